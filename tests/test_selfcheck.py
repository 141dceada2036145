"""The self-check (kvtool/cache/selfcheck.py): measured once per namespace, stored, reused, and the
only way a model with sliding windows, state layers or cache lists gets cached.

- the verdict is stored in the namespace's index meta and a later engine (a fresh process, or
  a subprocess) reads it instead of probing again (runs counted);
- a deliberately broken restore (a test hook perturbing one state / KV value) fails the
  self-check: the model is refused with the measured mismatch and still serves mlx-lm's tokens;
- the verdict is measured again when the code digest changes, and per namespace (block size);
- `kvtool inspect --namespace` shows it.
No timing assertions: the probe's cost is measured separately (see the report / README).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

from kvtool.cache import selfcheck
from kvtool.config import KVToolConfig
from kvtool.engine import Engine
from kvtool.kv import blocks
from kvtool.models.loader import load_model
from tests import model_zoo

BS = 32
_loaded: dict = {}


def loaded(family):
    if family not in _loaded:
        _loaded[family] = load_model(str(model_zoo.family_dir(family)))
    return _loaded[family]


def engine(family, cache_dir, **kw):
    cfg = KVToolConfig(ssd_cache_dir=cache_dir, block_size=kw.pop("block_size", BS), ssd_async_writes=False)
    return Engine(loaded(family), cfg, **kw)


def reference(family, ids, n=6):
    lm = loaded(family)
    out = []
    for tok, _ in generate_step(mx.array(ids), lm.model, max_tokens=n):
        if tok in lm.tokenizer.eos_token_ids:
            break
        out.append(int(tok))
    return out


@pytest.fixture(autouse=True)
def _fresh_memo():
    selfcheck._memo.clear()
    yield
    selfcheck._memo.clear()
    blocks.restore_hook = None


@pytest.mark.parametrize("family", ["gpt_oss", "qwen3_next"])
def test_verdict_is_stored_and_not_run_again(family, tmp_path):
    runs = selfcheck.RUNS
    eng = engine(family, tmp_path)
    assert eng.uncached_reason is None and selfcheck.RUNS == runs + 1
    ids = model_zoo.zoo_prompt(120)
    eng.generate(ids, max_tokens=4)
    verdict = selfcheck.stored_verdict(eng.cache.ssd)
    assert verdict is not None and verdict.passed and verdict.block_size == BS and verdict.probe_tokens >= 3 * BS
    eng.close()

    selfcheck._memo.clear()  # a later process: nothing in memory, the verdict on disk
    eng = engine(family, tmp_path)
    assert selfcheck.RUNS == runs + 1 and eng.uncached_reason is None
    res = eng.generate(ids, max_tokens=4)
    assert res.ssd_hit_tokens == len(ids) - 1 and res.token_ids == reference(family, ids, 4)
    eng.close()

    eng = engine(family, tmp_path, block_size=2 * BS)  # another namespace: measured for it
    assert selfcheck.RUNS == runs + 2 and eng.uncached_reason is None
    eng.close()


@pytest.mark.slow
def test_a_later_process_reuses_the_verdict(tmp_path):
    """A subprocess over the same cache directory: SSD hit, equal tokens, zero probes run."""
    family = "gemma4_text"
    ids = model_zoo.zoo_prompt(120)
    eng = engine(family, tmp_path)
    eng.generate(ids, max_tokens=4)
    assert eng.close().shutdown_clean
    code = f"""
import json, sys
sys.path.insert(0, {str(model_zoo.CACHE_DIR.parent.parent)!r})
from kvtool.cache import selfcheck
from kvtool.config import KVToolConfig
from kvtool.engine import Engine
from kvtool.models.loader import load_model
eng = Engine(load_model({str(model_zoo.family_dir(family))!r}),
             KVToolConfig(ssd_cache_dir={str(tmp_path)!r}, block_size={BS}, ssd_async_writes=False))
