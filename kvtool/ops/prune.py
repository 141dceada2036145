"""`kvtool prune`: plan from a scan (`plan_prune`), then execute (`execute_prune`), under the lock.

The unit of removal is a *segment file*; the rules (TTL, then the byte budget by least recent
*effective* access, descendants with their ancestors) are docs/operations.md#kvtool-prune, and
the planner (`SegmentPlanner`, `fit_budget`) is `kvtool.disk.planner`, shared with the SSD
tier's byte budget. `outdated` namespaces (format 1) unused for the TTL are removed whole
(`kvtool.ops.remove_tree`); `unreadable` ones on a full disk are planned from their segment
files' ages; `foreign`, `uninitialized` and other `unreadable` namespaces are left (reported).

Execution, per namespace: the rows in one transaction, which also records the segment files left
without rows in the index's removal journal (`BlockIndex.delete(journal=True)`), then those files,
each forgotten by the journal once gone. That commit is the removal's commit point: a prune (or
`rm --prompt`, executed here too) killed after it leaves files that `kvtool validate` finishes
removing (it never re-adopts a journaled file). If the index cannot be written because the disk
is full, the planned segment files are removed first and the rows after, when there is room
again.

This module never imports `kvtool.ops.inspect_cache`.
"""

from __future__ import annotations

import sqlite3
import time
from dataclasses import dataclass, field, fields
from pathlib import Path

import numpy as np

from kvtool.disk.confined import ConfinedDir, disk_full
from kvtool.disk.index import BlockIndex
from kvtool.disk.lock import LOCK_FILENAME, PruneError, PruneLocked, cache_lock
from kvtool.disk.names import INDEX_FILENAME
from kvtool.disk.planner import Segment, SegmentPlanner, fit_budget
from kvtool.disk.segment import FORMAT_VERSION
from kvtool.ops.heap import gc_paused
from kvtool.ops.remove_tree import plan_tree, remove_tree
from kvtool.ops.scan import CacheScan, NamespaceScan, NamespaceStatus, scan_cache

LEFT_ALONE_PROBLEMS = (NamespaceStatus.UNREADABLE, NamespaceStatus.FOREIGN)
HIDDEN_FIELDS = ("planner", "clamp")


@dataclass
class NamespacePlan:
    """Plan (and, once executed, outcome) for one namespace. Sizes in bytes (segment files).

    Attributes:
        namespace: layout key.
        model_name: from the index meta (None if unknown).
        status: the scan's `NamespaceStatus` value.
        message: why the namespace is left untouched or handled specially, or what failed.
        blocks, segments, bytes: rows, segments with rows, and their file bytes when planned.
        {ttl,lru,descendant}_blocks: blocks removed for that reason.
        {ttl,lru,descendant}_segments, _bytes: segment files removed for that reason, their bytes.
        prune_blocks, prune_segments, prune_bytes: everything removed.
        blocks_after, segments_after, bytes_after: what the plan leaves.
        remove_namespace: an `outdated` namespace removed whole (unused for the TTL).
        by_file_age: planned from segment file ages (the index cannot be opened on a full disk).
        rows_deleted, files_deleted, bytes_freed, unlink_failed: outcome (0 until executed).
        index_failed: the rows could not be deleted (files may be gone: run `kvtool validate`).
        access_clamped: access times in the future (clock skew) lowered to the planning time, so
            they cannot keep their chains alive through every TTL.
        planner: the namespace's planner once planned; the chosen blocks and segment files are
            its choices (`hashes`, `segment_names`; not in `to_dict`).
        clamp: the rows whose access time is clamped (not in `to_dict`).
        left: of a namespace removed whole, the entries kvtool never writes (paths relative to
            it, a directory with a trailing '/'): left where they are (`kvtool.ops.remove_tree`).
    """

    namespace: str
    model_name: str | None = None
    status: str = NamespaceStatus.OK.value
    message: str = ""
    blocks: int = 0
    segments: int = 0
    bytes: int = 0
    ttl_blocks: int = 0
    ttl_segments: int = 0
    ttl_bytes: int = 0
    lru_blocks: int = 0
    lru_segments: int = 0
    lru_bytes: int = 0
    descendant_blocks: int = 0
    descendant_segments: int = 0
    descendant_bytes: int = 0
    prune_blocks: int = 0
    prune_segments: int = 0
    prune_bytes: int = 0
    blocks_after: int = 0
    segments_after: int = 0
    bytes_after: int = 0
    remove_namespace: bool = False
    by_file_age: bool = False
    rows_deleted: int = 0
    files_deleted: int = 0
    bytes_freed: int = 0
    unlink_failed: int = 0
    index_failed: bool = False
    access_clamped: int = 0
    planner: SegmentPlanner | None = field(default=None, repr=False, compare=False)
    clamp: list[str] = field(default_factory=list, repr=False)
    left: list[str] = field(default_factory=list)

    @property
    def problems(self) -> int:
        untouched = self.status in LEFT_ALONE_PROBLEMS and not self.by_file_age
        return int(untouched) + self.unlink_failed + int(self.index_failed)

    @property
    def hashes(self) -> list[str]:
        """The chosen blocks (hashes, sorted; made when asked: one string per block)."""
        return sorted(self.planner.removed_block_names()) if self.planner is not None else []

    @property
    def segment_names(self) -> list[str]:
        """The chosen segment files (names, sorted)."""
        p = self.planner
        return [p.names[i] for i in p.removed_segment_ids().tolist()] if p is not None else []

    def count_removed(self, planner: SegmentPlanner, reasons: tuple[str, ...] = ("ttl", "lru", "descendant")) -> None:
        """Count what `planner` chose: per reason of `reasons` its blocks, segment files and their
        bytes (`{reason}_blocks`, `_segments`, `_bytes`), everything removed (`prune_*`) and what
        is left (`*_after`)."""
        for why, (blocks, segments, size) in planner.counts().items():
            if why in reasons:
                setattr(self, f"{why}_blocks", getattr(self, f"{why}_blocks") + blocks)
                setattr(self, f"{why}_segments", getattr(self, f"{why}_segments") + segments)
                setattr(self, f"{why}_bytes", getattr(self, f"{why}_bytes") + size)
        self.prune_blocks = int(planner.removed_block_ids().size)
        self.prune_segments = int(planner.removed_segment_ids().size)
        self.prune_bytes = self.bytes - planner.kept_bytes
        self.blocks_after, self.segments_after = self.blocks - self.prune_blocks, self.segments - self.prune_segments
        self.bytes_after = planner.kept_bytes

    def fields_dict(self) -> dict:
        """The report fields (everything but the planner and the rows to clamp)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in HIDDEN_FIELDS}


@dataclass
class PrunePlan:
    """What a prune removes, per namespace.

    Attributes:
        cache_dir: the SSD tier root.
        ttl_s: TTL in seconds (None: no TTL rule).
        max_bytes: byte budget (None: no budget rule).
        scope: 'namespace' (each namespace under `max_bytes`) or 'all' (the whole cache).
        now: the planning (scan) time (unix seconds).
        namespaces: one plan per namespace scanned.
        dry_run: not executed on purpose.
        executed: `execute_prune` ran.
    """

    cache_dir: str
    ttl_s: float | None
    max_bytes: int | None
    scope: str
    now: float
    namespaces: list[NamespacePlan] = field(default_factory=list)
    dry_run: bool = False
    executed: bool = False

    def total(self, name: str) -> int:
        """Sum of one `NamespacePlan` count over the namespaces."""
        return sum(getattr(ns, name) for ns in self.namespaces)

    def removes_anything(self) -> bool:
        """Something would be (or was) removed."""
        return any(ns.remove_namespace or ns.prune_blocks or ns.prune_segments for ns in self.namespaces)

    @property
    def problems(self) -> int:
        """Unreadable or foreign namespaces left untouched, files not removed, index failures."""
        return sum(ns.problems for ns in self.namespaces)

    def to_dict(self) -> dict:
        """JSON-ready document (the `--json` output)."""
        doc = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "namespaces"}
        doc["namespaces"] = [ns.fields_dict() for ns in self.namespaces]
        keys = ("blocks", "segments", "bytes", "prune_blocks", "prune_segments", "prune_bytes", "blocks_after",
                "segments_after", "bytes_after", "rows_deleted", "files_deleted", "bytes_freed", "unlink_failed")  # fmt: skip
        doc["totals"] = {k: self.total(k) for k in keys}
        doc["problems"] = self.problems
        return doc


# ----------------------------------------------------------------------------- planning
def planner_of(ns: NamespaceScan) -> SegmentPlanner:
    """The planner of a scanned namespace: its segments with rows (usable namespaces; a segment's
    access is the newest effective access of its blocks, its depth their deepest), or its segment
    files by age (index unreadable on a full disk: no blocks known)."""
    files = ns.files
    if not ns.usable or ns.table is None or ns.forest is None:
        names = sorted(files)
        return SegmentPlanner.from_arrays(names, np.array([files[n].size for n in names], dtype=np.int64),
                                          np.array([files[n].mtime for n in names], dtype=np.float64),
                                          np.zeros(len(names), dtype=np.int64), np.zeros(0, dtype=np.int64), None,
                                          lambda ids: [])  # fmt: skip
    t = ns.table
    size = np.array([files[n].size if n in files else 0 for n in t.segments], dtype=np.int64)
    return SegmentPlanner.from_forest(t.segments, size, t.seg, ns.forest, t.hashes)


def check_limits(ttl_s: float | None, max_bytes: int | None, namespace: str | None = None, all_namespaces: bool = False) -> None:
    """Raises `PruneError` for arguments that make no sense."""
    if namespace is not None and all_namespaces:
        raise PruneError("give --namespace or --all, not both")
    if ttl_s is not None and not ttl_s >= 0:
        raise PruneError(f"ttl must be >= 0 seconds, got {ttl_s}")
    if max_bytes is not None and max_bytes < 0:
        raise PruneError(f"max bytes must be >= 0, got {max_bytes}")


@gc_paused
def plan_prune(scan: CacheScan, ttl_s: float | None = None, max_bytes: int | None = None, all_namespaces: bool = False) -> PrunePlan:
    """Decide what to prune from a scan (changes nothing).

    Args:
        scan: a `scan_cache` result (its `now` is the planning time).
        ttl_s: remove segments not used for this many seconds (None: no TTL rule).
        max_bytes: byte budget per namespace, or for the whole cache with `all_namespaces`.
        all_namespaces: one LRU order over every namespace against `max_bytes`.

    Raises:
        PruneError: negative limits.
    """
    check_limits(ttl_s, max_bytes)
    plan = PrunePlan(str(scan.cache_dir), ttl_s, max_bytes, "all" if all_namespaces else "namespace", scan.now)
    planners: dict[str, SegmentPlanner] = {}
    for ns in scan.namespaces:
        p = NamespacePlan(ns.name, ns.meta.get("model_name"), ns.status.value, ns.message)
        plan.namespaces.append(p)
        if ns.usable or (ns.status == NamespaceStatus.UNREADABLE and ns.cause == "disk_full"):
            p.by_file_age = not ns.usable
            planners[ns.name] = p.planner = planner_of(ns)
            p.blocks, p.segments, p.bytes = ns.row_count, len(p.planner.names), p.planner.kept_bytes
            p.clamp, p.access_clamped = list(ns.future_rows), len(ns.future_rows)
        elif ns.status == NamespaceStatus.OUTDATED:
            _plan_outdated(scan, ns, p, ttl_s)
    if ttl_s is not None:
        for planner in planners.values():
            planner.apply_ttl(scan.now - ttl_s)
    if max_bytes is not None:
        groups = [planners] if all_namespaces else [{k: v} for k, v in planners.items()]
        for group in groups:
            fit_budget(group, max_bytes)
    for p in plan.namespaces:
        if p.namespace in planners:
            p.count_removed(planners[p.namespace])
    return plan


def _plan_outdated(scan: CacheScan, ns: NamespaceScan, p: NamespacePlan, ttl_s: float | None) -> None:
    try:
        tree = plan_tree(scan.cache_dir, ns.name)
        p.bytes, p.left = tree.bytes, tree.left
    except (OSError, ValueError):
        p.bytes = 0
    p.blocks_after, p.bytes_after = p.blocks, p.bytes
    version = ns.format_version or ""
    if not (version.isdigit() and int(version) < FORMAT_VERSION):
        return  # a newer kvtool's namespace: not ours to judge
    if ttl_s is not None and (ns.last_used or 0.0) < scan.now - ttl_s:
        p.remove_namespace = True
        p.prune_bytes, p.bytes_after = p.bytes, 0
        p.message = f"format_version {version}: unused for the TTL, removed whole"
        if p.left:  # the directory stays, holding them (remove_tree removes only kvtool's files)
            shown = ", ".join(p.left[:10]) + (f", ... ({len(p.left)} in all)" if len(p.left) > 10 else "")
            p.message = f"format_version {version}: unused for the TTL, its kvtool files removed; not kvtool's, left: {shown}"


# ----------------------------------------------------------------------------- execute
def execute_prune(plan: PrunePlan) -> PrunePlan:
    """Carry out a plan (hold `cache_lock` around scanning, planning and executing).

    Never raises for I/O trouble: failures are counted (`unlink_failed`, `index_failed`) and
    described in the namespace's `message`.

    Returns:
        The same plan, with the outcome counts filled in and `executed` set.
    """
    root = Path(plan.cache_dir)
    for p in plan.namespaces:
        try:
            if p.remove_namespace:
                tree = remove_tree(root, p.namespace)
                p.bytes_freed, p.files_deleted, p.left = tree.bytes, tree.files, tree.left
            elif p.prune_blocks or p.prune_segments:
                with ConfinedDir(root, p.namespace) as cdir:
                    _execute_namespace(root / p.namespace, cdir, p)
            if p.clamp and not p.remove_namespace:
                _clamp(root / p.namespace, p, plan.now)
        except (OSError, ValueError) as exc:
            p.unlink_failed += 1
            p.message = f"{p.message}; not removed: {exc}".lstrip("; ")
    plan.executed = True
    return plan


def _execute_namespace(ns_dir: Path, cdir: ConfinedDir, p: NamespacePlan) -> None:
    if p.by_file_age:  # no index to update first: files, then (best effort) their rows
        _unlink_segments(cdir, p, p.segment_names)
        if _delete_rows(ns_dir, p, segments=p.segment_names) is None:
            p.message = f"{p.message}; rows not deleted yet (readers drop them): run `kvtool validate`"
        return
    emptied = _delete_rows(ns_dir, p, hashes=p.hashes)
    if emptied is None and disk_full(ns_dir):  # free the space first, then try the rows again
        _unlink_segments(cdir, p, p.segment_names)
        emptied = _delete_rows(ns_dir, p, hashes=p.hashes)
        p.message = (p.message + "; disk full: segment files removed before their rows").lstrip("; ")
    if emptied is None:
        p.index_failed = True
        return
    # the rows' commit journaled `emptied` (the removal's commit point): a kill from here on leaves
    # files that `validate` finishes removing, never re-adopts; each is forgotten once unlinked
    _forget_removals(ns_dir, p, _unlink_segments(cdir, p, emptied))


def _clamp(ns_dir: Path, p: NamespacePlan, now: float) -> None:
    """Lower future access times to `now` (a touch clamps a time beyond the skew allowance)."""
    try:
        with BlockIndex(ns_dir / INDEX_FILENAME, create=False) as index:
            index.touch_many(sorted(set(index.present(p.clamp)) - set(p.hashes)), now)
            index.flush()
    except sqlite3.Error as exc:
        p.message = f"{p.message}; access times not clamped: {exc}".lstrip("; ")


def _delete_rows(ns_dir: Path, p: NamespacePlan, *, hashes=None, segments=None) -> list[str] | None:
    """Delete rows (by hash, or whole segments); returns the segments left without rows, or None
    if the index cannot be written."""
    try:
        with BlockIndex(ns_dir / INDEX_FILENAME, create=False) as index:
            if segments is not None:
                p.rows_deleted += index.delete_segments(segments)
                return list(segments)
            n, emptied = index.delete(hashes, journal=True)
            p.rows_deleted += n
            return emptied
    except sqlite3.Error as exc:
        p.message = f"{p.message}; index error: {exc}".lstrip("; ")
        return None


def _unlink_segments(cdir: ConfinedDir, p: NamespacePlan, names) -> list[str]:
    """Unlink segment files `names` (confined); returns those now gone (unlinked, or absent)."""
    gone = []
    for name in names:
        try:
            size = cdir.unlink_segment(name)
        except (OSError, ValueError) as exc:
            p.unlink_failed += 1
            p.message = f"{p.message}; {name} not removed: {exc}".lstrip("; ")
            continue
        gone.append(name)
        if size:
            p.files_deleted += 1
            p.bytes_freed += size
    return gone


def _forget_removals(ns_dir: Path, p: NamespacePlan, names: list[str]) -> None:
    """Drop the removal journal's entries of `names` (their files are gone). A failure is only
    noted: `validate` forgets entries whose file is gone."""
    if not names:
        return
    try:
        with BlockIndex(ns_dir / INDEX_FILENAME, create=False) as index:
            index.forget_removals(names)
    except sqlite3.Error as exc:
        p.message = f"{p.message}; removal journal not cleared ({exc}): `kvtool validate` clears it".lstrip("; ")


def prune(
    cache_dir: Path,
    ttl_s: float | None = None,
    max_bytes: int | None = None,
    namespace: str | None = None,
    all_namespaces: bool = False,
    dry_run: bool = False,
    now: float | None = None,
) -> PrunePlan:
    """Lock, scan, plan and execute (with `dry_run`: scan and plan only, no lock): a whole prune.

    Raises:
        PruneLocked: another prune is running on `cache_dir`.
        PruneError: bad arguments, or the lock cannot be used.
        ScanError: missing cache dir, unknown or ambiguous namespace.
    """
    check_limits(ttl_s, max_bytes, namespace, all_namespaces)
    if not Path(cache_dir).is_dir():
        raise PruneError(f"cache directory {cache_dir} does not exist or is not a directory")
    if dry_run:  # only reads: no lock, nothing written
        plan = plan_prune(scan_cache(cache_dir, namespace, now=now, full=False), ttl_s, max_bytes, all_namespaces)
        plan.dry_run = True
        return plan
    with cache_lock(cache_dir):
        now = time.time() if now is None else now
        return execute_prune(plan_prune(scan_cache(cache_dir, namespace, now=now, full=False), ttl_s, max_bytes, all_namespaces))


__all__ = [
    "prune", "plan_prune", "execute_prune", "check_limits", "cache_lock", "PrunePlan", "NamespacePlan",
    "SegmentPlanner", "Segment", "fit_budget", "planner_of", "PruneError", "PruneLocked", "LOCK_FILENAME",
]  # fmt: skip
