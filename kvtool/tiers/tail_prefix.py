"""Tail prefix hits: an earlier prompt's tail entry serves a longer prompt that extends it
(docs/design.md#tail-entries).

A tail entry holds the KV of a prompt's last `k < block_size` tokens after its parent block, and a
token's KV depends only on the tokens up to it, so it also serves any prompt with the same chain
and the same `k` tokens next (the next turn of a chat; a prompt extending an imported
`mlx_lm.cache_prompt` file). Where a fetch's chain walk stops (parent `P`, start `s`), `candidates`
gives the keys `hash_fn(P, ids[s:s+k])` of every `k` from `min(block_size - 1, len(ids) - s - 1)`
down to 1 (at least one prompt token is left to prefill: a full hit stays the prompt's own tail
entry's job); `find` asks the tiers fastest first, each for the lengths longer than what an
earlier tier had; the longest wins and is placed and verified like any chain entry. It is not an
entry of the new prompt's own chain, so `PrefixCache.store` still writes the prompt's own block.
With state layers a hit ending in an earlier prompt's tail re-forwards its last token (the tail's
state is the one before it). Not for KV quantization (the switch point depends on where chunks
end). MLX-free.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from kvtool.hashing import HashFn, blake2b_chain, blake2b_chain_prefixes

if TYPE_CHECKING:
    from kvtool.tiers.base import BlockTier

Found = tuple[Any, Any, str, int]  # (tier, its handle: Block | HostBlock | IndexRow, key, k)


def candidates(hash_fn: HashFn, block_size: int, ids: np.ndarray, parent: str, start: int) -> list[tuple[str, int]]:
    """Keys of the tail entries that could stand at token `start` after block `parent`.

    Args:
        hash_fn: the chain hash function (`kvtool.hashing.blake2b_chain`).
        block_size: tokens per block.
        ids: int32 prompt token ids `[T]`.
        parent: chain hash (32 hex) of the block before `start` (the layout's root parent at 0).
        start: token offset where the chain walk stopped.

    Returns:
        `(key, k)` for `k` from `min(block_size - 1, T - start - 1)` down to 1 (longest first).
    """
    key = bytes.fromhex(parent)
    kmax = min(block_size - 1, int(ids.size) - start - 1)
    if hash_fn is blake2b_chain:  # the default hash: the keys of all lengths in one pass
        keys = blake2b_chain_prefixes(key, ids[start : start + kmax])
        return [(keys[k - 1], k) for k in range(kmax, 0, -1)]
    return [(hash_fn(key, ids[start : start + k]), k) for k in range(kmax, 0, -1)]


def find(tiers: Sequence[BlockTier], cands: list[tuple[str, int]], ids: np.ndarray, start: int) -> Found | None:
    """The longest candidate any tier holds with exactly the prompt's token ids, or None.

    Tiers are asked fastest first (`BlockTier.find_any`), each only for candidates longer than
    what an earlier tier had; a shorter handle found first is released. In-memory tiers compare
    token ids here; the SSD tier only looks its rows up (the restore verifies them).

    Returns:
        `(tier, handle, key, k)`: hold `handle` until the request is done (`tier.release`).
    """
    best: Found | None = None
    for tier in tiers:
        longer = [(h, k) for h, k in cands if best is None or k > best[3]]
        if not longer:
            break
        got = tier.find_any(longer, ids, start)
        if got is not None:
            if best is not None:
                best[0].release([best[1]])
            best = (tier, *got)
    return best


__all__ = ["candidates", "find"]
