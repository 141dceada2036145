"""The SSD tier as a `BlockTier`: a namespace on disk (`kvtool.disk.namespace.SSDStore`) and the
writer that fills it (`kvtool.tiers.writer`), plus its pending buffer (`PendingTier`).

Reads: index rows on lookup (one query for the rest of a chain), records restored and verified
(header, slot, parent, exact token ids, checksum) straight into the request's buffers by reader
threads (`kvtool.disk.restore`); a bad record is a miss, dropped, and cuts the chain.
Writes: host copies of the blocks to the writer in batches of at most `WRITE_BATCH_BYTES` (each
becomes one segment); a full queue sheds a batch (best_effort, persistent) or waits (durable,
and `Put.PERSIST`, which a caller promised to the disk). Durability: docs/design.md#durability-modes.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvtool.disk import restore
from kvtool.disk.fsops import FileOps
from kvtool.disk.hostblock import HostBlock
from kvtool.disk.namespace import SSDStore
from kvtool.kv.blocks import Block, to_host_many
from kvtool.tiers.base import BlockTier, Caps, ChainEntry, Counts, Put, ReadResult, TierBase, WritePolicy
from kvtool.tiers.pending import PendingTier
from kvtool.tiers.writer import Writer, make_writer

log = logging.getLogger("kvtool")

MAX_SSD_SIBLINGS = 4  # SSD siblings read and verified per partial-block lookup (most recently used first)
WRITE_BATCH_BYTES = 64 << 20  # = the store's segment size cap


class SsdBlockTier(TierBase):
    """`BlockTier` over an `SSDStore` and its writer.

    Args:
        ssd: the namespace's store.
        writer: its writer (None: read side only, e.g. `PrefixCache.probe`).
        policy: `THROUGH` (`ssd_policy = write_through`) or `ON_EVICT` (`evict_only`).
        takes_promotions: verified hits of the tiers below (remote) are written here too
            (`remote_promote`).
    """

    name = "ssd"
    caps = Caps(persistent=True, backs_ram=True)

    def __init__(self, ssd: SSDStore, writer: Writer | None = None, policy: WritePolicy = WritePolicy.OFF,
                 takes_promotions: bool = False):  # fmt: skip
        self.ssd, self.writer = ssd, writer
        self.policy = policy if writer is not None else WritePolicy.OFF
        self.takes_promotions = takes_promotions and writer is not None
        self._counts = Counts("kv_write_through_enqueued", "kv_evict_to_ssd", "kv_remote_promoted_to_ssd")

    def longest_prefix(self, chain: Sequence[ChainEntry], ids: np.ndarray) -> list[Any]:
        return self.ssd.lookup([e.hash for e in chain])

    def find_any(self, cands: Sequence[tuple[str, int]], ids: np.ndarray, start: int) -> tuple[Any, str, int] | None:
        rows = self.ssd.rows_of([h for h, _ in cands])
        return next(((rows[h], h, k) for h, k in cands if h in rows), None)

    def sibling_candidates(self, parent: str, skip: set[str]) -> Iterator[tuple[HostBlock, int]]:
        for row in self.ssd.children(parent, MAX_SSD_SIBLINGS):
            if row.hash in skip:
                continue
            block = self.ssd.read_row(row, parent)  # read whole and verified
            if block is not None:
                yield block, row.nbytes

    def sibling_used(self, key: str, nbytes: int) -> None:
        """A sibling read from here served a hit: touch its row, count the load (bytes)."""
        self.ssd.record_hits([key], nbytes)

    def read_into(self, chain, handles, ids, buffers) -> ReadResult:
        res = restore.restore_chain(self.ssd, handles, chain[0].parent, ids, [e.start for e in chain],
                                    buffers.pieces, ready=buffers.ready, place=buffers.place_records)
        return ReadResult(res.n_ok, res.bytes_read)

    def touch(self, hashes: list[str]) -> None:
        """RAM hits on blocks also held here: touch their rows (batched), so prune's TTL / LRU
        view of hot blocks stays current."""
        self.ssd.touch_many(hashes)

    # ------------------------------------------------------------------ writes
    def put(self, blocks: Sequence[Block], why: Put) -> int:
        if self.writer is None or not blocks:
            return 0
        accepted = self._send(blocks, must_write=why is Put.PERSIST)
        if why is Put.NEW:
            self._counts.inc("kv_write_through_enqueued", len(blocks))
        elif why is Put.EVICTED:
            self._counts.inc("kv_evict_to_ssd", len(blocks))
        elif why is Put.PROMOTED:
            self._counts.inc("kv_remote_promoted_to_ssd", accepted)
        return accepted

    def _send(self, blocks: Sequence[Block], must_write: bool) -> int:
        """Host copies of the blocks, handed to the writer in batches of at most
        `WRITE_BATCH_BYTES` (a batch never exceeds the writer's queue). Returns how many blocks
        the writer accepted (none from a read-only or disabled store)."""
        accepted = 0
        try:
            writer = self.writer
            assert writer is not None  # put checks it
            batch: list[HostBlock] = []
            size = 0
            for b, host in zip(blocks, to_host_many(blocks)):
                if batch and size + b.nbytes > WRITE_BATCH_BYTES:
                    accepted += writer.enqueue_many(batch, must_write=must_write)
                    batch, size = [], 0
                batch.append(host)
                size += b.nbytes
            if batch:
                accepted += writer.enqueue_many(batch, must_write=must_write)
        except Exception:  # the cache must never fail a request
            log.exception("SSD write of %d block(s) failed", len(blocks))
        return accepted

    def remove(self, hashes: Sequence[str]) -> int:
        return self.ssd.remove(hashes)

    def stats(self) -> dict[str, int]:
        out = {**self._counts.snapshot(), **self.ssd.stats()}
        if self.writer is not None:
            out.update(self.writer.get_stats())
        return out

    def flush(self, timeout_s: float) -> bool:
        ok = self.writer.flush(timeout_s) if self.writer is not None else True
        self.ssd.flush()
        return ok

    def close(self, timeout_s: float) -> bool:
        """Drain the writer, then close the index (a writer that did not stop in time leaves a
        partial flush: `validate` reconciles the cache)."""
        clean = True
        if self.writer is not None and not self.writer.stop(timeout_s):
            clean = False
            log.critical("SSD writer did not stop cleanly; validate will reconcile the cache")
        self.ssd.close(clean, not clean)
        return clean


def open_ssd(config: Any, layout_key: str, meta: dict[str, str], fs: FileOps | None = None) -> list[BlockTier]:
    """The SSD tiers of a namespace when `config.ssd_enabled`: the writer's pending buffer, then
    the store (`[]` otherwise)."""
    if not config.ssd_enabled:
        return []
    ssd = SSDStore(Path(config.ssd_cache_dir), layout_key, meta, durability=config.ssd_durability,
                   flush_interval_s=config.ssd_flush_interval_s, fs=fs,
                   dir_mode=getattr(config, "ssd_dir_mode", 0o700))  # fmt: skip
    writer = make_writer(ssd, config)
    policy = WritePolicy.THROUGH if config.ssd_policy == "write_through" else WritePolicy.ON_EVICT
    return [PendingTier(writer), SsdBlockTier(ssd, writer, policy, takes_promotions=bool(config.remote_promote))]


__all__ = ["MAX_SSD_SIBLINGS", "WRITE_BATCH_BYTES", "SsdBlockTier", "open_ssd"]
