"""Every block row of a namespace index in one pass, as columns (`RowTable`): what the operator
commands (`inspect`, `prune`, `validate`, `rm --prompt`) and the SSD byte budget plan from.

One `IndexRow` per row costs ~1 us and ~300 bytes; at a million blocks the commands would spend
seconds and hundreds of MB on them. Here the rows are streamed from a cursor in chunks and kept
as numpy columns: hashes, parents and token digests as `[N, 2]` uint64 keys
(`kvtool.store.chains`), segments as numbers into a sorted name list, the numbers as int / float
arrays: 92 bytes per row, no Python object per row. `IndexRow`s are made on demand (`row(i)`,
iteration) for the few rows a command reports or rewrites.

A malformed row (NULL, wrong type, out of range, a name that is not 32 lowercase hex digits) is
never loaded: `VALID_ROW_SQL` is exactly `IndexRow.from_db`'s check, evaluated by SQLite, and
`bad_rowids` lists the others (for `kvtool validate`).

This module never imports MLX.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from kvtool.store.chains import KeyIndex, hex_of_keys, keys_from_hex
from kvtool.store.index import IndexRow

CHUNK_ROWS = 1 << 16  # rows converted at a time (bounds the Python objects alive while loading)


def _name_ok(col: str) -> str:
    return f"typeof({col})='text' AND length({col})=32 AND {col} NOT GLOB '*[^0-9a-f]*'"


def _int_ok(col: str, lo: int) -> str:
    return f"typeof({col})='integer' AND {col}>={lo}"


def _time_ok(col: str) -> str:
    return f"typeof({col}) IN ('integer','real') AND {col}>=0 AND {col}<9e999"  # 9e999: +infinity


VALID_ROW_SQL = " AND ".join([
    *(_name_ok(c) for c in ("hash", "parent", "segment", "tokens_digest")),
    _int_ok("slot", 0), _int_ok("num_tokens", 1), _int_ok("nbytes", 1), _time_ok("created"), _time_ok("last_access"),
])  # fmt: skip
_COLUMNS = "hash, parent, segment, slot, num_tokens, nbytes, tokens_digest, created, last_access"


@dataclass
class RowTable:
    """The well-formed block rows of one index, as columns (row `i` across all of them).

    Rows are ordered by hash. Sizes in bytes, times in unix seconds.

    Attributes:
        hash, parent, digest: `[N, 2]` uint64 keys of the hash, parent hash and tokens digest.
        seg: `[N]` int64, the row's segment as a number into `segments`.
        segments: the names of the segments rows point at, sorted.
        slot, num_tokens: `[N]` int64.
        nbytes: `[N]` int64, the record size.
        created, last_access: `[N]` float64.
    """

    hash: np.ndarray
    parent: np.ndarray
    digest: np.ndarray
    seg: np.ndarray
    segments: list[str]
    slot: np.ndarray
    num_tokens: np.ndarray
    nbytes: np.ndarray
    created: np.ndarray
    last_access: np.ndarray

    def __len__(self) -> int:
        return int(self.seg.shape[0])

    @classmethod
    def empty(cls) -> RowTable:
        """A table without rows."""
        keys, ints, floats = np.zeros((0, 2), np.uint64), np.zeros(0, np.int64), np.zeros(0, np.float64)
        return cls(keys, keys, keys, ints, [], ints, ints, ints, floats, floats)

    def __iter__(self) -> Iterator[IndexRow]:
        for i in range(len(self)):
            yield self.row(i)

    def __getitem__(self, i: int) -> IndexRow:
        return self.row(i)

    def row(self, i: int) -> IndexRow:
        """Row `i` as an `IndexRow`."""
        h, p, d = hex_of_keys(np.stack([self.hash[i], self.parent[i], self.digest[i]]))
        return IndexRow(h, p, self.segments[int(self.seg[i])], int(self.slot[i]), int(self.num_tokens[i]),
                        int(self.nbytes[i]), d, float(self.created[i]), float(self.last_access[i]))  # fmt: skip

    def hashes(self, rows: np.ndarray | None = None) -> list[str]:
        """The hashes of `rows` (row numbers; None: every row), as hex."""
        return hex_of_keys(self.hash if rows is None else self.hash[rows])

    @cached_property
    def index(self) -> KeyIndex:
        """Lookup of rows by hash key."""
        return KeyIndex(self.hash)

    def find(self, hashes: list[str]) -> np.ndarray:
        """Row numbers of `hashes` (32-hex strings), -1 where absent."""
        return self.index.find(keys_from_hex(hashes))

    def parent_rows(self) -> np.ndarray:
        """`[N]` int64: the row number of each row's parent, -1 if its parent has no row."""
        return self.index.find(self.parent)

    @cached_property
    def segment_numbers(self) -> dict[str, int]:
        """segment name -> its number in `segments` (segments some row points at)."""
        return {name: i for i, name in enumerate(self.segments)}

    @cached_property
    def by_segment(self) -> tuple[np.ndarray, np.ndarray]:
        """`(order, start)`: the row numbers sorted by (segment, slot), and where each segment's
        rows begin in it: segment `s`'s rows are `order[start[s]:start[s + 1]]`."""
        order = np.lexsort((self.slot, self.seg))
        start = np.zeros(len(self.segments) + 1, dtype=np.int64)
        np.cumsum(np.bincount(self.seg, minlength=len(self.segments)), out=start[1:])
        return order, start


