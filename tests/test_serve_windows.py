"""`kvtool serve` caching models with sliding-window and state layers, against `mlx_lm.server`.

mlx-lm's server hands back a cache whose rotating windows have overwritten early positions and
whose state layers hold only the state at the end, so for these models `kvtool serve` prefills
the prompt itself at fetch (kvtool/server/adapter.py): blocks with block-boundary states are
stored, and mlx-lm gets its own cache state before the last prompt token. End to end, per
family (tests/model_zoo.py: a sliding-window model, a state-layer model): `mlx_lm.server` (the
oracle) and `kvtool serve` answer the same greedy chat requests in the same order; the first
request is cold, a second one sharing its long system prompt hits (`cached_tokens` in the
response and the request's record), a restarted server hits from SSD; every output equals the
oracle's. In process: the adapter's records and inserts for such a model.
"""

from __future__ import annotations

import signal
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from tests import model_zoo
from tests.test_serve_http import DEMO, Proc, chat, client, start_oracle, stats

pytestmark = pytest.mark.slow

SYSTEM = "You summarise documentation. " + DEMO[:1200]  # ~300 tokens: every zoo window (24, 96) wraps
QUESTIONS = ["What is the first paragraph about?", "Name one module it mentions."]
FAMILIES = ["gemma3_text", "gpt_oss", "lfm2", "qwen3_next"]  # sliding windows (+ sinks); conv state; gated delta


def _messages(question: str, history: tuple[str, str] | None = None) -> list[dict]:
    msgs = [{"role": "system", "content": SYSTEM}]
    if history is not None:
        msgs += [{"role": "user", "content": history[0]}, {"role": "assistant", "content": history[1]}]
    return msgs + [{"role": "user", "content": question}]


def _start(tmp: Path, name: str, model: Path) -> Proc:
    cfg = tmp / "kv.toml"
    cfg.write_text("block_size = 32\n")
    proc = Proc([__import__("sys").executable, "-m", "kvtool.cli.app", "serve", "--model", str(model), "--port", "0",
                 "--cache-dir", str(tmp / "cache"), "--config", str(cfg)], tmp / f"{name}.log")
    proc.url = proc.wait_for(r"listening on (http://127\.0\.0\.1:\d+)", timeout=120).group(1)
    return proc


def _requests(c) -> list[tuple[str, str, int | None]]:
    """Cold; the same system prompt, another question (streamed); the first exchange extended."""
    first = chat(c, _messages(QUESTIONS[0]))
    second = chat(c, _messages(QUESTIONS[1]), stream=True)
    third = chat(c, _messages(QUESTIONS[1], (QUESTIONS[0], first[0])))
    return [first, second, third]


@pytest.mark.parametrize("family", FAMILIES)
def test_serve_caches_windowed_and_state_models_like_mlx_lm_server(family, tmp_path):
    model = model_zoo.family_dir(family)
    oracle = start_oracle(tmp_path, str(model))
    try:
        expected = _requests(client(oracle))
    finally:
        oracle.stop()
    assert all(t[0] for t in expected)

    a = _start(tmp_path, "a", model)
    try:
        got = _requests(client(a))
        assert [g[:2] for g in got] == [e[:2] for e in expected]
        doc = stats(a)
        assert doc["uncached_reason"] is None, doc["uncached_reason"]
        recs = doc["requests"]
        assert [r["cached_tokens"] for r in recs][0] == 0 and got[0][2] == 0  # cold, and reported so
        for rec, g in zip(recs[1:], got[1:]):
            assert rec["cached_tokens"] > 0 and rec["ram_hit_tokens"] == rec["cached_tokens"]
            assert g[2] == rec["cached_tokens"]  # the response's usage.cached_tokens is the true hit
            assert rec["prompt_tokens"] == rec["cached_tokens"] + rec["prefill_tokens"]
        assert all(r["blocks_stored"] > 0 for r in recs) and all(r["finished"] for r in recs)
        assert doc["adapter"]["requests_prefilled"] == 3 and doc["adapter"]["inserts_uncacheable"] == 0
        assert a.stop(signal.SIGTERM) == 143 and "shutdown_clean=True" in a.text()

        # a restart: empty RAM, the stored self-check verdict, the prefix from SSD
        a = _start(tmp_path, "b", model)
        c = client(a)
        again = chat(c, _messages(QUESTIONS[1], (QUESTIONS[0], got[0][0])))
        assert again[:2] == expected[2][:2]
        rec = stats(a)["requests"][-1]
        assert rec["ssd_hit_tokens"] > 0 and again[2] == rec["cached_tokens"] == rec["ssd_hit_tokens"]
    finally:
        a.kill()


