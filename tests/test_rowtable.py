"""kvtool.disk.rowtable: every row of an index read in one pass as columns. A row is loaded
exactly when `IndexRow.from_db` accepts it (hostile values of every kind), with its values
intact; the others are reported by rowid."""

from __future__ import annotations

import math
import sqlite3

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtool.disk.index import SCHEMA
from kvtool.disk.rowtable import INT32_MAX, IndexRow, load_rows

HEX = "0123456789abcdef"
name_ok = st.text(HEX, min_size=32, max_size=32)
name_any = st.one_of(
    name_ok, name_ok, name_ok,
    st.none(), st.text(HEX, min_size=31, max_size=31), st.text(HEX, min_size=33, max_size=33),
    name_ok.map(str.upper), st.text(min_size=32, max_size=32), st.binary(min_size=16, max_size=16),
    st.integers(0, 10**12), st.just("0" * 16 + " " * 16),
)  # fmt: skip
int_any = st.one_of(st.integers(-5, 1 << 20), st.integers(-(1 << 63), (1 << 63) - 1), st.none(), st.just("3"), st.floats(0, 9),
                    st.binary(max_size=2))  # fmt: skip
time_any = st.one_of(st.floats(0, 2e9), st.integers(0, 1 << 40), st.floats(allow_nan=False), st.none(), st.just("1.5"),
                     st.just(float("inf")), st.just(-1.0))  # fmt: skip
row = st.tuples(name_any, name_any, name_any, int_any, int_any, int_any, name_any, time_any, time_any)


def _db(rows) -> sqlite3.Connection:
    conn = sqlite3.connect(":memory:", isolation_level=None)
    # a tampered index may hold anything: no NOT NULL left (hashes stay unique, as the primary key makes them)
    conn.executescript("".join(stmt.replace("NOT NULL", "") + ";" for stmt in SCHEMA.split(";") if stmt.strip()))
    conn.executemany("INSERT INTO blocks VALUES (?,?,?,?,?,?,?,?,?)", rows)
    return conn


@settings(max_examples=200, deadline=None)
@given(st.lists(row, max_size=30, unique_by=lambda r: r[0]))
def test_a_row_is_loaded_exactly_when_from_db_accepts_it(rows):
    conn = _db(rows)
    stored = conn.execute("SELECT rowid, * FROM blocks").fetchall()  # as SQLite keeps them (type affinity)
    want = {rid: IndexRow.from_db(vals) for rid, *vals in stored}
    table = load_rows(conn)
    assert sorted(table.bad_rowids) == sorted(rid for rid, r in want.items() if r is None)
    clamp = lambda v: min(v, INT32_MAX)  # noqa: E731  (the table keeps int32: larger values as INT32_MAX)
    good = sorted((r._replace(slot=clamp(r.slot), num_tokens=clamp(r.num_tokens), nbytes=clamp(r.nbytes))
                   for r in want.values() if r is not None), key=lambda r: r.hash)  # fmt: skip
    got = list(table)
    assert [r.hash for r in got] == [r.hash for r in good]  # by hash
    for a, b in zip(got, good):
        assert a == b and math.isclose(a.last_access, b.last_access, rel_tol=0, abs_tol=0)


def test_many_rows_and_chunks(monkeypatch):
    from kvtool.disk import rowtable

    monkeypatch.setattr(rowtable, "CHUNK_ROWS", 7)
    rng = np.random.default_rng(0)
    rows = [(f"{rng.integers(1 << 62):032x}", f"{i:032x}", f"{i % 5:032x}", i % 16, 16, 1088, "d" * 32, 1.0 * i, 2.0 * i)
            for i in range(100)]  # fmt: skip
    rows[13] = rows[13][:3] + (-1,) + rows[13][4:]  # one bad row in one chunk
    table = load_rows(_db(rows))
    assert len(table) == 99 and table.bad_rowids == [14]
    assert table.segments == [f"{i:032x}" for i in range(5)]
    assert sorted(table.hashes()) == sorted(r[0] for i, r in enumerate(rows) if i != 13)
    for r in table:
        assert r.segment == f"{int(r.parent, 16) % 5:032x}" and r.slot == int(r.parent, 16) % 16


