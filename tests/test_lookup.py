"""Tests of kvtool.disk.lookup: the request path's rows, checked as columns, are exactly the rows
`IndexRow.from_db` keeps (the well-formed ones, same values), whatever is wrong with the others.
"""

from __future__ import annotations

import sqlite3

import numpy as np
import pytest

from kvtool.disk.lookup import rows_as_columns
from kvtool.disk.rowtable import IndexRow
from tests.store_helpers import make_chain, open_store

COLUMNS = "hash, parent, segment, slot, num_tokens, nbytes, tokens_digest, created, last_access"

DAMAGE = {  # one row's column set to a value from_db refuses (or, for an int time, converts)
    "negative_slot": ("slot", -1),
    "text_slot": ("slot", "x3"),
    "zero_tokens": ("num_tokens", 0),
    "real_tokens": ("num_tokens", 1.5),
    "text_nbytes": ("nbytes", "many"),
    "upper_parent": ("parent", "A" * 32),
    "short_segment": ("segment", "ab" * 15),
    "long_digest": ("tokens_digest", "0" * 33),
    "blob_parent": ("parent", b"0" * 32),
    "nul_in_parent": ("parent", "0" * 31 + "\x00"),
    "nul_after_segment": ("segment", "0" * 32 + "\x00"),
    "text_created": ("created", "now"),
    "negative_access": ("last_access", -1.0),
    "infinite_access": ("last_access", float("inf")),
    "int_created": ("created", 7),  # REAL affinity stores 7.0: kept, as a float
}


def _saved(tmp_path):
    store = open_store(tmp_path)
    chain = make_chain(store.layout_key, np.arange(100, 124, dtype=np.int32), "bfloat16", seed=1)
    assert set(store.save_blocks(chain)) == {"saved"}
    return store, [b.block_hash for b in chain]


def _as_from_db(store, hashes):
    con = sqlite3.connect(store.namespace_dir / "index.sqlite")
    try:
        raw = con.execute(f"SELECT {COLUMNS} FROM blocks WHERE hash IN ({','.join('?' * len(hashes))})", hashes).fetchall()
    finally:
        con.close()
    return {r.hash: r for r in map(IndexRow.from_db, raw) if r is not None}


def test_well_formed_rows_come_back_as_from_db_makes_them(tmp_path):
    store, hashes = _saved(tmp_path)
    with store.index.connection() as con:
        got = rows_as_columns(con, hashes)
    assert got is not None and {r.hash: r for r in got} == _as_from_db(store, hashes)
    assert all(type(r.created) is float and type(r.slot) is int for r in got)
    assert store.index.get_many(hashes) == _as_from_db(store, hashes)
    with store.index.connection() as con:
        assert rows_as_columns(con, []) == [] and rows_as_columns(con, ["f" * 32]) == []
    store.close()


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_a_malformed_row_is_left_out_exactly_as_from_db_decides(tmp_path, case):
    store, hashes = _saved(tmp_path)
    column, value = DAMAGE[case]
    con = sqlite3.connect(store.namespace_dir / "index.sqlite")
    with con:
        con.execute(f"UPDATE blocks SET {column}=? WHERE hash=?", (value, hashes[2]))
    con.close()
    want = _as_from_db(store, hashes)
    assert (hashes[2] in want) == (case == "int_created")
    assert store.index.get_many(hashes) == want
    assert [r.hash for r in store.lookup(hashes)] == (hashes if case == "int_created" else hashes[:2])
    store.close()
