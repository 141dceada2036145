"""`kvtool validate`: plan repairs from a scan (`plan_repairs`), then carry them out (`execute`:
namespace by namespace, each change a transaction, every file removed confined).

A dry run is a plan that is not executed. Rules, per usable namespace (`ok`/`empty`); nothing
that verifies is ever lost:

- leftover kvtool temp files (their writer is gone, or stale) -> removed;
- malformed rows (NULLs, wrong types, bad names: `IndexRow.from_db`) -> dropped;
- access times in the future (clock skew, tampering) -> clamped to now;
- a row that disagrees with the segment record it points at (slot, parent, length, size, token
  digest; `deep`: record checksum) is *rewritten* from a record of its hash that verifies (its own,
  or a copy in another segment); only a row with no verifying record anywhere is dropped
  (`missing_rows_dropped`: its segment file is gone; `corrupt_removed`: it is damaged);
- records without a row (every record of an orphan segment, i.e. a file no row names; a record
  of a segment that still has rows) get their row back when a prefix lookup can reach them
  (their parent chain is stored) and they verify (`orphans_adopted`): a lost or malformed row
  costs nothing. Blocks a prune removed never come back: their chain ends at a removed file.
  An orphan whose every record is stored elsewhere is removed (`duplicates_removed`, not a
  problem), one that does not verify or holds only unreachable blocks is removed
  (`orphans_removed`). A segment file named in the index's removal journal (a `prune` or
  `rm --prompt` killed between its rows' commit and its unlinks) is never adopted: it is removed
  (`removals_finished`), finishing the removal the user asked for;
- a `segments` row that is missing or wrong is rewritten from the file; one without file goes;
- rows no prefix lookup can reach (parent chain not ending at the namespace root, or a cycle)
  -> removed (`broken_chain_removed`);
- `unreadable` namespaces (corrupt index) are rebuilt from their segment files with
  `rebuild_index` (`kvtool validate --rebuild-index`); `uninitialized`, `outdated` and
  `foreign` namespaces and symlinks are left untouched and reported.

Safe while other processes serve from the same cache: every index change is a transaction, a
segment file is unlinked only once no row names it (re-checked just before), orphans are
re-checked before adoption, broken chains are re-checked on a fresh read, and temp files of
live writers are kept. Every path comes from `kvtool.disk.names` and is resolved without
following symlinks (`kvtool.disk.confined`). A repairing run holds the cache's maintenance lock
(`kvtool.disk.lock`) from the scan to the last change, so it never plans from rows or files that
a `prune` or `rm` is removing at the same moment; a dry run only reads and takes no lock.

Scale (docs/operations.md): the rows are read once, as columns (`kvtool.disk.rowtable`); the
segment files are opened once each. Clean segments (almost all of a healthy cache) are found
first, in batches (`kvtool.ops.clean_segments`); every other segment is then checked the general
way, in name order (`kvtool.ops.records.SegmentPass`). The chain tree (rows plus candidate
records) is built once. Memory grows with the blocks, never with the bytes of the cache.
"""

from __future__ import annotations

import dataclasses
import os
import sqlite3
import stat
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path

from kvtool.disk.chains import build_forest, key_of_hex
from kvtool.disk.confined import ConfinedDir
from kvtool.disk.fsops import FileOps, resolve_cache_root, short_path
from kvtool.disk.index import BlockIndex
from kvtool.disk.lock import cache_lock
from kvtool.disk.names import INDEX_FILENAME, INDEX_FILES, NAMESPACE_RE, segment_relpath
from kvtool.disk.rowtable import load_rows
from kvtool.disk.snapshot import read_quietly
from kvtool.hashing import root_parent
from kvtool.ops.heap import gc_paused
from kvtool.ops.rebuild import execute_rebuild, plan_rebuild
from kvtool.ops.records import SegmentPass
from kvtool.ops.repairs import (  # noqa: F401  (re-exported)
    MAX_DETAILS,
    REPAIRS,
    Actions,
    NamespaceRepair,
    RebuildPlan,
    RepairPlan,
    unlink_counted,
)
from kvtool.ops.scan import CacheScan, NamespaceScan, NamespaceStatus, ScanError, scan_cache, scan_namespace_dir
from kvtool.ops.validate_plan import ProgressFn, RepairPlanner


