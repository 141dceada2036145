"""The tiered cache: RAM over SSD for one namespace (layout key).

Lookup order per block hash: RAM, then the writer's pending buffer (queued, not yet on disk),
then the SSD store; it stops at the first miss. Every hit is checked against the request's
token ids; a mismatch is a miss. SSD hits are promoted into RAM.

Policies (seed 000): `write_through` sends every new block to RAM and to the SSD writer;
`evict_only` (write-back) sends a block to the writer only when RAM evicts it.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from kvtool.blocks import Block, from_host, to_host
from kvtool.config import KVToolConfig
from kvtool.store.ram import RamTier
from kvtool.store.ssd import SSDStore
from kvtool.store.writer import make_writer

log = logging.getLogger("kvtool")

DEFAULT_DRAIN_TIMEOUT_S = 30.0


@dataclass
class ShutdownStatus:
    """How a tier shut down (seed 000 §4)."""

    shutdown_clean: bool = True
    shutdown_partial_flush: bool = False


@dataclass
class LookupResult:
    """Blocks found for a prompt prefix, in prompt order, pinned in RAM until `release`.

    Attributes:
        blocks: the chain of leading blocks found.
        ram_blocks, ssd_blocks: how many came from RAM / from SSD (incl. the pending buffer).
        ssd_load_ms: time spent reading, verifying and converting SSD blocks (ms).
        ssd_bytes_read: bytes of block tensors loaded from the SSD tier.
    """

    blocks: list[Block] = field(default_factory=list)
    from_ssd: list[bool] = field(default_factory=list)  # per block: loaded from the SSD tier
    ram_blocks: int = 0
    ssd_blocks: int = 0
    ssd_load_ms: float = 0.0
    ssd_bytes_read: int = 0


class TieredCache:
    """RAM tier + optional SSD tier + writer for one namespace.

    Args:
        config: cache settings (policy, budgets, durability, writer).
        layout: layout key = namespace name.
        meta: namespace metadata for the SSD index (model_id, model_name, block_size,
            kv_dtype, n_layers, n_kv_heads, head_dim; all strings).
        fs: optional `FileOps` for fault injection in tests.
    """

    def __init__(self, config: KVToolConfig, layout: str, meta: dict[str, str], fs=None):
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
            )
            self.writer = make_writer(self.ssd, config)
        self._lock = threading.Lock()
        self._stats = {
            "kv_lookup_hits": 0,
            "kv_lookup_miss": 0,
            "kv_promote_hits": 0,
            "kv_promote_fail": 0,
            "kv_pending_hits": 0,
            "kv_ram_token_mismatch": 0,
            "kv_write_through_enqueued": 0,
            "kv_evict_to_ssd": 0,
        }
        self.write_path_ms = 0.0  # request-thread time spent handing blocks to the writer

    # ----------------------------------------------------------------- lookup
    def lookup(self, hashes: Sequence[str], token_ids: np.ndarray) -> LookupResult:
        """Find the longest chain of cached leading blocks of a prompt.

        Args:
            hashes: chain hashes of the prompt's full blocks.
            token_ids: int32 prompt token ids `[T]`, `T >= len(hashes) * block_size`.

        Returns:
            A `LookupResult`; its blocks are pinned in RAM until `release(result)` (a block
            the budget could not keep is still returned, just not held in RAM).
        """
        res = LookupResult()
        bs = self.block_size
        for i, h in enumerate(hashes):
            expected = token_ids[i * bs : (i + 1) * bs]
            block = self._from_ram(h, expected)
            from_ssd = block is None
            if block is not None:
                self.ram.pin([h])
                res.ram_blocks += 1
            else:
                t0 = time.perf_counter()
                block = self._from_ssd(h, expected)
                res.ssd_load_ms += (time.perf_counter() - t0) * 1e3
                if block is None:
                    self._inc("kv_lookup_miss")
                    break
                res.ssd_blocks += 1
                res.ssd_bytes_read += block.nbytes
            self._inc("kv_lookup_hits")
            res.blocks.append(block)
            res.from_ssd.append(from_ssd)
        return res

    def release(self, result: LookupResult) -> None:
        """Unpin the blocks of a finished request."""
        self.ram.unpin([b.block_hash for b in result.blocks])

    def _from_ram(self, h: str, expected: np.ndarray) -> Block | None:
        block = self.ram.get(h)
        if block is None:
            return None
        if not np.array_equal(block.token_ids, expected):
            self._inc("kv_ram_token_mismatch")
            return None
        if self.ssd is not None and self.ram.is_persisted(h):
            self.ssd.touch(h)  # batched: keeps prune's TTL/LRU view of hot blocks current
        return block

    def _from_ssd(self, h: str, expected: np.ndarray) -> Block | None:
        if self.ssd is None:
            return None
        host = self.writer.get_pending(h) if self.writer is not None else None
        if host is not None and np.array_equal(host.token_ids, expected):
            self._inc("kv_pending_hits")
            persisted = False
        else:
            host = self.ssd.load_block(h, np.asarray(expected, dtype=np.int32))
            if host is None:
                return None
            persisted = True
        try:
            block = from_host(host)
        except Exception:  # a malformed block must never reach the model
            log.exception("could not convert SSD block %s; treating as a miss", h)
            self._inc("kv_promote_fail")
            return None
        self.ram.put(block, persisted=persisted, pin=True)
        self._inc("kv_promote_hits")
        return block

    # ----------------------------------------------------------------- insert
    def insert(self, blocks: Sequence[Block]) -> None:
        """Add a request's new full blocks (policy decides whether they go to SSD now)."""
        write_through = self.config.ssd_policy == "write_through" and self.writer is not None
        for block in blocks:
            self.ram.put(block, persisted=write_through)
            if write_through:
                self._send_to_writer(block)
                self._inc("kv_write_through_enqueued")

    def persist(self, blocks: Sequence[Block]) -> None:
        """Put blocks in RAM and write those not yet on SSD, whatever the policy (`kvtool warm`)."""
        for block in blocks:
            already = self.ram.is_persisted(block.block_hash)
            self.ram.put(block, persisted=self.writer is not None)
            if self.writer is not None and not already:
                self._send_to_writer(block)

    def _send_to_writer(self, block: Block) -> None:
        t0 = time.perf_counter()
        try:
            self.writer.enqueue(to_host(block))
        except Exception:  # the cache must never fail a request
            log.exception("SSD write of block %s failed", block.block_hash)
        self.write_path_ms += (time.perf_counter() - t0) * 1e3

    def _on_evict(self, block: Block, persisted: bool) -> None:
        if persisted or self.writer is None or self.config.ssd_policy != "evict_only":
            return
        self._inc("kv_evict_to_ssd")
        self._send_to_writer(block)

    # -------------------------------------------------------------- lifecycle
    def flush(self, timeout: float = DEFAULT_DRAIN_TIMEOUT_S) -> bool:
        """Wait until every accepted write was attempted and the index is flushed."""
        ok = True
        if self.writer is not None:
            ok = self.writer.flush(timeout)
        if self.ssd is not None:
            self.ssd.flush()
        return ok

    def close(self, drain_timeout: float = DEFAULT_DRAIN_TIMEOUT_S) -> ShutdownStatus:
        """Drain the writer, flush and close the index, drop RAM blocks (seed 000 §4)."""
        status = ShutdownStatus()
        if self.writer is not None and not self.writer.stop(drain_timeout):
            status.shutdown_clean = False
            log.critical("SSD writer did not stop cleanly; validate will reconcile the cache")
        if self.ssd is not None:
            if not status.shutdown_clean:
                status.shutdown_partial_flush = True
            self.ssd.close(status.shutdown_clean, status.shutdown_partial_flush)
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
        return out

    def _inc(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._stats[key] += n
