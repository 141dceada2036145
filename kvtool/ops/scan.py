"""`scan_cache`: one read-only look at an SSD cache, shared by `inspect`, `validate` and `prune`.

The pattern of `huggingface_hub`'s `scan_cache_dir`: the cache is read once into frozen,
typed results, and each command only renders or plans from them:

    scan = scan_cache(cache_dir)                 # read-only: indexes opened quietly, files listed
    for ns in scan.namespaces:
        ns.status, ns.meta, ns.rows, ns.files, ns.missing, ns.orphans, ns.tree ...

Per namespace: the index files are checked to be regular files, the index is opened read-only
(`kvtool.disk.snapshot.read_quietly`), its meta is checked against the directory name (a meta
that does not hash to its name is `foreign`), every row is read and checked in one read
transaction (`kvtool.disk.rowtable.load_rows`), and the directory is listed, without following
symlinks, once the rows' snapshot is fixed (a row is never inserted before its file exists, so
the listing sees every file a row of the snapshot names). No segment file is read. The chain
tree of the rows (`forest`, `tree`) is built on first use, once.

Statuses (`NamespaceStatus`, one vocabulary for every command):

| status | meaning | validate / prune |
|---|---|---|
| `ok` | usable, holds blocks or files | repaired / pruned |
| `empty` | usable, holds nothing | as `ok` |
| `uninitialized` | no meta yet (creation interrupted or in progress, or an index rebuilt without its meta: the next process that opens it completes it) | left alone |
| `unreadable` | the index cannot be read (corrupt, missing beside segment files, a symlink, a full disk) | `validate --rebuild-index` rebuilds a corrupt index; prune removes whole segment files by age on a full disk; else left alone |
| `outdated` | another format version (format 1: one file per block) | prune removes it whole by TTL |
| `foreign` | its meta contradicts its name (layout key) | left untouched, reported |
"""

from __future__ import annotations

import math
import os
import sqlite3
import stat
import threading
import time
from collections.abc import Mapping
from contextlib import suppress
from pathlib import Path
from types import MappingProxyType

import numpy as np

from kvtool.disk.confined import disk_full, free_bytes
from kvtool.disk.fsops import (
    FileOps,
    NamespaceSelectError,
    resolve_cache_root,
    scan_namespace,
    select_namespaces,
    short_path,
    temp_is_leftover,
)
from kvtool.disk.index import FUTURE_SKEW_S, BlockIndex
from kvtool.disk.names import INDEX_FILENAME, INDEX_FILES, LOCK_FILENAME, irregular_index_file
from kvtool.disk.namespace_core import Expected
from kvtool.disk.rowtable import SegmentRow, load_rows
from kvtool.disk.segment import FORMAT_VERSION
from kvtool.disk.snapshot import read_quietly, read_snapshot
from kvtool.hashing import layout_key_of_meta
from kvtool.ops.heap import gc_paused, release_free_heap
from kvtool.ops.scan_results import (  # the results: re-exported under the names callers use
    OUTDATED_HINT,
    REBUILD_HINT,
    USABLE,
    CacheScan,
    NamespaceScan,
    NamespaceStatus,
    ScanError,
    SegmentFile,
    TempFile,
)