def validate(
    cache_dir: Path,
    namespace: str | None = None,
    deep: bool = False,
    dry_run: bool = False,
    progress: ProgressFn | None = None,
    fs: FileOps | None = None,
    *,
    rebuild_index: bool = False,
    now: float | None = None,
) -> RepairPlan:
    """Scan, plan and (unless `dry_run`) repair: a whole `kvtool validate`. A repairing run
    holds the maintenance lock (`kvtool.disk.lock.cache_lock`) from the scan to the last change.

    Raises:
        ScanError: the cache dir is not a directory or cannot be looked at, or `namespace`
            matches no namespace or several (a cache dir that does not exist yet is empty).
        PruneLocked: (not with `dry_run`) a prune, rm or validate holds the maintenance lock.
        PruneError: (not with `dry_run`) the lock file is unusable (a symlink, or it cannot be
            created: a read-only cache directory).
    """
    try:
        root = resolve_cache_root(cache_dir)
    except OSError as exc:
        raise ScanError(f"cannot use cache directory {short_path(cache_dir)}: {exc.strerror or exc}") from None
    lock: AbstractContextManager = nullcontext() if dry_run or not os.path.isdir(root) else cache_lock(root)
    with lock:  # a cache dir that does not exist yet: an empty cache, nothing to lock
        # an index file that is a FIFO, socket, device or directory: moved aside first (`move_irregular_index_files`)
        moved = {} if dry_run or not os.path.isdir(root) else move_irregular_index_files(root, namespace)
        scan = _with_moved_indexes(scan_cache(root, namespace, now=now, fs=fs), moved, fs)
        plan = plan_repairs(scan, deep=deep, rebuild_index=rebuild_index, progress=progress, moved=moved)
        return plan if dry_run else execute(plan)


@gc_paused
def plan_repairs(
    scan: CacheScan, *, deep: bool = False, rebuild_index: bool = False, progress: ProgressFn | None = None,
    moved: dict[str, list[MovedIndexFile]] | None = None,
) -> RepairPlan:  # fmt: skip
    """Decide every repair (reads segment headers, and records where needed; changes nothing).

    Args:
        scan: a `scan_cache` result.
        deep: read every record whole and verify its checksum (reads everything).
        rebuild_index: plan the rebuild of unreadable indexes from their segment files.
        progress: called as `progress(namespace, segments_done, segments_total)`.
        moved: namespace -> its index files moved aside before the scan
            (`move_irregular_index_files`): reported, and a namespace whose index itself moved is
            rebuilt from its segment files (`rebuild_index` or not).
    """
    moved = moved or {}
    plan = RepairPlan(str(scan.cache_dir), deep, rebuild_index=rebuild_index, symlinks=list(scan.symlinks))
    for ns in scan.namespaces:
        rep = NamespaceRepair(ns.name, ns.status.value, format_version=ns.format_version, rows=ns.row_count,
                              files=len(ns.files), ignored_entries=len(ns.other), symlinks=list(ns.symlinks),
                              irregular=list(ns.irregular))  # fmt: skip
        plan.namespaces.append(rep)
        for link in ns.symlinks:
            rep.note("symlink", link, "never followed")
        for m in moved.get(ns.name, ()):
            rep.irregular_removed += 1
            rep.note("irregular", m.name, f"a {m.kind}, not a file: SQLite would block on it; moved aside to {m.moved_to}")
        index_moved = any(m.name == INDEX_FILENAME for m in moved.get(ns.name, ()))
        if ns.usable:
            _plan_namespace(scan, ns, rep, deep, progress)
        elif (rebuild_index or index_moved) and _rebuildable(ns):
            try:
                rep.actions.rebuild = plan_rebuild(scan, ns, rep)
                rep.message = f"{ns.message} -> rebuilt from {len(ns.files)} segment file(s)"
            except OSError as exc:
                rep.outcome, rep.message = "failed", f"{ns.message}; cannot rebuild: {exc}"
        else:
            rep.outcome, rep.message = "skipped", ns.message
        if rep.outcome == "clean":
            rep.outcome = "problems" if rep.problems else "clean"
    return plan


def _with_moved_indexes(scan: CacheScan, moved: dict[str, list[MovedIndexFile]], fs: FileOps | None) -> CacheScan:
    """`scan` with the namespaces whose `index.sqlite` was moved aside added (a directory without
    an index is no namespace to `scan_cache`): each scans as unreadable, to be rebuilt."""
    seen = {ns.name for ns in scan.namespaces}
    lost = [name for name, files in moved.items() if name not in seen and any(m.name == INDEX_FILENAME for m in files)]
    if not lost:
        return scan
    extra = tuple(scan_namespace_dir(scan.cache_dir, name, now=scan.now, fs=fs) for name in lost)
    return dataclasses.replace(scan, namespaces=tuple(sorted(scan.namespaces + extra, key=lambda ns: ns.name)))


