"""kvtool.ops.listing_fork: the scan's file listing made in a forked child while the rows are
read. The results are the scanner's own listing, field for field, on a namespace with every kind
of entry; a child that dies is replaced by a listing in process; no child is left behind."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

from kvtool.disk.rowtable_arrow import ArrowUnusable
from kvtool.ops import listing_fork
from kvtool.ops import scan as scan_mod
from kvtool.ops.scan import scan_cache
from tests.store_helpers import free_fan_out, make_chain, open_store, segment_files

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"),
    reason="the forked listing is Linux-only (ForkedListing.usable); elsewhere the scan lists in a thread, as test_scan covers",
)
FIELDS = ("status", "row_count", "files", "temps", "symlinks", "irregular", "other", "missing", "orphans", "segment_rows")


@pytest.fixture
def cache(tmp_path):
    """A namespace with segments, an orphan, a missing file, a temp, a FIFO, a symlink, a stray file."""
    cache_dir = tmp_path / "kv"
    store = open_store(cache_dir)
    for i in range(4):
        assert set(store.save_blocks(make_chain(store.layout_key, np.arange(20 * i, 20 * i + 18), seed=i, tail=True))) == {"saved"}
    store.close()
    ns_dir = store.namespace_dir
    first, *_ = segment_files(store)
    first.unlink()  # its rows: missing
    sub = next(p for p in ns_dir.iterdir() if p.is_dir())
    (sub / f".{'a' * 32}.4194305.deadbeef.tmp").write_bytes(b"x")
    os.mkfifo(sub / f"{sub.name}{'b' * 30}.safetensors")  # a FIFO under a segment name: never opened
    (sub / "notes.txt").write_bytes(b"x")
    (ns_dir / free_fan_out(ns_dir)).symlink_to(tmp_path)  # segment names are random: a name not taken
    return cache_dir


def _listing(scan) -> tuple:
    (ns,) = scan.namespaces
    return tuple(dict(v) if k == "files" else getattr(ns, k) for k in FIELDS for v in [getattr(ns, k)])


@pytest.fixture
def children(monkeypatch):
    """The pids of the listing children made during a test."""
    pids: list[int] = []
    real = listing_fork.ForkedListing.__init__

    def init(self, *a):
        real(self, *a)
        pids.append(self.pid)

    monkeypatch.setattr(listing_fork.ForkedListing, "__init__", init)
    return pids


def _all_reaped(pids: list[int]) -> bool:
    for pid in pids:
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            continue
        return False
    return bool(pids)


def test_the_forked_listing_is_the_scanners_own(cache, children, monkeypatch):
    got = _listing(scan_cache(cache))
    assert _all_reaped(children)
    monkeypatch.setattr(listing_fork.ForkedListing, "usable", staticmethod(lambda scanner: False))
    want = _listing(scan_cache(cache))  # the listing in a thread beside the read
    assert got == want
    assert len(children) == 1  # the second scan made none
    for field in ("files", "missing", "temps", "irregular", "symlinks", "other"):
        assert got[FIELDS.index(field)], field


def test_a_child_that_dies_is_replaced_by_a_listing_here(cache, children, monkeypatch):
    want = _listing(scan_cache(cache))
    monkeypatch.setattr(listing_fork, "_child", lambda *a: os._exit(1))
    assert _listing(scan_cache(cache)) == want
    assert len(children) == 2 and _all_reaped(children)


def test_a_read_handed_back_stops_the_child(cache, children, monkeypatch):
    want = _listing(scan_cache(cache))

    def refuse(*a, fixed=None, **k):  # after the snapshot is fixed: the child is listing already
        fixed()
        raise ArrowUnusable("test")

    monkeypatch.setattr(scan_mod, "read_snapshot", refuse)
    assert _listing(scan_cache(cache)) == want  # the sqlite3 way, its own listing
    assert len(children) == 2 and _all_reaped(children)
