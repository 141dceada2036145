"""`kvtool inspect`: what the SSD tier holds, per namespace (a rendering of `scan_cache`), and
whether a prompt would hit.

Read-only: the scan opens indexes read-only (quietly: no -wal / -shm created) and only lists
files. `InspectReport.select` sorts, filters and limits the namespaces (`--sort`, `--filter`,
`--limit`): the table and the JSON show the same selection.

A prompt probe asks the model's own `PrefixCache.probe` (hashing and one index query, no block
read), on a store opened read-only through `ReadOnlyFileOps`: nothing is created or changed.
The CLI builds the engine; this module only holds the result type.
"""

from __future__ import annotations

import errno
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from enum import StrEnum
from pathlib import Path

import numpy as np

from kvtool.disk.fsops import FileOps
from kvtool.disk.segment import KVLayout
from kvtool.ops.scan import CacheScan, NamespaceScan, ScanError, scan_cache

InspectError = ScanError  # what `inspect_cache` raises (missing cache dir, bad namespace)

# Age buckets by last access: (label, upper bound in seconds); the last one is open-ended.
AGE_BUCKETS: tuple[tuple[str, float], ...] = (
    ("<1h", 3600.0),
    ("<1d", 86400.0),
    ("<7d", 7 * 86400.0),
    ("<30d", 30 * 86400.0),
    ("older", float("inf")),
)


class InspectSort(StrEnum):
    """`kvtool inspect --sort`: size, blocks and last-used list the largest / newest first; name
    sorts by model name, then namespace (namespaces without a model name last)."""

    SIZE = "size"
    LAST_USED = "last-used"
    NAME = "name"
    BLOCKS = "blocks"


@dataclass
class Health:
    """Index vs files of one namespace.

    Attributes:
        rows: well-formed index rows.
        files: segment files on disk.
        missing_files: segments named by rows whose file is gone.
        orphan_files: segment files no row names.
        temp_files: kvtool temp files (writes in progress or leftovers).
        bad_rows: malformed rows (NULLs, wrong types, bad names; never used).
        symlinks: symlinks inside the namespace (never followed).
        irregular: entries under a segment or temp file name that are not regular files (FIFO,
            socket, device, directory): never opened; `kvtool validate` removes them.
        ok: none of missing, orphan, bad rows, symlinks or irregular entries.
    """

    rows: int = 0
    files: int = 0
    missing_files: int = 0
    orphan_files: int = 0
    temp_files: int = 0
    bad_rows: int = 0
    symlinks: int = 0
    irregular: int = 0
    ok: bool = True