def _rebuildable(ns: NamespaceScan) -> bool:
    if ns.status == NamespaceStatus.UNREADABLE:
        return ns.cause == "index"
    return ns.status == NamespaceStatus.UNINITIALIZED and bool(ns.files) and not ns.row_count


def _plan_namespace(scan: CacheScan, ns: NamespaceScan, rep: NamespaceRepair, deep: bool, progress) -> None:
    exp = ns.expected
    assert exp is not None  # a usable namespace has its geometry
    journal = removal_journal(ns.path / INDEX_FILENAME)
    try:
        with ConfinedDir(scan.cache_dir, ns.name) as cdir, SegmentPass(cdir, ns.name, exp.kv, exp.block_size) as reader:
            RepairPlanner(scan.now, ns, rep, reader, deep, journal).run(progress)
    except OSError as exc:
        rep.outcome, rep.message = "failed", f"cannot open the namespace directory: {exc}"


def removal_journal(db: Path) -> set[str]:
    """The segment names in index `db`'s removal journal (`BlockIndex.removals`: files an
    interrupted `prune` or `rm --prompt` took the rows of); empty if it has none or cannot be read
    (read quietly: nothing created beside it)."""
    try:
        return read_quietly(db, lambda index: set(index.removals()))
    except sqlite3.Error:
        return set()


# ----------------------------------------------------------------------------- index files that are not files
# SQLite opens `index.sqlite` and its side files without `O_NOFOLLOW` or `O_NONBLOCK`, so no
# kvtool command opens a namespace where one of them is not a regular file
# (`kvtool.disk.names.irregular_index_file`: a FIFO would block forever), which disables it for
# good. A repairing `validate` renames every one that is a FIFO, socket, device or directory to
# `<name>.irregular` (`.irregular.1`, ... if taken) inside the namespace directory (a rename opens
# nothing, and deletes nothing kvtool may not have written); the scan that follows finds a
# readable index or none (then rebuilt from the segment files). A symlink is never touched.
IRREGULAR_SUFFIX = ".irregular"  # what an index file that is no file is renamed to (`.1`, ... if taken)


@dataclass(frozen=True)
class MovedIndexFile:
    """One index file moved aside: `name` (e.g. `index.sqlite-journal`) is now `moved_to`; `kind`
    says what it was (fifo, socket, device, directory)."""

    name: str
    moved_to: str
    kind: str


def _kind(mode: int) -> str | None:
    """What a non-regular, non-symlink entry is, or None for a regular file or a symlink."""
    if stat.S_ISREG(mode) or stat.S_ISLNK(mode):
        return None
    return ("fifo" if stat.S_ISFIFO(mode) else "socket" if stat.S_ISSOCK(mode) else
            "directory" if stat.S_ISDIR(mode) else "device")  # fmt: skip


def move_irregular_index_files(cache_dir: Path, only: str | None = None) -> dict[str, list[MovedIndexFile]]:
    """Rename aside every index file of the cache's namespaces (or of namespace `only`: a layout
    key or a unique prefix of one) that is a FIFO, socket, device or directory (see above). Run
    under the cache's maintenance lock.

    Returns:
        namespace -> the files moved (namespaces with none are left out). A namespace that cannot
        be opened (a symlink, gone) or a file that cannot be renamed is skipped: the scan reports
        it as before.
    """
    out: dict[str, list[MovedIndexFile]] = {}
    try:
        names = sorted(e.name for e in os.scandir(cache_dir) if NAMESPACE_RE.match(e.name) and e.is_dir(follow_symlinks=False))
    except OSError:
        return out
    if only is not None:  # a layout key or a unique prefix of one (else the scan says which error)
        names = [n for n in names if n.startswith(only)]
        names = names if len(names) == 1 else []
    for ns in names:
        try:
            with ConfinedDir(cache_dir, ns) as cdir:
                moved = [m for name in INDEX_FILES if (m := _move(cdir.fd, name)) is not None]
        except OSError:
            continue
        if moved:
            out[ns] = moved
    return out


