"""Reply KV reuse (kvtool/cache/reply.py and the adapter's final insert).

- the reply probe's verdict on this backend, stored in the namespace's index meta and reused by a
  later cache (not measured again); a verdict that does not parse counts as not measured;
- a decode whose KV deliberately differs from the prefill's (one layer's key projection scaled
  for one-token forwards) is measured "not identical", naming the layer and position;
- what the probe cannot decide (the switch off, quantized KV) is a no with its reason;
- end to end: a two-turn chat through a real `kvtool serve`, turn 2 re-sending turn 1's reply:
  turn 2's cached tokens cover turn 1's prompt and reply minus at most one block, its greedy
  output equals plain `mlx_lm.server`'s; with `--no-reply-cache` only turn 1's prompt hits.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest

from kvtool.cache import reply
from kvtool.cache.prefix import PrefixCache
from kvtool.config import KVToolConfig
from tests.test_serve_http import SYSTEM, USERS, client, kvtool_cli, start_kvtool, start_oracle, stats

openai = pytest.importorskip("openai")

BS = 32  # block size of the end-to-end servers: turn 1 ends inside a block (172 + 39 tokens held)
REPLY_TOKENS = 40


@pytest.fixture(autouse=True)
def _fresh_memo():
    reply._memo.clear()
    yield
    reply._memo.clear()


def prefix_cache(tiny_model, cache_dir, **cfg) -> PrefixCache:
    config = KVToolConfig(ssd_cache_dir=cache_dir, block_size=16, ssd_async_writes=False, **cfg)
    return PrefixCache.for_model(tiny_model.model, config, model_id=tiny_model.model_id, model_name="tiny")


def test_probe_verdict_is_stored_and_reused(tiny_model, tmp_path):
    runs = reply.RUNS
    with prefix_cache(tiny_model, tmp_path / "c") as pc:
        verdict = reply.ensure(pc, tiny_model.model)
        assert reply.RUNS == runs + 1
        assert reply.stored_verdict(pc.ssd) == verdict
        decided = reply.decide(pc, tiny_model.model)
    assert verdict.device == reply.device() and verdict.decode_steps == reply.DECODE_STEPS
    if verdict.device.startswith("cpu"):  # measured on this machine's CPU backend: decode KV == prefill KV
        assert verdict.exact and verdict.reason is None, verdict
    assert decided == reply.ReplyReuse(verdict.exact, verdict.describe())
    reply._memo.clear()
    with prefix_cache(tiny_model, tmp_path / "c") as pc:  # a later process: read, not measured
        assert reply.ensure(pc, tiny_model.model) == verdict and reply.RUNS == runs + 1
        namespace = pc.namespace_dir.name
    text = _inspect(tmp_path / "c", namespace)
    assert f"reply KV    {'exact' if verdict.exact else 'differs'} ({reply.DECODE_STEPS} decode steps on" in text
    with prefix_cache(tiny_model, tmp_path / "c") as pc:
        pc.ssd.index.set_meta({reply.META_KEY: '{"exact": true}'})  # an older / unknown format: not measured
        assert reply.stored_verdict(pc.ssd) is None
        assert reply.ensure(pc, tiny_model.model).exact == verdict.exact and reply.RUNS == runs + 2


def _inspect(cache_dir, namespace: str) -> str:
    """`kvtool inspect --namespace` (text), in process."""
    from typer.testing import CliRunner

    from kvtool.cli import app as app_module

    if not any(c.name == "inspect" for c in app_module.app.registered_commands):
        app_module._register()
    res = CliRunner().invoke(app_module.app, ["inspect", "--cache-dir", str(cache_dir), "--namespace", namespace])
    assert res.exit_code == 0, res.output
    return res.stdout


class _OneTokenDiffers(nn.Module):
    """A key projection whose one-token forwards (decode steps) round differently from a prefill's."""

    def __init__(self, proj):
        super().__init__()
        self.proj = proj

    def __call__(self, x: mx.array) -> mx.array:
        y = self.proj(x)
        return y * (1 + 2**-10) if x.shape[1] == 1 else y


