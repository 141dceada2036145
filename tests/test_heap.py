"""kvtool.ops.heap: free heap memory handed back to the system (glibc's malloc_trim), and the cyclic
collector held off while the operator commands build their tables."""

from __future__ import annotations

import gc
import json
import platform
import subprocess
import sys

import pytest

from kvtool.disk import restore
from kvtool.ops import heap

# Run in a fresh interpreter: its heap is laid out the same way every time (a test worker's is not).
PROBE = """
import json, numpy as np
from kvtool.ops.heap import release_free_heap

def rss_kb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 // 1024

keep = [np.ones(1 << 20, np.uint8)]  # a freed mmapped block raises glibc's threshold to 1 MiB ...
keep.clear()
small = [np.ones((1 << 20) - 4096, np.uint8) for _ in range(48)]  # ... so these come from the heap
last = np.ones(300_000, np.uint8)  # above them in the heap, in use: freeing them trims nothing by itself
before = rss_kb()
del small
freed = rss_kb()
released = release_free_heap()
print(json.dumps({"before": before, "freed": freed, "after": rss_kb(), "released": released}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
                    reason="malloc_trim and this heap layout are glibc's; elsewhere release_free_heap does nothing (next test)")
def test_memory_freed_in_the_heap_goes_back():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True)
    got = json.loads(out.stdout)
    assert got["before"] - got["freed"] < 16 * 1024  # freed into the heap: still in the process
    assert got["released"] is True
    assert got["freed"] - got["after"] > 32 * 1024  # most of the ~48 MiB is back


def test_elsewhere_it_does_nothing(monkeypatch):
    heap._malloc_trim.cache_clear()
    monkeypatch.setattr(heap.ctypes.util, "find_library", lambda name: None)  # no C library found, as without glibc
    try:
        assert heap.release_free_heap() is False
    finally:
        heap._malloc_trim.cache_clear()


def test_the_collector_waits_inside_and_comes_back_as_it_was():
    """`restore.gc_paused`: no cyclic collection inside (nested too); afterwards the collector is on again
    only if it was on before; `gc_paused` runs a function inside it, exceptions included."""
    was = gc.isenabled()
    try:
        gc.enable()
        with restore.gc_paused():
            assert not gc.isenabled()
            with restore.gc_paused():
                assert not gc.isenabled()
            assert not gc.isenabled()  # the outer block still holds it off
        assert gc.isenabled()
        gc.disable()
        with restore.gc_paused():
            pass
        assert not gc.isenabled()  # it was off: it stays off

        @heap.gc_paused
        def boom() -> None:
            assert not gc.isenabled()
            raise KeyError("x")

        gc.enable()
        with pytest.raises(KeyError):
            boom()
        assert gc.isenabled() and boom.__name__ == "boom"
    finally:
        (gc.enable if was else gc.disable)()