@dataclass
class NamespaceInfo:
    """One namespace. Sizes in bytes, times in unix seconds.

    Attributes:
        namespace: directory name (= layout key).
        status: the scan's status (ok | empty | uninitialized | unreadable | outdated | foreign).
        message: why the namespace is not usable, if it is not.
        model_id, model_name, model_class, layout_key, block_size (tokens), kv_dtype, kv_layers
            (per layer `HxDkxDv`), format_version: from the index meta.
        n_layers, n_kv_heads, head_dim: from `kv_layers` (the last two None if layers differ).
        blocks: index rows (full blocks and prompt tail entries); tail_entries: those shorter
            than a block.
        segments: segment files holding them; bytes: their size.
        chains: blocks whose parent is not stored (first blocks); max_depth: longest chain - 1.
        oldest_access, newest_access: min/max `last_access`, clamped to now (None when empty).
        age_histogram: blocks per `AGE_BUCKETS` label, by age of last access.
        shutdown_clean: the last process closed it cleanly (False also while one has it open).
        shutdown_partial_flush: the last shutdown flushed the index after an incomplete drain.
        created, last_open, last_close: from the index meta (None if absent).
        selfcheck: the namespace's self-check verdict (`kvtool.cache.selfcheck`, meta `selfcheck`):
            "pass" or "fail: <first mismatch>", with the probe's size and time; None if the
            layout needs none or it was never run.
        reply_check: the reply probe's verdict (`kvtool.cache.reply`, meta `selfcheck_reply`):
            "exact" or "differs: <first difference>", with its device and decode steps; None if
            `kvtool serve` never measured it here.
        last_used: the newest sign of use: a block's last access, the index's last write, or a
            process opening or closing the namespace (clamped to now; None if none is known).
        health: index vs files.
    """

    namespace: str
    status: str = "ok"
    message: str = ""
    model_id: str | None = None
    model_name: str | None = None
    model_class: str | None = None
    layout_key: str | None = None
    block_size: int | None = None
    kv_dtype: str | None = None
    kv_layers: str | None = None
    n_layers: int | None = None
    n_kv_heads: int | None = None
    head_dim: int | None = None
    format_version: str | None = None
    blocks: int = 0
    tail_entries: int = 0
    segments: int = 0
    bytes: int = 0
    chains: int = 0
    max_depth: int | None = None
    oldest_access: float | None = None
    newest_access: float | None = None
    age_histogram: dict[str, int] = field(default_factory=lambda: {label: 0 for label, _ in AGE_BUCKETS})
    shutdown_clean: bool | None = None
    shutdown_partial_flush: bool | None = None
    created: float | None = None
    last_open: float | None = None
    last_close: float | None = None
    selfcheck: str | None = None
    reply_check: str | None = None
    last_used: float | None = None
    health: Health = field(default_factory=Health)

    @property
    def problem(self) -> bool:
        """Unreadable, foreign, or index and files disagree (exit 1 of `kvtool inspect`)."""
        return self.status in ("unreadable", "foreign") or not self.health.ok


@dataclass
class InspectReport:
    """Every namespace inspected.

    Attributes:
        cache_dir: the SSD tier root.
        now: the time ages are measured from (unix seconds).
        namespaces: one entry per namespace (after `select`: the selection, in its order).
        symlinks: symlinks directly under the cache root (never followed).
        scanned: namespaces scanned (before `select` filtered and limited them).
        sort, filter, limit: the selection applied (None: not given).
    """

    cache_dir: str
    now: float
    namespaces: list[NamespaceInfo] = field(default_factory=list)
    symlinks: list[str] = field(default_factory=list)
    scanned: int = 0
    sort: str | None = None
    filter: str | None = None
    limit: int | None = None

    def select(self, sort: InspectSort | str | None = InspectSort.NAME, text: str | None = None,
               limit: int | None = None) -> InspectReport:  # fmt: skip
        """A copy with the namespaces sorted, filtered (`text`: a case-insensitive substring of
        the model name or the layout key) and cut to the first `limit`.

        Raises:
            ValueError: an unknown sort key or a negative limit.
        """
        if limit is not None and limit < 0:
            raise ValueError(f"limit must be >= 0, got {limit}")
        key = InspectSort(sort) if sort is not None else None
        picked = [ns for ns in self.namespaces if _matches(ns, text)]
        if key is not None:
            picked = sorted(picked, key=_SORT_KEYS[key])
        if limit is not None:
            picked = picked[:limit]
        return replace(self, namespaces=picked, sort=key.value if key else None, filter=text, limit=limit)

    @property
    def problems(self) -> int:
        """Namespaces shown that are unreadable or foreign or whose index and files disagree,
        plus symlinks under the cache root (exit 1 of `kvtool inspect`)."""
        return sum(ns.problem for ns in self.namespaces) + len(self.symlinks)

    def to_dict(self) -> dict:
        """JSON-ready document (the `--json` output; the CLI adds `schema_version`)."""
        doc = asdict(self)
        doc["totals"] = {
            "namespaces": len(self.namespaces),
            "blocks": sum(ns.blocks for ns in self.namespaces),
            "bytes": sum(ns.bytes for ns in self.namespaces),
        }
        return doc


def _matches(ns: NamespaceInfo, text: str | None) -> bool:
    if not text:
        return True
    needle = text.lower()
    return needle in ns.namespace or needle in (ns.model_name or "").lower()


