"""Blocks in MLX: the block form, its host form, and building caches from blocks and restores
(`kvtool.kv.cut` cuts blocks out of a cache).

A *block* is `block_size` consecutive prompt tokens together with the KV of every layer for those
positions: per layer a keys and a values tensor `[1, n_kv_heads, n, head_dim]`, i.e. a slice of
mlx-lm's `KVCache.state` along the sequence axis (axis 2). A prompt's *tail entry* is the same
with `n < block_size`. In a quantized layout (`KVLayout.bits` > 0) each layer's keys and values
are three tensors each, mlx-lm `QuantizedKVCache` slices (packed uint32 words, scales, biases):
`Block.keys`/`Block.values` are then flat lists of 3 tensors per layer. Hashing and layout keys
live in the MLX-free `kvtool.hashing`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, QuantizedKVCache

from kvtool.disk.hostblock import HostBlock  # noqa: F401  (re-exported: the MLX-free half of a block)
from kvtool.disk.kvlayout import KVLayout
from kvtool.hashing import (  # noqa: F401  (re-exported)
    HASH_DIGEST_BYTES,
    HashFn,
    blake2b_chain,
    chain_hashes,
    layout_key,
    root_parent,
    tail_hash,
)
from kvtool.kv.tree import (
    DTYPE_NAMES,
    dtype_name,
    leaves,
    unsupported_cache_reason,  # noqa: F401  (re-exported: kvtool.server.adapter)
)

CACHE_STEP = KVCache.step  # mlx-lm grows a KVCache in steps of this many tokens (256)

# MLX dtype -> the numpy dtype its bits travel as on the host (`to_numpy`; restore buffers' host views)
MX_TO_NP_STORAGE = {
    mx.float32: np.float32,
    mx.float16: np.float16,
    mx.bfloat16: np.uint16,  # numpy has no bfloat16: the bit pattern travels as uint16
    mx.uint32: np.uint32,  # packed words of quantized KV
}
NAME_TO_MX = {v: k for k, v in DTYPE_NAMES.items()}  # KV dtype name ('bfloat16', ...) -> MLX dtype


@dataclass(eq=False)
class BlockRun:
    """The arrays that the blocks of one run view: per KV layer keys and values `[1, n_kv_heads,
    T, head_dim]` (a quantized layout: its 3 tensors each, as `Block.keys`) holding the run's
    tokens back to back; no state layers. A rebuilt cache takes one view of it per tensor for
    consecutive blocks instead of one piece per block (`rebuild_cache`, `run_groups`)."""

    keys: list[mx.array]
    values: list[mx.array]


class Block:
    """A block in MLX arrays, as held by the RAM tier.

    Attributes:
        block_hash, parent_hash: as in `HostBlock`.
        token_ids: int32 numpy `[block_size]`.
        keys, values: per layer mx arrays `[1, n_kv_heads, block_size, head_dim]`, evaluated;
            a block of a run gets them as views of the run's arrays when first asked (a store
            makes no views it does not use).
        nbytes: bytes of its KV and token ids.
        run: `(run, lo)` where `keys` / `values` are (or will be) views of `run`'s arrays at
            tokens `[lo, lo + block_size)`; None where they are arrays of their own.

    Raises:
        ValueError: neither arrays nor a run given.
    """

    __slots__ = ("block_hash", "parent_hash", "token_ids", "_keys", "_values", "nbytes", "run")

    def __init__(self, block_hash: str, parent_hash: str, token_ids: np.ndarray, keys: list[mx.array] | None = None,
                 values: list[mx.array] | None = None, nbytes: int = 0,
                 run: tuple[BlockRun, int] | None = None):  # fmt: skip
        if (keys is None or values is None) and run is None:
            raise ValueError("a block needs its arrays or a run")
        self.block_hash, self.parent_hash, self.token_ids = block_hash, parent_hash, token_ids
        self._keys, self._values, self.run = keys, values, run
        if not nbytes and keys is not None and values is not None:
            nbytes = int(sum(k.nbytes + v.nbytes for k, v in zip(keys, values)) + token_ids.nbytes)
        elif not nbytes and run is not None:  # the run's bytes per token x tokens
            nbytes = sum(a.nbytes // a.shape[2] for a in (*run[0].keys, *run[0].values)) * self.num_tokens + token_ids.nbytes
        self.nbytes = nbytes

    @property
    def keys(self) -> list[mx.array]:
        if self._keys is None:
            self._keys = self._views(0)
        return self._keys

    @property
    def values(self) -> list[mx.array]:
        if self._values is None:
            self._values = self._views(1)
        return self._values

    def _views(self, which: int) -> list[mx.array]:
        run, lo = self.run  # type: ignore[misc]  # set whenever an array list is not
        return [a[..., lo : lo + self.num_tokens, :] for a in (run.values if which else run.keys)]

    def detach(self) -> None:
        """Make `keys` / `values` this block's own lists (views made now) and forget the run:
        for a caller that replaces some of them."""
        self._keys, self._values, self.run = self.keys, self.values, None

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def dtype(self) -> str:
        """KV dtype name (of the scales and biases in a quantized block)."""
        src = self.run[0] if self._keys is None and self.run is not None else self  # no views made for it
        return dtype_name(next(a.dtype for a in (*src.keys, *src.values) if a.dtype != mx.uint32))


def to_numpy(a: mx.array) -> np.ndarray:
    """A numpy view of an MLX array's memory (zero copy on the CPU backend, where MLX exports
    its buffer; a copy elsewhere). bfloat16 is viewed as its uint16 bit pattern. The view keeps
    the array alive; blocks are never written in place, so sharing their memory is safe.

    Returns:
        An array of `a`'s shape in `MX_TO_NP_STORAGE[a.dtype]` (float32, float16, uint16, uint32).

    Raises:
        ValueError: `a`'s dtype is not a KV dtype (`MX_TO_NP_STORAGE`).
    """
    storage = MX_TO_NP_STORAGE.get(a.dtype)
    if storage is None:
        raise ValueError(f"unsupported KV dtype {a.dtype}")
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    return np.asarray(a)


def to_mlx(a: np.ndarray) -> mx.array:
    """An MLX array of a host array (same shape; a copy), the inverse of `to_numpy`: uint16 is
    always a bfloat16 bit pattern (no KV or state dtype is uint16), packed uint32 words stay
    uint32, other dtypes map as `mx.array` maps them."""
    arr = mx.array(a)
    if a.dtype == np.uint16:
        arr = arr.view(mx.bfloat16)
    return arr


def to_host_many(blocks: Sequence[Block]) -> list[HostBlock]:
    """RAM blocks as host arrays for a writer: numpy views of the blocks' (immutable) MLX arrays,
    no copy on the CPU backend (a block is already a copy of the cache: see `slice_blocks`). Each
    group of consecutive blocks of one run (`run_groups`) is converted once per tensor and sliced
    per block in numpy: one conversion per group and tensor, not per block and tensor. Call on the
    MLX (request) thread."""
    out = []
    for i, count, n in run_groups(blocks):
        keys, values = host_arrays(blocks[i], n)
        at = 0
        for b in blocks[i : i + count]:
            hi = at + b.num_tokens
            ks, vs = keys, values  # one block: its arrays whole (state arrays: axis -2 is not tokens)
            if count > 1:  # a group of a run (no state arrays)
                ks, vs = [k[..., at:hi, :] for k in keys], [v[..., at:hi, :] for v in values]
            out.append(HostBlock(b.block_hash, b.parent_hash, np.array(b.token_ids, dtype=np.int32, copy=True),
                                 ks, vs, b.dtype))  # fmt: skip
            at = hi
    return out


def host_arrays(block: Block, n: int | None = None) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Numpy views (`to_numpy`) of a block's per-layer keys and values `[1, H, n, D]`; for a block
    of a run, `n` > its own tokens gives that many tokens of the run from the block's first
    (consecutive blocks of the run, see `run_groups`), one conversion per tensor. Call on the MLX
    (request) thread.

    Raises:
        ValueError: `n` differs from the block's tokens and the block has no run.
    """
    if block.run is None:
        if n is not None and n != block.num_tokens:
            raise ValueError(f"{n} tokens of a block of {block.num_tokens} that has no run")
        return [to_numpy(k) for k in block.keys], [to_numpy(v) for v in block.values]
    run, lo = block.run
    hi = lo + (block.num_tokens if n is None else n)
    return [to_numpy(k[..., lo:hi, :]) for k in run.keys], [to_numpy(v[..., lo:hi, :]) for v in run.values]


def from_host(host: HostBlock) -> Block:
    """Turn a host block into evaluated MLX arrays. Call on the MLX (request) thread.

    Raises:
        ValueError: unknown dtype name.
    """
    if host.dtype not in NAME_TO_MX:
        raise ValueError(f"unsupported KV dtype {host.dtype!r}")
    keys = [to_mlx(k) for k in host.keys]
    values = [to_mlx(v) for v in host.values]
    mx.eval(keys, values)
    return Block(host.block_hash, host.parent_hash, np.asarray(host.token_ids, dtype=np.int32), keys, values)


def cache_capacity(prompt_tokens: int) -> int:
    """Tokens a rebuilt cache holds room for: the prompt plus at least one decode step, rounded
    up to mlx-lm's 256-token step (as a cold prefill would leave it), so that neither the
    prefill of the uncached rest nor the first decode step reallocates (copies) the cache."""
    return (prompt_tokens // CACHE_STEP + 1) * CACHE_STEP


def rebuild_cache(blocks: Sequence[Block], n_layers: int, capacity: int = 0,
                  kv: KVLayout | None = None) -> list:
    """A fresh cache holding the concatenation of `blocks` along the sequence axis.

    Args:
        blocks: a chain of blocks, in prompt order, starting at the first block.
        n_layers: number of KV layers of the model.
        capacity: buffer length in tokens (>= the blocks' tokens); the rest is decode room.
        kv: the layout; a quantized one gives `QuantizedKVCache`s; one with state layers or
            cache lists gives the model's structure (`assemble_layers`; None: plain).

    Returns:
        Per KV layer a cache with `offset == sum(block tokens)` (in the model's structure);
        empty caches if `blocks` is empty.
    """
    if kv is not None and kv.quantized:
        return after_restore(_rebuild_quantized(blocks, kv, capacity))
    if kv is not None and kv.kinds:
        kv_caches = _rebuild_plain(blocks, kv.n_layers, capacity) if kv.n_layers else []
        state = [b for b in blocks[-1].values[kv.n_layers:]] if blocks and kv.has_states else None
        return after_restore(assemble_layers(kv, kv_caches, state))
    return after_restore(_rebuild_plain(blocks, n_layers, capacity))


def _rebuild_plain(blocks: Sequence[Block], n_layers: int, capacity: int) -> list:
    caches = [KVCache() for _ in range(n_layers)]
    if not blocks:
        return caches
    n = sum(b.num_tokens for b in blocks)
    room = max(capacity - n, 0)
    groups = [(blocks[i], n) for i, _, n in run_groups(blocks)]
    for layer, c in enumerate(caches):
        ks = [_piece(b, n, layer, True) for b, n in groups]
        vs = [_piece(b, n, layer, False) for b, n in groups]
        if room:
            k0, v0 = ks[0], vs[0]
            ks.append(mx.zeros((*k0.shape[:2], room, k0.shape[3]), k0.dtype))
            vs.append(mx.zeros((*v0.shape[:2], room, v0.shape[3]), v0.dtype))
        c.keys = mx.concatenate(ks, axis=2) if len(ks) > 1 else ks[0]
        c.values = mx.concatenate(vs, axis=2) if len(vs) > 1 else vs[0]
        c.offset = n
    # Not evaluated here: the concatenation runs as part of the request's first forward, as the
    # deep copy of mlx-lm's own prompt cache does (an eval would wait for everything queued on the
    # stream first, e.g. a server's batch decode step in flight).
    return caches


def run_groups(blocks: Sequence[Block]) -> list[tuple[int, int, int]]:
    """`blocks` as `(first index, blocks, tokens)` groups: consecutive blocks that view adjacent
    tokens of one `BlockRun` form one group, every other block its own."""
    groups: list[tuple[int, int, int]] = []
    end: tuple[BlockRun, int] | None = None  # the last group's run and its end in it
    for i, b in enumerate(blocks):
        if b.run is not None and end is not None and b.run[0] is end[0] and b.run[1] == end[1]:
            first, count, n = groups[-1]
            groups[-1] = (first, count + 1, n + b.num_tokens)
        else:
            groups.append((i, 1, b.num_tokens))
        end = (b.run[0], b.run[1] + b.num_tokens) if b.run is not None else None
    return groups


def _piece(first: Block, n: int, index: int, keys: bool) -> mx.array:
    """Keys (or values) tensor `index` (a layer's; in a quantized layout one of its three) of a
    `run_groups` group of `n` tokens from block `first`: the block's own array, or one view of
    the run spanning the group's blocks (no per-block views made)."""
    if first.run is None:
        return first.keys[index] if keys else first.values[index]
    run, lo = first.run
    return (run.keys if keys else run.values)[index][..., lo : lo + n, :]


def _rebuild_quantized(blocks: Sequence[Block], kv: KVLayout, capacity: int) -> list:
    caches = [QuantizedKVCache(group_size=kv.group_size, bits=kv.bits) for _ in range(kv.n_layers)]
    if not blocks:
        return caches
    n = sum(b.num_tokens for b in blocks)
    room = max(capacity - n, 0)

    def cat(parts):
        if room:
            p0 = parts[0]
            parts = [*parts, mx.zeros((*p0.shape[:2], room, p0.shape[3]), p0.dtype)]
        return mx.concatenate(parts, axis=2) if len(parts) > 1 else parts[0]

    groups = [(blocks[i], m) for i, _, m in run_groups(blocks)]
    for layer, c in enumerate(caches):
        c.keys = [cat([_piece(b, m, 3 * layer + i, True) for b, m in groups]) for i in range(3)]
        c.values = [cat([_piece(b, m, 3 * layer + i, False) for b, m in groups]) for i in range(3)]
        c.offset = n
    mx.eval([c.keys for c in caches], [c.values for c in caches])
    return caches


def assemble_layers(kv: KVLayout, kv_caches: list, state: Sequence | None) -> list:
    """The model's cache structure (`kv.kinds`) over restored leaves: the KV caches (in order),
    an `ArraysCache` per state layer holding its part of `state` (the state arrays of every state
    layer, in order; None: empty), and a `CacheList` per parenthesised group."""
    kv_iter = iter(kv_caches)
    pos = 0

    def parse(i: int) -> tuple[list, int]:
        nonlocal pos
        out: list = []
        while i < len(kv.kinds):
            ch = kv.kinds[i]
            if ch == "(":
                inner, i = parse(i + 1)
                out.append(CacheList(*inner))
                continue
            if ch == ")":
                return out, i + 1
            if ch == "k":
                out.append(next(kv_iter))
            else:
                n = int(ch)
                a = ArraysCache(size=n)
                if state is not None:
                    a.cache = [x if isinstance(x, mx.array) else to_mlx(x) for x in state[pos : pos + n]]
                pos += n
                out.append(a)
            i += 1
        return out, i

    return parse(0)[0] if kv.kinds else list(kv_caches)


# A test hook: `after_restore` calls it with every cache a fetch rebuilt from blocks (RAM
# rebuilds and SSD restores), before the cache is used. Tests set it to break a restore on
# purpose (the self-check must then fail); never set otherwise.
restore_hook = None


def after_restore(cache: list) -> list:
    """`cache`, after `restore_hook` (if set) saw it."""
    if restore_hook is not None:
        restore_hook(cache)
    return cache


def state_arrays(cache: list) -> list[mx.array]:
    """The state arrays of a cache's state layers (`ArraysCache`, `CacheList`s flattened), in
    order (references: mlx-lm replaces them with new arrays at every step, so this is a snapshot)."""
    return [a for c in leaves(cache) if isinstance(c, ArraysCache) for a in c.cache]
