"""kvtool configuration: one validated model, settable from CLI flags, `KVTOOL_<FIELD>` environment
variables, a TOML file and sweep files (which wins, and the config file's places: `kvtool.config.settings`).

Every value goes through the same pydantic validators wherever it comes from, so the rules are
the same everywhere: sizes are integers or strings such as `"1GiB"`, `"512MB"`, `"512M"`
(`kvtool.units.parse_size`); durations are strings with their unit such as `"7d"`, `"12h"`,
`"1d12h"` (`kvtool.units.parse_duration`; a bare number is refused, except in a field named for
its unit: `ssd_ttl_days` (deprecated) and `ssd_flush_interval_s`); booleans are never numbers,
NaN and infinities are rejected, and every number is bounded. An invalid value raises
`ConfigError` naming the field.

Fields and defaults: docs/configuration.md; durability modes: docs/design.md#durability-modes.
"""

from __future__ import annotations

import difflib
import logging
import math
import os
import tomllib
from datetime import timedelta
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, ValidationInfo

from kvtool.config.remote_url import URL_ENV, RemoteURLError, parse_remote_url
from kvtool.errors import KVToolError
from kvtool.units import MAX_DURATION_S, parse_duration, parse_size, short_repr

# Chosen by measurement (bench_configs/block_size.py, docs/benchmarks.md#block-size): a request costs the
# cold load of its cached blocks (per-file cost grows as blocks shrink) plus ~block_size/2 tokens
# of re-prefill (the part of the block where the prompt diverges, or its tail). On this CPU
# (0.3-24 ms/token prefill) 64 tokens is at or near the minimum for every embedded preset.
DEFAULT_BLOCK_SIZE = 64
DEFAULT_RAM_BYTES = 1 << 30  # 1 GiB
DEFAULT_DIR_MODE = 0o700  # owner only; 0o2770 for a cache shared by a group
MAX_BLOCK_SIZE = 1 << 20
MAX_WRITER_QUEUE_SIZE = 1 << 20
MAX_RETRIES = 100
DEFAULT_TTL_S = 7 * 86400.0  # `kvtool prune`'s TTL when neither ssd_ttl nor ssd_ttl_days is set
_DEPRECATIONS_LOGGED: set[str] = set()  # config fields whose deprecation was logged (once per process)


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


class WriterMode(StrEnum):
    """Where SSD writes run (`ssd_async_writes`): inline or on a background thread."""

    SYNC = "sync"
    ASYNC = "async"


class RemotePolicy(StrEnum):
    """When blocks reach the remote tier (`remote_url`). Members compare equal to their string values."""

    OFF = "off"  # no remote tier, even with a remote_url
    WRITE_THROUGH = "write_through"  # new blocks go to the remote store as they are stored
    ON_EVICT = "on_evict"  # blocks go to the remote store when the RAM tier evicts them


SSD_POLICIES = tuple(p.value for p in SSDPolicy)
REMOTE_POLICIES = tuple(p.value for p in RemotePolicy)
DEFAULT_REMOTE_TIMEOUT = timedelta(milliseconds=250)
MAX_REMOTE_TIMEOUT_S = 60.0
DURABILITY_MODES = tuple(d.value for d in Durability)
WRITER_MODES = tuple(w.value for w in WriterMode)
CODECS = tuple(c.value for c in Codec)


class ConfigError(KVToolError, ValueError):
    """An invalid configuration value.

    Attributes:
        field: the offending field (`block_size`, `cache.ram_bytes`, `<file>` for the file itself).
        reason: the message without the `config field '...'` prefix.
    """

    def __init__(self, field_name: str, message: str, *, hint: str | None = None):
        """Create the error; `str(error)` is `config field '<field_name>': <message>`, or
        `config file <message>` for `<file>` (the message then starts with the path)."""
        prefix = "config file" if field_name == "<file>" else f"config field '{field_name}':"
        super().__init__(f"{prefix} {message}", hint=hint)
        self.field = field_name
        self.reason = message


# ----------------------------------------------------------------------------- validators
# Each takes the raw value (from TOML, a flag or Python) and returns the field's value or raises
# ValueError with a message that does not repeat the field name (the error's `field` gives it).


