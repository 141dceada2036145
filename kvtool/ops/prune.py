"""`kvtool prune`: remove old and least recently used blocks from the SSD tier.

hf-cache style: scan -> plan -> (show, confirm: the CLI) -> execute.

Plan, per namespace (or over the whole cache with `all_namespaces`):
1. TTL: every block last used before `now - ttl_s`;
2. budget: then the least recently used blocks until the remaining bytes are within `max_bytes`;
3. descendants of any chosen block go too: a prefix lookup walks a chain from its first block,
   so a block whose parent is gone can never be reached again.

"Last used" is a block's *effective* access time: the newest `last_access` in its subtree
(the block and its stored descendants). Using a descendant means its whole prefix was used,
even when the prefix came from another process's RAM tier and its SSD row was not touched.
So a prefix is never older than what hangs below it, and with ties broken deepest first the
LRU order removes leaves before their parents: it trims chains from the end instead of
dropping whole chains for the sake of their first block.

Execute, per namespace: the index rows are deleted in one transaction, then the files (the
design's ordering invariant: a file is unlinked only after its row is gone).

Safe while `serve-once` or `warm` use the same cache: a reader that finds a row whose file was
just unlinked treats it as a miss (`SSDStore._file_vanished`), and a lookup that misses block i
stops there, so it never uses a chain with a hole. A block saved again between the two steps
may lose its new file; the next reader drops its row (a miss, never wrong KV).

Two prunes never run at once: `prune_lock` holds an exclusive `fcntl.flock` on
`<cache_dir>/.prune.lock` (non-blocking: the second one fails with `PruneLocked`).
"""

from __future__ import annotations

import fcntl
import os
import sqlite3
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator

from kvtool.ops.inspect_cache import InspectError, select_namespaces
from kvtool.store import blockfile
from kvtool.store.fsops import FileOps, block_relpath
from kvtool.store.index import INDEX_FILENAME, BlockIndex, IndexRow


LOCK_FILENAME = ".prune.lock"  # docs/DESIGN.md: <cache_dir>/.prune.lock
REASONS = ("ttl", "lru", "descendant")


class PruneError(Exception):
    """Prune cannot run: missing cache dir, unknown or ambiguous namespace, bad arguments."""


class PruneLocked(PruneError):
    """Another prune holds the lock on this cache directory."""


# ----------------------------------------------------------------------------- lock
@contextmanager
def prune_lock(cache_dir: Path) -> Iterator[Path]:
    """Hold the cache's prune lock for the duration of the `with` block.

    The lock is an exclusive, non-blocking `fcntl.flock` on `<cache_dir>/.prune.lock`; the
    kernel releases it when the process dies, so a crashed prune never leaves it stuck. The
    file itself stays (removing it would let two processes lock two different files).

    Yields:
        The lock file path.

    Raises:
        PruneLocked: another process holds the lock.
        PruneError: the lock file cannot be created (missing or read-only cache dir).
    """
    path = Path(cache_dir) / LOCK_FILENAME
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise PruneError(f"cannot create the prune lock {path}: {exc.strerror or exc}") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
            who = f" (pid {holder})" if holder.isdigit() else ""
            raise PruneLocked(f"another kvtool prune is running on {cache_dir}{who}; try again later") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield path
    finally:
        os.close(fd)  # releases the flock


