"""The remote tier as a `BlockTier`: a Redis / Valkey store shared by hosts (`kvtool.store.remote`).

It stands last in the tier stack (after RAM, the pending buffer and SSD), so a prompt that this
host has never seen, but another host has, is served from the shared store:
- `longest_prefix`: one pipelined round trip of EXISTS for the rest of the chain (nothing while
  the store's circuit breaker is open, so a dead server costs no request more than its deadline);
- `read_into`: the values fetched in pipelined batches, each verified exactly like an SSD record
  (header, layout, parent, token ids, checksum: `kvtool.store.remote_value`), then placed into the
  request's buffers; a bad value is a miss (deleted and counted by the store) and cuts the chain;
- verified blocks are handed to `on_read` (the tiered cache writes them to the local SSD tier when
  `remote_promote` is on) and promoted into RAM like SSD hits, as views of the request's cache.
Tail-entry candidates and siblings are not looked up remotely: that would add a round trip to every
miss and needs key listing, which kvtool never does on the request path.

This module never imports MLX.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from kvtool.hostblock import HostBlock
from kvtool.tiers import ChainEntry, ReadResult

if TYPE_CHECKING:
    from kvtool.kvbuffers import KVBuffers
    from kvtool.store.remote import RemoteStore


class RemoteBlockTier:
    """`BlockTier` over a `RemoteStore`.

    Args:
        store: the namespace's remote store.
        on_read: called with the verified host blocks of every read (SSD promotion), or None.
    """

    kind, in_memory, promote = "remote", False, True

    def __init__(self, store: RemoteStore, on_read: Callable[[list[HostBlock]], None] | None = None):
        self.store = store
        self._on_read = on_read

    def longest_prefix(self, chain: Sequence[ChainEntry], ids: np.ndarray) -> list[ChainEntry]:
        if not chain or not self.store.available:
            return []
        n = self.store.longest_prefix([e.hash for e in chain])
        return list(chain[:n])

    def find_any(self, cands: Sequence[tuple[str, int]], ids: np.ndarray, start: int) -> tuple[Any, str, int] | None:
        return None  # see the module docstring

    def sibling_candidates(self, parent: str, skip: set[str]) -> Iterator[tuple[HostBlock, int]]:
        return iter(())  # see the module docstring

    def read_into(self, chain: Sequence[ChainEntry], handles: Sequence[Any], ids: np.ndarray,
                  buffers: KVBuffers) -> ReadResult:
        blocks = self.store.get_blocks([e.hash for e in chain], [e.parent for e in chain],
                                       [ids[e.start : e.stop] for e in chain])
        buffers.ready()
        good: list[HostBlock] = []
        for e, block in zip(chain, blocks):
            if block is None:
                break
            buffers.place_host(e.start, block)
            good.append(block)
        if good and self._on_read is not None:
            self._on_read(good)
        return ReadResult(len(good), sum(b.nbytes for b in good))

    def release(self, handles: Sequence[Any]) -> None:
        pass


def open_remote(config: Any, layout_key: str, meta: dict[str, str]) -> tuple[Any, Any]:
    """The namespace's `RemoteStore` and its `RemoteWriter` when `config.remote_enabled`, else
    `(None, None)`. A server that is down leaves the store unavailable (it reconnects later);
    a configuration it cannot use (layout, URL) is logged once and leaves the tier off."""
    if not getattr(config, "remote_enabled", False):
        return None, None
    import logging

    from kvtool.store.kvlayout import KVLayout
    from kvtool.store.remote import RemoteStore
    from kvtool.store.remote_url import RemoteURLError
    from kvtool.store.remote_writer import RemoteWriter

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
