"""Push an SSD namespace's blocks to the remote tier (`kvtool remote push`, `kvtool warm --to-remote`).

Every segment the index lists is opened once (regular files only, never following a symlink:
`FileOps.open_read`), its header checked against the namespace, and each record read and
verified (`segment.read_block`: checksum over the whole record) before it is stored remotely
with `SET NX` (`RemoteStore.save_blocks`: a block the server holds already is not rewritten).
A record that fails verification is skipped and counted, never pushed; the SSD tier is not
changed (that is `kvtool validate`'s job). Blocks go out in batches of about `BATCH_BYTES`; each
block's outcome is counted (stored, there already, refused by the server), and a call that fails
(the server gone, timed out) stops the push: `PushStopped`, carrying what was done.

This module never imports MLX.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TypeVar

from kvtool.disk import segment as seg
from kvtool.disk.fsops import FileOps
from kvtool.disk.index import BlockIndex
from kvtool.disk.kvlayout import KVLayout
from kvtool.disk.names import INDEX_FILENAME, segment_relpath
from kvtool.disk.snapshot import read_quietly
from kvtool.errors import KVToolError

BATCH_BYTES = 8 << 20  # host bytes per save_blocks call
T = TypeVar("T")


class PushStopped(KVToolError):
    """The server failed during a push (connection lost or refused, timed out): the push stopped
    there (exit 2). `report` says what was done before."""

    def __init__(self, message: str, report: PushReport):
        super().__init__(message)
        self.report = report


@dataclass
class PushReport:
    """What a push did (block counts in blocks, sizes in bytes).

    Attributes:
        namespace: the layout key pushed.
        segments: segment files read.
        blocks_read: verified blocks read from SSD.
        blocks_stored: blocks the server stored (new keys).
        blocks_existing: blocks the server held already (not rewritten).
        blocks_failed: blocks read but not stored: refused by the server (e.g. out of memory
            under `maxmemory-policy noeviction`), or in a call that failed.
        bytes_read: record bytes read.
        bad_records: records that failed verification (skipped).
        unreadable_segments: segment files missing, unreadable or of another namespace.
        error: the namespace's index could not be read (nothing pushed), or the server's last
            failure or refusal; None if there was none.
        stopped: the server failed during the push, which stopped there.
    """

    namespace: str
    segments: int = 0
    blocks_read: int = 0
    blocks_stored: int = 0
    blocks_existing: int = 0
    blocks_failed: int = 0
    bytes_read: int = 0
    bad_records: int = 0
    unreadable_segments: list[str] = field(default_factory=list)
    error: str | None = None
    stopped: bool = False

    @property
    def problems(self) -> int:
        """Bad records, unreadable segments, blocks not stored, and an unreadable index (as 1)."""
        unreadable_index = self.error is not None and not (self.blocks_failed or self.stopped)
        return self.bad_records + len(self.unreadable_segments) + self.blocks_failed + unreadable_index

    def to_dict(self) -> dict:
        return asdict(self)


def _read_index(namespace_dir: Path, read: Callable[[BlockIndex], T]) -> T:
    """`read(index)` on the namespace's index, opened read-only (`snapshot.read_quietly`).

    Raises:
        ValueError: the index cannot be read (missing, not a database, damaged, not a file).
    """
    try:
        return read_quietly(namespace_dir / INDEX_FILENAME, read)  # (no -wal / -shm made beside it)
    except (OSError, sqlite3.Error) as exc:
        raise ValueError(f"{namespace_dir.name}: index cannot be read ({exc}); `kvtool validate --rebuild-index` "
                         "rebuilds it") from None


def open_store_for(namespace_dir: Path, url: str, *, timeout_s: float, cluster: bool | None = None):
    """A `RemoteStore` for the namespace at `namespace_dir` (its layout and codec from the index).

    Raises:
        ValueError: not a kvtool namespace (no index meta, an index that cannot be read);
            RemoteURLError: a malformed URL.
    """
    from kvtool.tiers.remote_store import RemoteStore

    meta = _read_index(namespace_dir, lambda index: index.get_meta())
    if "kv_layers" not in meta or "kv_dtype" not in meta:
        raise ValueError(f"{namespace_dir} is not a kvtool namespace (no layout in its index)")
    kv = KVLayout.parse(meta["kv_layers"], meta["kv_dtype"])
    return RemoteStore(url, namespace_dir.name, kv, meta.get("kv_codec", "none"), timeout_s=timeout_s, cluster=cluster)


def _store(store, batch: list, report: PushReport) -> None:
    """Store `batch` (`save_blocks`: SET NX), its outcomes counted into `report`.

    Raises:
        PushStopped: the call failed (the server is gone or timed out).
    """
    dropped = store.stats()["remote_dropped_writes"]
    outcomes = store.save_blocks(batch)
    report.blocks_stored += outcomes.count("saved")
    report.blocks_existing += outcomes.count("dedup")
    report.blocks_failed += outcomes.count("error")
    if outcomes.count("error"):
        report.error = store.last_error
    if store.stats()["remote_dropped_writes"] > dropped:
        report.stopped = True
        raise PushStopped(f"remote push of {report.namespace} stopped after {report.blocks_stored} new block(s) "
                          f"stored: {store.last_error}", report)


def push_namespace(namespace_dir: Path, store, *, progress: Callable[[int, int], None] | None = None) -> PushReport:
    """Push every verified block of the SSD namespace at `namespace_dir` to `store`.

    Args:
        namespace_dir: `<cache_dir>/<layout key>`.
        store: a `RemoteStore` of the same layout key (`open_store_for`).
        progress: called as `progress(segments_done, segments_total)`.

    Returns:
        A `PushReport`. Never raises for a bad segment or record (counted instead).

    Raises:
        ValueError: the namespace's index cannot be read.
        PushStopped: the server failed during the push (its `report` says what was done).
    """
    report = PushReport(namespace_dir.name)
    names = _read_index(namespace_dir, lambda index: [s.name for s in index.segments()])
    fs = FileOps()
    batch: list = []
    size = 0
    for i, name in enumerate(names):
        try:
            fd = fs.open_read(namespace_dir / segment_relpath(name))
        except (OSError, ValueError):
            report.unreadable_segments.append(name)
            continue
        try:
            header = seg.read_header(fd, os.fstat(fd).st_size)
            seg.check_header(header, report.namespace, header.kv)
            for slot in header.slots:
                try:
                    block = seg.read_block(fd, slot, header.kv)
                except seg.BlockFileError:
                    report.bad_records += 1
                    continue
                report.blocks_read += 1
                report.bytes_read += slot.nbytes
                batch.append(block)
                size += block.nbytes
                if size >= BATCH_BYTES:
                    _store(store, batch, report)
                    batch, size = [], 0
            report.segments += 1
        except (OSError, seg.BlockFileError):
            report.unreadable_segments.append(name)
        finally:
            os.close(fd)
        if progress is not None:
            progress(i + 1, len(names))
    if batch:
        _store(store, batch, report)
    return report


__all__ = ["PushReport", "PushStopped", "push_namespace", "open_store_for", "BATCH_BYTES"]
