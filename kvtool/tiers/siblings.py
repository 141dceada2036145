"""Partial-block prefix hits: the longest common token prefix of a stored sibling block
(docs/design.md#partial-block-hits).

Where a prompt's chain walk stops (parent `P`, first token `s`) inside a prefix it shares with an
earlier prompt, that prompt's block under the same parent `P` (a *sibling*) holds the KV of the
tokens both share, and a token's KV depends only on the tokens up to it. So the sibling's first
`L` tokens serve this prompt, `L` being the common prefix of its token ids and `ids[s:]`, capped
so that at least one prompt token is left to prefill (as mlx-lm's in-memory prompt cache trims
its nearest entry). `find` asks the tiers fastest first (`BlockTier.sibling_candidates`: RAM and
the pending buffer, newest first; then the most recently used SSD rows, read whole and verified).
The winner is returned *truncated* to its `L` tokens (views, no copy) and placed like any chain
entry; it is never promoted or stored under its own hash (its hash names the whole sibling).

Exactness rules:
- Plain `KVCache` and sliding-window layers (restored as full views): any prefix of a block is
  the KV of those tokens.
- State layers (`ArraysCache`): a state exists only at a block's end, so partial hits are not
  used (`PrefixCache` keeps block-boundary and tail-entry reuse for them).
- Quantized KV: a block is stored only with canonical content (`KVQuantization`), except the
  last token of a tail entry, which may have been computed after a non-canonical switch; so a
  tail-entry sibling (fewer than `block_size` tokens) gives at most its first `n - 1` tokens, and
  the caller's `usable` check of the hit's end applies as for any hit.
MLX-free.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kvtool.disk.hostblock import HostBlock

if TYPE_CHECKING:
    from kvtool.tiers.base import BlockTier


NO_TOKEN = -(1 << 40)  # pads a shorter sibling's row: equal to no int32 token id


@dataclass
class Sibling:
    """The best sibling of a lookup, truncated to the tokens it serves.

    Attributes:
        kind: the hit counter of the tier it came from ('ram' | 'ssd' | 'remote').
        block: `kvtool.kv.blocks.Block` (RAM) or `HostBlock` (pending, SSD), truncated to `n`
            tokens: views `[..., :n, :]` of the sibling's arrays.
        key: chain hash of the whole sibling (it names the sibling's tokens, not this prompt's).
        n: leading tokens reused (>= 1).
        nbytes_read: bytes read from a storage tier by the lookup (every candidate, chosen or not).
        tier: the `BlockTier` it came from.
    """

    kind: str
    block: Any
    key: str
    n: int
    nbytes_read: int = 0
    tier: Any = None


def usable_lens(ids: np.ndarray, start: int, limit: int, token_ids: Sequence[np.ndarray], block_size: int,
                quantized: bool) -> np.ndarray:
    """Tokens of each sibling that may serve the prompt at `start`: the common prefix of its token
    ids and `ids[start : start + limit]`, capped for a quantized tail (see the module docstring).

    Args:
        ids: int32 prompt token ids `[T]`; `start + limit <= T`.
        start: token offset where the chain walk stopped.
        limit: tokens a sibling may give at most (>= 1).
        token_ids: each sibling's int32 token ids `[n_i]`, `n_i <= block_size`.
        block_size: tokens per block.
        quantized: the namespace holds quantized KV.

    Returns:
        int64 `[len(token_ids)]`, each in `[0, limit]` (tokens); one comparison for all siblings.
    """
    rows = np.full((len(token_ids), limit), NO_TOKEN, dtype=np.int64)
    for i, t in enumerate(token_ids):
        cap = min(limit, t.size - 1) if quantized and t.size < block_size else limit  # a tail's last token may be off
        if cap > 0:
            rows[i, : min(cap, t.size)] = t[:cap]
    same = rows == ids[start : start + limit]
    return np.where(same.all(axis=1), limit, same.argmin(axis=1))


def find(tiers: Sequence[BlockTier], block_size: int, parent: str, ids: np.ndarray, start: int, *,
         longer_than: int = 0, quantized: bool = False, count: bool = True) -> Sibling | None:
    """The sibling of `parent` sharing the longest token prefix with `ids[start:]`, if longer
    than `longer_than` tokens (the first such candidate on ties, tiers fastest first).

    Candidates already in memory (RAM, the pending buffer) are compared all at once
    (`usable_lens`); a candidate that cost a read (SSD, remote) is compared as soon as it is
    read, so that a longest possible match stops the reads.

    Args:
        tiers: the tier stack, fastest first (`BlockTier.sibling_candidates`): RAM, the pending
            buffer, then SSD rows read whole and verified.
        block_size: tokens per block.
        parent: chain hash (32 hex) of the block before `start`.
        ids: int32 prompt token ids `[T]`.
        start: token offset where the chain walk stopped (a multiple of the block size).
        longer_than: a hit already found (tokens): only a longer one is returned.
        quantized: the namespace holds quantized KV (see the module docstring).
        count: tell the winner's tier it was used (SSD: touch its row, count the load).

    Returns:
        A `Sibling` truncated to its reusable tokens, or None.
    """
    limit = min(block_size, int(ids.size) - start - 1)  # leave at least one prompt token to prefill
    if limit <= longer_than:
        return None
    best: Sibling | None = None
    seen: set[str] = set()
    read = 0

    def judge(tier: Any, blocks: list) -> None:
        nonlocal best
        lens = usable_lens(ids, start, limit, [b.token_ids for b in blocks], block_size, quantized)
        i = int(lens.argmax())  # the first of the longest
        if lens[i] > max(longer_than, best.n if best else 0):
            best = Sibling(tier.name, blocks[i], blocks[i].block_hash, int(lens[i]), tier=tier)

    for tier in tiers:
        if best is not None and best.n == limit:
            break
        held: list = []
        for block, nbytes in tier.sibling_candidates(parent, seen):
            seen.add(block.block_hash)
            read += nbytes
            held.append(block)
            if nbytes:  # it was read: judge it now, the next one costs another read
                judge(tier, held)
                held = []
                if best is not None and best.n == limit:
                    break
        if held:
            judge(tier, held)
    if best is None:
        return None
    best.nbytes_read = read
    if count:
        best.tier.sibling_used(best.key, best.nbytes_read)
    best.block = truncate(best.block, best.n)
    return best


def truncate(block: Any, n: int) -> Any:
    """The first `n` tokens of a `Block` or `HostBlock`, as views of its arrays (every KV
    array, packed quantized words and scales included, has tokens on axis -2)."""
    if n == block.num_tokens:
        return block
    keys = [k[..., :n, :] for k in block.keys]
    values = [v[..., :n, :] for v in block.values]
    if isinstance(block, HostBlock):
        return HostBlock(block.block_hash, block.parent_hash, block.token_ids[:n], keys, values, block.dtype)
    return type(block)(block.block_hash, block.parent_hash, block.token_ids[:n], keys, values)


__all__ = ["Sibling", "find", "truncate", "usable_lens"]
