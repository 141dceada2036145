"""The state every part of one namespace's SSD tier shares: `StoreCore` (with the removal of
unusable blocks: `remove`, `discard`, `tokens_mismatch`), the small types of its open path
(`Expected`, `ReconcileReport`, `Recent`), and the open path itself: when an existing index must
not be used (`refusal`), the read-only probe (`probe_writable`), `open_index` and the startup
reconcile (`reconcile`).

`SSDStore` (`kvtool.disk.namespace`) is a `StoreCore`; its save path (`kvtool.disk.namespace_save`)
takes a `StoreCore`. This module imports neither, so both depend on it and never on each other in
a cycle. Logs go to the `kvtool.disk.namespace` logger.
"""

from __future__ import annotations

import errno
import logging
import os
import sqlite3
import stat
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import suppress
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvtool.disk import segment as seg
from kvtool.disk.budget import SSDBudget
from kvtool.disk.fsops import DEFAULT_DIR_MODE, FileOps, scan_namespace, temp_is_leftover, temp_path_for
from kvtool.disk.index import BlockIndex
from kvtool.disk.kvlayout import KVLayout
from kvtool.disk.names import INDEX_FILENAME, NAMESPACE_RE, is_hash, is_segment_name, segment_relpath

if TYPE_CHECKING:
    import numpy as np

    from kvtool.disk.rowtable import IndexRow

log = logging.getLogger("kvtool.disk.namespace")

NONCACHEABLE_TTL_S = 3600.0  # a colliding hash is not cached for one hour (docs/design.md#chain-hash)
SUSPECT_MAX = 4096  # segments remembered as having failed verification (oldest forgotten first)
SAVED_MAX = 1 << 16  # hashes remembered as saved by this process, for `saved_count` (oldest first)


@dataclass
class ReconcileReport:
    """Startup reconcile of one namespace (the fast part of crash recovery: no row is loaded; docs/design.md#durability-modes).

    Attributes:
        temp_removed: leftover temp files removed.
        missing_rows_dropped: block rows whose segment file was gone, dropped.
        orphan_files: segment files without a segment row (for `kvtool validate` to adopt).
        rows: block rows after reconcile.
    """

    temp_removed: int = 0
    missing_rows_dropped: int = 0
    orphan_files: int = 0
    rows: int = 0


@dataclass(frozen=True)
class Expected:
    """What the blocks of one namespace must look like.

    Attributes:
        layout_key: the namespace's layout key.
        kv: per-layer KV shapes and dtype.
        block_size: tokens per full block (tail entries hold fewer).
        codec: how records are stored: 'none' or a `segment.CODECS` codec (meta `kv_codec`).
    """

    layout_key: str
    kv: KVLayout
    block_size: int
    codec: str = "none"

    @classmethod
    def from_meta(cls, layout_key: str, meta: dict[str, str]) -> Expected:
        """Build from namespace index metadata (string values).

        Raises:
            KeyError, ValueError: a key is missing or malformed.
        """
        codec = meta.get("kv_codec") or "none"
        if codec not in seg.CODECS:
            raise ValueError(f"unknown kv_codec {codec!r}")
        return cls(layout_key, KVLayout.parse(meta["kv_layers"], meta["kv_dtype"]), int(meta["block_size"]), codec)


class Recent:
    """A set that remembers its last `limit` members (oldest forgotten first). Thread-safe."""

    def __init__(self, limit: int):
        self.limit = limit
        self._items: dict[str, None] = {}
        self._lock = threading.Lock()

    def add(self, items: Iterable[str]) -> None:
        """Add (or refresh) members."""
        with self._lock:
            for item in items:
                self._items.pop(item, None)
                self._items[item] = None
            while len(self._items) > self.limit:
                del self._items[next(iter(self._items))]

    def __contains__(self, item: object) -> bool:
        with self._lock:
            return item in self._items

    def count(self, items: Iterable[str]) -> int:
        """How many distinct members of `items` are remembered."""
        with self._lock:
            return sum(item in self._items for item in set(items))


