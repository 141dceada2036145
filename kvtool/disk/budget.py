"""The SSD tier's byte budget (`ssd_max_bytes`): one namespace directory kept within a size while
serving, across every process that writes it (docs/design.md#ssd-byte-budget).

What counts is what `du` counts: segment files (rounded up to the file system's block), the
index and its `-wal` / `-shm`, and the directories. Processes agree through the namespace's
SQLite index: before a segment file is created its writer *reserves* its bytes (`reserve`, one
`BEGIN IMMEDIATE` transaction), evicting least recently used segments with the planner `kvtool
prune` uses (`kvtool.disk.planner`) when it does not fit; segments used in the last `protect_s`
seconds are never evicted, and a segment that cannot fit even so is refused (the save answers
'refused': the budget at work, not a failure). Evicted rows go in that transaction, their files
stay reserved until unlinked right after it. The writer's reservation ends in the transaction
that inserts its rows (`BlockIndex.insert_segment(release=True)`), or when the write fails
(`release`); those of a dead process or older than `STALE_RESERVATION_S` are dropped by the next
`reserve`. The index's WAL counts too: a budgeted store keeps it small (`WAL_LIMIT_BYTES`).
"""

from __future__ import annotations

import logging
import math
import os
import sqlite3
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvtool.disk.chains import build_forest, key_of_hex
from kvtool.disk.fsops import FileOps, pid_alive
from kvtool.disk.index import BlockIndex
from kvtool.disk.names import INDEX_FILENAME, SUBDIR_RE, is_segment_name
from kvtool.disk.planner import SegmentPlanner, fit_budget
from kvtool.disk.rowtable import load_rows
from kvtool.hashing import root_parent

log = logging.getLogger("kvtool.disk.namespace")

DEFAULT_PROTECT_S = 3.0  # rows used this recently are never evicted (> the 1 s access-time flush)
EVICT_SLACK = 0.05  # an eviction frees down to this fraction below the budget (fewer evictions)
STALE_RESERVATION_S = 600.0  # a reservation this old is a leftover (as temp files)
REFUSAL_LOG_INTERVAL_S = 60.0
WAL_CHECKPOINT_PAGES = 64  # the index's WAL is checkpointed at this many pages (SQLite's default: 1000)
WAL_LIMIT_BYTES = 256 << 10  # and truncated to this after a checkpoint: it counts against the budget
_MAX_VARS = 500  # host parameters per statement (as the index's)


@dataclass
class Eviction:
    """What one `reserve` evicted.

    Attributes:
        segments: segment files evicted.
        blocks: block rows deleted (their descendants in kept segments included).
        nbytes: bytes of the evicted files (rounded to the file system's block).
    """

    segments: int = 0
    blocks: int = 0
    nbytes: int = 0


