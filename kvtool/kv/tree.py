"""The structure of an mlx-lm prompt cache: its leaves (`CacheList`s flattened), their kinds,
sliding windows and offsets, and the per-layer KV layout of a filled cache (`kv_layout_of`).
Blocks (`kvtool.kv.blocks`) slice and rebuild what this module describes.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, QuantizedKVCache, RotatingKVCache

from kvtool.disk.kvlayout import KVLayout

DTYPE_NAMES = {mx.float32: "float32", mx.float16: "float16", mx.bfloat16: "bfloat16"}


def dtype_name(dtype: mx.Dtype) -> str:
    """Name of a supported KV dtype ('float32' | 'float16' | 'bfloat16').

    Raises:
        ValueError: the dtype is not a supported floating KV dtype.
    """
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(f"unsupported KV dtype {dtype}") from None


def leaves(cache: Sequence) -> list:
    """The leaf caches of a model's prompt cache, in order: every `CacheList` (a layer holding
    several caches, e.g. a state and an attention cache) is flattened, recursively."""
    out: list = []
    for c in cache:
        if isinstance(c, CacheList):
            out += leaves(c.caches)
        else:
            out.append(c)
    return out


def cache_kinds(cache: Sequence) -> str:
    """The structure of a prompt cache as `KVLayout.kinds`: per entry `k` (a KV leaf), the
    number of arrays of an `ArraysCache`, or `(`...`)` around the leaves of a `CacheList`."""
    out = ""
    for c in cache:
        if isinstance(c, CacheList):
            out += "(" + cache_kinds(c.caches) + ")"
        elif isinstance(c, ArraysCache):
            out += str(len(c.cache))
        else:
            out += "k"
    return out


def unsupported_cache_reason(cache: list, allow_rotating: bool = False, allow_state: bool = False,
                             allow_lists: bool = False) -> str | None:
    """Why a model's prompt cache cannot be stored block-wise, or None if it can.

    Plain full-attention `KVCache` layers are supported; with `allow_rotating`, also
    sliding-window `RotatingKVCache` layers with `keep == 0` (stored from a full-attention view,
    see `WindowedKVCache`); with `allow_state`, `ArraysCache` state layers (checkpointed at
    block ends); with `allow_lists`, `CacheList` entries whose leaves are supported. Quantized
    caches, `ChunkedKVCache`, rotating layers with `keep > 0` or any other class would give
    wrong KV if sliced. Whether a supported structure is exact for a given model is measured by
    `kvtool.cache.selfcheck`, not assumed here.
    """
    if not allow_lists and any(isinstance(c, CacheList) for c in cache):
        return "cache layers of type CacheList are not plain KVCache"
    flat = leaves(cache)

    def ok(c) -> bool:
        return (type(c) is KVCache or (allow_rotating and type(c) is RotatingKVCache and c.keep == 0)
                or (allow_state and type(c) is ArraysCache))

    bad = [c for c in flat if not ok(c)]
    kinds = sorted({type(c).__name__ for c in bad})
    if kinds:
        if allow_rotating and any(type(c) is RotatingKVCache for c in bad):
            keeps = sorted({c.keep for c in bad if type(c) is RotatingKVCache})
            return (f"cache layers of type {', '.join(kinds)} are not plain KVCache (or RotatingKVCache with "
                    f"keep=0; here keep={','.join(map(str, keeps))})")
        return f"cache layers of type {', '.join(kinds)} are not plain KVCache"
    if not flat:
        return "the model has no KV cache layers"
    return None


def sliding_windows(cache: list) -> tuple[int | None, ...]:
    """Per leaf (`leaves`) the window (`max_size`) of a `RotatingKVCache`, None for other leaves."""
    return tuple(c.max_size if type(c) is RotatingKVCache else None for c in leaves(cache))


def map_leaves(cache: Sequence, fn) -> list:
    """The same structure (`CacheList`s rebuilt) with every leaf replaced by `fn(leaf, i)`, `i`
    its index in `leaves(cache)`."""
    counter = iter(range(1 << 30))

    def walk(entries):
        out = []
        for c in entries:
            if isinstance(c, CacheList):
                out.append(CacheList(*walk(c.caches)))
            else:
                out.append(fn(c, next(counter)))
        return out

    return walk(cache)


def trim_kv(cache: Sequence, n: int) -> None:
    """Trim `n` tokens off every KV leaf (state leaves hold no tokens; see `kvtool.cache.prefix`)."""
    for c in leaves(cache):
        if not isinstance(c, ArraysCache):
            c.trim(n)


def kv_offset(cache: Sequence) -> int | None:
    """Tokens held by the first KV leaf (None: no KV leaf)."""
    for c in leaves(cache):
        if not isinstance(c, ArraysCache):
            return int(c.offset)
    return None


def cache_arrays(cache: Sequence) -> list:
    """Every array a prompt cache holds (for `mx.eval`), `CacheList`s flattened."""
    out: list = []
    for c in leaves(cache):
        if isinstance(c, ArraysCache):
            out += [a for a in c.cache if a is not None]
        elif isinstance(c, QuantizedKVCache):
            if c.keys is not None:
                out += list(c.keys) + list(c.values)
        elif getattr(c, "keys", None) is not None:
            out += [c.keys, c.values]
    return out


# ------------------------------------------------------------------ restore buffers
def kv_layout_of(cache: list[KVCache], bits: int = 0, group_size: int = 0) -> KVLayout:
    """The per-layer KV layout of a filled cache (keys/values `[B, H, T, D]`).

    Args:
        cache: a model's prompt cache after one token (KV leaves, `ArraysCache` state layers,
            `CacheList`s of them).
        bits, group_size: quantisation of the layout (0: plain), see `KVLayout`.

    Raises:
        ValueError: unsupported dtype, keys and values with different head counts, head dims
            that do not quantise with `bits`/`group_size`, or a state layer that is not a batch of
            one array per slot.
    """
    if any(isinstance(c, (ArraysCache, CacheList)) for c in cache):
        return _layout_with_states(cache, bits, group_size)
    return KVLayout(tuple(_heads(c) for c in cache), dtype_name(cache[0].keys.dtype), bits, group_size)


def _heads(c) -> tuple[int, int, int]:
    """`(n_kv_heads, key head dim, value head dim)` of a KV leaf."""
    _, h, _, dk = c.keys.shape
    _, hv, _, dv = c.values.shape
    if h != hv:
        raise ValueError(f"keys have {h} heads but values {hv}")
    return int(h), int(dk), int(dv)


def _layout_with_states(cache: list, bits: int, group_size: int) -> KVLayout:
    states, layers, kv_dtypes, state_dtypes = [], [], set(), []
    for c in leaves(cache):
        if isinstance(c, ArraysCache):
            if not c.cache or any(a is None or a.shape[0] != 1 for a in c.cache) or len(c.cache) > 9:
                raise ValueError("a state layer whose state is not a batch of one array per slot")
            states += [tuple(int(x) for x in a.shape) for a in c.cache]
            state_dtypes += [dtype_name(a.dtype) for a in c.cache]
        else:
            layers.append(_heads(c))
            kv_dtypes |= {c.keys.dtype, c.values.dtype}
    if len(kv_dtypes) > 1:
        raise ValueError(f"KV arrays of several dtypes {sorted(str(d) for d in kv_dtypes)}")
    dtype = dtype_name(kv_dtypes.pop()) if kv_dtypes else (state_dtypes[0] if state_dtypes else "float32")
    sdt = tuple(state_dtypes) if any(d != dtype for d in state_dtypes) else ()
    return KVLayout(tuple(layers), dtype, bits, group_size, cache_kinds(cache), tuple(states), sdt)