class StoreCore:
    """State and helpers of one namespace's SSD tier, shared by `SSDStore` and its open and
    save paths. Not used alone: `SSDStore` is the public class.

    Args: as `SSDStore`'s (`durability` checked there), and `counters`: the names of its counters
    (all start at 0).

    Attributes (besides the arguments kept as given: `cache_dir`, `layout_key`, `fs`, `clock`,
    `dir_mode`, `segment_max_bytes`):
        namespace_dir: the namespace's directory.
        enabled, read_only, disabled_reason: whether it serves, and why not.
        index, expected: the open index and the namespace's geometry (None until opened).
        lock: held by saves, removals and close.
        saved: hashes this process saved (`saved_count`).
        budget: the byte budget (`SSDStore.set_max_bytes`), or None.
    """

    def __init__(
        self,
        cache_dir: Path,
        layout_key: str,
        *,
        durability: str,
        fs: FileOps | None,
        clock: Callable[[], float] = time.time,
        noncacheable: dict[str, float] | None = None,
        dir_mode: int = DEFAULT_DIR_MODE,
        segment_max_bytes: int,
        counters: Iterable[str] = (),
    ):
        self.cache_dir = Path(cache_dir)
        self.layout_key = layout_key
        self.namespace_dir = self.cache_dir / layout_key
        self.durable = str(durability) == "durable"
        self.enabled = False
        self.read_only = False
        self.disabled_reason: str | None = None
        self.previous_shutdown_clean: bool | None = None
        self.reconcile_report = ReconcileReport()
        self.index: BlockIndex | None = None
        self.expected: Expected | None = None
        self.segment_max_bytes = segment_max_bytes
        self.dir_mode = dir_mode
        self.fs = fs or FileOps()
        self.clock = clock
        self._noncacheable = {} if noncacheable is None else noncacheable
        self.lock = threading.Lock()  # saves, removals, close
        self._stats_lock = threading.Lock()
        self._stats = dict.fromkeys(counters, 0)
        self._suspect = Recent(SUSPECT_MAX)  # segments a record of which failed verification
        self.saved = Recent(SAVED_MAX)  # hashes this process saved (`saved_count`)
        self.budget: SSDBudget | None = None  # the byte budget (`SSDStore.set_max_bytes`)
        self._place: tuple[tuple[int, int], tuple[int, int]] | None = None  # (root, namespace) (device, inode) at open

    @property
    def geometry(self) -> Expected:
        """`expected`, once the index is open (every read and write path runs only then)."""
        assert self.expected is not None, "SSD store used before its index was opened"
        return self.expected

    def disable(self, reason: str) -> None:
        self.enabled = False
        self.disabled_reason = reason
        log.warning("SSD tier disabled: %s", reason)

    def close_index_quietly(self) -> None:
        if self.index is not None:
            with suppress(sqlite3.Error):
                self.index.close()
            self.index = None

    def seg_path(self, name: str) -> Path:
        """Path of a segment (raises ValueError for a malformed name)."""
        return self.namespace_dir / segment_relpath(name)

    def pin_place(self) -> None:
        """Remember which directories the cache root and the namespace are (device, inode), once
        the namespace directory exists: every later write and unlink checks them (`write_path`).

        Raises:
            OSError: either cannot be stat'ed.
        """
        root, ns = os.stat(self.cache_dir), os.lstat(self.namespace_dir)  # the root may be a symlink its owner chose
        self._place = ((root.st_dev, root.st_ino), (ns.st_dev, ns.st_ino))

    def place_changed(self) -> str | None:
        """Why the cache root or the namespace directory is no longer the directory opened (moved,
        or swapped for a symlink or another directory while this process runs), or None."""
        if self._place is None:
            return None
        try:
            root, ns = os.stat(self.cache_dir), os.lstat(self.namespace_dir)
            same = stat.S_ISDIR(ns.st_mode) and ((root.st_dev, root.st_ino), (ns.st_dev, ns.st_ino)) == self._place
            gone = ""
        except OSError as exc:
            same, gone = False, f" ({exc.strerror})"
        if same:
            return None
        return (f"{self.namespace_dir} (or its cache directory) was moved or replaced while open{gone}: nothing "
                "more is written or removed there; restart to use the cache as it is now")  # fmt: skip

    def write_path(self, name: str) -> Path:
        """`seg_path` for a write or an unlink, once the namespace directory is checked to be the
        one opened (`place_changed`, one `lstat` and one `stat`): where it is not, the tier is
        disabled and nothing is created or removed outside the cache.

        Raises:
            OSError: ESTALE, the directory changed. ValueError: a malformed name.
        """
        why = self.place_changed()
        if why is not None:
            if self.enabled:
                self.disable(why)
            raise OSError(errno.ESTALE, why, str(self.namespace_dir))
        return self.seg_path(name)

    def unlink_quiet(self, path: Path) -> None:
        try:
            self.fs.unlink(path)
        except OSError as exc:
            log.warning("could not remove %s: %s", path, exc)

    def unlink_segment(self, name: str) -> None:
        """Remove segment `name`'s file where the namespace is still the directory opened
        (`write_path`); a failure is logged. Never raises."""
        try:
            self.fs.unlink(self.write_path(name))
        except (OSError, ValueError) as exc:
            log.warning("could not remove segment %s: %s", name, exc)

    def inc(self, key: str, n: int = 1) -> None:
        """Add `n` to one of the `ssd_` counters."""
        with self._stats_lock:
            self._stats[key] += n

    def _index_error(self, what: str, exc: Exception) -> None:
        self.inc("ssd_index_errors")
        log.warning("SSD index %s failed in %s: %s", what, self.namespace_dir, exc)

    # -------------------------------------------------------------- isolation
    def is_noncacheable(self, h: str) -> bool:
        until = self._noncacheable.get(h)
        if until is None:
            return False
        if self.clock() < until:
            return True
        self._noncacheable.pop(h, None)
        return False

    def cacheable(self, rows: dict[str, IndexRow]) -> dict[str, IndexRow]:
        """`rows` (hash -> row) without the isolated hashes (`is_noncacheable`); `rows` itself
        when no hash is isolated at all (the usual case: no per-row check)."""
        if not self._noncacheable:
            return rows
        return {h: row for h, row in rows.items() if not self.is_noncacheable(h)}

    def collision(self, h: str, where: str) -> None:
        """An intact block holds other token ids than asked for: isolate its hash for 1 h."""
        self._noncacheable[h] = self.clock() + NONCACHEABLE_TTL_S
        self.inc("ssd_hash_collision_detected")
        log.warning("HASH COLLISION on %s: hash=%s holds other tokens; non-cacheable for %ds", where, h, NONCACHEABLE_TTL_S)

    def touch_rows(self, hashes: Sequence[str]) -> None:
        """Batched access-time update of blocks; a failed auto-flush costs only freshness."""
        index = self.index
        if self.read_only or index is None:  # None: closed concurrently
            return
        try:
            index.touch_many(hashes, self.clock())
        except (sqlite3.Error, AttributeError) as exc:  # AttributeError: closed concurrently
            self._index_error("touch", exc)

    def suspect(self, segment: str) -> None:
        """Remember that a record of `segment` failed verification (a record swap damages two):
        a save of a block whose row points into it replaces that row instead of being dropped as
        a duplicate (`kvtool.disk.namespace_save`), so a recomputed block is stored again."""
        self._suspect.add([segment])

    def is_suspect(self, segment: str) -> bool:
        """True if a record of `segment` failed verification in this process (`suspect`)."""
        return segment in self._suspect

    # ----------------------------------------------------------------- removal
    def remove(self, hashes: Iterable[str]) -> int:
        """Delete blocks: rows in one transaction, then segment files left without rows.

        Returns:
            Rows deleted. Never raises.
        """
        hashes = [h for h in hashes if is_hash(h)]
        if not self.enabled or self.read_only or not hashes:
            return 0
        with self.lock:
            if self.index is None:  # closed meanwhile (close() takes the same lock)
                return 0
            try:
                n, emptied = self.index.delete(hashes)
            except sqlite3.Error as exc:
                self._index_error("remove", exc)
                return 0
            for name in emptied:
                self.unlink_segment(name)
        return n

    def discard(self, h: str, why: str) -> None:
        """Drop an unusable block: its row first, then its segment's file if now empty. Its
        segment becomes suspect (`suspect`): its other blocks were not verified either."""
        log.warning("SSD block %s unusable (%s); removed", h, why)
        self.inc("ssd_load_corrupt")
        if self.read_only:
            return
        try:
            row = self.index.get(h) if self.index is not None else None
        except sqlite3.Error:
            row = None
        if row is not None:
            self.suspect(row.segment)
        self.remove([h])

    def tokens_mismatch(self, row: IndexRow, expected: np.ndarray, where: str) -> None:
        """A verified record (checksums match) of `row` holds other token ids than the prompt's
        `expected` (int32). If the row's `tokens_digest` is the prompt's, the record contradicts
        its own row: a damaged or forged record (e.g. two records swapped with their checksums
        moved and the header re-sealed), dropped as any verification failure (`discard`).
        Otherwise the stored block really is another one under the same hash (`collision`)."""
        if row.tokens_digest == seg.tokens_digest(expected):
            self.discard(row.hash, "its record holds other token ids than its row says")
        else:
            self.collision(row.hash, where)

    def _drop_segment(self, name: str) -> None:
        if self.read_only:
            return
        with self.lock:
            try:
                if self.index is not None:
                    self.index.delete_segments([name])
            except sqlite3.Error as exc:
                self._index_error("drop segment", exc)
                return
            self.unlink_segment(name)


