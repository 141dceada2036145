"""Two connections to one index in one read snapshot: a pass over many rows split between two
threads (`kvtool.disk.rowtable.load_rows(also=...)`; SQLite runs without the GIL, so two cores
share the work).

Two read transactions see the same rows only if no transaction committed between their starts.
The proof: the WAL-index header (`kvtool.disk.names.wal_index_header`, which every commit
changes; sqlite.org/walformat.html) read before the first transaction began equals the one read
after the second began. Without WAL it holds by itself: under a rollback journal the first
reader's SHARED lock keeps every writer from committing, and an `immutable` index never changes.
Where it cannot be proven, there is no second connection and one thread reads everything.

This module never imports MLX.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager

from kvtool.disk import names
from kvtool.disk.index import BlockIndex


@contextmanager
def read_snapshot(index: BlockIndex, pair: bool = False) -> Iterator[tuple[sqlite3.Connection, sqlite3.Connection | None]]:
    """A read transaction on `index`'s connection (its snapshot fixed here, by a first read), under
    the index's lock; with `pair`, also a second connection (`BlockIndex.open_reader`) whose read
    transaction is proven to see the very same snapshot (see the module docstring), else None.
    Both transactions end on exit.

    Raises:
        sqlite3.Error: the index cannot be read.
    """
    with index.connection() as conn:
        also = None
        wal = pair and not index.immutable and conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        before = names.wal_index_header(index.path) if wal else None
        conn.execute("BEGIN")
        try:
            conn.execute("SELECT COUNT(*) FROM meta").fetchone()  # the first read fixes the snapshot
            if pair and (before is not None or not wal):
                also = index.open_reader()
                also.execute("BEGIN")
                also.execute("SELECT COUNT(*) FROM meta").fetchone()
                if wal and names.wal_index_header(index.path) != before:  # a commit came between: one connection
                    also.close()
                    also = None
            yield conn, also
        finally:
            if also is not None:
                also.close()  # ends its read transaction
            conn.execute("COMMIT")


__all__ = ["read_snapshot"]
