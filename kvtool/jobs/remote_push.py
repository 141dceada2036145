"""Push an SSD namespace's blocks to the remote tier (`kvtool remote push`, `kvtool warm --to-remote`).

Every segment the index lists is opened once (regular files only, never following a symlink:
`FileOps.open_read`), its header checked against the namespace, and each record read and
verified (`segment.read_block`: checksum over the whole record) before it is stored remotely
with `SET NX` (`RemoteStore.put_blocks`: a block the server holds already is not rewritten).
A record that fails verification is skipped and counted, never pushed; the SSD tier is not
changed (that is `kvtool validate`'s job). Blocks go out in batches of about `BATCH_BYTES`.

This module never imports MLX.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvtool.disk import segment as seg
from kvtool.disk.fsops import FileOps
from kvtool.disk.index import BlockIndex
from kvtool.disk.kvlayout import KVLayout
from kvtool.disk.names import INDEX_FILENAME, segment_relpath

BATCH_BYTES = 8 << 20  # host bytes per put_blocks call


@dataclass
class PushReport:
    """What a push did (block counts in blocks, sizes in bytes).

    Attributes:
        namespace: the layout key pushed.
        segments: segment files read.
        blocks_read: verified blocks read from SSD.
        blocks_stored: blocks the server stored (new keys; existing ones are not counted).
        bytes_read: record bytes read.
        bad_records: records that failed verification (skipped).
        unreadable_segments: segment files missing, unreadable or of another namespace.
    """

    namespace: str
    segments: int = 0
    blocks_read: int = 0
    blocks_stored: int = 0
    bytes_read: int = 0
    bad_records: int = 0
    unreadable_segments: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def open_store_for(namespace_dir: Path, url: str, *, timeout_s: float, cluster: bool | None = None):
    """A `RemoteStore` for the namespace at `namespace_dir` (its layout and codec from the index).

    Raises:
        ValueError: not a kvtool namespace (no index meta); RemoteURLError: a malformed URL.
    """
    from kvtool.tiers.remote_store import RemoteStore

    index = BlockIndex(namespace_dir / INDEX_FILENAME, read_only=True, create=False)
    try:
        meta = index.get_meta()
    finally:
        index.close()
    if "kv_layers" not in meta or "kv_dtype" not in meta:
        raise ValueError(f"{namespace_dir} is not a kvtool namespace (no layout in its index)")
    kv = KVLayout.parse(meta["kv_layers"], meta["kv_dtype"])
    return RemoteStore(url, namespace_dir.name, kv, meta.get("kv_codec", "none"), timeout_s=timeout_s, cluster=cluster)


def push_namespace(namespace_dir: Path, store, *, progress: Callable[[int, int], None] | None = None) -> PushReport:
    """Push every verified block of the SSD namespace at `namespace_dir` to `store`.

    Args:
        namespace_dir: `<cache_dir>/<layout key>`.
        store: a `RemoteStore` of the same layout key (`open_store_for`).
        progress: called as `progress(segments_done, segments_total)`.

    Returns:
        A `PushReport`. Never raises for a bad segment or record (counted instead).
    """
    layout_key = namespace_dir.name
    report = PushReport(layout_key)
    index = BlockIndex(namespace_dir / INDEX_FILENAME, read_only=True, create=False)
    try:
        names = [s.name for s in index.segments()]
    finally:
        index.close()
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
            seg.check_header(header, layout_key, header.kv)
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
                    report.blocks_stored += store.put_blocks(batch)
                    batch, size = [], 0
            report.segments += 1
        except (OSError, seg.BlockFileError):
            report.unreadable_segments.append(name)
        finally:
            os.close(fd)
        if progress is not None:
            progress(i + 1, len(names))
    if batch:
        report.blocks_stored += store.put_blocks(batch)
    return report


__all__ = ["PushReport", "push_namespace", "open_store_for", "BATCH_BYTES"]
