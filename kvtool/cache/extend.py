"""Where a prompt's chain walk stops: the chain's entries, and the extension of a partial hit there.

A walk over the tiers stops at the first chain entry no tier holds (parent `P`, first token `s`).
The hit is extended there with the longest of an earlier prompt's tail entry whose key matches
exactly (`kvtool.tiers.tail_prefix`; not with KV quantization, whose switch point depends on where
chunks end) and a sibling block's common token prefix (`kvtool.tiers.siblings`; not with state
layers, whose state exists only at block ends). `PrefixCache.fetch` asks every tier of its stack,
`PrefixCache.probe` only the local persistent one. Whatever is found is placed and verified like
any chain entry; a quantized sibling is cut to where mlx-lm's cache would be quantized alike.

MLX-free except through `PlacedBlock` (a sibling already in hand).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtool.hashing import HashFn, root_parent
from kvtool.kv.model_kv import KVQuantization
from kvtool.tiers import siblings, tail_prefix
from kvtool.tiers.base import BlockTier, ChainEntry, PlacedBlock


def chain_entries(layout_key: str, block_size: int, n_tokens: int, full: list[str], tail: str | None) -> list[ChainEntry]:
    """A prompt's chain: its full blocks (hashes `full`), then its tail entry (`tail`), each with
    its parent and token range."""
    parent = root_parent(layout_key)
    out = []
    for i, h in enumerate(full):
        out.append(ChainEntry(h, parent, i * block_size, (i + 1) * block_size))
        parent = h
    if tail is not None:
        out.append(ChainEntry(tail, parent, len(full) * block_size, n_tokens))
    return out


def quant_usable(quant: KVQuantization | None, cached: int, n_prompt: int) -> bool:
    """Plain KV: always. Quantized: only where mlx-lm's cache is quantized alike (a full hit is
    used with its last token trimmed)."""
    if quant is None:
        return True
    return quant.usable(cached - 1 if cached == n_prompt else cached, n_prompt)


@dataclass
class Extension:
    """What stands at the stop instead of the chain's own entry.

    Attributes:
        entry: its chain entry (its key, the stop's parent, `[s, s + n)`).
        tier: where it is read from (a `PlacedBlock` for a sibling, already read and verified).
        handle: the tier's handle (hold it until the request is done).
        sibling: a sibling's common prefix (else an earlier prompt's tail entry).
        nbytes_read: bytes read by the sibling lookup (every candidate).
    """

    entry: ChainEntry
    tier: Any
    handle: Any
    sibling: bool
    nbytes_read: int = 0


def extend(tiers: Sequence[BlockTier], e: ChainEntry, ids: np.ndarray, *, hash_fn: HashFn, block_size: int,
           quant: KVQuantization | None, has_states: bool, count: bool = True) -> Extension | None:  # fmt: skip
    """The longest extension at the stop `e` (the first entry no tier holds) that `tiers` hold.

    Args:
        tiers: the tiers to ask, fastest first.
        e: the chain entry where the walk stopped.
        ids: int32 prompt token ids `[T]`.
        hash_fn: the chain hash function.
        block_size: tokens per block.
        quant: the namespace's KV quantization, or None.
        has_states: the model has state layers (no sibling prefixes).
        count: tell a sibling's tier it served (SSD: touch its row, count the load).

    Returns:
        The extension, or None.
    """
    best = None
    if quant is None:
        cands = tail_prefix.candidates(hash_fn, block_size, ids, e.parent, e.start)
        best = tail_prefix.find([t for t in tiers if t.caps.finds_tails], cands, ids, e.start)
    k = best[3] if best is not None else 0
    sib = None
    if not has_states:
        sib = siblings.find([t for t in tiers if t.caps.lists_siblings], block_size, e.parent, ids, e.start,
                            longer_than=k, quantized=quant is not None, count=count)  # fmt: skip
    if sib is not None and quant is not None:
        sib = _quant_sibling(quant, sib, e.start, int(ids.size))
    if sib is not None:
        if best is not None:
            best[0].release([best[1]])
        entry = ChainEntry(sib.key, e.parent, e.start, e.start + sib.n)
        return Extension(entry, PlacedBlock(sib.tier, sib.block), sib.block, True, sib.nbytes_read)
    if best is None:
        return None
    tier, handle, h, k = best
    return Extension(ChainEntry(h, e.parent, e.start, e.start + k), tier, handle, False)


def _quant_sibling(quant: KVQuantization, sib: siblings.Sibling, start: int, n_prompt: int) -> siblings.Sibling | None:
    """A sibling hit where mlx-lm's quantized cache would be in the same state: its whole length,
    or cut to the switch point when that lies inside it, or none."""
    if quant_usable(quant, start + sib.n, n_prompt):
        return sib
    q = quant.switch_point(n_prompt)
    if start < q < start + sib.n and quant_usable(quant, q, n_prompt):
        sib.block, sib.n = siblings.truncate(sib.block, q - start), q - start
        return sib
    return None


__all__ = ["Extension", "chain_entries", "extend", "quant_usable"]
