"""Sliding-window layers in kvtool: a full-attention view to prefill into and cut blocks from
(`WindowedKVCache`), and mlx-lm's own `RotatingKVCache` state rebuilt from it for decoding
(`rotating_from_full`). Whether a model's sliding layers are exact this way is measured per
model by `kvtool.cache.selfcheck`.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import numpy as np
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import KVCache, RotatingKVCache

from kvtool.kv.tree import map_leaves


class WindowedKVCache(KVCache):
    """A full-attention view of a sliding-window layer, used while prefilling.

    It keeps every token's KV (so blocks can be cut from it and restored into it, as for any
    `KVCache`) and masks attention to the last `max_size` tokens, as mlx-lm's `RotatingKVCache`
    does. Measured bit-identical on the CPU backend (llama sliding layers, gemma3_text): a layer
    prefilled this way and converted by `rotating_from_full` continues exactly as mlx-lm's own
    rotating path, for prompts shorter and longer than the window and any chunking.
    """

    def __init__(self, max_size: int):
        super().__init__()
        self.max_size = max_size

    def make_mask(self, N: int, window_size: int | None = None, return_array: bool = False, **kwargs):
        return create_causal_mask(N, self.offset, window_size=window_size or self.max_size)


def as_windowed(c: KVCache, max_size: int) -> WindowedKVCache:
    """The same buffers as a `WindowedKVCache` (no copy)."""
    w = WindowedKVCache(max_size)
    w.keys, w.values, w.offset = c.keys, c.values, c.offset
    return w


def rotating_layout(n: int, max_size: int, step: int) -> tuple[np.ndarray, int]:
    """Which token each slot of mlx-lm's `RotatingKVCache(max_size, keep=0)` holds after
    generate_step prefilled `n` tokens in chunks of `step`, and its `_idx`.

    Runs mlx-lm's own `update_and_fetch` (concatenating chunks of several tokens, writing a
    one-token chunk in place, trimming and rotating) on token numbers instead of KV, so the
    layout is mlx-lm's by construction. Returns `(slots, idx)`: per buffer slot the token
    number, or -1 for a slot mlx-lm allocated but has not written (zeros).
    """
    r = RotatingKVCache(max_size=max_size, keep=0)
    pos = 0
    while pos < n:
        end = min(pos + step, n)
        marks = mx.arange(pos + 1, end + 1, dtype=mx.float32).reshape(1, 1, end - pos, 1)
        r.update_and_fetch(marks, marks)
        pos = end
    slots = np.array(r.keys[0, 0, :, 0]).astype(np.int64) - 1  # exact: token numbers < 2**24
    *_, idx = r.state  # mlx-lm 0.32.2: (keys, values, offset, keep, max_size, _idx)
    return slots, int(idx)


def rotating_from_full(c: KVCache, n: int, max_size: int, step: int) -> RotatingKVCache:
    """mlx-lm's own `RotatingKVCache` state after its prefill of `n` tokens in chunks of `step`,
    built from a full view `c` holding (at least) those tokens' KV: the same buffer (slot by
    slot, see `rotating_layout`), `offset` and `_idx`, so the next `update_and_fetch` (the last
    prompt token, then decode) continues exactly as mlx-lm's does."""
    r = RotatingKVCache(max_size=max_size, keep=0)
    if n == 0:
        return r
    if n >= 1 << 24:
        raise ValueError("prompt too long for the rotating layout simulation")
    slots, idx = rotating_layout(n, max_size, step)
    lo = int(slots[0])
    if lo >= 0 and np.array_equal(slots, np.arange(lo, lo + len(slots))):
        r.keys = mx.contiguous(c.keys[..., lo : lo + len(slots), :])
        r.values = mx.contiguous(c.values[..., lo : lo + len(slots), :])
    else:
        take = mx.array(np.maximum(slots, 0).astype(np.int32))
        empty = mx.array(slots < 0).reshape(1, 1, -1, 1)
        r.keys = mx.where(empty, mx.zeros((), c.keys.dtype), mx.take(c.keys, take, axis=2))
        r.values = mx.where(empty, mx.zeros((), c.values.dtype), mx.take(c.values, take, axis=2))
    r.state = (r.keys, r.values, n, r.keep, r.max_size, idx)  # sets offset and _idx (as `rotating_layout`)
    return r


DEFAULT_STEP = 2048  # mlx-lm's prefill_step_size default


def as_rotating(cache: list, n: int, step: int = DEFAULT_STEP) -> list:
    """A restored cache of `n` tokens as mlx-lm's own classes: every `WindowedKVCache` leaf (a
    `CacheList` walked) becomes the `RotatingKVCache` mlx-lm leaves after prefilling `n` tokens
    (`rotating_from_full`), so mlx-lm's own prefill and decode continue from it exactly as from
    its own cache (measured by the self-check's "used as-is" request); other leaves stay."""
    return map_leaves(cache, lambda c, i: rotating_from_full(c, n, c.max_size, step)
                      if isinstance(c, WindowedKVCache) else c)


def with_windows(cache: Sequence, windows: Sequence[int | None]) -> list:
    """A restored cache with its sliding-window leaves as `WindowedKVCache` full views (no copy);
    `windows` per leaf as `sliding_windows` (empty: unchanged)."""
    if not windows:
        return list(cache)

    def view(c, i: int):
        w = windows[i]
        return as_windowed(c, w) if w is not None else c

    return map_leaves(cache, view)


__all__ = ["DEFAULT_STEP", "WindowedKVCache", "as_rotating", "as_windowed", "rotating_from_full", "rotating_layout", "with_windows"]
