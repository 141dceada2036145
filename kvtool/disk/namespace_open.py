"""Opening one namespace of the SSD tier: when an existing index must not be used (`refusal`),
and the startup reconcile (`reconcile`).

Split out of `kvtool.disk.namespace`; the types it fills in (`Expected`, `ReconcileReport`) and the
state it works on (`StoreCore`) are `kvtool.disk.namespace_core`'s (re-exported here and by
`kvtool.disk.namespace`). Logs go to the `kvtool.disk.namespace` logger. This module never imports MLX (the
SSD writer thread calls it).
"""

from __future__ import annotations

import errno
import logging
import sqlite3
from dataclasses import asdict

from kvtool.disk import segment as seg
from kvtool.disk.fsops import scan_namespace, temp_is_leftover, temp_path_for
from kvtool.disk.index import BlockIndex
from kvtool.disk.names import INDEX_FILENAME, NAMESPACE_RE, is_segment_name
from kvtool.disk.namespace_core import Expected, Recent, ReconcileReport, StoreCore

log = logging.getLogger("kvtool.disk.namespace")

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
        read_only=not writable, create=writable,
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
        gone = [n for n in gone if not store.fs.exists(store.seg_path(n, check=False))]  # re-check just before
        rep.missing_rows_dropped = index.delete_segments(gone) if gone else 0
        rep.orphan_files = len(set(scan.files) - set(names))
        rep.rows = index.totals()[0]
    except (OSError, sqlite3.Error, ValueError) as exc:
        log.warning("startup reconcile of %s incomplete: %s", store.namespace_dir, exc)
    store.inc("ssd_stale_index_cleaned", rep.missing_rows_dropped)
    if rep.temp_removed or rep.missing_rows_dropped or rep.orphan_files:
        log.info("SSD reconcile %s: %s", store.layout_key, asdict(rep))


__all__ = [
    "Expected", "ReconcileReport", "Recent", "open_index", "probe_writable", "refusal", "reconcile", "IDENTITY_META",
]  # fmt: skip
