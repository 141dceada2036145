"""The remote tier as a `BlockTier`: a Redis / Valkey store shared by hosts (`kvtool.tiers.remote_store`).

It stands last in the tier stack (after RAM, the pending buffer and SSD), so a prompt that this
host has never seen, but another host has, is served from the shared store:
- `longest_prefix`: one pipelined round trip of EXISTS for the rest of the chain (nothing while
  the store's circuit breaker is open, so a dead server costs no request more than its deadline);
  the read of what it found starts there (`RemoteStore.read`: where cores are to spare, its
  first batches are fetched and verified on the store's reader threads while the request
  allocates its buffers);
- `read_into`: the values in pipelined batches, each verified exactly like an SSD record
  (header, layout, parent, token ids, checksum: `kvtool.tiers.remote_value`), then placed into
  the request's buffers (with reader threads: while the next batch is on the wire); a bad value
  is a miss (deleted and counted by the store) and cuts the chain; `release` cancels what was
  not placed;
- its hits are promoted into RAM like SSD hits, as views of the request's cache when the request
  is released (`PrefixCache.release`), and with `to_ssd` (`remote_promote`) written from those
  views to the local SSD tier at the same moment. (Keeping the values' bytes for that instead
  would deny the next batches their memory: ~15 ms more page faults on a 16k-token hit.)
Tail-entry candidates and siblings are not looked up remotely: that would add a round trip to every
miss and needs key listing, which kvtool never does on the request path.

This module never imports MLX.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from kvtool.disk.hostblock import HostBlock
from kvtool.tiers.protocol import ChainEntry, ReadResult

if TYPE_CHECKING:
    from kvtool.kv.buffers import KVBuffers
    from kvtool.tiers.remote_read import ValueRead
    from kvtool.tiers.remote_store import RemoteStore


class RemoteHandle(NamedTuple):
    """A chain entry the remote tier holds: the entry, and its position in the read that
    `longest_prefix` started."""

    entry: ChainEntry
    read: ValueRead
    pos: int


class RemoteBlockTier:
    """`BlockTier` over a `RemoteStore`.

    Args:
        store: the namespace's remote store.
        to_ssd: its hits are also written to the local SSD tier (`remote_promote`), from the
            request's cache when it is released (`PrefixCache.release`), as RAM promotion is.

    Attributes:
        to_ssd: as the argument.
    """

    kind, in_memory, promote = "remote", False, True

    def __init__(self, store: RemoteStore, to_ssd: bool = False):
        self.store = store
        self.to_ssd = to_ssd

    def longest_prefix(self, chain: Sequence[ChainEntry], ids: np.ndarray) -> list[RemoteHandle]:
        if not chain or not self.store.available:
            return []
        n = self.store.longest_prefix([e.hash for e in chain])
        if not n:
            return []
        run = chain[:n]
        reading = self.store.read([e.hash for e in run], [e.parent for e in run], [ids[e.start : e.stop] for e in run])
        return [RemoteHandle(e, reading, i) for i, e in enumerate(run)]

    def find_any(self, cands: Sequence[tuple[str, int]], ids: np.ndarray, start: int) -> tuple[Any, str, int] | None:
        return None  # see the module docstring

    def sibling_candidates(self, parent: str, skip: set[str]) -> Iterator[tuple[HostBlock, int]]:
        return iter(())  # see the module docstring

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


def open_remote(config: Any, layout_key: str, meta: dict[str, str]) -> tuple[Any, Any]:
    """The namespace's `RemoteStore` and its `RemoteWriter` when `config.remote_enabled`, else
    `(None, None)`. A server that is down leaves the store unavailable (it reconnects later);
    a configuration it cannot use (layout, URL) is logged once and leaves the tier off."""
    if not getattr(config, "remote_enabled", False):
        return None, None
    import logging

    from kvtool.config.remote_url import RemoteURLError
    from kvtool.disk.kvlayout import KVLayout
    from kvtool.tiers.remote_store import RemoteStore
    from kvtool.tiers.remote_writer import RemoteWriter

    try:
        kv = KVLayout.parse(meta["kv_layers"], meta["kv_dtype"])
        store = RemoteStore(config.remote_url, layout_key, kv, meta.get("kv_codec", "none"),
                            timeout_s=config.remote_timeout_s, ttl_s=config.remote_ttl_s,
                            cluster=True if config.remote_cluster else None)
    except (RemoteURLError, ValueError, KeyError) as exc:
        logging.getLogger("kvtool").warning("kvtool: remote tier off: %s", exc)
        return None, None
    return store, RemoteWriter(store)


__all__ = ["RemoteBlockTier", "open_remote"]
