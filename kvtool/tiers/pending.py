"""The SSD writer's pending buffer as a `BlockTier`: blocks the writer accepted and has not written
yet (host arrays), a hit like SSD. It is filled by the SSD tier's writes (`SsdBlockTier.put`), so
the stack never writes it (`WritePolicy.OFF`); its blocks reach the SSD tier when the writer
saves them."""

from __future__ import annotations

import numpy as np

from kvtool.disk.hostblock import HostBlock
from kvtool.tiers.base import Caps, Counts, MemoryTier, ReadResult
from kvtool.tiers.ram import MAX_MEMORY_SIBLINGS
from kvtool.tiers.writer import Writer


class PendingTier(MemoryTier):
    """`BlockTier` over a writer's pending buffer (`Writer.get_pending`, `pending_children`):
    exact token ids compared on lookup; hits counted `kv_pending_hits` (blocks).

    Args:
        writer: the SSD tier's writer (a `SyncWriter` has nothing pending: every lookup misses).
    """

    name = "ssd"
    caps = Caps(verifies_on_read=False, removes=False)

    def __init__(self, writer: Writer):
        self.writer = writer
        self._counts = Counts("kv_pending_hits")
        self._closed = False  # the writer is the SSD tier's to stop: after close, lookups miss

    def _get(self, h: str, expected: np.ndarray) -> HostBlock | None:
        host = None if self._closed else self.writer.get_pending(h)
        if host is None or not np.array_equal(host.token_ids, expected):
            return None
        self._counts.inc("kv_pending_hits")
        return host

    def read_into(self, chain, handles, ids, buffers) -> ReadResult:
        buffers.ready()
        for e, host in zip(chain, handles):
            buffers.place_host(e.start, host)
        return ReadResult(len(handles))

    def _children(self, parent: str) -> list[HostBlock]:
        return [] if self._closed else self.writer.pending_children(parent, MAX_MEMORY_SIBLINGS)

    def stats(self) -> dict[str, int]:
        return self._counts.snapshot()

    def close(self, timeout_s: float) -> bool:
        self._closed = True
        return True


__all__ = ["PendingTier"]
