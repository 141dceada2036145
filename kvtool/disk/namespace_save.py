"""The save path of `SSDStore`: a write batch -> segment files + index rows (docs/design.md#write-path).

`SSDStore.save_blocks` delegates to the `SegmentSaver` each store owns. One `save_blocks` call:
- runs under the store's lock (saves, removals and `close` are serialised);
- answers per block, in order: 'saved' (file + row written), 'dedup' (hash already in the index,
  or earlier in the same call; an indexed row's access time is touched; but a row whose segment
  failed verification in this process, `SSDStore.suspect`, is *replaced* by the new block: a
  recomputed block is stored again, not dropped as a duplicate of a damaged one), 'collision' (the hash is
  isolated, or its row holds other token ids: the hash is then isolated for 1 h), 'refused'
  (the byte budget had no room for its segment, below: not stored, and not a failure) or
  'error' (a malformed block or parent hash, a geometry mismatch, any I/O or SQLite failure;
  every block of a disabled or read-only store, counted as `ssd_save_disabled`);
- packs the new blocks, in order, into segments of at most `segment_max_bytes` (record bytes
  per `KVLayout.record_nbytes`; a single larger block gets a segment of its own), so the
  consecutive new blocks of one request share one file (format: `kvtool.disk.segment`);
- writes each segment atomically: a temp file `.<name>.<pid>.<random8>.tmp` in its final
  directory `<name[:2]>/` (`name`: 128 random bits, hex), renamed into place (`os.replace`);
  under `durable` the file is fsynced before the rename and its directory after it (once per
  segment, not per block), and the namespace directory the first time this process creates
  a segment subdirectory (a subdirectory removed meanwhile is recreated once);
- then inserts the segment row and its block rows in one index transaction. If the write or
  the transaction fails, the temp or renamed file is unlinked again (no orphan). On a full disk
  (ENOSPC, EDQUOT, SQLITE_FULL) the segment is split in halves and retried, first half first:
  what fits is saved, the blocks from the first one that does not fit on answer 'error', and
  later segments of the call are not attempted. Any other failure makes the whole call answer
  'error' for every block (segments the call already committed stay stored).
A block whose dtype or token count (0 < n <= block_size) does not match the namespace makes
its whole segment 'error' (`ssd_save_fail`), the other segments of the call go ahead.

With a byte budget (`SSDStore.set_max_bytes`) each segment's bytes are reserved before its temp
file is created (`kvtool.disk.budget`); the reservation ends in the transaction that inserts its
rows, or when the write fails. A segment that cannot fit answers 'refused' for its blocks
(`ssd_budget_refused`, not `ssd_save_fail`).

Nothing here raises to the caller. The saver reads the store's state (file ops, clock, lock,
geometry, durability, `segment_max_bytes`) at call time. Logs go to the `kvtool.disk.namespace` logger.
"""

from __future__ import annotations

import errno
import logging
import secrets
import sqlite3
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from kvtool.disk import segment as seg
from kvtool.disk.fsops import temp_path_for
from kvtool.disk.index import BlockIndex
from kvtool.disk.names import is_hash
from kvtool.disk.namespace_core import StoreCore
from kvtool.disk.rowtable import IndexRow, SegmentRow
from kvtool.disk.segment import BlockFileError

if TYPE_CHECKING:
    from kvtool.disk.hostblock import HostBlock

log = logging.getLogger("kvtool.disk.namespace")


