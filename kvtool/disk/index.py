"""SQLite index of one namespace: which blocks exist, in which segment, and when they were used.

One database per namespace (`<cache_dir>/<layout_key>/index.sqlite`), in WAL mode so readers
never block the writer and several processes can share it (`busy_timeout`). A segment's rows
and its `segments` row are inserted in one transaction, after the file is in place; a crash
loses at most the last uncommitted transaction (`synchronous=NORMAL`) or nothing that was
committed (`synchronous=FULL`, the `durable` mode).

Every value read from the database is checked in one place (`IndexRow.from_db`): a row whose
hash, parent or segment is not well-formed, or whose numbers are NULL, text or out of range,
is never returned as a row (`scan()` reports it), so no tampered value reaches a path or a
calculation (docs/design.md#threat-model).

Access-time updates are the hot path of a cache hit, so they are buffered in memory and
committed in one transaction by `flush()`, or by the next `touch_many()` once the oldest buffered
update is older than `flush_interval_s` (batched index flush). A stored access time
in the future (clock skew, tampering) is clamped to now on the next touch. Prefix lookups'
rows are kept per process, exactly (`kvtool.disk.row_cache`).
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import astuple
from pathlib import Path

from kvtool.disk.fsops import dir_owner, give_to
from kvtool.disk.names import INDEX_FILENAME, irregular_index_file, is_segment_name, quiet_signature
from kvtool.disk.row_cache import RowCache
from kvtool.disk.rowtable import IndexRow, SegmentRow

DEFAULT_BUSY_TIMEOUT_MS = 10_000
FUTURE_SKEW_S = 60.0  # an access time further ahead than this is clamped to now
_MAX_VARS = 500  # host parameters per statement (well below SQLite's limit)

SCHEMA = """
CREATE TABLE IF NOT EXISTS blocks (
    hash TEXT PRIMARY KEY NOT NULL,
    parent TEXT NOT NULL,
    segment TEXT NOT NULL,
    slot INTEGER NOT NULL,
    num_tokens INTEGER NOT NULL,
    nbytes INTEGER NOT NULL,
    tokens_digest TEXT NOT NULL,
    created REAL NOT NULL,
    last_access REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS segments (
    name TEXT PRIMARY KEY NOT NULL,
    nbytes INTEGER NOT NULL,
    n_blocks INTEGER NOT NULL,
    created REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT);
CREATE TABLE IF NOT EXISTS reservations (
    name TEXT PRIMARY KEY NOT NULL,
    nbytes INTEGER NOT NULL,
    pid INTEGER NOT NULL,
    created REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS blocks_last_access ON blocks(last_access);
CREATE INDEX IF NOT EXISTS blocks_segment ON blocks(segment);
CREATE INDEX IF NOT EXISTS blocks_parent ON blocks(parent, last_access);
"""
# The removal journal (`kvtool prune`, `kvtool rm --prompt`): the segment files a removal left
# without rows, recorded in the same transaction as the row deletions and forgotten once unlinked.
# A removal killed in between is finished by `kvtool validate` (never re-adopted). Created when a
# removal first writes to it: an index without it has no removal pending.
REMOVALS_SCHEMA = "CREATE TABLE IF NOT EXISTS removals (name TEXT PRIMARY KEY NOT NULL, created REAL NOT NULL)"
_COLUMNS = "hash, parent, segment, slot, num_tokens, nbytes, tokens_digest, created, last_access"
_SEG_COLUMNS = "name, nbytes, n_blocks, created"

__all__ = ["BlockIndex", "INDEX_FILENAME"]


def index_uri(path: Path, mode: str = "ro", immutable: bool = False) -> str:
    """The SQLite URI that opens index `path` in `mode` ('ro': read-only; 'rw': read-write, never
    created; `immutable=1`: no -wal / -shm used); the path is percent-quoted ('?' or '#' in a
    directory name)."""
    return f"file:{urllib.parse.quote(str(path))}?mode={mode}" + ("&immutable=1" if immutable else "")


class BlockIndex:
    """The SQLite index of one namespace. Thread-safe: one connection guarded by a lock.

    Args:
        path: the database file (created with the schema if absent, unless `create=False`).
        durable: `synchronous=FULL` (every commit reaches stable storage) instead of NORMAL.
        flush_interval_s: max age of a buffered access-time update before `touch_many` commits.
        create: create the schema; False opens an existing index without writing to it.
        clock: time source for access times and the flush interval (seconds).
        initial_meta: meta written in the same transaction as the schema, only if the index
            has no `format_version` yet; a namespace is then never visible half-created.
            `created_meta` tells whether this open wrote it.
        read_only: open with `mode=ro` (a cache the process cannot write), or `immutable=1`
            where even the -wal / -shm files cannot be created (`immutable` tells).
        quiet: with `read_only`, open an index no process has open (no side file) `immutable=1`:
            no -wal / -shm created; `unchanged()` tells whether a writer came since (then reread).

    Raises:
        sqlite3.Error: the database cannot be opened (locked past the busy timeout, corrupt,
            not a database, unwritable directory), or it or one of its side files is not a
            regular file (`irregular_index_file`: never opened, so never followed nor blocked on).
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
        read_only: bool = False,
        quiet: bool = False,
    ):
        self.path = Path(path)
        self.created_meta = False
        self.read_only = read_only
        self.flush_interval_s = flush_interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._pending: dict[str, float] = {}
        self._pending_since: float | None = None
        self.row_cache = RowCache()  # get_many's rows
        if (bad := irregular_index_file(self.path)) is not None:
            raise sqlite3.OperationalError(f"{bad} is not a regular file (FIFO, symlink, device?): never opened")
        self._quiet = quiet_signature(self.path) if read_only and quiet else None
        self.immutable = self._quiet is not None
        self._conn = self._connect(read_only, self.immutable)
        if read_only and not self.immutable:
            self._conn = self._read_only_fallback()
        try:
            self._conn.execute(f"PRAGMA busy_timeout={DEFAULT_BUSY_TIMEOUT_MS}")
            if create and not read_only:
                self._conn.execute("PRAGMA journal_mode=WAL")
                with self._transaction() as cur:
                    for stmt in SCHEMA.split(";"):
                        if stmt.strip():
                            cur.execute(stmt)
                    if initial_meta and cur.execute("SELECT 1 FROM meta WHERE key='format_version'").fetchone() is None:
                        cur.executemany("INSERT OR REPLACE INTO meta(key, value) VALUES (?, ?)", list(initial_meta.items()))
                        self.created_meta = True
            self._conn.execute(f"PRAGMA synchronous={'FULL' if durable else 'NORMAL'}")
            if not read_only:  # root writing into a user's cache: the user keeps owning the index
                self._give_to(dir_owner(self.path.parent))
        except BaseException:
            self._conn.close()
            raise

    def _give_to(self, owner: tuple[int, int] | None) -> None:
        """chown the index and its -wal / -shm to `owner` where they belong to someone else."""
        if owner is None:
            return
        for name in ("", "-wal", "-shm"):
            with suppress(FileNotFoundError):
                if os.lstat(f"{self.path}{name}").st_uid != owner[0]:
                    give_to(owner, f"{self.path}{name}")

    def _connect(self, read_only: bool, immutable: bool = False) -> sqlite3.Connection:
        """A connection: read-write, or read-only (`mode=ro`; `immutable=1`: no -wal / -shm used)."""
        target = index_uri(self.path, immutable=immutable) if read_only else str(self.path)
        return sqlite3.connect(target, timeout=DEFAULT_BUSY_TIMEOUT_MS / 1000, isolation_level=None,
                               check_same_thread=False, uri=read_only)  # fmt: skip

    def _read_only_fallback(self) -> sqlite3.Connection:
        """The read-only connection, checked with one read. A WAL index whose `-shm` cannot be
        created (a read-only mount, another user's directory) cannot be read `mode=ro`: it is then
        opened `immutable=1` (its -wal ignored: at worst rows are stale; block reads are verified).

        Raises:
            sqlite3.Error: neither way reads it (not a database, corrupt, absent).
        """
        try:
            self._conn.execute("SELECT 1 FROM sqlite_master LIMIT 1").fetchall()
            return self._conn
        except sqlite3.OperationalError as exc:
            code = getattr(exc, "sqlite_errorcode", None)
            self._conn.close()
            if not isinstance(code, int) or code & 0xFF not in (sqlite3.SQLITE_READONLY, sqlite3.SQLITE_CANTOPEN):
                raise
        conn = self._connect(True, immutable=True)
        try:
            conn.execute("SELECT 1 FROM sqlite_master LIMIT 1").fetchall()
        except BaseException:
            conn.close()
            raise
        self.immutable = True
        return conn

    # ------------------------------------------------------------------ plumbing
    @contextmanager
    def _transaction(self, rows_kept: bool = False) -> Iterator[sqlite3.Cursor]:
        """`BEGIN IMMEDIATE` ... `COMMIT`; `ROLLBACK` if the body or the commit fails. Empties the
        row cache unless `rows_kept` (the caller drops what it changes), and always on failure."""
        cur = self._conn.cursor()
        cur.execute("BEGIN IMMEDIATE")
        try:
            yield cur
            self._conn.execute("COMMIT")
        except BaseException:
            self.row_cache.clear()
            with suppress(sqlite3.Error):
                self._conn.execute("ROLLBACK")
            raise
        if not rows_kept:
            self.row_cache.clear()

    def close(self) -> None:
        """Commit buffered touches (best effort) and close the connection. Idempotent."""
        with self._lock:
            if self._conn is None:
                return
            try:
                if not self.read_only:
                    self._flush_locked()
            finally:
                self._conn.close()
                self._conn = None  # type: ignore[assignment]  # closed: every other use runs while open

    def unchanged(self) -> bool:
        """False if this index was opened `quiet` and a process has opened or changed it since."""
        return self._quiet is None or quiet_signature(self.path) == self._quiet

    def __enter__(self) -> BlockIndex:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def connection(self) -> Iterator[sqlite3.Connection]:
        """The connection, under the index's lock: for a statement the methods here do not make
        (`kvtool.disk.rowtable.load_rows`, one pass over many rows). Do not commit through it."""
        with self._lock:
            yield self._conn

    def open_reader(self) -> sqlite3.Connection:
        """A second connection to the index, opened as this one was (read-write, `mode=ro` or
        `immutable=1`): for a reader in another thread (`kvtool.disk.snapshot`). The caller closes it.

        Raises:
            sqlite3.Error: it cannot be opened.
        """
        conn = self._connect(self.read_only, self.immutable)
        conn.execute(f"PRAGMA busy_timeout={DEFAULT_BUSY_TIMEOUT_MS}")
        return conn

    def _select_rows(self, where: str, args: Sequence[object]) -> list[IndexRow]:
        rows = self._conn.execute(f"SELECT {_COLUMNS} FROM blocks WHERE {where}", list(args)).fetchall()
        return [r for r in (IndexRow.from_db(v) for v in rows) if r is not None]

    # --------------------------------------------------------------------- reads
    def get(self, block_hash: str) -> IndexRow | None:
        """The well-formed row of `block_hash`, or None."""
        with self._lock:
            rows = self._select_rows("hash=?", (block_hash,))
        return rows[0] if rows else None

    def get_many(self, hashes: Sequence[str]) -> dict[str, IndexRow]:
        """Well-formed rows of `hashes`: hash -> row; from the row cache where it has them (a
        row's `last_access` may then be older than the database's), else one query per 500."""
        with self._lock:
            version = self._conn.execute("PRAGMA data_version").fetchone()[0]
            out, missing = self.row_cache.lookup(version, hashes)
            for i in range(0, len(missing), _MAX_VARS):
                chunk = missing[i : i + _MAX_VARS]
                read = self._select_rows(f"hash IN ({','.join('?' * len(chunk))})", chunk)
                self.row_cache.add(read)
                out.update((row.hash, row) for row in read)
        return out

    def children(self, parent: str, limit: int) -> list[IndexRow]:
        """Up to `limit` well-formed rows whose parent is `parent`, most recently used first
        (one query on the `blocks_parent` index): the siblings of a partial-block prefix hit."""
        with self._lock:
            return self._select_rows("parent=? ORDER BY last_access DESC LIMIT ?", (parent, int(limit)))

    def present(self, hashes: Sequence[str]) -> set[str]:
        """The subset of `hashes` that have well-formed rows."""
        return set(self.get_many(hashes))

    def segment_rows(self, name: str) -> list[IndexRow]:
        """The well-formed rows stored in segment `name`, by slot."""
        with self._lock:
            return self._select_rows("segment=? ORDER BY slot", (name,))

    def segments(self) -> list[SegmentRow]:
        """The well-formed `segments` rows, in name order (malformed ones left out)."""
        with self._lock:
            rows = self._conn.execute(f"SELECT {_SEG_COLUMNS} FROM segments ORDER BY name").fetchall()
        return [s for s in map(SegmentRow.from_db, rows) if s is not None]

    def totals(self) -> tuple[int, int]:
        """(number of block rows, sum of segment file sizes in bytes)."""
        with self._lock:
            (n,) = self._conn.execute("SELECT COUNT(*) FROM blocks").fetchone()
            (size,) = self._conn.execute(
                "SELECT COALESCE(SUM(CASE WHEN typeof(nbytes)='integer' AND nbytes > 0 THEN nbytes END), 0) FROM segments"
            ).fetchone()
        return int(n), int(size)

    def initialized(self) -> bool:
        """True if the schema exists and the meta holds a `format_version` (read-only check)."""
        with self._lock:
            return _has_table(self._conn, "meta") and self._conn.execute(
                "SELECT 1 FROM meta WHERE key='format_version'"
            ).fetchone() is not None

    def get_meta(self) -> dict[str, str]:
        """All meta key/values (non-string values are turned into strings)."""
        with self._lock:
            return {str(k): str(v) for k, v in self._conn.execute("SELECT key, value FROM meta").fetchall() if k is not None}

    # -------------------------------------------------------------------- writes
    def set_meta(self, values: dict[str, str]) -> None:
        """Upsert meta keys in one transaction."""
        with self._lock, self._transaction() as cur:
            cur.executemany("INSERT OR REPLACE INTO meta(key, value) VALUES (?, ?)", list(values.items()))

    def insert_segment(self, segment: SegmentRow, rows: Sequence[IndexRow], release: bool = False) -> None:
        """Insert a segment and its block rows in one transaction (call after the file is in
        place). A block row replaces an existing row of the same hash. `release`: the segment's
        byte reservation (`kvtool.disk.budget`) ends in the same transaction."""
        with self._lock, self._transaction(rows_kept=True) as cur:
            cur.execute(f"INSERT OR REPLACE INTO segments({_SEG_COLUMNS}) VALUES (?,?,?,?)", astuple(segment))
            cur.executemany(f"INSERT OR REPLACE INTO blocks({_COLUMNS}) VALUES (?,?,?,?,?,?,?,?,?)", rows)
            self.row_cache.drop(row[0] for row in rows)
            if release:
                cur.execute("DELETE FROM reservations WHERE name=?", (segment.name,))

    @contextmanager
    def write_transaction(self) -> Iterator[sqlite3.Cursor]:
        """One `BEGIN IMMEDIATE` transaction under the index's lock: the database's write lock is
        held (every process sharing the index waits) from the first statement to the commit, so
        a read-decide-write sequence (`kvtool.disk.budget`) sees no other writer. Buffered
        access times are committed first. Rolled back if the body raises.

        Raises:
            sqlite3.Error: the transaction could not start or commit (busy past the timeout).
        """
        with self._lock:
            self._flush_locked()
            with self._transaction() as cur:
                yield cur

    def delete(self, hashes: Iterable[str], journal: bool = False) -> tuple[int, list[str]]:
        """Delete block rows in one transaction; segments left without rows go too.

        Args:
            hashes: the blocks to delete.
            journal: record the segments left without rows in the removal journal
                (`REMOVALS_SCHEMA`) in the same transaction; `forget_removals` once unlinked.

        Returns:
            `(rows deleted, names of the segments removed from the index)`; unlink their files
            after this returns (a row never outlives its file's index entry).
        """
        hashes = list(hashes)
        with self._lock:
            for h in hashes:
                self._pending.pop(h, None)
            with self._transaction() as cur:
                n, touched = 0, set[str]()
                for i in range(0, len(hashes), _MAX_VARS):
                    chunk = hashes[i : i + _MAX_VARS]
                    marks = ",".join("?" * len(chunk))
                    touched.update(r[0] for r in cur.execute(f"SELECT DISTINCT segment FROM blocks WHERE hash IN ({marks})", chunk))
                    cur.execute(f"DELETE FROM blocks WHERE hash IN ({marks})", chunk)
                    n += cur.rowcount
                emptied = self._drop_empty_segments(cur, touched)
                if journal and emptied:
                    self._journal(cur, emptied)
        return n, emptied

    def _journal(self, cur: sqlite3.Cursor, names: Sequence[str]) -> None:
        cur.execute(REMOVALS_SCHEMA)
        now = self._clock()
        cur.executemany("INSERT OR REPLACE INTO removals(name, created) VALUES (?, ?)", [(n, now) for n in names])

    def removals(self) -> list[str]:
        """The segment names of the removal journal (well-formed ones, sorted; [] without a
        journal): files a removal took the rows of and may not have unlinked yet."""
        with self._lock:
            if not _has_table(self._conn, "removals"):
                return []
            names = [r[0] for r in self._conn.execute("SELECT name FROM removals ORDER BY name")]
        return [n for n in names if is_segment_name(n)]

    def forget_removals(self, names: Iterable[str]) -> None:
        """Drop `names` from the removal journal (their files are gone), in one transaction; also
        any malformed entry. No-op without a journal."""
        names = list(names)
        with self._lock, self._transaction() as cur:
            if not _has_table(cur, "removals"):
                return
            cur.executemany("DELETE FROM removals WHERE name=?", [(n,) for n in names])
            cur.execute("DELETE FROM removals WHERE typeof(name) != 'text' OR length(name) != 32")

    def delete_rowids(self, block_rowids: Sequence[int], segment_rowids: Sequence[int] = ()) -> int:
        """Delete malformed rows by rowid (see `scan`); returns block rows deleted."""
        with self._lock, self._transaction() as cur:
            cur.executemany("DELETE FROM blocks WHERE rowid=?", [(r,) for r in block_rowids])
            n = cur.rowcount
            cur.executemany("DELETE FROM segments WHERE rowid=?", [(r,) for r in segment_rowids])
        return max(n, 0)

    def delete_segments(self, names: Iterable[str], journal: bool = False) -> int:
        """Delete segments and every block row stored in them, in one transaction (`journal`:
        recording them in the removal journal in the same transaction, as `delete`).

        Returns:
            Block rows deleted.
        """
        names = list(names)
        with self._lock:
            with self._transaction() as cur:
                gone = [r[0] for name in names for r in cur.execute("SELECT hash FROM blocks WHERE segment=?", (name,))]
                cur.executemany("DELETE FROM blocks WHERE segment=?", [(s,) for s in names])
                cur.executemany("DELETE FROM segments WHERE name=?", [(s,) for s in names])
                if journal and names:
                    self._journal(cur, [n for n in names if is_segment_name(n)])
            for h in gone:
                self._pending.pop(h, None)
        return len(gone)

    @staticmethod
    def _drop_empty_segments(cur: sqlite3.Cursor, names: Iterable[object]) -> list[str]:
        emptied = []
        for name in names:
            if cur.execute("SELECT 1 FROM blocks WHERE segment=? LIMIT 1", (name,)).fetchone() is None:
                cur.execute("DELETE FROM segments WHERE name=?", (name,))
                if is_segment_name(name):
                    emptied.append(str(name))
        return emptied

    def touch_many(self, hashes: Iterable[str], t: float | None = None) -> None:
        """Buffer access-time updates (`t`, default now); commits the buffer if its oldest entry
        is overdue.

        Raises:
            sqlite3.Error: only from an automatic flush (the buffer is kept for a retry).
        """
        with self._lock:
            now = self._clock()
            t = now if t is None else t
            pending = self._pending
            for h in hashes:
                old = pending.get(h)
                pending[h] = t if old is None or old < t else old
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
        if not self._pending or self.read_only:
            self._pending.clear()
            return 0
        limit = self._clock() + FUTURE_SKEW_S
        items = [(t, limit, h) for h, t in self._pending.items()]
        with self._transaction(rows_kept=True) as cur:
            cur.executemany(
                "UPDATE blocks SET last_access = CASE WHEN typeof(last_access) NOT IN ('real', 'integer')"
                " OR last_access < ?1 OR last_access > ?2 THEN ?1 ELSE last_access END WHERE hash=?3",
                items,
            )
        self._pending.clear()
        self._pending_since = None
        return len(items)


def _has_table(conn: sqlite3.Connection | sqlite3.Cursor, name: str) -> bool:
    return conn.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name=?", (name,)).fetchone() is not None
