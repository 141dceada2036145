"""Two connections to one index in one read snapshot: a pass over many rows split between two
threads (`kvtool.disk.rowtable.load_rows(also=...)`; SQLite runs without the GIL, so two cores
share the work).

Two read transactions see the same rows only if no transaction committed between their starts.
The proof: the WAL-index header (`kvtool.disk.names.wal_index_header`, which every commit
changes; sqlite.org/walformat.html) read before the first transaction began equals the one read
after the second began. Without WAL it holds by itself: under a rollback journal the first
reader's SHARED lock keeps every writer from committing, and an `immutable` index never changes.
Where it cannot be proven, there is no second connection and one thread reads everything.

`read_quietly` is how a read-only command reads an index: opened `quiet` (`BlockIndex`), it creates
no -wal / -shm beside an index that no process has open, and it reads again `mode=ro` (seeing every
committed transaction, the WAL's too) where a writer opened or changed the index meanwhile.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import TypeVar

from kvtool.disk import names
from kvtool.disk.index import BlockIndex

T = TypeVar("T")


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


def read_quietly(path: Path, read: Callable[[BlockIndex], T]) -> T:
    """`read(index)` on index `path` opened read-only and `quiet` (no -wal / -shm created beside
    an index no process has open); once more opened `mode=ro` if a process opened or changed the
    index meanwhile (what `read` got may be stale or torn). `read` may run twice: it starts afresh.

    Raises:
        sqlite3.Error: the index cannot be opened or read (not a database, corrupt, locked).
    """
    index: BlockIndex | None = None
    try:
        index = BlockIndex(path, create=False, read_only=True, quiet=True)
        result = read(index)
    except sqlite3.Error:
        if index is None or index.unchanged():
            raise
    else:
        if index.unchanged():
            return result
    finally:
        if index is not None:
            with suppress(sqlite3.Error):
                index.close()
    index = BlockIndex(path, create=False, read_only=True)
    try:
        return read(index)
    finally:
        with suppress(sqlite3.Error):
            index.close()


__all__ = ["read_snapshot", "read_quietly"]
