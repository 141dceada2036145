"""The tiered cache: RAM over SSD for one namespace (layout key).

The prefix walk itself lives in `kvtool.cache.prefix.PrefixCache`; this layer owns the tiers: RAM
blocks and the writer's pending buffer (queued, not yet on disk) are checked against the
request's token ids (a mismatch is a miss), SSD blocks are restored in batches, and restored
blocks are promoted into RAM as views of the request's cache.

Policies (docs/design.md#tier-policies): `write_through` sends every new block to RAM and to the SSD writer;
`evict_only` (write-back) sends a block to the writer only when RAM evicts it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvtool.config import KVToolConfig
from kvtool.disk.fsops import FileOps
from kvtool.disk.hostblock import HostBlock
from kvtool.disk.namespace import SSDStore
from kvtool.kv.blocks import Block, to_host
from kvtool.tiers.protocol import BlockTier, PendingTier, RamBlockTier, SsdBlockTier
from kvtool.tiers.ram import RamTier
from kvtool.tiers.remote import RemoteBlockTier, open_remote
from kvtool.tiers.writer import DEFAULT_DRAIN_TIMEOUT_S, make_writer

log = logging.getLogger("kvtool")

WRITE_BATCH_BYTES = 64 << 20  # = the store's segment size cap


@dataclass
class WriteTally:
    """One request's own blocks handed to the tiers (`TieredCache.insert` / `persist` while
    `TieredCache.tally` is set), and how many of them the SSD writer accepted. Which of them
    reached the disk is `SSDStore.saved_count(hashes)` once the writer has drained.

    Attributes:
        hashes: the request's blocks (and tail entry), by chain hash.
        accepted: blocks the writer accepted for the SSD (queued or written), not shed nor refused.
    """

    hashes: list[str] = field(default_factory=list)
    accepted: int = 0


@dataclass
class ShutdownStatus:
    """How a tier shut down (docs/design.md#tier-policies)."""

    shutdown_clean: bool = True
    shutdown_partial_flush: bool = False


class TieredCache:
    """RAM tier + optional SSD tier + writer for one namespace.

    Args:
        config: cache settings (policy, budgets, durability, writer).
        layout: layout key = namespace name.
        meta: namespace metadata for the SSD index (model_id, model_name, block_size,
            kv_dtype, n_layers, n_kv_heads, head_dim; all strings).
        fs: optional `FileOps` for fault injection in tests.
    """

    def __init__(self, config: KVToolConfig, layout: str, meta: dict[str, str], fs: FileOps | None = None):
        self.config = config
        self.layout = layout
        self.block_size = config.block_size
        self.ram = RamTier(config.ram_bytes, on_evict=self._on_evict)
        self.ssd: SSDStore | None = None
        self.writer = None
        if config.ssd_enabled:
            self.ssd = SSDStore(
                Path(config.ssd_cache_dir),
                layout,
                meta,
                durability=config.ssd_durability,
                flush_interval_s=config.ssd_flush_interval_s,
                fs=fs,
                dir_mode=getattr(config, "ssd_dir_mode", 0o700),
            )
            self.writer = make_writer(self.ssd, config)
        self.tally: WriteTally | None = None  # set by the request thread around one request's store
        self._lock = threading.Lock()
        # The read-side tier stack, fastest first (`kvtool.tiers.protocol`): PrefixCache walks it.
        self.tiers: list[BlockTier] = [RamBlockTier(self.ram, on_hit=self._touch_persisted,
                                                    on_mismatch=lambda: self._inc("kv_ram_token_mismatch"))]
        if self.writer is not None:
            self.tiers.append(PendingTier(self.writer, on_hit=lambda: self._inc("kv_pending_hits")))
        if self.ssd is not None:
            self.tiers.append(SsdBlockTier(self.ssd))
        self.remote, self.remote_writer = open_remote(config, layout, meta)
        if self.remote is not None:
            self.tiers.append(RemoteBlockTier(self.remote, to_ssd=bool(config.remote_promote) and self.writer is not None))
        self._stats = {
            "kv_lookup_hits": 0,
            "kv_lookup_miss": 0,
            "kv_promote_hits": 0,
            "kv_promote_fail": 0,
            "kv_pending_hits": 0,
            "kv_tail_prefix_hits": 0,
            "kv_partial_block_hits": 0,
            "kv_ram_token_mismatch": 0,
            "kv_write_through_enqueued": 0,
            "kv_evict_to_ssd": 0,
            "kv_remote_enqueued": 0,
            "kv_remote_promoted_to_ssd": 0,
        }

    # ----------------------------------------------------------------- lookup
    def _touch_persisted(self, hashes: list[str]) -> None:
        """RAM hits on blocks that are also on SSD: touch their rows (batched), so prune's TTL /
        LRU view of hot blocks stays current."""
        if self.ssd is not None:
            self.ssd.touch_many(self.ram.persisted(hashes))

    def count_hits(self, n: int) -> None:
        self._inc("kv_lookup_hits", n)

    def count_miss(self) -> None:
        self._inc("kv_lookup_miss")

    def count_tail_prefix(self) -> None:
        """A fetch extended its hit with an earlier prompt's tail entry (`PrefixCache`)."""
        self._inc("kv_tail_prefix_hits")

    def count_partial_block(self) -> None:
        """A fetch extended its hit with a sibling block's common token prefix (`kvtool.tiers.siblings`)."""
        self._inc("kv_partial_block_hits")

    def promote(self, blocks: Sequence[Block]) -> None:
        """Put blocks restored from SSD into RAM (already persisted)."""
        for block in blocks:
            self.ram.put(block, persisted=True)
        self._inc("kv_promote_hits", len(blocks))

    # ----------------------------------------------------------------- insert
    def insert(self, blocks: Sequence[Block]) -> None:
        """Add a request's new full blocks (policy decides whether they go to SSD now)."""
        write_through = self.config.ssd_policy == "write_through" and self.writer is not None
        self._tally(blocks)
        for block in blocks:
            self.ram.put(block, persisted=write_through)
        if write_through:
            self._tally((), self._send_to_writer(blocks))
            self._inc("kv_write_through_enqueued", len(blocks))
        if self.remote_writer is not None and self.config.remote_policy == "write_through":
            self._send_to_remote(blocks)

    def _send_to_remote(self, blocks: Sequence[Block]) -> None:
        """Host views of the blocks to the remote writer (never waits: a full queue drops them)."""
        try:
            assert self.remote_writer is not None  # callers check it
            self._inc("kv_remote_enqueued", self.remote_writer.enqueue([to_host(b) for b in blocks]))
        except Exception:  # the cache must never fail a request
            log.exception("remote write of %d block(s) failed", len(blocks))

    def remote_to_ssd(self, blocks: Sequence[Block]) -> None:
        """Verified remote hits into the local SSD tier (`remote_promote`; views of the request's
        cache, `PrefixCache.release`): host copies to the writer's queue, shed like any write
        when full."""
        if self.writer is not None and blocks:
            self._inc("kv_remote_promoted_to_ssd", self._send_to_writer(blocks))

    def _tally(self, blocks: Sequence[Block], accepted: int = 0) -> None:
        """Note a request's own blocks and how many of them the writer accepted (`tally`)."""
        if self.tally is not None:
            self.tally.hashes += [b.block_hash for b in blocks]
            self.tally.accepted += accepted

    def persist(self, blocks: Sequence[Block]) -> None:
        """Put blocks in RAM and write those not yet on SSD, whatever the policy (`kvtool warm`)."""
        todo = []
        self._tally(blocks)
        for block in blocks:
            if not self.ram.is_persisted(block.block_hash):
                todo.append(block)
            self.ram.put(block, persisted=self.writer is not None)
        if self.writer is not None and todo:
            self._tally((), self._send_to_writer(todo, must_write=True))  # never shed: warm promises SSD

    def _send_to_writer(self, blocks: Sequence[Block], must_write: bool = False) -> int:
        """Host copies of the blocks, handed to the writer in batches of at most
        `WRITE_BATCH_BYTES` (each becomes one segment; a batch never exceeds the writer's queue).
        A full async queue sheds a batch (best_effort, persistent) unless `must_write`.
        Returns how many blocks the writer accepted (none from a read-only or disabled store)."""
        accepted = 0
        try:
            writer = self.writer
            assert writer is not None  # callers check it
            batch: list[HostBlock] = []
            size = 0
            for b in blocks:
                if batch and size + b.nbytes > WRITE_BATCH_BYTES:
                    accepted += writer.enqueue_many(batch, must_write=must_write)
                    batch, size = [], 0
                batch.append(to_host(b))
                size += b.nbytes
            if batch:
                accepted += writer.enqueue_many(batch, must_write=must_write)
        except Exception:  # the cache must never fail a request
            log.exception("SSD write of %d block(s) failed", len(blocks))
        return accepted

    def _on_evict(self, block: Block, persisted: bool) -> None:
        if self.remote_writer is not None and self.config.remote_policy == "on_evict":
            self._send_to_remote([block])  # SET NX: a block the store holds already is not rewritten
        if persisted or self.writer is None or self.config.ssd_policy != "evict_only":
            return
        self._inc("kv_evict_to_ssd")
        self._send_to_writer([block])

    # -------------------------------------------------------------- lifecycle
    def flush(self, timeout: float = DEFAULT_DRAIN_TIMEOUT_S) -> bool:
        """Wait until every accepted write was attempted and the index is flushed."""
        ok = True
        if self.writer is not None:
            ok = self.writer.flush(timeout)
        if self.ssd is not None:
            self.ssd.flush()
        if self.remote_writer is not None:
            self.remote_writer.flush(timeout)  # best effort: the remote tier promises nothing
        return ok

    def close(self, drain_timeout: float = DEFAULT_DRAIN_TIMEOUT_S) -> ShutdownStatus:
        """Drain the writer, flush and close the index, drop RAM blocks (docs/design.md#tier-policies)."""
        status = ShutdownStatus()
        if self.writer is not None and not self.writer.stop(drain_timeout):
            status.shutdown_clean = False
            log.critical("SSD writer did not stop cleanly; validate will reconcile the cache")
        if self.ssd is not None:
            if not status.shutdown_clean:
                status.shutdown_partial_flush = True
            self.ssd.close(status.shutdown_clean, status.shutdown_partial_flush)
        if self.remote_writer is not None:
            self.remote_writer.stop(drain_timeout)
            self.remote.close()
        self.ram.clear()
        return status

    def queue_depth(self) -> int:
        return self.writer.queue_depth() if self.writer is not None else 0

    def stats(self) -> dict:
        """Counters of every owner merged (prefixes kv_, ssd_, writer_ never collide)."""
        out: dict = {}
        with self._lock:
            out.update(self._stats)
        out.update(self.ram.stats())
        if self.ssd is not None:
            out.update(self.ssd.stats())
        if self.writer is not None:
            out.update(self.writer.get_stats())
        if self.remote is not None:
            out.update(self.remote.stats())
        if self.remote_writer is not None:
            out.update(self.remote_writer.stats())
        return out

    def _inc(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._stats[key] += n