def test_a_perturbed_decode_kv_is_detected(tiny_model):
    model = tiny_model.model
    attn = model.model.layers[1].self_attn
    original = attn.k_proj
    attn.k_proj = _OneTokenDiffers(original)
    try:
        verdict = reply.run(model, "test")
    finally:
        attn.k_proj = original
    assert not verdict.exact
    assert verdict.reason == (f"generate_step: layer 1 keys of position {reply.PROBE_TOKENS - 1} differ between "
                              "decode and prefill"), verdict.reason
    assert "layer 1 keys" in verdict.describe()
    if reply.device().startswith("cpu"):
        assert reply.run(model, "test").exact  # restored: as measured


def test_what_the_probe_cannot_decide_is_a_no(tiny_model, tmp_path):
    from kvtool.kv.model_kv import KVQuantization

    runs = reply.RUNS
    with prefix_cache(tiny_model, tmp_path / "off", reply_cache=False) as pc:
        assert reply.decide(pc, tiny_model.model) == reply.ReplyReuse(False, "turned off (reply_cache = false)")
    config = KVToolConfig(ssd_cache_dir=tmp_path / "q", block_size=16, ssd_async_writes=False)
    quant = KVQuantization(8, 32, 0, 2048)
    with PrefixCache.for_model(tiny_model.model, config, model_id=tiny_model.model_id, quant=quant) as pc:
        decided = reply.decide(pc, tiny_model.model)
    assert not decided.enabled and decided.reason.startswith("quantized KV"), decided
    assert reply.RUNS == runs  # nothing measured


def test_the_final_insert_stores_the_reply_blocks_the_cache_holds(tiny_model, tmp_path):
    """mlx-lm's final insert: `tokens` = prompt + generated, the cache may lack the last sampled
    token's KV: the full blocks and the tail entry within the cache's offset are stored; a later
    prompt re-sending the reply hits all of it, one re-rendering its end differently its common
    prefix. A reconfiguration does not measure; a known verdict carries over."""
    from kvtool.server import KVToolPromptCache
    from tests.test_serve_http import _run

    runs = reply.RUNS
    pc = prefix_cache(tiny_model, tmp_path / "c")
    adapter = KVToolPromptCache(pc, model_key="M", model=tiny_model.model)
    try:
        verdict = reply.ensure(pc, tiny_model.model)
        assert adapter.reply_reuse == reply.ReplyReuse(verdict.exact, verdict.describe()) and reply.RUNS == runs + 1
        if not verdict.exact:
            pytest.skip(f"this device's decode KV differs from prefill KV: {verdict.reason}")
        prompt = reply.probe_ids(40, salt=5)  # 2 full blocks of 16 + 8 tokens
        generated = reply.probe_ids(24, salt=9)  # 64 tokens in all; the cache holds 63 of them
        adapter.fetch_nearest_cache("M", prompt)
        adapter.insert_cache("M", prompt + generated, _run(tiny_model.model, prompt + generated[:-1]))
        st = adapter.stats()
        assert st["reply_kv_reuse"] == {"enabled": True, "reason": verdict.describe()}
        # block 3 (tokens 32..47) and the tail entry of tokens 48..62; token 63 is past the cache
        assert st["adapter"]["reply_blocks_stored"] == 2
        assert st["adapter"]["blocks_stored"] == 5  # the prompt's 2 blocks and tail entry, then the reply's 2
        cache, rest = adapter.fetch_nearest_cache("M", prompt + generated + [7])
        assert len(rest) == 64 + 1 - 63 and cache[0].offset == 63  # as much as mlx-lm's cache holds
        cache, rest = adapter.fetch_nearest_cache("M", prompt + generated[:20] + [7, 8, 9])  # a reply re-rendered
        assert len(rest) == 3 and cache[0].offset == 40 + 20  # its common prefix with the stored tail entry

        adapter.reconfigure(pc.config.replace(reply_cache=False))
        assert adapter.reply_reuse == reply.ReplyReuse(False, "turned off (reply_cache = false)")
        reply._memo.clear()
        adapter.reconfigure(pc.config.replace(reply_cache=True, block_size=8))  # a new namespace: not measured
        assert not adapter.reply_reuse.enabled and adapter.reply_reuse.reason.startswith("not measured")
        adapter.reconfigure(pc.config.replace(block_size=16))  # the first namespace holds the verdict
        assert adapter.reply_reuse.enabled and reply.RUNS == runs + 1
    finally:
        adapter.close()


