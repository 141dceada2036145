"""SSDStore: the SSD tier of one namespace (block files + SQLite index), seed 000 §1.

A namespace directory `<cache_dir>/<layout_key>/` holds `index.sqlite` and one safetensors
file per block at `<hash[:2]>/<hash>.safetensors` (format: `kvtool.store.blockfile`).

Correctness rules (a wrong block served is worse than none):
- A file is written to a temp file in its final directory, then renamed into place; under
  `durable` the file and the directory are fsynced. Only then is the index row inserted.
  A file is unlinked only after its row is deleted. So a row always points at a complete file,
  unless something outside kvtool removed it (then the row is dropped on first use).
- Every load re-reads and re-verifies the file (format, namespace, hash, geometry, checksum)
  and compares its token ids with the expected ones. Any doubt -> row and file removed, miss.
  Same hash with other token ids is a collision: the hash is isolated (non-cacheable) for 1 h.
- Nothing here raises to the caller on I/O trouble: loads miss, saves return 'error', and a
  store that cannot open its directory or index is *disabled* (all misses, all 'error').

Several processes may share a namespace: SQLite WAL + busy timeout for the index, atomic
renames for files, and a reader that finds a row whose file was just removed by another
process treats it as a plain miss.

This module never imports MLX (the SSD writer thread calls it).
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Sequence

import numpy as np

from kvtool.store import blockfile
from kvtool.store.blockfile import BlockFileError, Expected
from kvtool.store.fsops import (
    HASH_RE,
    NAMESPACE_RE,
    FileOps,
    block_relpath,
    scan_namespace,
    temp_is_leftover,
    temp_path_for,
)
from kvtool.store.index import INDEX_FILENAME, BlockIndex, IndexRow

if TYPE_CHECKING:
    from kvtool.hostblock import HostBlock

log = logging.getLogger(__name__)

NONCACHEABLE_TTL_S = 3600.0  # seed 000: a colliding hash is not cached for one hour
REQUIRED_META = ("model_id", "model_name", "block_size", "kv_dtype", "n_layers", "n_kv_heads", "head_dim")
_GEOMETRY_META = ("block_size", "kv_dtype", "n_layers", "n_kv_heads", "head_dim", "model_id")

COUNTERS = (
    "ssd_save_success", "ssd_save_fail", "ssd_save_dedup_skip", "ssd_save_disabled",
    "ssd_stale_index_cleaned", "ssd_hash_collision_detected", "ssd_bytes_written",
    "ssd_load_hits", "ssd_load_miss", "ssd_load_corrupt", "ssd_load_missing", "ssd_load_fail",
    "ssd_load_noncacheable", "ssd_bytes_read", "ssd_namespace_refused", "ssd_index_errors",
    "ssd_reconcile_temp_removed", "ssd_reconcile_missing_dropped", "ssd_reconcile_orphan_files",
)  # fmt: skip


@dataclass
class ReconcileReport:
    """Startup reconcile of one namespace (seed 000 Phase 3, the fast part).

    Attributes:
        temp_removed: leftover temp files removed.
        missing_rows_dropped: index rows whose file was gone, dropped.
        orphan_files: block files without a row (left for `kvtool validate` to adopt or remove).
        rows: rows after reconcile.
    """

    temp_removed: int = 0
    missing_rows_dropped: int = 0
    orphan_files: int = 0
    rows: int = 0


# ----------------------------------------------------------------------------- store
class SSDStore:
    """The SSD tier of one namespace. Thread-safe; never raises on I/O trouble.

    Args:
        cache_dir: root of the SSD tier.
        layout_key: the namespace (32 hex characters).
        meta: namespace metadata, string values for `REQUIRED_META` (model_id, model_name,
            block_size, kv_dtype, n_layers, n_kv_heads, head_dim).
        durability: 'best_effort' | 'persistent' (both: rename only; retries are the writer's)
            or 'durable' (fsync file + directory before the row commits; SQLite synchronous=FULL).
        flush_interval_s: max delay of batched access-time updates (seconds).
        fs: file-system operations (inject faults in tests).
        clock: time source (unix seconds) for created/last_access and collision isolation.
        noncacheable: hash -> isolation expiry (unix seconds); pass a dict to share or inspect it.

    Attributes:
        namespace_dir: `<cache_dir>/<layout_key>`.
        enabled: False if the store could not open (every load misses, every save is 'error').
        disabled_reason: why it is disabled, or None.
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
    ):
        missing = [k for k in REQUIRED_META if k not in meta]
        if missing:
            raise ValueError(f"SSDStore meta lacks {missing}")
        if durability not in ("best_effort", "persistent", "durable"):
            raise ValueError(f"unknown durability {durability!r}")
        self.cache_dir = Path(cache_dir)
        self.layout_key = layout_key
        self.namespace_dir = self.cache_dir / layout_key
        self.durable = durability == "durable"
        self.enabled = False
        self.disabled_reason: str | None = None
        self.previous_shutdown_clean: bool | None = None
        self.reconcile_report = ReconcileReport()
        self.index: BlockIndex | None = None
        self._fs = fs or FileOps()
        self._clock = clock
        self._noncacheable = {} if noncacheable is None else noncacheable
        self._lock = threading.Lock()  # saves, removals, close (seed 000 §1)
        self._stats_lock = threading.Lock()
        self._stats = dict.fromkeys(COUNTERS, 0)
        self._made_dirs: set[str] = set()
        self._expected: Expected | None = None
        try:
            self._open({k: str(v) for k, v in meta.items()}, flush_interval_s)
        except (OSError, sqlite3.Error, ValueError) as exc:
            self._disable(f"cannot open {self.namespace_dir}: {exc}")
            return
        if self.enabled:
            self._reconcile()

    # ------------------------------------------------------------------ open/close
    def _open(self, meta: dict[str, str], flush_interval_s: float) -> None:
        if not NAMESPACE_RE.match(self.layout_key):
            raise ValueError(f"layout key {self.layout_key!r} is not 32 hex characters")
        self._fs.makedirs(self.namespace_dir)
        probe = temp_path_for(self.namespace_dir / "probe", "probe")
        self._fs.close(self._fs.open_new(probe))  # a read-only directory fails here
        self._fs.unlink(probe)
        now = repr(self._clock())
        fresh = {**meta, "format_version": str(blockfile.FORMAT_VERSION), "layout_key": self.layout_key,
                 "created": now, "last_open": now, "shutdown_clean": "0", "shutdown_partial_flush": "0"}  # fmt: skip
        self.index = BlockIndex(
            self.namespace_dir / INDEX_FILENAME, self.durable, flush_interval_s=flush_interval_s, clock=self._clock,
            initial_meta=fresh,
        )
        stored = self.index.get_meta()
        if not self.index.created_meta:
            refused = self._refusal(stored, meta)
            if refused:
                self._inc("ssd_namespace_refused")
                self.index.close()
                self.index = None
                self._disable(refused)
                return
            self.previous_shutdown_clean = stored.get("shutdown_clean") == "1"
            self.index.set_meta({"last_open": now, "shutdown_clean": "0"})
        self._expected = Expected.from_meta(self.layout_key, {**meta, **stored})
        self.enabled = True

    def _refusal(self, stored: dict[str, str], meta: dict[str, str]) -> str | None:
        """Why an existing namespace must not be used, or None."""
        if not stored:
            return None
        if stored.get("format_version") != str(blockfile.FORMAT_VERSION):
            return f"namespace has format_version {stored.get('format_version')!r}, this kvtool writes {blockfile.FORMAT_VERSION}"
        if stored.get("layout_key") != self.layout_key:
            return f"namespace index belongs to layout {stored.get('layout_key')!r}"
        diff = [k for k in _GEOMETRY_META if stored.get(k) != meta[k]]
        return f"namespace metadata differs: {diff}" if diff else None

    def _disable(self, reason: str) -> None:
        self.enabled = False
        self.disabled_reason = reason
        log.warning("SSD tier disabled: %s", reason)

    def close(self, shutdown_clean: bool = True, partial_flush: bool = False) -> None:
        """Flush access times, record the shutdown state in the index meta, close. Never raises.

        Args:
            shutdown_clean: every accepted write was attempted (seed 000 §4).
            partial_flush: the index was flushed after an incomplete writer shutdown.
        """
        with self._lock:
            if self.index is None:
                return
            try:
                self.index.flush()
                self.index.set_meta(
                    {
                        "shutdown_clean": "1" if shutdown_clean else "0",
                        "shutdown_partial_flush": "1" if partial_flush else "0",
                        "last_close": repr(self._clock()),
                    }
                )
            except sqlite3.Error as exc:
                self._inc("ssd_index_errors")
                log.error("could not record shutdown state in %s: %s", self.namespace_dir, exc)
            finally:
                try:
                    self.index.close()
                except sqlite3.Error:
                    pass
                self.index = None
                self.enabled = False

    def _reconcile(self) -> None:
        """Remove leftover temp files and drop rows whose file is missing (fast: no file reads)."""
        rep = self.reconcile_report
        try:
            rows = list(self.index.rows())  # rows before files: a row never precedes its file
            scan = scan_namespace(self.namespace_dir, self._fs)
            for tmp in scan.temps:
                if temp_is_leftover(self._fs, tmp):
                    self._unlink_quiet(tmp)
                    rep.temp_removed += 1
            gone = [r.hash for r in rows if r.hash not in scan.files]
            gone = [h for h in gone if not self._fs.exists(self._path(h))]  # re-check just before
            rep.missing_rows_dropped = self.index.delete(gone) if gone else 0
            rep.orphan_files = len(set(scan.files) - {r.hash for r in rows})
            rep.rows = len(rows) - rep.missing_rows_dropped
        except (OSError, sqlite3.Error) as exc:
            log.warning("startup reconcile of %s incomplete: %s", self.namespace_dir, exc)
        self._inc("ssd_stale_index_cleaned", rep.missing_rows_dropped)
        if rep.temp_removed or rep.missing_rows_dropped or rep.orphan_files:
            log.info("SSD reconcile %s: %s", self.layout_key, asdict(rep))

    # ----------------------------------------------------------------- lookups
    def contains(self, block_hash: str) -> bool:
        """True if the index has a usable row for `block_hash` (the file is not read)."""
        return self.count_prefix([block_hash]) == 1

    def count_prefix(self, hashes: Sequence[str]) -> int:
        """How many leading `hashes` the index holds (stops at the first absent/isolated one)."""
        if not self.enabled or self.index is None:
            return 0
        try:
            present = self.index.present(hashes)
        except sqlite3.Error as exc:
            self._index_error("count_prefix", exc)
            return 0
        n = 0
        for h in hashes:
            if h not in present or self._is_noncacheable(h):
                break
            n += 1
        return n

    def load_block(self, block_hash: str, expected_token_ids: np.ndarray) -> "HostBlock | None":
        """Read, verify and return one block, or None (a miss). Never raises.

        Args:
            block_hash: the block's chain hash.
            expected_token_ids: int32 `[block_size]`, the prompt tokens the block must hold.

        Returns:
            The block (arrays view one buffer read from the file) or None on any doubt.
        """
        if not self.enabled:
            return None
        try:
            return self._load(block_hash, np.asarray(expected_token_ids))
        except Exception:  # a bug here must cost a miss, never a request
            log.exception("SSD load of %s failed", block_hash)
            self._inc("ssd_load_fail")
            return None

    def _load(self, h: str, expected: np.ndarray) -> "HostBlock | None":
        if not HASH_RE.match(h) or expected.shape != (self._expected.block_size,):
            log.warning("SSD load of %r with %s expected tokens: not a valid request", h, expected.shape)
            self._inc("ssd_load_fail")
            return None
        if self._is_noncacheable(h):
            self._inc("ssd_load_noncacheable")
            return None
        index = self.index
        if index is None or index.get(h) is None:
            self._inc("ssd_load_miss")
            return None
        path = self._path(h)
        try:
            data = self._fs.read_bytes(path)
        except FileNotFoundError:
            return self._file_vanished(h, path)
        except OSError as exc:
            log.warning("SSD read of %s failed: %s", path, exc)
            self._inc("ssd_load_fail")
            self._discard(h)
            return None
        try:
            block, _ = blockfile.verify(data, replace(self._expected, block_hash=h), expected)
        except BlockFileError as exc:
            if exc.kind == "tokens":
                self._isolate(h, "load")
            else:
                log.warning("SSD block %s unusable (%s); removed", h, exc)
                self._inc("ssd_load_corrupt")
            self._discard(h)
            return None
        self._touch(h)
        self._inc("ssd_load_hits")
        self._inc("ssd_bytes_read", len(data))
        return block

    def _file_vanished(self, h: str, path: Path) -> None:
        """A row's file is gone: another process's removal (miss) or a stale row (drop it)."""
        with self._lock:
            index = self.index
            if index is None or index.get(h) is None or self._fs.exists(path):
                self._inc("ssd_load_miss")  # removed (row first) or re-saved meanwhile
                return None
            index.delete([h])
        log.warning("SSD index row %s had no file; dropped", h)
        self._inc("ssd_load_missing")
        self._inc("ssd_stale_index_cleaned")
        return None

    # ------------------------------------------------------------------- saves
    def save_block(self, block: "HostBlock") -> str:
        """Store one block (seed 000 §1). Never raises.

        Args:
            block: the block; its geometry must match the namespace.

        Returns:
            'saved' (file + row written), 'dedup' (already stored; access time touched),
            'collision' (same hash with other tokens, or hash isolated), 'error' (not stored).
        """
        if not self.enabled:
            self._inc("ssd_save_disabled")
            return "error"
        with self._lock:
            try:
                return self._save_locked(block)
            except Exception as exc:
                level = logging.WARNING if isinstance(exc, (OSError, sqlite3.Error)) else logging.ERROR
                log.log(level, "SSD save of %s failed: %s", getattr(block, "block_hash", "?"), exc)
                self._inc("ssd_save_fail")
                return "error"

    def _save_locked(self, block: "HostBlock") -> str:
        h = block.block_hash
        if not HASH_RE.match(h) or self.index is None:
            raise ValueError(f"cannot store block hash {h!r}")
        if self._is_noncacheable(h):
            return "collision"
        digest = blockfile.tokens_digest(block.token_ids)
        path = self._path(h)
        row = self.index.get(h)
        if row is not None:
            if not self._fs.exists(path):
                self.index.delete([h])
                self._inc("ssd_stale_index_cleaned")
                log.warning("stale SSD index row %s (no file) cleaned; saving again", h)
            elif row.tokens_digest != digest:
                self._isolate(h, "save")
                return "collision"
            else:
                self._touch(h)
                self._inc("ssd_save_dedup_skip")
                return "dedup"
        self._check_geometry(block)
        now = self._clock()
        data = blockfile.encode(block, self.layout_key, now)
        self._write_file(path, h, data)
        self.index.insert(
            IndexRow(h, block.parent_hash, block_relpath(h), block.num_tokens, len(data), digest, now, now)
        )
        self._inc("ssd_save_success")
        self._inc("ssd_bytes_written", len(data))
        return "saved"

    def _check_geometry(self, block: "HostBlock") -> None:
        e = self._expected
        shape = (1, e.n_kv_heads, e.block_size, e.head_dim)
        if (
            block.dtype != e.dtype
            or len(block.keys) != e.n_layers
            or block.num_tokens != e.block_size
            or any(tuple(a.shape) != shape for a in (*block.keys, *block.values))
        ):
            raise BlockFileError("shape", f"block {block.block_hash} does not match namespace geometry")

    def _write_file(self, path: Path, h: str, data: bytes) -> None:
        """Temp file in the final directory, fsync (durable), rename, fsync dir (durable)."""
        sub = path.parent
        if sub.name not in self._made_dirs:
            self._fs.makedirs(sub)
            if self.durable:
                self._fs.fsync_dir(self.namespace_dir)
            self._made_dirs.add(sub.name)
        tmp = temp_path_for(path, h)
        try:
            try:
                fd = self._fs.open_new(tmp)
            except FileNotFoundError:  # subdir removed by someone: recreate once
                self._fs.makedirs(sub)
                fd = self._fs.open_new(tmp)
            try:
                self._fs.write_all(fd, data)
                if self.durable:
                    self._fs.fsync(fd)
            finally:
                self._fs.close(fd)
            self._fs.replace(tmp, path)
        except BaseException:
            try:
                self._fs.unlink(tmp)
            except OSError as exc:
                log.warning("could not remove temp file %s: %s", tmp, exc)
            raise
        if self.durable:
            self._fs.fsync_dir(sub)

    # ----------------------------------------------------------------- removal
    def remove(self, hashes: Iterable[str]) -> int:
        """Delete blocks: rows in one transaction, then their files. Never raises.

        Returns:
            Rows deleted.
        """
        hashes = [h for h in hashes if HASH_RE.match(h)]
        if not self.enabled or not hashes:
            return 0
        with self._lock:
            try:
                n = self.index.delete(hashes)
            except sqlite3.Error as exc:
                self._index_error("remove", exc)
                return 0
            for h in hashes:
                self._unlink_quiet(self._path(h))
        return n

    def _discard(self, h: str) -> None:
        """Remove an unusable block: row first, then (only if that worked) the file."""
        with self._lock:
            try:
                if self.index is None:
                    return
                self.index.delete([h])
            except sqlite3.Error as exc:
                self._index_error("discard", exc)
                return
            self._unlink_quiet(self._path(h))

    def _unlink_quiet(self, path: Path) -> None:
        try:
            self._fs.unlink(path)
        except OSError as exc:
            log.warning("could not remove %s: %s", path, exc)

    # -------------------------------------------------------------- isolation
    def _is_noncacheable(self, h: str) -> bool:
        until = self._noncacheable.get(h)
        if until is None:
            return False
        if self._clock() < until:
            return True
        self._noncacheable.pop(h, None)
        return False

    def _isolate(self, h: str, where: str) -> None:
        self._noncacheable[h] = self._clock() + NONCACHEABLE_TTL_S
        self._inc("ssd_hash_collision_detected")
        log.warning("HASH COLLISION on %s: hash=%s holds other tokens; non-cacheable for %ds", where, h, NONCACHEABLE_TTL_S)

    # ------------------------------------------------------------------- misc
    def flush(self) -> None:
        """Commit batched access-time updates. Never raises."""
        index = self.index
        if index is None:
            return
        try:
            index.flush()
        except sqlite3.Error as exc:
            self._index_error("flush", exc)

    def totals(self) -> tuple[int, int]:
        """(blocks, bytes of block files) in the index; (0, 0) if disabled or unreadable."""
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

    def touch(self, h: str) -> None:
        """Record a use of block `h` (e.g. a RAM-tier hit) in its row's last access, batched.

        Keeps `prune --ttl` and the LRU order honest for blocks a long-running process serves
        from RAM. Never raises.
        """
        if self.enabled and self.index is not None:
            self._touch(h)

    def _touch(self, h: str) -> None:
        """Batched access-time update; a failed auto-flush costs only freshness."""
        try:
            self.index.touch(h, self._clock())
        except (sqlite3.Error, AttributeError) as exc:  # AttributeError: closed concurrently
            self._index_error("touch", exc)

    def _path(self, h: str) -> Path:
        return self.namespace_dir / block_relpath(h)

    def _inc(self, key: str, n: int = 1) -> None:
        with self._stats_lock:
            self._stats[key] += n

    def _index_error(self, what: str, exc: Exception) -> None:
        self._inc("ssd_index_errors")
        log.warning("SSD index %s failed in %s: %s", what, self.namespace_dir, exc)


__all__ = ["SSDStore", "ReconcileReport", "COUNTERS", "NONCACHEABLE_TTL_S", "REQUIRED_META"]
