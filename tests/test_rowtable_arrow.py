"""kvtool.disk.rowtable_arrow: the block and segment rows of an index through ADBC's SQLite
driver. It decides a table only when every row is well-formed, and then exactly as the
`sqlite3` way (`rowtable.load_rows`, `SegmentRow.from_db`); any other table it hands back
(`ArrowUnusable`), whatever the hostile values. It reads one snapshot, and the scan falls back
to the `sqlite3` way with the same results."""

from __future__ import annotations

import sqlite3
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtool.disk import rowtable_arrow, rowtable_native
from kvtool.disk.index import SCHEMA, SegmentRow
from kvtool.disk.rowtable import load_rows
from kvtool.disk.rowtable_arrow import ArrowUnusable, read_snapshot
from kvtool.ops import scan as scan_mod
from kvtool.ops.scan import scan_cache
from tests.store_helpers import make_chain, open_store
from tests.test_rowtable import row

COLUMNS = ("hash", "parent", "digest", "seg", "slot", "num_tokens", "nbytes", "created", "last_access")
seg_name = st.one_of(st.text("0123456789abcdef", min_size=32, max_size=32), st.binary(min_size=32, max_size=32),
                     st.integers(0, 99), st.just("0" * 32))  # fmt: skip
seg_row = st.tuples(seg_name, st.one_of(st.integers(-2, 1 << 20), st.just("7")), st.integers(0, 64),
                    st.one_of(st.floats(0, 2e9), st.integers(0, 9)))  # fmt: skip


def _db(path: Path, rows, segs=()) -> Path:
    conn = sqlite3.connect(path, isolation_level=None)
    # a tampered index may hold anything: no NOT NULL left (hashes stay unique, as the primary key makes them)
    conn.executescript("".join(stmt.replace("NOT NULL", "") + ";" for stmt in SCHEMA.split(";") if stmt.strip()))
    conn.execute("PRAGMA journal_mode=WAL")
    conn.executemany("INSERT INTO blocks VALUES (?,?,?,?,?,?,?,?,?)", rows)
    conn.executemany("INSERT OR IGNORE INTO segments VALUES (?,?,?,?)", segs)
    conn.close()
    return path


def _same_tables(a, b) -> None:
    for k in COLUMNS:
        assert np.array_equal(getattr(a, k), getattr(b, k)), k
    assert a.segments == b.segments


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
        except ArrowUnusable:
            continue  # handed back: the sqlite3 way decides (never for a table of well-formed values only)
        assert want.bad_rowids == [] and snap.table.bad_rowids == []
        _same_tables(snap.table, load_rows(sqlite3.connect(db), full=full) if not full else want)
        assert [(r, seg) for r, seg in snap.segments] == [(r, SegmentRow.from_db(vals)) for r, *vals in want_segs]
    if not want.bad_rowids and all(type(v) is str for r in rows for v in (r[0], r[1], r[2], r[6])) and all(
            type(v) is int for r in rows for v in r[3:6]) and all(type(v) in (int, float) for r in rows for v in r[7:]):  # fmt: skip
        if all(type(s[0]) is str and type(s[1]) is int for s in segs):
            read_snapshot(db)  # well-formed values of the schema's types: decided, never handed back


def test_many_rows_over_batches_equal_sqlite3(tmp_path, monkeypatch):
    monkeypatch.setattr(rowtable_arrow, "BATCH_ROWS", 7)
    rng = np.random.default_rng(0)
    rows = [(f"{rng.integers(1 << 62):032x}", f"{i:032x}", f"{i % 5:032x}", i % 16, 16, 1088, f"{i:032x}", 1.0 * i, 2.5 * i)
            for i in range(100)]  # fmt: skip
    segs = [(f"{i:032x}", 100 + i, 16, 3.0) for i in range(5)]
    db = _db(tmp_path / "index.sqlite", rows, segs)
    snap = read_snapshot(db)
    _same_tables(snap.table, load_rows(sqlite3.connect(db)))
    assert [seg.name for _, seg in snap.segments] == [s[0] for s in segs]
    rows[57] = rows[57][:2] + (rows[57][2].encode(),) + rows[57][3:]  # a BLOB segment name, in a later batch
    with pytest.raises(ArrowUnusable):
        read_snapshot(_db(tmp_path / "blob.sqlite", rows, segs))
    rows[57] = rows[57][:3] + ("7",) + rows[57][4:]  # and text in an integer column
    with pytest.raises(ArrowUnusable):
        read_snapshot(_db(tmp_path / "text.sqlite", rows, segs))


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


def test_scan_takes_the_arrow_way_and_falls_back_alike(tmp_path, monkeypatch):
    store = open_store(tmp_path)
    for i in range(3):
        assert set(store.save_blocks(make_chain(store.layout_key, np.arange(30 * i, 30 * i + 18), seed=i, tail=True))) == {"saved"}
    store.close()
    monkeypatch.setattr(rowtable_native, "available", lambda: False)  # the Arrow way, as where the compiled reader is not built
    called = []
    real = scan_mod.read_snapshot
    monkeypatch.setattr(scan_mod, "read_snapshot", lambda *a, **k: called.append(1) or real(*a, **k))
    monkeypatch.setattr(scan_mod, "load_rows", lambda *a, **k: pytest.fail("the sqlite3 way was taken"))
    fast = scan_cache(tmp_path)
    assert called
    monkeypatch.undo()

    def refuse(*a, fixed=None, **k):  # hands back after the snapshot is fixed: rows and files read again
        if fixed is not None:
            fixed()
        raise ArrowUnusable("test")

    monkeypatch.setattr(rowtable_native, "available", lambda: False)
    monkeypatch.setattr(scan_mod, "read_snapshot", refuse)
    slow = scan_cache(tmp_path)
    (a,), (b,) = fast.namespaces, slow.namespaces
    assert (a.status, a.row_count, dict(a.files), a.segment_rows, a.bad_rows) == (b.status, b.row_count, dict(b.files), b.segment_rows, b.bad_rows)
    _same_tables(a.table, b.table)


def test_any_driver_error_is_handed_back(tmp_path):
    (tmp_path / "garbage.sqlite").write_bytes(b"not a database" * 100)
    for path in (tmp_path / "garbage.sqlite", tmp_path / "absent.sqlite"):
        with pytest.raises(ArrowUnusable):
            read_snapshot(path)
    assert not (tmp_path / "absent.sqlite").exists()  # mode=ro: nothing is created
