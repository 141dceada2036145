"""kvtool.hugepages: `MADV_HUGEPAGE` over the 2 MiB-aligned part of a buffer, never raising."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from kvtool import hugepages
from kvtool.hugepages import HUGE_PAGE_BYTES, advise_huge


def aligned_part(address: int, nbytes: int) -> int:
    lo = (address + HUGE_PAGE_BYTES - 1) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    hi = (address + nbytes) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    return max(0, hi - lo)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise through libc on Linux")
def test_advises_exactly_the_aligned_interior():
    buf = np.empty(9 * HUGE_PAGE_BYTES + 12345, np.uint8)
    addr = buf.ctypes.data + 100  # an odd start: the advice must round inwards
    got = advise_huge(addr, buf.nbytes - 100)
    assert got in (0, aligned_part(addr, buf.nbytes - 100))  # 0: a kernel without THP refuses
    assert aligned_part(addr, buf.nbytes - 100) >= 7 * HUGE_PAGE_BYTES
    buf[:] = 1  # the range stays ordinary writable memory
    assert int(buf[::HUGE_PAGE_BYTES].sum()) == len(buf[::HUGE_PAGE_BYTES])


def test_ranges_without_a_whole_huge_page_are_left_alone():
    buf = np.empty(3 * HUGE_PAGE_BYTES, np.uint8)
    addr = (buf.ctypes.data + HUGE_PAGE_BYTES - 1) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES + 8
    assert advise_huge(addr, HUGE_PAGE_BYTES) == 0
    assert advise_huge(buf.ctypes.data, 4096) == 0


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("KVTOOL_MADVISE_HUGEPAGE", "0")
    buf = np.empty(8 * HUGE_PAGE_BYTES, np.uint8)
    assert not hugepages.enabled()
    assert advise_huge(buf.ctypes.data, buf.nbytes) == 0
