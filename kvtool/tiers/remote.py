"""The remote tier as a `BlockTier`: a Redis / Valkey store shared by hosts (`kvtool.tiers.remote_store`).

It stands last in the tier stack, so a prompt this host has never seen, but another host has, is
served from the shared store:
- `longest_prefix`: one pipelined round trip of EXISTS for the rest of the chain (nothing while
  the store's circuit breaker is open); the read of what it found starts there (`RemoteStore.read`);
- `read_into`: the values in pipelined batches, each verified exactly like an SSD record
  (`kvtool.tiers.remote_value`) and placed into the request's buffers; a bad value is a miss
  (deleted and counted by the store) and cuts the chain; `release` cancels what was not placed;
- its hits are promoted into RAM, and with `to_ssd` (`remote_promote`) to the local SSD tier, as
  views of the request's cache when the request is released (`PrefixCache.release`).
Tail-entry candidates and siblings are not looked up remotely: that would add a round trip to every
miss and needs key listing, which kvtool never does on the request path.

Writes (`put`, per `remote_policy`) go through the one writer (`AsyncWriter`, `when_full="shed"`,
a daemon thread): the request thread never waits on the network, a batch that finds the queue full
is dropped (counted `remote_dropped_writes`), values are `SET NX` (first writer wins).
MLX is used only to turn a block into host views on the request thread (`put`).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from kvtool.kv.blocks import Block, to_host_many
from kvtool.tiers.base import BlockTier, Caps, ChainEntry, Counts, Put, ReadResult, TierBase, WritePolicy
from kvtool.tiers.writer import AsyncWriter

if TYPE_CHECKING:
    from kvtool.kv.buffers import KVBuffers
    from kvtool.tiers.remote_read import ValueRead
    from kvtool.tiers.remote_store import RemoteStore

log = logging.getLogger("kvtool")

DEFAULT_WRITER_QUEUE_BYTES = 64 << 20  # bytes queued and being written
DEFAULT_WRITER_BATCH_BYTES = 8 << 20  # bytes of blocks per `save_blocks` call


class RemoteHandle(NamedTuple):
    """A chain entry the remote tier holds: the entry, and its position in the read that
    `longest_prefix` started."""

    entry: ChainEntry
    read: ValueRead
    pos: int


def remote_writer(store: RemoteStore, max_queue_bytes: int = DEFAULT_WRITER_QUEUE_BYTES,
                  batch_bytes: int = DEFAULT_WRITER_BATCH_BYTES) -> AsyncWriter:
    """The one writer (`AsyncWriter`) as the remote tier runs it: one attempt per batch, a daemon
    thread, a queue bounded in bytes only, and a batch that finds it full dropped at once
    (`when_full="shed"`; counted `remote_dropped_writes`, as blocks offered after `stop`)."""
    return AsyncWriter(store, queue_size=1 << 30, durability="best_effort", max_queue_bytes=max_queue_bytes,
                       batch_max_bytes=batch_bytes, when_full="shed", daemon=True, name="remote",
                       on_drop=functools.partial(store.count, "remote_dropped_writes"))  # fmt: skip


class RemoteBlockTier(TierBase):
    """`BlockTier` over a `RemoteStore`.

    Args:
        store: the namespace's remote store.
        policy: `THROUGH` (`remote_policy = write_through`), `ON_EVICT` (`on_evict`) or `OFF`.
        max_queue_bytes: the writer's queue bound (bytes); a batch that does not fit is dropped.
        batch_bytes: blocks per `save_blocks` call (bytes).
    """

    name = "remote"
    caps = Caps(finds_tails=False, lists_siblings=False, persistent=True)

    def __init__(self, store: RemoteStore, policy: WritePolicy = WritePolicy.THROUGH, *,
                 max_queue_bytes: int = DEFAULT_WRITER_QUEUE_BYTES, batch_bytes: int = DEFAULT_WRITER_BATCH_BYTES):  # fmt: skip
        self.store = store
        self.policy = policy
        self.writer = remote_writer(store, max_queue_bytes, batch_bytes)
        self._counts = Counts("kv_remote_enqueued")

    def longest_prefix(self, chain: Sequence[ChainEntry], ids: np.ndarray) -> list[RemoteHandle]:
        if not chain or not self.store.available:
            return []
        n = self.store.longest_prefix([e.hash for e in chain])
        if not n:
            return []
        run = chain[:n]
        reading = self.store.read([e.hash for e in run], [e.parent for e in run], [ids[e.start : e.stop] for e in run])
        return [RemoteHandle(e, reading, i) for i, e in enumerate(run)]

    def read_into(self, chain: Sequence[ChainEntry], handles: Sequence[RemoteHandle], ids: np.ndarray,
                  buffers: KVBuffers) -> ReadResult:
        reading = handles[0].read if handles else None
        if reading is None or len(handles) != len(chain) or any(h.read is not reading or h.pos != i or h.entry != e
                                  for i, (h, e) in enumerate(zip(handles, chain))):  # fmt: skip
            self.release(handles)  # not the run longest_prefix found (never so in PrefixCache): read anew
            reading = self.store.read([e.hash for e in chain], [e.parent for e in chain],
                                      [ids[e.start : e.stop] for e in chain])  # fmt: skip
        n_ok = nbytes = 0
        try:  # each batch's bytes are dropped once placed: the next batch reuses their memory
            for k, block in reading.blocks(len(chain)):
                if block is None or k != n_ok:
                    break
                if not n_ok:
                    buffers.ready()
                buffers.place_host(chain[k].start, block)
                n_ok, nbytes = n_ok + 1, nbytes + block.nbytes
        finally:
            reading.cancel()
        buffers.ready()
        return ReadResult(n_ok, nbytes)

    def release(self, handles: Sequence[Any]) -> None:
        for reading in {id(h.read): h.read for h in handles if isinstance(h, RemoteHandle)}.values():
            reading.cancel()

    def put(self, blocks: Sequence[Block], why: Put) -> int:
        """Host views of the blocks to the writer (never waits: a full queue drops them)."""
        try:
            accepted = self.writer.enqueue_many(to_host_many(blocks))
        except Exception:  # the cache must never fail a request
            log.exception("remote write of %d block(s) failed", len(blocks))
            return 0
        self._counts.inc("kv_remote_enqueued", accepted)
        return accepted

    def remove(self, hashes: Sequence[str]) -> int:
        return self.store.delete(hashes)

    def stats(self) -> dict[str, int]:
        """The store's `remote_*` counters, `kv_remote_enqueued`, and the writer's
        `remote_writer_queue_bytes`, `remote_writer_queue_blocks` (gauges) and
        `remote_writer_stored` (blocks it stored)."""
        w = self.writer
        return {**self._counts.snapshot(), **self.store.stats(), "remote_writer_queue_bytes": w.queue_bytes(),
                "remote_writer_queue_blocks": w.queue_depth(),
                "remote_writer_stored": w.get_stats()["writer_save_success"]}  # fmt: skip

    def flush(self, timeout_s: float) -> bool:
        self.writer.flush(timeout_s)
        return True  # best effort: the remote tier promises nothing

    def close(self, timeout_s: float) -> bool:
        self.writer.stop(timeout_s)
        self.store.close()
        return True


def open_remote(config: Any, layout_key: str, meta: dict[str, str]) -> list[BlockTier]:
    """The namespace's remote tier when `config.remote_enabled` (`[]` otherwise). A server that
    is down leaves the store unavailable (it reconnects later); a configuration it cannot use
    (layout, URL) is logged once and leaves the tier off."""
    if not getattr(config, "remote_enabled", False):
        return []
    from kvtool.config.remote_url import RemoteURLError
    from kvtool.disk.kvlayout import KVLayout
    from kvtool.tiers.remote_store import RemoteStore

    try:
        kv = KVLayout.parse(meta["kv_layers"], meta["kv_dtype"])
        store = RemoteStore(config.remote_url, layout_key, kv, meta.get("kv_codec", "none"),
                            timeout_s=config.remote_timeout_s, ttl_s=config.remote_ttl_s,
                            cluster=True if config.remote_cluster else None)
    except (RemoteURLError, ValueError, KeyError) as exc:
        log.warning("kvtool: remote tier off: %s", exc)
        return []
    policy = {"write_through": WritePolicy.THROUGH, "on_evict": WritePolicy.ON_EVICT}.get(config.remote_policy,
                                                                                           WritePolicy.OFF)
    return [RemoteBlockTier(store, policy)]


__all__ = ["RemoteBlockTier", "open_remote", "remote_writer"]
