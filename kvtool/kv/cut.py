"""Cutting blocks out of an mlx-lm prompt cache: the new blocks of a request (`slice_blocks`, one
copy per run of back-to-back blocks), the blocks of a hit entering RAM (`promote_slices`, views of
the request's cache) and the prompt's last token's prefilled KV put back (`patch_last_token`).
The block form (`Block`, `BlockRun`) and the way back to caches live in `kvtool.kv.blocks`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import ArraysCache, KVCache, QuantizedKVCache

from kvtool.disk.kvlayout import KVLayout
from kvtool.kv.blocks import Block, BlockRun, to_mlx
from kvtool.kv.tree import leaves

__all__ = ["patch_last_token", "promote_slices", "slice_blocks"]


def _layer_slices(c, lo: int, hi: int, kv: KVLayout | None, copy: bool) -> tuple[list[mx.array], list[mx.array]]:
    """One layer's keys and values for tokens `[lo, hi)` in the block form of layout `kv`.

    A plain `KVCache` layer of a quantized layout is quantized here (`mx.quantize` works per
    group of one token's head dim, so a quantized slice equals the slice of the quantized cache).
    """
    def cut(a):
        a = a[..., lo:hi, :]
        return mx.contiguous(a) if copy else a

    if not isinstance(c, (KVCache, QuantizedKVCache)):  # RotatingKVCache: a ring buffer, not token order
        raise ValueError(f"cannot cut blocks from a {type(c).__name__} layer (use a full view)")
    if isinstance(c, QuantizedKVCache):
        if kv is None or not kv.quantized or (c.bits, c.group_size) != (kv.bits, kv.group_size):
            raise ValueError("a quantized cache layer in a layout of another quantisation")
        return [cut(a) for a in c.keys], [cut(a) for a in c.values]
    if kv is not None and kv.quantized:
        k = mx.quantize(mx.contiguous(c.keys[..., lo:hi, :]), group_size=kv.group_size, bits=kv.bits)
        v = mx.quantize(mx.contiguous(c.values[..., lo:hi, :]), group_size=kv.group_size, bits=kv.bits)
        return list(k), list(v)
    return [cut(c.keys)], [cut(c.values)]


def slice_blocks(
    cache: list[KVCache],
    token_ids: Sequence[int] | np.ndarray,
    spans: Sequence[tuple[str, str, int, int]],
    kv: KVLayout | None = None,
    states: Sequence[Sequence[mx.array]] | None = None,
) -> list[Block]:
    """Cut blocks (or a tail entry) out of a filled prompt cache, as copies.

    Args:
        cache: per-layer `KVCache` (or `QuantizedKVCache`) whose `offset` covers every span, in
            a model's structure (`CacheList`s are flattened, `ArraysCache`s skipped); buffers may
            be padded past `offset` (mlx-lm grows them in 256-token steps): only
            `[..., :offset, :]` is read.
        token_ids: the prompt token ids.
        spans: `(block_hash, parent_hash, start, stop)` token ranges.
        kv: the namespace layout; a quantized one quantizes plain layers (None: plain).
        states: with state layers (`ArraysCache`, skipped in `cache`), per span the state arrays
            the record ends with (appended to `Block.values`).

    Returns:
        Evaluated blocks, each holding copies (not views) of the cache's KV.
    """
    ids = np.asarray(token_ids, dtype=np.int32)
    cache = leaves(cache)
    if _one_copy_per_layer(cache, spans, states):
        return _slice_run(cache, ids, spans, kv)
    blocks: list[Block] = []
    for i, (h, parent, lo, hi) in enumerate(spans):
        keys: list[mx.array] = []
        values: list[mx.array] = []
        for c in cache:
            if isinstance(c, ArraysCache):
                continue
            k, v = _layer_slices(c, lo, hi, kv, copy=True)
            keys += k
            values += v
        if states is not None:
            values += list(states[i])
        blocks.append(Block(h, parent, ids[lo:hi].copy(), keys, values))
    mx.eval([b.keys for b in blocks], [b.values for b in blocks])
    return blocks


def patch_last_token(blocks: Sequence[Block], spans: Sequence[tuple[Any, ...]], n: int,
                     last_kv: Sequence[tuple[int, mx.array, mx.array]]) -> None:
    """In the block whose span ends at token `n` (a prompt's last), replace the last token's KV
    of the given KV leaves (`(KV leaf index, keys [1, H, 1, Dk], values [1, H, 1, Dv])`, plain
    layouts) by these; the arrays are new (blocks of one run share views of one copy)."""
    for b, span in zip(blocks, spans):
        if span[3] != n:
            continue
        b.detach()  # no longer views of the run
        for j, k, v in last_kv:
            b.keys[j] = mx.concatenate([b.keys[j][..., :-1, :], k.astype(b.keys[j].dtype)], axis=2)
            b.values[j] = mx.concatenate([b.values[j][..., :-1, :], v.astype(b.values[j].dtype)], axis=2)
        mx.eval(b.keys, b.values)


def _one_copy_per_layer(cache, spans, states) -> bool:
    """True for the common case: `KVCache` / `QuantizedKVCache` layers, no state layers, and
    back-to-back spans."""
    if states is not None or not spans or any(type(c) not in (KVCache, QuantizedKVCache) for c in cache):
        return False
    return all(a[3] == b[2] for a, b in zip(spans, spans[1:]))


def _slice_run(cache: list, ids: np.ndarray, spans: Sequence[tuple[str, str, int, int]], kv: KVLayout | None) -> list[Block]:
    """Blocks of back-to-back spans from ONE contiguous copy per layer and tensor (in a quantized
    layout: the run quantized at once, equal to quantizing each block, as `mx.quantize` works per
    group of one token's head dim): each block views its part of the copy. The copy is shared by
    the run's blocks, so its memory is freed when the last of them leaves RAM."""
    lo0, hi0 = spans[0][2], spans[-1][3]
    runs_k: list[mx.array] = []
    runs_v: list[mx.array] = []
    for c in cache:
        k, v = _layer_slices(c, lo0, hi0, kv, copy=True)
        runs_k += k
        runs_v += v
    mx.eval(runs_k, runs_v)
    run = BlockRun(runs_k, runs_v)
    return [Block(h, parent, ids[lo:hi].copy(), run=(run, lo - lo0)) for h, parent, lo, hi in spans]


def promote_slices(cache: list[KVCache], spans: Sequence[tuple[Any, ...]],
                   kv: KVLayout | None = None) -> list[Block]:
    """Blocks that are views into a finished request's cache (no copy), for the RAM tier.

    Args:
        cache: the request's caches after generation (their prompt positions are final).
        spans: `(block_hash, parent_hash, token_ids, offset)` per block, plus the block's state
            arrays with state layers.
        kv: the namespace layout (None: plain).
    """
    blocks = []
    cache = leaves(cache)
    run = _run_of(cache, kv)
    if run is not None:  # views made when asked for (`Block.keys`)
        mx.eval(run.keys, run.values)
        return [Block(h, parent, np.asarray(ids, dtype=np.int32), run=(run, off)) for h, parent, ids, off, *_ in spans]
    for h, parent, ids, off, *state in spans:
        n = len(ids)
        keys: list[mx.array] = []
        values: list[mx.array] = []
        for c in cache:
            if isinstance(c, ArraysCache):
                continue
            k, v = _layer_slices(c, off, off + n, kv, copy=False)
            keys += k
            values += v
        if state:  # state layers: the entry's state arrays (host copies from the restore)
            assert kv is not None  # state layers exist only in a layout
            values += [x if isinstance(x, mx.array) else to_mlx(x) for x in state[0]]
        blocks.append(Block(h, parent, np.asarray(ids, dtype=np.int32), keys, values))
    mx.eval([b.keys for b in blocks], [b.values for b in blocks])
    return blocks


def _run_of(cache: list, kv: KVLayout | None) -> BlockRun | None:
    """The cache's arrays as a run its blocks can view: plain `KVCache` layers in a plain layout,
    or `QuantizedKVCache` layers of the layout's quantisation (3 tensors each); else None
    (state layers, plain layers of a quantized layout: per-block arrays)."""
    if (kv is None or not kv.quantized) and all(type(c) is KVCache for c in cache):
        return BlockRun([c.keys for c in cache], [c.values for c in cache])
    if kv is not None and kv.quantized and all(
        type(c) is QuantizedKVCache and (c.bits, c.group_size) == (kv.bits, kv.group_size) for c in cache
    ):
        return BlockRun([a for c in cache for a in c.keys], [a for c in cache for a in c.values])
    return None
