"""SQLite index of one namespace: which blocks exist, where, and when they were last used.

One database per namespace (`<cache_dir>/<layout_key>/index.sqlite`), in WAL mode so readers
never block the writer and several processes can share it (`busy_timeout`). Every write is
its own short transaction; a crash loses at most the last uncommitted one (`synchronous=NORMAL`)
or nothing that was committed (`synchronous=FULL`, the `durable` mode).

Access-time updates are the hot path of a cache hit, so they are buffered in memory and
committed in one transaction by `flush()`, or by the next `touch()` once the oldest buffered
update is older than `flush_interval_s` (seed 000: batched index flush).

This module never imports MLX (the SSD writer thread calls it).
"""

from __future__ import annotations

import sqlite3
import threading
import time
from contextlib import contextmanager
from dataclasses import astuple, dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

INDEX_FILENAME = "index.sqlite"
DEFAULT_BUSY_TIMEOUT_MS = 10_000
_MAX_VARS = 500  # host parameters per statement (well below SQLite's limit)

SCHEMA = """
CREATE TABLE IF NOT EXISTS blocks (
    hash TEXT PRIMARY KEY,
    parent TEXT,
    path TEXT,
    num_tokens INT,
    nbytes INT,
    tokens_digest TEXT,
    created REAL,
    last_access REAL
);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT);
CREATE INDEX IF NOT EXISTS blocks_last_access ON blocks(last_access);
"""
_COLUMNS = "hash, parent, path, num_tokens, nbytes, tokens_digest, created, last_access"


@dataclass(frozen=True)
class IndexRow:
    """One row of `blocks`.

    Attributes:
        hash: block chain hash (hex, primary key).
        parent: parent block hash (hex).
        path: block file path relative to the namespace directory.
        num_tokens: tokens in the block.
        nbytes: size of the block file (bytes).
        tokens_digest: `blockfile.tokens_digest` of the block's token ids.
        created: unix seconds when the file was written.
        last_access: unix seconds of the last save/load (batched, may lag by flush_interval_s).
    """

    hash: str
    parent: str
    path: str
    num_tokens: int
    nbytes: int
    tokens_digest: str
    created: float
    last_access: float


