"""What `kvtool.ops.scan.scan_cache` returns: frozen, typed results (`CacheScan`, `NamespaceScan`,
`SegmentFile`, `TempFile`) and the statuses every command shares (`NamespaceStatus`; the
module docstring of `kvtool.ops.scan` says what each means).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from functools import cached_property
from pathlib import Path
from types import MappingProxyType

from kvtool.disk.chains import ChainTree, Forest, build_forest, hex_of_keys, key_of_hex
from kvtool.disk.namespace_core import Expected
from kvtool.disk.rowtable import RowTable, SegmentRow
from kvtool.errors import KVToolError
from kvtool.hashing import root_parent

REBUILD_HINT = "`kvtool validate --rebuild-index` rebuilds it from the segment files"
OUTDATED_HINT = "re-warm; `kvtool prune` removes them"


class NamespaceStatus(StrEnum):
    """What a namespace is, for every command (see the module docstring)."""

    OK = "ok"
    EMPTY = "empty"
    UNINITIALIZED = "uninitialized"
    UNREADABLE = "unreadable"
    OUTDATED = "outdated"
    FOREIGN = "foreign"


USABLE = (NamespaceStatus.OK, NamespaceStatus.EMPTY)


class ScanError(KVToolError):
    """The cache cannot be scanned: missing cache dir, unknown or ambiguous namespace (exit 2)."""


@dataclass(frozen=True, slots=True)  # no __dict__: one per row or file, by the million
class SegmentFile:
    """A segment file on disk (name and place checked, never followed).

    Attributes:
        name: segment name (32 hex).
        relpath: `<name[:2]>/<name>.safetensors`, relative to the namespace directory.
        size: bytes (lstat).
        mtime: modification time (unix seconds): a segment is written once, so its creation.
    """

    name: str
    relpath: str
    size: int
    mtime: float


@dataclass(frozen=True, slots=True)  # no __dict__: one per row or file, by the million
class TempFile:
    """A kvtool temp file (`.<name>.<pid>.<hex>.tmp`): a write in progress or a leftover.

    Attributes:
        relpath: path relative to the namespace directory.
        size: bytes.
        leftover: its writer is gone (or it is stale): `validate` removes it.
    """

    relpath: str
    size: int
    leftover: bool


@dataclass(frozen=True)
class NamespaceScan:
    """One namespace as scanned (read-only snapshot). Sizes in bytes, times in unix seconds.

    Attributes:
        name: directory name (the layout key).
        path: the namespace directory.
        status: see `NamespaceStatus`.
        message: why the status is not `ok`/`empty` (one line), else "".
        cause: for `unreadable`: 'index' (corrupt or unreadable index), 'link' (an index file is
            a symlink or not a regular file), 'disk_full' (the index cannot be opened on a full
            disk), 'listing' (the directory cannot be listed); else "".
        meta: the index's meta table ({} if unreadable).
        format_version: meta `format_version` (None if unknown).
        expected: the KV layout and block size blocks must have (usable namespaces only).
        table: the well-formed block rows as columns (`RowTable`, by hash); None when not read
            (`rows=False`, or the index could not be read). `rows` is the same, or ().
        row_count: well-formed block rows (also when only counted).
        segment_rows: well-formed `segments` rows.
        bad_rows, bad_segment_rows: rowids of malformed rows (NULLs, wrong types, bad names).
        files: segment name -> `SegmentFile` for well-named segment files.
        temps: kvtool temp files.
        symlinks: relative paths of symlinks found inside (never followed).
        irregular: relative paths of entries under a segment or temp file name that are not
            regular files (a FIFO, socket, device or directory): never opened; `validate`
            removes them (directories are only reported).
        other: relative paths of entries that are not kvtool's (ignored).
        missing: segments named by a row whose file is absent (sorted; an irregular entry
            under its name is not absent: its rows are corrupt).
        orphans: segment files no block row names (sorted).
        future_rows: hashes whose `last_access` is in the future (beyond the skew allowance).
        last_used: newest sign of use (index file mtimes, meta open/close times), clamped to now.
        now: the scan time (access times are clamped to it in the chain tree).
        forest: the chain forest of the rows (row `i` is node `i`; built on first use).
        tree: the same by hash (`ChainTree`; one object per block when its nodes are used).
    """

    name: str
    path: Path
    status: NamespaceStatus
    message: str = ""
    cause: str = ""
    meta: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    format_version: str | None = None
    expected: Expected | None = None
    table: RowTable | None = None
    row_count: int = 0
    segment_rows: tuple[SegmentRow, ...] = ()
    bad_rows: tuple[int, ...] = ()
    bad_segment_rows: tuple[int, ...] = ()
    files: Mapping[str, SegmentFile] = field(default_factory=lambda: MappingProxyType({}))
    temps: tuple[TempFile, ...] = ()
    symlinks: tuple[str, ...] = ()
    irregular: tuple[str, ...] = ()
    other: tuple[str, ...] = ()
    missing: tuple[str, ...] = ()
    orphans: tuple[str, ...] = ()
    future_rows: tuple[str, ...] = ()
    last_used: float | None = None
    now: float = 0.0

    @property
    def usable(self) -> bool:
        """`ok` or `empty`: commands may read and change it."""
        return self.status in USABLE

    @property
    def rows(self) -> RowTable | tuple[()]:
        """The well-formed block rows (`table`; () when not read). Iterating makes `IndexRow`s."""
        return self.table if self.table is not None else ()

    @property
    def bytes(self) -> int:
        """Bytes of the segment files that rows name (what the blocks occupy)."""
        named = self.table.segment_numbers if self.table is not None else {}
        return sum(f.size for n, f in self.files.items() if n in named)

    @property
    def file_bytes(self) -> int:
        """Bytes of every segment file (orphans included)."""
        return sum(f.size for f in self.files.values())

    @cached_property
    def forest(self) -> Forest | None:
        """The chain forest of `table` (access times clamped to `now`), None without rows read."""
        t = self.table
        if t is None or not self.usable:
            return None
        root = key_of_hex(root_parent(self.name))
        at_root = (t.parent[:, 0] == root[0]) & (t.parent[:, 1] == root[1])
        return build_forest(t.parent_rows(), at_root, t.last_access, self.now)

    @cached_property
    def tree(self) -> ChainTree | None:
        """`forest` by hash (the hashes are made on first use of its nodes)."""
        if self.table is None or self.forest is None:
            return None
        t = self.table
        return ChainTree(root_parent(self.name), t.hashes, lambda: hex_of_keys(t.parent), self.forest)


@dataclass(frozen=True)
class CacheScan:
    """A whole cache as scanned.

    Attributes:
        cache_dir: the cache root.
        now: the scan time (ages and clamps are relative to it).
        namespaces: one scan per namespace directory (real 32-hex directories with an index).
        symlinks: names of symlinks directly under the cache root (never followed).
        other: names of other entries directly under the cache root (not kvtool's).
    """

    cache_dir: Path
    now: float
    namespaces: tuple[NamespaceScan, ...] = ()
    symlinks: tuple[str, ...] = ()
    other: tuple[str, ...] = ()


__all__ = [
    "REBUILD_HINT", "OUTDATED_HINT", "NamespaceStatus", "USABLE", "ScanError", "SegmentFile", "TempFile", "NamespaceScan", "CacheScan",
]  # fmt: skip
