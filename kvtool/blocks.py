"""Blocks and keys: chain hashing, layout keys, and slicing mlx-lm caches into blocks and back.

A *block* is `block_size` consecutive prompt tokens together with the KV of every layer for those
positions: per layer a keys and a values tensor of shape `[1, n_kv_heads, block_size, head_dim]`,
i.e. a slice of mlx-lm's `KVCache.state` along the sequence axis (axis 2).

Block identity is a *chain hash* (as in vLLM's prefix caching and seed 002 F1): the digest of
the parent block's digest followed by the block's token ids as little-endian int32. The first
block's parent is a digest of the *layout key*, so two models (or dtypes, block sizes, format
versions) never share a hash. blake2b is used, never Python's `hash()`, so hashes are identical
across processes and machines; hashing a prompt is O(n).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Callable, Sequence

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from kvtool.hostblock import HostBlock  # noqa: F401  (re-exported: the MLX-free half of a block)

BLOCK_FORMAT_VERSION = 1
HASH_DIGEST_BYTES = 16  # blake2b-128, hex-encoded to 32 characters

HashFn = Callable[[bytes, np.ndarray], str]

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


def layout_key(
    model_id: str,
    n_layers: int,
    n_kv_heads: int,
    head_dim: int,
    kv_dtype: str,
    block_size: int,
    format_version: int = BLOCK_FORMAT_VERSION,
) -> str:
    """Digest of everything that makes stored KV interchangeable; also the namespace name.

    Args:
        model_id: digest of the model's weights/config (and adapter), see `kvtool.models`.
        n_layers, n_kv_heads, head_dim: KV geometry.
        kv_dtype: 'float32' | 'float16' | 'bfloat16'.
        block_size: tokens per block.
        format_version: the on-disk block format version.

    Returns:
        32 hex characters (blake2b-128).
    """
    text = (
        f"kvtool-layout|fmt={format_version}|model={model_id}|layers={n_layers}"
        f"|kv_heads={n_kv_heads}|head_dim={head_dim}|dtype={kv_dtype}|block={block_size}"
    )
    return hashlib.blake2b(text.encode(), digest_size=HASH_DIGEST_BYTES).hexdigest()


def root_parent(layout: str) -> str:
    """The parent digest of a prompt's first block: a digest of the layout key (hex)."""
    return hashlib.blake2b(b"kvtool-root|" + layout.encode(), digest_size=HASH_DIGEST_BYTES).hexdigest()


def blake2b_chain(parent: bytes, token_ids: np.ndarray) -> str:
    """Default chain hash: blake2b-128(parent digest || token ids as little-endian int32) -> hex."""
    h = hashlib.blake2b(parent, digest_size=HASH_DIGEST_BYTES)
    h.update(np.ascontiguousarray(token_ids, dtype="<i4").tobytes())
    return h.hexdigest()


def chain_hashes(
    token_ids: Sequence[int] | np.ndarray,
    block_size: int,
    layout: str,
    hash_fn: HashFn = blake2b_chain,
) -> list[str]:
    """Chain hashes of every *full* block of a prompt, O(len(token_ids)).

    Args:
        token_ids: prompt token ids (int).
        block_size: tokens per block.
        layout: the layout key (namespace); seeds the first parent.
        hash_fn: injectable hash for tests (e.g. to force collisions).

    Returns:
        `len(token_ids) // block_size` hex digests; element i covers tokens
        `[i*block_size, (i+1)*block_size)`.
    """
    ids = np.asarray(token_ids, dtype=np.int32)
    parent = root_parent(layout)
    out: list[str] = []
    for i in range(len(ids) // block_size):
        parent = hash_fn(bytes.fromhex(parent), ids[i * block_size : (i + 1) * block_size])
        out.append(parent)
    return out


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
    hashes: Sequence[str],
    layout: str,
    start: int,
    stop: int,
    block_size: int,
) -> list[Block]:
    """Cut blocks `[start, stop)` out of a filled prompt cache.

    Args:
        cache: per-layer `KVCache` whose `offset >= stop * block_size`; its buffers may be
            padded past `offset` (mlx-lm grows them in 256-token steps) — only
            `[..., :offset, :]` is read.
        token_ids: the prompt token ids.
        hashes: `chain_hashes(token_ids, block_size, layout)`.
        layout: layout key (gives the first block's parent).
        start, stop: block indices.
        block_size: tokens per block.

    Returns:
        Evaluated blocks, each holding copies (not views) of the cache's KV.
    """
    ids = np.asarray(token_ids, dtype=np.int32)
    blocks: list[Block] = []
    for i in range(start, stop):
        lo, hi = i * block_size, (i + 1) * block_size
        keys = [mx.contiguous(c.keys[..., lo:hi, :]) for c in cache]
        values = [mx.contiguous(c.values[..., lo:hi, :]) for c in cache]
        parent = hashes[i - 1] if i > 0 else root_parent(layout)
        blocks.append(Block(hashes[i], parent, ids[lo:hi].copy(), keys, values))
    mx.eval([b.keys for b in blocks], [b.values for b in blocks])
    return blocks


def rebuild_cache(blocks: Sequence[Block], n_layers: int) -> list[KVCache]:
    """A fresh per-layer `KVCache` holding the concatenation of `blocks` along the sequence axis.

    Args:
        blocks: a chain of blocks, in prompt order, starting at the first block.
        n_layers: number of cache layers of the model.

    Returns:
        `n_layers` caches with `offset == sum(block tokens)`; empty caches if `blocks` is empty.
    """
    caches = [KVCache() for _ in range(n_layers)]
    if not blocks:
        return caches
    for layer, c in enumerate(caches):
        keys = mx.concatenate([b.keys[layer] for b in blocks], axis=2)
        values = mx.concatenate([b.values[layer] for b in blocks], axis=2)
        c.state = (keys, values, int(keys.shape[2]))
    mx.eval([c.keys for c in caches], [c.values for c in caches])
    return caches
