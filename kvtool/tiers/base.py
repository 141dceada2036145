"""The tier interface of the prefix cache: `BlockTier` (reads and writes), its capability flags
(`Caps`), and the values it trades in (`ChainEntry`, `ReadResult`, `Put`, `WritePolicy`).

`TierStack` (`kvtool.tiers.stack`) holds an ordered list of tiers, fastest first (RAM, the SSD
writer's pending buffer, SSD, then a remote tier when configured), and names none of them: it
branches on each tier's `caps`, `policy` and `takes_promotions`, never on a class or a name.

Reads (the request thread, `PrefixCache.fetch`):
- `longest_prefix(chain, ids)`: handles of the leading entries of `chain` the tier holds. A tier
  whose blocks are in memory compares token ids here (`caps.verifies_on_read` False); one that
  must read to check returns index rows / keys and verifies in `read_into`. RAM pins what it
  returns.
- `read_into(chain, handles, ids, buffers)`: place them at their token offsets into the request's
  `KVBuffers`, verified (layout key, parent, exact token ids, checksum); returns how many leading
  ones were placed: the first failure cuts the chain there (a miss, recomputed).
- `find_any(cands, ids, start)`: the first of candidate tail-entry keys `(key, k)` it holds
  (`caps.finds_tails`; `kvtool.tiers.tail_prefix`).
- `sibling_candidates(parent, skip)`: blocks stored under `parent` with the bytes read to get
  each (`caps.lists_siblings`; `kvtool.tiers.siblings`); `sibling_used(key, nbytes)` when one
  served a hit.
- `touch(hashes)`: RAM served these blocks, which this tier holds too (its LRU / TTL view).
- `release(handles)`: the request is done with them (RAM unpins, remote cancels reads ahead).
Writes (`TierStack`, per policy):
- `put(blocks, why)`: MLX `Block`s (`[1, n_kv_heads, n, head_dim]` per layer) handed to the tier:
  new blocks of a request (`Put.NEW`, where `policy` is `WritePolicy.THROUGH`), blocks RAM evicts
  (`Put.EVICTED`, where `policy` is `WritePolicy.ON_EVICT`), verified hits of a lower tier
  (`Put.PROMOTED`, where `takes_promotions`), blocks a caller promised to the local persistent
  tier (`Put.PERSIST`, `kvtool warm`: never shed). Returns how many it accepted. Never raises for
  a storage failure (the cache never fails a request).
- `remove(hashes)`, `stats()` (counters, names prefixed by the tier's owner), `flush(timeout_s)`,
  `close(timeout_s)` (True: every accepted write was attempted). After `close`, reads miss and
  `release` is a no-op.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import numpy as np

from kvtool.kv.blocks import Block

if TYPE_CHECKING:
    from kvtool.disk.hostblock import HostBlock
    from kvtool.kv.buffers import KVBuffers


class ChainEntry(NamedTuple):
    """One entry of a prompt's chain: a full block or the prompt's tail entry.

    Attributes:
        hash: chain hash (32 hex).
        parent: the previous entry's hash (the layout's root parent for the first).
        start, stop: its token range `[start, stop)` in the prompt (tokens).
    """

    hash: str
    parent: str
    start: int
    stop: int


@dataclass
class ReadResult:
    """What `read_into` placed: leading entries (`n_ok`) and record bytes read (bytes)."""

    n_ok: int
    bytes_read: int = 0


class Put(enum.Enum):
    """Why blocks are handed to a tier's `put` (see the module docstring)."""

    NEW = "new"
    EVICTED = "evicted"
    PROMOTED = "promoted"
    PERSIST = "persist"


class WritePolicy(enum.Enum):
    """When a tier is written: every new block (`THROUGH`, write-through), blocks RAM evicts
    (`ON_EVICT`, write-back), or never by the stack (`OFF`: the tier fills itself, or is read-only)."""

    THROUGH = "through"
    ON_EVICT = "on_evict"
    OFF = "off"


@dataclass(frozen=True)
class Caps:
    """What a tier can do; `TierStack` and `PrefixCache` branch on these, never on a class.

    Attributes:
        in_memory: handles are evaluated MLX `Block`s: a hit made only of such is concatenated,
            no buffers.
        verifies_on_read: `read_into` verifies what it reads (header, parent, token ids,
            checksum); False: token ids were compared by `longest_prefix` already.
        finds_tails: `find_any` can answer (else it returns None at no cost).
        lists_siblings: `sibling_candidates` can yield (else it yields nothing at no cost).
        promotes: its hits are promoted into the tiers above that take promotions.
        removes: `remove` drops blocks (the pending buffer cannot: its blocks leave when written).
        persistent: what it holds survives a restart of the process (reopened from its store).
        backs_ram: the local persistent tier: RAM's `persisted` flag means "handed to this
            tier"; RAM hits on persisted blocks touch it; `Put.PERSIST` goes to it.
    """

    in_memory: bool = False
    verifies_on_read: bool = True
    finds_tails: bool = True
    lists_siblings: bool = True
    promotes: bool = True
    removes: bool = True
    persistent: bool = False
    backs_ram: bool = False


