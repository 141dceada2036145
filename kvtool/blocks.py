"""Blocks in MLX: slicing mlx-lm caches into blocks, and building caches from blocks and restores.

A *block* is `block_size` consecutive prompt tokens together with the KV of every layer for those
positions: per layer a keys and a values tensor `[1, n_kv_heads, n, head_dim]`, i.e. a slice of
mlx-lm's `KVCache.state` along the sequence axis (axis 2). A prompt's *tail entry* is the same
with `n < block_size`. Hashing and layout keys live in the MLX-free `kvtool.hashing`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from kvtool.hashing import (  # noqa: F401  (re-exported)
    HASH_DIGEST_BYTES,
    HashFn,
    blake2b_chain,
    chain_hashes,
    layout_key,
    root_parent,
    tail_hash,
)
from kvtool.hostblock import HostBlock  # noqa: F401  (re-exported: the MLX-free half of a block)
from kvtool.store.segment import STORAGE_DTYPES, KVLayout

CACHE_STEP = KVCache.step  # mlx-lm grows a KVCache in steps of this many tokens (256)

_MX_TO_NP_STORAGE = {
    mx.float32: np.float32,
    mx.float16: np.float16,
    mx.bfloat16: np.uint16,  # numpy has no bfloat16: the bit pattern travels as uint16
}
_DTYPE_NAMES = {mx.float32: "float32", mx.float16: "float16", mx.bfloat16: "bfloat16"}
_NAME_TO_MX = {v: k for k, v in _DTYPE_NAMES.items()}


def dtype_name(dtype: mx.Dtype) -> str:
    """Name of a supported KV dtype ('float32' | 'float16' | 'bfloat16').

    Raises:
        ValueError: the dtype is not a supported floating KV dtype.
    """
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(f"unsupported KV dtype {dtype}") from None


def unsupported_cache_reason(cache: list) -> str | None:
    """Why a model's prompt cache cannot be stored block-wise, or None if it can.

    Only plain full-attention `KVCache` layers are supported; RotatingKVCache, ArraysCache,
    QuantizedKVCache, CacheList or any other class would give wrong KV if sliced.
    """
    kinds = sorted({type(c).__name__ for c in cache if type(c) is not KVCache})
    if kinds:
        return f"cache layers of type {', '.join(kinds)} are not plain KVCache"
    if not cache:
        return "the model has no KV cache layers"
    return None


@dataclass
class Block:
    """A block in MLX arrays, as held by the RAM tier.

    Attributes:
        block_hash, parent_hash: as in `HostBlock`.
        token_ids: int32 numpy `[block_size]`.
        keys, values: per layer mx arrays `[1, n_kv_heads, block_size, head_dim]`, evaluated.
    """

    block_hash: str
    parent_hash: str
    token_ids: np.ndarray
    keys: list[mx.array]
    values: list[mx.array]
    nbytes: int = field(default=0)

    def __post_init__(self) -> None:
        if not self.nbytes:
            self.nbytes = int(sum(k.nbytes + v.nbytes for k, v in zip(self.keys, self.values)) + self.token_ids.nbytes)

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def dtype(self) -> str:
        return dtype_name(self.keys[0].dtype)


def _to_numpy(a: mx.array) -> np.ndarray:
    storage = _MX_TO_NP_STORAGE.get(a.dtype)
    if storage is None:
        raise ValueError(f"unsupported KV dtype {a.dtype}")
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    return np.array(a, copy=True)


def _to_mlx(a: np.ndarray, dtype: str) -> mx.array:
    arr = mx.array(a)
    if dtype == "bfloat16":
        arr = arr.view(mx.bfloat16)
    return arr


def to_host(block: Block) -> HostBlock:
    """Materialise a RAM block into host memory (copies). Call on the MLX (request) thread."""
    return HostBlock(
        block_hash=block.block_hash,
        parent_hash=block.parent_hash,
        token_ids=np.array(block.token_ids, dtype=np.int32, copy=True),
        keys=[_to_numpy(k) for k in block.keys],
        values=[_to_numpy(v) for v in block.values],
        dtype=block.dtype,
    )


def from_host(host: HostBlock) -> Block:
    """Turn a host block into evaluated MLX arrays. Call on the MLX (request) thread.

    Raises:
        ValueError: unknown dtype name.
    """
    if host.dtype not in _NAME_TO_MX:
        raise ValueError(f"unsupported KV dtype {host.dtype!r}")
    keys = [_to_mlx(k, host.dtype) for k in host.keys]
    values = [_to_mlx(v, host.dtype) for v in host.values]
    mx.eval(keys, values)
    return Block(host.block_hash, host.parent_hash, np.asarray(host.token_ids, dtype=np.int32), keys, values)


def slice_blocks(
    cache: list[KVCache],
    token_ids: Sequence[int] | np.ndarray,
    spans: Sequence[tuple[str, str, int, int]],
) -> list[Block]:
    """Cut blocks (or a tail entry) out of a filled prompt cache, as copies.

    Args:
        cache: per-layer `KVCache` whose `offset` covers every span; its buffers may be padded
            past `offset` (mlx-lm grows them in 256-token steps): only `[..., :offset, :]` is read.
        token_ids: the prompt token ids.
        spans: `(block_hash, parent_hash, start, stop)` token ranges.

    Returns:
        Evaluated blocks, each holding copies (not views) of the cache's KV.
    """
    ids = np.asarray(token_ids, dtype=np.int32)
    blocks: list[Block] = []
    for h, parent, lo, hi in spans:
        keys = [mx.contiguous(c.keys[..., lo:hi, :]) for c in cache]
        values = [mx.contiguous(c.values[..., lo:hi, :]) for c in cache]
        blocks.append(Block(h, parent, ids[lo:hi].copy(), keys, values))
    mx.eval([b.keys for b in blocks], [b.values for b in blocks])
    return blocks


def cache_capacity(prompt_tokens: int) -> int:
    """Tokens a rebuilt cache holds room for: the prompt plus at least one decode step, rounded
    up to mlx-lm's 256-token step (as a cold prefill would leave it), so that neither the
    prefill of the uncached rest nor the first decode step reallocates (copies) the cache."""
    return (prompt_tokens // CACHE_STEP + 1) * CACHE_STEP


def rebuild_cache(blocks: Sequence[Block], n_layers: int, capacity: int = 0) -> list[KVCache]:
    """A fresh per-layer `KVCache` holding the concatenation of `blocks` along the sequence axis.

    Args:
        blocks: a chain of blocks, in prompt order, starting at the first block.
        n_layers: number of cache layers of the model.
        capacity: buffer length in tokens (>= the blocks' tokens); the rest is decode room.

    Returns:
        `n_layers` caches with `offset == sum(block tokens)`; empty caches if `blocks` is empty.
    """
    caches = [KVCache() for _ in range(n_layers)]
    if not blocks:
        return caches
    n = sum(b.num_tokens for b in blocks)
    room = max(capacity - n, 0)
    for layer, c in enumerate(caches):
        ks = [b.keys[layer] for b in blocks]
        vs = [b.values[layer] for b in blocks]
        if room:
            k0, v0 = ks[0], vs[0]
            ks.append(mx.zeros((*k0.shape[:2], room, k0.shape[3]), k0.dtype))
            vs.append(mx.zeros((*v0.shape[:2], room, v0.shape[3]), v0.dtype))
        c.keys = mx.concatenate(ks, axis=2) if len(ks) > 1 else ks[0]
        c.values = mx.concatenate(vs, axis=2) if len(vs) > 1 else vs[0]
        c.offset = n
    mx.eval([c.keys for c in caches], [c.values for c in caches])
    return caches


# ------------------------------------------------------------------ restore buffers
def kv_layout_of(cache: list[KVCache]) -> KVLayout:
    """The per-layer KV layout of a filled cache (keys/values `[B, H, T, D]`).

    Raises:
        ValueError: unsupported dtype, or keys and values with different head counts.
    """
    layers = []
    for c in cache:
        _, h, _, dk = c.keys.shape
        _, hv, _, dv = c.values.shape
        if h != hv:
            raise ValueError(f"keys have {h} heads but values {hv}")
        layers.append((int(h), int(dk), int(dv)))
    return KVLayout(tuple(layers), dtype_name(cache[0].keys.dtype))


def _host_view(a: mx.array) -> np.ndarray | None:
    """A writable numpy view of an evaluated MLX array's memory, or None where MLX does not
    share it with the host (then the restore stages in numpy and copies once)."""
    storage = _MX_TO_NP_STORAGE[a.dtype]
    src = a.view(mx.uint16) if a.dtype == mx.bfloat16 else a
    mx.eval(src)
    try:
        view = np.asarray(src)
    except (TypeError, ValueError, RuntimeError):
        return None
    if view.dtype != storage or not view.flags.writeable or view.shape != tuple(a.shape):
        return None
    return view


@dataclass
class KVBuffers:
    """Per-layer destination buffers of a restore: `[1, H_l, capacity, D_l]` keys and values.

    Reader threads fill `views` (numpy, storage dtype) at token offsets; `caches()` then hands
    mlx-lm `KVCache`s over the same memory (CPU: zero copy) with decode room after `offset`.

    Attributes:
        arrays: MLX arrays in record order (K0, V0, K1, V1, ...).
        views: writable numpy views of `arrays` (or host staging arrays, see `_host_view`).
        staged: True if `views` are separate host arrays to copy in at `caches()`.
    """

    arrays: list[mx.array]
    views: list[np.ndarray]
    staged: bool = False

    @classmethod
    def allocate(cls, kv: KVLayout, capacity: int) -> "KVBuffers":
        """Allocate buffers for `capacity` tokens (call on the request thread)."""
        dtype = _NAME_TO_MX[kv.dtype]
        arrays = [mx.zeros(shape, dtype) for shape in kv.shapes(capacity)]
        mx.eval(arrays)
        views = [_host_view(a) for a in arrays]
        if all(v is not None for v in views):
            return cls(arrays, views)  # type: ignore[arg-type]
        storage = STORAGE_DTYPES[kv.dtype]
        return cls(arrays, [np.empty(a.shape, storage) for a in arrays], staged=True)

    def dest(self, offset: int, n: int) -> list[np.ndarray]:
        """Views `[1, H, n, D]` of every tensor at token `offset` (for `restore_chain`)."""
        return [v[:, :, offset : offset + n, :] for v in self.views]

    def place(self, offset: int, block: Block) -> None:
        """Copy an MLX block (RAM tier) into the buffers at token `offset`."""
        n = block.num_tokens
        for dst, src in zip(self.dest(offset, n), (a for kv in zip(block.keys, block.values) for a in kv)):
            dst[...] = _to_numpy(src)

    def place_host(self, offset: int, block: HostBlock) -> None:
        """Copy a host block (writer's pending buffer) into the buffers at token `offset`."""
        n = block.num_tokens
        for dst, src in zip(self.dest(offset, n), (a for kv in zip(block.keys, block.values) for a in kv)):
            dst[...] = src

    def caches(self, offset: int) -> list[KVCache]:
        """mlx-lm caches over the buffers, holding `offset` tokens; drops this object's
        references so the caches own their buffers (in-place updates, no copy on decode)."""
        arrays = self.arrays
        if self.staged:
            dtype = arrays[0].dtype
            arrays = [_to_mlx(v, dtype_name(dtype)) for v in self.views]
            mx.eval(arrays)
        self.arrays, self.views = [], []
        out = []
        for k, v in zip(arrays[0::2], arrays[1::2]):
            c = KVCache()
            c.keys, c.values, c.offset = k, v, offset
            out.append(c)
        return out


def promote_slices(cache: list[KVCache], spans: Sequence[tuple[str, str, np.ndarray, int]]) -> list[Block]:
    """Blocks that are views into a finished request's cache (no copy), for the RAM tier.

    Args:
        cache: the request's caches after generation (their prompt positions are final).
        spans: `(block_hash, parent_hash, token_ids, offset)` per block.
    """
    blocks = []
    for h, parent, ids, off in spans:
        n = len(ids)
        keys = [c.keys[..., off : off + n, :] for c in cache]
        values = [c.values[..., off : off + n, :] for c in cache]
        blocks.append(Block(h, parent, np.asarray(ids, dtype=np.int32), keys, values))
    mx.eval([b.keys for b in blocks], [b.values for b in blocks])
    return blocks