# ----------------------------------------------------------------------------- plan
@dataclass
class NamespacePlan:
    """Plan (and, once executed, outcome) for one namespace. Sizes in bytes.

    Attributes:
        namespace: layout key.
        model_name: from the index meta (None if unreadable).
        status: 'ok' | 'uninitialized' | 'unknown_format' (left untouched) | 'unreadable' (left untouched).
        message: why a namespace is left untouched.
        blocks, bytes: in the index when planned.
        ttl_blocks, ttl_bytes: chosen because they were last used before `now - ttl_s`.
        lru_blocks, lru_bytes: chosen, least recently used first, to get under the budget.
        descendant_blocks, descendant_bytes: chosen because an ancestor was.
        prune_blocks, prune_bytes: all chosen (the sum of the three reasons).
        blocks_after, bytes_after: what the plan leaves.
        rows_deleted, files_deleted, bytes_freed, unlink_failed: outcome (0 until executed).
        hashes: the chosen block hashes (not in `to_dict`).
    """

    namespace: str
    model_name: str | None = None
    status: str = "ok"
    message: str = ""
    blocks: int = 0
    bytes: int = 0
    ttl_blocks: int = 0
    ttl_bytes: int = 0
    lru_blocks: int = 0
    lru_bytes: int = 0
    descendant_blocks: int = 0
    descendant_bytes: int = 0
    prune_blocks: int = 0
    prune_bytes: int = 0
    blocks_after: int = 0
    bytes_after: int = 0
    rows_deleted: int = 0
    files_deleted: int = 0
    bytes_freed: int = 0
    unlink_failed: int = 0
    hashes: list[str] = field(default_factory=list, repr=False)


@dataclass
class PrunePlan:
    """What a prune would remove, per namespace.

    Attributes:
        cache_dir: the SSD tier root.
        ttl_s: TTL in seconds (None: no TTL rule).
        max_bytes: byte budget (None: no budget rule).
        scope: 'namespace' (each namespace under `max_bytes`) or 'all' (the whole cache).
        now: the planning time (unix seconds).
        namespaces: one plan per namespace considered.
        dry_run: the plan was not executed on purpose.
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

    @property
    def problems(self) -> int:
        """Unreadable namespaces plus files that could not be removed."""
        return sum(ns.status == "unreadable" for ns in self.namespaces) + self.total("unlink_failed")

    def to_dict(self) -> dict:
        """JSON-ready document (see docs/OPS.md)."""
        doc = asdict(self)
        for d in doc["namespaces"]:
            d.pop("hashes")
        keys = ("blocks", "bytes", "prune_blocks", "prune_bytes", "blocks_after", "bytes_after",
                "rows_deleted", "files_deleted", "bytes_freed", "unlink_failed")  # fmt: skip
        doc["totals"] = {k: self.total(k) for k in keys}
        doc["problems"] = self.problems
        return doc


class _Namespace:
    """The index snapshot of one namespace and the blocks chosen so far."""

    def __init__(self, plan: NamespacePlan, rows: list[IndexRow]):
        self.plan = plan
        self.rows = {r.hash: r for r in rows}
        self.children: dict[str, list[str]] = {}
        for r in rows:
            self.children.setdefault(r.parent, []).append(r.hash)
        self.depth = _depths(self.rows)
        self.used = _effective_access(self.rows, self.depth)
        self.chosen: dict[str, str] = {}  # hash -> reason
        self.kept_bytes = sum(r.nbytes for r in rows)

    def choose(self, hashes: list[str], reason: str) -> None:
        """Choose `hashes` for `reason` (those not chosen yet), then their stored descendants."""
        fresh = [h for h in hashes if h not in self.chosen]
        for h in fresh:
            self.chosen[h] = reason
            self.kept_bytes -= self.rows[h].nbytes
        stack = [(c, "descendant") for h in fresh for c in self.children.get(h, ())]
        while stack:
            cur, why = stack.pop()
            if cur in self.chosen:
                continue
            self.chosen[cur] = why
            self.kept_bytes -= self.rows[cur].nbytes
            stack.extend((c, "descendant") for c in self.children.get(cur, ()))

    def finish(self) -> NamespacePlan:
        p = self.plan
        for h, why in self.chosen.items():
            setattr(p, f"{why}_blocks", getattr(p, f"{why}_blocks") + 1)
            setattr(p, f"{why}_bytes", getattr(p, f"{why}_bytes") + self.rows[h].nbytes)
        p.hashes = sorted(self.chosen)
        p.prune_blocks = len(p.hashes)
        p.prune_bytes = p.bytes - self.kept_bytes
        p.blocks_after, p.bytes_after = p.blocks - p.prune_blocks, self.kept_bytes
        return p


def _effective_access(rows: dict[str, IndexRow], depth: dict[str, int]) -> dict[str, float]:
    """Newest `last_access` in each block's subtree (unix seconds)."""
    used = {h: r.last_access for h, r in rows.items()}
    for h in sorted(rows, key=lambda x: -depth[x]):  # children before parents
        parent = rows[h].parent
        if parent in used:
            used[parent] = max(used[parent], used[h])
    return used


