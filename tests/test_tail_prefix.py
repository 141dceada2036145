"""Tail prefix hits: a prompt that extends an earlier one reuses the earlier prompt's tail entry.

The earlier prompt `A` (300 tokens: 4 blocks of 64 and a 44-token tail entry) is stored; a
prompt that starts with all of `A` gets 300 cached tokens instead of 256, from RAM or from SSD
after a restart, and its output equals mlx-lm's own greedy generation without a cache. A prompt
that differs inside the tail, or stops short of the stored tail's tokens, gets the full blocks
only. A corrupt tail record is cut like any block. The next prompt's own full block over the
tail's tokens is still stored.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtool import KVToolConfig, PrefixCache
from kvtool.hashing import blake2b_chain, chain_hashes, tail_hash
from kvtool.tiers import tail_prefix
from tests.store_helpers import flip_record_byte
from tests.test_prefix_api import generate as _generate
from tests.test_prefix_api import serve

BS = 64


@pytest.fixture(scope="module")
def prompts(tiny_model):
    ids = tiny_model.tokenizer.encode(open("kvtool/assets/demo_prompt.txt", encoding="utf-8").read())
    assert len(ids) >= 700
    return ids[:300], ids[300:340]  # A (4 blocks + a 44-token tail), and what the next turn adds


def generate(tiny, prompt) -> list[int]:
    return _generate(tiny.model, tiny.tokenizer, prompt)


def config(tmp_path, **kw) -> KVToolConfig:
    return KVToolConfig(ssd_cache_dir=tmp_path, ssd_async_writes=False, block_size=BS, **kw)


def test_extended_prompt_reuses_the_tail_from_ram_and_from_ssd(tiny_model, prompts, tmp_path):
    a, more = prompts
    b = a + more
    ref = generate(tiny_model, b)
    with PrefixCache.for_model(tiny_model.model, config(tmp_path), model_id=tiny_model.model_id) as pc:
        serve(pc, tiny_model, a)
        out, hit = serve(pc, tiny_model, b)
        assert out == ref
        assert (hit.cached_tokens, hit.ram_tokens, hit.ssd_tokens) == (300, 300, 0)
        assert hit.remaining.tolist() == more
        assert pc.stats()["kv_tail_prefix_hits"] == 1
        # B's own block 4 (tokens 256..319) and its tail were stored: B again is a full hit
        again, hit = serve(pc, tiny_model, b)
        assert again == ref and hit.cached_tokens == len(b) - 1
    with PrefixCache.for_model(tiny_model.model, config(tmp_path), model_id=tiny_model.model_id) as pc:  # a restart
        c = a + more[:10]  # 310 tokens, A's tail entry (44 tokens) is a prefix of it, from SSD ...
        out, hit = serve(pc, tiny_model, c)
        assert out == generate(tiny_model, c)
        # ... but B's block 4 (a sibling, kvtool.tiers.siblings) holds all of c's tokens but the last
        assert (hit.cached_tokens, hit.ssd_tokens, hit.ram_tokens) == (309, 309, 0)
        assert pc.stats()["kv_partial_block_hits"] == 1


@pytest.mark.parametrize("edit", ["token_in_tail", "stops_inside_tail"])
def test_no_tail_prefix_unless_every_tail_token_matches(tiny_model, prompts, tmp_path, edit):
    """No tail prefix hit; the tail entry still serves as a sibling up to the first difference."""
    a, more = prompts
    if edit == "token_in_tail":
        b = [*a[:290], (a[290] + 1) % 1000, *a[291:], *more]
    else:  # 24 of the tail's 44 tokens, then others: no stored tail is a prefix of it
        b = [*a[:280], *more]
    with PrefixCache.for_model(tiny_model.model, config(tmp_path), model_id=tiny_model.model_id) as pc:
        serve(pc, tiny_model, a)
        out, hit = serve(pc, tiny_model, b)
        assert out == generate(tiny_model, b)
        assert hit.cached_tokens == (290 if edit == "token_in_tail" else 280)
        assert pc.stats()["kv_tail_prefix_hits"] == 0 and pc.stats()["kv_partial_block_hits"] == 1


def test_corrupt_tail_record_is_cut_and_recomputed(tiny_model, prompts, tmp_path):
    a, more = prompts
    b = a + more
    with PrefixCache.for_model(tiny_model.model, config(tmp_path), model_id=tiny_model.model_id) as pc:
        serve(pc, tiny_model, a)
        store = pc.ssd
        full = chain_hashes(a, BS, pc.layout_key)
        flip_record_byte(store, tail_hash(a, BS, pc.layout_key, full))
    with PrefixCache.for_model(tiny_model.model, config(tmp_path), model_id=tiny_model.model_id) as pc:
        out, hit = serve(pc, tiny_model, b)
        assert out == generate(tiny_model, b)
        assert (hit.cached_tokens, hit.ssd_tokens) == (256, 256)
        assert pc.stats()["ssd_load_corrupt"] >= 1


@given(st.lists(st.integers(0, 2**31 - 1), min_size=2, max_size=80), st.integers(1, 64), st.data())
def test_candidate_keys_in_one_pass_are_the_hash_of_each_length(tokens, block_size, data):
    ids = np.array(tokens, np.int32)
    start = data.draw(st.integers(0, ids.size - 2))
    parent = "ab" * 16
    got = tail_prefix.candidates(blake2b_chain, block_size, ids, parent, start)
    kmax = min(block_size - 1, ids.size - start - 1)
    assert got == [(blake2b_chain(bytes.fromhex(parent), ids[start : start + k]), k) for k in range(kmax, 0, -1)]
    # any other hash function is called once per length, as given
    calls = []
    other = tail_prefix.candidates(lambda p, t: calls.append(t.size) or f"{t.size:032x}", block_size, ids, parent, start)
    assert other == [(f"{k:032x}", k) for k in range(kmax, 0, -1)] and calls == list(range(kmax, 0, -1))

