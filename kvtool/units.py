"""Human sizes and durations: `50GB`, `512MiB`, `7d`, `12h`, `30m`, `1d12h`.

One parser each, used by every flag, config file and sweep file, so the same text means the same
thing everywhere. Arithmetic is exact (no float overflow on a 400-digit number) and results are
bounded: a size fits a signed 64-bit integer, a duration is at most 100 years.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

MAX_BYTES = 2**63 - 1  # fits SQLite INTEGER, numpy int64 and pandas columns
MAX_DURATION_S = 100 * 365 * 86400  # 100 years
_MAX_DIGITS = 40  # a longer number is too large for either bound anyway

_SIZE_UNITS = {"": 1, "b": 1} | {  # kb, mb, gb, tb: decimal; kib ... tib and k ... t: binary
    unit: base**power
    for power, prefix in enumerate("kmgt", start=1)
    for unit, base in ((f"{prefix}b", 1000), (f"{prefix}ib", 1024), (prefix, 1024))
}
_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_UNIT_NAMES = (("d", "days"), ("h", "hours"), ("m", "minutes"), ("s", "seconds"))
_NUMBER_UNIT = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)")
_BARE_NUMBER = re.compile(r"\d+(?:\.\d*)?|\.\d+")
_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]+)\s*")  # one `12h ` of `1d 12h`
SIZE_EXAMPLES = "examples: 50GB, 512MiB, 512M, 1048576"
DURATION_EXAMPLES = "examples: 7d, 12h, 30m, 45s, 1d12h"


def short_repr(value: object, limit: int = 40) -> str:
    """`repr(value)`, cut to `limit` characters (error messages must stay one short line)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def parse_size(text: str | int) -> int:
    """Bytes from `1234`, `50GB` (decimal), `512MiB` / `512M` (binary). Case-insensitive.

    Args:
        text: a size string, or an integer number of bytes (booleans are not numbers).

    A count of bytes (no unit, or `B`) must be whole: `1.5` is refused. With a larger unit a
    decimal is rounded down to whole bytes: `1.5KiB` is 1536, `0.1MiB` is 104857.

    Returns:
        The size in bytes, `0 <= size <= MAX_BYTES`.

    Raises:
        ValueError: not a size, a fractional count of bytes, negative, or larger than `MAX_BYTES`.
    """
    if isinstance(text, bool) or not isinstance(text, (int, str)):
        raise ValueError(f"not a size: {short_repr(text)} ({SIZE_EXAMPLES})")
    if isinstance(text, int):
        number, unit = Fraction(text), ""
    else:
        number, unit = _number_and_unit(text, "size", SIZE_EXAMPLES)
        if unit not in _SIZE_UNITS:
            raise ValueError(f"not a size: {short_repr(text)} ({SIZE_EXAMPLES})")
        if _SIZE_UNITS[unit] == 1 and number.denominator != 1:
            raise ValueError(f"{short_repr(text)} is not a whole number of bytes: give bytes as an integer, or a "
                             f"unit ({SIZE_EXAMPLES})")
    size = number * _SIZE_UNITS[unit]
    if size < 0:
        raise ValueError(f"a size cannot be negative, got {short_repr(text)}")
    if size > MAX_BYTES:
        raise ValueError(f"size too large: {short_repr(text)} (at most {MAX_BYTES} bytes)")
    return int(size)


def parse_duration(text: str | int | float, default_unit: str | None = None) -> float:
    """Seconds from a duration with its unit: `45s`, `30m`, `12h`, `7d`, `2w`, or a combination
    such as `1d12h` or `1h30m` (each unit at most once; decimals allowed: `1.5h`).

    A bare number (`7`, `"7"`) is refused: it would be read as seconds by one tool and as days
    by another. Only a config key that carries its unit in its name (`ssd_ttl_days`) passes
    `default_unit` to read a bare number in that unit.

    Args:
        text: a duration string, or a number in `default_unit` (booleans, NaN and infinities are
            rejected).
        default_unit: unit of a bare number, `s`, `m`, `h`, `d` or `w`; None (the default): a
            bare number is an error.

    Returns:
        The duration in seconds, `0 <= seconds <= MAX_DURATION_S`.

    Raises:
        ValueError: not a duration, a bare number without `default_unit` (the message names the
            units), negative, not finite, or longer than 100 years.
    """
    if isinstance(text, bool) or not isinstance(text, (int, float, str)):
        raise ValueError(f"not a duration: {short_repr(text)} ({DURATION_EXAMPLES})")
    if isinstance(text, float) and not math.isfinite(text):
        raise ValueError(f"a duration must be a finite number, got {text!r}")
    if isinstance(text, str) and not _BARE_NUMBER.fullmatch(text.strip()):
        return _checked_seconds(_sum_of_parts(text), text)
    if default_unit is None:
        raise ValueError(bare_number_message(text))
    number = _number_and_unit(text, "duration", DURATION_EXAMPLES)[0] if isinstance(text, str) else Fraction(text)
    return _checked_seconds(number * _DURATION_UNITS[default_unit], text)


