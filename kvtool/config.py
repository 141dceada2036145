"""kvtool configuration: one dataclass, settable from CLI flags and a TOML file.

The SSD fields follow seed 000 ("SSD Write-Through Cache Plan", Config section); `block_size`,
`ram_bytes` and the `durable` durability mode are kvtool's own additions.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SSD_POLICIES = ("evict_only", "write_through")
DURABILITY_MODES = ("best_effort", "persistent", "durable")

# Chosen by measurement (bench_configs/block_size.py, README "Block size"): a request costs the
# cold load of its cached blocks (per-file cost grows as blocks shrink) plus ~block_size/2 tokens
# of re-prefill (the part of the block where the prompt diverges, or its tail). On this CPU
# (0.3-24 ms/token prefill) 64 tokens is at or near the minimum for every embedded preset.
DEFAULT_BLOCK_SIZE = 64
DEFAULT_RAM_BYTES = 1 << 30  # 1 GiB


class ConfigError(ValueError):
    """An invalid configuration value. `field` names the offending field."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"config field '{field_name}': {message}")
        self.field = field_name


def default_cache_dir() -> Path:
    """`$KVTOOL_CACHE_DIR`, else `~/.cache/kvtool`."""
    env = os.environ.get("KVTOOL_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kvtool"


@dataclass
class KVToolConfig:
    """Settings of the tiered KV cache.

    Attributes:
        ssd_enabled: use the SSD tier at all.
        ssd_cache_dir: root of the SSD tier; one sub-directory per namespace (layout key).
        ssd_ttl_days: default TTL used by `kvtool prune` when no `--ttl` is given (days).
        ssd_policy: `write_through` (new blocks go to RAM and SSD) or `evict_only`
            (write-back: blocks reach SSD only when RAM evicts them).
        ssd_durability: `best_effort` (one attempt), `persistent` (retries) or `durable`
            (fsync file + directory before the index row commits, SQLite synchronous=FULL).
        ssd_async_writes: write SSD blocks from a background writer thread.
        ssd_writer_queue_size: bound of the writer queue (blocks).
        ssd_flush_interval_s: max delay of batched index access-time updates (seconds).
        ssd_persistent_max_retries: retries of a failed write under `persistent`.
        block_size: tokens per cached block; only full blocks are cached.
        ram_bytes: byte budget of the RAM tier (sum of block `nbytes`).
    """

    ssd_enabled: bool = True
    ssd_cache_dir: Path = field(default_factory=default_cache_dir)
    ssd_ttl_days: float = 7.0
    ssd_policy: str = "write_through"
    ssd_durability: str = "best_effort"
    ssd_async_writes: bool = True
    ssd_writer_queue_size: int = 512
    ssd_flush_interval_s: float = 1.0
    ssd_persistent_max_retries: int = 3
    block_size: int = DEFAULT_BLOCK_SIZE
    ram_bytes: int = DEFAULT_RAM_BYTES

    def __post_init__(self) -> None:
        self.ssd_cache_dir = Path(self.ssd_cache_dir).expanduser()
        self.validate()

    def validate(self) -> None:
        """Check every field; raise `ConfigError` naming the first bad one."""
        if self.ssd_policy not in SSD_POLICIES:
            raise ConfigError("ssd_policy", f"must be one of {', '.join(SSD_POLICIES)}, got {self.ssd_policy!r}")
        if self.ssd_durability not in DURABILITY_MODES:
            raise ConfigError(
                "ssd_durability", f"must be one of {', '.join(DURABILITY_MODES)}, got {self.ssd_durability!r}"
            )
        _positive_int(self, "block_size")
        _positive_int(self, "ssd_writer_queue_size")
        if not isinstance(self.ram_bytes, int) or self.ram_bytes < 0:
            raise ConfigError("ram_bytes", f"must be an integer >= 0, got {self.ram_bytes!r}")
        if not isinstance(self.ssd_persistent_max_retries, int) or self.ssd_persistent_max_retries < 0:
            raise ConfigError("ssd_persistent_max_retries", "must be an integer >= 0")
        for name in ("ssd_ttl_days", "ssd_flush_interval_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value <= 0:
                raise ConfigError(name, f"must be a number > 0, got {value!r}")
        for name in ("ssd_enabled", "ssd_async_writes"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(name, "must be true or false")

    def replace(self, **changes: Any) -> "KVToolConfig":
        """A copy with `changes` applied (validated)."""
        return dataclasses.replace(self, **changes)


def _positive_int(cfg: KVToolConfig, name: str) -> None:
    value = getattr(cfg, name)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(name, f"must be an integer > 0, got {value!r}")


FIELD_NAMES = tuple(f.name for f in dataclasses.fields(KVToolConfig))


def load_config(path: Path | None = None, **overrides: Any) -> KVToolConfig:
    """Build a config from an optional TOML file, then CLI overrides (None = not given).

    The TOML may hold the fields at top level or under a `[kvtool]` table.

    Raises:
        ConfigError: unknown field, wrong type or invalid value (the message names the field).
        FileNotFoundError: `path` does not exist.
    """
    values: dict[str, Any] = {}
    if path is not None:
        with open(path, "rb") as fh:
            try:
                data = tomllib.load(fh)
            except tomllib.TOMLDecodeError as exc:
                raise ConfigError("<file>", f"{path}: invalid TOML: {exc}") from None
        data = data.get("kvtool", data)
        for key, value in data.items():
            if key not in FIELD_NAMES:
                raise ConfigError(key, f"unknown field in {path}")
            values[key] = value
    values.update({k: v for k, v in overrides.items() if v is not None})
    return KVToolConfig(**values)