res = eng.generate({ids!r}, max_tokens=4)
eng.close()
print(json.dumps({{"runs": selfcheck.RUNS, "ssd": res.ssd_hit_tokens, "tokens": res.token_ids,
                   "reason": eng.uncached_reason}}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(model_zoo.CACHE_DIR.parent.parent)})
    assert out.returncode == 0, out.stderr[-2000:]
    doc = json.loads(out.stdout.strip().splitlines()[-1])
    assert doc == {"runs": 0, "ssd": len(ids) - 1, "tokens": reference(family, ids, 4), "reason": None}


def _perturb_first_state(cache):
    leaf = next(c for c in blocks.leaves(cache) if type(c).__name__ == "ArraysCache" and c.cache[0] is not None)
    a = leaf.cache[-1]
    flat = a.reshape(-1)
    flat[0] = flat[0] + 1e-3  # one value of one state array
    leaf.cache[-1] = flat.reshape(a.shape)


def _perturb_first_kv(cache):
    """One key value of token 0 in every KV leaf (a sliding layer no longer sees token 0 at the
    end of the probe: only a full-attention layer's change is visible)."""
    for leaf in blocks.leaves(cache):
        if getattr(leaf, "keys", None) is not None:
            leaf.keys[0, 0, 0, 0] = leaf.keys[0, 0, 0, 0] + 1e-3


@pytest.mark.parametrize("family,hook", [("qwen3_next", _perturb_first_state), ("falcon_h1", _perturb_first_state),
                                         ("gpt_oss", _perturb_first_kv)])
def test_broken_restore_fails_the_selfcheck_and_the_model_is_refused(family, hook, tmp_path, caplog):
    """A restore that changes one value: the self-check measures it, the model runs uncached with
    that reason (stored, so a later start refuses it without probing), output stays mlx-lm's."""
    import logging

    blocks.restore_hook = hook
    with caplog.at_level(logging.WARNING, logger="kvtool"):
        eng = engine(family, tmp_path)
    reason = eng.uncached_reason
    assert reason is not None and reason.startswith("self-check failed: "), reason
    assert "differ" in reason or "raised" in reason
    if family == "falcon_h1":  # (its block cuts already differ from mlx-lm's chunks: the cold request fails first)
        assert "cold prompt" in reason
    else:
        assert "cold prompt" not in reason  # the cold path is exact: the broken restore is what failed
    assert sum("running uncached" in r.getMessage() for r in caplog.records) == 1
    ids = model_zoo.zoo_prompt(120)
    res = eng.generate(ids, max_tokens=4)
    assert res.token_ids == reference(family, ids, 4) and res.cached_tokens == 0 and res.uncached_reason == reason
    ns = next(d for d in tmp_path.iterdir() if d.is_dir())
    eng.close()

    blocks.restore_hook = None
    selfcheck._memo.clear()
    runs = selfcheck.RUNS
    eng = engine(family, tmp_path)  # the stored verdict: refused again, no probe
    assert eng.uncached_reason == reason and selfcheck.RUNS == runs
    eng.close()

    from typer.testing import CliRunner

    from kvtool.cli import app as app_module

    if not any(c.name == "inspect" for c in app_module.app.registered_commands):
        app_module._register()
    app = app_module.app
    out = CliRunner().invoke(app, ["inspect", "--cache-dir", str(tmp_path), "--namespace", ns.name, "--json"])
    doc = json.loads(out.stdout)
    assert doc["namespaces"][0]["selfcheck"].startswith("fail: " + reason.removeprefix("self-check failed: "))
    text = CliRunner().invoke(app, ["inspect", "--cache-dir", str(tmp_path), "--namespace", ns.name]).stdout
    assert "self-check  fail:" in text


def test_verdict_measured_again_when_the_code_changes(tmp_path, monkeypatch):
    eng = engine("cohere2", tmp_path)
    eng.close()
    runs = selfcheck.RUNS
    monkeypatch.setattr(selfcheck, "code_digest", lambda model: "0" * 16)
    selfcheck._memo.clear()
    eng = engine("cohere2", tmp_path)
    assert selfcheck.RUNS == runs + 1 and selfcheck.stored_verdict(eng.cache.ssd).code == "0" * 16
    eng.close()