# ----------------------------------------------------------------------------- the open path
IDENTITY_META = ("block_size", "kv_dtype", "kv_layers", "model_id")
READ_ONLY_ERRNOS = (errno.EROFS, errno.EACCES, errno.EPERM)


def open_index(store: StoreCore, meta: dict[str, str], flush_interval_s: float) -> None:
    """Open `store`'s namespace: create its directory (exact mode), probe whether it is writable,
    open its index (read-only where it is not: `BlockIndex(read_only=True)`), check the stored
    meta against `meta`, and set `store.index`, `expected`, `enabled`, `read_only`.

    Raises:
        ValueError: a malformed layout key or meta.
        OSError, sqlite3.Error: the directory or index cannot be used (the caller disables the tier).
    """
    if not NAMESPACE_RE.match(store.layout_key):
        raise ValueError(f"layout key {store.layout_key!r} is not 32 hex characters")
    writable = probe_writable(store)
    store.pin_place()  # writes and unlinks check it (`StoreCore.write_path`)
    now = repr(store.clock())
    fresh = {**meta, "format_version": str(seg.FORMAT_VERSION), "layout_key": store.layout_key,
             "created": now, "last_open": now, "shutdown_clean": "0", "shutdown_partial_flush": "0"}  # fmt: skip
    db = store.namespace_dir / INDEX_FILENAME
    if not writable and not store.fs.exists(db):
        raise OSError(errno.EROFS, "read-only cache directory without an index", str(store.namespace_dir))
    store.index = BlockIndex(  # refuses an index or side file that is no regular file (never opened)
        db, store.durable, flush_interval_s=flush_interval_s, clock=store.clock, initial_meta=fresh,
        read_only=not writable, create=writable, quiet=store.fs.quiet_index,
    )  # fmt: skip
    stored = store.index.get_meta()
    if not store.index.created_meta:
        refused = refusal(store.layout_key, stored, meta)
        if refused:
            store.inc("ssd_namespace_refused")
            store.close_index_quietly()
            store.disable(refused)
            return
        store.previous_shutdown_clean = stored.get("shutdown_clean") == "1"
        if writable:
            store.index.set_meta({"last_open": now, "shutdown_clean": "0"})
    store.expected = Expected.from_meta(store.layout_key, {**meta, **stored})
    store.enabled = True
    if not writable:
        store.read_only = True
        store.disabled_reason = f"{store.namespace_dir} is not writable: serving hits read-only"
        log.warning("SSD tier read-only: %s", store.disabled_reason)


