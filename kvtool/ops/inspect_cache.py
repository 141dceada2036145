"""`kvtool inspect`: what the SSD tier holds, per namespace, and whether a prompt would hit.

Read-only: indexes are opened without the schema step and never written, block files are
listed but never read. (Named `inspect_cache` so that it never shadows the stdlib `inspect`.)

`probe_prompt` answers "how many leading tokens of this prompt are on SSD?" by hashing alone:
the prompt's chain hashes are looked up in the namespace index, no block is loaded and the
model does not run on the prompt.
"""

from __future__ import annotations

import sqlite3
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

from kvtool.store import blockfile
from kvtool.store.fsops import FileOps, NamespaceSelectError, block_relpath, scan_namespace
from kvtool.store.fsops import select_namespaces as _select_namespaces
from kvtool.store.index import INDEX_FILENAME, BlockIndex, IndexRow

# Age buckets by last access: (label, upper bound in seconds); the last one is open-ended.
AGE_BUCKETS: tuple[tuple[str, float], ...] = (
    ("<1h", 3600.0),
    ("<1d", 86400.0),
    ("<7d", 7 * 86400.0),
    ("<30d", 30 * 86400.0),
    ("older", float("inf")),
)


class InspectError(Exception):
    """Inspect cannot run: missing cache dir, unknown or ambiguous namespace."""


def select_namespaces(cache_dir: Path, namespace: str | None = None, fs: FileOps | None = None) -> list[Path]:
    """`kvtool.store.fsops.select_namespaces`, raising `InspectError` on a bad selection."""
    try:
        return _select_namespaces(cache_dir, namespace, fs)
    except NamespaceSelectError as exc:
        raise InspectError(str(exc)) from None


@dataclass
class Health:
    """Index vs files of one namespace (counts of blocks/files).

    Attributes:
        rows: index rows.
        files: block files on disk.
        missing_files: rows whose file is gone.
        orphan_files: files without a row.
        temp_files: temp files (writes in progress or leftovers).
        ok: no missing and no orphan files.
    """

    rows: int = 0
    files: int = 0
    missing_files: int = 0
    orphan_files: int = 0
    temp_files: int = 0
    ok: bool = True


@dataclass
class NamespaceInfo:
    """One namespace. Sizes in bytes, times in unix seconds.

    Attributes:
        namespace: directory name (= layout key).
        status: 'ok' | 'uninitialized' (creation interrupted or in progress; empty) | 'unknown_format' |
            'unreadable'.
        message: why the namespace could not be read fully.
        model_id, model_name, layout_key, block_size (tokens), kv_dtype, n_layers, n_kv_heads,
        head_dim, format_version: from the index meta.
        blocks, bytes: rows in the index and the sum of their file sizes.
        oldest_access, newest_access: min/max `last_access` (None when empty).
        age_histogram: blocks per `AGE_BUCKETS` label, by age of last access.
        shutdown_clean: the last process closed it cleanly (False also while one has it open).
        shutdown_partial_flush: the last shutdown flushed the index after an incomplete drain.
        created, last_open, last_close: from the index meta (None if absent).
        health: index vs files.
    """

    namespace: str
    status: str = "ok"
    message: str = ""
    model_id: str | None = None
    model_name: str | None = None
    layout_key: str | None = None
    block_size: int | None = None
    kv_dtype: str | None = None
    n_layers: int | None = None
    n_kv_heads: int | None = None
    head_dim: int | None = None
    format_version: str | None = None
    blocks: int = 0
    bytes: int = 0
    oldest_access: float | None = None
    newest_access: float | None = None
    age_histogram: dict[str, int] = field(default_factory=lambda: {label: 0 for label, _ in AGE_BUCKETS})
    shutdown_clean: bool | None = None
    shutdown_partial_flush: bool | None = None
    created: float | None = None
    last_open: float | None = None
    last_close: float | None = None
    health: Health = field(default_factory=Health)


@dataclass
class InspectReport:
    """Every namespace inspected.

    Attributes:
        cache_dir: the SSD tier root.
        now: the time ages are measured from (unix seconds).
        namespaces: one entry per namespace.
    """

    cache_dir: str
    now: float
    namespaces: list[NamespaceInfo] = field(default_factory=list)

    def to_dict(self) -> dict:
        """JSON-ready document (see docs/OPS.md)."""
        doc = asdict(self)
        doc["totals"] = {
            "namespaces": len(self.namespaces),
            "blocks": sum(ns.blocks for ns in self.namespaces),
            "bytes": sum(ns.bytes for ns in self.namespaces),
        }
        return doc


def inspect_cache(
    cache_dir: Path, namespace: str | None = None, now: float | None = None, fs: FileOps | None = None
) -> InspectReport:
    """Describe the namespaces of an SSD cache (read-only).

    Args:
        cache_dir: the SSD tier root.
        namespace: only this namespace (layout key or unique prefix).
        now: time the ages are measured from (unix seconds); injectable for tests.
        fs: file-system operations.

    Returns:
        The report.

    Raises:
        InspectError: missing cache dir, unknown or ambiguous namespace.
    """
    fs = fs or FileOps()
    dirs = select_namespaces(cache_dir, namespace, fs)
    report = InspectReport(str(cache_dir), time.time() if now is None else now)
    for ns_dir in dirs:
        report.namespaces.append(_inspect_namespace(ns_dir, report.now, fs))
    return report


