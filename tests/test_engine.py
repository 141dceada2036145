"""The engine's output equals mlx-lm's own greedy generation in every cache path.

Paths: cold, RAM hit in one process, SSD hit after restart (new engine = empty RAM tier), full
hit, a prompt diverging mid-block; plus bit-identical last-position logits with a cached prefix
(float32 and bfloat16), context sensitivity of the embedded model, and the uncached fallback for
models whose cache is not plain KVCache.
"""

from __future__ import annotations

import copy
import logging
import sqlite3

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache

from kvtool.config import KVToolConfig
from kvtool.engine import Engine
from kvtool.kv.blocks import Block, chain_hashes, rebuild_cache
from kvtool.models.loader import load_model

BS = 64  # small blocks keep the tiny-model tests fast
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny")


@pytest.fixture(scope="module")
def prompt_ids(tiny):
    text = open("kvtool/assets/demo_prompt.txt", encoding="utf-8").read()
    ids = tiny.tokenizer.encode(text)
    assert len(ids) >= 5 * BS + 10
    return ids[: 5 * BS + 10]


def reference_tokens(model, tokenizer, ids, max_tokens=MAX_TOKENS):
    """mlx-lm's greedy generation on a fresh cache, stopped at EOS (EOS excluded)."""
    out = []
    for tok, _ in generate_step(mx.array(ids), model, max_tokens=max_tokens):
        if tok in tokenizer.eos_token_ids:
            break
        out.append(int(tok))
    return out


def make_engine(loaded, tmp_path, **overrides):
    cfg = KVToolConfig(ssd_cache_dir=tmp_path / "kv", block_size=BS, ssd_async_writes=False, **overrides)
    return Engine(loaded, cfg)


def test_cold_ram_ssd_and_full_hit_equal_mlx_lm(tiny, prompt_ids, tmp_path):
    ref = reference_tokens(tiny.model, tiny.tokenizer, prompt_ids)
    n_full = len(prompt_ids) // BS * BS

    eng = make_engine(tiny, tmp_path)
    cold = eng.generate(prompt_ids, max_tokens=MAX_TOKENS)
    assert cold.token_ids == ref
    assert cold.cached_tokens == 0 and cold.prefill_tokens == len(prompt_ids)
    assert cold.blocks_written == len(prompt_ids) // BS + 1  # full blocks + the tail entry

    ram = eng.generate(prompt_ids, max_tokens=MAX_TOKENS)  # exact replay: a full hit thanks to the tail
    assert ram.token_ids == ref
    assert ram.ram_hit_tokens == len(prompt_ids) - 1 and ram.ssd_hit_tokens == 0
    assert ram.prefill_tokens == 1
    assert eng.close().shutdown_clean

    eng2 = make_engine(tiny, tmp_path)  # a restart: empty RAM tier, same SSD tier
    ssd = eng2.generate(prompt_ids, max_tokens=MAX_TOKENS)
    assert ssd.token_ids == ref
    assert ssd.ssd_hit_tokens == len(prompt_ids) - 1 and ssd.ram_hit_tokens == 0
    assert ssd.prompt_tokens == ssd.cached_tokens + ssd.prefill_tokens
    # a changed last token misses the tail entry, but the stored tail (a sibling under the same
    # parent, kvtool.tiers.siblings) still serves every token before the change
    changed = list(prompt_ids[:-1]) + [prompt_ids[-1] + 1]
    res = eng2.generate(changed, max_tokens=MAX_TOKENS)
    assert res.cached_tokens == len(prompt_ids) - 1 > n_full
    assert res.token_ids == reference_tokens(tiny.model, tiny.tokenizer, changed)
    eng2.close()

    # full hit: a prompt that is exactly its full blocks
    full_ids = prompt_ids[:n_full]
    eng3 = make_engine(tiny, tmp_path)
    full = eng3.generate(full_ids, max_tokens=MAX_TOKENS)
    assert full.token_ids == reference_tokens(tiny.model, tiny.tokenizer, full_ids)
    assert full.cached_tokens == n_full - 1 and full.prefill_tokens == 1
    again = eng3.generate(full_ids, max_tokens=MAX_TOKENS)  # full hit from RAM this time
    assert again.token_ids == full.token_ids and again.ram_hit_tokens == n_full - 1
    eng3.close()