_LAST = float("inf")
_SORT_KEYS = {
    InspectSort.SIZE: lambda ns: (-ns.bytes, ns.namespace),
    InspectSort.BLOCKS: lambda ns: (-ns.blocks, ns.namespace),
    InspectSort.LAST_USED: lambda ns: (-(ns.last_used if ns.last_used is not None else -_LAST), ns.namespace),
    InspectSort.NAME: lambda ns: (ns.model_name is None, (ns.model_name or "").lower(), ns.namespace),
}


def inspect_cache(cache_dir: Path, namespace: str | None = None, now: float | None = None, fs: FileOps | None = None) -> InspectReport:
    """Describe the namespaces of an SSD cache (read-only): `render(scan_cache(...))`.

    Raises:
        ScanError: missing cache dir, unknown or ambiguous namespace.
    """
    return render(scan_cache(cache_dir, namespace, now=now, fs=fs, full=False))


def render(scan: CacheScan) -> InspectReport:
    """The inspect report of a scan."""
    report = InspectReport(str(scan.cache_dir), scan.now, symlinks=list(scan.symlinks), scanned=len(scan.namespaces))
    report.namespaces = [_info(ns, scan.now) for ns in scan.namespaces]
    return report


def _info(ns: NamespaceScan, now: float) -> NamespaceInfo:
    info = NamespaceInfo(ns.name, ns.status.value, ns.message)
    meta = ns.meta
    info.model_id, info.model_name, info.model_class = meta.get("model_id"), meta.get("model_name"), meta.get("model_class")
    info.layout_key, info.kv_dtype, info.kv_layers = meta.get("layout_key"), meta.get("kv_dtype"), meta.get("kv_layers")
    info.format_version = ns.format_version
    info.block_size = _num(meta.get("block_size"), int)
    for name in ("created", "last_open", "last_close"):
        setattr(info, name, _num(meta.get(name), float))
    if "shutdown_clean" in meta:
        info.shutdown_clean = meta["shutdown_clean"] == "1"
    if "shutdown_partial_flush" in meta:
        info.shutdown_partial_flush = meta["shutdown_partial_flush"] == "1"
    info.selfcheck = _verdict_words(meta.get("selfcheck"), _selfcheck_words, "the next start")
    info.reply_check = _verdict_words(meta.get("selfcheck_reply"), _reply_words, "the next start of kvtool serve")
    _fill_layers(info)
    t, forest = ns.table, ns.forest
    info.blocks = ns.row_count
    info.segments = len(t.segments) if t is not None else 0
    info.bytes = ns.bytes if ns.usable else ns.file_bytes
    if info.block_size and t is not None:
        info.tail_entries = int(np.count_nonzero(t.num_tokens < info.block_size))
    if forest is not None and len(forest):
        times = forest.last_access
        info.oldest_access, info.newest_access = float(times.min()), float(times.max())
        bounds = np.array([bound for _, bound in AGE_BUCKETS])
        per = np.bincount(np.searchsorted(bounds, now - times, side="right"), minlength=len(bounds))
        for (label, _), n in zip(AGE_BUCKETS, per.tolist()):
            info.age_histogram[label] += n
        info.chains, info.max_depth = int(forest.tops().size), int(forest.depth.max())
    seen = [t for t in (info.newest_access, ns.last_used) if t is not None]
    info.last_used = min(max(seen), now) if seen else None
    h = Health(ns.row_count, len(ns.files), len(ns.missing), len(ns.orphans), len(ns.temps), len(ns.bad_rows) + len(ns.bad_segment_rows),
               len(ns.symlinks), len(ns.irregular))  # fmt: skip
    h.ok = not (h.missing_files or h.orphan_files or h.bad_rows or h.symlinks or h.irregular)
    info.health = h
    return info


def _verdict_words(text: str | None, words: Callable[[dict], str], again: str) -> str | None:
    """A probe's verdict stored as JSON (`kvtool.cache.verdict.StoredVerdict`) in words
    (`words(doc)`; MLX-free); None without one; malformed: a line saying it is measured again at `again`."""
    if not text:
        return None
    try:
        return words(json.loads(text))
    except (ValueError, TypeError, KeyError):
        return f"unreadable verdict (measured again at {again})"