def test_plain_kv_models_need_no_selfcheck(tmp_path):
    runs = selfcheck.RUNS
    eng = engine("llama", tmp_path)
    assert eng.uncached_reason is None and selfcheck.RUNS == runs
    assert selfcheck.stored_verdict(eng.cache.ssd) is None
    eng.close()


def test_without_ssd_the_verdict_is_kept_for_the_process(tmp_path):
    cfg = KVToolConfig(ssd_enabled=False, block_size=BS)
    runs = selfcheck.RUNS
    eng = Engine(loaded("jamba"), cfg)
    assert eng.uncached_reason is None and selfcheck.RUNS == runs + 1
    ids = model_zoo.zoo_prompt(100)
    eng.generate(ids, max_tokens=3)
    res = eng.generate(ids, max_tokens=3)
    assert res.ram_hit_tokens == len(ids) - 1 and res.token_ids == reference("jamba", ids, 3)
    eng.close()
    Engine(loaded("jamba"), cfg).close()
    assert selfcheck.RUNS == runs + 1  # same process, same namespace: measured once


def test_verdict_json_round_trip_and_malformed():
    v = selfcheck.Verdict(False, 112, 32, reason="x differs", code="ab" * 8, ms=12.5, checked=1.0)
    assert selfcheck.Verdict.from_json(v.to_json()) == v
    for bad in ("", "{", "[]", '{"passed": "yes", "reason": null, "code": "x"}', json.dumps({"passed": True})):
        assert selfcheck.Verdict.from_json(bad) is None


def test_max_kv_size_is_refused_with_mlx_lm_s_chunk_dependence(tmp_path):
    """mlx-lm's RotatingKVCache with keep > 0 (--max-kv-size, models without make_cache): its own
    output depends on the prefill chunking (measured here), so no block of it is reusable."""
    lm = loaded("qwen2")
    ids = model_zoo.zoo_prompt(100)
    lps = [next(generate_step(mx.array(ids), lm.model, max_tokens=1, max_kv_size=32, prefill_step_size=s))[1]
           for s in (2048, 40)]
    assert not mx.array_equal(lps[0], lps[1])
    eng = engine("qwen2", tmp_path, max_kv_size=32)
    assert "keep=4" in eng.uncached_reason and "prefill_step_size" in eng.uncached_reason
    res = eng.generate(ids, max_tokens=4)
    ref = [int(t) for t, _ in generate_step(mx.array(ids), lm.model, max_tokens=4, max_kv_size=32)]
    assert res.token_ids == [t for t in ref if t not in lm.tokenizer.eos_token_ids][: len(res.token_ids)]
    eng.close()


@pytest.mark.parametrize("family", ["gpt_oss", "gemma4_text", "recurrent_gemma", "falcon_h1"])
def test_a_hit_handed_to_mlx_lm_as_is_is_bit_exact(family, tmp_path):
    """`PrefixCache.fetch` (the default, what `kvtool serve` and the Python API use) returns
    mlx-lm's own RotatingKVCache state for sliding leaves, so mlx-lm's generate_step continues
    from it with the log-probabilities of a run without the cache, bit for bit (full views used
    as-is differ in the last bits: the self-check's "used as-is" request measures this)."""
    from mlx_lm.models.cache import RotatingKVCache

    ids = model_zoo.zoo_prompt(150)
    eng = engine(family, tmp_path)
    eng.generate(ids[:100], max_tokens=2)
    lm = loaded(family)
    hit = eng.cache.fetch(ids)
    try:
        if eng.uncached_reason is not None:  # refused (falcon_h1: measured): nothing to hand over
            assert hit.cached_tokens == 0 and not hit.cache
            return
        assert hit.cached_tokens >= 64
        if eng.cache.windows:
            assert any(isinstance(c, RotatingKVCache) for c in blocks.leaves(hit.cache))
        got = [lp for _, lp in generate_step(mx.array(hit.remaining), lm.model, max_tokens=4, prompt_cache=hit.cache)]
    finally:
        eng.cache.release(hit)
    ref = [lp for _, lp in generate_step(mx.array(ids), lm.model, max_tokens=4)]
    assert all(mx.array_equal(a, b).item() for a, b in zip(ref, got)) and len(got) == len(ref)
    eng.close()