@gc_paused
def scan_cache(
    cache_dir: Path, namespace: str | None = None, *, now: float | None = None, fs: FileOps | None = None,
    rows: bool = True, full: bool = True,
) -> CacheScan:  # fmt: skip
    """Scan an SSD cache (read-only).

    Args:
        cache_dir: the SSD tier root; a symlink there is followed once (`CacheScan.cache_dir` is
            the resolved path); a root that does not exist yet is an empty cache.
        namespace: only this namespace (a layout key or a unique prefix of one); None = all.
        now: the scan time (unix seconds; injectable for tests).
        fs: file-system operations (listing; fault injection in tests).
        rows: read every row (`NamespaceScan.table`); False: only count them (malformed rows
            included) and list the segment files by name (sizes 0, `irregular` not told apart):
            no `bad_rows`, `segment_rows`, `missing`, `orphans` or `future_rows` then (what `kvtool
            rm NAMESPACE` needs: it removes the whole directory).
        full: keep every column of the rows; False: not their token digests and creation times
            (`inspect`, `prune` and `rm --prompt` plan without them: less memory).

    Raises:
        ScanError: `cache_dir` is not a directory or cannot be looked at (a name too long, no
            permission), or `namespace` matches none or several.
    """
    fs = fs or FileOps()
    now = time.time() if now is None else now
    try:
        cache_dir = resolve_cache_root(cache_dir)
    except OSError as exc:
        raise ScanError(f"cannot use cache directory {short_path(cache_dir)}: {exc.strerror or exc}") from None
    try:
        dirs = select_namespaces(cache_dir, namespace, fs)
    except NamespaceSelectError as exc:
        raise ScanError(str(exc)) from None
    links: list[str] = []
    other: list[str] = []
    if namespace is None:
        picked = {d.name for d in dirs}
        try:
            names = sorted(fs.listdir(cache_dir))
        except OSError:
            names = []
        for n in names:
            if os.path.islink(cache_dir / n):
                links.append(n)
            elif n not in picked and n != LOCK_FILENAME:
                other.append(n)
    spaces = tuple(scan_namespace_dir(cache_dir, d.name, now=now, fs=fs, rows=rows, full=full) for d in dirs)
    release_free_heap()  # what reading the rows freed (a million rows: batches, sort orders)
    return CacheScan(cache_dir, now, spaces, tuple(links), tuple(other))


def scan_namespace_dir(cache_dir: Path, name: str, *, now: float | None = None, fs: FileOps | None = None,
                       rows: bool = True, full: bool = True) -> NamespaceScan:  # fmt: skip
    """Scan one namespace directory (see the module docstring). Never raises for its content."""
    return _Scanner(Path(cache_dir) / name, time.time() if now is None else now, fs or FileOps(), rows, full).run()