def probe_writable(store: StoreCore) -> bool:
    """Create the namespace directory (exact mode) and try a temp file in it.

    Returns:
        False if the directory exists but this process cannot write it (EROFS, EACCES, EPERM).

    Raises:
        OSError: the directory cannot be created or is not a real directory.
    """
    try:
        store.fs.makedirs(store.namespace_dir, store.dir_mode)
        probe = temp_path_for(store.namespace_dir / "probe", "probe")
        store.fs.close(store.fs.open_new(probe))
        store.fs.unlink(probe)
        return True
    except OSError as exc:
        if exc.errno in READ_ONLY_ERRNOS and store.fs.is_dir(store.namespace_dir):
            return False
        raise


def refusal(layout_key: str, stored: dict[str, str], meta: dict[str, str]) -> str | None:
    """Why an existing namespace index (meta `stored`) must not be used with `meta`, or None."""
    if not stored:
        return None
    if stored.get("format_version") != str(seg.FORMAT_VERSION):
        return f"namespace has format_version {stored.get('format_version')!r}, this kvtool writes {seg.FORMAT_VERSION}"
    if stored.get("layout_key") != layout_key:
        return f"namespace index belongs to layout {stored.get('layout_key')!r}"
    diff = [k for k in IDENTITY_META if stored.get(k) != meta[k]]
    return f"namespace metadata differs: {diff}" if diff else None


