"""What every block writer shares (`WriterBase`: the sink, the retry policy, the `writer_*`
counters), and `SyncWriter`, which saves each batch on the caller's thread (`ssd_async_writes =
false`). The background writer is `kvtool.tiers.writer.AsyncWriter`; both are made by
`kvtool.tiers.writer.make_writer`. MLX-free.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from kvtool.tiers.writer_batch import DEFAULT_MAX_RETRIES, DEFAULT_RETRY_BACKOFF_S, Counters, RetryPolicy

if TYPE_CHECKING:
    from kvtool.disk.hostblock import HostBlock

DEFAULT_DRAIN_TIMEOUT_S = 30.0  # the one drain timeout (writer stop, tier close)
DEFAULT_FLUSH_TIMEOUT_S = 60.0


class BlockSink(Protocol):
    """What a writer needs from `SSDStore`: `save_blocks` (one call per batch, one outcome per
    block, in order), `enabled` and `stats`."""

    enabled: bool

    def save_blocks(self, blocks: Sequence[HostBlock]) -> list[str]: ...

    def stats(self) -> dict: ...


class WriterBase:
    """State and stats common to both writers."""

    def __init__(self, store: BlockSink, policy: RetryPolicy) -> None:
        self._store = store
        self._policy = policy
        self._counters = Counters()

    @property
    def durability(self) -> str:
        return self._policy.durability

    def _store_enabled(self) -> bool:
        """A store that can take writes: enabled and not read-only (a read-only cache would
        answer 'error' to every block, and retrying that is only latency)."""
        return bool(getattr(self._store, "enabled", True)) and not getattr(self._store, "read_only", False)

    def _save(self, blocks: list[HostBlock], abort: threading.Event | None = None) -> list[str]:
        """Save a batch (the retry policy's `save_batch`), counting the CPU time it took on the
        thread that ran it (`writer_cpu_us`: the writer's own, or the caller's for a sync save)."""
        started = time.thread_time()
        try:
            return self._policy.save_batch(self._store, blocks, self._counters, abort)
        finally:
            self._counters.inc("writer_cpu_us", round((time.thread_time() - started) * 1e6))

    def enqueue(self, block: HostBlock, *, must_write: bool = False) -> bool:
        """`enqueue_many([block], must_write=must_write) == 1`: True if `block` was accepted."""
        return self.enqueue_many([block], must_write=must_write) == 1

    def enqueue_many(self, blocks: Sequence[HostBlock], *, must_write: bool = False) -> int:  # pragma: no cover
        raise NotImplementedError

    def get_stats(self) -> dict[str, int]:
        """Snapshot of the `writer_*` counters (blocks, bytes where named) plus the gauges
        `writer_queue_depth` (blocks), `writer_pending` (blocks), `writer_pending_bytes` and
        `writer_queue_peak_bytes` (bytes)."""
        stats: dict[str, Any] = self._counters.snapshot()
        stats["writer_queue_depth"] = self.queue_depth()
        stats["writer_pending"] = self._pending_count()
        stats["writer_pending_bytes"] = self.pending_bytes()
        stats["writer_queue_peak_bytes"] = self.queue_peak_bytes()
        return stats

    # a writer without a queue (`SyncWriter`): nothing queued, nothing pending
    def queue_peak_bytes(self) -> int:
        return 0

    def queue_depth(self) -> int:
        return 0

    def _pending_count(self) -> int:
        return 0

    def pending_bytes(self) -> int:
        return 0


def unique_blocks(blocks: Sequence[HostBlock], skip: Callable[[str], bool] = lambda h: False) -> list[HostBlock]:
    """`blocks` in order without repeated hashes, nor hashes for which `skip` is true."""
    seen: set[str] = set()
    out = []
    for b in blocks:
        if b.block_hash not in seen and not skip(b.block_hash):
            seen.add(b.block_hash)
            out.append(b)
    return out


class SyncWriter(WriterBase):
    """Writes each batch on the caller's thread, with the same retry policy as `AsyncWriter`."""

    def __init__(
        self,
        store: BlockSink,
        durability: str = "best_effort",
        max_retries: int = DEFAULT_MAX_RETRIES,
        retry_backoff_s: float = DEFAULT_RETRY_BACKOFF_S,
        *,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        super().__init__(store, RetryPolicy(durability, max_retries, retry_backoff_s, sleep))
        self._closed = False

    def enqueue_many(self, blocks: Sequence[HostBlock], *, must_write: bool = False) -> int:
        """Save `blocks` now with one `save_blocks` call (retries included).

        Args:
            blocks: the batch, in write order; a hash repeated in it is saved once (the
                repeats count as `writer_enqueue_dedup_skip`).
            must_write: accepted for interface parity with `AsyncWriter`; every batch is
                written here anyway (nothing is ever shed).

        Returns:
            How many blocks were accepted (and attempted); 0 if stopped or the store is disabled.
        """
        blocks = list(blocks)
        if not blocks:
            return 0
        if self._closed or not self._store_enabled():
            self._counters.inc("writer_enqueue_rejected", len(blocks))
            return 0
        batch = unique_blocks(blocks)
        if len(batch) < len(blocks):
            self._counters.inc("writer_enqueue_dedup_skip", len(blocks) - len(batch))
        self._counters.inc("writer_enqueue_total", len(batch))
        self._save(batch)
        return len(batch)

    def get_pending(self, block_hash: str) -> HostBlock | None:
        """Nothing is ever pending: always None."""
        return None

    def pending_children(self, parent_hash: str, limit: int) -> list[HostBlock]:
        """Nothing is ever pending: always []."""
        return []

    def flush(self, timeout: float | None = DEFAULT_FLUSH_TIMEOUT_S) -> bool:
        """Every accepted block has been attempted already: True."""
        return True

    def stop(self, drain_timeout: float = DEFAULT_DRAIN_TIMEOUT_S) -> bool:
        """Refuse further blocks; True (nothing to drain). Idempotent."""
        self._closed = True
        return True


__all__ = ["DEFAULT_DRAIN_TIMEOUT_S", "DEFAULT_FLUSH_TIMEOUT_S", "BlockSink", "SyncWriter", "WriterBase", "unique_blocks"]
