"""What `kvtool validate` plans and reports: per namespace the repairs (`NamespaceRepair`, with
the `Actions` that `execute` carries out), the whole run (`RepairPlan`), and the rebuild of an
unreadable index (`RebuildPlan`): shared by `kvtool.ops.validate` and `kvtool.ops.rebuild`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields

from kvtool.disk.rowtable import IndexRow, SegmentRow
from kvtool.ops.scan import NamespaceStatus

MAX_DETAILS = 50  # per namespace, in the report
REPAIRS = (
    "temp_removed", "bad_rows_dropped", "access_clamped", "rows_repaired", "missing_rows_dropped", "corrupt_removed",
    "segment_rows_fixed", "orphans_adopted", "orphans_removed", "broken_chain_removed", "irregular_removed",
    "removals_finished",
)  # fmt: skip
UNCHECKED_PROBLEMS = (NamespaceStatus.UNREADABLE, NamespaceStatus.FOREIGN)


@dataclass
class RebuildPlan:
    """How to rebuild one namespace's index (`kvtool.ops.rebuild`).

    Attributes:
        meta: meta to write (complete if salvaged, else only what the files say).
        complete_meta: `meta` holds a `format_version` and hashes to the namespace's name.
        segments: per segment to index, its `segments` row and block rows.
        remove: segment files with nothing recoverable (unusable, or only unreachable blocks).
    """

    meta: dict[str, str]
    complete_meta: bool
    segments: list[tuple[SegmentRow, list[IndexRow]]] = field(default_factory=list)
    remove: list[str] = field(default_factory=list)


@dataclass
class Actions:
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
    finish_removals: list[str] = field(default_factory=list)  # journaled segment files: unlinked, then forgotten
    forget_removals: list[str] = field(default_factory=list)  # journal entries to drop (no file, or rows again)
    rebuild: RebuildPlan | None = None

    def write(self, seg_row: SegmentRow, rewrite: Sequence[IndexRow] = (), adopt: Sequence[IndexRow] = ()) -> None:
        """Rows to write into segment `seg_row.name`, with its (verified) `segments` row."""
        _, rw, ad = self.writes.setdefault(seg_row.name, (seg_row, [], []))
        rw += rewrite
        ad += adopt

    def any(self) -> bool:
        """Something to do: any field set (a list or the writes not empty, a rebuild planned)."""
        return any(getattr(self, f.name) for f in fields(self))


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
        removals_finished: segment files of an interrupted removal (`prune`, `rm --prompt` killed
            between its rows' commit and its unlinks: named in the index's removal journal)
            removed, never re-adopted.
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
    removals_finished: int = 0
    duplicates_removed: int = 0
    blocks_recovered: int = 0
    index_rebuilt: bool = False
    unlink_failed: int = 0
    bytes_freed: int = 0
    ignored_entries: int = 0
    symlinks: list[str] = field(default_factory=list)
    irregular: list[str] = field(default_factory=list)
    details: list[str] = field(default_factory=list)
    actions: Actions = field(default_factory=Actions, repr=False)

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
        doc = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "namespaces"}
        doc["namespaces"] = [{**{f.name: getattr(ns, f.name) for f in fields(ns) if f.name != "actions"},
                              "problems": ns.problems} for ns in self.namespaces]  # fmt: skip
        doc["problems"] = self.problems
        doc["clean"] = self.problems == 0
        return doc


def unlink_counted(rep: NamespaceRepair, fn: Callable[[], object], what: str) -> None:
    """`fn()` (an unlink); a failure is counted in `rep.unlink_failed` and noted, never raised."""
    try:
        fn()
    except (OSError, ValueError) as exc:
        rep.unlink_failed += 1
        rep.note("unlink_failed", what, str(exc))


__all__ = [
    "Actions", "NamespaceRepair", "RepairPlan", "RebuildPlan", "unlink_counted", "MAX_DETAILS",
    "REPAIRS", "UNCHECKED_PROBLEMS",
]  # fmt: skip
