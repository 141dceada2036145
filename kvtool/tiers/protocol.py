"""The tiers of a prefix cache behind one interface: `BlockTier`, and the RAM, pending and SSD tiers.

`PrefixCache` walks an ordered stack of tiers (fastest first: RAM, the SSD writer's pending
buffer, SSD, then a remote tier when configured) and names none of them: at each chain position
the first tier that holds the next entries gives its longest run (`longest_prefix`), and the hit
is then placed run by run (`read_into`) into the request's buffers, each tier verifying what it
reads. A tier after this is one module implementing `BlockTier` and one config section.

The read side of the protocol:
- `longest_prefix(chain, ids)`: handles of the leading entries of `chain` the tier holds (token
  ids checked where that is free, i.e. for blocks already in memory; a tier that must read to
  check returns index rows and checks in `read_into`). RAM pins what it returns.
- `read_into(chain, handles, ids, buffers)`: place them, verified, at their token offsets;
  returns how many leading ones were placed (the first failure cuts the chain there).
- `find_any(cands, ids, start)`: the longest of candidate tail-entry keys it holds (tail prefix
  hits, `kvtool.tiers.tail_prefix`).
- `sibling_candidates(parent, skip)`: blocks stored under `parent`, for partial-block hits
  (`kvtool.tiers.siblings`); a tier that cannot list them cheaply yields none.
- `release(handles)`: the request is done with them (RAM unpins).
The write side (`put`, `remove`, `stats`, `close`) is driven by `TieredCache` per policy:
writes flow down (RAM, then the writer per `ssd_policy`); hits in a lower tier are promoted up
(`promote`: into RAM as views of the request's cache at `PrefixCache.release`).

Attributes every tier has: `kind` ('ram' | 'ssd' | 'remote': which hit counter its tokens go
to; the pending buffer counts as SSD, as before), `in_memory` (handles are MLX `Block`s a hit
made only of such can be concatenated without buffers), `promote`, and `to_ssd` (its hits are
also written to the local SSD tier at `PrefixCache.release`, from the same views: the remote
tier with `remote_promote`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import numpy as np

from kvtool.disk import restore
from kvtool.disk.hostblock import HostBlock
from kvtool.kv.blocks import Block

if TYPE_CHECKING:
    from kvtool.disk.namespace import SSDStore
    from kvtool.kv.buffers import KVBuffers
    from kvtool.tiers.ram import RamTier
    from kvtool.tiers.writer import Writer

MAX_MEMORY_SIBLINGS = 64  # RAM / pending siblings compared per partial-block lookup (newest first)
MAX_SSD_SIBLINGS = 4  # SSD siblings read and verified per partial-block lookup (most recently used first)


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


class BlockTier(Protocol):
    """A tier of the prefix cache (see the module docstring)."""

    kind: str
    in_memory: bool
    promote: bool
    to_ssd: bool

    def longest_prefix(self, chain: Sequence[ChainEntry], ids: np.ndarray) -> list[Any]: ...

    def find_any(self, cands: Sequence[tuple[str, int]], ids: np.ndarray, start: int) -> tuple[Any, str, int] | None: ...

    def sibling_candidates(self, parent: str, skip: set[str]) -> Iterator[tuple[Block | HostBlock, int]]: ...

    def read_into(self, chain: Sequence[ChainEntry], handles: Sequence[Any], ids: np.ndarray,
                  buffers: KVBuffers) -> ReadResult: ...

    def release(self, handles: Sequence[Any]) -> None: ...


class RamBlockTier:
    """The RAM tier (`RamTier`): evaluated MLX blocks, token ids compared on lookup, pinned
    while a request uses them."""

    kind, in_memory, promote, to_ssd = "ram", True, False, False

    def __init__(self, ram: RamTier, on_hit=None, on_mismatch=None):
        self.ram = ram
        self._on_hit = on_hit  # called with the hashes of the blocks a lookup found (touch on SSD)
        self._on_mismatch = on_mismatch

    def _get(self, h: str, expected: np.ndarray) -> Block | None:
        block = self.ram.get(h)
        if block is None:
            return None
        if not np.array_equal(block.token_ids, expected):
            if self._on_mismatch is not None:
                self._on_mismatch()
            return None
        return block

    def _found(self, hashes: list[str]) -> None:
        self.ram.pin(hashes)
        if self._on_hit is not None and hashes:
            self._on_hit(hashes)

    def longest_prefix(self, chain: Sequence[ChainEntry], ids: np.ndarray) -> list[Block]:
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

    def sibling_candidates(self, parent: str, skip: set[str]) -> Iterator[tuple[Block, int]]:
        yield from ((b, 0) for b in self.ram.children(parent, MAX_MEMORY_SIBLINGS) if b.block_hash not in skip)

    def read_into(self, chain, handles, ids, buffers) -> ReadResult:
        buffers.ready()
        for e, block in zip(chain, handles):
            buffers.place(e.start, block)
        return ReadResult(len(handles))

    def release(self, handles: Sequence[Any]) -> None:
        self.ram.unpin([b.block_hash for b in handles if isinstance(b, Block)])


class PendingTier:
    """Blocks accepted by the SSD writer and not written yet (host arrays): a hit like SSD."""

    kind, in_memory, promote, to_ssd = "ssd", False, True, False

    def __init__(self, writer: Writer, on_hit=None):
        self.writer = writer
        self._on_hit = on_hit

    def _get(self, h: str, expected: np.ndarray) -> HostBlock | None:
        host = self.writer.get_pending(h)
        if host is None or not np.array_equal(host.token_ids, expected):
            return None
        if self._on_hit is not None:
            self._on_hit()
        return host

    def longest_prefix(self, chain: Sequence[ChainEntry], ids: np.ndarray) -> list[HostBlock]:
        out = []
        for e in chain:
            host = self._get(e.hash, ids[e.start : e.stop])
            if host is None:
                break
            out.append(host)
        return out

    def find_any(self, cands, ids, start) -> tuple[Any, str, int] | None:
        for h, k in cands:
            host = self._get(h, ids[start : start + k])
            if host is not None:
                return host, h, k
        return None

    def sibling_candidates(self, parent: str, skip: set[str]) -> Iterator[tuple[HostBlock, int]]:
        pending = self.writer.pending_children(parent, MAX_MEMORY_SIBLINGS)
        yield from ((b, 0) for b in pending if b.block_hash not in skip)

    def read_into(self, chain, handles, ids, buffers) -> ReadResult:
        buffers.ready()
        for e, host in zip(chain, handles):
            buffers.place_host(e.start, host)
        return ReadResult(len(handles))

    def release(self, handles: Sequence[Any]) -> None:
        pass


class SsdBlockTier:
    """The SSD tier (`SSDStore`): index rows on lookup (one query for the rest of a chain),
    records restored and verified straight into the buffers (`kvtool.disk.restore`)."""

    kind, in_memory, promote, to_ssd = "ssd", False, True, False

    def __init__(self, ssd: SSDStore):
        self.ssd = ssd

    def longest_prefix(self, chain: Sequence[ChainEntry], ids: np.ndarray) -> list[Any]:
        return self.ssd.lookup([e.hash for e in chain])

    def find_any(self, cands, ids, start) -> tuple[Any, str, int] | None:
        rows = self.ssd.rows_of([h for h, _ in cands])
        return next(((rows[h], h, k) for h, k in cands if h in rows), None)

    def sibling_candidates(self, parent: str, skip: set[str]) -> Iterator[tuple[HostBlock, int]]:
        for row in self.ssd.children(parent, MAX_SSD_SIBLINGS):
            if row.hash in skip:
                continue
            block = self.ssd.read_row(row, parent)  # read whole and verified
            if block is not None:
                yield block, row.nbytes

    def sibling_used(self, h: str, nbytes: int) -> None:
        """A sibling read from here served a hit: touch its row, count the load (bytes)."""
        self.ssd.record_hits([h], nbytes)

    def read_into(self, chain, handles, ids, buffers) -> ReadResult:
        res = restore.restore_chain(self.ssd, handles, chain[0].parent, ids, [e.start for e in chain],
                                    buffers.pieces, ready=buffers.ready)
        return ReadResult(res.n_ok, res.bytes_read)

    def release(self, handles: Sequence[Any]) -> None:
        pass


class PlacedBlock:
    """A block already in hand (a sibling truncated to the tokens it serves): placed as it is,
    never promoted (its hash names the whole sibling, not this prompt's tokens)."""

    promote = to_ssd = False

    def __init__(self, kind: str, block: Block | HostBlock):
        self.kind = kind
        self.in_memory = isinstance(block, Block)
        self.block = block

    def read_into(self, chain, handles, ids, buffers) -> ReadResult:
        buffers.ready()
        for e, b in zip(chain, handles):
            (buffers.place if isinstance(b, Block) else buffers.place_host)(e.start, b)
        return ReadResult(len(handles))

    def release(self, handles: Sequence[Any]) -> None:
        pass


__all__ = ["BlockTier", "ChainEntry", "MAX_MEMORY_SIBLINGS", "MAX_SSD_SIBLINGS", "PendingTier", "PlacedBlock", "RamBlockTier",
           "ReadResult", "SsdBlockTier"]