class BlockIndex:
    """The SQLite index of one namespace. Thread-safe: one connection guarded by a lock.

    Args:
        path: the database file (created with the schema if absent, unless `create=False`).
        durable: `synchronous=FULL` (every commit reaches stable storage) instead of NORMAL.
        flush_interval_s: max age of a buffered access-time update before `touch` commits.
        create: create the schema; False opens an existing index without writing to it.
        clock: time source for the flush interval (seconds).
        initial_meta: meta written in the same transaction as the schema, only if the index
            has no `format_version` yet; a namespace is then never visible half-created (a
            kill between schema and meta would leave an index no tool could classify).
            `created_meta` tells whether this open wrote it.

    Raises:
        sqlite3.Error: the database cannot be opened (locked past the busy timeout, corrupt,
            not a database, unwritable directory).
    """

    def __init__(
        self,
        path: Path,
        durable: bool = False,
        *,
        flush_interval_s: float = 1.0,
        create: bool = True,
        clock: Callable[[], float] = time.time,
        initial_meta: dict[str, str] | None = None,
    ):
        self.path = Path(path)
        self.created_meta = False
        self.flush_interval_s = flush_interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._pending: dict[str, float] = {}
        self._pending_since: float | None = None
        self._conn = sqlite3.connect(
            str(self.path), timeout=DEFAULT_BUSY_TIMEOUT_MS / 1000, isolation_level=None, check_same_thread=False
        )
        try:
            self._conn.execute(f"PRAGMA busy_timeout={DEFAULT_BUSY_TIMEOUT_MS}")
            if create:
                self._conn.execute("PRAGMA journal_mode=WAL")
                with self._transaction() as cur:
                    for stmt in SCHEMA.split(";"):
                        if stmt.strip():
                            cur.execute(stmt)
                    if initial_meta and cur.execute("SELECT 1 FROM meta WHERE key='format_version'").fetchone() is None:
                        cur.executemany("INSERT OR REPLACE INTO meta(key, value) VALUES (?, ?)", list(initial_meta.items()))
                        self.created_meta = True
            self._conn.execute(f"PRAGMA synchronous={'FULL' if durable else 'NORMAL'}")
        except BaseException:
            self._conn.close()
            raise

    # ------------------------------------------------------------------ plumbing
    def _transaction(self):
        return _transaction(self._conn)

    def close(self) -> None:
        """Commit buffered touches (best effort) and close the connection. Idempotent."""
        with self._lock:
            if self._conn is None:
                return
            try:
                self._flush_locked()
            finally:
                self._conn.close()
                self._conn = None  # type: ignore[assignment]

    # --------------------------------------------------------------------- reads
    def get(self, block_hash: str) -> IndexRow | None:
        """The row of `block_hash`, or None."""
        with self._lock:
            row = self._conn.execute(f"SELECT {_COLUMNS} FROM blocks WHERE hash=?", (block_hash,)).fetchone()
        return IndexRow(*row) if row else None

    def contains(self, block_hash: str) -> bool:
        """True if `block_hash` has a row."""
        with self._lock:
            return self._conn.execute("SELECT 1 FROM blocks WHERE hash=?", (block_hash,)).fetchone() is not None

    def present(self, hashes: Sequence[str]) -> set[str]:
        """The subset of `hashes` that have rows."""
        found: set[str] = set()
        with self._lock:
            for i in range(0, len(hashes), _MAX_VARS):
                chunk = list(hashes[i : i + _MAX_VARS])
                marks = ",".join("?" * len(chunk))
                found.update(r[0] for r in self._conn.execute(f"SELECT hash FROM blocks WHERE hash IN ({marks})", chunk))
        return found

    def count_prefix(self, hashes: Sequence[str]) -> int:
        """How many leading `hashes` have rows (stops at the first absent one)."""
        found = self.present(hashes)
        n = 0
        for h in hashes:
            if h not in found:
                break
            n += 1
        return n

    def rows(self) -> Iterator[IndexRow]:
        """Every row (a snapshot taken when called, ordered by hash)."""
        with self._lock:
            rows = self._conn.execute(f"SELECT {_COLUMNS} FROM blocks ORDER BY hash").fetchall()
        return (IndexRow(*r) for r in rows)

    def totals(self) -> tuple[int, int]:
        """(number of blocks, sum of file sizes in bytes)."""
        with self._lock:
            n, size = self._conn.execute("SELECT COUNT(*), COALESCE(SUM(nbytes), 0) FROM blocks").fetchone()
        return int(n), int(size)

    def initialized(self) -> bool:
        """True if the schema exists and the meta holds a `format_version` (read-only check)."""
        with self._lock:
            has_meta = self._conn.execute(
                "SELECT 1 FROM sqlite_master WHERE type='table' AND name='meta'"
            ).fetchone()
            return bool(has_meta) and self._conn.execute(
                "SELECT 1 FROM meta WHERE key='format_version'"
            ).fetchone() is not None

    def get_meta(self) -> dict[str, str]:
        """All meta key/values."""
        with self._lock:
            return dict(self._conn.execute("SELECT key, value FROM meta").fetchall())

    # -------------------------------------------------------------------- writes
    def set_meta(self, values: dict[str, str]) -> None:
        """Upsert meta keys in one transaction."""
        with self._lock, self._transaction() as cur:
            cur.executemany("INSERT OR REPLACE INTO meta(key, value) VALUES (?, ?)", list(values.items()))

    def insert(self, row: IndexRow, replace: bool = True) -> bool:
        """Insert a row (call only after its file is complete and in place).

        Args:
            row: the row.
            replace: overwrite an existing row of the same hash (else keep it).

        Returns:
            True if the row was written.
        """
        verb = "INSERT OR REPLACE" if replace else "INSERT OR IGNORE"
        with self._lock, self._transaction() as cur:
            cur.execute(f"{verb} INTO blocks({_COLUMNS}) VALUES (?,?,?,?,?,?,?,?)", astuple(row))
            return cur.rowcount > 0

    def delete(self, hashes: Iterable[str]) -> int:
        """Delete rows in one transaction; returns how many existed."""
        hashes = list(hashes)
        with self._lock:
            for h in hashes:
                self._pending.pop(h, None)
            with self._transaction() as cur:
                n = 0
                for i in range(0, len(hashes), _MAX_VARS):
                    chunk = hashes[i : i + _MAX_VARS]
                    cur.execute(f"DELETE FROM blocks WHERE hash IN ({','.join('?' * len(chunk))})", chunk)
                    n += cur.rowcount
        return n

    def touch(self, block_hash: str, t: float) -> None:
        """Buffer an access-time update; commits the buffer if its oldest entry is overdue.

        Raises:
            sqlite3.Error: only from an automatic flush (the buffer is kept for a retry).
        """
        with self._lock:
            self._pending[block_hash] = max(t, self._pending.get(block_hash, t))
            now = self._clock()
            if self._pending_since is None:
                self._pending_since = now
            elif now - self._pending_since >= self.flush_interval_s:
                self._flush_locked()

    def flush(self) -> int:
        """Commit buffered access-time updates in one transaction; returns how many.

        Raises:
            sqlite3.Error: the commit failed (the buffer is kept for a retry).
        """
        with self._lock:
            return self._flush_locked()

    def _flush_locked(self) -> int:
        if not self._pending:
            return 0
        items = [(t, h) for h, t in self._pending.items()]
        with self._transaction() as cur:
            cur.executemany("UPDATE blocks SET last_access=MAX(COALESCE(last_access, 0), ?) WHERE hash=?", items)
        self._pending.clear()
        self._pending_since = None
        return len(items)


@contextmanager
def _transaction(conn: sqlite3.Connection) -> Iterator[sqlite3.Cursor]:
    """`BEGIN IMMEDIATE` ... `COMMIT`; `ROLLBACK` if the body or the commit fails."""
    cur = conn.cursor()
    cur.execute("BEGIN IMMEDIATE")
    try:
        yield cur
        conn.execute("COMMIT")
    except BaseException:
        try:
            conn.execute("ROLLBACK")
        except sqlite3.Error:
            pass
        raise