class SSDBudget:
    """The byte budget of one namespace directory (see the module docstring). Thread-safe through
    the index's lock; one per `SSDStore`.

    Args:
        max_bytes: the most bytes the namespace directory may hold (as `du` counts them).
        namespace_dir: the namespace directory.
        index: its (writable) index.
        fs: file-system operations (unlinks).
        seg_path: segment name -> its path.
        clock: time source (unix seconds).
        protect_s: segments with rows used this recently are never evicted (seconds).
        on_evict: called with each `Eviction` (counters).

    Raises:
        ValueError: `max_bytes` is negative.
    """

    def __init__(
        self, max_bytes: int, namespace_dir: Path, index: BlockIndex, fs: FileOps, seg_path: Callable[[str], Path],
        *, clock: Callable[[], float] = time.time, protect_s: float = DEFAULT_PROTECT_S,
        on_evict: Callable[[Eviction], None] | None = None,
    ):  # fmt: skip
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = int(max_bytes)
        self.namespace_dir = Path(namespace_dir)
        self.protect_s = protect_s
        self.evict_slack = EVICT_SLACK  # an eviction frees this fraction of the budget beyond the need
        self._index, self._fs, self._seg_path, self._clock = index, fs, seg_path, clock
        self._on_evict = on_evict
        self._root = key_of_hex(root_parent(self.namespace_dir.name))
        self._unreleased: set[str] = set()  # evicted files unlinked whose reservation is still in
        self._last_refusal_log = -REFUSAL_LOG_INTERVAL_S
        try:
            self.block = max(512, os.statvfs(self.namespace_dir).f_frsize)
        except OSError:
            self.block = 4096
        with index.connection() as conn:  # the WAL is part of the directory: keep it small
            conn.execute(f"PRAGMA wal_autocheckpoint={WAL_CHECKPOINT_PAGES}")
            conn.execute(f"PRAGMA journal_size_limit={WAL_LIMIT_BYTES}")

    def allocated(self, nbytes: int) -> int:
        """`nbytes` rounded up to the file system's block (what a file of that size occupies)."""
        return -(-int(nbytes) // self.block) * self.block

    def reserve(self, name: str, nbytes: int) -> bool:
        """Reserve the bytes of segment `name` (`nbytes`, its file size) before writing it,
        evicting least recently used segments if it does not fit.

        Returns:
            True if reserved (write the file, then insert its rows with `release=True`, or call
            `release`); False if the segment cannot fit (nothing reserved).

        Raises:
            sqlite3.Error: the index could not be read or written.
        """
        need = self.allocated(nbytes)
        evicted: list[str] = []
        outcome = Eviction()
        self._trim_wal()
        with self._index.write_transaction() as cur:
            now = self._clock()
            self._drop_stale(cur, now)
            used = self._used(cur) + self._overhead()
            if used + need > self.max_bytes:
                evicted = self._evict(cur, used, need, now, outcome)
                used -= outcome.nbytes
            fits = used + need <= self.max_bytes
            if fits:
                cur.execute("INSERT OR REPLACE INTO reservations(name, nbytes, pid, created) VALUES (?,?,?,?)",
                            (name, need, os.getpid(), now))  # fmt: skip
        self._unlink(evicted)
        if outcome.segments and self._on_evict is not None:
            self._on_evict(outcome)
        if not fits:
            self._log_refusal(need, used)
        return fits

    def release(self, name: str) -> None:
        """End the reservation of a segment whose write failed. Never raises."""
        try:
            with self._index.write_transaction() as cur:
                cur.execute("DELETE FROM reservations WHERE name=?", (name,))
        except sqlite3.Error as exc:
            log.warning("could not release the byte reservation of %s: %s", name, exc)

    def used_bytes(self) -> int:
        """Bytes the namespace holds by the budget's count now (segments, reservations, index,
        directories).

        Raises:
            sqlite3.Error: the index could not be read.
        """
        with self._index.connection() as conn:
            return self._used(conn.cursor()) + self._overhead()

    def _trim_wal(self) -> None:
        """Checkpoint the index's WAL and truncate it when it outgrew `WAL_LIMIT_BYTES` (writers
        in several processes keep it from being reset by SQLite's own checkpoints). Best effort:
        a checkpoint that cannot finish (a reader still in the log) is simply left for later."""
        with suppress(OSError, sqlite3.Error):
            if os.lstat(self.namespace_dir / (INDEX_FILENAME + "-wal")).st_size <= WAL_LIMIT_BYTES:
                return
            with self._index.connection() as conn:
                conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()

    # ------------------------------------------------------------------ inside the transaction
    def _used(self, cur: sqlite3.Cursor) -> int:
        b = self.block
        (segs,) = cur.execute(
            "SELECT COALESCE(SUM((nbytes + ?1 - 1) / ?1 * ?1), 0) FROM segments WHERE typeof(nbytes)='integer' AND nbytes > 0",
            (b,),
        ).fetchone()
        (reserved,) = cur.execute("SELECT COALESCE(SUM(nbytes), 0) FROM reservations WHERE typeof(nbytes)='integer'").fetchone()
        return int(segs) + int(reserved)

    def _overhead(self) -> int:
        """Bytes of the index files and the directories (what `du` adds to the segment files)."""
        total = 0
        names = [INDEX_FILENAME + s for s in ("", "-wal", "-shm")]
        with suppress(OSError):
            names += [n for n in os.listdir(self.namespace_dir) if SUBDIR_RE.match(n)]
        for n in ["", *names]:
            try:
                size = os.lstat(self.namespace_dir / n).st_blocks * 512
            except OSError:
                continue
            # the WAL grows between two reservations (of any process) by a few transactions, and is
            # trimmed once it passes WAL_LIMIT_BYTES: count it at twice that at least
            total += max(size, 2 * WAL_LIMIT_BYTES) if n == names[1] else size
        return total

    def _drop_stale(self, cur: sqlite3.Cursor, now: float) -> None:
        """Drop reservations of dead processes, old ones, and this process's evicted files that
        are unlinked already (their release failed)."""
        gone = list(self._unreleased)
        for name, pid, created in cur.execute("SELECT name, pid, created FROM reservations").fetchall():
            if not isinstance(pid, int) or not isinstance(created, (int, float)) or now - created > STALE_RESERVATION_S:
                gone.append(name)
            elif pid != os.getpid() and not pid_alive(pid, math.inf):
                gone.append(name)
        _delete_in(cur, "reservations", "name", gone)
        self._unreleased.clear()

    def _evict(self, cur: sqlite3.Cursor, used: int, need: int, now: float, out: Eviction) -> list[str]:
        """Choose and delete the rows of least recently used segments until `used + need` is
        `EVICT_SLACK` below the budget (or as close as the protected segments allow).

        Returns:
            Names of the segment files to unlink (their bytes stay reserved until then).
        """
        conn = cur.connection
        table = load_rows(conn, full=False)
        sizes = {name: self.allocated(n) for name, n in cur.execute(
            "SELECT name, nbytes FROM segments WHERE typeof(nbytes)='integer' AND nbytes > 0") if is_segment_name(name)}  # fmt: skip
        at_root = (table.parent == self._root).all(axis=1)
        forest = build_forest(table.parent_rows(), at_root, table.last_access, now)
        size = np.array([sizes.get(n, 0) for n in table.segments], dtype=np.int64)
        planner = SegmentPlanner.from_forest(table.segments, size, table.seg, forest, table.hashes)
        rowless = sorted(set(sizes) - set(table.segment_numbers))  # a `segments` row without blocks: nothing to keep
        free_rowless = sum(sizes[n] for n in rowless)
        others = used - int(size.sum()) - free_rowless  # reservations, index, directories
        target = int(self.max_bytes * (1 - self.evict_slack)) - others - need
        fit_budget({"ns": planner}, max(target, 0), protect_after=now - self.protect_s)
        names = [planner.names[i] for i in planner.removed_segment_ids().tolist()] + rowless
        hashes = planner.removed_block_names()
        _delete_in(cur, "blocks", "hash", hashes)
        pid = os.getpid()
        for name in names:
            cur.execute("DELETE FROM segments WHERE name=?", (name,))
            cur.execute("INSERT OR REPLACE INTO reservations(name, nbytes, pid, created) VALUES (?,?,?,?)",
                        (name, sizes.get(name, 0), pid, now))  # fmt: skip
        out.segments, out.blocks = len(names), len(hashes)
        out.nbytes = sum(sizes.get(n, 0) for n in names)
        return names

    def _unlink(self, names: list[str]) -> None:
        """Unlink evicted files (after the commit that deleted their rows), then end their
        reservations (a failure leaves them to the next `reserve`)."""
        for name in names:
            try:
                self._fs.unlink(self._seg_path(name))
            except (OSError, ValueError) as exc:
                log.warning("could not remove evicted segment %s: %s", name, exc)
                continue
            self._unreleased.add(name)
        if not self._unreleased:
            return
        done = sorted(self._unreleased)
        try:
            with self._index.write_transaction() as cur:
                _delete_in(cur, "reservations", "name", done)
        except sqlite3.Error as exc:
            log.warning("could not end the reservations of %d evicted segment(s): %s", len(done), exc)
            return
        self._unreleased.difference_update(done)

    def _log_refusal(self, need: int, used: int) -> None:
        now = time.monotonic()
        if now - self._last_refusal_log >= REFUSAL_LOG_INTERVAL_S:
            self._last_refusal_log = now
            log.info("SSD byte budget %d B of %s: a %d B segment does not fit (%d B used; segments used in the last "
                     "%.0f s are not evicted): not stored", self.max_bytes, self.namespace_dir, need, used, self.protect_s)  # fmt: skip


def _delete_in(cur: sqlite3.Cursor, table: str, column: str, values: list[str]) -> None:
    """`DELETE FROM table WHERE column IN (values)`, `_MAX_VARS` values a statement (in the
    caller's transaction)."""
    for i in range(0, len(values), _MAX_VARS):
        chunk = values[i : i + _MAX_VARS]
        cur.execute(f"DELETE FROM {table} WHERE {column} IN ({','.join('?' * len(chunk))})", chunk)


__all__ = ["SSDBudget", "Eviction", "DEFAULT_PROTECT_S", "EVICT_SLACK", "STALE_RESERVATION_S"]