def reconcile(store: StoreCore) -> None:
    """Remove leftover temp files and drop segments whose file is missing (`store.reconcile_report`).

    Cheap at any size: one directory listing and the `segments` table (one row per write
    batch); block rows are not loaded. Never raises.
    """
    rep = store.reconcile_report
    index = store.index
    assert index is not None  # called only right after a successful open
    try:
        with index.connection() as conn:  # one read of a small table
            names = [r[0] for r in conn.execute("SELECT name FROM segments")]
        names = [n for n in names if is_segment_name(n)]  # malformed rows: validate reports them
        scan = scan_namespace(store.namespace_dir, store.fs)
        for tmp in scan.temps:
            if temp_is_leftover(store.fs, tmp):
                store.unlink_quiet(tmp)
                rep.temp_removed += 1
        gone = [n for n in names if n not in scan.files]
        gone = [n for n in gone if not store.fs.exists(store.seg_path(n))]  # re-check just before
        rep.missing_rows_dropped = index.delete_segments(gone) if gone else 0
        rep.orphan_files = len(set(scan.files) - set(names))
        rep.rows = index.totals()[0]
    except (OSError, sqlite3.Error, ValueError) as exc:
        log.warning("startup reconcile of %s incomplete: %s", store.namespace_dir, exc)
    store.inc("ssd_stale_index_cleaned", rep.missing_rows_dropped)
    if rep.temp_removed or rep.missing_rows_dropped or rep.orphan_files:
        log.info("SSD reconcile %s: %s", store.layout_key, asdict(rep))


__all__ = [
    "StoreCore", "Expected", "ReconcileReport", "Recent", "NONCACHEABLE_TTL_S", "SUSPECT_MAX", "SAVED_MAX",
    "open_index", "probe_writable", "refusal", "reconcile", "IDENTITY_META",
]  # fmt: skip