# --------------------------------------------------------------------------- end to end
def _turn(c, messages) -> tuple[str, int, int, int]:
    """(text, prompt tokens, completion tokens, cached tokens) of a greedy chat request."""
    r = c.chat.completions.create(model="default_model", messages=messages, max_tokens=REPLY_TOKENS, temperature=0.0)
    details = r.usage.prompt_tokens_details
    return (r.choices[0].message.content, r.usage.prompt_tokens, r.usage.completion_tokens,
            details.cached_tokens if details else 0)


def _two_turns(c) -> tuple[tuple, tuple]:
    first = [{"role": "system", "content": SYSTEM[:600]}, {"role": "user", "content": USERS[0]}]
    t1 = _turn(c, first)
    t2 = _turn(c, [*first, {"role": "assistant", "content": t1[0]}, {"role": "user", "content": USERS[1]}])
    return t1, t2


@pytest.mark.slow
def test_an_agents_next_turn_reuses_the_reply(tmp_path):
    model_path = kvtool_cli("model", "path", "tiny").stdout.strip()
    cfg = tmp_path / "kv.toml"
    (tmp_path / "on").mkdir()
    (tmp_path / "off").mkdir()
    cfg.write_text(f"block_size = {BS}\n")
    oracle = start_oracle(tmp_path, model_path)
    procs = [oracle]
    try:
        want1, want2 = _two_turns(client(oracle))
        on = start_kvtool(tmp_path / "on", "on", "--config", str(cfg))
        procs.append(on)
        if not stats(on)["reply_kv_reuse"]["enabled"] and not reply.device().startswith("cpu"):
            pytest.skip(f"this device's decode KV differs from prefill KV: {stats(on)['reply_kv_reuse']}")
        assert "reply KV reuse on: measured: decode KV is bit-identical" in on.text()
        t1, t2 = _two_turns(client(on))
        st = stats(on)
        assert (t1[0], t2[0]) == (want1[0], want2[0])  # greedy output: plain mlx_lm.server's
        assert st["reply_kv_reuse"]["enabled"], st["reply_kv_reuse"]
        assert st["adapter"]["reply_blocks_stored"] > 0
        sent = t1[1] + t1[2]  # turn 1's prompt and reply, re-sent by turn 2
        assert sent - BS <= t2[3] <= t2[1], (t1, t2)
        assert t2[3] >= want2[3], (t2, want2)  # at least as much of the reply as mlx-lm's own cache

        off = start_kvtool(tmp_path / "off", "off", "--config", str(cfg), "--no-reply-cache")
        procs.append(off)
        assert "reply KV reuse off: turned off (reply_cache = false)" in off.text()
        o1, o2 = _two_turns(client(off))
        st = stats(off)
        assert (o1[0], o2[0]) == (want1[0], want2[0])
        assert st["reply_kv_reuse"] == {"enabled": False, "reason": "turned off (reply_cache = false)"}
        assert st["adapter"]["reply_blocks_stored"] == 0
        assert o2[3] <= o1[1], (o1, o2)  # only turn 1's prompt (its blocks and tail entry)
    finally:
        for p in procs:
            p.stop()