def _selfcheck_words(doc: dict) -> str:
    """The self-check's verdict (`kvtool.cache.selfcheck.Verdict`)."""
    what = "pass" if doc["passed"] is True else f"fail: {doc['reason']}"
    return f"{what} (probe of {int(doc['probe_tokens'])} tokens, {float(doc['ms']):.0f} ms)"


def _reply_words(doc: dict) -> str:
    """The reply probe's verdict (`kvtool.cache.reply.ReplyVerdict`)."""
    what = "exact" if doc["exact"] is True else f"differs: {doc['reason']}"
    return f"{what} ({int(doc['decode_steps'])} decode steps on {doc['device']}, {float(doc['ms']):.0f} ms)"


def _fill_layers(info: NamespaceInfo) -> None:
    if not info.kv_layers or not info.kv_dtype:
        return
    try:
        kv = KVLayout.parse(info.kv_layers, info.kv_dtype)
    except (ValueError, TypeError):
        return
    info.n_layers = kv.n_layers
    if len(set(kv.layers)) == 1 and kv.layers[0][1] == kv.layers[0][2]:
        info.n_kv_heads, info.head_dim = kv.layers[0][0], kv.layers[0][1]


def _num(text: str | None, kind: type):
    try:
        return kind(text) if text is not None else None
    except ValueError:
        return None


# ----------------------------------------------------------------------------- prompt probe
class ReadOnlyFileOps(FileOps):
    """FileOps that refuse every write (EROFS): an `SSDStore` opened with it serves lookups
    read-only (index opened `quiet`, no meta update, no reconcile, no touch) and creates nothing;
    a namespace that does not exist is not created (the store stays disabled)."""

    quiet_index = True

    def _refuse(self, path) -> None:
        raise OSError(errno.EROFS, "kvtool inspect opens the cache read-only", str(path))

    def makedirs(self, path, mode=0o700):  # noqa: D102
        self._refuse(path)

    def open_new(self, path):  # noqa: D102
        self._refuse(path)

    def replace(self, src, dst):  # noqa: D102
        self._refuse(dst)

    def unlink(self, path, missing_ok=True):  # noqa: D102
        self._refuse(path)


@dataclass
class PromptProbe:
    """Would a prompt hit the SSD tier? Token counts in tokens.

    Attributes:
        namespace: the layout key this model and block size use.
        namespace_exists: the cache holds that namespace.
        block_size: tokens per block.
        prompt_tokens: tokens in the prompt.
        full_blocks: full blocks in the prompt.
        cached_blocks: leading full blocks present in the index.
        cached_tokens: leading prompt tokens whose KV is on SSD (`PrefixCache.probe`; includes the
            prompt's tail entry when the whole prompt is stored, or an earlier prompt's tail entry
            that the prompt extends: a tail prefix hit).
        reused_tokens: what a following request would report as `cached_tokens`
            (one less on a full hit: the last prompt token is re-forwarded).
        would_hit: at least one token is cached.
    """

    namespace: str
    namespace_exists: bool
    block_size: int
    prompt_tokens: int
    full_blocks: int
    cached_blocks: int
    cached_tokens: int
    reused_tokens: int
    would_hit: bool

    @classmethod
    def of(cls, namespace: str, exists: bool, block_size: int, prompt_tokens: int, cached_tokens: int) -> PromptProbe:
        """The probe of a prompt of `prompt_tokens` tokens of which `cached_tokens` are stored."""
        full = prompt_tokens // block_size
        reused = cached_tokens - 1 if cached_tokens and cached_tokens == prompt_tokens else cached_tokens
        return cls(namespace, exists, block_size, prompt_tokens, full, min(cached_tokens // block_size, full),
                   cached_tokens, reused, cached_tokens > 0)  # fmt: skip

    def to_dict(self) -> dict:
        """JSON-ready document."""
        return asdict(self)


__all__ = [
    "inspect_cache", "render", "InspectReport", "InspectSort", "NamespaceInfo", "Health", "PromptProbe",
    "ReadOnlyFileOps", "InspectError", "AGE_BUCKETS",
]  # fmt: skip
