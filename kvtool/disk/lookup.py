"""The request path's row lookup: the rows of a chain's hashes in one query per 500, checked as
columns.

`IndexRow.from_db` checks a row in Python (~4 us: a regex, five number checks, the dataclass);
a 16k-token prompt of 64-token blocks looks up 256 rows per request. Here the rows of one query
are checked column by column with C-level passes (`map`, `set`, `min`, one regex over all the
names joined): the same rules as `from_db` (names: text of 32 lowercase hex digits; slot >= 0,
num_tokens and nbytes >= 1, integers; times finite and >= 0). When every row passes and every
time is already a float (as kvtool writes them) the rows are made straight from the tuples;
otherwise the caller checks them one by one with `from_db`. Either way, the rows that come back
are exactly those `from_db` keeps, with the same values.

This module never imports MLX.
"""

from __future__ import annotations

import math
import re
import sqlite3
from collections.abc import Sequence

from kvtool.disk.rowtable import IndexRow

_COLUMNS = "hash, parent, segment, slot, num_tokens, nbytes, tokens_digest, created, last_access"
_HEX = re.compile(r"[0-9a-f]*")


def _names_ok(col: tuple) -> bool:
    return set(map(type, col)) == {str} and set(map(len, col)) == {32}


def _ints_ok(col: tuple, lo: int) -> bool:
    return set(map(type, col)) == {int} and min(col) >= lo  # type(True) is bool: no bool passes


def _times_ok(col: tuple) -> bool:
    return set(map(type, col)) == {float} and min(col) >= 0 and math.isfinite(max(col))  # SQLite has no NaN


def rows_as_columns(conn: sqlite3.Connection, hashes: Sequence[str]) -> list[IndexRow] | None:
    """The rows of up to 500 `hashes` in one query, in any order, if all of them are
    well-formed with float times (`IndexRow.from_db` would keep each as it is); else None: the
    caller checks them one by one.

    Raises:
        sqlite3.Error: the query failed.
    """
    if not hashes:
        return []
    marks = ",".join("?" * len(hashes))
    rows = conn.execute(f"SELECT {_COLUMNS} FROM blocks WHERE hash IN ({marks})", list(hashes)).fetchall()
    if not rows:
        return []
    h, parent, seg, slot, n_tok, nbytes, digest, created, last = zip(*rows)
    if not (all(map(_names_ok, (h, parent, seg, digest))) and _ints_ok(slot, 0) and _ints_ok(n_tok, 1)
            and _ints_ok(nbytes, 1) and _times_ok(created) and _times_ok(last)):  # fmt: skip
        return None
    if not _HEX.fullmatch("".join(h) + "".join(parent) + "".join(seg) + "".join(digest)):
        return None
    return [IndexRow(*r) for r in rows]


__all__ = ["rows_as_columns"]
