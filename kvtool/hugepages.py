"""Transparent huge pages for large host buffers that are about to be written for the first time.

A restore writes hundreds of MB into freshly allocated memory. With 4 KiB pages every page
costs a fault on its first write: measured on this VM (2 cores, kernel 6.18, THP `madvise`
mode), reading 400 MB from the page cache into fresh memory with two threads took 165 ms on
4 KiB pages and 66 ms with `MADV_HUGEPAGE`, against 48 ms into memory already faulted
(`docs/DESIGN.md`, "Where a restore's time goes"). numpy gives every array of 4 MiB and more the
same advice (`numpy/_core/src/multiarray/alloc.c`, switched off with `NUMPY_MADVISE_HUGEPAGE=0`);
MLX's allocator does not, so kvtool advises the buffers it restores into.

The advice covers the 2 MiB-aligned interior of a buffer (the edges keep 4 KiB pages) and must
come before the first write: pages already faulted stay small. With the kernel's
`defrag=madvise` policy an advised fault may compact memory synchronously when free memory is
fragmented; `KVTOOL_MADVISE_HUGEPAGE=0` turns the advice off. It is a no-op where the call is
missing (not Linux) or refused.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

__all__ = ["HUGE_PAGE_BYTES", "advise_huge", "enabled"]

HUGE_PAGE_BYTES = 2 << 20  # x86-64 and arm64 (4 KiB base pages): one PMD
MADV_HUGEPAGE = 14  # <linux/mman.h> (asm-generic)

_madvise = None
if sys.platform.startswith("linux"):
    try:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        _madvise = _libc.madvise
        _madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _madvise.restype = ctypes.c_int
    except (OSError, AttributeError):
        _madvise = None


def enabled() -> bool:
    """True if the advice is available here and not switched off (`KVTOOL_MADVISE_HUGEPAGE=0`)."""
    return _madvise is not None and os.environ.get("KVTOOL_MADVISE_HUGEPAGE", "1") != "0"


def advise_huge(address: int, nbytes: int) -> int:
    """Advise transparent huge pages for the 2 MiB-aligned part of `[address, address + nbytes)`.

    Call before the range is first written. Never raises: a refusal (`EINVAL` on a kernel
    without THP, for example) only leaves 4 KiB pages.

    Args:
        address: start of a writable anonymous mapping (e.g. `ndarray.ctypes.data`).
        nbytes: its length in bytes.

    Returns:
        The bytes advised (0 if none: range under 2 MiB, advice off or refused).
    """
    if not enabled():
        return 0
    lo = -(-address // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    hi = (address + nbytes) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    if hi <= lo:
        return 0
    assert _madvise is not None  # enabled() checked it
    return hi - lo if _madvise(lo, hi - lo, MADV_HUGEPAGE) == 0 else 0