def test_key_index_finds_keys_whose_high_halves_collide():
    from kvtool.disk.chains import KeyIndex, hex_of_keys, keys_from_hex

    pairs = [(1, 5), (2, 5), (2, 9), (2, 7), (7, 5), (0, 0), ((1 << 64) - 1, (1 << 64) - 1)]  # three share their high half
    hashes = [f"{hi:016x}{lo:016x}" for hi, lo in pairs]
    keys = keys_from_hex(hashes)
    assert hex_of_keys(keys) == hashes
    queries = keys_from_hex([*hashes[::-1], f"{2:016x}{6:016x}", f"{3:016x}{5:016x}"])
    for index in (KeyIndex(keys), KeyIndex(keys[np.lexsort((keys[:, 1], keys[:, 0]))], is_sorted=True)):
        found = index.find(queries)
        assert found[-2:].tolist() == [-1, -1]  # absent: a shared high half, and no high half at all
        got = [hex_of_keys((keys if index.order is not None else keys[np.lexsort((keys[:, 1], keys[:, 0]))])[[i]])[0]
               for i in found[:-2].tolist()]  # fmt: skip
        assert got == hashes[::-1]


def test_a_plan_table_keeps_the_plan_columns_of_the_full_one():
    """`full=False` (inspect, prune, rm, the byte budget): the same rows and plan columns, the
    others read as zeros."""
    rows = [(f"{i * 7919:032x}", f"{i:032x}", f"{i % 3:032x}", i % 4, 16, 1088, f"{i:032x}", 1.0 + i, 2.5 * i) for i in range(50)]
    full, part = load_rows(_db(rows)), load_rows(_db(rows), full=False)
    for k in ("hash", "parent", "seg", "num_tokens", "last_access"):
        assert np.array_equal(getattr(full, k), getattr(part, k)), k
    assert part.segments == full.segments and not part.slot.any() and not part.created.any()


def test_rows_are_read_in_one_snapshot(tmp_path):
    """Inside the caller's read transaction, a commit made after its first read is not seen (the
    scan lists the directory once that read fixed the snapshot)."""
    path = tmp_path / "index.sqlite"
    conn = sqlite3.connect(path, isolation_level=None)
    conn.executescript("".join(stmt + ";" for stmt in SCHEMA.split(";") if stmt.strip()))
    conn.execute("PRAGMA journal_mode=WAL")
    conn.executemany("INSERT INTO blocks VALUES (?,?,?,?,?,?,?,?,?)",
                     [(f"{i:032x}", "0" * 32, f"{i:032x}", 0, 16, 1088, "d" * 32, 1.0, 1.0) for i in range(10)])  # fmt: skip
    reader = sqlite3.connect(path, isolation_level=None)
    reader.execute("BEGIN")
    reader.execute("SELECT COUNT(*) FROM meta").fetchone()  # fixes the snapshot
    conn.execute("INSERT INTO blocks VALUES (?,?,?,?,?,?,?,?,?)", ("f" * 32, "0" * 32, "e" * 32, 0, 16, 1088, "d" * 32, 1.0, 1.0))
    assert len(load_rows(reader)) == 10
    reader.execute("COMMIT")
    assert len(load_rows(reader)) == 11


def _wal_index(tmp_path, n: int):
    """A WAL index of `n` rows (every 7th malformed: a negative slot) and a writer connection."""
    from kvtool.disk.index import BlockIndex

    path = tmp_path / "index.sqlite"
    BlockIndex(path).close()  # the schema, in WAL mode
    writer = sqlite3.connect(path, isolation_level=None)
    writer.executemany("INSERT INTO blocks VALUES (?,?,?,?,?,?,?,?,?)",
                       [(f"{i * 7919:032x}", f"{i:032x}", f"{i % 9:032x}", -1 if i % 7 == 3 else i % 16, 16, 1088,
                         f"{i:032x}", 1.0 + i, 2.5 * i) for i in range(n)])  # fmt: skip
    return path, writer


