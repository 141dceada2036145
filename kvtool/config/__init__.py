"""kvtool configuration: one validated model (`KVToolConfig`), set from CLI flags, `KVTOOL_<FIELD>`
environment variables, a TOML file and sweep files (which wins, and the config file's places:
`kvtool.config.settings`).

Every value goes through the same pydantic validators (`kvtool.config.validators`) wherever it
comes from, so `"1GiB"` or `"12h"` means the same everywhere (a bare number is a duration only in
a field named for its unit: `ssd_ttl_days`, `ssd_flush_interval_s`); an invalid value raises
`ConfigError` naming the field. Fields, defaults and the rules of values: docs/configuration.md;
durability modes: docs/design.md#durability-modes.
"""

from __future__ import annotations

import difflib
import os
import tomllib
from datetime import timedelta
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from kvtool.config import validators as v
from kvtool.config.validators import expand_path
from kvtool.errors import KVToolError
from kvtool.units import parse_size, short_repr

DEFAULT_BLOCK_SIZE = 64  # chosen by measurement: docs/benchmarks.md#block-size
DEFAULT_RAM_BYTES = 1 << 30  # 1 GiB
DEFAULT_DIR_MODE = 0o700  # owner only; 0o2770 for a cache shared by a group
MAX_BLOCK_SIZE = 1 << 20
MAX_WRITER_QUEUE_SIZE = 1 << 20
MAX_RETRIES = 100
DEFAULT_TTL_S = 7 * 86400.0  # `kvtool prune`'s TTL when neither ssd_ttl nor ssd_ttl_days is set


class SSDPolicy(StrEnum):
    """When blocks reach the SSD tier. Members compare equal to their string values."""

    EVICT_ONLY = "evict_only"  # write-back: blocks reach SSD only when RAM evicts them
    WRITE_THROUGH = "write_through"  # new blocks go to RAM and SSD


class Durability(StrEnum):
    """How hard the SSD writer tries. Members compare equal to their string values."""

    BEST_EFFORT = "best_effort"  # one attempt
    PERSISTENT = "persistent"  # retries
    DURABLE = "durable"  # fsync file + directory before the index row commits


class Codec(StrEnum):
    """How SSD block records are stored (`ssd_codec`): as they are, or losslessly compressed."""

    NONE = "none"
    ZSTD = "zstd"  # zstandard level 3: ~1.1x (f32) / ~1.4x (bf16) on KV, ~0.5 GB/s in, ~1 GB/s out
    LZ4 = "lz4"  # lz4 block: ~1.07x / ~1.09x, ~2-3 GB/s in, ~7-10 GB/s out


class RemotePolicy(StrEnum):
    """When blocks reach the remote tier (`remote_url`). Members compare equal to their string values."""

    OFF = "off"  # no remote tier, even with a remote_url
    WRITE_THROUGH = "write_through"  # new blocks go to the remote store as they are stored
    ON_EVICT = "on_evict"  # blocks go to the remote store when the RAM tier evicts them


DEFAULT_REMOTE_TIMEOUT = timedelta(milliseconds=250)
DURABILITY_MODES = tuple(d.value for d in Durability)  # (the SSD writer checks its mode against them)


class ConfigError(KVToolError, ValueError):
    """An invalid configuration value.

    Attributes:
        field: the offending field (`block_size`, `cache.ram_bytes`, `<file>` for the file itself).
        reason: the message without the `config field '...'` prefix.
    """

    def __init__(self, field_name: str, message: str, *, hint: str | None = None):
        """`str(error)` is `config field '<field_name>': <message>`, or `config file <message>` for
        `<file>` (the message then starts with the path)."""
        prefix = "config file" if field_name == "<file>" else f"config field '{field_name}':"
        super().__init__(f"{prefix} {message}", hint=hint)
        self.field = field_name
        self.reason = message


def default_cache_dir() -> Path:
    """`$KVTOOL_CACHE_DIR`, else `$XDG_CACHE_HOME/kvtool` (if absolute), else `~/.cache/kvtool`.

    Raises:
        ConfigError: `$KVTOOL_CACHE_DIR` cannot be expanded, or there is no home directory.
    """
    env = os.environ.get("KVTOOL_CACHE_DIR")
    if env:
        try:
            return expand_path(env)
        except ValueError as exc:
            raise ConfigError("ssd_cache_dir", f"$KVTOOL_CACHE_DIR: {exc}") from None
    path = v.xdg_dir("XDG_CACHE_HOME", ".cache")
    if path is None:
        raise ConfigError("ssd_cache_dir", "no home directory to put the cache in",
                          hint="set $KVTOOL_CACHE_DIR or pass --cache-dir")
    return path


# ----------------------------------------------------------------------------- the model
Flag = Annotated[bool, BeforeValidator(v.flag)]


