"""kvtool's prefill of a prompt into a cache it can cut blocks from, and the hand-over to mlx-lm.

mlx-lm prefills a prompt (`generate_step`) in chunks of `prefill_step_size` tokens into the
caches of `make_prompt_cache(model)`, then forwards the last prompt token alone and decodes.
kvtool does the same, except where a block cache needs more than mlx-lm keeps:

- sliding-window leaves (`RotatingKVCache`, keep 0) are prefilled into full views
  (`kvtool.kv.windows.WindowedKVCache`: every token's KV kept, the window masked), and become
  mlx-lm's own rotating state (`rotating_from_full`) for the last prompt token;
- state leaves (`ArraysCache`) are snapshotted at every block end and before the last prompt
  token (chunks end there too), so each stored block carries the state after its last token;
- with KV quantisation the cache is quantized exactly where mlx-lm's `generate_step` would.

`CacheList` entries (a layer holding several caches) are walked leaf by leaf. Whether this
reproduces mlx-lm's own output bit for bit is measured per model (`kvtool.cache.selfcheck`): a
model whose cache has sliding-window leaves, state leaves or cache lists is cached only after
that measurement passed. Used by `kvtool.engine.Engine` and `kvtool.cache.selfcheck`.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache, make_prompt_cache

from kvtool.kv.blocks import state_arrays
from kvtool.kv.model_kv import KVQuantization
from kvtool.kv.tree import cache_arrays, leaves, map_leaves, trim_kv
from kvtool.kv.windows import WindowedKVCache, rotating_from_full


def new_cache(model, windows: Sequence[int | None] = (), max_kv_size: int | None = None) -> list:
    """An empty cache for a prefill: mlx-lm's own (`make_prompt_cache`), with every
    sliding-window leaf replaced by a `WindowedKVCache` full view when `windows` is given
    (per leaf, as `kvtool.kv.blocks.sliding_windows`)."""
    cache = make_prompt_cache(model, max_kv_size=max_kv_size)
    if not windows:
        return cache

    def view(c, i):
        w = windows[i] if i < len(windows) else None
        return WindowedKVCache(w) if w is not None and isinstance(c, RotatingKVCache) else c

    return map_leaves(cache, view)


def prefill(model, cache: list, tokens: np.ndarray, n_prompt: int, start: int, *, step: int,
            quant: KVQuantization | None = None, states: dict | None = None, block_size: int = 0,
            outputs: list | None = None) -> None:
    """Run the model over `tokens` (the prompt's tokens after the `start` ones `cache` holds) in
    chunks of `step`, filling `cache` in place, as mlx-lm's `generate_step` prefill.

    Args:
        model: the mlx-lm model.
        cache: the model's cache structure (full views for sliding-window leaves).
        tokens: int32 token ids `[T]`.
        n_prompt: tokens in the whole prompt (the quantisation switch and the state cuts
            depend on it).
        start: prompt tokens `cache` already holds.
        step: tokens per prefill chunk (`prefill_step_size`).
        quant: KV quantisation; the cache is quantized exactly at mlx-lm's switch point
            (`KVQuantization.switch_point`).
        states: with state leaves: chunks also end at every block end (`block_size`) and before
            the last prompt token, and `states[offset]` receives the state arrays there
            (`kvtool.kv.blocks.state_arrays`); None: no snapshots.
        block_size: tokens per block (with `states`).
        outputs: if given, receives the model's output (logits `[1, n, vocab]`) of every chunk
            (`kvtool.cache.selfcheck` compares them with mlx-lm's).
    """
    switch = quant.switch_point(n_prompt) if quant is not None else -1
    cuts: set[int] = set()
    if states is not None:
        cuts = set(range(block_size, n_prompt + 1, block_size)) | {n_prompt - 1, n_prompt}
        snap = state_arrays(cache)
        if start in cuts and snap and all(a is not None for a in snap):
            states[start] = snap
    i = 0
    while i < len(tokens):
        n = min(step, len(tokens) - i)
        if start + i < switch < start + i + n:
            n = switch - (start + i)
        nxt = [b for b in cuts if start + i < b < start + i + n]
        if nxt:
            n = min(nxt) - (start + i)
        out = model(mx.array(tokens[i : i + n])[None], cache=cache)
        if outputs is not None:
            outputs.append(out)
        mx.eval(cache_arrays(cache), out if outputs is not None else [])
        i += n
        if start + i == switch:
            quantize(cache, quant)
        if states is not None and start + i in cuts:  # (cuts is empty without states)
            states[start + i] = state_arrays(cache)


def quantize(cache: list, quant: KVQuantization | None) -> None:
    """mlx-lm's `maybe_quantize_kv_cache` at the switch point (layers already quantized stay)."""
    assert quant is not None  # only called at the switch point of a quantized cache
    for i, c in enumerate(cache):
        if hasattr(c, "to_quantized"):
            cache[i] = c.to_quantized(group_size=quant.group_size, bits=quant.bits)
    mx.eval(cache_arrays(cache))


def last_token_kv(full: list, n: int, windows: Sequence[int | None]) -> list[tuple[int, mx.array, mx.array]]:
    """The prefilled KV of an `n`-token prompt's last token in the KV leaves `generation_cache`
    hands to mlx-lm as they are (full attention, next to sliding-window leaves), as evaluated
    copies `(KV leaf index, keys [1, H, 1, Dk], values [1, H, 1, Dv])`.

    mlx-lm's decode forwards the last prompt token again, alone (some attention code takes
    another path for one token, e.g. MLA) and through rotating sliding layers, either of which
    can round the next layers' KV of that token differently from a prefill chunk (where a
    longer prompt computes it); `PrefixCache.store(last_kv=...)` stores these copies instead, so
    a block or tail entry ending there is what a longer prompt's prefill gives."""
    out: list[tuple[int, mx.array, mx.array]] = []
    j = 0
    for i, c in enumerate(leaves(full)):
        if isinstance(c, ArraysCache):
            continue
        if (windows[i] if i < len(windows) else None) is None and c.keys is not None and c.offset >= n:
            out.append((j, mx.contiguous(c.keys[..., n - 1 : n, :]), mx.contiguous(c.values[..., n - 1 : n, :])))
        j += 1
    mx.eval([a for _, k, v in out for a in (k, v)])
    return out


def for_generation(model, cache: list, ids: np.ndarray, start: int, *, step: int, windows: Sequence[int | None],
                   states: dict | None, quant: KVQuantization | None, block_size: int, stored: bool = True,
                   outputs: list | None = None) -> tuple[list, list | None, int]:
    """Prefill a prompt's tokens after the `start` ones `cache` holds and hand over to mlx-lm's
    `generate_step`, which forwards the last prompt token (as it does without a cache).

    Blockwise (full views of sliding windows, or `states` for state leaves): the whole rest is
    prefilled, then `generation_cache` gives mlx-lm its own cache at `n - 1`. Plain KV without
    quantisation: the rest is prefilled too, its last chunk holding at least 2 tokens (one more
    cached token is recomputed if needed), and the KV leaves are trimmed by one. Either way the
    last token's prefilled KV is returned for storing (`last_token_kv`), so a block or tail entry
    ending there holds what a longer prompt computes. With quantisation, a cache that is not
    stored (`stored` False: the model runs uncached) or leaves other than plain `KVCache`:
    mlx-lm's own schedule (the rest but the last token; nothing to patch).

    Args:
        ids: int32 prompt token ids `[n]` (n >= 1).
        start: prompt tokens `cache` holds.
        windows: per leaf sliding windows (full views), () if none.
        states: {} to collect state snapshots (state leaves), else None.
        stored: the prompt's blocks will be stored (False: the model runs uncached, exactly
            mlx-lm's schedule).
        outputs: collects the model's outputs (see `prefill`).

    Returns:
        (generation cache, last_kv or None, the token offset where `outputs` begin).
    """
    n = int(ids.size)
    if windows or states is not None:
        prefill(model, cache, ids[start:], n, start, step=step, quant=quant, states=states, block_size=block_size,
                outputs=outputs)
        last_kv = last_token_kv(cache, n, windows)
        return generation_cache(cache, n - 1, windows, step, states), last_kv, start
    if quant is not None or n < 2 or not stored or any(type(c) is not KVCache for c in leaves(cache)):
        prefill(model, cache, ids[start:-1], n, start, step=step, quant=quant, outputs=outputs)
        return cache, None, start
    if n - start < 2:  # the last chunk recomputes the token before the last as well
        trim_kv(cache, start - (n - 2))
        start = n - 2
    prefill(model, cache, ids[start:], n, start, step=step, outputs=outputs)
    last_kv = last_token_kv(cache, n, ())
    trim_kv(cache, 1)  # mlx-lm's generate_step forwards the last token again, alone
    return cache, last_kv, start


def generation_cache(full: list, n: int, windows: Sequence[int | None], step: int,
                     states: dict | None = None) -> list:
    """mlx-lm's cache after its own prefill of a prompt's first `n` tokens, built from the
    prefill cache `full` holding the whole prompt (same structure, `CacheList`s kept):
    full-attention leaves are trimmed to `n` (the last prompt token is forwarded again by
    `generate_step`, giving bit-identical KV), sliding-window leaves become the
    `RotatingKVCache` mlx-lm's chunked prefill (chunks of `step`) leaves (`rotating_from_full`),
    state leaves get the checkpoint taken after `n` tokens (`states[n]`)."""
    snapshot = list((states or {}).get(n) or [])

    def convert(c, i):
        w = windows[i] if i < len(windows) else None
        if isinstance(c, ArraysCache):
            a = ArraysCache(size=len(c.cache))
            if snapshot:
                a.cache = [snapshot.pop(0) for _ in range(len(c.cache))]
            return a
        if w is None:
            c.trim(c.offset - n)
            return c
        return rotating_from_full(c, n, w, step)

    out = map_leaves(full, convert)
    mx.eval(cache_arrays(out))
    return out


__all__ = ["for_generation", "generation_cache", "last_token_kv", "new_cache", "prefill", "quantize"]