def _inspect_namespace(ns_dir: Path, now: float, fs: FileOps) -> NamespaceInfo:
    info = NamespaceInfo(ns_dir.name)
    try:
        index = BlockIndex(ns_dir / INDEX_FILENAME, create=False)
    except sqlite3.Error as exc:
        info.status, info.message = "unreadable", f"cannot open index: {exc}"
        return info
    try:
        if not index.initialized():
            info.status, info.message = "uninitialized", "namespace creation interrupted or in progress: empty"
            return info
        meta = index.get_meta()
        rows = list(index.rows())  # rows before files: a row never precedes its file
        _fill_meta(info, meta)
        _fill_rows(info, rows, now)
        _fill_health(info, index, rows, ns_dir, fs)
    except sqlite3.Error as exc:
        info.status, info.message = "unreadable", f"index error: {exc}"
    except OSError as exc:
        info.status, info.message = "unreadable", f"cannot list files: {exc.strerror or exc}"
    finally:
        index.close()
    if info.status == "ok" and (info.format_version != str(blockfile.FORMAT_VERSION) or info.layout_key != ns_dir.name):
        info.status = "unknown_format"
        info.message = f"format_version {info.format_version!r}, layout {info.layout_key!r}: not usable by this kvtool"
    return info


def _fill_meta(info: NamespaceInfo, meta: dict[str, str]) -> None:
    info.model_id, info.model_name = meta.get("model_id"), meta.get("model_name")
    info.layout_key, info.kv_dtype = meta.get("layout_key"), meta.get("kv_dtype")
    info.format_version = meta.get("format_version")
    for name in ("block_size", "n_layers", "n_kv_heads", "head_dim"):
        setattr(info, name, _to_num(meta.get(name), int))
    for name in ("created", "last_open", "last_close"):
        setattr(info, name, _to_num(meta.get(name), float))
    if "shutdown_clean" in meta:
        info.shutdown_clean = meta["shutdown_clean"] == "1"
    if "shutdown_partial_flush" in meta:
        info.shutdown_partial_flush = meta["shutdown_partial_flush"] == "1"


def _to_num(text: str | None, kind: type):
    try:
        return kind(text) if text is not None else None
    except ValueError:
        return None


def _fill_rows(info: NamespaceInfo, rows: list[IndexRow], now: float) -> None:
    info.blocks, info.bytes = len(rows), sum(r.nbytes for r in rows)
    if not rows:
        return
    times = [r.last_access for r in rows]
    info.oldest_access, info.newest_access = min(times), max(times)
    for t in times:
        age = now - t
        label = next(label for label, bound in AGE_BUCKETS if age < bound)
        info.age_histogram[label] += 1


def _fill_health(info: NamespaceInfo, index: BlockIndex, rows: list[IndexRow], ns_dir: Path, fs: FileOps) -> None:
    scan = scan_namespace(ns_dir, fs)
    indexed = {r.hash for r in rows}
    missing = [h for h in indexed if h not in scan.files and not fs.exists(ns_dir / block_relpath(h))]
    orphans = [h for h in scan.files if h not in indexed]
    if orphans:  # a writer may have added the file and then its row since the row snapshot
        orphans = [h for h in orphans if h not in index.present(orphans)]
    info.health = Health(len(rows), len(scan.files), len(missing), len(orphans), len(scan.temps))
    info.health.ok = not missing and not orphans


# ----------------------------------------------------------------------------- prompt probe
@dataclass
class PromptProbe:
    """Would a prompt hit the SSD tier? Token counts in tokens.

    Attributes:
        namespace: the layout key this model and block size use.
        namespace_exists: the cache holds that namespace.
        block_size: tokens per block.
        prompt_tokens: tokens in the prompt.
        full_blocks: full blocks in the prompt (only those are ever cached).
        cached_blocks: leading full blocks present in the index.
        cached_tokens: `cached_blocks * block_size`: prompt tokens whose KV is on SSD.
        reused_tokens: what a following request would report as `cached_tokens`
            (one less on a full hit: the last prompt token is re-forwarded).
        would_hit: at least one block is cached.
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

    def to_dict(self) -> dict:
        """JSON-ready document (see docs/OPS.md)."""
        return asdict(self)


def probe_prompt(cache_dir: Path, layout_key: str, block_size: int, hashes: Sequence[str], prompt_tokens: int) -> PromptProbe:
    """Count the leading blocks of a prompt present in a namespace index (no block is read).

    Args:
        cache_dir: the SSD tier root.
        layout_key: the namespace of the model, dtype and block size.
        block_size: tokens per block.
        hashes: the prompt's chain hashes (`kvtool.blocks.chain_hashes`).
        prompt_tokens: tokens in the prompt.

    Returns:
        The probe.

    Raises:
        InspectError: `cache_dir` is not a directory, or the index cannot be read.
    """
    fs = FileOps()
    if not fs.is_dir(Path(cache_dir)):
        raise InspectError(f"cache directory {cache_dir} does not exist or is not a directory")
    db = Path(cache_dir) / layout_key / INDEX_FILENAME
    exists, cached = fs.exists(db), 0
    if exists:
        try:
            index = BlockIndex(db, create=False)
            try:
                cached = index.count_prefix(list(hashes))
            finally:
                index.close()
        except sqlite3.Error as exc:
            raise InspectError(f"cannot read {db}: {exc}") from None
    cached_tokens = cached * block_size
    reused = cached_tokens - 1 if cached_tokens and cached_tokens == prompt_tokens else cached_tokens
    return PromptProbe(layout_key, exists, block_size, prompt_tokens, len(hashes), cached, cached_tokens, reused, cached > 0)


__all__ = [
    "inspect_cache", "probe_prompt", "select_namespaces", "InspectReport", "NamespaceInfo", "Health",
    "PromptProbe", "InspectError", "AGE_BUCKETS",
]  # fmt: skip