class KVToolConfig(BaseModel):
    """Settings of the tiered KV cache (validated on construction, assignment and `replace`).

    Attributes:
        ssd_enabled: use the SSD tier at all.
        ssd_cache_dir: root of the SSD tier; one sub-directory per namespace (layout key).
            A string or path; `~` is expanded; empty is an error.
        ssd_ttl_days: deprecated (use `ssd_ttl`): the same TTL in days, or a duration string;
            None when not set. Setting it logs a deprecation warning once.
        ssd_ttl: default TTL used by `kvtool prune` when no `--ttl` is given: a duration with
            its unit (`"7d"`, `"12h"`, `"1d12h"`) or a `timedelta`; held as a `timedelta`, None
            when not set (`ttl_s` gives the TTL in effect, 7 days by default).
        ssd_policy: when blocks reach SSD: `write_through` or `evict_only` (`SSDPolicy`).
        ssd_durability: `best_effort`, `persistent` or `durable` (`Durability`; `durable` also
            runs SQLite with synchronous=FULL).
        ssd_async_writes: write SSD blocks from a background writer thread.
        ssd_writer_queue_size: bound of the writer queue (blocks).
        ssd_flush_interval_s: max delay of batched index access-time updates: seconds, or a
            duration string.
        ssd_persistent_max_retries: retries of a failed write under `persistent`.
        block_size: tokens per cached block; only full blocks are cached.
        ram_bytes: byte budget of the RAM tier (sum of block `nbytes`): an integer or a size
            string (`"512MiB"`, `"1GB"`).
        ssd_dir_mode: permission bits of the directories kvtool creates in the cache, applied
            whatever the umask. 0o700 (owner only) by default; use 0o2770 for a cache shared by
            a group (setgid keeps the group on new directories). TOML: `0o2770` or `"2770"`.
            Other-write (0o002) is refused, and group write (0o020) without setgid too.
        ssd_max_bytes: the SSD tier's byte budget per namespace, enforced while serving: before a
            segment that would not fit is written, the least recently used segments are evicted
            (`kvtool.disk.budget`; the directory as `du` counts it: segment files, index,
            directories); None (the default): no budget (`kvtool prune` trims from cron).
        ssd_codec: `none` (the default), `zstd` or `lz4` (`Codec`; a separate namespace, since the
            codec is part of the layout key).
        remote_url: the remote tier's Redis / Valkey server (`redis://`, `rediss://`,
            `unix://`, `redis+cluster://`; `kvtool.config.remote_url`), default
            `$KVTOOL_REMOTE_URL`; None: no remote tier. The password may come from
            `$KVTOOL_REMOTE_PASSWORD` instead. Hidden from `repr`; show it with `mask_url`.
        remote_policy: `off`, `write_through` (the default) or `on_evict` (`RemotePolicy`); the
            tier is used when `remote_url` is set and this is not `off`.
        remote_promote: a remote hit is also written to the local SSD tier (from the request's
            cache when the request is released; it enters RAM either way, as SSD hits do).
        remote_ttl: expiry of the values kvtool stores (a duration such as `"7d"`, held as a
            `timedelta`); None (the default): no expiry.
        remote_timeout: deadline of every remote socket operation (`"250ms"`, `"1s"`; a
            `timedelta`, 250 ms by default). A slower server is a miss, never a slower request.
        remote_cluster: the server is a Redis Cluster (also implied by `redis+cluster://`).
        reply_cache: `kvtool serve` also stores the KV of a finished request's generated tokens
            (its reply, re-sent in an agent's next turn), where the reply probe measured decode
            KV bit-identical to prefill KV for the model and device (`kvtool.cache.reply`).
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True, validate_default=True)

    ssd_enabled: Flag = True
    ssd_cache_dir: Annotated[Path, BeforeValidator(v.directory)] = Field(default_factory=default_cache_dir)
    ssd_ttl_days: Annotated[float | None, BeforeValidator(v.ttl_days)] = None
    ssd_ttl: Annotated[timedelta | None, BeforeValidator(v.ttl)] = None  # after ssd_ttl_days: it checks both
    ssd_policy: Annotated[SSDPolicy, v.choice(SSDPolicy)] = SSDPolicy.WRITE_THROUGH
    ssd_durability: Annotated[Durability, v.choice(Durability)] = Durability.BEST_EFFORT
    ssd_async_writes: Flag = True
    ssd_writer_queue_size: Annotated[int, v.int_between(1, MAX_WRITER_QUEUE_SIZE)] = 512
    ssd_flush_interval_s: Annotated[float, v.duration_in("s")] = 1.0
    ssd_persistent_max_retries: Annotated[int, v.int_between(0, MAX_RETRIES)] = 3
    block_size: Annotated[int, v.int_between(1, MAX_BLOCK_SIZE)] = DEFAULT_BLOCK_SIZE
    ram_bytes: Annotated[int, BeforeValidator(parse_size)] = DEFAULT_RAM_BYTES  # no bools, floats, < 0
    ssd_dir_mode: Annotated[int, BeforeValidator(v.dir_mode)] = DEFAULT_DIR_MODE
    ssd_codec: Annotated[Codec, v.choice(Codec)] = Codec.NONE
    ssd_max_bytes: Annotated[int | None, BeforeValidator(v.optional_size)] = None
    remote_url: Annotated[str | None, BeforeValidator(v.remote_url)] = Field(default_factory=v.remote_url_default, repr=False)
    remote_policy: Annotated[RemotePolicy, v.choice(RemotePolicy)] = RemotePolicy.WRITE_THROUGH
    remote_promote: Flag = True
    remote_ttl: Annotated[timedelta | None, BeforeValidator(v.remote_ttl)] = None
    remote_timeout: Annotated[timedelta, BeforeValidator(v.remote_timeout)] = DEFAULT_REMOTE_TIMEOUT
    remote_cluster: Flag = False
    reply_cache: Flag = True

    def __init__(self, **values: Any) -> None:
        """Validate `values` (field names as keywords; omitted fields take their defaults).

        Raises:
            ConfigError: the first unknown field or invalid value, named.
        """
        try:
            super().__init__(**values)
        except ValidationError as exc:
            raise _config_error(exc) from None

    def __setattr__(self, name: str, value: Any) -> None:
        try:
            super().__setattr__(name, value)
        except ValidationError as exc:
            raise _config_error(exc) from None

    def replace(self, **changes: Any) -> KVToolConfig:
        """A copy with `changes` applied (validated).

        Raises:
            ConfigError: an unknown field or invalid value in `changes`.
        """
        return type(self)(**{**{name: getattr(self, name) for name in FIELD_NAMES}, **changes})

    @property
    def ttl_s(self) -> float:
        """`kvtool prune`'s default TTL in seconds: `ssd_ttl`, else `ssd_ttl_days` (deprecated),
        else 7 days."""
        if self.ssd_ttl is not None:
            return self.ssd_ttl.total_seconds()
        return self.ssd_ttl_days * 86400.0 if self.ssd_ttl_days is not None else DEFAULT_TTL_S

    @property
    def remote_enabled(self) -> bool:
        """A remote tier is configured: `remote_url` set and `remote_policy` not `off`."""
        return self.remote_url is not None and self.remote_policy != RemotePolicy.OFF

    @property
    def remote_timeout_s(self) -> float:
        """`remote_timeout` in seconds."""
        return self.remote_timeout.total_seconds()

    @property
    def remote_ttl_s(self) -> float | None:
        """`remote_ttl` in seconds, None for no expiry."""
        return None if self.remote_ttl is None else self.remote_ttl.total_seconds()


FIELD_NAMES: tuple[str, ...] = tuple(KVToolConfig.model_fields)


def _did_you_mean(name: str) -> str | None:
    close = difflib.get_close_matches(name, FIELD_NAMES, n=1)
    return f"did you mean '{close[0]}'?" if close else None


def _config_error(exc: ValidationError) -> ConfigError:
    """The first error of a pydantic `ValidationError` as a `ConfigError` naming its field."""
    err = exc.errors(include_url=False)[0]
    name = ".".join(str(part) for part in err["loc"]) or "<config>"
    if err["type"] == "extra_forbidden":
        return ConfigError(name, "unknown field", hint=_did_you_mean(name))
    cause = err.get("ctx", {}).get("error")
    return ConfigError(name, str(cause) if isinstance(cause, ValueError) else err["msg"])


# ----------------------------------------------------------------------------- files
def read_config_file(path: Path | str) -> dict[str, Any]:
    """The config fields of a TOML file (top level, or the `[kvtool]` table if there is one).

    Raises:
        FileNotFoundError: `path` does not exist.
        ConfigError: unreadable, not UTF-8, not TOML, `kvtool` not a table, or an unknown field.
    """
    try:
        raw = Path(path).read_bytes()
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise ConfigError("<file>", f"{path}: cannot read: {exc.strerror or exc}") from None
    data = parse_toml(raw, path)
    if "kvtool" in data:
        data = data["kvtool"]
        if not isinstance(data, dict):
            raise ConfigError("kvtool", f"{path}: must be a [kvtool] table of config fields, got {short_repr(data)}")
    for key in data:
        if key not in FIELD_NAMES:
            raise ConfigError(key, f"unknown field in {path}", hint=_did_you_mean(key))
    return dict(data)


def parse_toml(raw: bytes, path: Path | str) -> dict[str, Any]:
    """Decode `raw` (UTF-8) and parse it as TOML; every failure is a `ConfigError` naming `path`.

    Raises:
        ConfigError: not UTF-8 (e.g. a binary file), invalid TOML, or nested too deeply.
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError("<file>", f"{path}: not a UTF-8 text file (bad byte at offset {exc.start})") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("<file>", f"{path}: invalid TOML: {exc}") from None
    except RecursionError:
        raise ConfigError("<file>", f"{path}: invalid TOML: nested too deeply") from None


def load_config(path: Path | str | None = None, **overrides: Any) -> KVToolConfig:
    """A config from an optional TOML file (`read_config_file`), then `overrides` (field values;
    None: not given). The environment and the default config file are not read here (the CLI
    layers them: `kvtool.config.settings.resolve_settings`).

    Raises:
        ConfigError: unknown field, invalid value (named), or a file that cannot be read as TOML.
        FileNotFoundError: `path` does not exist.
    """
    values = read_config_file(path) if path is not None else {}
    values.update({k: v for k, v in overrides.items() if v is not None})
    return KVToolConfig(**values)

