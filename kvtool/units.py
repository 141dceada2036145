"""Human sizes and durations: `50GB`, `512MiB`, `7d`, `12h`, `30m`.

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

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
    "t": 2**40,
}
_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_NUMBER_UNIT = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)")
SIZE_EXAMPLES = "examples: 50GB, 512MiB, 512M, 1048576"
DURATION_EXAMPLES = "examples: 7d, 12h, 30m, 45s"


def short_repr(value: object, limit: int = 40) -> str:
    """`repr(value)`, cut to `limit` characters (error messages must stay one short line)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def parse_size(text: str | int) -> int:
    """Bytes from `1234`, `50GB` (decimal), `512MiB` / `512M` (binary). Case-insensitive.

    Args:
        text: a size string, or an integer number of bytes (booleans are not numbers).

    Returns:
        The size in bytes, `0 <= size <= MAX_BYTES` (fractions of a byte are dropped).

    Raises:
        ValueError: not a size, negative, or larger than `MAX_BYTES`.
    """
    if isinstance(text, bool) or not isinstance(text, (int, str)):
        raise ValueError(f"not a size: {short_repr(text)} ({SIZE_EXAMPLES})")
    if isinstance(text, int):
        number, unit = Fraction(text), ""
    else:
        number, unit = _number_and_unit(text, "size", SIZE_EXAMPLES)
        if unit not in _SIZE_UNITS:
            raise ValueError(f"not a size: {short_repr(text)} ({SIZE_EXAMPLES})")
    size = number * _SIZE_UNITS[unit]
    if size < 0:
        raise ValueError(f"a size cannot be negative, got {short_repr(text)}")
    if size > MAX_BYTES:
        raise ValueError(f"size too large: {short_repr(text)} (at most {MAX_BYTES} bytes)")
    return int(size)


def parse_duration(text: str | int | float, default_unit: str = "s") -> float:
    """Seconds from `30s`, `30m`, `12h`, `7d`, `2w`, or a bare number in `default_unit`.

    Args:
        text: a duration string or a number (booleans, NaN and infinities are rejected).
        default_unit: unit of a bare number: `s`, `m`, `h`, `d` or `w`.

    Returns:
        The duration in seconds, `0 <= seconds <= MAX_DURATION_S`.

    Raises:
        ValueError: not a duration, negative, not finite, or longer than 100 years.
    """
    if isinstance(text, bool) or not isinstance(text, (int, float, str)):
        raise ValueError(f"not a duration: {short_repr(text)} ({DURATION_EXAMPLES})")
    if isinstance(text, float) and not math.isfinite(text):
        raise ValueError(f"a duration must be a finite number, got {text!r}")
    if isinstance(text, str):
        number, unit = _number_and_unit(text, "duration", DURATION_EXAMPLES)
        if unit and unit not in _DURATION_UNITS:
            raise ValueError(f"not a duration: {short_repr(text)} ({DURATION_EXAMPLES})")
    else:
        number, unit = Fraction(text), ""
    seconds = number * _DURATION_UNITS[unit or default_unit]
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


def format_bytes(n: float) -> str:
    """`1.5 MiB`-style text for a byte count."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover
