"""`kvtool validate`: plan repairs from a scan (`plan_repairs`), then carry them out (`execute`).

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
  (`orphans_removed`);
- a `segments` row that is missing or wrong is rewritten from the file; one without file goes;
- rows no prefix lookup can reach (parent chain not ending at the namespace root, or a cycle)
  -> removed (`broken_chain_removed`);
- `unreadable` namespaces (corrupt index) are rebuilt from their segment files with
  `rebuild_index` (`kvtool validate --rebuild-index`); `uninitialized`, `outdated` and
  `foreign` namespaces and symlinks are left untouched and reported.

Safe while other processes serve from the same cache: every index change is a transaction, a
segment file is unlinked only once no row names it (re-checked just before), orphans are
re-checked before adoption, broken chains are re-checked on a fresh read, and temp files of
live writers are kept. Every path comes from `kvtool.store.names` and is resolved without
following symlinks (`kvtool.ops.confined`). A repairing run holds the cache's maintenance lock
(`kvtool.ops.lock`) from the scan to the last change, so it never plans from rows or files that
a `prune` or `rm` is removing at the same moment; a dry run only reads and takes no lock.

This module never imports MLX.
"""

from __future__ import annotations

import os
import sqlite3
import stat
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvtool.hashing import root_parent
from kvtool.ops.chains import build_chain_tree
from kvtool.ops.confined import ConfinedDir
from kvtool.ops.lock import cache_lock
from kvtool.ops.rebuild import RebuildPlan, execute_rebuild, plan_rebuild
from kvtool.ops.records import Record, SegmentReader, created_of, row_disagrees
from kvtool.ops.scan import CacheScan, NamespaceScan, NamespaceStatus, ScanError, scan_cache
from kvtool.store.fsops import FileOps, resolve_cache_root, short_path
from kvtool.store.index import BlockIndex, IndexRow, SegmentRow
from kvtool.store.names import INDEX_FILENAME, segment_relpath

MAX_DETAILS = 50  # per namespace, in the report
ProgressFn = Callable[[str, int, int], None]  # progress(namespace, segments_done, segments_total)
ValidateError = ScanError  # what `validate` raises when it cannot run (missing dir, bad namespace)

REPAIRS = (
    "temp_removed", "bad_rows_dropped", "access_clamped", "rows_repaired", "missing_rows_dropped", "corrupt_removed",
    "segment_rows_fixed", "orphans_adopted", "orphans_removed", "broken_chain_removed", "irregular_removed",
)  # fmt: skip
UNCHECKED_PROBLEMS = (NamespaceStatus.UNREADABLE, NamespaceStatus.FOREIGN)


@dataclass
class _Actions:
    """What `execute` does to one namespace (not part of the report)."""

    temps: list[str] = field(default_factory=list)
    irregular: list[str] = field(default_factory=list)
    bad_rowids: list[int] = field(default_factory=list)
    bad_segment_rowids: list[int] = field(default_factory=list)
    clamp: list[str] = field(default_factory=list)
    # segment -> (its segments row, rows rewritten from its records, rows adopted from its records)
    writes: dict[str, tuple[SegmentRow, list[IndexRow], list[IndexRow]]] = field(default_factory=dict)
    drop: list[str] = field(default_factory=list)
    broken: list[str] = field(default_factory=list)
    remove_segments: list[str] = field(default_factory=list)
    rebuild: RebuildPlan | None = None

    def write(self, seg_row: SegmentRow, rewrite: Sequence[IndexRow] = (), adopt: Sequence[IndexRow] = ()) -> None:
        _, rw, ad = self.writes.get(seg_row.name, (seg_row, [], []))
        self.writes[seg_row.name] = (seg_row, rw + list(rewrite), ad + list(adopt))

    def any(self) -> bool:
        return bool(self.temps or self.irregular or self.bad_rowids or self.bad_segment_rowids or self.clamp or self.writes or self.drop
                    or self.broken or self.remove_segments or self.rebuild)  # fmt: skip


@dataclass
class NamespaceRepair:
    """Plan and outcome for one namespace. Under a dry run the counts say what *would* be done.

    Attributes:
        namespace: layout key.
        status: the scan's `NamespaceStatus` value (ok | empty | uninitialized | unreadable |
            outdated | foreign).
        outcome: clean | repaired | problems (dry run) | skipped (not checked) | failed.
        format_version: the index's format version (None if unreadable).
        message: why the namespace was not checked, or what failed.
        rows: well-formed index rows at the start; files: segment files at the start.
        temp_removed ... broken_chain_removed: repairs by kind (see the module docstring); counts
            of blocks (rows), except temp files, segment rows and orphan segment files.
        duplicates_removed: orphan segments whose records are all stored elsewhere (not a problem).
        blocks_recovered: rows recreated by an index rebuild.
        index_rebuilt: the index was (or, dry run, would be) rebuilt from the segment files.
        unlink_failed: files that could not be removed.
        bytes_freed: bytes of files removed.
        ignored_entries: entries that are not kvtool's (left alone).
        symlinks: symlinks inside the namespace (never followed, never removed: a problem).
        irregular: entries under a segment or temp file name that are not regular files (FIFO,
            socket, device: removed, `irregular_removed`; a directory: left, a problem). Their
            rows are `corrupt_removed`.
        details: up to `MAX_DETAILS` lines 'kind hash-or-name: reason'.
    """

    namespace: str
    status: str = NamespaceStatus.OK.value
    outcome: str = "clean"
    format_version: str | None = None
    message: str = ""
    rows: int = 0
    files: int = 0
    temp_removed: int = 0
    bad_rows_dropped: int = 0
    access_clamped: int = 0
    rows_repaired: int = 0
    missing_rows_dropped: int = 0
    corrupt_removed: int = 0
    segment_rows_fixed: int = 0
    orphans_adopted: int = 0
    orphans_removed: int = 0
    broken_chain_removed: int = 0
    irregular_removed: int = 0
    duplicates_removed: int = 0
    blocks_recovered: int = 0
    index_rebuilt: bool = False
    unlink_failed: int = 0
    bytes_freed: int = 0
    ignored_entries: int = 0
    symlinks: list[str] = field(default_factory=list)
    irregular: list[str] = field(default_factory=list)
    details: list[str] = field(default_factory=list)
    actions: _Actions = field(default_factory=_Actions, repr=False)

    @property
    def problems(self) -> int:
        """Problems found: repairs, symlinks, irregular entries left, failures, and an unreadable
        or foreign namespace."""
        unchecked = self.status in UNCHECKED_PROBLEMS
        left = len(self.irregular) - self.irregular_removed
        return (sum(getattr(self, k) for k in REPAIRS) + len(self.symlinks) + left + self.unlink_failed
                + int(unchecked) + int(self.outcome == "failed" and not unchecked))  # fmt: skip

    def note(self, kind: str, what: str, reason: str) -> None:
        if len(self.details) < MAX_DETAILS:
            self.details.append(f"{kind} {what}: {reason}")


@dataclass
class RepairPlan:
    """Repairs of one `validate` run: planned (`plan_repairs`), then executed (`execute`).

    Attributes:
        cache_dir: the cache root.
        deep: every record was read and its checksum verified.
        dry_run: not executed on purpose.
        executed: `execute` ran.
        rebuild_index: unreadable indexes are rebuilt from their segment files.
        symlinks: symlinks directly under the cache root (never followed; a problem each).
        namespaces: one entry per namespace.
    """

    cache_dir: str
    deep: bool
    dry_run: bool = True
    executed: bool = False
    rebuild_index: bool = False
    symlinks: list[str] = field(default_factory=list)
    namespaces: list[NamespaceRepair] = field(default_factory=list)

    @property
    def problems(self) -> int:
        return sum(ns.problems for ns in self.namespaces) + len(self.symlinks)

    def to_dict(self) -> dict:
        """JSON-ready document (the `--json` output)."""
        doc = asdict(self)
        for ns, d in zip(self.namespaces, doc["namespaces"]):
            d.pop("actions")
            d["problems"] = ns.problems
        doc["problems"] = self.problems
        doc["clean"] = self.problems == 0
        return doc


ValidateReport = RepairPlan  # the name callers used before the plan/execute split


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
    holds the maintenance lock (`kvtool.ops.lock.cache_lock`) from the scan to the last change.

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
        plan = plan_repairs(scan_cache(root, namespace, now=now, fs=fs), deep=deep, rebuild_index=rebuild_index,
                            progress=progress)  # fmt: skip
        return plan if dry_run else execute(plan)


def plan_repairs(
    scan: CacheScan, *, deep: bool = False, rebuild_index: bool = False, progress: ProgressFn | None = None
) -> RepairPlan:
    """Decide every repair (reads segment headers, and records where needed; changes nothing).

    Args:
        scan: a `scan_cache` result.
        deep: read every record whole and verify its checksum (reads everything).
        rebuild_index: plan the rebuild of unreadable indexes from their segment files.
        progress: called as `progress(namespace, segments_done, segments_total)`.
    """
    plan = RepairPlan(str(scan.cache_dir), deep, rebuild_index=rebuild_index, symlinks=list(scan.symlinks))
    for ns in scan.namespaces:
        rep = NamespaceRepair(ns.name, ns.status.value, format_version=ns.format_version, rows=len(ns.rows),
                              files=len(ns.files), ignored_entries=len(ns.other), symlinks=list(ns.symlinks),
                              irregular=list(ns.irregular))  # fmt: skip
        plan.namespaces.append(rep)
        for link in ns.symlinks:
            rep.note("symlink", link, "never followed")
        if ns.usable:
            _plan_namespace(scan, ns, rep, deep, progress)
        elif rebuild_index and _rebuildable(ns):
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


def _rebuildable(ns: NamespaceScan) -> bool:
    if ns.status == NamespaceStatus.UNREADABLE:
        return ns.cause == "index"
    return ns.status == NamespaceStatus.UNINITIALIZED and bool(ns.files) and not ns.rows


def _plan_namespace(scan: CacheScan, ns: NamespaceScan, rep: NamespaceRepair, deep: bool, progress) -> None:
    exp = ns.expected
    assert exp is not None  # a usable namespace has its geometry
    try:
        with ConfinedDir(scan.cache_dir, ns.name) as cdir, SegmentReader(cdir, ns.name, exp.kv, exp.block_size) as reader:
            _Planner(scan.now, ns, rep, reader, deep).run(progress)
    except OSError as exc:
        rep.outcome, rep.message = "failed", f"cannot open the namespace directory: {exc}"


class _Planner:
    """Plans the repairs of one usable namespace."""

    def __init__(self, now: float, ns: NamespaceScan, rep: NamespaceRepair, reader: SegmentReader, deep: bool):
        self.now, self.ns, self.rep, self.reader, self.deep = now, ns, rep, reader, deep
        self.act = rep.actions

    def run(self, progress: ProgressFn | None) -> None:
        ns, rep, act = self.ns, self.rep, self.act
        for rel in ns.irregular:
            if _is_dir(ns.path / rel):
                rep.note("irregular", rel, "a directory under a kvtool file name: left alone")
                continue
            act.irregular.append(rel)
            rep.irregular_removed += 1
            rep.note("irregular", rel, "not a regular file (FIFO, socket or device): never opened; removed")
        for t in ns.temps:
            if t.leftover:
                act.temps.append(t.relpath)
                rep.temp_removed += 1
                rep.bytes_freed += t.size
                rep.note("temp", t.relpath, "leftover of a writer that is gone")
        act.bad_rowids, act.bad_segment_rowids = list(ns.bad_rows), list(ns.bad_segment_rows)
        rep.bad_rows_dropped = len(ns.bad_rows)
        rep.segment_rows_fixed += len(ns.bad_segment_rows)
        for rowid in ns.bad_rows:
            rep.note("bad_row", f"rowid {rowid}", "NULL, wrongly typed or malformed value")
        act.clamp = list(ns.future_rows)
        rep.access_clamped = len(act.clamp)
        for i, name in enumerate(sorted(ns.files), 1):
            self.reader.header(name)
            if progress is not None:
                progress(ns.name, i, len(ns.files))
        final = self._resolve_rows()
        adopted, bad = self._adopt(final)
        self._finish(final, adopted, bad)

    # ------------------------------------------------------------------ rows
    def _resolve_rows(self) -> dict[str, IndexRow]:
        """Rows that stay (some rewritten from their record); the others are dropped."""
        final: dict[str, IndexRow] = {}
        for row in self.ns.rows:
            why = self._check_row(row)
            if why is None:
                final[row.hash] = row
                continue
            rec = self._relocate(row)
            if rec is not None:
                new = rec.row(row.created, min(row.last_access, self.now))
                final[row.hash] = new
                self.act.write(self.reader.verified_segment_row(rec.segment), rewrite=[new])
                self.rep.rows_repaired += 1
                self.rep.note("repaired", row.hash, f"{why}; rewritten from its record in {rec.segment} slot {rec.slot.index}")
                continue
            self.act.drop.append(row.hash)
            if row.segment in self.ns.missing or self.reader.errors.get(row.segment) == "missing":
                self.rep.missing_rows_dropped += 1
                self.rep.note("missing", row.hash, why)
            else:
                self.rep.corrupt_removed += 1
                self.rep.note("corrupt", row.hash, why)
        return final

    def _check_row(self, row: IndexRow) -> str | None:
        if row.segment not in self.ns.files:
            if segment_relpath(row.segment) in self.ns.irregular:
                return f"segment {row.segment} is not a regular file (never opened)"
            link = row.segment[:2] in self.ns.symlinks
            return f"segment {row.segment} " + ("is behind a symlinked directory (never followed)" if link else "has no file")
        header = self.reader.header(row.segment)
        if header is None:
            return f"segment {row.segment} unusable: {self.reader.errors.get(row.segment)}"
        if row.slot >= len(header.slots):
            return f"segment {row.segment} has no slot {row.slot}"
        differs = row_disagrees(row, header.slots[row.slot])
        if differs:
            return differs
        digest: str | None
        if self.deep:
            rec = self.reader.record(row.segment, row.slot)
            if rec is None:
                return f"record unusable: {self.reader.record_error(row.segment, row.slot)}"
            digest = rec.tokens_digest
        else:
            digest = self.reader.tokens_digest(row.segment, row.slot)
        if digest != row.tokens_digest:
            return "tokens_digest differs from its record"
        return None

    def _known(self) -> set[str]:
        """Segment files of the snapshot: named by a row, or orphans (not files written since)."""
        return ({r.segment for r in self.ns.rows} | set(self.ns.orphans)) & set(self.ns.files)

    def _where(self) -> dict[str, list[tuple[str, int]]]:
        if not hasattr(self, "_where_cache"):
            where: dict[str, list[tuple[str, int]]] = {}
            for name in sorted(self.ns.files):
                header = self.reader.header(name)
                for s in header.slots if header is not None else ():
                    where.setdefault(s.block_hash, []).append((name, s.index))
            self._where_cache = where
        return self._where_cache

    def _relocate(self, row: IndexRow) -> Record | None:
        """A verified record of `row.hash` (its own segment first), or None."""
        spots = sorted(self._where().get(row.hash, ()), key=lambda s: (s[0] != row.segment, s))
        for name, idx in spots:
            rec = self.reader.record(name, idx)
            if rec is not None and rec.slot.block_hash == row.hash:
                return rec
        return None

    # ------------------------------------------------------------------ orphans and chains
    def _adopt(self, final: dict[str, IndexRow]) -> tuple[dict[str, IndexRow], dict[str, int]]:
        """Records without a row (every slot of an orphan segment, the unreferenced slots of the
        others) that a prefix lookup could reach and that verify: they get their rows back.

        Returns:
            `(hash -> adopted row, segment -> records that failed verification)`. Only rooted
            candidates are read, so blocks a prune removed (their chain ends at a removed file)
            are never read nor resurrected.
        """
        spare: dict[str, tuple[str, int, str]] = {}  # hash -> (segment, slot, parent)
        for name in sorted(self._known()):
            header = self.reader.header(name)
            for s in header.slots if header is not None else ():
                if s.block_hash not in final:
                    spare.setdefault(s.block_hash, (name, s.index, s.parent_hash))
        root = root_parent(self.ns.name)
        adopted: dict[str, IndexRow] = {}
        bad: dict[str, int] = {}
        while True:
            entries = [(r.hash, r.parent, 0.0) for r in final.values()]
            entries += [(h, parent, 0.0) for h, (_, _, parent) in spare.items()]
            tree = build_chain_tree(entries, root)
            failed = False
            for h in sorted(h for h in spare if tree.nodes[h].rooted and h not in adopted):
                name, idx, _ = spare[h]
                rec = self.reader.record(name, idx)
                if rec is None:
                    del spare[h]
                    bad[name] = bad.get(name, 0) + 1
                    failed = True
                    continue
                t = min(created_of(self.reader.verified_header(name)), self.now)
                adopted[h] = rec.row(t, t)
            if not failed:  # a failure can unroot other candidates: look again
                return {h: r for h, r in adopted.items() if tree.nodes[h].rooted}, bad

    def _finish(self, final: dict[str, IndexRow], adopted: dict[str, IndexRow], bad: dict[str, int]) -> None:
        ns, rep, act, reader = self.ns, self.rep, self.act, self.reader
        every = {**final, **adopted}
        tree = build_chain_tree(((r.hash, r.parent, r.last_access) for r in every.values()), root_parent(ns.name), self.now)
        unrooted = set(tree.unrooted())
        for h in sorted(unrooted & set(final)):
            act.broken.append(h)
            rep.broken_chain_removed += 1
            rep.note("broken_chain", h, f"parent {final[h].parent} is not stored (or the chain loops)")
        by_segment: dict[str, list[IndexRow]] = {}
        for r in adopted.values():
            by_segment.setdefault(r.segment, []).append(r)
        referenced = {r.segment for r in final.values()}
        for name, rows in sorted(by_segment.items()):
            act.write(reader.verified_segment_row(name), adopt=sorted(rows, key=lambda r: r.slot))
            rep.orphans_adopted += len(rows)
            what = "an orphan segment" if name not in referenced else "a segment whose rows lost them"
            rep.note("adopted", name, f"{len(rows)} verified record(s) of {what}")
        for name in sorted(self._known() - referenced - set(by_segment)):  # orphans nothing came back from
            header = reader.header(name)
            act.remove_segments.append(name)
            if header is not None and all(s.block_hash in final for s in header.slots):
                rep.duplicates_removed += 1
                rep.note("orphan", name, "every record is stored in another segment")
                continue
            rep.orphans_removed += 1
            why = (f"unusable: {reader.errors.get(name)}" if header is None else
                   f"{bad[name]} corrupt record(s)" if bad.get(name) else "no block a lookup can reach")  # fmt: skip
            rep.note("orphan", name, why)
        self._segment_rows(final, unrooted)
        after = {r.segment for h, r in final.items() if h not in unrooted}
        after |= {name for name, (_, rw, ad) in act.writes.items() if rw or ad}
        rep.bytes_freed += sum(ns.files[n].size for n in self._known() if n not in after)

    def _segment_rows(self, final: dict[str, IndexRow], unrooted: set[str]) -> None:
        """`segments` rows: rewrite wrong or missing ones of kept segments; drop ones without file."""
        seg_rows = {s.name: s for s in self.ns.segment_rows}
        kept = {r.segment for h, r in final.items() if h not in unrooted}
        for name in sorted(kept):
            want = self.reader.segment_row(name)
            have = seg_rows.get(name)
            if want is None or name in self.act.writes:
                continue
            if have is None or (have.nbytes, have.n_blocks) != (want.nbytes, want.n_blocks):
                self.act.write(want)
                self.rep.segment_rows_fixed += 1
                self.rep.note("segment_row", name, "missing" if have is None else "size or block count differs from the file")
        named = {r.segment for r in self.ns.rows}
        for name in sorted(set(seg_rows) - set(self.ns.files)):
            if name not in self.act.remove_segments:
                self.act.remove_segments.append(name)
                if name not in named:  # else part of dropping the rows of a missing segment
                    self.rep.segment_rows_fixed += 1
                    self.rep.note("segment_row", name, "no file")


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
        _unlink(rep, lambda: cdir.unlink_temp(rel), rel)  # noqa: B023  (called at once, inside the loop)
    index = BlockIndex(ns_dir / INDEX_FILENAME, create=False)
    try:
        if act.bad_rowids or act.bad_segment_rowids:
            index.delete_rowids(act.bad_rowids, act.bad_segment_rowids)
        if act.clamp:
            now = time.time()
            for h in act.clamp:
                index.touch(h, now)  # a touch lowers an access time beyond the skew allowance to `now`
            index.flush()
        for seg_row, rewrite, adopt in act.writes.values():
            if adopt:  # a live writer may have stored them meanwhile: never replace its rows
                present = index.present([r.hash for r in adopt])
                adopt = [r for r in adopt if r.hash not in present]
                if not adopt and not rewrite:
                    continue
            index.insert_segment(seg_row, rewrite + adopt)
        emptied = index.delete(act.drop)[1] if act.drop else []
        for rel in act.irregular:  # their rows are gone (dropped above, or rewritten to a copy)
            _unlink(rep, lambda: cdir.unlink_irregular(rel), rel)  # noqa: B023  (called at once, inside the loop)
        if act.broken:  # re-check on a fresh read: a live writer may have stored a missing parent
            fresh = index.scan()
            tree = build_chain_tree(((r.hash, r.parent, r.last_access) for r in fresh.rows), root_parent(rep.namespace))
            act.broken = [h for h in act.broken if h in tree.nodes and not tree.nodes[h].rooted]
            emptied += index.delete(act.broken)[1] if act.broken else []
        for name in emptied:
            _unlink(rep, lambda: cdir.unlink_segment(name), name)  # noqa: B023  (called at once, inside the loop)
        for name in act.remove_segments:
            if index.segment_rows(name):  # rows appeared meanwhile (a live writer): keep it
                continue
            index.delete_segments([name])
            _unlink(rep, lambda: cdir.unlink_segment(name), name)  # noqa: B023  (called at once, inside the loop)
    finally:
        index.close()


def _is_dir(path: Path) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def _unlink(rep: NamespaceRepair, fn: Callable[[], int], what: str) -> int:
    try:
        return fn()
    except (OSError, ValueError) as exc:
        rep.unlink_failed += 1
        rep.note("unlink_failed", what, str(exc))
        return 0


__all__ = [
    "validate", "plan_repairs", "execute", "RepairPlan", "NamespaceRepair", "ValidateReport", "ValidateError",
    "MAX_DETAILS", "REPAIRS",
]  # fmt: skip