def test_adapter_prefills_and_stores_at_fetch(tmp_path):
    """In process, a state-layer model: fetch prefills and stores the prompt, hands mlx-lm its
    cache before the last token (the greedy continuation equals mlx-lm's own), the final insert
    only finishes the record, and the next fetch of a longer prompt hits."""
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    from kvtool.cache.prefix import PrefixCache
    from kvtool.config import KVToolConfig
    from kvtool.models.loader import compute_model_id, load_model
    from kvtool.server.adapter import KVToolPromptCache

    path = model_zoo.family_dir("lfm2")
    lm = load_model(str(path))
    cfg = KVToolConfig(ssd_cache_dir=tmp_path, block_size=32, ssd_async_writes=False)
    pc = PrefixCache.for_model(lm.model, cfg, model_id=compute_model_id(path, None), model_name="lfm2")
    cache = KVToolPromptCache(pc, model_key="M", model=lm.model, prefill_step=2048)
    ids = model_zoo.zoo_prompt(150)

    def mlx_lm_tokens(prompt_cache, rest) -> list[int]:
        return [int(t) for t, _ in generate_step(mx.array(rest), lm.model, max_tokens=4, prompt_cache=prompt_cache)]

    expected = mlx_lm_tokens(make_prompt_cache(lm.model), ids)
    try:
        got, rest = cache.fetch_nearest_cache("M", ids[:100])
        assert list(rest) == ids[99:100]
        rec = cache.stats()["requests"][-1]
        assert rec["cached_tokens"] == 0 and rec["blocks_stored"] == 4  # 3 blocks + the tail entry
        assert cache.reported_cached(ids[:100], 99) == 0 and cache.reported_cached(ids[:100], 99) == 99
        out = mlx_lm_tokens(got, rest)
        assert out == mlx_lm_tokens(make_prompt_cache(lm.model), ids[:100])
        cache.insert_cache("M", ids[:100] + out, got)
        rec = cache.stats()["requests"][-1]
        assert rec["finished"] and rec["generated_tokens"] == len(out) and cache.stats()["adapter"]["waiting"] == 0

        got, rest = cache.fetch_nearest_cache("M", ids)
        rec = cache.stats()["requests"][-1]
        # the first prompt's tail entry (its state is the one before its last token)
        assert rec["cached_tokens"] == 99 and list(rest) == ids[-1:]
        assert mlx_lm_tokens(got, np.asarray(rest)) == expected
    finally:
        cache.close()


