"""`kvtool rm`: remove one namespace, or the blocks of one prompt and what hangs below them
(docs/operations.md#kvtool-rm).

Both are plans (prune's `PrunePlan`), executed under prune's lock (`kvtool.disk.lock.cache_lock`)
and its confinement rules (`kvtool.disk.confined`).

- **A namespace** (`plan_namespace_removal`): the directory named by a unique key prefix (at
  least `MIN_PREFIX_HEX` hex digits) goes whole, whatever its status, by kvtool's names only
  (`kvtool.ops.remove_tree`: segment files first, the index last, so an `rm` killed half-way
  leaves rows of missing files that `validate` drops, or a namespace a second `rm` finishes);
  what kvtool never writes is left and listed (`left`). A directory whose `index.sqlite` is not
  a kvtool index is refused whole (`RemoveError`), as is a symlink in the cache root.
- **A prompt** (`plan_prompt_removal`): the caller hashes the prompt for the namespace(s) its
  model uses (`PromptKeys`); in each, the stored ones go with their descendants in any segment,
  and every segment file left without a row (executed as prune). Matched namespaces that are not
  usable are left untouched and reported as problems.

Hashing a prompt needs its tokenizer: the CLI does that.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvtool.disk.confined import REMOVE_WORKERS
from kvtool.disk.lock import cache_lock
from kvtool.disk.names import NAMESPACE_RE
from kvtool.errors import KVToolError
from kvtool.ops.heap import gc_paused
from kvtool.ops.prune import NamespacePlan, PrunePlan, execute_prune, planner_of
from kvtool.ops.remove_tree import kvtool_index_problem, plan_tree, remove_tree
from kvtool.ops.scan import CacheScan, NamespaceScan, ScanError, scan_cache

_HEX = set("0123456789abcdef")
MIN_PREFIX_HEX = 8  # a shorter key prefix is refused: `rm 0` must never pick a namespace by luck


class RemoveError(KVToolError):
    """`kvtool rm` cannot run: not a key prefix, a symlinked namespace, missing cache dir (exit 2)."""


@dataclass(frozen=True)
class PromptKeys:
    """A prompt's keys in one namespace.

    Attributes:
        namespace: the layout key its model and this block size use.
        block_size: tokens per block.
        hashes: chain hashes of its full blocks, then its tail entry's key (if it has a tail).
    """

    namespace: str
    block_size: int
    hashes: tuple[str, ...]


@dataclass
class NamespaceRemoval(NamespacePlan):
    """Plan (and outcome) of `kvtool rm` in one namespace; `prune_*` count everything removed.

    Attributes (besides `NamespacePlan`'s):
        prompt_entries: the prompt's keys at this namespace's block size (full blocks + tail).
        prompt_blocks: of those, the ones stored (removed).
        skipped: matched but not usable (unreadable, foreign, uninitialized): left untouched.
        namespace_removed: the whole namespace directory was removed (outcome; `left`, from
            `NamespacePlan`, lists what kept it).
    """

    prompt_entries: int = 0
    prompt_blocks: int = 0
    skipped: bool = False
    namespace_removed: bool = False

    @property
    def problems(self) -> int:
        """Left untouched although matched, files not removed, index failures."""
        return int(self.skipped) + self.unlink_failed + int(self.index_failed)

    def to_dict(self) -> dict:
        """JSON-ready (see `RemovePlan.to_dict`)."""
        return {
            "namespace": self.namespace, "model_name": self.model_name, "status": self.status, "message": self.message,
            "remove_namespace": self.remove_namespace, "namespace_removed": self.namespace_removed,
            "blocks": self.blocks, "segments": self.segments, "bytes": self.bytes,
            "prompt_entries": self.prompt_entries, "prompt_blocks": self.prompt_blocks,
            "descendant_blocks": self.descendant_blocks,
            "remove_blocks": self.prune_blocks, "remove_segments": self.prune_segments, "remove_bytes": self.prune_bytes,
            "blocks_after": self.blocks_after, "segments_after": self.segments_after, "bytes_after": self.bytes_after,
            "rows_deleted": self.rows_deleted, "files_deleted": self.files_deleted, "bytes_freed": self.bytes_freed,
            "unlink_failed": self.unlink_failed, "index_failed": self.index_failed, "left": list(self.left),
        }  # fmt: skip


TOTAL_KEYS = ("blocks", "segments", "bytes", "remove_blocks", "remove_segments", "remove_bytes", "blocks_after",
              "segments_after", "bytes_after", "rows_deleted", "files_deleted", "bytes_freed", "unlink_failed")  # fmt: skip


@dataclass
class RemovePlan(PrunePlan):
    """What `kvtool rm` removes (a `PrunePlan` without TTL or budget, executed by `execute_prune`).

    Attributes (besides `PrunePlan`'s):
        target: 'namespace' or 'prompt'.
        model: the model the prompt was hashed for (prompt only).
        prompt_tokens: the prompt's length in tokens (prompt only).
    """

    target: str = "namespace"
    model: str | None = None
    prompt_tokens: int | None = None

    def to_dict(self) -> dict:
        """JSON-ready document (the `--json` output; the CLI adds `schema_version`)."""
        spaces = [ns.to_dict() for ns in self.namespaces if isinstance(ns, NamespaceRemoval)]
        return {
            "cache_dir": self.cache_dir, "target": self.target, "model": self.model, "prompt_tokens": self.prompt_tokens,
            "now": self.now, "dry_run": self.dry_run, "executed": self.executed, "namespaces": spaces,
            "totals": {k: sum(d[k] for d in spaces) for k in TOTAL_KEYS}, "problems": self.problems,
        }  # fmt: skip


# ----------------------------------------------------------------------------- a namespace
def check_prefix(prefix: str) -> str:
    """The lower-cased key prefix.

    Raises:
        RemoveError: empty, longer than a key, not hexadecimal (e.g. a model name), or shorter
            than `MIN_PREFIX_HEX` hex digits.
    """
    p = prefix.strip().lower()
    if not p or len(p) > 32 or not set(p) <= _HEX:
        raise RemoveError(f"{prefix!r} is not a namespace key prefix (hex digits, as `kvtool inspect` lists them)",
                          hint=f"`kvtool inspect --filter {prefix}` finds a model's namespaces" if prefix.strip() else None)  # fmt: skip
    if len(p) < MIN_PREFIX_HEX:
        raise RemoveError(f"namespace key prefix {prefix!r} is too short: give at least {MIN_PREFIX_HEX} hex digits "
                          "of the key, as `kvtool inspect` lists it; nothing removed")  # fmt: skip
    return p


def scan_for_removal(cache_dir: Path, prefix: str, now: float | None = None) -> CacheScan:
    """Scan the one namespace `prefix` names.

    Raises:
        RemoveError: not a key prefix (or too short), several entries of the cache root match it
            (nothing is removed), or the only match is a symlink in the cache root (never followed).
            Also: its `index.sqlite` is not a kvtool index (`remove_tree.kvtool_index_problem`).
        ScanError: missing cache dir; no namespace matches.
    """
    p = check_prefix(prefix)
    matches = _entries_matching(Path(cache_dir), p)
    if len(matches) > 1:
        raise RemoveError(f"{len(matches)} namespaces in {cache_dir} match {prefix!r}: ambiguous, nothing removed",
                          hint="give more of the key (kvtool inspect lists them)")  # fmt: skip
    if len(matches) == 1 and not os.path.islink(Path(cache_dir) / matches[0]):
        problem = kvtool_index_problem(Path(cache_dir) / matches[0])
        if problem is not None:
            raise RemoveError(f"{Path(cache_dir) / matches[0]} is not a kvtool namespace: {problem}; nothing removed",
                              hint="a kvtool namespace whose index is damaged: `kvtool validate --rebuild-index` first; "
                                   "else it is not kvtool's: remove it by hand if it is not wanted")  # fmt: skip
    try:
        return scan_cache(cache_dir, p, now=now, rows=False)  # a namespace goes whole: its rows are only counted
    except ScanError:
        links = [n for n in _entries_matching(Path(cache_dir), p) if os.path.islink(Path(cache_dir) / n)]
        if links:
            raise RemoveError(f"{Path(cache_dir) / links[0]} is a symlink: never followed, nothing removed",
                              hint="remove the link itself if it is not wanted") from None  # fmt: skip
        raise


def _entries_matching(cache_dir: Path, prefix: str) -> list[str]:
    """Names in the cache root that look like a layout key starting with `prefix` (directories
    and symlinks alike); [] if the root cannot be listed."""
    try:
        names = sorted(os.listdir(cache_dir))
    except OSError:
        return []
    return [n for n in names if NAMESPACE_RE.match(n) and n.startswith(prefix)]


def plan_namespace_removal(scan: CacheScan) -> RemovePlan:
    """Plan the removal of every namespace of `scan` (one, from `scan_for_removal`), whole."""
    plan = RemovePlan(str(scan.cache_dir), None, None, "namespace", scan.now, target="namespace")
    for ns in scan.namespaces:
        p = NamespaceRemoval(ns.name, ns.meta.get("model_name"), ns.status.value, remove_namespace=True)
        try:
            tree = plan_tree(scan.cache_dir, ns.name)
            p.bytes, p.left = tree.bytes, tree.left
        except (OSError, ValueError):
            p.bytes = ns.file_bytes
        p.blocks, p.segments = ns.row_count, len(ns.files)
        p.prune_blocks, p.prune_segments, p.prune_bytes = p.blocks, p.segments, p.bytes
        if ns.usable and ns.meta.get("shutdown_clean") == "0":
            p.message = "open now, or its last process did not shut down cleanly: a process using it stops caching to it"
        plan.namespaces.append(p)
    return plan


# ----------------------------------------------------------------------------- a prompt
def block_sizes_of(scan: CacheScan) -> set[int]:
    """The block sizes of the scanned namespaces (from their meta)."""
    out = set()
    for ns in scan.namespaces:
        try:
            bs = int(ns.meta.get("block_size", ""))
        except ValueError:
            continue
        if bs > 0:
            out.add(bs)
    return out


@gc_paused
def plan_prompt_removal(
    scan: CacheScan, keys_for: Callable[[int], PromptKeys], block_sizes: Iterable[int] | None = None,
    *, model: str | None = None, prompt_tokens: int | None = None,
) -> RemovePlan:  # fmt: skip
    """Plan the removal of a prompt's blocks (changes nothing).

    Args:
        scan: a `scan_cache` result.
        keys_for: block size -> the prompt's keys at that block size (its namespace and hashes).
        block_sizes: the block sizes to look in; None: every block size of the scanned namespaces.
        model, prompt_tokens: recorded in the plan (for the report).
    """
    plan = RemovePlan(str(scan.cache_dir), None, None, "namespace", scan.now, target="prompt", model=model,
                      prompt_tokens=prompt_tokens)  # fmt: skip
    by_name = {ns.name: ns for ns in scan.namespaces}
    sizes = sorted(set(block_sizes) if block_sizes is not None else block_sizes_of(scan))
    for bs in sizes:
        keys = keys_for(bs)
        ns = by_name.get(keys.namespace)
        if ns is not None:
            plan.namespaces.append(_plan_prompt_in(ns, keys))
    return plan


def _plan_prompt_in(ns: NamespaceScan, keys: PromptKeys) -> NamespaceRemoval:
    p = NamespaceRemoval(ns.name, ns.meta.get("model_name"), ns.status.value, prompt_entries=len(keys.hashes))
    if not ns.usable:
        p.skipped = True
        p.message = f"{ns.status.value}: left untouched ({ns.message})" if ns.message else f"{ns.status.value}: left untouched"
        return p
    planner = p.planner = planner_of(ns)
    p.blocks, p.segments, p.bytes = ns.row_count, len(planner.names), planner.kept_bytes
    rows = ns.table.find(list(keys.hashes)) if ns.table is not None and keys.hashes else np.zeros(0, dtype=np.int64)
    planner.choose_blocks(rows[rows >= 0], "prompt")
    p.count_removed(planner, reasons=())  # the prompt's blocks and their descendants: counted below
    p.prompt_blocks = planner.counts().get("prompt", (0, 0, 0))[0]
    p.descendant_blocks = p.prune_blocks - p.prompt_blocks
    return p


# ----------------------------------------------------------------------------- execute
def execute_removal(plan: RemovePlan) -> RemovePlan:
    """Carry out a plan (hold `cache_lock` around scanning, planning and executing). A namespace's
    kvtool entries go (`remove_tree.remove_tree`: segment files first, `REMOVE_WORKERS` fan-out
    directories at once, the index last; its rows and segment files count as deleted; what is not
    kvtool's is left and listed in `left`); a prompt's blocks go by prune's execution.

    Never raises for I/O trouble: failures are counted (`unlink_failed`, `index_failed`)."""
    if plan.target != "namespace":
        execute_prune(plan)
    else:
        for p in plan.namespaces:
            try:
                tree = remove_tree(Path(plan.cache_dir), p.namespace, REMOVE_WORKERS)
            except (OSError, ValueError) as exc:
                p.unlink_failed += 1
                p.message = f"{p.message}; not removed: {exc}".lstrip("; ")
                continue
            p.bytes_freed = tree.bytes
            p.rows_deleted, p.files_deleted = p.blocks, p.segments
            if isinstance(p, NamespaceRemoval):
                p.namespace_removed, p.left = tree.removed, tree.left
        plan.executed = True
    return plan


def remove_namespace(cache_dir: Path, prefix: str, dry_run: bool = False, now: float | None = None) -> RemovePlan:
    """Lock, scan, plan and execute the removal of one namespace (`dry_run`: no lock, no change).

    Raises:
        RemoveError, ScanError: see `scan_for_removal`. PruneLocked: a prune or rm holds the lock.
    """
    return _locked(cache_dir, dry_run, lambda: plan_namespace_removal(scan_for_removal(cache_dir, prefix, now)))


def remove_prompt(
    cache_dir: Path, keys_for: Callable[[int], PromptKeys], block_sizes: Iterable[int] | None = None,
    dry_run: bool = False, now: float | None = None,
) -> RemovePlan:  # fmt: skip
    """Lock, scan, plan and execute the removal of a prompt's blocks (`dry_run`: no lock, no change).

    Raises:
        ScanError: missing cache dir. PruneLocked: a prune or rm holds the lock.
    """
    return _locked(cache_dir, dry_run,
                   lambda: plan_prompt_removal(scan_cache(cache_dir, now=now, full=False), keys_for, block_sizes))  # fmt: skip


def _locked(cache_dir: Path, dry_run: bool, plan: Callable[[], RemovePlan]) -> RemovePlan:
    """`plan()` executed under `cache_lock`; `dry_run`: planned without the lock, not executed.

    Raises:
        RemoveError: the cache directory does not exist (not with `dry_run`).
    """
    if dry_run:
        out = plan()
        out.dry_run = True
        return out
    if not Path(cache_dir).is_dir():
        raise RemoveError(f"cache directory {cache_dir} does not exist or is not a directory")
    with cache_lock(cache_dir):
        return execute_removal(plan())


__all__ = [
    "MIN_PREFIX_HEX", "PromptKeys", "NamespaceRemoval", "RemovePlan", "RemoveError", "check_prefix", "scan_for_removal",
    "plan_namespace_removal", "plan_prompt_removal", "block_sizes_of", "execute_removal", "remove_namespace",
    "remove_prompt",
]  # fmt: skip
