"""Partial-block prefix hits: prompts that share a prefix ending inside a block reuse it to the token.

Two prompts share their first 2,000 tokens (a system prompt) and then differ (the user turn).
Block 31 covers tokens 1,984..2,047, so a block cache alone reuses 1,984 tokens; the second
prompt must reuse exactly 2,000 — from the first prompt's block 31 (a sibling under the same
parent) — in RAM, in the writer's pending buffer, and on SSD after a restart, with output equal
to mlx-lm's own greedy generation without a cache. A corrupt sibling record is a miss (1,984).
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtool import KVToolConfig, PrefixCache
from kvtool.disk.fsops import FileOps
from kvtool.hashing import chain_hashes
from kvtool.tiers.siblings import truncate, usable_lens
from tests.store_helpers import flip_record_byte
from tests.test_prefix_api import generate as _generate
from tests.test_prefix_api import serve

BS = 64
SHARED = 2000


@pytest.fixture(scope="module")
def prompts(tiny_model):
    ids = tiny_model.tokenizer.encode(open("kvtool/assets/demo_prompt.txt", encoding="utf-8").read())
    shared = ids[:SHARED]
    x, y = ids[100:180], ids[600:680]  # block 31 (tokens 1,984..2,047) is full in both
    assert x[0] != y[0]
    return shared + x, shared + y


def generate(tiny, prompt) -> list[int]:
    return _generate(tiny.model, tiny.tokenizer, prompt)


def config(tmp_path, **kw) -> KVToolConfig:
    kw.setdefault("ssd_async_writes", False)
    return KVToolConfig(ssd_cache_dir=tmp_path, block_size=BS, **kw)


def _usable_len(ids, start: int, limit: int, t, block_size: int, quantized: bool) -> int:
    """One sibling, token by token: the rule `usable_lens` applies to all at once."""
    cap = min(limit, t.size - 1) if quantized and t.size < block_size else limit
    n = 0
    while n < min(cap, t.size) and t[n] == ids[start + n]:
        n += 1
    return n


TOKENS = st.integers(-2, 2)  # few values: long common prefixes; -1 and -2 stand for any id, padding is no id


@given(st.data())
def test_usable_lens_is_each_siblings_common_prefix(data):
    block_size = data.draw(st.integers(1, 8))
    ids = np.array(data.draw(st.lists(TOKENS, min_size=2, max_size=3 * block_size)), np.int32)
    start = data.draw(st.integers(0, ids.size - 2))
    limit = data.draw(st.integers(1, min(block_size, ids.size - start - 1)))
    sibs = [np.array(t, np.int32) for t in data.draw(st.lists(st.lists(TOKENS, min_size=1, max_size=block_size),
                                                              min_size=1, max_size=6))]
    quantized = data.draw(st.booleans())
    got = usable_lens(ids, start, limit, sibs, block_size, quantized)
    assert got.tolist() == [_usable_len(ids, start, limit, t, block_size, quantized) for t in sibs]


def test_usable_lens_and_truncate():
    a = np.array([1, 2, 3, 4], np.int32)
    ids = np.concatenate([a, [0]]).astype(np.int32)
    sibs = [np.array([1, 2, 9], np.int32), a[:3], np.array([7], np.int32), a]
    assert usable_lens(ids, 0, 4, sibs, 4, False).tolist() == [2, 3, 0, 4]
    assert usable_lens(ids, 0, 4, sibs, 4, True).tolist() == [2, 2, 0, 4]  # a quantized tail gives n - 1 at most
    from kvtool.disk.hostblock import HostBlock
    k = np.arange(2 * 4 * 3, dtype=np.float32).reshape(1, 2, 4, 3)
    host = HostBlock("a" * 32, "b" * 32, a, [k], [k + 1], "float32")
    cut = truncate(host, 2)
    assert cut.num_tokens == 2 and cut.keys[0].shape == (1, 2, 2, 3)
    assert np.array_equal(cut.values[0], (k + 1)[:, :, :2, :])


@pytest.mark.slow
def test_mid_block_divergence_reuses_the_shared_tokens_from_ram_and_ssd(tiny_model, prompts, tmp_path):
    a, b = prompts
    ref = generate(tiny_model, b)
    with PrefixCache.for_model(tiny_model.model, config(tmp_path), model_id=tiny_model.model_id) as pc:
        serve(pc, tiny_model, a)
        assert pc.probe(b) == SHARED  # what a fresh process would take from SSD
        out, hit = serve(pc, tiny_model, b)
        assert out == ref
        assert (hit.cached_tokens, hit.ram_tokens, hit.ssd_tokens) == (SHARED, SHARED, 0)
        assert pc.stats()["kv_partial_block_hits"] == 1
        # B's own block 31 was stored: B again is a full hit
        again, hit = serve(pc, tiny_model, b)
        assert again == ref and hit.cached_tokens == len(b) - 1
    c = a[:SHARED] + b[SHARED + 5 :]  # a third turn: shares 2,000 tokens with both
    with PrefixCache.for_model(tiny_model.model, config(tmp_path), model_id=tiny_model.model_id) as pc:  # a restart
        assert pc.probe(c) == SHARED
        out, hit = serve(pc, tiny_model, c)
        assert out == generate(tiny_model, c)
        assert (hit.cached_tokens, hit.ssd_tokens, hit.ram_tokens) == (SHARED, SHARED, 0)
        assert pc.stats()["kv_partial_block_hits"] == 1


@pytest.mark.slow
def test_mid_block_divergence_from_the_writers_pending_buffer(tiny_model, prompts, tmp_path):
    class BlockedWriteFS(FileOps):
        def __init__(self):
            self.entered, self.release = threading.Event(), threading.Event()

        def write_all(self, fd, data):
            self.entered.set()
            assert self.release.wait(timeout=60)
            return super().write_all(fd, data)

    a, b = prompts
    fs = BlockedWriteFS()
    pc = PrefixCache.for_model(tiny_model.model, config(tmp_path, ssd_async_writes=True, ram_bytes=0),
                               model_id=tiny_model.model_id, fs=fs)
    try:
        serve(pc, tiny_model, a)
        assert fs.entered.wait(timeout=60)
        out, hit = serve(pc, tiny_model, b)
        assert out == generate(tiny_model, b)
        assert (hit.cached_tokens, hit.ssd_tokens) == (SHARED, SHARED)
        assert pc.stats()["kv_partial_block_hits"] == 1
    finally:
        fs.release.set()
    assert pc.close().shutdown_clean


@pytest.mark.slow
def test_corrupt_sibling_record_is_a_miss(tiny_model, prompts, tmp_path):
    a, b = prompts
    with PrefixCache.for_model(tiny_model.model, config(tmp_path), model_id=tiny_model.model_id) as pc:
        serve(pc, tiny_model, a)
        block31 = chain_hashes(np.asarray(a, np.int32), BS, pc.layout_key)[SHARED // BS]
        flip_record_byte(pc.ssd, block31)
    with PrefixCache.for_model(tiny_model.model, config(tmp_path), model_id=tiny_model.model_id) as pc:
        out, hit = serve(pc, tiny_model, b)
        assert out == generate(tiny_model, b)
        assert hit.cached_tokens == SHARED // BS * BS  # the full blocks only
        assert pc.stats()["kv_partial_block_hits"] == 0
        assert pc.stats()["ssd_load_corrupt"] >= 1
