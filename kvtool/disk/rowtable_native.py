"""Every block row and segment row of a namespace index in one snapshot, read through SQLite's C
API by kvtool's one compiled part (`kvtool/disk/_indexread.c`): the fastest way into a
`RowTable` for the operator commands' scan (`kvtool.ops.scan`).

At a million rows the ADBC driver (`kvtool.disk.rowtable_arrow`) and the numpy work after it
take ~1.8-2.4 s on this machine; SQLite itself steps the same rows in ~0.3 s. Here a C loop steps
them without the GIL and writes every value straight into the buffers of the columns a
`RowTable` is made of (names decoded from hex into `[N, 2]` uint64 keys, numbers as int32 /
float64, each row's segment as the number of its run of rows: a segment's rows are inserted
together), so nothing per row is made in Python.

Exactness: the C loop checks every value as `IndexRow.from_db` and `SegmentRow.from_db` do (the
storage class SQLite reports, not a conversion of it: a name is TEXT of exactly 32 lowercase hex
digits; slot an INTEGER >= 0; num_tokens, nbytes, n_blocks INTEGERs >= 1; times REAL or INTEGER,
finite, >= 0). The first value that is anything else ends the read: `read_snapshot` raises
`NativeUnusable` (an `ArrowUnusable`), and the scan reads the index again the `sqlite3` way, which
decides row by row. So the verdicts are always `from_db`'s.

The extension is optional (`setup.py`): where it was not built, `available()` is False and the
scan reads through ADBC.

This module never imports MLX.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import numpy as np

from kvtool.disk import compiled
from kvtool.disk.chains import hex_of_keys
from kvtool.disk.index import SegmentRow, read_only_uri
from kvtool.disk.rowtable import RowTable, _Columns
from kvtool.disk.rowtable_arrow import ArrowUnusable, Snapshot

_FULL_ONLY = ("digest", "slot", "nbytes", "created")  # columns kept only with `full` (as `_Columns`)


class NativeUnusable(ArrowUnusable):
    """The compiled reader cannot decide this index (a malformed or unusual value, an SQLite
    error, the extension missing): read it the `sqlite3` way."""


def _module() -> ModuleType | None:
    return compiled.load("kvtool.disk._indexread")


def available() -> bool:
    """Whether the compiled reader was built for this install."""
    return _module() is not None


def read_snapshot(path: Path, *, full: bool = True, immutable: bool = False,
                  fixed: Callable[[], None] | None = None,
                  on_table: Callable[[RowTable], None] | None = None) -> Snapshot:  # fmt: skip
    """Read index `path`'s block rows and `segments` rows in one read transaction (`mode=ro`),
    as `rowtable_arrow.read_snapshot` does (the same arguments); `on_table(table)` is called as
    soon as the block rows are a table, before the `segments` rows are made.

    Raises:
        NativeUnusable: a value that is not well-formed, an SQLite error, or no compiled reader.
        what `fixed` raised.
    """
    mod = _module()
    if mod is None:
        raise NativeUnusable("the compiled index reader is not built")
    got = mod.read(read_only_uri(path, immutable), fixed)
    if got is None:
        raise NativeUnusable("a value the compiled reader does not decide, or an SQLite error")
    table = _table(got, full)
    if on_table is not None:
        on_table(table)
    return Snapshot(table, _segment_rows(got))


def _table(got: dict, full: bool):
    """The `RowTable` of the columns the reader filled (in rowid order)."""
    n = int(got["rows"])
    cols = _Columns(0, full)
    runs = np.frombuffer(got["runs"], dtype=np.uint64).reshape(-1, 2)
    number = cols.segments.setdefault
    run_number = np.array([number(name, len(cols.segments)) for name in hex_of_keys(runs)], dtype=np.int32)
    run = np.frombuffer(got.pop("run"), dtype=np.int32)
    cols.cols = {"seg": run_number[run] if n else np.zeros(0, dtype=np.int32)}
    del run
    for key, dtype, width in (("hash", np.uint64, 2), ("parent", np.uint64, 2), ("digest", np.uint64, 2),
                              ("slot", np.int32, 1), ("num_tokens", np.int32, 1), ("nbytes", np.int32, 1),
                              ("created", np.float64, 1), ("last_access", np.float64, 1)):  # fmt: skip
        data = got.pop(key)
        if full or key not in _FULL_ONLY:
            arr = np.frombuffer(data, dtype=dtype)
            cols.cols[key] = arr.reshape(n, 2) if width == 2 else arr
    cols.n = n
    return cols.table()


def _segment_rows(got: dict) -> list[tuple[int, SegmentRow | None]]:
    """`(rowid, SegmentRow)` of every `segments` row, in name order (all well-formed: the reader
    returns nothing otherwise)."""
    names = hex_of_keys(np.frombuffer(got["segment_name"], dtype=np.uint64).reshape(-1, 2))
    cols = (np.frombuffer(got[k], dtype=t).tolist() for k, t in (("segment_rowid", np.int64), ("segment_nbytes", np.int64),
                                                                  ("segment_n_blocks", np.int64), ("segment_created", np.float64)))  # fmt: skip
    rowid, nbytes, n_blocks, created = cols
    return [(r, SegmentRow(name, nb, k, c)) for r, name, nb, k, c in zip(rowid, names, nbytes, n_blocks, created, strict=True)]


__all__ = ["read_snapshot", "available", "NativeUnusable"]
