"""Memory of the operator commands: free heap memory goes back to the system between steps, and
the cyclic garbage collector waits while they build their tables.

glibc's malloc serves a request of `M_MMAP_THRESHOLD` bytes or more (128 KiB at start) with its
own `mmap`, returned to the system when freed. After the first such free it raises the threshold
to that size (up to 32 MiB, and the trim threshold to twice it), so later blocks of a few MiB
come from its heaps (one per thread), and what is freed there stays in the process. A scan of a
million rows builds and drops many such numpy temporaries (batches of rows, sort orders, masks).
`release_free_heap` (glibc's `malloc_trim`) hands that back after a scan and after the segment
check.

`gc_paused` holds the cyclic collector off while a scan or a plan runs: they make objects by the
ten thousand that live to the end of the command, so each collection walks them all and frees
nothing. Reference counting still frees everything that is not in a cycle.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from collections.abc import Callable
from functools import cache
from typing import ParamSpec, TypeVar

from kvtool.disk import restore

_P = ParamSpec("_P")
_R = TypeVar("_R")


@cache
def _malloc_trim():
    if not sys.platform.startswith("linux"):
        return None
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc
        return None
    if trim is not None:
        trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def release_free_heap() -> bool:
    """Return the free memory of every malloc heap to the system (glibc on Linux; elsewhere
    nothing); never changes what is allocated.

    Returns:
        True if some memory was released.
    """
    trim = _malloc_trim()
    return bool(trim(0)) if trim is not None else False


def gc_paused(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """`fn` run with the cyclic collector paused (`kvtool.disk.restore.gc_paused`: nests, across
    threads too): a decorator for the operator commands' scans and plans."""
    return restore.gc_paused()(fn)  # a context manager made by `contextmanager` decorates (afresh per call)


__all__ = ["release_free_heap", "gc_paused"]