class BlockTier(Protocol):
    """A tier of the prefix cache (see the module docstring).

    Attributes:
        name: the hit counter its tokens go to (`CacheHit.tier_tokens`, the JSON fields
            `<name>_hit_tokens`): 'ram', 'ssd' (the pending buffer counts as SSD) or 'remote'.
        caps: its capabilities.
        policy: when the stack writes it (from the config).
        takes_promotions: verified hits of the tiers below it are `put` here at release.
    """

    name: str
    caps: Caps
    policy: WritePolicy
    takes_promotions: bool

    def longest_prefix(self, chain: Sequence[ChainEntry], ids: np.ndarray) -> list[Any]: ...

    def read_into(self, chain: Sequence[ChainEntry], handles: Sequence[Any], ids: np.ndarray,
                  buffers: KVBuffers) -> ReadResult: ...

    def find_any(self, cands: Sequence[tuple[str, int]], ids: np.ndarray, start: int) -> tuple[Any, str, int] | None: ...

    def sibling_candidates(self, parent: str, skip: set[str]) -> Iterator[tuple[Block | HostBlock, int]]: ...

    def sibling_used(self, key: str, nbytes: int) -> None: ...

    def touch(self, hashes: list[str]) -> None: ...

    def release(self, handles: Sequence[Any]) -> None: ...

    def put(self, blocks: Sequence[Block], why: Put) -> int: ...

    def remove(self, hashes: Sequence[str]) -> int: ...

    def stats(self) -> dict[str, int]: ...

    def flush(self, timeout_s: float) -> bool: ...

    def close(self, timeout_s: float) -> bool: ...


class TierBase:
    """Defaults for a tier that lacks a capability: no tail entries, no siblings, nothing to
    release, no writes, no counters, nothing to flush or close."""

    name = "ssd"
    caps = Caps()
    policy = WritePolicy.OFF
    takes_promotions = False

    def find_any(self, cands: Sequence[tuple[str, int]], ids: np.ndarray, start: int) -> tuple[Any, str, int] | None:
        return None

    def sibling_candidates(self, parent: str, skip: set[str]) -> Iterator[tuple[Any, int]]:
        return iter(())

    def sibling_used(self, key: str, nbytes: int) -> None:
        pass

    def touch(self, hashes: list[str]) -> None:
        pass

    def release(self, handles: Sequence[Any]) -> None:
        pass

    def put(self, blocks: Sequence[Block], why: Put) -> int:
        return 0

    def remove(self, hashes: Sequence[str]) -> int:
        return 0

    def stats(self) -> dict[str, int]:
        return {}

    def flush(self, timeout_s: float) -> bool:
        return True

    def close(self, timeout_s: float) -> bool:
        return True


class Counts:
    """A tier's own counters (ints, thread-safe), all present from the start."""

    def __init__(self, *names: str) -> None:
        self._lock = threading.Lock()
        self._n = dict.fromkeys(names, 0)

    def inc(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._n[name] += n

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._n)


class MemoryTier(TierBase):
    """A tier whose blocks are in memory (RAM, the pending buffer): `_get` gives a block only if
    its token ids equal the prompt's exactly (else a miss), so lookups verify and `read_into`
    copies."""

    caps = Caps(verifies_on_read=False)

    def _get(self, h: str, expected: np.ndarray) -> Any:
        raise NotImplementedError

    def _found(self, hashes: list[str]) -> None:
        """A lookup found these blocks (RAM pins them)."""

    def _children(self, parent: str) -> list[Any]:
        return []

    def longest_prefix(self, chain: Sequence[ChainEntry], ids: np.ndarray) -> list[Any]:
        out = []
        for e in chain:
            block = self._get(e.hash, ids[e.start : e.stop])
            if block is None:
                break
            out.append(block)
        self._found([b.block_hash for b in out])
        return out

    def find_any(self, cands: Sequence[tuple[str, int]], ids: np.ndarray, start: int) -> tuple[Any, str, int] | None:
        for h, k in cands:
            block = self._get(h, ids[start : start + k])
            if block is not None:
                self._found([h])
                return block, h, k
        return None

    def sibling_candidates(self, parent: str, skip: set[str]) -> Iterator[tuple[Any, int]]:
        yield from ((b, 0) for b in self._children(parent) if b.block_hash not in skip)


def place_held(chain: Sequence[ChainEntry], handles: Sequence[Any], buffers: KVBuffers) -> ReadResult:
    """`read_into` of blocks already in hand and checked (MLX `Block`s or `HostBlock`s): each
    placed at its entry's first token."""
    buffers.ready()
    for e, b in zip(chain, handles):
        (buffers.place if isinstance(b, Block) else buffers.place_host)(e.start, b)
    return ReadResult(len(handles))


class PlacedBlock(TierBase):
    """A block already in hand (a sibling truncated to the tokens it serves), counted to the tier
    it came from; placed as it is, never promoted (its hash names the whole sibling, not this
    prompt's tokens)."""

    def __init__(self, tier: BlockTier, block: Block | HostBlock):
        self.name = tier.name
        self.caps = Caps(in_memory=tier.caps.in_memory, promotes=False)
        self.block = block

    def longest_prefix(self, chain: Sequence[ChainEntry], ids: np.ndarray) -> list[Any]:
        return [self.block][: len(chain)]

    def read_into(self, chain, handles, ids, buffers) -> ReadResult:
        return place_held(chain, handles, buffers)


__all__ = ["BlockTier", "Caps", "ChainEntry", "Counts", "MemoryTier", "PlacedBlock", "Put", "ReadResult", "TierBase", "WritePolicy",
           "place_held"]
