"""`kvtool validate`: check every namespace of an SSD cache and repair what is wrong.

Rules (issue 3 §6), per namespace:
- leftover temp files (their writer is gone, or stale) -> removed;
- index rows whose file is missing -> dropped;
- files with a row that are corrupt (unreadable header, size or shape mismatch, another
  namespace's block; with `deep` also checksum and token-digest mismatch) -> row, then file, removed;
- orphan files (no row): a complete file of this namespace whose checksum verifies is
  re-adopted into the index, anything else is removed;
- rows whose parent chain is broken (parent neither the namespace's root parent nor an existing
  row) -> removed, transitively;
- a namespace with an unknown format version or an unreadable index -> untouched, reported.

Safe while another process serves from the same cache: every index change is a transaction,
a file is unlinked only after its row is gone, temp files of live writers are kept, and only
rows seen in the snapshot are ever deleted.
"""

from __future__ import annotations

import sqlite3
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

from kvtool.blocks import root_parent
from kvtool.store import blockfile
from kvtool.store.blockfile import BlockFileError, Expected
from kvtool.store.fsops import (
    FileOps, NamespaceSelectError, block_relpath, scan_namespace, select_namespaces, temp_is_leftover,
)
from kvtool.store.index import INDEX_FILENAME, BlockIndex, IndexRow

HEAD_READ_BYTES = 64 * 1024  # one read covers the header of any realistic block file
MAX_DETAILS = 50  # per namespace, in the report

# progress(namespace, files_done, files_total)
ProgressFn = Callable[[str, int, int], None]


class ValidateError(Exception):
    """Validate could not run (missing cache dir, unknown or ambiguous namespace)."""


@dataclass
class NamespaceReport:
    """Outcome for one namespace. Under `dry_run` the counts say what *would* be done.

    Attributes:
        namespace: layout key.
        status: 'clean' | 'repaired' | 'problems' (dry run) | 'uninitialized' (creation interrupted or in
            progress; nothing stored, left alone, not a problem) | 'unknown_format' | 'unreadable'.
        format_version: the index's format version (None if unreadable).
        rows: index rows at the start.
        files: block files on disk at the start.
        temp_removed, missing_rows_dropped, corrupt_removed, orphans_adopted, orphans_removed,
        broken_chain_removed: repairs, by kind (blocks/files).
        bytes_freed: bytes of block files removed.
        ignored_entries: entries in the namespace dir that are not kvtool's (left alone).
        message: why the namespace was not checked, if it was not.
        details: up to `MAX_DETAILS` lines 'kind hash: reason'.
    """

    namespace: str
    status: str = "clean"
    format_version: str | None = None
    rows: int = 0
    files: int = 0
    temp_removed: int = 0
    missing_rows_dropped: int = 0
    corrupt_removed: int = 0
    orphans_adopted: int = 0
    orphans_removed: int = 0
    broken_chain_removed: int = 0
    bytes_freed: int = 0
    ignored_entries: int = 0
    message: str = ""
    details: list[str] = field(default_factory=list)

    @property
    def problems(self) -> int:
        """Number of problems found (an unchecked namespace counts as one)."""
        if self.status in ("unknown_format", "unreadable"):
            return 1
        return (
            self.temp_removed + self.missing_rows_dropped + self.corrupt_removed
            + self.orphans_adopted + self.orphans_removed + self.broken_chain_removed
        )  # fmt: skip

    def note(self, kind: str, h: str, reason: str) -> None:
        if len(self.details) < MAX_DETAILS:
            self.details.append(f"{kind} {h}: {reason}")


@dataclass
class ValidateReport:
    """Outcome of one `validate` run.

    Attributes:
        cache_dir: the cache root checked.
        deep: checksums were verified.
        dry_run: nothing was changed.
        namespaces: one report per namespace checked.
    """

    cache_dir: str
    deep: bool
    dry_run: bool
    namespaces: list[NamespaceReport] = field(default_factory=list)

    @property
    def problems(self) -> int:
        return sum(ns.problems for ns in self.namespaces)

    def to_dict(self) -> dict:
        """JSON-ready summary (the `--json` document)."""
        doc = asdict(self)
        for ns, d in zip(self.namespaces, doc["namespaces"]):
            d["problems"] = ns.problems
        doc["problems"] = self.problems
        doc["clean"] = self.problems == 0
        return doc


