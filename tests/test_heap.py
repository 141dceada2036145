"""kvtool.ops.heap: free heap memory handed back to the system (glibc's malloc_trim)."""

from __future__ import annotations

import platform
import sys

import numpy as np
import pytest

from kvtool.ops import heap


@pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_memory_freed_in_the_heap_goes_back():
    def rss_kb() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096 // 1024

    heap.release_free_heap()
    keep = [np.ones(1 << 20, np.uint8)]  # a freed mmapped block raises glibc's threshold to 1 MiB ...
    keep.clear()
    small = [np.ones((1 << 20) - 4096, np.uint8) for _ in range(48)]  # ... so these come from the heap
    last = np.ones(300_000, np.uint8)  # above them in the heap, in use: freeing them trims nothing by itself
    before = rss_kb()
    del small
    freed = rss_kb()
    assert before - freed < 16 * 1024  # freed into the heap: still in the process
    assert heap.release_free_heap() is True
    assert freed - rss_kb() > 32 * 1024  # most of the ~48 MiB is back
    del last


def test_elsewhere_it_does_nothing(monkeypatch):
    heap._malloc_trim.cache_clear()
    monkeypatch.setattr(heap.sys, "platform", "darwin")
    try:
        assert heap.release_free_heap() is False
    finally:
        heap._malloc_trim.cache_clear()