def test_hit_from_ram_then_ssd_equals_mlx_lm(tiny, prompt_ids, tmp_path):
    """After a restart, a prompt's first half served from SSD enters RAM (views of that request's
    cache: one run); the whole prompt then hits RAM for that half, copied into the restore buffers
    one run at a time, and SSD for the rest: the output equals mlx-lm's."""
    eng = make_engine(tiny, tmp_path)
    eng.generate(prompt_ids, max_tokens=MAX_TOKENS)
    eng.close()
    eng2 = make_engine(tiny, tmp_path)
    half = prompt_ids[: len(prompt_ids) // BS // 2 * BS + 3]
    first = eng2.generate(half, max_tokens=MAX_TOKENS)
    assert first.ssd_hit_tokens >= 2 * BS and first.ram_hit_tokens == 0
    res = eng2.generate(prompt_ids, max_tokens=MAX_TOKENS)
    assert res.ram_hit_tokens >= 2 * BS and res.ssd_hit_tokens >= BS
    assert res.token_ids == reference_tokens(tiny.model, tiny.tokenizer, prompt_ids)
    eng2.close()


def test_prompt_diverging_mid_block_reuses_every_shared_token(tiny, prompt_ids, tmp_path):
    """Full blocks before the divergence, then the stored block 2's first half (a sibling)."""
    eng = make_engine(tiny, tmp_path)
    eng.generate(prompt_ids, max_tokens=2)
    diverged = list(prompt_ids[: 2 * BS + BS // 2]) + [t + 1 for t in prompt_ids[2 * BS + BS // 2 : 4 * BS]]
    res = eng.generate(diverged, max_tokens=MAX_TOKENS)
    assert res.cached_tokens == 2 * BS + BS // 2
    assert res.token_ids == reference_tokens(tiny.model, tiny.tokenizer, diverged)
    eng.close()


def _last_logits(model, ids, cache):
    logits = model(mx.array(ids)[None], cache=cache)[:, -1, :]
    mx.eval(logits)
    return logits


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_logits_with_cached_prefix_are_bit_identical(dtype, prompt_ids, tmp_path):
    loaded = load_model("tiny")
    if dtype != mx.float32:
        loaded.model.set_dtype(dtype)
    uncached = _last_logits(loaded.model, prompt_ids, make_prompt_cache(loaded.model))

    eng = make_engine(loaded, tmp_path)
    eng.generate(prompt_ids, max_tokens=1)  # writes blocks to SSD (sync writer)
    eng.close()
    eng = make_engine(loaded, tmp_path)  # fresh RAM: blocks come from segment files
    hit = eng.cache.fetch(prompt_ids)
    assert hit.ssd_tokens == len(prompt_ids) - 1 and hit.cache[0].keys.dtype == dtype
    cached = _last_logits(loaded.model, hit.remaining.tolist(), hit.cache)
    assert cached.dtype == uncached.dtype
    assert mx.array_equal(cached, uncached).item()
    eng.cache.release(hit)
    eng.close()


def test_embedded_model_is_context_sensitive_per_block(tiny, prompt_ids, tmp_path):
    """Zeroing the KV of any one cached block changes the generated tokens, so exactness tests
    would catch wrong KV."""
    eng = make_engine(tiny, tmp_path)
    ids = prompt_ids[: 4 * BS + 5]
    ref = eng.generate(ids, max_tokens=MAX_TOKENS).token_ids
    assert len(set(ref)) >= 4
    blocks = [eng.tiered.ram.get(h) for h in chain_hashes(ids, BS, eng.layout_key)]
    for i in range(len(blocks)):
        damaged = [copy.copy(b) for b in blocks]
        damaged[i] = Block(blocks[i].block_hash, blocks[i].parent_hash, blocks[i].token_ids,
                           [mx.zeros_like(k) for k in blocks[i].keys], [mx.zeros_like(v) for v in blocks[i].values])
        cache = rebuild_cache(damaged, len(blocks[0].keys))
        model_out = eng.model(mx.array(ids[4 * BS : -1])[None], cache=cache)
        mx.eval(model_out)
        toks = [int(t) for t, _ in generate_step(mx.array(ids[-1:]), tiny.model, max_tokens=MAX_TOKENS, prompt_cache=cache)]
        assert toks[: len(ref)] != ref, f"zeroing block {i} did not change the output"
    eng.close()


def test_non_kvcache_model_runs_uncached_with_one_warning(prompt_ids, tmp_path, caplog):
    loaded = load_model("tiny")
    n_layers = len(loaded.model.layers)
    loaded.model.make_cache = lambda: [RotatingKVCache(max_size=4096, keep=4) for _ in range(n_layers)]
    ids = prompt_ids[: 3 * BS]
    ref = reference_tokens(loaded.model, loaded.tokenizer, ids)
    with caplog.at_level(logging.WARNING, logger="kvtool"):
        eng = make_engine(loaded, tmp_path)
    warnings = [r for r in caplog.records if "uncached" in r.getMessage()]
    assert len(warnings) == 1 and "RotatingKVCache" in warnings[0].getMessage()
    for _ in range(2):
        res = eng.generate(ids, max_tokens=MAX_TOKENS)
        assert res.token_ids == ref and res.cached_tokens == 0 and res.blocks_written == 0
    eng.close()
    assert not (tmp_path / "kv").exists() or not any((tmp_path / "kv").rglob("*.safetensors"))


def test_chat_messages_have_no_doubled_bos_and_stop_strings_cut(tiny, tmp_path):
    eng = make_engine(tiny, tmp_path)
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
    ids = eng.encode(messages=msgs)
    text = tiny.tokenizer.decode(ids)
    assert text.count("<|im_start|>") == 3  # system, user, and the generation prompt
    bos = getattr(tiny.tokenizer, "bos_token_id", None)
    assert bos is None or ids[:2] != [bos, bos]
    res = eng.generate(ids, max_tokens=20)
    if len(res.text) > 3:
        stop = res.text[2:4]
        cut = eng.generate(ids, max_tokens=20, stop=[stop])
        assert cut.finish_reason == "stop" and stop not in cut.text and res.text.startswith(cut.text)
    eng.close()


def test_sampling_with_seed_is_reproducible_and_cache_independent(tiny, prompt_ids, tmp_path):
    eng = make_engine(tiny, tmp_path)
    a = eng.generate(prompt_ids, max_tokens=8, temp=0.8, top_p=0.9, seed=7)
    b = eng.generate(prompt_ids, max_tokens=8, temp=0.8, top_p=0.9, seed=7)  # RAM hit
    assert b.cached_tokens > 0 and a.token_ids == b.token_ids
    eng.close()


@pytest.mark.slow
def test_forgotten_close_still_drains_and_exits(tmp_path):
    """The writer thread is non-daemon; a program that never calls close() must still exit, with
    every accepted block written (drained by the interpreter-exit hook)."""
    import subprocess
    import sys

    code = (
        "from kvtool.config import KVToolConfig\n"
        "from kvtool.engine import Engine\n"
        f"eng = Engine.from_spec('tiny', KVToolConfig(ssd_cache_dir={str(tmp_path)!r}, block_size={BS}))\n"
        "r = eng.generate(eng.encode(prompt=open('kvtool/assets/demo_prompt.txt').read()), max_tokens=2)\n"
        "print(r.blocks_written)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    (db,) = tmp_path.glob("*/index.sqlite")
    rows = sqlite3.connect(db).execute("SELECT COUNT(*) FROM blocks").fetchone()[0]
    assert int(out.stdout.strip()) == rows > 0


def _damage_record(eng, block_hash: str) -> None:
    """Flip one byte in the middle of a block's record inside its segment file."""
    row = eng.cache.ssd.index.get(block_hash)
    path = eng.cache.ssd.namespace_dir / row.segment[:2] / f"{row.segment}.safetensors"
    import os

    from kvtool.disk import segment as seg

    fd = os.open(path, os.O_RDWR)
    try:
        slot = seg.read_header(fd, os.fstat(fd).st_size).slots[row.slot]
        at = slot.offset + slot.nbytes // 2
        byte = os.pread(fd, 1, at)
        os.pwrite(fd, bytes([byte[0] ^ 0x40]), at)
    finally:
        os.close(fd)


def test_corrupt_block_mid_chain_cuts_there_and_output_stays_exact(tiny, prompt_ids, tmp_path):
    ref = reference_tokens(tiny.model, tiny.tokenizer, prompt_ids)
    eng = make_engine(tiny, tmp_path)
    eng.generate(prompt_ids, max_tokens=1)
    hashes = chain_hashes(np.asarray(prompt_ids, dtype=np.int32), BS, eng.layout_key)
    eng.close()
    eng = make_engine(tiny, tmp_path)
    _damage_record(eng, hashes[2])
    res = eng.generate(prompt_ids, max_tokens=MAX_TOKENS)
    assert res.ssd_hit_tokens == 2 * BS and res.token_ids == ref
    assert eng.stats()["ssd_load_corrupt"] >= 1
    again = eng.generate(prompt_ids, max_tokens=MAX_TOKENS)  # the recomputed blocks were stored again
    assert again.token_ids == ref and again.cached_tokens == len(prompt_ids) - 1
    eng.close()


def test_stream_yields_the_generate_tokens(tiny, prompt_ids, tmp_path):
    eng = make_engine(tiny, tmp_path)
    steps = list(eng.stream(prompt_ids, max_tokens=MAX_TOKENS))
    assert steps[-1].finish_reason in ("length", "stop")
    tokens = [s.token for s in steps[:-1]]
    assert tokens == steps[-1].result.token_ids == reference_tokens(tiny.model, tiny.tokenizer, prompt_ids)
    assert "".join(s.text for s in steps) == steps[-1].result.text
    eng.close()