def _move(dir_fd: int, name: str) -> MovedIndexFile | None:
    try:
        kind = _kind(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return None
    if kind is None:
        return None
    for n in range(100):
        dest = name + IRREGULAR_SUFFIX + (f".{n}" if n else "")
        try:
            os.stat(dest, dir_fd=dir_fd, follow_symlinks=False)
            continue  # taken
        except FileNotFoundError:
            pass
        except OSError:
            return None
        try:
            os.rename(name, dest, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except OSError:
            return None
        return MovedIndexFile(name, dest, kind)
    return None


# ----------------------------------------------------------------------------- execute
def execute(plan: RepairPlan) -> RepairPlan:
    """Carry out a repair plan (see the module docstring for the order). Never raises for I/O
    trouble: a namespace whose index cannot be written gets outcome 'failed' and a message."""
    root = Path(plan.cache_dir)
    for rep in plan.namespaces:
        if rep.outcome == "skipped" or not rep.actions.any():
            continue
        try:
            with ConfinedDir(root, rep.namespace) as cdir:
                if rep.actions.rebuild is not None:
                    execute_rebuild(root, cdir, rep.actions.rebuild, rep)
                else:
                    _execute_namespace(root / rep.namespace, cdir, rep)
        except (sqlite3.Error, OSError, ValueError) as exc:
            rep.outcome, rep.message = "failed", f"repair stopped: {exc}; nothing after that point was changed"
            continue
        repaired = any(getattr(rep, k) for k in REPAIRS) or rep.index_rebuilt or rep.duplicates_removed
        rep.outcome = "repaired" if repaired else ("problems" if rep.problems else "clean")
    plan.dry_run, plan.executed = False, True
    return plan


def _execute_namespace(ns_dir: Path, cdir: ConfinedDir, rep: NamespaceRepair) -> None:
    act = rep.actions
    for rel in act.temps:
        unlink_counted(rep, lambda: cdir.unlink_temp(rel), rel)  # noqa: B023  (called at once, inside the loop)
    with BlockIndex(ns_dir / INDEX_FILENAME, create=False) as index:
        if act.bad_rowids or act.bad_segment_rowids:
            index.delete_rowids(act.bad_rowids, act.bad_segment_rowids)
        if act.clamp:
            index.touch_many(act.clamp, time.time())  # a touch lowers an access time beyond the skew allowance to now
            index.flush()
        for seg_row, rewrite, adopt in act.writes.values():
            if adopt:  # a live writer may have stored them meanwhile: never replace its rows
                present = index.present([r.hash for r in adopt])
                adopt = [r for r in adopt if r.hash not in present]
                if not adopt and not rewrite:
                    continue
            index.insert_segment(seg_row, rewrite + adopt)
        emptied = index.delete(act.drop)[1] if act.drop else []
        links = set(rep.symlinks)  # reported, never followed: a symlinked segment (or its directory) is not unlinked

        def unlink_segment(name: str) -> None:
            if segment_relpath(name) not in links and name[:2] not in links:
                unlink_counted(rep, lambda: cdir.unlink_segment(name), name)

        for rel in act.irregular:  # their rows are gone (dropped above, or rewritten to a copy)
            unlink_counted(rep, lambda: cdir.unlink_irregular(rel), rel)  # noqa: B023  (called at once, inside the loop)
        if act.broken:  # re-check on a fresh read: a live writer may have stored a missing parent
            act.broken = _still_unrooted(index, rep.namespace, act.broken)
            emptied += index.delete(act.broken)[1] if act.broken else []
        for name in emptied:
            unlink_segment(name)
        for name in act.remove_segments:
            if index.segment_rows(name):  # rows appeared meanwhile (a live writer): keep it
                continue
            index.delete_segments([name])
            unlink_segment(name)
        forget = list(act.forget_removals)
        for name in act.finish_removals:  # an interrupted removal, finished: its rows are long gone
            if index.segment_rows(name):
                forget.append(name)  # rows name it again: it is kept, the entry is stale
                continue
            failed = rep.unlink_failed
            unlink_counted(rep, lambda: cdir.unlink_segment(name), name)  # noqa: B023  (called at once, inside the loop)
            if rep.unlink_failed == failed:
                forget.append(name)
        if forget:
            index.forget_removals(forget)


def _still_unrooted(index: BlockIndex, namespace: str, hashes: list[str]) -> list[str]:
    """Those of `hashes` whose rows a prefix lookup still cannot reach, on a fresh read."""
    with index.connection() as conn:
        t = load_rows(conn)
    root = key_of_hex(root_parent(namespace))
    forest = build_forest(t.parent_rows(), (t.parent == root).all(axis=1), None)
    rows = t.find(hashes)
    return [h for h, r in zip(hashes, rows.tolist()) if r >= 0 and not forest.rooted[r]]


__all__ = [
    "validate", "plan_repairs", "execute", "RepairPlan", "NamespaceRepair", "move_irregular_index_files", "MovedIndexFile",
    "MAX_DETAILS", "REPAIRS",
]  # fmt: skip
