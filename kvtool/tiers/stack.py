"""`TierStack`: the tiers of one namespace (layout key), fastest first, and the walk, promotion and
write policies as loops over them (docs/design.md#tier-policies).

RAM (evaluated MLX blocks, LRU under a byte budget) comes first, then the tiers its builder opens
from the config (`open_ssd`: the writer's pending buffer and the SSD namespace; `open_remote`). It
names none of them; it reads their capabilities (`Caps`), write policy and `takes_promotions`:
- the walk (`collect`): at each chain position the first tier that holds the next entries gives
  its longest run; `fill` places the runs, each tier verifying what it reads, and counts tokens
  per tier (`CacheHit.tier_tokens`);
- writes: new blocks go to every write-through tier; blocks RAM evicts go to the write-back
  (`ON_EVICT`) tiers, except the local persistent tier (`caps.backs_ram`) when RAM knows them
  handed to it already (`persisted`);
- promotion: a hit from a tier that `promotes` is put, at `PrefixCache.release`, into every tier
  above it that `takes_promotions`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvtool.config import KVToolConfig
from kvtool.disk.fsops import FileOps
from kvtool.kv.blocks import Block
from kvtool.tiers.base import BlockTier, ChainEntry, Put, WritePolicy
from kvtool.tiers.ram import RamBlockTier, RamTier
from kvtool.tiers.remote import open_remote
from kvtool.tiers.ssd import open_ssd
from kvtool.tiers.writer import DEFAULT_DRAIN_TIMEOUT_S

log = logging.getLogger("kvtool")


@dataclass
class WriteTally:
    """One request's own blocks (and tail entry) handed to the tiers, by chain hash (`hashes`;
    `TierStack.insert` / `persist` while `TierStack.tally` is set), and how many of them the local
    persistent tier's writer accepted (`accepted`: queued or written, not shed nor refused). Which
    of them reached the disk is `SSDStore.saved_count(hashes)` once the writer has drained."""

    hashes: list[str] = field(default_factory=list)
    accepted: int = 0


@dataclass
class ShutdownStatus:
    """How a tier shut down (docs/design.md#tier-policies)."""

    shutdown_clean: bool = True
    shutdown_partial_flush: bool = False


STACK_COUNTERS = ("kv_lookup_hits", "kv_lookup_miss", "kv_promote_fail", "kv_tail_prefix_hits", "kv_partial_block_hits")


class TierStack:
    """RAM + the configured tiers of one namespace.

    Args:
        config: cache settings (policies, budgets, durability, writer, remote).
        layout: layout key = namespace name.
        meta: namespace metadata for the SSD index (model_id, model_name, block_size, kv_dtype,
            kv_layers, ...; all strings).
        fs: optional `FileOps` for fault injection in tests.
        lower: the tiers below RAM, fastest first; None (the default): opened from the config
            (`open_ssd`, `open_remote`). `kvtool bench-plan` passes its byte-counting stand-in.

    Attributes:
        tiers: the read order, fastest first (`BlockTier`s).
        ram: the RAM front (`RamTier`).
        backing: the local persistent tier (`caps.backs_ram`), or None.
        ssd, writer: the backing tier's store and writer (None without one), for callers that
            read its counters or wait on it.
        tally: set by the request thread around one request's store (`WriteTally`).
    """

    def __init__(self, config: KVToolConfig, layout: str, meta: dict[str, str], fs: FileOps | None = None,
                 lower: Sequence[BlockTier] | None = None):  # fmt: skip
        self.config = config
        self.layout = layout
        self.block_size = config.block_size
        self.ram = RamTier(config.ram_bytes, on_evict=self._on_evict)
        front = RamBlockTier(self.ram)
        if lower is None:
            lower = [*open_ssd(config, layout, meta, fs), *open_remote(config, layout, meta)]
        self.tiers: list[BlockTier] = [front, *lower]
        self.backing: Any = next((t for t in self.tiers if t.caps.backs_ram), None)
        if self.backing is not None:
            front.has_backing, front.on_hit = True, self.backing.touch
            front.new_persisted = self.backing.policy is WritePolicy.THROUGH
        self.ssd = getattr(self.backing, "ssd", None)
        self.writer = getattr(self.backing, "writer", None)
        # promotion targets of each tier's hits: the tiers above it that take promotions
        self._up = {id(t): [u for u in self.tiers[:i] if u.takes_promotions] for i, t in enumerate(self.tiers)}
        self.tally: WriteTally | None = None
        self._lock = threading.Lock()
        self._stats = dict.fromkeys(STACK_COUNTERS, 0)

    # ------------------------------------------------------------------- walk
    def collect(self, chain: Sequence[ChainEntry], ids: np.ndarray) -> list[tuple[Any, Any]]:
        """`(tier, handle)` of the leading chain entries: at each position the first tier that
        holds the next entries gives its longest run (`BlockTier.longest_prefix`)."""
        found: list[tuple[Any, Any]] = []
        i = 0
        while i < len(chain):
            for tier in self.tiers:
                got = tier.longest_prefix(chain[i:], ids)
                if got:
                    found += [(tier, g) for g in got]
                    i += len(got)
                    break
            else:
                self._inc("kv_lookup_miss")
                break
        self._inc("kv_lookup_hits", len(found))
        return found

    def fill(self, chain: Sequence[ChainEntry], found: list, ids: np.ndarray, buffers: Any, hit: Any,
             scratch: Callable[[int], list]) -> int:  # fmt: skip
        """Place every found entry into `buffers` (`KVBuffers`), run by run of the same tier, each
        tier verifying what it reads; tokens and bytes read per tier go to `hit.tier_tokens` /
        `hit.tier_bytes`, entries to promote to `hit.promote` / `hit.sources`
        (`(hash, parent, ids, offset, *scratch(offset))`). Returns the entries placed (a failed
        entry cuts the chain)."""
        i = 0
        while i < len(found):
            tier = found[i][0]
            j = i
            while j < len(found) and found[j][0] is tier:
                j += 1
            res = tier.read_into(chain[i:j], [h for _, h in found[i:j]], ids, buffers)
            name = tier.name
            hit.tier_bytes[name] = hit.tier_bytes.get(name, 0) + res.bytes_read
            placed = chain[i : i + res.n_ok]
            hit.tier_tokens[name] = hit.tier_tokens.get(name, 0) + sum(e.stop - e.start for e in placed)
            if tier.caps.promotes and self._up.get(id(tier)):
                for e in placed:
                    hit.promote.append((e.hash, e.parent, ids[e.start : e.stop], e.start, *scratch(e.start)))
                    hit.sources[e.hash] = tier
            if res.n_ok < j - i:
                return i + res.n_ok
            i = j
        return i

    def release(self, held: Sequence[tuple[Any, Any]]) -> None:
        """Release `(tier, handle)` pairs a request held (RAM unpins), one call per tier."""
        groups: dict[int, tuple[Any, list]] = {}
        for tier, handle in held:
            groups.setdefault(id(tier), (tier, []))[1].append(handle)
        for tier, handles in groups.values():
            tier.release(handles)

    def count_tail_prefix(self) -> None:
        """A fetch extended its hit with an earlier prompt's tail entry (`PrefixCache`)."""
        self._inc("kv_tail_prefix_hits")

    def count_partial_block(self) -> None:
        """A fetch extended its hit with a sibling block's common token prefix."""
        self._inc("kv_partial_block_hits")

    # ------------------------------------------------------------------ writes
    def promote(self, blocks: Sequence[Block], sources: Sequence[Any]) -> None:
        """Verified hits (views of the request's cache) into every tier above their source tier
        that takes promotions (`Put.PROMOTED`)."""
        targets: dict[int, tuple[Any, list[Block]]] = {}
        for block, src in zip(blocks, sources):
            for t in self._up.get(id(src), ()):
                targets.setdefault(id(t), (t, []))[1].append(block)
        for tier, group in targets.values():
            tier.put(group, Put.PROMOTED)

    def insert(self, blocks: Sequence[Block]) -> None:
        """A request's new blocks: to every write-through tier (RAM first)."""
        self._tally(blocks)
        for tier in self.tiers:
            if tier.policy is WritePolicy.THROUGH:
                accepted = tier.put(blocks, Put.NEW)
                if tier is self.backing:
                    self._tally((), accepted)

    def persist(self, blocks: Sequence[Block]) -> None:
        """Put blocks in RAM and hand those RAM does not know persisted to the local persistent
        tier, whatever the policy, never shed (`kvtool warm`)."""
        self._tally(blocks)
        done = set(self.ram.persisted([b.block_hash for b in blocks]))
        todo = [b for b in blocks if b.block_hash not in done]
        self.tiers[0].put(blocks, Put.PERSIST)
        if self.backing is not None and todo:
            self._tally((), self.backing.put(todo, Put.PERSIST))

    def _tally(self, blocks: Sequence[Block], accepted: int = 0) -> None:
        if self.tally is not None:
            self.tally.hashes += [b.block_hash for b in blocks]
            self.tally.accepted += accepted

    def _on_evict(self, block: Block, persisted: bool) -> None:
        """RAM evicted `block`: write it back to the `ON_EVICT` tiers (not to the local
        persistent tier if RAM knows it handed there already)."""
        for tier in self.tiers:
            if tier.policy is WritePolicy.ON_EVICT and not (persisted and tier.caps.backs_ram):
                tier.put([block], Put.EVICTED)

    # -------------------------------------------------------------- lifecycle
    def flush(self, timeout: float = DEFAULT_DRAIN_TIMEOUT_S) -> bool:
        """Wait until every accepted write was attempted and indexes are flushed."""
        ok = True
        for tier in self.tiers:
            ok = tier.flush(timeout) and ok
        return ok

    def close(self, drain_timeout: float = DEFAULT_DRAIN_TIMEOUT_S) -> ShutdownStatus:
        """Drain the writers, flush and close the stores, drop RAM blocks (RAM last)."""
        clean = all([tier.close(drain_timeout) for tier in [*self.tiers[1:], self.tiers[0]]])
        return ShutdownStatus(shutdown_clean=clean, shutdown_partial_flush=not clean)

    def queue_depth(self) -> int:
        return self.writer.queue_depth() if self.writer is not None else 0

    def stats(self) -> dict:
        """Counters of every tier merged (prefixes kv_, ssd_, writer_, remote_ never collide)."""
        with self._lock:
            out: dict = dict(self._stats)
        for tier in self.tiers:
            out.update(tier.stats())
        return out

    def _inc(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._stats[key] += n


__all__ = ["ShutdownStatus", "TierStack", "WriteTally"]