def validate(
    cache_dir: Path,
    namespace: str | None = None,
    deep: bool = False,
    dry_run: bool = False,
    progress: ProgressFn | None = None,
    fs: FileOps | None = None,
) -> ValidateReport:
    """Check (and unless `dry_run`, repair) the namespaces of an SSD cache.

    Args:
        cache_dir: the SSD tier root.
        namespace: a layout key or a unique prefix of one; None = every namespace.
        deep: read whole files and verify checksums and token digests (slow: reads everything).
        dry_run: report what would be done, change nothing.
        progress: called as `progress(namespace, files_done, files_total)` while checking.
        fs: file-system operations (fault injection in tests).

    Returns:
        A `ValidateReport`.

    Raises:
        ValidateError: the cache dir does not exist or is not a directory, or `namespace`
            matches no namespace or several.
    """
    fs = fs or FileOps()
    cache_dir = Path(cache_dir)
    try:
        dirs = select_namespaces(cache_dir, namespace, fs)
    except NamespaceSelectError as exc:
        raise ValidateError(str(exc)) from None
    report = ValidateReport(str(cache_dir), deep, dry_run)
    for ns_dir in dirs:
        report.namespaces.append(_NamespaceCheck(ns_dir, fs, deep, dry_run, progress).run())
    return report


