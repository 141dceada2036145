"""What a model's KV cache looks like, for `PrefixCache`: probing a model's per-layer layout,
the uniform `KVGeometry` shorthand, the library versions in the layout key, and mlx-lm's KV
quantisation schedule (`KVQuantization`).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, make_prompt_cache

from kvtool.blocks import kv_layout_of, sliding_windows, unsupported_cache_reason
from kvtool.store.segment import KVLayout

log = logging.getLogger("kvtool")


@dataclass(frozen=True)
class KVGeometry:
    """Uniform KV geometry (every layer alike): a shorthand for `KVLayout.uniform`."""

    n_layers: int
    n_kv_heads: int
    head_dim: int
    dtype: str = "float32"

    def layout(self) -> KVLayout:
        return KVLayout.uniform(self.n_layers, self.n_kv_heads, self.head_dim, self.dtype)


def library_versions() -> str:
    """Versions of the libraries that compute the KV (part of the layout key)."""
    import mlx_lm

    return f"mlx={mx.__version__},mlx_lm={mlx_lm.__version__}"  # type: ignore[attr-defined]  # mlx.core's stub omits __version__


# Model code whose sliding-window layers were measured bit-exact through a `WindowedKVCache`
# prefill + `rotating_from_full` (tests/test_families.py): their masks come from the cache's
# `make_mask(N, window_size=...)` and nothing else depends on the cache class.
ROTATING_VERIFIED = ("mlx_lm.models.llama", "mlx_lm.models.gemma3_text")
# Model code whose state layers (`ArraysCache`) were measured bit-exact under chunked prefill
# (the state after [0, a) then [a, b) equals the state after [0, b), every array, every bit), so
# a state checkpoint at a block end continues exactly (tests/test_families.py).
STATE_VERIFIED = ("mlx_lm.models.mamba", "mlx_lm.models.lfm2")


def probe_layout(model, max_kv_size: int | None = None,
                 quant: KVQuantization | None = None) -> tuple[KVLayout | None, str | None]:
    """Find a model's per-layer KV layout by one forward pass of one token.

    Args:
        model: an mlx-lm model.
        max_kv_size: mlx-lm's rotating-cache size (refused).
        quant: KV quantisation: the layout of its blocks (packed words, scales, biases).

    Returns:
        `(layout, None)` if every cache layer is a plain `KVCache`, else `(None, reason)`.
    """
    if max_kv_size is not None:
        return None, f"max_kv_size={max_kv_size} makes mlx-lm use a RotatingKVCache"
    cache = make_prompt_cache(model)
    rotating = any(w is not None for w in sliding_windows(cache))
    stateful = any(type(c) is ArraysCache for c in cache)
    module = type(model).__module__
    verified = module in ROTATING_VERIFIED
    state_ok = module in STATE_VERIFIED
    reason = unsupported_cache_reason(cache, allow_rotating=verified, allow_state=state_ok)
    if reason is None and rotating and quant is not None:
        reason = "kv_bits with sliding-window (RotatingKVCache) layers: mlx-lm does not quantize them"
    if reason is None and stateful and quant is not None:
        reason = "kv_bits with state (ArraysCache) layers is not cached"
    if reason is None and stateful and rotating:
        reason = "sliding-window and state layers in one model are not cached"
    if reason is not None:
        if rotating and not verified and "RotatingKVCache" in reason:
            reason += f" (sliding-window layers are cached for {', '.join(ROTATING_VERIFIED)} only)"
        if stateful and not state_ok and "ArraysCache" in reason:
            reason += f" (state layers are cached for {', '.join(STATE_VERIFIED)} only)"
        return None, reason
    model(mx.array([[0]]), cache=cache)
    mx.eval([c.state for c in cache])
    try:
        if quant is not None:
            return kv_layout_of(cache, quant.bits, quant.group_size), None
        return kv_layout_of(cache), None
    except ValueError as exc:
        return None, str(exc)


DEFAULT_QUANTIZED_KV_START = 5000  # mlx_lm.generate.DEFAULT_QUANTIZED_KV_START
DEFAULT_KV_GROUP_SIZE = 64  # mlx-lm's --kv-group-size default


@dataclass(frozen=True)
class KVQuantization:
    """mlx-lm's KV quantisation (`generate_step(kv_bits=, kv_group_size=, quantized_kv_start=)`)
    and what a block cache may do under it.

    mlx-lm quantizes the whole cache after the first model call whose end offset is
    >= `start`: prefill chunks end at `step`, `2*step`, ..., and at L-1 for an L-token prompt,
    then the last prompt token's step ends at L, decode steps at L+1, ... (`switch_point`).
    Before the switch every token's KV is the plain KV (then quantized, token by token: equal to
    quantizing a block alone); after it, KV is computed against the quantized cache.

    Canonical block content: the trajectory that switches at `canonical_switch`, the first
    chunk end >= start (every prompt longer than it switches there). Measured bit-exact on the
    CPU backend: the KV of a token does not depend on how the prefill is chunked, before or
    after the switch (plain and quantized attention), and `mx.quantize` of a block equals the
    block of the quantized cache.

    Attributes:
        bits: 2, 3, 4, 5, 6 or 8.
        group_size: quantisation group along the head dim.
        start: mlx-lm's `quantized_kv_start` (tokens).
        step: the prefill chunk (`prefill_step_size`).
    """

    bits: int
    group_size: int = DEFAULT_KV_GROUP_SIZE
    start: int = DEFAULT_QUANTIZED_KV_START
    step: int = 2048

    def __post_init__(self) -> None:
        if self.bits not in (2, 3, 4, 5, 6, 8) or self.group_size <= 0 or self.start < 0 or self.step < 1:
            raise ValueError(f"bad KV quantisation {self}")

    @property
    def canonical_switch(self) -> int:
        """The switch point of every prompt of more than this many tokens (+1)."""
        return max(1, math.ceil(self.start / self.step)) * self.step

    def switch_point(self, n_prompt: int) -> int:
        """Cache offset after which mlx-lm's generate_step quantizes, for an `n_prompt`-token prompt."""
        pos = 0
        while n_prompt - pos > 1:
            pos = min(pos + self.step, n_prompt - 1)
            if pos >= self.start:
                return pos
        return max(n_prompt, self.start)

    def usable(self, cached: int, n_prompt: int) -> bool:
        """May a restored quantized cache of `cached` tokens continue this prompt exactly?

        Only where mlx-lm's own cache is quantized at that offset with canonical content: at
        exactly the switch point, or past it when the switch is the canonical one.
        """
        q = self.switch_point(n_prompt)
        return cached > 0 and (cached == q or (q == self.canonical_switch and cached >= q))

    def storable_until(self, n_prompt: int) -> int:
        """Full blocks ending at or before this offset hold canonical content (tail entries are
        only ever used with their last token trimmed, so they are always storable)."""
        q = self.switch_point(n_prompt)
        return n_prompt if (q == self.canonical_switch or q >= n_prompt) else q

    def key_extra(self) -> str:
        """Part of the layout key: what makes the stored content of this namespace."""
        return f"kv_bits={self.bits},kv_group_size={self.group_size},switch={self.canonical_switch}"