def _flag(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"must be true or false, got {short_repr(value)}")
    return value


def _int_between(low: int, high: int) -> BeforeValidator:
    def check(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"must be an integer, got {short_repr(value)}")
        if not low <= value <= high:
            raise ValueError(f"must be an integer from {low} to {high}, got {short_repr(value)}")
        return value

    return BeforeValidator(check)


def _duration_in(unit: str) -> BeforeValidator:
    """A duration > 0 held in `unit` (`d` or `s`): a number in that unit, or a string like `12h`."""
    unit_s = {"s": 1, "d": 86400}[unit]

    def check(value: Any) -> float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if (isinstance(value, float) and not math.isfinite(value)) or not 0 < value * unit_s <= MAX_DURATION_S:
                raise ValueError(f"must be a finite number > 0 (at most 100 years), got {short_repr(value)}")
            return float(value)
        if not isinstance(value, str):
            raise ValueError(f"must be a number or a duration like '7d', '12h', got {short_repr(value)}")
        seconds = parse_duration(value, default_unit=unit)
        if seconds <= 0:
            raise ValueError(f"must be > 0, got {short_repr(value)}")
        return seconds / unit_s

    return BeforeValidator(check)


def _ttl(value: Any, info: ValidationInfo) -> timedelta | None:
    """`ssd_ttl`: None (not set), a duration with its unit (`"7d"`, `"1d12h"`) or a `timedelta`;
    > 0 and at most 100 years. A bare number is refused (the message names the units)."""
    if value is None:
        return None
    seconds = value.total_seconds() if isinstance(value, timedelta) else parse_duration(value)
    if not 0 < seconds <= MAX_DURATION_S:
        raise ValueError(f"must be > 0 (at most 100 years), got {short_repr(value)}")
    if info.data.get("ssd_ttl_days") is not None:
        raise ValueError("set ssd_ttl or the deprecated ssd_ttl_days, not both")
    return timedelta(seconds=seconds)


def _ttl_days(value: Any) -> float | None:
    """The deprecated `ssd_ttl_days`: None (not set), days, or a duration string; logs the
    deprecation once per process."""
    if value is None:
        return None
    days = _duration_in("d").func(value)  # type: ignore[call-arg]
    if "ssd_ttl_days" not in _DEPRECATIONS_LOGGED:
        _DEPRECATIONS_LOGGED.add("ssd_ttl_days")
        logging.getLogger("kvtool.config").warning(
            "config field 'ssd_ttl_days' is deprecated: use ssd_ttl = \"%gd\" (a duration with its unit: 7d, 12h, 1d12h)", days)
    return float(days)


