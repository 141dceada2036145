"""`PrefixCache` used directly from Python with `mlx_lm.stream_generate` (docs/python-api.md).

The output equals mlx-lm's own greedy generation without a cache: cold, on a RAM hit, and on an
SSD hit after a restart (a new PrefixCache = empty RAM tier).
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm import stream_generate
from mlx_lm.models.cache import make_prompt_cache

from kvtool import KVToolConfig, PrefixCache
from kvtool.kv import buffers as kvbuffers
from kvtool.models.loader import load_model
from tests.store_helpers import index_rows

MAX_TOKENS = 10


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny")


@pytest.fixture(scope="module")
def ids(tiny):
    return tiny.tokenizer.encode(open("kvtool/assets/demo_prompt.txt", encoding="utf-8").read())[:300]


def generate(model, tokenizer, prompt, cache=None):
    out = []
    for r in stream_generate(model, tokenizer, prompt, max_tokens=MAX_TOKENS, prompt_cache=cache):
        out.append(r.token)
    return out


def serve(pc: PrefixCache, tiny, ids):
    hit = pc.fetch(ids)
    cache = hit.cache or make_prompt_cache(tiny.model)
    tokens = generate(tiny.model, tiny.tokenizer, hit.remaining.tolist(), cache)
    pc.store(ids, cache, hit)
    pc.release(hit)
    return tokens, hit


@pytest.mark.parametrize("blank", [False, True], ids=["zeros", "unfilled"])
def test_stream_generate_over_prefix_cache_equals_mlx_lm(tiny, ids, tmp_path, blank, monkeypatch):
    """... also with SSD restores into buffers allocated without a fill (large KV's path)."""
    if blank:
        monkeypatch.setattr(kvbuffers, "BLANK_MIN_TENSOR_BYTES", 0)
    ref = generate(tiny.model, tiny.tokenizer, ids)
    cfg = KVToolConfig(ssd_cache_dir=tmp_path, ssd_async_writes=False)
    with PrefixCache.for_model(tiny.model, cfg, model_id=tiny.model_id, model_name="tiny") as pc:
        cold, hit = serve(pc, tiny, ids)
        assert cold == ref and hit.cached_tokens == 0
        ram, hit = serve(pc, tiny, ids)
        assert ram == ref and hit.ram_tokens == len(ids) - 1 and hit.remaining.tolist() == ids[-1:]
        stats = pc.stats()
    assert stats["kv_lookup_hits"] > 0
    with PrefixCache.for_model(tiny.model, cfg, model_id=tiny.model_id) as pc:  # a restart
        ssd, hit = serve(pc, tiny, ids)
        assert ssd == ref and hit.ssd_tokens == len(ids) - 1 and hit.ram_tokens == 0
        longer = ids + ids[:40]
        more, hit = serve(pc, tiny, longer)  # the old prompt's blocks and tail entry come from RAM (promoted)
        assert more == generate(tiny.model, tiny.tokenizer, longer)
        assert hit.ram_tokens == len(ids)  # 4 blocks + the 44-token tail entry (a tail prefix hit)
    assert pc.stats()["ssd_save_success"] > 0  # counters stay readable after close


def test_ram_hits_touch_their_ssd_rows(tiny, ids, tmp_path):
    """A prompt served from RAM moves the last access of its blocks' SSD rows (prune's TTL and LRU
    view of hot blocks), and of those blocks only."""
    cfg = KVToolConfig(ssd_cache_dir=tmp_path, ssd_async_writes=False)
    with PrefixCache.for_model(tiny.model, cfg, model_id=tiny.model_id) as pc:
        serve(pc, tiny, ids)
        other = ids[:100]
        serve(pc, tiny, ids[200:] + ids[:50])  # blocks of another chain: not touched below
        pc.flush()
        ssd = pc.tiered.ssd
        rows = {r.hash: r.last_access for r in index_rows(ssd.index)}
        ssd.clock = lambda: max(rows.values()) + 100.0
        _, hit = serve(pc, tiny, other)
        assert hit.ram_tokens == 99  # block 0 by its hash, then 35 tokens of the first prompt's block 1 (a sibling)
        pc.flush()
        after = {r.hash: r.last_access for r in index_rows(ssd.index)}
        first = pc.hashes(other)[0][0]
    assert {h for h in rows if after[h] != rows[h]} == {first} and after[first] == max(rows.values()) + 100.0


def test_uncached_model_fetch_returns_the_whole_prompt(tiny, ids, tmp_path):
    pc = PrefixCache(KVToolConfig(ssd_cache_dir=tmp_path), model_id="x", uncached_reason="test")
    hit = pc.fetch(ids)
    assert hit.cache == [] and hit.remaining.tolist() == ids and pc.store(ids, [], hit) == 0
    pc.release(hit)
    pc.close()


def test_public_names_import():
    import kvtool

    assert {"PrefixCache", "Engine", "KVToolConfig", "__version__"} <= set(kvtool.__all__)
    assert isinstance(kvtool.__version__, str) and kvtool.Engine.__name__ == "Engine"
    assert mx.array([1]).item() == 1
