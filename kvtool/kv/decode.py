"""Decoding after a prefill: mlx-lm's `generate_step`, with its first token handed out as soon as
it is sampled.

`generate_step` pipelines decode: before it hands out token `t` it builds and dispatches the
forward of token `t + 1` (`mx.async_eval`), which keeps the device busy between steps but puts one
step's graph construction, and on a CPU that step's competition for the cores, in front of the
*first* token. `tokens` samples the first token with the ops of
`generate_step`'s own `_step` (the model over the last prompt token, the cache quantised as
`maybe_quantize_kv_cache` does after each step, log-probabilities by `logsumexp`, the sampler),
on mlx-lm's `generation_stream`, yields it, and then lets `generate_step` go on from that token.
The tokens are the same, in the same order, with the same random draws (the first draw is
made first either way); only the first token comes earlier, and the pipelining starts one token
later. No cache logic here; `kvtool.engine.Engine` is its caller.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import mlx.core as mx
from mlx_lm.generate import generate_step, generation_stream, maybe_quantize_kv_cache

__all__ = ["tokens"]


def tokens(model: Any, cache: list, last: int, *, max_tokens: int, sampler: Callable[[mx.array], mx.array],
           prefill_step_size: int, quant: dict[str, Any]) -> Iterator[int]:  # fmt: skip
    """Generated token ids after a prompt whose tokens but the last are in `cache`.

    Args:
        model: the mlx-lm model.
        cache: mlx-lm caches holding every prompt token but the last (updated in place).
        last: the prompt's last token id.
        max_tokens: tokens to generate (>= 1).
        sampler: mlx-lm sampler (log-probabilities `[1, vocab]` -> token `[1]`).
        prefill_step_size: passed on to `generate_step`.
        quant: `kv_bits`, `kv_group_size`, `quantized_kv_start` as `generate_step` takes them
            (empty: no KV quantisation).

    Yields:
        Token ids (int), as `generate_step(mx.array([last]), ...)` yields them, the first one
        as soon as it is sampled.
    """
    with mx.stream(generation_stream):  # `generate_step`'s `_step` on a one-token prompt
        logits = model(mx.array([last])[None], cache=cache)[:, -1, :]
        if quant:
            maybe_quantize_kv_cache(prompt_cache=cache, **quant)
        logprobs = logits - mx.logsumexp(logits, keepdims=True)
        first = sampler(logprobs)
    mx.eval(first)
    token = int(first.item())  # type: ignore[arg-type]  # a token id
    yield token
    if max_tokens > 1:
        for t, _ in generate_step(mx.array([token]), model, max_tokens=max_tokens - 1, sampler=sampler,
                                  prompt_cache=cache, prefill_step_size=prefill_step_size, **quant):  # fmt: skip
            yield int(t)
