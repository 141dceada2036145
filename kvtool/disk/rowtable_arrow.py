"""Every block row and segment row of a namespace index in one snapshot, read through Apache
Arrow ADBC's SQLite driver (`adbc-driver-sqlite`) as Arrow columns (`nanoarrow`): the fast way
into a `RowTable` for the operator commands' scan (`kvtool.ops.scan`).

Python's `sqlite3` makes one object per value; `rowtable.load_rows` avoids that by having SQLite
build one hex string per chunk of rows, with SQL type checks per row, and at a million rows that
still costs ~2-3 s, most of it SQL expressions. The ADBC driver steps the same query in C and
appends each value to an Arrow column: ~0.8 s for a million rows here. Its columns become numpy
arrays without a Python object per row.

The driver infers each column's Arrow type from its first batch and converts what follows, so
some of what `IndexRow.from_db` refuses would arrive looking fine: an integer or a BLOB in a
text column arrives as text. The query therefore carries one check per row, `max(hash, parent,
tokens_digest, segment) < x''` (true only when no name is a BLOB: in SQLite every BLOB sorts
after every TEXT; an integer renders as at most 20 digits, never 32 hex digits), and every batch
must have exactly the expected column types, no NULL, names of 32 lowercase hex digits and
numbers in range. Anything else (a malformed row, a type the driver changed or refused, a driver
error) raises `ArrowUnusable`: the caller then reads the index the `sqlite3` way, which decides
row by row (`rowtable.load_rows`). So the verdicts are `IndexRow.from_db`'s, only faster to reach.

This module never imports MLX.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator
from contextlib import closing
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

from kvtool.disk.chains import unhex_lower
from kvtool.disk.index import SegmentRow, read_only_uri
from kvtool.disk.rowtable import INT32_MAX, RowTable, _Columns, _SegmentNames

BATCH_ROWS = 1 << 14  # rows per Arrow batch (bounds the memory of one batch: ~4 MB)
# every column is read and checked, whatever the caller keeps: the verdicts are the same either way
_BLOCKS = ("SELECT max(hash, parent, tokens_digest, segment) < x'' AS ok, hash, parent, tokens_digest, segment, "
           "slot, num_tokens, nbytes, created, last_access FROM blocks")  # fmt: skip
_SEGMENTS = "SELECT rowid, name < x'' AS ok, name, nbytes, n_blocks, created FROM segments ORDER BY name"


class ArrowUnusable(Exception):
    """The Arrow way cannot decide this index (a malformed or unusual row, a driver error, the
    driver missing): read it the `sqlite3` way."""


@dataclass
class Snapshot:
    """What `read_snapshot` read, in one read transaction.

    Attributes:
        table: the block rows (`RowTable`; all well-formed, `bad_rowids` empty).
        segments: the `segments` rows in name order, as `(rowid, SegmentRow)`, or `(rowid, None)`
            for a malformed one (as `SegmentRow.from_db` decides; a BLOB name is malformed).
    """

    table: RowTable
    segments: list[tuple[int, SegmentRow | None]]


def read_snapshot(path: Path, *, full: bool = True, immutable: bool = False,
                  fixed: Callable[[], None] | None = None,
                  on_table: Callable[[RowTable], None] | None = None) -> Snapshot:  # fmt: skip
    """Read index `path`'s block rows and `segments` rows in one read transaction (`mode=ro`).

    Args:
        path: the index file (`index.sqlite`).
        full: every column (else only what a plan needs, as `rowtable.load_rows(full=False)`).
        immutable: open it `immutable=1` (an index whose -shm cannot be created).
        fixed: called once the snapshot is fixed (after the transaction's first read).
        on_table: called with the block rows' table once it is made, before this returns.

    Raises:
        ArrowUnusable: the rows cannot be decided this way (see the module docstring).
    """
    adbc, adbc_driver_sqlite, _ = _driver()
    uri = read_only_uri(path, immutable)
    try:
        with adbc_driver_sqlite.connect(uri) as db, adbc.AdbcConnection(db) as conn:
            conn.set_autocommit(False)  # BEGIN: every statement below reads one snapshot
            try:
                with closing(_rows(conn, "SELECT COUNT(*) FROM meta")) as batches:  # the first read fixes the snapshot
                    for _ in batches:
                        pass
                if fixed is not None:
                    fixed()
                with closing(_rows(conn, "SELECT COUNT(*) FROM blocks")) as batches:
                    (count,) = _column_values(batches, "int64")
                cols = _Columns(int(count[0]), full)
                with closing(_rows(conn, _BLOCKS)) as batches:
                    for batch in batches:
                        cols.add(*_convert(batch))
                with closing(_rows(conn, _SEGMENTS)) as batches:
                    segments = _segments(batches)
            finally:
                conn.rollback()
    except ArrowUnusable:
        raise
    except Exception as exc:  # the driver refused a value or could not read: any error, the sqlite3 way decides
        raise ArrowUnusable(f"ADBC read failed: {exc!r}") from None
    if cols.n != count[0]:  # rows the driver skipped: never expected, but the count is known
        raise ArrowUnusable("row count differs")
    table = cols.table()
    if on_table is not None:
        on_table(table)
    return Snapshot(table, segments)


@cache
def _driver() -> tuple[Any, Any, Any]:
    """`(adbc_driver_manager, adbc_driver_sqlite, nanoarrow)`, imported on first use (only the
    operator commands read this way).

    Raises:
        ArrowUnusable: an install without them (the sqlite3 way then reads).
    """
    try:
        import adbc_driver_manager
        import adbc_driver_sqlite
        import nanoarrow
    except ImportError as exc:
        raise ArrowUnusable(f"ADBC SQLite driver unavailable: {exc}") from None
    return adbc_driver_manager, adbc_driver_sqlite, nanoarrow


def _rows(conn, sql: str) -> Generator:
    """The result of `sql` as nanoarrow struct array views, one per batch (each valid until the
    next is asked for). The result stream is released before its statement is closed (the
    driver's statement must outlive its stream)."""
    adbc, _, na = _driver()
    with adbc.AdbcStatement(conn) as stmt:
        stmt.set_options(**{"adbc.sqlite.query.batch_rows": str(BATCH_ROWS)})
        stmt.set_sql_query(sql)
        handle, _ = stmt.execute_query()
        stream = na.c_array_stream(handle)
        try:
            while True:
                try:
                    array = stream.get_next()
                except StopIteration:
                    return
                yield array.view()
                del array
        finally:
            stream.release()
            handle.release()


def _column_values(batches: Iterator, *types: str) -> list[np.ndarray]:
    """The numeric columns of a (one-batch) result as numpy arrays."""
    out = None
    for view in batches:
        got = [_numbers(col, t) for col, t in zip(view.children, types, strict=True)]
        out = got if out is None else [np.concatenate([a, b]) for a, b in zip(out, got)]
    if out is None:
        raise ArrowUnusable("empty result")
    return out


def _buffers(col) -> list:
    if col.null_count:
        raise ArrowUnusable("a NULL value")
    return list(col.buffers)


def _numbers(col, kind: str) -> np.ndarray:
    """An int64 or double column's values (`[m]`, a copy: the batch's memory goes with it), no NULL."""
    if col.storage_type != kind:
        raise ArrowUnusable(f"a {col.storage_type} column where {kind} was expected")
    bufs = _buffers(col)
    return np.frombuffer(bufs[1], dtype=np.int64 if kind == "int64" else np.float64)[col.offset : col.offset + col.length].copy()


def _names(col) -> np.ndarray:
    """A text column of names, each 32 lowercase hex digits: their bytes, `[m, 16]` uint8."""
    if col.storage_type != "string":
        raise ArrowUnusable(f"a {col.storage_type} column where names were expected")
    bufs = _buffers(col)
    m = col.length
    offsets = np.frombuffer(bufs[1], dtype=np.int32)[col.offset : col.offset + m + 1]
    if m and not (np.diff(offsets) == 32).all():
        raise ArrowUnusable("a name that is not 32 characters")
    chars = np.frombuffer(bufs[2], dtype=np.uint8)[offsets[0] : offsets[0] + 32 * m]
    got, ok = unhex_lower(chars.reshape(m, 32))
    if not ok.all():
        raise ArrowUnusable("a name that is not lowercase hex")
    return got


def _convert(view) -> tuple[np.ndarray, _SegmentNames, np.ndarray, np.ndarray, np.ndarray]:
    """One batch of block rows as `_Columns.add` takes them."""
    ch = list(view.children)
    if (_numbers(ch[0], "int64") != 1).any():  # a BLOB name
        raise ArrowUnusable("a name stored as a BLOB")
    h, p, d, s = (_names(c) for c in ch[1:5])
    ints = np.stack([_numbers(c, "int64") for c in ch[5:8]])  # slot, num_tokens, nbytes
    if not ((ints[0] >= 0).all() and (ints[1:] >= 1).all()):
        raise ArrowUnusable("a number out of range")
    np.minimum(ints, INT32_MAX, out=ints)
    times = np.stack([_times(c) for c in ch[8:10]])  # created, last_access
    return np.concatenate([h, p, d], axis=1), _SegmentNames(s), s, ints, times  # names: [m, 48] hash, parent, digest


def _times(col) -> np.ndarray:
    """A time column (`[m]` float64), each finite and >= 0 (an integer time arrives as a double)."""
    t = _numbers(col, "double")
    if not (np.isfinite(t).all() and (t >= 0).all()):
        raise ArrowUnusable("a time out of range")
    return t


def _segments(batches: Iterator) -> list[tuple[int, SegmentRow | None]]:
    """`segments` rows (`Snapshot.segments`), each made into its `SegmentRow` at once (no
    intermediate object per row is kept). Rows are checked as columns; a row that fails a check
    is decided by `SegmentRow.from_db` itself."""
    out: list[tuple[int, SegmentRow | None]] = []
    for view in batches:
        ch = list(view.children)
        rowid, ok = _numbers(ch[0], "int64"), _numbers(ch[1], "int64")
        if ch[2].storage_type != "string":
            raise ArrowUnusable("segment names of another type")
        bufs, m = _buffers(ch[2]), ch[2].length
        offsets = np.frombuffer(bufs[1], dtype=np.int32)[ch[2].offset : ch[2].offset + m + 1].astype(np.int64)
        nbytes, n_blocks = (_numbers(c, "int64") for c in ch[3:5])
        created = _numbers(ch[5], "double")
        fine = (ok == 1) & (np.diff(offsets) == 32) & (nbytes >= 1) & (n_blocks >= 1)
        fine &= np.isfinite(created) & (created >= 0)
        chars = np.frombuffer(bufs[2], dtype=np.uint8)
        held = np.flatnonzero(fine)
        if held.size:  # names of 32 lowercase hex digits, as `is_segment_name`
            fine[held[~unhex_lower(chars[offsets[held][:, None] + np.arange(32)])[1]]] = False
        text = bytes(bufs[2])
        cols = zip(rowid.tolist(), fine.tolist(), offsets[:-1].tolist(), offsets[1:].tolist(), nbytes.tolist(),
                   n_blocks.tolist(), created.tolist(), ok.tolist(), strict=True)  # fmt: skip
        for r, good, a, b, nb, n, c, text_name in cols:
            if good:
                out.append((r, SegmentRow(text[a:b].decode("ascii"), nb, n, c)))
            else:  # a BLOB name (`text_name` 0) is refused there
                out.append((r, SegmentRow.from_db((text[a:b].decode(errors="replace") if text_name == 1 else None, nb, n, c))))
    return out


__all__ = ["read_snapshot", "Snapshot", "ArrowUnusable", "BATCH_ROWS"]
