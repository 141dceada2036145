"""The validators of `KVToolConfig`'s fields (pydantic `BeforeValidator`s and the functions behind them).

Each takes the raw value (from TOML, a flag or Python) and returns the field's value or raises
ValueError with a message that does not repeat the field name (the `ConfigError` names it).
"""

from __future__ import annotations

import logging
import math
import os
import re
from datetime import timedelta
from enum import StrEnum
from pathlib import Path
from typing import Any

from pydantic import BeforeValidator, ValidationInfo

from kvtool.config.remote_url import URL_ENV, RemoteURLError, parse_remote_url
from kvtool.units import MAX_DURATION_S, parse_duration, parse_size, short_repr

MAX_REMOTE_TIMEOUT_S = 60.0
_MILLISECONDS = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*ms", re.IGNORECASE)
_DEPRECATIONS_LOGGED: set[str] = set()  # config fields whose deprecation was logged (once per process)


def flag(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"must be true or false, got {short_repr(value)}")
    return value


def int_between(low: int, high: int) -> BeforeValidator:
    def check(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"must be an integer, got {short_repr(value)}")
        if not low <= value <= high:
            raise ValueError(f"must be an integer from {low} to {high}, got {short_repr(value)}")
        return value

    return BeforeValidator(check)


def duration_in(unit: str) -> BeforeValidator:
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


def ttl(value: Any, info: ValidationInfo) -> timedelta | None:
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


def ttl_days(value: Any) -> float | None:
    """The deprecated `ssd_ttl_days`: None (not set), days, or a duration string; logs the
    deprecation once per process."""
    if value is None:
        return None
    days = duration_in("d").func(value)  # type: ignore[call-arg]
    if "ssd_ttl_days" not in _DEPRECATIONS_LOGGED:
        _DEPRECATIONS_LOGGED.add("ssd_ttl_days")
        logging.getLogger("kvtool.config").warning(
            "config field 'ssd_ttl_days' is deprecated: use ssd_ttl = \"%gd\" (a duration with its unit: 7d, 12h, 1d12h)", days)
    return float(days)


def remote_url(value: Any) -> str | None:
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


def remote_url_default() -> str | None:
    """`$KVTOOL_REMOTE_URL`, if set and not empty."""
    return os.environ.get(URL_ENV) or None


def remote_timeout(value: Any) -> timedelta:
    """`remote_timeout`: a duration with its unit (`"250ms"`, `"1s"`) or a `timedelta`, from
    1 ms to 60 s. A bare number is refused, as for every duration."""
    if (isinstance(value, (int, float)) and not isinstance(value, bool)) or (isinstance(value, str) and value.strip().replace(".", "", 1).isdigit()):
        raise ValueError(f"{short_repr(value)} has no unit: write e.g. 250ms or 0.25s")
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, str) and value.strip().lower().endswith("ms") and value.strip()[:-2].strip():
        if (ms := _MILLISECONDS.fullmatch(value.strip())) is None:
            raise ValueError(f"not a duration: {short_repr(value)} (examples: 250ms, 1s)")
        seconds = float(ms.group(1)) / 1000
    else:
        seconds = parse_duration(value)
    if not 0.001 <= seconds <= MAX_REMOTE_TIMEOUT_S:
        raise ValueError(f"must be from 1ms to {MAX_REMOTE_TIMEOUT_S:g}s, got {short_repr(value)}")
    return timedelta(seconds=seconds)


def remote_ttl(value: Any) -> timedelta | None:
    """`remote_ttl`: None (values never expire: the server's eviction or `kvtool remote prune`
    removes them), a duration with its unit (`"7d"`, `"12h"`) or a `timedelta`; from 1 s to 68
    years (Redis' `EX` takes whole seconds, up to 2**31)."""
    if value is None:
        return None
    seconds = value.total_seconds() if isinstance(value, timedelta) else parse_duration(value)
    if not 1 <= seconds < 2**31:
        raise ValueError(f"must be from 1s to 68 years, got {short_repr(value)}")
    return timedelta(seconds=seconds)


def optional_size(value: Any) -> int | None:
    """`ssd_max_bytes`: None (no budget) or a size: bytes, or a string with its unit (`"50GB"`,
    `"512MiB"`; `kvtool.units.parse_size`)."""
    return None if value is None else parse_size(value)


def choice(enum_cls: type[StrEnum]) -> BeforeValidator:
    values = [m.value for m in enum_cls]
    choices = ", ".join(values)

    def check(value: Any) -> StrEnum:
        if isinstance(value, str) and value in values:
            return enum_cls(value)
        raise ValueError(f"must be one of {choices}, got {short_repr(value)}")

    return BeforeValidator(check)


def directory(value: Any) -> Path:
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str):
        raise ValueError(f"must be a directory path (a string), got {short_repr(value)}")
    if not value.strip():
        raise ValueError("must not be empty")
    if "\0" in value:
        raise ValueError("must not contain a NUL character")
    return expand_path(value)


def dir_mode(value: Any) -> int:
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


def xdg_dir(variable: str, default: str) -> Path | None:
    """`$<variable>/kvtool` if that variable is absolute (the XDG spec ignores a relative one),
    else `~/<default>/kvtool`; None without a home directory."""
    xdg = os.environ.get(variable)
    if xdg and os.path.isabs(xdg):
        return Path(xdg) / "kvtool"
    try:
        return Path.home() / default / "kvtool"
    except RuntimeError:
        return None
