"""Partial-block prefix hits: the longest common token prefix of a stored sibling block.

A prompt's chain walk stops at its first block that no tier holds: parent `P`, first token `s`.
Where two prompts share a prefix that ends inside a block (a system prompt followed by distinct
user turns), an earlier prompt's block under the same parent `P` — a *sibling* — holds the KV of
the tokens both prompts share, and a token's KV depends only on the tokens up to it. So the
sibling's first `L` tokens serve this prompt, `L` being the length of the common prefix of the
sibling's token ids and `ids[s:]`, capped so that at least one prompt token is left to prefill.
This is what mlx-lm's in-memory prompt cache does when it trims its nearest entry to the common
prefix; without it a block cache re-prefills up to `block_size - 1` shared tokens per request.

`find` looks at the siblings of `P` in RAM (`RamTier.children`, newest first, up to
`MAX_RAM_SIBLINGS`), in the writer's pending buffer, and — if neither gave the longest possible
prefix — at the `MAX_SSD_SIBLINGS` most recently used sibling rows of the SSD index (one query on
the parent column). SSD siblings are read whole and verified like every record (header, slot,
parent, checksum over the whole record; `SSDStore.read_row`), then compared and sliced. The
winner is returned *truncated* to its `L` tokens (views, no copy), so it is placed like any chain
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

This module never imports MLX.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kvtool.hostblock import HostBlock

if TYPE_CHECKING:
    from kvtool.store.ssd import SSDStore
    from kvtool.store.tiered import TieredCache

MAX_RAM_SIBLINGS = 64  # RAM / pending siblings compared per lookup (newest first)
MAX_SSD_SIBLINGS = 4  # SSD siblings read and verified per lookup (most recently used first)


@dataclass
class Sibling:
    """The best sibling of a lookup, truncated to the tokens it serves.

    Attributes:
        source: 'ram' | 'pending' | 'ssd' (the tier it came from).
        block: `kvtool.blocks.Block` (RAM) or `HostBlock` (pending, SSD), truncated to `n`
            tokens: views `[..., :n, :]` of the sibling's arrays.
        key: chain hash of the whole sibling (it names the sibling's tokens, not this prompt's).
        n: leading tokens reused (>= 1).
        nbytes_read: record bytes read from SSD by the lookup (every candidate, chosen or not).
    """

    source: str
    block: Any
    key: str
    n: int
    nbytes_read: int = 0


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the common prefix of two int32 token arrays (tokens)."""
    n = min(a.size, b.size)
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


def _usable_len(ids: np.ndarray, start: int, limit: int, tokens: np.ndarray, block_size: int, quantized: bool) -> int:
    """Tokens of a sibling holding `tokens` that may serve the prompt at `start` (0: none)."""
    cap = limit
    if quantized and tokens.size < block_size:
        cap = min(cap, tokens.size - 1)  # a tail entry's last token may be off the canonical trajectory
    return common_prefix(ids[start : start + cap], tokens[:cap]) if cap > 0 else 0


def find(tier: TieredCache, parent: str, ids: np.ndarray, start: int, *, longer_than: int = 0,
         quantized: bool = False) -> Sibling | None:
    """The sibling of `parent` sharing the longest token prefix with `ids[start:]`, if longer
    than `longer_than` tokens.

    Args:
        tier: the namespace's tiers.
        parent: chain hash (32 hex) of the block before `start`.
        ids: int32 prompt token ids `[T]`.
        start: token offset where the chain walk stopped (a multiple of the block size).
        longer_than: a hit already found (tokens): only a longer one is returned.
        quantized: the namespace holds quantized KV (see the module docstring).

    Returns:
        A `Sibling` truncated to its reusable tokens, or None.
    """
    bs = tier.block_size
    limit = min(bs, int(ids.size) - start - 1)  # leave at least one prompt token to prefill
    if limit <= longer_than:
        return None
    best: Sibling | None = None
    seen: set[str] = set()
    local: list[tuple[str, Any]] = [("ram", b) for b in tier.ram.children(parent, MAX_RAM_SIBLINGS)]
    if tier.writer is not None:
        local += [("pending", b) for b in tier.writer.pending_children(parent, MAX_RAM_SIBLINGS)]
    for source, block in local:
        seen.add(block.block_hash)
        n = _usable_len(ids, start, limit, block.token_ids, bs, quantized)
        if n > max(longer_than, best.n if best else 0):
            best = Sibling(source, block, block.block_hash, n)
            if n == limit:
                break
    have = max(longer_than, best.n if best else 0)
    if have < limit and tier.ssd is not None:
        best = on_ssd(tier.ssd, bs, parent, ids, start, longer_than=have, skip=seen, quantized=quantized) or best
    if best is None:
        return None
    best.block = truncate(best.block, best.n)
    return best


def on_ssd(ssd: SSDStore, block_size: int, parent: str, ids: np.ndarray, start: int, *, longer_than: int = 0,
           skip: set[str] | frozenset[str] = frozenset(), quantized: bool = False, count: bool = True) -> Sibling | None:
    """The best of the `MAX_SSD_SIBLINGS` most recently used SSD siblings of `parent`, read and
    verified whole (`SSDStore.read_row`), if it serves more than `longer_than` tokens; `skip`:
    hashes already compared. With `count`, the winner's row is touched and counted as a load."""
    limit = min(block_size, int(ids.size) - start - 1)
    best: Sibling | None = None
    read = 0
    for row in ssd.children(parent, MAX_SSD_SIBLINGS):
        if row.hash in skip or limit <= longer_than:
            continue
        block = ssd.read_row(row, parent)
        if block is None:
            continue
        read += row.nbytes
        n = _usable_len(ids, start, limit, block.token_ids, block_size, quantized)
        if n > max(longer_than, best.n if best else 0):
            best = Sibling("ssd", block, row.hash, n)
            if n == limit:
                break
    if best is not None:
        best.nbytes_read = read
        if count:
            ssd.record_hits([best.key], read)
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


__all__ = ["MAX_RAM_SIBLINGS", "MAX_SSD_SIBLINGS", "Sibling", "common_prefix", "find", "on_ssd", "truncate"]