def _remote_url(value: Any) -> str | None:
    """`remote_url`: None (no remote tier) or a URL `kvtool.config.remote_url.parse_remote_url`
    accepts. The error shows the URL with its password masked."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise ValueError(f"must be a URL such as redis://host:6379/0, got a {type(value).__name__}")
    try:
        parse_remote_url(value)
    except RemoteURLError as exc:
        raise ValueError(exc.message) from None
    return value


def _remote_url_default() -> str | None:
    """`$KVTOOL_REMOTE_URL`, if set and not empty."""
    return os.environ.get(URL_ENV) or None


def _remote_timeout(value: Any) -> timedelta:
    """`remote_timeout`: a duration with its unit (`"250ms"`, `"1s"`) or a `timedelta`, from
    1 ms to 60 s. A bare number is refused, as for every duration."""
    if (isinstance(value, (int, float)) and not isinstance(value, bool)) or (isinstance(value, str) and value.strip().replace(".", "", 1).isdigit()):
        raise ValueError(f"{short_repr(value)} has no unit: write e.g. 250ms or 0.25s")
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, str) and value.strip().lower().endswith("ms") and value.strip()[:-2].strip():
        number = value.strip()[:-2].strip()
        try:
            seconds = float(number) / 1000 if number.replace(".", "", 1).isdigit() else -1.0
        except ValueError:
            seconds = -1.0
        if seconds < 0:
            raise ValueError(f"not a duration: {short_repr(value)} (examples: 250ms, 1s)")
    else:
        seconds = parse_duration(value)
    if not 0.001 <= seconds <= MAX_REMOTE_TIMEOUT_S:
        raise ValueError(f"must be from 1ms to {MAX_REMOTE_TIMEOUT_S:g}s, got {short_repr(value)}")
    return timedelta(seconds=seconds)


def _remote_ttl(value: Any) -> timedelta | None:
    """`remote_ttl`: None (values never expire: the server's eviction or `kvtool remote prune`
    removes them), a duration with its unit (`"7d"`, `"12h"`) or a `timedelta`; from 1 s to 68
    years (Redis' `EX` takes whole seconds, up to 2**31)."""
    if value is None:
        return None
    seconds = value.total_seconds() if isinstance(value, timedelta) else parse_duration(value)
    if not 1 <= seconds < 2**31:
        raise ValueError(f"must be from 1s to 68 years, got {short_repr(value)}")
    return timedelta(seconds=seconds)


def _optional_size(value: Any) -> int | None:
    """`ssd_max_bytes`: None (no budget) or a size: bytes, or a string with its unit (`"50GB"`,
    `"512MiB"`; `kvtool.units.parse_size`)."""
    return None if value is None else parse_size(value)


def _choice(enum_cls: type[StrEnum]) -> BeforeValidator:
    values = [m.value for m in enum_cls]
    choices = ", ".join(values)

    def check(value: Any) -> StrEnum:
        if isinstance(value, str) and value in values:
            return enum_cls(value)
        raise ValueError(f"must be one of {choices}, got {short_repr(value)}")

    return BeforeValidator(check)


def _directory(value: Any) -> Path:
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str):
        raise ValueError(f"must be a directory path (a string), got {short_repr(value)}")
    if not value.strip():
        raise ValueError("must not be empty")
    if "\0" in value:
        raise ValueError("must not contain a NUL character")
    return expand_path(value)


def _dir_mode(value: Any) -> int:
    if isinstance(value, str):
        text = value.strip().lower().removeprefix("0o")
        if not text or not set(text) <= set("01234567") or len(text) > 6:
            raise ValueError(f"must be an octal mode like 0o700 or '2770', got {short_repr(value)}")
        value = int(text, 8)
    elif isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"must be an octal mode like 0o700, got {short_repr(value)}")
    if not 0 <= value <= 0o7777:
        raise ValueError("must be an octal mode from 0o0 to 0o7777")
    if value & 0o700 != 0o700:
        raise ValueError(f"must give the owner read, write and search (0o700), got {oct(value)}")
    if value & 0o002:  # anyone could plant files in the cache (docs/design.md#threat-model)
        raise ValueError(f"must not let other users write (0o002), got {oct(value)}; use 0o700, or 0o2770 for a group")
    if value & 0o020 and not value & 0o2000:
        raise ValueError(f"group write (0o020) needs the setgid bit (0o2000: a group-shared cache, e.g. 0o2770), got {oct(value)}")
    return value


def expand_path(text: str) -> Path:
    """`Path(text)` with `~` / `~user` expanded.

    Raises:
        ValueError: the user does not exist or the home directory is unknown.
    """
    try:
        return Path(text).expanduser()
    except RuntimeError:
        head = text.split("/", 1)[0]
        raise ValueError(f"cannot expand {short_repr(head)}: no such user or no home directory") from None


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
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg and os.path.isabs(xdg):  # the XDG spec: a relative value is invalid and ignored
        return Path(xdg) / "kvtool"
    try:
        return Path.home() / ".cache" / "kvtool"
    except RuntimeError:
        raise ConfigError(
            "ssd_cache_dir", "no home directory to put the cache in", hint="set $KVTOOL_CACHE_DIR or pass --cache-dir"
        ) from None


# ----------------------------------------------------------------------------- the model
Flag = Annotated[bool, BeforeValidator(_flag)]


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
        ssd_policy: `write_through` (new blocks go to RAM and SSD) or `evict_only`
            (write-back: blocks reach SSD only when RAM evicts them). An `SSDPolicy`.
        ssd_durability: `best_effort` (one attempt), `persistent` (retries) or `durable`
            (fsync file + directory before the index row commits, SQLite synchronous=FULL).
            A `Durability`.
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
        ssd_codec: `none` (records stored as they are, the default), or `zstd` / `lz4`: every
            record compressed losslessly (opt-in; a separate namespace, since the codec is part
            of the layout key). A `Codec`.
        remote_url: the remote tier's Redis / Valkey server (`redis://`, `rediss://`,
            `unix://`, `redis+cluster://`; `kvtool.config.remote_url`), default
            `$KVTOOL_REMOTE_URL`; None: no remote tier. The password may come from
            `$KVTOOL_REMOTE_PASSWORD` instead. Hidden from `repr`; show it with `mask_url`.
        remote_policy: `off`, `write_through` (new blocks go to the remote store too, the
            default) or `on_evict` (blocks go there when RAM evicts them). A `RemotePolicy`;
            the tier is used when `remote_url` is set and this is not `off`.
        remote_promote: a remote hit is also written to the local SSD tier (from the request's
            cache when the request is released; it enters RAM either way, as SSD hits do).
        remote_ttl: expiry of the values kvtool stores (a duration such as `"7d"`, held as a
            `timedelta`); None (the default): no expiry.
        remote_timeout: deadline of every remote socket operation (`"250ms"`, `"1s"`; a
            `timedelta`, 250 ms by default). A slower server is a miss, never a slower request.
        remote_cluster: the server is a Redis Cluster (also implied by `redis+cluster://`).
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True, validate_default=True)

    ssd_enabled: Flag = True
    ssd_cache_dir: Annotated[Path, BeforeValidator(_directory)] = Field(default_factory=default_cache_dir)
    ssd_ttl_days: Annotated[float | None, BeforeValidator(_ttl_days)] = None
    ssd_ttl: Annotated[timedelta | None, BeforeValidator(_ttl)] = None  # after ssd_ttl_days: it checks both
    ssd_policy: Annotated[SSDPolicy, _choice(SSDPolicy)] = SSDPolicy.WRITE_THROUGH
    ssd_durability: Annotated[Durability, _choice(Durability)] = Durability.BEST_EFFORT
    ssd_async_writes: Flag = True
    ssd_writer_queue_size: Annotated[int, _int_between(1, MAX_WRITER_QUEUE_SIZE)] = 512
    ssd_flush_interval_s: Annotated[float, _duration_in("s")] = 1.0
    ssd_persistent_max_retries: Annotated[int, _int_between(0, MAX_RETRIES)] = 3
    block_size: Annotated[int, _int_between(1, MAX_BLOCK_SIZE)] = DEFAULT_BLOCK_SIZE
    ram_bytes: Annotated[int, BeforeValidator(parse_size)] = DEFAULT_RAM_BYTES  # no bools, floats, < 0
    ssd_dir_mode: Annotated[int, BeforeValidator(_dir_mode)] = DEFAULT_DIR_MODE
    ssd_codec: Annotated[Codec, _choice(Codec)] = Codec.NONE
    ssd_max_bytes: Annotated[int | None, BeforeValidator(_optional_size)] = None
    remote_url: Annotated[str | None, BeforeValidator(_remote_url)] = Field(default_factory=_remote_url_default, repr=False)
    remote_policy: Annotated[RemotePolicy, _choice(RemotePolicy)] = RemotePolicy.WRITE_THROUGH
    remote_promote: Flag = True
    remote_ttl: Annotated[timedelta | None, BeforeValidator(_remote_ttl)] = None
    remote_timeout: Annotated[timedelta, BeforeValidator(_remote_timeout)] = DEFAULT_REMOTE_TIMEOUT
    remote_cluster: Flag = False

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
    """Build a config from an optional TOML file, then overrides (None = not given; they win).
    The environment and the default config file are not read here (the CLI layers them:
    `kvtool.config.settings.resolve_settings`).

    Args:
        path: TOML file with the fields at top level or under a `[kvtool]` table.
        **overrides: field values, typically from CLI flags.

    Raises:
        ConfigError: unknown field, wrong type or invalid value (the message names the field),
            or a file that cannot be read as TOML.
        FileNotFoundError: `path` does not exist.
    """
    values = read_config_file(path) if path is not None else {}
    values.update({k: v for k, v in overrides.items() if v is not None})
    return KVToolConfig(**values)

