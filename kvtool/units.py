"""Human sizes and durations for the CLI: `50GB`, `512MiB`, `7d`, `12h`, `30m`."""

from __future__ import annotations

import re

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
_NUMBER = r"(\d+(?:\.\d*)?|\.\d+)"


def parse_size(text: str | int) -> int:
    """Bytes from `1234`, `50GB` (decimal), `512MiB` / `512M` (binary). Case-insensitive.

    Raises:
        ValueError: not a size.
    """
    if isinstance(text, int):
        return text
    m = re.fullmatch(_NUMBER + r"\s*([a-zA-Z]*)", str(text).strip())
    unit = m.group(2).lower() if m else None
    if not m or unit not in _SIZE_UNITS:
        raise ValueError(f"not a size: {text!r} (examples: 50GB, 512MiB, 1048576)")
    return int(float(m.group(1)) * _SIZE_UNITS[unit])


def parse_duration(text: str | float) -> float:
    """Seconds from `30s`, `30m`, `12h`, `7d`, `2w`, or a bare number of seconds.

    Raises:
        ValueError: not a duration.
    """
    if isinstance(text, (int, float)):
        return float(text)
    m = re.fullmatch(_NUMBER + r"\s*([a-zA-Z]*)", str(text).strip())
    unit = m.group(2).lower() if m else None
    if not m or (unit and unit not in _DURATION_UNITS):
        raise ValueError(f"not a duration: {text!r} (examples: 7d, 12h, 30m, 45s)")
    return float(m.group(1)) * _DURATION_UNITS.get(unit or "s", 1)


def format_bytes(n: float) -> str:
    """`1.5 MiB`-style text for a byte count."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover
