"""What a model's KV cache looks like, for `PrefixCache`: probing a model's per-layer layout,
the uniform `KVGeometry` shorthand, the library versions in the layout key, and mlx-lm's KV
quantisation schedule (`KVQuantization`).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, RotatingKVCache, make_prompt_cache

from kvtool.disk.segment import KVLayout
from kvtool.kv.tree import cache_arrays, kv_layout_of, leaves, sliding_windows, unsupported_cache_reason

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


def probe_layout(model, max_kv_size: int | None = None,
                 quant: KVQuantization | None = None) -> tuple[KVLayout | None, str | None]:
    """Find a model's per-layer KV layout by one forward pass of one token.

    Plain `KVCache` leaves, sliding-window `RotatingKVCache` leaves (keep 0), `ArraysCache`
    state leaves and `CacheList`s of them have a layout; whether kvtool's blocks reproduce a
    given model's output with them is measured per model (`kvtool.cache.selfcheck`, run by
    `PrefixCache` when it attaches a namespace), not assumed from the model's code.

    Args:
        model: an mlx-lm model.
        max_kv_size: mlx-lm's `--max-kv-size`: for a model without its own `make_cache`, mlx-lm
            then uses `RotatingKVCache(max_kv_size, keep=4)` everywhere (refused, see below);
            models with one ignore it.
        quant: KV quantisation: the layout of its blocks (packed words, scales, biases).

    Returns:
        `(layout, None)`, or `(None, reason)` when kvtool cannot store the cache block-wise.
    """
    cache = make_prompt_cache(model, max_kv_size=max_kv_size)
    keeps = sorted({c.keep for c in leaves(cache) if type(c) is RotatingKVCache and c.keep > 0})
    if keeps:
        # Measured (tests/test_selfcheck.py): with keep > 0 mlx-lm's chunked prefill lets only the
        # first queries of each chunk attend to the kept tokens, so its own output changes with
        # prefill_step_size and no block is the same for two differently chunked prompts.
        return None, (f"max_kv_size={max_kv_size}: mlx-lm's RotatingKVCache(keep={keeps[0]}) attends to a "
                      "chunk-dependent set of tokens while prefilling (mlx-lm's own output changes with "
                      "prefill_step_size), so its KV cannot be reused block-wise")
    rotating = any(w is not None for w in sliding_windows(cache))
    structured = any(isinstance(c, (ArraysCache, CacheList)) for c in cache)
    reason = unsupported_cache_reason(cache, allow_rotating=True, allow_state=True, allow_lists=True)
    if reason is None and rotating and quant is not None:
        reason = ("kv_bits with sliding-window (RotatingKVCache) layers: mlx-lm cannot quantize them "
                  "(RotatingKVCache.to_quantized raises NotImplementedError)")
    if reason is None and structured and quant is not None:
        reason = "kv_bits with state layers (ArraysCache) or cache lists (CacheList) is not cached by kvtool"
    if reason is not None:
        return None, reason
    model(mx.array([[0]]), cache=cache)
    mx.eval(cache_arrays(cache))
    try:
        if quant is not None:
            return kv_layout_of(cache, quant.bits, quant.group_size), None
        return kv_layout_of(cache), None
    except ValueError as exc:
        return None, str(exc)


def quantized_kv_failure(model, quant: KVQuantization) -> str | None:
    """Why mlx-lm itself cannot run `model` with a quantized KV cache (None: it can).

    Measured, not looked up: mlx-lm's own `maybe_quantize_kv_cache` is applied after a
    2-token forward (as `generate_step` does once `quantized_kv_start` is reached), then one more
    token is forwarded. Model code that cannot attend over a `QuantizedKVCache` (gemma2's
    hand-written attention, attention sinks) or cache classes without quantisation
    (`RotatingKVCache`: "RotatingKVCache Quantization NYI") raise there; mlx-lm would raise the
    same error in the middle of a request whose prompt reaches `quantized_kv_start`.
    """
    from mlx_lm.generate import maybe_quantize_kv_cache

    cache = make_prompt_cache(model)
    try:
        model(mx.array([[1, 2]]), cache=cache)
        mx.eval(cache_arrays(cache))
        dims = {int(c.keys.shape[-1]) for c in leaves(cache) if isinstance(c, KVCache) and c.keys is not None}
        # a group size mx.quantize supports and every head dim takes (other groups are a settings
        # problem, reported as the layout's; none at all: nothing to measure)
        group = next((g for g in (quant.group_size, 64, 32, 128) if g in (32, 64, 128) and not any(d % g for d in dims)),
                     0)
        if not group:
            return None
        maybe_quantize_kv_cache(cache, 0, group, quant.bits)
        mx.eval(model(mx.array([[3]]), cache=cache))
    except Exception as exc:  # noqa: BLE001 - any error here is mlx-lm's limitation for this model
        return f"{type(exc).__name__}: {exc}"
    return None


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

    def miss_reason(self, cached: int, n_prompt: int) -> str:
        """Why a cached prefix of `cached` tokens is not used for an `n_prompt`-token prompt
        (`usable` is False), in words for the request's `uncached_reason`."""
        q = self.switch_point(n_prompt)
        if cached < q:
            return (f"kv_bits: the cached prefix ({cached} tokens) ends before mlx-lm's quantization start for this "
                    f"{n_prompt}-token prompt (its cache is quantized at token {q}: the first prefill chunk end "
                    f">= quantized_kv_start {self.start}); up to there mlx-lm's KV is plain, kvtool's blocks are "
                    f"quantized")
        return (f"kv_bits: mlx-lm quantizes this {n_prompt}-token prompt's cache at token {q}, not at "
                f"{self.canonical_switch} where the cached blocks were quantized (prefill chunks of {self.step})")

    def storable_until(self, n_prompt: int) -> int:
        """Full blocks ending at or before this offset hold canonical content (tail entries are
        only ever used with their last token trimmed, so they are always storable)."""
        q = self.switch_point(n_prompt)
        return n_prompt if (q == self.canonical_switch or q >= n_prompt) else q

    def key_extra(self) -> str:
        """Part of the layout key: what makes the stored content of this namespace."""
        return f"kv_bits={self.bits},kv_group_size={self.group_size},switch={self.canonical_switch}"
