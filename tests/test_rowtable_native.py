"""kvtool.store.rowtable_native: the block and segment rows of an index through kvtool's compiled
reader (`kvtool/store/_indexread.c`). It decides a table only when every value is well-formed,
and then exactly as the `sqlite3` way (`rowtable.load_rows`, `SegmentRow.from_db`) and the Arrow
way; any other table it hands back (`NativeUnusable`), whatever the hostile values. It reads one
snapshot; the scan takes it where it is built and falls back to the `sqlite3` way with the same
results."""

from __future__ import annotations

import os
import sqlite3
import sys
import sysconfig
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtool.ops import clean_native
from kvtool.ops import scan as scan_mod
from kvtool.ops.scan import scan_cache
from kvtool.store import rowtable_arrow, rowtable_native
from kvtool.store.index import SegmentRow
from kvtool.store.rowtable import load_rows
from kvtool.store.rowtable_arrow import ArrowUnusable
from kvtool.store.rowtable_native import NativeUnusable, read_snapshot
from tests.store_helpers import make_chain, open_store
from tests.test_rowtable import row
from tests.test_rowtable_arrow import _db, _same_tables, seg_row

built = pytest.mark.skipif(not rowtable_native.available(), reason="the compiled reader was not built (no C compiler or sqlite3.h)")


def test_built_where_it_can_be():
    """Where a C compiler, Python's headers and sqlite3.h are (this machine, CI), the optional
    extensions must have been built (the segment check where libxxhash is too): a failed build
    would otherwise pass unseen (slower commands)."""
    include = Path(sysconfig.get_paths()["include"])
    can = (sys.platform.startswith("linux") and os.path.exists("/usr/bin/cc") and (include / "Python.h").exists()
           and os.path.exists("/usr/include/sqlite3.h"))  # fmt: skip
    if not can:
        pytest.skip("no toolchain for the extension here: the Arrow way reads")
    assert rowtable_native.available()
    if any(Path(d, "libxxhash.so.0").exists() for d in ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib")):
        assert clean_native.available()  # validate's compiled segment check, which links libxxhash


@built
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.lists(row, max_size=20, unique_by=lambda r: r[0]), segs=st.lists(seg_row, max_size=6))
def test_decides_only_well_formed_tables_and_then_as_sqlite3(tmp_path, rows, segs):
    db = _db(Path(tempfile.mkdtemp(dir=tmp_path)) / "index.sqlite", rows, segs)
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, isolation_level=None)
    want = load_rows(conn)
    want_segs = conn.execute("SELECT rowid, name, nbytes, n_blocks, created FROM segments ORDER BY name").fetchall()
    conn.close()
    for full in (True, False):
        try:
            snap = read_snapshot(db, full=full)
        except NativeUnusable:
            continue  # handed back: the sqlite3 way decides
        assert want.bad_rowids == [] and snap.table.bad_rowids == []
        _same_tables(snap.table, load_rows(sqlite3.connect(db), full=full) if not full else want)
        assert [(r, seg) for r, seg in snap.segments] == [(r, SegmentRow.from_db(vals)) for r, *vals in want_segs]
        assert all(seg is not None for _, seg in snap.segments)  # only tables it decides whole
    well_typed = all(type(v) is str for r in rows for v in (r[0], r[1], r[2], r[6])) and all(
        type(v) is int for r in rows for v in r[3:6]) and all(type(v) in (int, float) for r in rows for v in r[7:])  # fmt: skip
    segs_fine = all(SegmentRow.from_db(s) is not None for s in segs)
    if not want.bad_rowids and well_typed and segs_fine:
        read_snapshot(db)  # every value well-formed: decided, never handed back


@built
def test_many_rows_equal_sqlite3_and_arrow(tmp_path):
    rng = np.random.default_rng(0)
    rows = [(f"{rng.integers(1 << 62):032x}", f"{i:032x}", f"{i % 5:032x}", i % 16, 16, 1088, f"{i:032x}", 1.0 * i, 2.5 * i)
            for i in range(3000)]  # fmt: skip
    rows[7] = rows[7][:3] + (1 << 40,) + rows[7][4:]  # well-formed, past int32: kept as INT32_MAX, as the others do
    segs = [(f"{i:032x}", 100 + i, 16, 3.0) for i in range(5)] + [(f"{9:032x}", 7, 1, 4)]  # an integer time
    db = _db(tmp_path / "index.sqlite", rows, segs)
    snap = read_snapshot(db)
    _same_tables(snap.table, load_rows(sqlite3.connect(db)))
    _same_tables(snap.table, rowtable_arrow.read_snapshot(db).table)
    assert snap.segments == rowtable_arrow.read_snapshot(db).segments
    assert [seg.name for _, seg in snap.segments] == sorted(s[0] for s in segs)
    for k, bad in ((2, b"\x00" * 32), (3, "x7"), (7, float("nan")), (0, "A" * 32), (4, -1)):
        hostile = list(rows)
        hostile[2999] = hostile[2999][:k] + (bad,) + hostile[2999][k + 1 :]  # the very last row
        with pytest.raises(NativeUnusable):
            read_snapshot(_db(tmp_path / f"bad{k}.sqlite", hostile, segs))
    with pytest.raises(NativeUnusable):
        read_snapshot(_db(tmp_path / "badseg.sqlite", rows, [*segs, ("b" * 32, 0, 1, 1.0)]))  # nbytes 0


@built
def test_one_snapshot_from_the_first_read(tmp_path):
    rows = [(f"{i:032x}", "0" * 32, f"{i:032x}", 0, 16, 1088, "d" * 32, 1.0, 1.0) for i in range(10)]
    db = _db(tmp_path / "index.sqlite", rows, [(f"{i:032x}", 1088, 1, 1.0) for i in range(10)])
    writer = sqlite3.connect(db, isolation_level=None)

    def write_more() -> None:  # committed after the snapshot is fixed, before the rows are read
        writer.execute("INSERT INTO blocks VALUES (?,?,?,?,?,?,?,?,?)", ("f" * 32, "0" * 32, "e" * 32, 0, 16, 1088, "d" * 32, 1.0, 1.0))
        writer.execute("DELETE FROM segments WHERE name=?", ("0" * 32,))

    snap = read_snapshot(db, fixed=write_more)
    assert len(snap.table) == 10 and len(snap.segments) == 10
    assert len(read_snapshot(db).table) == 11

    def fail() -> None:
        raise RuntimeError("from fixed")

    with pytest.raises(RuntimeError, match="from fixed"):  # what `fixed` raises comes through, nothing leaks
        read_snapshot(db, fixed=fail)


@built
def test_errors_and_absence_are_handed_back(tmp_path, monkeypatch):
    (tmp_path / "garbage.sqlite").write_bytes(b"not a database" * 100)
    for path in (tmp_path / "garbage.sqlite", tmp_path / "absent.sqlite"):
        with pytest.raises(NativeUnusable):
            read_snapshot(path)
    assert not (tmp_path / "absent.sqlite").exists()  # mode=ro: nothing is created
    assert issubclass(NativeUnusable, ArrowUnusable)  # the scan's fallback takes both
    monkeypatch.setattr(rowtable_native, "_module", lambda: None)
    assert not rowtable_native.available()
    with pytest.raises(NativeUnusable):
        read_snapshot(tmp_path / "garbage.sqlite")


@built
def test_scan_takes_it_and_falls_back_alike(tmp_path, monkeypatch):
    store = open_store(tmp_path)
    for i in range(3):
        assert set(store.save_blocks(make_chain(store.layout_key, np.arange(30 * i, 30 * i + 18), seed=i, tail=True))) == {"saved"}
    store.close()
    called = []
    real = rowtable_native.read_snapshot
    monkeypatch.setattr(rowtable_native, "read_snapshot", lambda *a, **k: called.append(1) or real(*a, **k))
    monkeypatch.setattr(scan_mod, "read_snapshot", lambda *a, **k: pytest.fail("the Arrow way was taken"))
    monkeypatch.setattr(scan_mod, "load_rows", lambda *a, **k: pytest.fail("the sqlite3 way was taken"))
    fast = scan_cache(tmp_path)
    assert called
    monkeypatch.undo()

    def refuse(*a, fixed=None, **k):  # hands back after the snapshot is fixed: rows and files read again
        if fixed is not None:
            fixed()
        raise NativeUnusable("test")

    monkeypatch.setattr(rowtable_native, "read_snapshot", refuse)
    slow = scan_cache(tmp_path)
    (a,), (b,) = fast.namespaces, slow.namespaces
    assert (a.status, a.row_count, dict(a.files), a.segment_rows, a.bad_rows) == (b.status, b.row_count, dict(b.files), b.segment_rows, b.bad_rows)
    _same_tables(a.table, b.table)


@built
@settings(max_examples=60, deadline=None)
@given(keys=st.lists(st.integers(0, (1 << 64) - 1), max_size=300), shift=st.sampled_from([0, 11, 32, 53]))
def test_the_radix_order_is_numpys_stable_order(keys, shift):
    """`rowtable.argsort_stable` (the compiled radix sort) equals numpy's stable argsort: random
    keys, many equal ones, keys that differ only in one digit."""
    from kvtool.store.rowtable import argsort_stable

    arr = np.array([k >> shift << shift for k in keys], dtype=np.uint64)
    assert np.array_equal(argsort_stable(arr), np.argsort(arr, kind="stable"))
    dup = np.repeat(arr[: len(arr) // 3], 3)
    assert np.array_equal(argsort_stable(dup), np.argsort(dup, kind="stable"))