def _depths(rows: dict[str, IndexRow]) -> dict[str, int]:
    """Chain depth of every row (0 = its parent is not stored)."""
    depth: dict[str, int] = {}
    for h in rows:
        path = []
        cur = h
        while cur in rows and cur not in depth and len(path) <= len(rows):
            path.append(cur)
            cur = rows[cur].parent
        d = depth.get(cur, -1)
        for node in reversed(path):
            d += 1
            depth[node] = d
    return depth


def plan_prune(
    cache_dir: Path,
    ttl_s: float | None = None,
    max_bytes: int | None = None,
    namespace: str | None = None,
    all_namespaces: bool = False,
    now: float | None = None,
    fs: FileOps | None = None,
) -> PrunePlan:
    """Decide what to prune (reads the indexes, changes nothing).

    Args:
        cache_dir: the SSD tier root.
        ttl_s: remove blocks not accessed for this many seconds (None: no TTL rule).
        max_bytes: byte budget, per namespace, or for the whole cache with `all_namespaces`
            (None: no budget rule).
        namespace: only this namespace (layout key or unique prefix).
        all_namespaces: one global LRU over every namespace against `max_bytes`.
        now: current time (unix seconds); injectable for tests.
        fs: file-system operations.

    Returns:
        The plan.

    Raises:
        PruneError: bad arguments, missing cache dir, unknown or ambiguous namespace.
    """
    if namespace is not None and all_namespaces:
        raise PruneError("give --namespace or --all, not both")
    if ttl_s is not None and ttl_s < 0:
        raise PruneError(f"ttl must be >= 0 seconds, got {ttl_s}")
    if max_bytes is not None and max_bytes < 0:
        raise PruneError(f"max bytes must be >= 0, got {max_bytes}")
    try:
        dirs = select_namespaces(cache_dir, namespace, fs)
    except InspectError as exc:
        raise PruneError(str(exc)) from None
    now = time.time() if now is None else now
    plan = PrunePlan(str(cache_dir), ttl_s, max_bytes, "all" if all_namespaces else "namespace", now)
    spaces = []
    for ns_dir in dirs:
        ns_plan, rows = _read_namespace(ns_dir)
        plan.namespaces.append(ns_plan)
        if ns_plan.status == "ok":
            spaces.append(_Namespace(ns_plan, rows))
    for ns in spaces:
        if ttl_s is not None:
            ns.choose([h for h in ns.rows if ns.used[h] < now - ttl_s], "ttl")
    if max_bytes is not None:
        groups = [spaces] if all_namespaces else [[ns] for ns in spaces]
        for group in groups:
            _fit_budget(group, max_bytes)
    for ns in spaces:
        ns.finish()
    return plan


def _read_namespace(ns_dir: Path) -> tuple[NamespacePlan, list[IndexRow]]:
    plan = NamespacePlan(ns_dir.name)
    try:
        index = BlockIndex(ns_dir / INDEX_FILENAME, create=False)
    except sqlite3.Error as exc:
        plan.status, plan.message = "unreadable", f"cannot open index: {exc}"
        return plan, []
    try:
        if not index.initialized():  # creation interrupted or in progress: nothing to prune
            plan.status, plan.message = "uninitialized", "namespace not initialised: left untouched"
            return plan, []
        meta = index.get_meta()
        rows = list(index.rows())
    except sqlite3.Error as exc:
        plan.status, plan.message = "unreadable", f"index error: {exc}"
        return plan, []
    finally:
        index.close()
    plan.model_name = meta.get("model_name")
    plan.blocks, plan.bytes = len(rows), sum(r.nbytes for r in rows)
    version = meta.get("format_version")
    if version != str(blockfile.FORMAT_VERSION) or meta.get("layout_key") != ns_dir.name:
        plan.status = "unknown_format"
        plan.message = f"format_version {version!r}, layout {meta.get('layout_key')!r}: left untouched"
        return plan, []
    return plan, rows


