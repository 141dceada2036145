"""SSDStore: the SSD tier of one namespace (segment files + SQLite index), docs/design.md#namespaces-and-files.

The index maps every block to `(segment, slot)` of a segment file (`kvtool.disk.segment`). The
save path is `kvtool.disk.namespace_save`, the open path and the state both share
`kvtool.disk.namespace_core`, and the optional byte budget (`set_max_bytes`) `kvtool.disk.budget`.

Correctness rules (a wrong block served is worse than none):
- A segment is written to a temp file in its final directory, then renamed into place; under
  `durable` the file and the directory are fsynced (once per segment, not per block). Only then
  are its rows inserted, in one transaction; if that fails, the file is unlinked again. A file
  is unlinked only after its last row is deleted.
- Every read re-verifies: header checksum and namespace, slot hash, parent and length, record
  checksum, and the exact token ids. Any doubt -> that block's row is dropped, a miss.
  Same hash with other token ids is a collision: the hash is isolated (non-cacheable) for 1 h.
- Nothing here raises to the caller on I/O trouble: loads miss, saves return 'error', and a
  store that cannot open its directory or index is *disabled* (all misses, all 'error'). A
  directory this process cannot write is opened *read-only*: hits are served, nothing written.
- No path is built from an unchecked name (`kvtool.disk.names`); symlinks are never followed.

Several processes may share a namespace: SQLite WAL + busy timeout for the index, atomic
renames for files, and a reader whose segment was just removed by another process misses.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from kvtool.disk import segment as seg
from kvtool.disk.budget import DEFAULT_PROTECT_S, Eviction, SSDBudget
from kvtool.disk.fsops import DEFAULT_DIR_MODE, FileOps, NotRegularFileError, check_regular
from kvtool.disk.header_cache import HEADERS
from kvtool.disk.index import BlockIndex
from kvtool.disk.names import all_hashes, is_hash
from kvtool.disk.namespace_core import NONCACHEABLE_TTL_S, Expected, ReconcileReport, StoreCore, open_index, reconcile
from kvtool.disk.namespace_save import SegmentSaver
from kvtool.disk.rowtable import IndexRow
from kvtool.disk.segment import BlockFileError
from kvtool.disk.verify import slot_problem

if TYPE_CHECKING:
    from kvtool.disk.hostblock import HostBlock

log = logging.getLogger(__name__)

SEGMENT_MAX_BYTES = 64 << 20  # a write batch is split into segments of at most this size
REQUIRED_META = ("model_id", "model_name", "block_size", "kv_dtype", "kv_layers")

COUNTERS = (
    "ssd_save_success", "ssd_save_fail", "ssd_save_dedup_skip", "ssd_save_disabled",
    "ssd_stale_index_cleaned", "ssd_hash_collision_detected", "ssd_bytes_written", "ssd_segments_written",
    "ssd_load_hits", "ssd_load_miss", "ssd_load_corrupt", "ssd_load_missing", "ssd_load_fail",
    "ssd_load_noncacheable", "ssd_bytes_read", "ssd_namespace_refused", "ssd_index_errors",
    "ssd_reconcile_temp_removed", "ssd_reconcile_missing_dropped", "ssd_reconcile_orphan_files",
    "ssd_budget_evictions", "ssd_budget_evicted_bytes", "ssd_budget_evicted_blocks", "ssd_budget_refused",
)  # fmt: skip


class SSDStore(StoreCore):
    """The SSD tier of one namespace. Thread-safe; never raises on I/O trouble.

    Args:
        cache_dir: root of the SSD tier.
        layout_key: the namespace (32 hex characters).
        meta: namespace metadata, string values for `REQUIRED_META` (model_id, model_name,
            block_size, kv_dtype, kv_layers = `KVLayout.spec`); extra keys are stored too.
        durability: 'best_effort' | 'persistent' (both: rename only; retries are the writer's)
            or 'durable' (fsync file + directory before the rows commit; SQLite synchronous=FULL).
        flush_interval_s: max delay of batched access-time updates (seconds).
        fs: file-system operations (inject faults in tests).
        clock: time source (unix seconds) for created/last_access and collision isolation.
        noncacheable: hash -> isolation expiry (unix seconds); pass a dict to share or inspect it.
        dir_mode: mode of the directories it creates (0o700; 0o2770 for a group-shared cache).
        segment_max_bytes: largest segment a save writes (bytes).

    Attributes:
        namespace_dir: `<cache_dir>/<layout_key>`.
        expected: the namespace's `Expected` layout (None until opened).
        enabled: False if the store could not open (every load misses, every save is 'error').
        read_only: True if the directory is not writable here: loads work, saves are refused.
        disabled_reason: why it is disabled (or read-only), or None.
        previous_shutdown_clean: the previous run's `shutdown_clean` (None for a new namespace).
        reconcile_report: what the startup reconcile did.

    Raises:
        ValueError: `meta` lacks a required key or `durability` is unknown (caller bugs only).
    """

    def __init__(
        self,
        cache_dir: Path,
        layout_key: str,
        meta: dict[str, str],
        *,
        durability: str = "best_effort",
        flush_interval_s: float = 1.0,
        fs: FileOps | None = None,
        clock: Callable[[], float] = time.time,
        noncacheable: dict[str, float] | None = None,
        dir_mode: int = DEFAULT_DIR_MODE,
        segment_max_bytes: int = SEGMENT_MAX_BYTES,
        max_bytes: int | None = None,
    ):
        missing = [k for k in REQUIRED_META if k not in meta]
        if missing:
            raise ValueError(f"SSDStore meta lacks {missing}")
        if str(durability) not in ("best_effort", "persistent", "durable"):
            raise ValueError(f"unknown durability {durability!r}")
        super().__init__(cache_dir, layout_key, durability=durability, fs=fs, clock=clock, noncacheable=noncacheable,
                         dir_mode=dir_mode, segment_max_bytes=segment_max_bytes, counters=COUNTERS)  # fmt: skip
        self._saver = SegmentSaver(self)  # the save path (kvtool.disk.namespace_save)
        try:
            open_index(self, {k: str(v) for k, v in meta.items()}, flush_interval_s)  # kvtool.disk.namespace_core
        except Exception as exc:  # any trouble opening costs the tier, never the request (docs/design.md#failure-isolation)
            self.close_index_quietly()
            self.disable(f"cannot open {self.namespace_dir}: {exc}")
            return
        if self.enabled and not self.read_only:
            reconcile(self)
        self.set_max_bytes(max_bytes)

    def set_max_bytes(self, max_bytes: int | None, protect_s: float = DEFAULT_PROTECT_S) -> None:
        """Keep the namespace directory within `max_bytes` (as `du` counts it) while writing:
        least recently used segments are evicted before a segment that would not fit is written
        (`kvtool.disk.budget`; the budget is the namespace's, shared by every process
        through its index). None: no budget. A disabled or read-only store writes nothing: no
        budget either.

        Args:
            max_bytes: the budget in bytes, or None.
            protect_s: segments whose rows were used this many seconds ago or less are never evicted.

        Raises:
            ValueError: `max_bytes` is negative.
        """
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        index = self.index
        if max_bytes is None or index is None or not self.enabled or self.read_only:
            self.budget = None
            return
        self.budget = SSDBudget(max_bytes, self.namespace_dir, index, self.fs, self.write_path, clock=self.clock,
                                protect_s=protect_s, on_evict=self._evicted)  # fmt: skip

    def _evicted(self, ev: Eviction) -> None:
        self.inc("ssd_budget_evictions", ev.segments)
        self.inc("ssd_budget_evicted_bytes", ev.nbytes)
        self.inc("ssd_budget_evicted_blocks", ev.blocks)

    # ------------------------------------------------------------------ open/close
    def close(self, shutdown_clean: bool = True, partial_flush: bool = False) -> None:
        """Flush access times, record the shutdown state in the index meta, close. Never raises.

        Args:
            shutdown_clean: every accepted write was attempted (docs/design.md#tier-policies).
            partial_flush: the index was flushed after an incomplete writer shutdown.
        """
        with self.lock:
            if self.index is None:
                return
            try:
                if not self.read_only:
                    self.index.flush()
                    self.index.set_meta(
                        {
                            "shutdown_clean": "1" if shutdown_clean else "0",
                            "shutdown_partial_flush": "1" if partial_flush else "0",
                            "last_close": repr(self.clock()),
                        }
                    )
            except sqlite3.Error as exc:
                self.inc("ssd_index_errors")
                log.error("could not record shutdown state in %s: %s", self.namespace_dir, exc)
            finally:
                self.close_index_quietly()
                self.enabled = False

    def reopen_if_changed(self) -> bool:
        """Where the index was opened `quiet` (`FileOps.quiet_index`) and a process opened or
        changed it since (`BlockIndex.unchanged`): reopen it `mode=ro`, since what was read may be
        stale or torn; True if it was reopened (read again).

        Raises:
            sqlite3.Error: the index cannot be opened again.
        """
        with self.lock:
            index = self.index
            if index is None or index.unchanged():
                return False
            self.close_index_quietly()
            self.index = BlockIndex(index.path, create=False, read_only=True)
            return True

    # ----------------------------------------------------------------- lookups
    def count_prefix(self, hashes: Sequence[str]) -> int:
        """How many leading `hashes` the index holds (stops at the first absent/isolated one)."""
        return len(self.lookup(hashes))

    def lookup(self, hashes: Sequence[str]) -> list[IndexRow]:
        """Rows of the longest leading run of `hashes` that the index holds (one query).

        Stops at the first hash that is absent, isolated, or not a well-formed hash. Never raises.
        """
        found = self.rows_of(hashes)
        out = []
        for h in hashes:
            row = found.get(h)
            if row is None:
                break
            out.append(row)
        return out

    def rows_of(self, hashes: Sequence[str]) -> dict[str, IndexRow]:
        """hash -> row for those of `hashes` the index holds (not isolated, well-formed), in one
        query per 500 hashes; any order (e.g. a tail entry's candidate keys). Never raises."""
        index = self.index
        if not self.enabled or index is None or not hashes:
            return {}
        try:
            found = index.get_many(hashes if all_hashes(hashes) else [h for h in hashes if is_hash(h)])
        except (sqlite3.Error, AttributeError) as exc:
            self._index_error("lookup", exc)
            return {}
        return self.cacheable(found)

    def children(self, parent: str, limit: int) -> list[IndexRow]:
        """Rows whose parent is `parent` (not isolated), most recently used first, at most
        `limit` (one index query). Never raises."""
        index = self.index
        if not self.enabled or index is None or not is_hash(parent):
            return []
        try:
            rows = index.children(parent, limit)
        except (sqlite3.Error, AttributeError) as exc:
            self._index_error("lookup", exc)
            return []
        return [r for r in rows if not self.is_noncacheable(r.hash)]

    def read_row(self, row: IndexRow, parent: str | None = None) -> HostBlock | None:
        """Read one record into fresh host arrays, verified (header, slot, parent, checksum over
        the whole record) but not compared with any prompt's token ids: the caller compares.
        A damaged record loses its row; a read error is a miss. Never raises."""
        got = self._read_verified(row, parent)
        return got[0] if got is not None else None

    def _read_verified(self, row: IndexRow, parent: str | None) -> tuple[HostBlock, seg.Slot] | None:
        """`read_row`, with the slot read."""
        try:
            opened = self.open_segment(row.segment)
            if opened is None:
                return None
            fd, header = opened
            try:
                slot = self.check_slot(row, header, parent)
                if slot is None:
                    self.discard(row.hash, "slot does not hold the block")
                    return None
                return seg.read_block(fd, slot, header.kv), slot
            finally:
                os.close(fd)
        except OSError as exc:  # a read error is not corruption: miss, keep the row
            log.warning("SSD read of block %s failed: %s", row.hash, exc)
            self.inc("ssd_load_fail")
        except BlockFileError as exc:
            self.discard(row.hash, str(exc))
        except Exception:  # a bug here must cost a miss, never a request
            log.exception("SSD read of %s failed", row.hash)
            self.inc("ssd_load_fail")
        return None

    def open_segment(self, name: str) -> tuple[int, seg.SegmentHeader] | None:
        """Open a segment file and verify its header against the namespace.

        Returns:
            `(fd, header)` (close `fd` with `os.close`), or None if the segment is unusable: its
            rows are then dropped (`corrupt`) or it vanished (`missing`). A FIFO, socket, device
            or directory under the segment's name is never read: a corrupt entry (counted, its
            rows marked suspect and left for `kvtool validate`). Never raises.
        """
        try:
            path = self.seg_path(name)
            fd = self.fs.open_read(path)
        except FileNotFoundError:
            self._segment_vanished(name)
            return None
        except NotRegularFileError as exc:
            self._not_regular(name, exc)
            return None
        except (OSError, ValueError) as exc:
            log.warning("SSD segment %s unreadable: %s", name, exc)
            self.inc("ssd_load_fail")
            return None
        try:
            header = HEADERS.read(fd, check_regular(fd, path))  # parsed once per file (kvtool.disk.header_cache)
            seg.check_header(header, self.layout_key, self.geometry.kv, self.geometry.codec)
            return fd, header
        except (OSError, BlockFileError) as exc:
            os.close(fd)
            if isinstance(exc, NotRegularFileError):
                self._not_regular(name, exc)
            elif isinstance(exc, OSError):  # a read error is not corruption: miss, keep the rows
                log.warning("SSD segment %s: read failed (%s); a miss", name, exc)
                self.inc("ssd_load_fail")
            else:
                log.warning("SSD segment %s unusable (%s); its blocks are dropped", name, exc)
                self.inc("ssd_load_corrupt")
                self._drop_segment(name)
            return None

    def _not_regular(self, name: str, exc: OSError) -> None:
        """A segment name taken by something else than a regular file: a corrupt entry, a miss.
        Nothing is removed here (`kvtool validate` does); its blocks may be stored anew."""
        log.warning("SSD segment %s is %s: never read; a miss (kvtool validate removes it)", name, exc.strerror)
        self.inc("ssd_load_corrupt")
        self.suspect(name)

    def check_slot(self, row: IndexRow, header: seg.SegmentHeader, parent: str | None) -> seg.Slot | None:
        """The header's slot for `row` if it is the block asked for (`verify.slot_problem`: hash,
        parent, length), else None."""
        if row.slot >= len(header.slots):
            return None
        slot = header.slots[row.slot]
        return slot if slot_problem(slot, row.hash, parent, row.num_tokens) is None else None

    def load_block(self, block_hash: str, expected_token_ids: np.ndarray, parent: str | None = None) -> HostBlock | None:
        """Read, verify and return one block (full or tail entry) in fresh host arrays, or None.

        For tests and tools; the request path restores whole chains with `kvtool.disk.restore`.
        Never raises.
        """
        if not self.enabled:
            return None
        try:
            expected = np.asarray(expected_token_ids, dtype=np.int32)
            row = self.rows_of([block_hash]).get(block_hash)  # its row (tail entries included)
            if row is None or row.num_tokens != expected.shape[0]:
                self.inc("ssd_load_noncacheable" if self.is_noncacheable(block_hash) else "ssd_load_miss")
                return None
            got = self._read_verified(row, parent)
            if got is None:
                return None
            block, slot = got
            if not np.array_equal(block.token_ids, expected):
                self.tokens_mismatch(row, expected, "load")
                return None
            self.record_hits([block_hash], slot.nbytes)
            return block
        except Exception:  # a bug here must cost a miss, never a request
            log.exception("SSD load of %s failed", block_hash)
            self.inc("ssd_load_fail")
            return None

    def record_hits(self, hashes: Sequence[str], nbytes: int) -> None:
        """Count verified loads and touch their rows (batched access-time update)."""
        self.touch_rows(hashes)
        self.inc("ssd_load_hits", len(hashes))
        self.inc("ssd_bytes_read", nbytes)

    def _segment_vanished(self, name: str) -> None:
        """A segment file is gone: another process's removal (miss) or a stale row (drop)."""
        with self.lock:
            index = self.index
            if index is None or self.read_only or self.fs.exists(self.seg_path(name)):
                self.inc("ssd_load_miss")
                return
            try:
                n = index.delete_segments([name])
            except sqlite3.Error as exc:
                self._index_error("drop vanished segment", exc)
                return
        if n:
            log.warning("SSD segment %s had no file; %d row(s) dropped", name, n)
            self.inc("ssd_load_missing")
            self.inc("ssd_stale_index_cleaned", n)
        else:
            self.inc("ssd_load_miss")

    # ------------------------------------------------------------------- saves
    def save_block(self, block: HostBlock) -> str:
        """Store one block; see `save_blocks`."""
        return self.save_blocks([block])[0]

    def save_blocks(self, blocks: Sequence[HostBlock]) -> list[str]:
        """Store blocks as one write batch (one segment per `segment_max_bytes`). Never raises.

        The save path is `kvtool.disk.namespace_save.SegmentSaver`.

        Args:
            blocks: blocks (or tail entries) whose geometry matches the namespace.

        Returns:
            Per block, in order: 'saved' (file + row written), 'dedup' (already stored; access
            time touched), 'collision' (same hash with other tokens, or hash isolated),
            'refused' (the byte budget, `set_max_bytes`, had no room for its segment: not
            stored, not a failure), 'error' (not stored: a failure).
        """
        return self._saver.save_blocks(blocks)

    def saved_count(self, hashes: Iterable[str]) -> int:
        """How many of `hashes` this process saved to SSD (file written and rows committed;
        the last `SAVED_MAX` saves are remembered): a request's blocks that reached the disk."""
        return self.saved.count(hashes)

    # ------------------------------------------------------------------- misc
    def flush(self) -> None:
        """Commit batched access-time updates. Never raises."""
        index = self.index
        if index is None:
            return
        try:
            index.flush()
        except (sqlite3.Error, AttributeError) as exc:
            self._index_error("flush", exc)

    def totals(self) -> tuple[int, int]:
        """(blocks, bytes of segment files) in the index; (0, 0) if disabled or unreadable."""
        try:
            return self.index.totals() if self.index is not None else (0, 0)
        except sqlite3.Error:
            return (0, 0)

    def stats(self) -> dict[str, int]:
        """Counters (all prefixed `ssd_`), a snapshot, plus what the startup reconcile did."""
        rec = self.reconcile_report
        with self._stats_lock:
            out = dict(self._stats)
        out.update(
            ssd_reconcile_temp_removed=rec.temp_removed,
            ssd_reconcile_missing_dropped=rec.missing_rows_dropped,
            ssd_reconcile_orphan_files=rec.orphan_files,
        )
        return out

    def touch_many(self, hashes: list[str]) -> None:
        """Record a use of `hashes` (e.g. RAM-tier hits) in their rows' last access: one buffered
        update (one lock). Keeps `prune --ttl` and the LRU order honest for blocks a long-running
        process serves from RAM. Never raises."""
        if hashes and self.enabled and self.index is not None:
            self.touch_rows(hashes)

__all__ = ["SSDStore", "Expected", "ReconcileReport", "COUNTERS", "NONCACHEABLE_TTL_S", "REQUIRED_META"]