class _Scanner:
    def __init__(self, path: Path, now: float, fs: FileOps, rows: bool = True, full: bool = True):
        self.path, self.now, self.fs, self.rows, self.full = path, now, fs, rows, full
        self.f: dict = {"name": path.name, "path": path, "now": now}

    def run(self) -> NamespaceScan:
        self.f["last_used"] = self._index_mtime()
        link = irregular_index_file(self.path / INDEX_FILENAME)
        if link:
            self._list_files()
            return self._done(NamespaceStatus.UNREADABLE, (f"{link} is not a regular file: never opened, never followed (SQLite would follow a symlink or block on a FIFO); "
                               "a repairing `kvtool validate` moves a FIFO, socket, device or directory aside (an index "
                               "moved is rebuilt from the segment files) and leaves a symlink"), "link")  # fmt: skip
        first = dict(self.f)
        try:
            return read_quietly(self.path / INDEX_FILENAME, lambda index: self._read(index, first))
        except sqlite3.Error as exc:
            return self._unreadable(exc)

    # ------------------------------------------------------------------ steps
    def _read(self, index: BlockIndex, first: dict) -> NamespaceScan:
        """The scan of `index` (anything a read before left in `self.f` is dropped: `first`)."""
        self.f = f = dict(first)
        if not index.initialized():
            if not self._list_files():
                return self._done(NamespaceStatus.UNREADABLE, "cannot list the namespace directory", "listing")
            with suppress(sqlite3.Error):  # an index rebuilt without its meta has rows; one killed before its schema has none
                self._read_rows(index)
                f["meta"] = MappingProxyType(index.get_meta())
            n = len(f.get("files", {}))
            why = (f"no metadata yet; {n} segment file(s) and {f.get('row_count', 0)} row(s): completed by the next "
                   f"kvtool process that opens this namespace with its model" if n else
                   "creation interrupted or in progress: nothing stored")  # fmt: skip
            return self._done(NamespaceStatus.UNINITIALIZED, why)
        meta = index.get_meta()
        f["meta"] = MappingProxyType(meta)
        f["format_version"] = version = meta.get("format_version")
        f["last_used"] = _newest(self.now, f["last_used"], *(_num(meta.get(k)) for k in ("created", "last_open", "last_close")))
        if version != str(FORMAT_VERSION):
            self._list_files()
            newer = (number := _int(version)) is not None and number > FORMAT_VERSION
            msg = (f"format_version {version!r} is newer than this kvtool's ({FORMAT_VERSION}): left untouched" if newer else
                   f"format_version {version!r}, this kvtool reads {FORMAT_VERSION}: its blocks are never used; {OUTDATED_HINT}")  # fmt: skip
            return self._done(NamespaceStatus.OUTDATED, msg)
        problem = meta_problem(self.path.name, meta)
        if problem:
            self._list_files()
            return self._done(NamespaceStatus.FOREIGN, f"{problem}: left untouched (remove the directory if it is not yours)")
        f["expected"] = Expected.from_meta(self.path.name, meta)
        if not self._read_rows_and_list(index):  # every row, checked; malformed ones by rowid
            return self._done(NamespaceStatus.UNREADABLE, "cannot list the namespace directory", "listing")
        table, files = f.get("table"), f["files"]
        if table is not None:
            planted = {Path(rel).name.split(".")[0] for rel in f["irregular"]}
            named = set(table.segments) | {s.name for s in f["segment_rows"]}
            f["missing"] = tuple(sorted(n for n in named if n not in files and n not in planted))
            referenced = table.segment_numbers
            orphans = [n for n in sorted(files) if n not in referenced]
            # a writer may have renamed a segment in and inserted its rows since the row snapshot
            f["orphans"] = tuple(n for n in orphans if not index.segment_rows(n))
            future = np.flatnonzero(table.last_access > self.now + FUTURE_SKEW_S)
            f["future_rows"] = tuple(table.hashes(future)) if future.size else ()
        rows = f.get("row_count", 0)
        empty = not rows and not files
        return self._done(NamespaceStatus.EMPTY if empty else NamespaceStatus.OK, "")

    def _read_rows_and_list(self, index: BlockIndex) -> bool:
        """`_read_rows` in a thread, `_list_files` here as soon as the rows' snapshot is fixed
        (files are listed after it, as if one came after the other). Returns what `_list_files`
        does.

        Raises:
            sqlite3.Error: the index cannot be read.
        """
        fixed = threading.Event()
        failed: list[BaseException] = []

        def read() -> None:
            try:
                self._read_rows(index, fixed)
            except BaseException as exc:  # handed to the caller below
                failed.append(exc)
            finally:
                fixed.set()

        reader = threading.Thread(target=read, name="kvtool-scan-rows", daemon=True)
        reader.start()
        fixed.wait()
        listed = self._list_files() if not failed else False
        reader.join()
        if failed:
            raise failed[0]
        return listed

    def _read_rows(self, index: BlockIndex, fixed: threading.Event | None = None) -> None:
        """Rows (columns, or a count), malformed rowids and `segments` rows, in one snapshot;
        `fixed` is set once the snapshot is (its first read done).

        Raises:
            sqlite3.Error: the index cannot be read.
        """
        f = self.f
        with read_snapshot(index, pair=self.rows) as (conn, also):  # the rows: two threads in one snapshot
            if fixed is not None:
                fixed.set()
            if self.rows:
                table = load_rows(conn, full=self.full, also=also)
                f.update(table=table, row_count=len(table), bad_rows=tuple(table.bad_rowids))
            else:  # counted, not checked: malformed rows included
                (f["row_count"],) = conn.execute("SELECT COUNT(*) FROM blocks").fetchone()
            segs, bad = [], []
            query = "SELECT rowid, name, nbytes, n_blocks, created FROM segments ORDER BY name" if self.rows else ""
            for rowid, *vals in conn.execute(query) if query else ():
                seg = SegmentRow.from_db(vals)
                segs.append(seg) if seg else bad.append(rowid)
            f.update(segment_rows=tuple(segs), bad_segment_rows=tuple(bad))

    def _list_files(self) -> bool:
        """List segment files, temps, symlinks, other entries (no symlink followed)."""
        try:
            listing = scan_namespace(self.path, self.fs, with_stat=self.rows)
        except OSError:
            return False
        files, irregular = {}, []
        for name, rel in sorted(listing.files.items()):
            if not self.rows:  # only counted: names, no stat (sizes 0)
                files[name] = SegmentFile(name, rel, 0, 0.0)
                continue
            st = listing.stats.get(rel)
            if st is None:
                continue
            if stat.S_ISREG(st.st_mode):
                files[name] = SegmentFile(name, rel, st.st_size, st.st_mtime)
            elif not stat.S_ISLNK(st.st_mode):
                irregular.append(rel)
        temps = []
        for p in listing.temps:
            rel = str(p.relative_to(self.path))
            st = listing.stats.get(rel) if self.rows else os.lstat(p) if os.path.lexists(p) else None
            if st is None:
                continue
            if not stat.S_ISREG(st.st_mode):
                irregular.append(rel)
                continue
            temps.append(TempFile(rel, st.st_size, temp_is_leftover(self.fs, p, self.now)))
        self.f.update(files=MappingProxyType(files), temps=tuple(temps), symlinks=tuple(listing.symlinks),
                      irregular=tuple(sorted(irregular)), other=tuple(listing.other))  # fmt: skip
        return True

    def _index_mtime(self) -> float | None:
        times = []
        for name in INDEX_FILES[:2]:
            try:
                st = os.lstat(self.path / name)
            except OSError:
                continue
            if st.st_size:  # a read-only open leaves an empty -wal behind: not a use
                times.append(st.st_mtime)
        return _newest(self.now, *times)

    def _unreadable(self, exc: Exception) -> NamespaceScan:
        self._list_files()
        if disk_full(self.path):
            return self._done(
                NamespaceStatus.UNREADABLE,
                f"index cannot be opened on a full disk ({free_bytes(self.path)} bytes free: {exc}); "
                "`kvtool prune` removes whole segment files by age",
                "disk_full",
            )
        missing = not os.path.lexists(self.path / INDEX_FILENAME)  # deleted, segment files left (`select_namespaces`)
        what = f"{INDEX_FILENAME} is missing" if missing else f"index cannot be read ({exc})"
        return self._done(NamespaceStatus.UNREADABLE, f"{what}; {REBUILD_HINT}", "index")

    def _done(self, status: NamespaceStatus, message: str, cause: str = "") -> NamespaceScan:
        return NamespaceScan(status=status, message=message, cause=cause, **self.f)


