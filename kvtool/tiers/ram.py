"""The RAM tier: evaluated MLX blocks under a byte budget, LRU eviction, pins for requests in
flight (`RamTier`), and its `BlockTier` (`RamBlockTier`): token ids compared on lookup."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtool.kv.blocks import Block, run_groups
from kvtool.tiers.base import Caps, Counts, MemoryTier, Put, ReadResult, WritePolicy

MAX_MEMORY_SIBLINGS = 64  # RAM / pending siblings compared per partial-block lookup (newest first)

EvictCallback = Callable[[Block, bool], None]


@dataclass
class _Entry:
    block: Block
    pins: int = 0
    persisted: bool = False  # already on SSD (loaded from it, or handed to the writer)


class RamTier:
    """LRU map block hash -> `Block` with a byte budget.

    Args:
        capacity_bytes: budget over the sum of `Block.nbytes` (bytes). 0 keeps nothing that
            is not pinned.
        on_evict: called as `on_evict(block, persisted)` for every block dropped by the budget
            (not by `clear()`); under `evict_only` the tiered cache writes it to SSD there.

    Pinned blocks (those of the request in flight) are never evicted; while pins hold the tier
    above budget, eviction resumes at `unpin`.
    """

    def __init__(self, capacity_bytes: int, on_evict: EvictCallback | None = None):
        self.capacity_bytes = int(capacity_bytes)
        self._on_evict = on_evict
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._children: dict[str, dict[str, None]] = {}  # parent hash -> child hashes, oldest first
        self._nbytes = 0
        self._lock = threading.Lock()
        self._stats = {"kv_ram_evictions": 0, "kv_ram_evicted_bytes": 0, "kv_ram_inserts": 0}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, block_hash: str) -> bool:
        return block_hash in self._entries

    @property
    def nbytes(self) -> int:
        """Bytes held (sum of block nbytes)."""
        return self._nbytes

    def get(self, block_hash: str) -> Block | None:
        """The block, marked most recently used, or None."""
        with self._lock:
            entry = self._entries.get(block_hash)
            if entry is None:
                return None
            self._entries.move_to_end(block_hash)
            return entry.block

    def put(self, block: Block, *, persisted: bool = False, pin: bool = False) -> None:
        """Insert (or refresh) a block as most recently used, then evict down to the budget."""
        with self._lock:
            entry = self._entries.get(block.block_hash)
            if entry is None:
                entry = _Entry(block, persisted=persisted)
                self._entries[block.block_hash] = entry
                self._children.setdefault(block.parent_hash, {})[block.block_hash] = None
                self._nbytes += block.nbytes
                self._stats["kv_ram_inserts"] += 1
            else:
                entry.persisted = entry.persisted or persisted
                self._entries.move_to_end(block.block_hash)
            if pin:
                entry.pins += 1
            victims = self._collect_victims(self.capacity_bytes)
        self._notify(victims)

    def children(self, parent_hash: str, limit: int) -> list[Block]:
        """Up to `limit` held blocks whose parent is `parent_hash`, newest first (not marked used).

        The siblings a partial-block prefix hit chooses from (`kvtool.tiers.siblings`): O(limit).
        """
        with self._lock:
            kids = self._children.get(parent_hash)
            if not kids:
                return []
            out = []
            for h in reversed(kids):
                out.append(self._entries[h].block)
                if len(out) >= limit:
                    break
            return out

    def _forget(self, h: str, entry: _Entry) -> None:
        """Drop one entry and its child link (lock held)."""
        del self._entries[h]
        self._nbytes -= entry.block.nbytes
        kids = self._children.get(entry.block.parent_hash)
        if kids is not None:
            kids.pop(h, None)
            if not kids:
                del self._children[entry.block.parent_hash]

    def persisted(self, hashes: Iterable[str]) -> list[str]:
        """Those of `hashes` that are held and known to be on SSD (or handed to the writer)."""
        with self._lock:
            entries = self._entries
            return [h for h in hashes if (e := entries.get(h)) is not None and e.persisted]

    def pin(self, hashes: Iterable[str]) -> None:
        with self._lock:
            for h in hashes:
                entry = self._entries.get(h)
                if entry is not None:
                    entry.pins += 1

    def unpin(self, hashes: Iterable[str]) -> None:
        """Release pins, then evict down to the budget."""
        with self._lock:
            for h in hashes:
                entry = self._entries.get(h)
                if entry is not None and entry.pins > 0:
                    entry.pins -= 1
            victims = self._collect_victims(self.capacity_bytes)
        self._notify(victims)

    def trim(self, max_bytes: int | None = None, max_blocks: int | None = None) -> int:
        """Evict least recently used unpinned blocks until at most `max_bytes` bytes and
        `max_blocks` blocks are held (the budget itself is unchanged); evicted blocks go through
        `on_evict` (write-back under `evict_only`). Pinned blocks stay.

        Returns:
            Blocks evicted.
        """
        with self._lock:
            victims = self._collect_victims(max_bytes, max_blocks)
        self._notify(victims)
        return len(victims)

    def remove(self, hashes: Iterable[str]) -> int:
        """Drop blocks, pinned or not (no eviction callbacks; a request holding one keeps its
        arrays). Returns how many were held."""
        n = 0
        with self._lock:
            for h in hashes:
                entry = self._entries.get(h)
                if entry is not None:
                    self._forget(h, entry)
                    n += 1
        return n

    def clear(self) -> list[Block]:
        """Drop every block (no eviction callbacks); returns the blocks that were held."""
        with self._lock:
            blocks = [e.block for e in self._entries.values()]
            self._entries.clear()
            self._children.clear()
            self._nbytes = 0
        return blocks

    def stats(self) -> dict[str, int]:
        with self._lock:
            out = dict(self._stats)
            out.update(kv_ram_blocks=len(self._entries), kv_ram_bytes=self._nbytes)
            return out

    def _collect_victims(self, max_bytes: int | None, max_blocks: int | None = None) -> list[_Entry]:
        """Pop least recently used unpinned entries until at most `max_bytes` bytes (None: any)
        and `max_blocks` blocks (None: any) are held; call under the lock.

        Walks from the LRU end and stops as soon as the bounds hold, so an insert costs
        O(evicted + pinned entries skipped), not O(entries).
        """
        victims: list[tuple[str, _Entry]] = []
        nbytes, count = self._nbytes, len(self._entries)
        for h, entry in self._entries.items():
            if not ((max_bytes is not None and nbytes > max_bytes) or (max_blocks is not None and count > max_blocks)):
                break
            if entry.pins:
                continue
            victims.append((h, entry))
            nbytes -= entry.block.nbytes
            count -= 1
        for h, entry in victims:
            self._forget(h, entry)
            self._stats["kv_ram_evictions"] += 1
            self._stats["kv_ram_evicted_bytes"] += entry.block.nbytes
        return [e for _, e in victims]

    def _notify(self, victims: list[_Entry]) -> None:
        if self._on_evict is None:
            return
        for entry in victims:
            self._on_evict(entry.block, entry.persisted)


class RamBlockTier(MemoryTier):
    """`BlockTier` over a `RamTier`: evaluated MLX blocks, exact token ids compared on lookup (a
    mismatch is a miss, counted `kv_ram_token_mismatch`), pinned while a request uses them.

    Args:
        ram: the RAM tier.
        on_hit: called with the hashes a lookup found that are persisted (the stack touches them
            on the local persistent tier); None: nothing.

    Attributes:
        new_persisted: new blocks (`Put.NEW`) count as handed to the local persistent tier (it is
            written through); set by the stack.
        has_backing: a local persistent tier exists (`Put.PERSIST` blocks are handed to it).
    """

    name = "ram"
    caps = Caps(in_memory=True, verifies_on_read=False, promotes=False)
    policy = WritePolicy.THROUGH

    def __init__(self, ram: RamTier, on_hit: Callable[[list[str]], None] | None = None):
        self.ram = ram
        self.on_hit = on_hit
        self.new_persisted = self.has_backing = False
        self._counts = Counts("kv_ram_token_mismatch", "kv_promote_hits")
        self.takes_promotions = ram.capacity_bytes > 0  # hits of lower tiers enter RAM (a budget of 0 keeps none)

    def _get(self, h: str, expected: np.ndarray) -> Block | None:
        block = self.ram.get(h)
        if block is None:
            return None
        if not np.array_equal(block.token_ids, expected):
            self._counts.inc("kv_ram_token_mismatch")
            return None
        return block

    def _found(self, hashes: list[str]) -> None:
        self.ram.pin(hashes)
        if self.on_hit is not None and hashes:
            self.on_hit(self.ram.persisted(hashes))

    def _children(self, parent: str) -> list[Block]:
        return self.ram.children(parent, MAX_MEMORY_SIBLINGS)

    def read_into(self, chain, handles, ids, buffers) -> ReadResult:
        """Copy the blocks into the buffers: one copy per tensor for consecutive blocks of one
        run (`run_groups`; blocks of runs have no state layers)."""
        buffers.ready()
        for i, _, n in run_groups(handles):
            buffers.place(chain[i].start, handles[i], n)
        return ReadResult(len(handles))

    def release(self, handles: Sequence[Any]) -> None:
        self.ram.unpin([b.block_hash for b in handles if isinstance(b, Block)])

    def put(self, blocks: Sequence[Block], why: Put) -> int:
        persisted = {Put.NEW: self.new_persisted, Put.PROMOTED: True, Put.PERSIST: self.has_backing}.get(why, False)
        for block in blocks:
            self.ram.put(block, persisted=persisted)
        if why is Put.PROMOTED:
            self._counts.inc("kv_promote_hits", len(blocks))
        return len(blocks)

    def remove(self, hashes: Sequence[str]) -> int:
        return self.ram.remove(hashes)

    def stats(self) -> dict[str, int]:
        return {**self.ram.stats(), **self._counts.snapshot()}

    def close(self, timeout_s: float) -> bool:
        self.ram.clear()
        return True
