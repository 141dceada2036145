"""kvtool's optional compiled parts (`setup.py`: `kvtool.disk._indexread`,
`kvtool.ops._segcheck`), imported where the install built them.

This module never imports MLX.
"""

from __future__ import annotations

import importlib
from functools import cache
from types import ModuleType


@cache
def load(name: str) -> ModuleType | None:
    """The compiled module `name`, or None where it was not built (the caller then does the same
    work in Python)."""
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


__all__ = ["load"]
