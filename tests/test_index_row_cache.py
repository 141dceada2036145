"""kvtool.disk.index: the rows `get_many` keeps per process. A repeated lookup is answered from
them, and what it answers is always what the database holds now: after a commit of another
process or connection, after every write of this one, after a failed transaction."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvtool.disk import row_cache
from kvtool.disk.index import BlockIndex
from kvtool.disk.rowtable import IndexRow, SegmentRow


def _hex(i: int, kind: str = "a") -> str:
    return f"{kind}{i:031x}"


def _row(i: int, segment: str = _hex(0, "c"), slot: int | None = None) -> IndexRow:
    return IndexRow(_hex(i), _hex(i, "b"), segment, i if slot is None else slot, 64, 4096, _hex(i, "d"), 1.0e9, 1.0e9)


def _insert(index: BlockIndex, rows: list[IndexRow], segment: str = _hex(0, "c")) -> None:
    index.insert_segment(SegmentRow(segment, 4096 * len(rows), len(rows), 1.0e9), rows)


@pytest.fixture
def index(tmp_path):
    with BlockIndex(tmp_path / "index.sqlite") as idx:
        _insert(idx, [_row(i) for i in range(8)])
        yield idx


def _lookup(index: BlockIndex, n: int = 8) -> tuple[dict[str, IndexRow], int]:
    """(rows of the first `n` hashes, how many of them came from the cache)."""
    before = index.row_cache.hits
    got = index.get_many([_hex(i) for i in range(n)])
    return got, index.row_cache.hits - before


def test_a_repeated_lookup_is_answered_from_the_cache_with_the_same_rows(index):
    first, hits = _lookup(index)
    assert hits == 0 and sorted(first) == [_hex(i) for i in range(8)]
    again, hits = _lookup(index)
    assert hits == 8 and again == first
    _, hits = _lookup(index, 10)  # two absent hashes: asked of SQLite, not kept
    assert hits == 8
    assert index.get_many([_hex(9)]) == {}


def test_another_process_replacing_and_deleting_rows_is_seen(index, tmp_path):
    _lookup(index)
    moved = _hex(7, "e")
    script = (
        "import sqlite3, sys; c = sqlite3.connect(sys.argv[1], isolation_level=None);"
        "c.execute('UPDATE blocks SET segment=?, slot=5 WHERE hash=?', (sys.argv[2], sys.argv[3]));"
        "c.execute('DELETE FROM blocks WHERE hash=?', (sys.argv[4],))"
    )
    subprocess.run([sys.executable, "-c", script, str(tmp_path / "index.sqlite"), moved, _hex(1), _hex(2)], check=True)
    got, hits = _lookup(index)
    assert hits == 0  # the other process's commit emptied the cache
    assert (got[_hex(1)].segment, got[_hex(1)].slot) == (moved, 5)
    assert _hex(2) not in got and len(got) == 7


def test_another_connection_of_this_process_is_seen(index, tmp_path):
    _lookup(index)
    with BlockIndex(tmp_path / "index.sqlite") as other:
        other.delete([_hex(3)])
    got, _ = _lookup(index)
    assert _hex(3) not in got and len(got) == 7


def test_own_segment_insert_drops_only_the_rows_it_replaces(index):
    _lookup(index)
    seg2 = _hex(1, "c")
    _insert(index, [_row(2, segment=seg2, slot=0), _row(20, segment=seg2, slot=1)], segment=seg2)
    got, hits = _lookup(index)
    assert hits == 7  # every cached row but the replaced one
    assert (got[_hex(2)].segment, got[_hex(2)].slot) == (seg2, 0)
    assert index.get_many([_hex(20)])[_hex(20)].segment == seg2


@pytest.mark.parametrize("write", ["delete", "delete_segments", "write_transaction"])
def test_own_writes_empty_the_cache(index, write):
    _lookup(index)
    if write == "delete":
        index.delete([_hex(4)])
    elif write == "delete_segments":
        index.delete_segments([_hex(0, "c")])
    else:
        with index.write_transaction() as cur:
            cur.execute("UPDATE blocks SET nbytes=8192 WHERE hash=?", (_hex(4),))
    got, hits = _lookup(index)
    assert hits == 0
    if write == "delete":
        assert _hex(4) not in got and len(got) == 7
    elif write == "delete_segments":
        assert got == {}
    else:
        assert got[_hex(4)].nbytes == 8192 and got[_hex(5)].nbytes == 4096


def test_a_failed_transaction_empties_the_cache(index):
    _lookup(index)
    with pytest.raises(RuntimeError), index.write_transaction() as cur:
        cur.execute("DELETE FROM blocks WHERE hash=?", (_hex(6),))
        raise RuntimeError("body fails: rolled back")
    got, hits = _lookup(index)
    assert hits == 0 and len(got) == 8  # rolled back: the row is still there


def test_an_access_time_flush_keeps_the_cached_rows(index):
    _lookup(index)
    index.touch_many([_hex(i) for i in range(8)], t=2.0e9)
    assert index.flush() == 8
    got, hits = _lookup(index)
    assert hits == 8 and got[_hex(0)].last_access == 1.0e9  # the row as read (documented)
    assert index.get(_hex(0)).last_access == 2.0e9  # the database has the new time


def test_the_cache_is_bounded(index, monkeypatch):
    monkeypatch.setattr(row_cache, "ROW_CACHE_ROWS", 5)
    _lookup(index)  # 8 rows read, over the bound: the older half goes
    _, hits = _lookup(index)
    assert hits == 4