class SegmentSaver:
    """The save path of one `SSDStore` (its own part: it uses the store's private members).

    Args:
        store: the store it writes for; read at call time, never copied.
    """

    def __init__(self, store: StoreCore):
        self._store = store
        self._made_dirs: set[str] = set()  # segment subdirectories this process has created

    def save_blocks(self, blocks: Sequence[HostBlock]) -> list[str]:
        """`SSDStore.save_blocks`: store blocks as one write batch. Never raises."""
        store = self._store
        if not store.enabled or store.read_only:
            store.inc("ssd_save_disabled", len(blocks))
            return ["error"] * len(blocks)
        with store.lock:
            try:
                return self._save_locked(list(blocks))
            except Exception as exc:
                level = logging.WARNING if isinstance(exc, (OSError, sqlite3.Error)) else logging.ERROR
                log.log(level, "SSD save of %d block(s) failed: %s", len(blocks), exc)
                store.inc("ssd_save_fail", len(blocks))
                return ["error"] * len(blocks)

    def _save_locked(self, blocks: list[HostBlock]) -> list[str]:
        store = self._store
        index = store.index
        if index is None:
            raise OSError(errno.EBADF, "index closed")
        outcome: dict[int, str] = {}
        existing = index.get_many([b.block_hash for b in blocks if is_hash(b.block_hash)])
        fresh: list[tuple[int, HostBlock]] = []
        seen: set[str] = set()
        for i, b in enumerate(blocks):
            h = b.block_hash
            if not is_hash(h) or not is_hash(b.parent_hash):
                outcome[i] = "error"
            elif store.is_noncacheable(h):
                outcome[i] = "collision"
            elif h not in seen and self._replaces(existing.get(h), b):
                seen.add(h)  # its row points into a segment that failed verification: written anew
                fresh.append((i, b))
            elif h in existing or h in seen:
                outcome[i] = self._dedup(h, existing.get(h), b, seen)
            else:
                seen.add(h)
                fresh.append((i, b))
        full = False
        for batch in self._batches(fresh):
            if full:  # the disk filled up: what follows would not fit either (nor be reachable)
                store.inc("ssd_save_fail", len(batch))
                results = ["error"] * len(batch)
            else:
                results, full = self._write_fitting(index, [b for _, b in batch])
            for i, result in zip((i for i, _ in batch), results):
                outcome[i] = result
        return [outcome[i] for i in range(len(blocks))]

    def _replaces(self, row: IndexRow | None, b: HostBlock) -> bool:
        """True if `b` must replace its existing `row` instead of being a duplicate: the row's
        segment failed verification in this process (`SSDStore.suspect`) and the row describes
        the same token ids (other token ids are a collision, handled by `_dedup`)."""
        return (row is not None and self._store.is_suspect(row.segment)
                and row.tokens_digest == seg.tokens_digest(b.token_ids))  # fmt: skip

    def _write_fitting(self, index: BlockIndex, blocks: list[HostBlock]) -> tuple[list[str], bool]:
        """`_write_segment`, but on a full disk (ENOSPC, EDQUOT, SQLITE_FULL) the blocks are
        split in halves and the first half retried, then the second if the first fit whole:
        what fits is saved, in order; from the first block that does not fit on, every block
        is 'error' (counted in `ssd_save_fail`).

        Returns:
            `(per-block outcomes, whether the disk was found full)`.

        Raises:
            OSError, sqlite3.Error: any other failure (as `_write_segment`).
        """
        store = self._store
        try:
            return self._write_segment(index, blocks), False
        except (OSError, sqlite3.Error) as exc:
            if not disk_full_error(exc):
                raise
            if len(blocks) == 1:
                log.warning("SSD save of block %s failed: %s", blocks[0].block_hash, exc)
                store.inc("ssd_save_fail")
                return ["error"], True
        half = (len(blocks) + 1) // 2
        first, _ = self._write_fitting(index, blocks[:half])
        if first[-1] != "saved":  # the first half did not fit whole: the rest is not attempted
            store.inc("ssd_save_fail", len(blocks) - half)
            return first + ["error"] * (len(blocks) - half), True
        rest, _ = self._write_fitting(index, blocks[half:])
        return first + rest, True

    def _dedup(self, h: str, row: IndexRow | None, b: HostBlock, seen: set[str]) -> str:
        store = self._store
        if row is not None and row.tokens_digest != seg.tokens_digest(b.token_ids):
            store.collision(h, "save")
            return "collision"
        if row is not None:
            store.touch_rows([h])
        store.inc("ssd_save_dedup_skip")
        return "dedup"

    def _batches(self, items: list[tuple[int, HostBlock]]) -> Iterable[list[tuple[int, HostBlock]]]:
        store = self._store
        batch: list[tuple[int, HostBlock]] = []
        size = 0
        for item in items:
            n = store.geometry.kv.record_nbytes(int(item[1].token_ids.shape[0]))
            if batch and size + n > store.segment_max_bytes:
                yield batch
                batch, size = [], 0
            batch.append(item)
            size += n
        if batch:
            yield batch

    def _write_segment(self, index: BlockIndex, blocks: list[HostBlock]) -> list[str]:
        """Encode, write (temp + rename), then insert the rows in one transaction."""
        store = self._store
        try:
            for b in blocks:
                self._check_block(b)
            now = store.clock()
            buffers, slots = seg.encode(blocks, store.layout_key, store.geometry.kv, now, store.geometry.codec)
        except (BlockFileError, ValueError) as exc:
            log.error("SSD save refused: %s", exc)
            store.inc("ssd_save_fail", len(blocks))
            return ["error"] * len(blocks)
        name = secrets.token_hex(16)
        path = store.write_path(name)  # the namespace is still the directory opened, else OSError
        size = sum(b.nbytes for b in buffers)
        budget = store.budget
        if budget is not None and not budget.reserve(name, size):  # the byte budget: no room even after eviction
            store.inc("ssd_budget_refused", len(blocks))
            return ["refused"] * len(blocks)
        try:
            self._write_file(path, name, buffers)
            rows = [
                IndexRow(b.block_hash, b.parent_hash, name, s.index, s.n_tokens, s.nbytes, seg.tokens_digest(b.token_ids), now, now)
                for b, s in zip(blocks, slots)
            ]
            try:
                index.insert_segment(SegmentRow(name, size, len(blocks), now), rows, release=budget is not None)
            except BaseException:
                store.unlink_quiet(path)  # no row will ever point at it: never leave an orphan
                raise
        except BaseException:
            if budget is not None:
                budget.release(name)
            raise
        store.saved.add(b.block_hash for b in blocks)
        store.inc("ssd_save_success", len(blocks))
        store.inc("ssd_segments_written")
        store.inc("ssd_bytes_written", size)
        return ["saved"] * len(blocks)

    def _check_block(self, block: HostBlock) -> None:
        e = self._store.geometry
        n = int(np.asarray(block.token_ids).shape[0])
        if block.dtype != e.kv.dtype or not 0 < n <= e.block_size:
            raise BlockFileError("shape", f"block {block.block_hash} does not match namespace geometry")

    def _write_file(self, path: Path, name: str, buffers: Sequence) -> None:
        """Temp file in the final directory, fsync (durable), rename, fsync dir (durable)."""
        store = self._store
        fs = store.fs
        sub = path.parent
        if sub.name not in self._made_dirs:
            fs.makedirs(sub, store.dir_mode)
            if store.durable:
                fs.fsync_dir(store.namespace_dir)
            self._made_dirs.add(sub.name)
        tmp = temp_path_for(path, name)
        renamed = False
        try:
            try:
                fd = fs.open_new(tmp)
            except FileNotFoundError:  # subdir removed by someone: recreate once
                fs.makedirs(sub, store.dir_mode)
                fd = fs.open_new(tmp)
            try:
                fs.write_all(fd, list(buffers))
                if store.durable:
                    fs.fsync(fd)
            finally:
                fs.close(fd)
            fs.replace(tmp, path)
            renamed = True
            if store.durable:
                fs.fsync_dir(sub)
        except BaseException:
            store.unlink_quiet(path if renamed else tmp)  # no row will point at it: never an orphan
            raise


def disk_full_error(exc: BaseException) -> bool:
    """True if `exc` says the file system is full: ENOSPC or EDQUOT, or SQLite's SQLITE_FULL."""
    if isinstance(exc, OSError):
        return exc.errno in (errno.ENOSPC, errno.EDQUOT)
    code = getattr(exc, "sqlite_errorcode", None)
    return isinstance(exc, sqlite3.Error) and isinstance(code, int) and code & 0xFF == sqlite3.SQLITE_FULL


__all__ = ["SegmentSaver", "disk_full_error"]