def meta_problem(name: str, meta: Mapping[str, str]) -> str | None:
    """Why a format-2 namespace's meta contradicts its name (the layout key), or None.

    The layout key is a digest of the model id, KV layout, dtype, block size, format version,
    model class, library versions and KV quantisation (`kvtool.hashing.layout_key`, fed from the
    meta exactly as `kvtool.cache.prefix.PrefixCache` writes it), so a meta with, e.g., a wrong
    `block_size` no longer hashes to its directory name.
    """
    if meta.get("layout_key") != name:
        return f"its meta names layout {meta.get('layout_key')!r}, not its directory name"
    try:
        key = layout_key_of_meta(meta)
        if int(meta["block_size"]) <= 0:
            raise ValueError("block_size must be positive")
        Expected.from_meta(name, dict(meta))
    except (KeyError, ValueError, TypeError) as exc:
        return f"its meta is incomplete or malformed ({exc!r})"
    if key != name:
        return "its meta (model, KV layout, dtype, block size, libraries) does not hash to its layout key"
    return None


def _num(text: str | None) -> float | None:
    try:
        v = float(text) if text is not None else None
    except ValueError:
        return None
    return v if v is not None and math.isfinite(v) and v >= 0 else None


def _int(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def _newest(now: float, *times: float | None) -> float | None:
    vals = [min(t, now) for t in times if t is not None]
    return max(vals) if vals else None


__all__ = [
    "scan_cache", "scan_namespace_dir", "meta_problem", "CacheScan", "NamespaceScan", "NamespaceStatus",
    "SegmentFile", "TempFile", "ScanError", "USABLE", "REBUILD_HINT", "OUTDATED_HINT",
]  # fmt: skip