@pytest.mark.parametrize("family", ["gemma3_text", "lfm2"])
def test_adapter_stores_the_kv_a_prefill_computes(family, tmp_path):
    """What the adapter stores at fetch (before mlx-lm forwards the last token) is bit for bit
    the KV and states kvtool's prefill computes for the prompt, which the self-check measured
    equal to mlx-lm's own: the prompt restored from the tiers (every token but the last, the
    state before the last token) equals a fresh prefill's cache, every array."""
    from kvtool.cache.prefix import PrefixCache
    from kvtool.cache.selfcheck import _same
    from kvtool.config import KVToolConfig
    from kvtool.kv import blocks, prefill
    from kvtool.models.loader import compute_model_id, load_model
    from kvtool.server.adapter import KVToolPromptCache

    path = model_zoo.family_dir(family)
    lm = load_model(str(path))
    cfg = KVToolConfig(ssd_cache_dir=tmp_path, block_size=32, ssd_async_writes=False)
    pc = PrefixCache.for_model(lm.model, cfg, model_id=compute_model_id(path, None), model_name=family)
    assert pc.uncached_reason is None and (pc.windows or pc.has_states)
    cache = KVToolPromptCache(pc, model_key="M", model=lm.model, prefill_step=2048)
    ids = np.asarray(model_zoo.zoo_prompt(150), dtype=np.int32)
    try:
        cache.fetch_nearest_cache("M", ids.tolist())
        hit = pc.fetch(ids, full_views=True)
        try:
            assert hit.cached_tokens == ids.size - 1
            states: dict = {}
            fresh = prefill.new_cache(lm.model, pc.windows)
            prefill.prefill(lm.model, fresh, ids, int(ids.size), 0, step=2048, states=states if pc.has_states else None,
                            block_size=32)
            n = ids.size - 1
            kv = [(a, b) for a, b in zip(blocks.leaves(fresh), blocks.leaves(hit.cache)) if hasattr(a, "keys")]
            assert len(blocks.leaves(hit.cache)) == len(blocks.leaves(fresh)) and kv
            for i, (a, b) in enumerate(kv):
                assert int(b.offset) == n
                assert _same(a.keys[..., :n, :], b.keys[..., :n, :]), f"KV leaf {i} keys"
                assert _same(a.values[..., :n, :], b.values[..., :n, :]), f"KV leaf {i} values"
            got = blocks.state_arrays(hit.cache)
            assert len(got) == len(states.get(n, [])) and all(_same(x, y) for x, y in zip(states.get(n, []), got))
        finally:
            pc.release(hit)
    finally:
        cache.close()


def test_stats_answer_during_kvtool_s_prefill_and_a_reconfiguration_meanwhile_stores_nothing(tmp_path):
    """The model's forward passes of kvtool's prefill run outside the adapter's lock (the stats
    route answers meanwhile); a reconfiguration during them: the request is still served (its
    cache is its own), nothing is stored under the new layout."""
    import threading

    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    from kvtool.cache.prefix import PrefixCache
    from kvtool.config import KVToolConfig
    from kvtool.models.loader import compute_model_id, load_model
    from kvtool.server.adapter import KVToolPromptCache

    path = model_zoo.family_dir("gemma3_text")
    lm = load_model(str(path))
    entered, go = threading.Event(), threading.Event()

    class Gated:  # the model, held at its first forward pass until `go`
        def __call__(self, *args, **kwargs):
            entered.set()
            assert go.wait(60)
            return lm.model(*args, **kwargs)

        def __getattr__(self, name):
            return getattr(lm.model, name)

    cfg = KVToolConfig(ssd_cache_dir=tmp_path, block_size=32, ssd_async_writes=False)
    pc = PrefixCache.for_model(lm.model, cfg, model_id=compute_model_id(path, None), model_name="gemma3_text")
    cache = KVToolPromptCache(pc, model_key="M", model=Gated(), prefill_step=2048)
    ids = model_zoo.zoo_prompt(150)
    out: list = []
    worker = threading.Thread(target=lambda: out.append(cache.fetch_nearest_cache("M", ids)))
    worker.start()
    try:
        assert entered.wait(60)
        assert cache.stats()["adapter"]["requests"] == 1  # answered while the prefill runs
        cache.reconfigure(KVToolConfig(ssd_cache_dir=tmp_path, block_size=16, ssd_async_writes=False))
    finally:
        go.set()
        worker.join(60)
    try:
        got, rest = out[0]
        rec = cache.stats()["requests"][-1]
        assert rec["blocks_stored"] == 0 and cache.stats()["cache"].get("kv_ram_inserts", 0) == 0
        expected = [int(t) for t, _ in generate_step(mx.array(ids), lm.model, max_tokens=4,
                                                     prompt_cache=make_prompt_cache(lm.model))]
        assert [int(t) for t, _ in generate_step(mx.array(rest), lm.model, max_tokens=4, prompt_cache=got)] == expected
    finally:
        cache.close()