def _fit_budget(group: list[_Namespace], max_bytes: int) -> None:
    """Choose least recently used blocks of `group` until its kept bytes fit `max_bytes`."""
    if sum(ns.kept_bytes for ns in group) <= max_bytes:
        return
    candidates = sorted(
        (ns.used[h], -ns.depth[h], ns.plan.namespace, h, i)
        for i, ns in enumerate(group)
        for h in ns.rows
        if h not in ns.chosen
    )  # fmt: skip
    kept = sum(ns.kept_bytes for ns in group)
    for *_, h, i in candidates:
        if kept <= max_bytes:
            break
        ns = group[i]
        if h in ns.chosen:
            continue
        before = ns.kept_bytes
        ns.choose([h], "lru")
        kept -= before - ns.kept_bytes


# ----------------------------------------------------------------------------- execute
def execute_prune(plan: PrunePlan, fs: FileOps | None = None) -> PrunePlan:
    """Carry out a plan: per namespace, delete the rows in one transaction, then the files.

    Hold `prune_lock` around planning and executing. Never raises for I/O trouble: an index
    that cannot be written marks its namespace 'unreadable', a file that cannot be removed
    counts in `unlink_failed` (its row is gone already; `kvtool validate` removes the orphan).

    Returns:
        The same plan, with the outcome counts filled in and `executed` set.
    """
    fs = fs or FileOps()
    root = Path(plan.cache_dir)
    for ns in plan.namespaces:
        if ns.status != "ok" or not ns.hashes:
            continue
        ns_dir = root / ns.namespace
        try:
            index = BlockIndex(ns_dir / INDEX_FILENAME, create=False)
            try:
                ns.rows_deleted = index.delete(ns.hashes)
            finally:
                index.close()
        except sqlite3.Error as exc:
            ns.status, ns.message = "unreadable", f"index error, nothing removed: {exc}"
            continue
        for h in ns.hashes:
            path = ns_dir / block_relpath(h)
            try:
                size = fs.size(path)
                fs.unlink(path)
            except FileNotFoundError:
                continue
            except OSError:
                ns.unlink_failed += 1
                continue
            ns.files_deleted += 1
            ns.bytes_freed += size
    plan.executed = True
    return plan


def prune(
    cache_dir: Path,
    ttl_s: float | None = None,
    max_bytes: int | None = None,
    namespace: str | None = None,
    all_namespaces: bool = False,
    dry_run: bool = False,
    now: float | None = None,
) -> PrunePlan:
    """Lock, plan and execute (or, with `dry_run`, only plan, without the lock): a whole prune.

    Args: as `plan_prune`; `dry_run` plans only.

    Returns:
        The executed (or, under `dry_run`, only planned) plan.

    Raises:
        PruneLocked: another prune is running on `cache_dir`.
        PruneError: as `plan_prune`, or the lock cannot be created.
    """
    if not Path(cache_dir).is_dir():
        raise PruneError(f"cache directory {cache_dir} does not exist or is not a directory")
    if dry_run:  # only reads: no lock, nothing written
        plan = plan_prune(cache_dir, ttl_s, max_bytes, namespace, all_namespaces, now)
        plan.dry_run = True
        return plan
    with prune_lock(cache_dir):
        return execute_prune(plan_prune(cache_dir, ttl_s, max_bytes, namespace, all_namespaces, now))


__all__ = [
    "prune", "plan_prune", "execute_prune", "prune_lock", "PrunePlan", "NamespacePlan", "PruneError",
    "PruneLocked", "LOCK_FILENAME",
]  # fmt: skip
