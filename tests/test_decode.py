"""`kvtool.kv.decode.tokens` yields what mlx-lm's `generate_step` yields on the same cache: greedy,
sampled with a seed (the same random draws in the same order), with KV quantisation, for one
token and for many."""

from __future__ import annotations

import copy

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_sampler

from kvtool.kv import decode
from kvtool.models.loader import load_model


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny")


@pytest.fixture(scope="module")
def prefilled(tiny):
    """A cache holding a 300-token prompt but its last token, and that last token."""
    text = open("kvtool/assets/demo_prompt.txt", encoding="utf-8").read()
    ids = tiny.tokenizer.encode(text)[:300]
    cache = make_prompt_cache(tiny.model)
    mx.eval(tiny.model(mx.array(ids[:-1])[None], cache=cache))
    return cache, ids[-1]


QUANT = {"kv_bits": 8, "kv_group_size": 32, "quantized_kv_start": 0}  # tiny: head_dim 32


@pytest.mark.parametrize("max_tokens", [1, 2, 9])
@pytest.mark.parametrize("sampling", [{"temp": 0.0}, {"temp": 0.9, "top_p": 0.9}, {"temp": 1.3}])
@pytest.mark.parametrize("quant", [{}, QUANT], ids=["plain", "kv8"])
def test_tokens_equal_generate_step(tiny, prefilled, max_tokens, sampling, quant):
    cache, last = prefilled
    mx.random.seed(1234)
    theirs = copy.deepcopy(cache)
    want = [int(t) for t, _ in generate_step(mx.array([last]), tiny.model, max_tokens=max_tokens,
                                             sampler=make_sampler(**sampling), prompt_cache=theirs, **quant)]  # fmt: skip
    mx.random.seed(1234)
    ours = copy.deepcopy(cache)
    got = list(decode.tokens(tiny.model, ours, last, max_tokens=max_tokens, sampler=make_sampler(**sampling),
                             prefill_step_size=2048, quant=quant))  # fmt: skip
    assert got == want and len(got) == max_tokens
    # generate_step forwards one token past the last it yields (dispatched ahead); after the
    # first token alone, `tokens` has not (it hands the first one out before any dispatch)
    assert ours[0].offset == theirs[0].offset - (max_tokens == 1)