def test_two_connections_in_one_snapshot_read_the_same_table(tmp_path, monkeypatch):
    """`kvtool.disk.snapshot.read_snapshot(pair=True)`: a second connection proven to see the first one's snapshot
    reads every other chunk in a second thread; the table (rows, malformed rowids, segments) is
    the one a single connection reads."""
    from kvtool.disk import rowtable
    from kvtool.disk.index import BlockIndex
    from kvtool.disk.snapshot import read_snapshot

    monkeypatch.setattr(rowtable, "CHUNK_ROWS", 64)
    monkeypatch.setattr(rowtable, "PARALLEL_MIN_ROWS", 100)
    path, _writer = _wal_index(tmp_path, 1000)
    index = BlockIndex(path, create=False, read_only=True)
    with read_snapshot(index) as (conn, none):
        one = load_rows(conn)
        assert none is None
    with read_snapshot(index, pair=True) as (conn, also):
        assert also is not None and also.in_transaction
        two = load_rows(conn, also=also)
    index.close()
    assert len(one) == 1000 - len(one.bad_rowids) and one.bad_rowids == two.bad_rowids and len(one.bad_rowids) == 143
    assert one.segments == two.segments
    for k in ("hash", "parent", "digest", "seg", "slot", "num_tokens", "nbytes", "created", "last_access"):
        assert np.array_equal(getattr(one, k), getattr(two, k)), k


def test_a_commit_between_the_two_starts_leaves_one_connection(tmp_path, monkeypatch):
    """Where a transaction commits between the first connection's snapshot and the second's
    (made to happen there: a real commit from another connection), the two would see different
    rows: `read_snapshot` gives no second connection, and the rows read are one snapshot's."""
    from kvtool.disk import names
    from kvtool.disk.index import BlockIndex
    from kvtool.disk.names import wal_index_header
    from kvtool.disk.snapshot import read_snapshot

    path, writer = _wal_index(tmp_path, 50)
    before = wal_index_header(path)
    writer.execute("INSERT INTO blocks VALUES (?,?,?,?,?,?,?,?,?)", ("f" * 32, "0" * 32, "e" * 32, 0, 16, 1088, "d" * 32, 1.0, 1.0))
    assert before is not None and wal_index_header(path) not in (None, before)  # every commit changes it
    calls = []

    def header_then_commit(p):
        calls.append(p)
        if len(calls) == 2:  # the second look, after both transactions began: a commit came first
            writer.execute("DELETE FROM blocks WHERE hash=?", ("f" * 32,))
        return wal_index_header(p)

    monkeypatch.setattr(names, "wal_index_header", header_then_commit)
    index = BlockIndex(path, create=False, read_only=True)
    with read_snapshot(index, pair=True) as (conn, also):
        assert len(calls) == 2 and also is None
        assert len(load_rows(conn)) == 51 - 7  # the snapshot before the delete (7 of the 50 rows malformed)
    index.close()


_HEX = "0123456789abcdef"
_values = st.one_of(
    st.text(_HEX, min_size=32, max_size=32),  # well-formed
    st.text(_HEX + "\nA ", min_size=31, max_size=34),  # near misses: a newline, upper case, length
    st.builds(lambda a, b: a + "\n" + b, st.text(_HEX, min_size=32, max_size=32), st.text(_HEX, max_size=32)),
    st.integers(),
    st.none(),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_values, max_size=6))
def test_all_hashes_agrees_with_is_hash_on_every_value(values):
    """The one-pass check of a lookup's hashes says what checking each one says."""
    from kvtool.disk.names import all_hashes, is_hash

    assert all_hashes(values) == all(is_hash(v) for v in values)