def bare_number_message(value: object) -> str:
    """Why a bare number is not a duration, naming the units (`'7' has no unit: write 7d (days), ...`)."""
    shown = str(value).strip() if len(str(value).strip()) <= 12 else "7"  # a long number: the units alone matter
    units = ", ".join(f"{shown}{u} ({name})" for u, name in _UNIT_NAMES)
    return f"{short_repr(value)} has no unit: write {units}; combined: 1d12h"


def _sum_of_parts(text: str) -> Fraction:
    """`1d12h` -> 129600 (seconds, exact). ValueError: not number+unit parts, a unit twice."""
    parts = list(_DURATION_PART.finditer(text.strip()))
    if not parts or "".join(p.group(0) for p in parts) != text.strip():
        raise ValueError(f"not a duration: {short_repr(text)} ({DURATION_EXAMPLES})")
    seen: set[str] = set()
    seconds = Fraction(0)
    for part in parts:
        digits, unit = part.group(1), part.group(2).lower()
        if part.group(2) == "M":  # months in other tools: `prune --ttl 1M` from cron must not mean 1 minute
            raise ValueError(f"not a duration: {short_repr(text)}: 'M' is ambiguous (minutes or months): write "
                             f"{digits}m for minutes, or days / weeks ({DURATION_EXAMPLES})")
        if unit not in _DURATION_UNITS:
            raise ValueError(f"not a duration: {short_repr(text)}: unknown unit {unit!r} ({DURATION_EXAMPLES})")
        if unit in seen:
            raise ValueError(f"not a duration: {short_repr(text)}: unit {unit!r} given twice")
        if len(digits) > _MAX_DIGITS:
            raise ValueError(f"duration too large: {short_repr(text)}")
        seen.add(unit)
        seconds += Fraction(digits) * _DURATION_UNITS[unit]
    return seconds


def _checked_seconds(seconds: Fraction, text: object) -> float:
    """`seconds` as a float. ValueError: negative, or longer than `MAX_DURATION_S` (`text` is quoted)."""
    if seconds < 0:
        raise ValueError(f"a duration cannot be negative, got {short_repr(text)}")
    if seconds > MAX_DURATION_S:
        raise ValueError(f"duration too long: {short_repr(text)} (at most 100 years)")
    return float(seconds)


def _number_and_unit(text: str, what: str, examples: str) -> tuple[Fraction, str]:
    """Split `12.5 GiB` into (Fraction(25, 2), "gib"); ValueError if it is not number + letters."""
    m = _NUMBER_UNIT.fullmatch(text.strip())
    if not m:
        raise ValueError(f"not a {what}: {short_repr(text)} ({examples})")
    digits = m.group(1)
    if len(digits) > _MAX_DIGITS:
        raise ValueError(f"{what} too large: {short_repr(text)}")
    return Fraction(digits), m.group(2).lower()


def format_duration(seconds: float) -> str:
    """`seconds` in the largest unit that holds it whole (`7d`, `12h`, `90s`: what
    `parse_duration` reads back), or in milliseconds below a second (`250ms`); fractions of a
    second above it as `1.5s`."""
    if seconds < 1:
        return f"{seconds * 1000:g}ms"
    for unit in ("d", "h", "m", "s"):
        if seconds % _DURATION_UNITS[unit] == 0:
            return f"{int(seconds // _DURATION_UNITS[unit])}{unit}"
    return f"{seconds:g}s"


def format_hits(ram: int, ssd: int, remote: int) -> str:
    """Where cached tokens came from, for a person: `RAM 12, SSD 2037, remote 0` (every tier
    named, so a hit from the shared remote tier is never invisible)."""
    return f"RAM {ram}, SSD {ssd}, remote {remote}"


def format_size(n: int) -> str:
    """A byte budget for a person: `2 GiB` when it is a whole number of a binary unit (what
    `parse_size` reads back), else `format_bytes` (`1.4 GiB`); exact bytes belong in JSON."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:  # the largest unit it reaches, whole or rounded (not `62500 KiB`)
            return f"{n // size} {unit}" if n % size == 0 else format_bytes(n)
    return format_bytes(n)


def format_bytes(n: float) -> str:
    """`1.5 MiB`-style text for a byte count."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