class _NamespaceCheck:
    """One namespace: snapshot, classify, then (unless dry run) repair."""

    def __init__(self, ns_dir: Path, fs: FileOps, deep: bool, dry_run: bool, progress: ProgressFn | None):
        self.ns_dir, self.fs, self.deep, self.dry_run, self.progress = ns_dir, fs, deep, dry_run, progress
        self.rep = NamespaceReport(ns_dir.name)

    def run(self) -> NamespaceReport:
        try:
            index = BlockIndex(self.ns_dir / INDEX_FILENAME, create=False)
        except sqlite3.Error as exc:
            return self._skip("unreadable", f"cannot open index: {exc}")
        try:
            self._run(index)
        except sqlite3.Error as exc:
            self._skip("unreadable", f"index error: {exc}")
        finally:
            index.close()
        return self.rep

    def _skip(self, status: str, message: str) -> NamespaceReport:
        self.rep.status, self.rep.message = status, message
        return self.rep

    def _run(self, index: BlockIndex) -> None:
        rep, ns = self.rep, self.ns_dir.name
        if not index.initialized():
            # Killed while being created (index file, no schema/meta yet), or being created right
            # now by a live process: nothing was ever stored in it, so nothing to repair.
            if scan_namespace(self.ns_dir, self.fs).files:
                self._skip("unreadable", "index has no metadata but block files exist: left untouched")
            else:
                self._skip("uninitialized", "namespace index not initialised (creation interrupted or in progress)")
            return
        meta = index.get_meta()
        rep.format_version = meta.get("format_version")
        if rep.format_version != str(blockfile.FORMAT_VERSION) or meta.get("layout_key") != ns:
            self._skip("unknown_format", f"format_version {rep.format_version!r}, layout {meta.get('layout_key')!r}: left untouched")
            return
        try:
            expected = Expected.from_meta(ns, meta)
        except (KeyError, ValueError) as exc:
            self._skip("unreadable", f"index metadata incomplete: {exc!r}")
            return
        rows = {r.hash: r for r in index.rows()}  # rows before files: a row never precedes its file
        scan = scan_namespace(self.ns_dir, self.fs)
        rep.rows, rep.files, rep.ignored_entries = len(rows), len(scan.files), len(scan.other)

        temps = [t for t in scan.temps if temp_is_leftover(self.fs, t)]
        missing = [h for h in rows if h not in scan.files and not self.fs.exists(self._path(h))]
        to_check = [h for h in rows if h in scan.files]
        orphans = [h for h in scan.files if h not in rows]
        total, done = len(to_check) + len(orphans), 0
        corrupt: list[str] = []
        for h in to_check:
            reason = self._check_indexed(rows[h], expected)
            if reason == "missing":
                missing.append(h)
            elif reason:
                corrupt.append(h)
                rep.note("corrupt", h, reason)
            done += 1
            self._progress(done, total)
        adopt: list[IndexRow] = []
        bad_orphans: list[str] = []
        for h in orphans:
            row, reason = self._check_orphan(h, expected)
            if row is not None:
                adopt.append(row)
            elif reason != "missing":
                bad_orphans.append(h)
                rep.note("orphan", h, reason)
            done += 1
            self._progress(done, total)
        for h in missing:
            rep.note("missing", h, "index row without file")
        rep.temp_removed, rep.missing_rows_dropped = len(temps), len(missing)
        rep.corrupt_removed, rep.orphans_adopted, rep.orphans_removed = len(corrupt), len(adopt), len(bad_orphans)
        rep.bytes_freed = sum(self._size(self._path(h)) for h in corrupt + bad_orphans)

        if not self.dry_run:
            self._unlink_all(temps)
            index.delete(missing)
            self._remove_rows_then_files(index, corrupt)
            for row in adopt:
                index.insert(row, replace=False)
            self._remove_orphans(index, bad_orphans)
            live = {r.hash: r.parent for r in index.rows()}  # fresh: includes rows saved meanwhile
        else:
            gone = set(missing) | set(corrupt)
            live = {h: r.parent for h, r in rows.items() if h not in gone}
            live.update((r.hash, r.parent) for r in adopt)
        seen = set(rows) | {r.hash for r in adopt}  # rows saved meanwhile by a live writer are not ours
        broken = [h for h in _broken_chains(live, root_parent(ns)) if h in seen]
        for h in broken:
            rep.note("broken_chain", h, f"parent {live[h]} is not stored")
        rep.broken_chain_removed = len(broken)
        rep.bytes_freed += sum(self._size(self._path(h)) for h in broken)
        if not self.dry_run:
            self._remove_rows_then_files(index, broken)
        if rep.problems:
            rep.status = "problems" if self.dry_run else "repaired"

    # ------------------------------------------------------------------ checks
    def _check_indexed(self, row: IndexRow, expected: Expected) -> str | None:
        """Why a file with a row is unusable: a reason, 'missing', or None if fine."""
        path = self._path(row.hash)
        exp = replace(expected, block_hash=row.hash)
        try:
            if self.deep:
                data = self.fs.read_bytes(path)
                block, _ = blockfile.decode(data, exp, verify_checksum=True)
                if blockfile.tokens_digest(block.token_ids) != row.tokens_digest:
                    return "token digest differs from the index"
                size = len(data)
            else:
                size = self.fs.size(path)
                header = blockfile.read_header(self._read_head(path), file_size=size)
                blockfile.check_header(header, exp)
        except FileNotFoundError:
            return "missing"
        except BlockFileError as exc:
            return str(exc)
        except OSError as exc:
            return f"unreadable: {exc}"
        if size != row.nbytes:
            return f"size {size} differs from the index ({row.nbytes})"
        return None

    def _check_orphan(self, h: str, expected: Expected) -> tuple[IndexRow | None, str]:
        """An adoptable row for an orphan file, or (None, reason)."""
        path = self._path(h)
        exp = replace(expected, block_hash=h)
        try:
            data = self.fs.read_bytes(path)
            block, meta = blockfile.decode(data, exp, verify_checksum=True)
            created = float(meta["created"])
        except FileNotFoundError:
            return None, "missing"
        except (BlockFileError, ValueError) as exc:
            return None, str(exc)
        except OSError as exc:
            return None, f"unreadable: {exc}"
        digest = blockfile.tokens_digest(block.token_ids)
        row = IndexRow(h, block.parent_hash, block_relpath(h), block.num_tokens, len(data), digest, created, created)
        return row, ""

    def _read_head(self, path: Path) -> bytes:
        head = self.fs.read_head(path, HEAD_READ_BYTES)
        if len(head) >= 8:
            need = 8 + int.from_bytes(head[:8], "little")
            if len(head) < need <= blockfile.MAX_HEADER_BYTES + 8:
                head = self.fs.read_head(path, need)
        return head

    # ----------------------------------------------------------------- repairs
    def _remove_rows_then_files(self, index: BlockIndex, hashes: list[str]) -> None:
        if hashes:
            index.delete(hashes)  # one transaction; files only after their rows are gone
            self._unlink_all(self._path(h) for h in hashes)

    def _remove_orphans(self, index: BlockIndex, hashes: list[str]) -> None:
        present = index.present(hashes)  # a live writer may have inserted the row meanwhile
        self._unlink_all(self._path(h) for h in hashes if h not in present)

    def _unlink_all(self, paths) -> None:
        for p in paths:
            try:
                self.fs.unlink(p)
            except OSError as exc:
                self.rep.note("unlink_failed", p.name, str(exc))

    # ------------------------------------------------------------------- misc
    def _path(self, h: str) -> Path:
        return self.ns_dir / block_relpath(h)

    def _size(self, path: Path) -> int:
        try:
            return self.fs.size(path)
        except OSError:
            return 0

    def _progress(self, done: int, total: int) -> None:
        if self.progress is not None:
            self.progress(self.ns_dir.name, done, total)


def _broken_chains(parents: dict[str, str], root: str) -> list[str]:
    """Hashes not reachable from `root` through parent links (sorted)."""
    children: dict[str, list[str]] = {}
    for h, p in parents.items():
        children.setdefault(p, []).append(h)
    reached: set[str] = set()
    stack = [root]
    while stack:
        for c in children.get(stack.pop(), ()):
            if c not in reached:
                reached.add(c)
                stack.append(c)
    return sorted(h for h in parents if h not in reached)


__all__ = ["validate", "ValidateReport", "NamespaceReport", "ValidateError"]