def load_rows(conn: sqlite3.Connection, where: str = "1", args: tuple = ()) -> RowTable:
    """Read the well-formed rows of `blocks` (those matching `where`, SQL over its columns) in
    one pass of one statement (one snapshot), `CHUNK_ROWS` at a time.

    Raises:
        sqlite3.Error: the read failed.
    """
    cur = conn.execute(f"SELECT {_COLUMNS} FROM blocks WHERE ({VALID_ROW_SQL}) AND ({where})", args)
    parts: list[list[np.ndarray]] = []
    seg_number: dict[str, int] = {}
    while True:
        chunk = cur.fetchmany(CHUNK_ROWS)
        if not chunk:
            break
        h, p, s, slot, n_tok, nbytes, digest, created, last = zip(*chunk)
        del chunk
        number = seg_number.setdefault
        segs = np.fromiter((number(x, len(seg_number)) for x in s), dtype=np.int64, count=len(s))
        parts.append([keys_from_hex(h), keys_from_hex(p), keys_from_hex(digest), segs, np.array(slot, dtype=np.int64),
                      np.array(n_tok, dtype=np.int64), np.array(nbytes, dtype=np.int64),
                      np.array(created, dtype=np.float64), np.array(last, dtype=np.float64)])  # fmt: skip
    cols: list[np.ndarray]
    if parts:
        cols = [np.concatenate(c) for c in zip(*parts)]
        del parts
    else:
        cols = [np.zeros((0, 2), np.uint64)] * 3 + [np.zeros(0, np.int64)] * 4 + [np.zeros(0, np.float64)] * 2
    names = sorted(seg_number)
    remap = np.zeros(len(names), dtype=np.int64)
    for new, name in enumerate(names):
        remap[seg_number[name]] = new
    cols[3] = remap[cols[3]] if len(names) else cols[3]
    order = np.lexsort((cols[0][:, 1], cols[0][:, 0]))  # by hash
    out = [c[order] for c in cols]
    return RowTable(out[0], out[1], out[2], out[3], names, out[4], out[5], out[6], out[7], out[8])


def bad_rowids(conn: sqlite3.Connection) -> list[int]:
    """rowids of the malformed rows of `blocks` (what `load_rows` leaves out).

    Raises:
        sqlite3.Error: the read failed.
    """
    return [r for (r,) in conn.execute(f"SELECT rowid FROM blocks WHERE NOT ({VALID_ROW_SQL}) OR ({VALID_ROW_SQL}) IS NULL")]


__all__ = ["RowTable", "load_rows", "bad_rowids", "VALID_ROW_SQL", "CHUNK_ROWS"]