@pytest.mark.parametrize("family", ["gemma3_text", "deepseek_v32"])
def test_a_prompts_last_token_is_stored_as_a_prefill_computes_it(family, tmp_path, monkeypatch):
    """mlx-lm's decode forwards a prompt's last token again (alone; through rotating sliding
    layers), which can round its KV differently from a prefill chunk: the block or tail entry
    ending there must hold the prefilled KV (`kvtool.kv.prefill.last_token_kv`), or a longer prompt
    using it is no longer bit-identical. Without it the self-check fails; with it a longer prompt
    after a 100-token and after a 64-token prompt is bit-identical (logits, cache arrays)."""
    from kvtool.kv import prefill
    from tests import zoo_matrix

    lm = loaded(family)
    assert zoo_matrix.bitwise(lm, tmp_path / "with") is None
    selfcheck._memo.clear()
    monkeypatch.setattr(prefill, "last_token_kv", lambda *a, **k: [])
    eng = engine(family, tmp_path / "without")
    reason = eng.uncached_reason or ""
    assert reason.startswith("self-check failed: ") and ("extended" in reason or "as-is" in reason), reason
    eng.close()


@pytest.mark.parametrize("family,alone", [("llama", True), ("deepseek_v3", False)])
def test_a_cache_from_mlx_lm_s_own_decode_is_stored_only_where_exact(family, alone, tmp_path):
    """The Python API / server path: mlx-lm decodes (re-forwarding the prompt's last token alone)
    and hands the cache to `store`. Where a token alone gets other KV than in a prefill chunk
    (deepseek_v3's MLA, measured at attach: `alone_exact`), the entry holding that last token is
    not stored, so a longer prompt stays bit-identical; elsewhere it is (tail entries, chat)."""
    from mlx_lm.models.cache import make_prompt_cache

    from kvtool.cache.prefix import PrefixCache

    lm = loaded(family)
    cfg = KVToolConfig(ssd_cache_dir=tmp_path, block_size=BS, ssd_async_writes=False)
    ids = model_zoo.zoo_prompt(150)
    with PrefixCache.for_model(lm.model, cfg, model_id=lm.model_id, model_name=family) as pc:
        assert pc.alone_exact is alone
        first = ids[:100]
        hit = pc.fetch(first)
        cache = hit.cache or make_prompt_cache(lm.model)
        list(generate_step(mx.array(hit.remaining), lm.model, max_tokens=2, prompt_cache=cache))
        stored = pc.store(first, cache, hit)
        pc.release(hit)
        assert stored == (4 if alone else 3)  # 3 blocks + the tail entry holding token 99
        hit = pc.fetch(ids)
        assert hit.cached_tokens == (100 if alone else 96)
        got = [lp for _, lp in generate_step(mx.array(hit.remaining), lm.model, max_tokens=3, prompt_cache=hit.cache)]
        pc.release(hit)
    ref = [lp for _, lp in generate_step(mx.array(ids), lm.model, max_tokens=3)]
    assert all(mx.array_equal(a, b).item() for a, b in zip(ref, got))


def test_the_code_digest_covers_every_module_of_the_cache_path():
    """Every module the digest names exists (after the layered layout moved them, stale names made
    it skip most of the cache path: an edit of `kv/blocks.py` did not re-measure the verdict)."""
    root = Path(selfcheck.__file__).resolve().parent.parent
    missing = [m for m in selfcheck.CODE_MODULES if not (root / f"{m}.py").is_file()]
    assert not missing, missing
    assert {"kv/blocks", "kv/prefill", "cache/prefix", "disk/segment"} <= set(selfcheck.CODE_MODULES)
