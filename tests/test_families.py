"""Every model family of the test zoo: kvtool's output equals mlx-lm's own greedy output.

For each family (tests/model_zoo.py): cold, RAM hit and SSD hit after a restart (a new Engine on
the same cache directory) give the tokens of `mlx_lm.generate.generate_step` on a fresh
`make_prompt_cache(model)`; or the model is refused cleanly: one warning, `uncached_reason`
set, nothing written, no SSD write failure. A cached family must really use its SSD tier after a
restart (`ssd_load_hits > 0`, `ssd_save_fail == 0`): never a silent loss of the SSD tier.
Plus: quantized KV (`kv_bits`) against mlx-lm's generate_step with the same settings, and refused
up front where mlx-lm's own code cannot run it (sliding windows, gemma2); sliding-
window layers (RotatingKVCache) in every regime (prompt shorter/longer than the window, hits
before/after a wrap, one-token last chunks, decode past a wrap); state layers (ArraysCache:
hybrid lfm2, SSM mamba) with per-block state checkpoints; the writer's pending buffer; bf16.
Quantized weights (the `tiny-4bit` / `tiny-8bit` presets, packed as `mlx_lm.convert -q` writes
them) run the same cold / RAM / SSD matrix.
"""

from __future__ import annotations

import logging

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step

from kvtool.config import KVToolConfig
from kvtool.engine import Engine
from kvtool.models import embedded
from kvtool.models.loader import load_model
from tests import model_zoo

BS = 64
MAX_TOKENS = 8
PROMPT_TOKENS = 250

# family -> expected: "cached" (every layer stored block-wise) or "refused" (uncached, one warning)
# (refusals: REFUSED below; every zoo family is cached now)
EXPECTED = {
    "llama": "cached",
    "qwen3": "cached",
    "phi3": "cached",
    "deepseek_v2": "cached",
    "openelm": "cached",
    "gemma3_text": "cached",
    "mistral_swa": "cached",
    "lfm2": "cached",
    "mamba": "cached",
    "tiny-4bit": "cached",  # quantized weights, as mlx_lm.convert -q writes them (embedded presets)
    "tiny-8bit": "cached",
}
QUANTIZED_PRESETS = ("tiny-4bit", "tiny-8bit")
SLOW = {"gemma3_text", "deepseek_v2", "lfm2", "mamba", "mistral_swa", "openelm", "phi3"}


@pytest.fixture(scope="session")
def zoo():
    """family -> model directory (the zoo's cache, built on first use)."""
    dirs = {f: model_zoo.family_dir(f) for f in [*EXPECTED, "gemma2", "qwen3_5"] if f not in QUANTIZED_PRESETS}
    return {**dirs, **{p: embedded.model_dir(p) for p in QUANTIZED_PRESETS}}


_loaded: dict[str, object] = {}


def loaded_family(zoo, family):
    if family not in _loaded:
        _loaded[family] = load_model(str(zoo[family]))
    return _loaded[family]


def prompt_for(loaded, n=PROMPT_TOKENS):
    text = open("kvtool/assets/demo_prompt.txt", encoding="utf-8").read()
    ids = loaded.tokenizer.encode(text)
    assert len(ids) >= n
    return [int(t) for t in ids[:n]]


def reference_tokens(model, tokenizer, ids, max_tokens=MAX_TOKENS, **kwargs):
    """mlx-lm's greedy generation on a fresh `make_prompt_cache(model)`, EOS excluded."""
    out = []
    for tok, _ in generate_step(mx.array(ids), model, max_tokens=max_tokens, **kwargs):
        if tok in tokenizer.eos_token_ids:
            break
        out.append(int(tok))
    return out


def make_engine(loaded, tmp_path, **kwargs):
    cfg = KVToolConfig(ssd_cache_dir=tmp_path / "kv", block_size=BS, ssd_async_writes=False)
    return Engine(loaded, cfg, **kwargs)


# (case id, family, engine kwargs): cases kvtool refuses to cache; output must still be mlx-lm's
REFUSED = [
    ("lfm2+kv_bits", "lfm2", {"kv_bits": 8, "kv_group_size": 32}),  # state layers + quantized
]


def _params():
    out = [pytest.param(f, f, {}, marks=pytest.mark.slow) if f in SLOW else pytest.param(f, f, {}, id=f)
           for f in EXPECTED]
    return out + [pytest.param(case, f, kw, id=case) for case, f, kw in REFUSED]


@pytest.mark.parametrize("case,family,kwargs", _params())
def test_family_cold_ram_ssd_equal_mlx_lm(zoo, case, family, kwargs, tmp_path, caplog):
    loaded = loaded_family(zoo, family)
    ids = prompt_for(loaded)
    q = {k: v for k, v in kwargs.items() if k.startswith("kv_")}
    ref = reference_tokens(loaded.model, loaded.tokenizer, ids, **q)
    assert len(ref) == MAX_TOKENS
    expected = EXPECTED[family] if not kwargs else "refused"

    with caplog.at_level(logging.WARNING, logger="kvtool"):
        eng = make_engine(loaded, tmp_path, **kwargs)
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("kvtool")]
    cold = eng.generate(ids, max_tokens=MAX_TOKENS)
    assert cold.token_ids == ref, "cold"
    ram = eng.generate(ids, max_tokens=MAX_TOKENS)
    assert ram.token_ids == ref, "RAM hit"
    stats1 = dict(eng.stats())
    assert eng.close().shutdown_clean

    if expected == "refused":
        assert eng.uncached_reason, "a refused model names its reason"
        assert len(warnings) == 1 and eng.uncached_reason in warnings[0].getMessage()
        assert eng.layout_key is None and cold.blocks_written == 0 and ram.cached_tokens == 0
        assert not (tmp_path / "kv").exists() or not any((tmp_path / "kv").iterdir())
        return

    assert eng.uncached_reason is None and not warnings
    assert cold.cached_tokens == 0 and cold.blocks_written == len(ids) // BS + 1
    assert ram.ram_hit_tokens == len(ids) - 1
    assert stats1.get("ssd_save_fail", 0) == 0 and stats1.get("writer_save_fail", 0) == 0
    assert stats1.get("ssd_save_success", 0) >= cold.blocks_written

    eng2 = make_engine(loaded, tmp_path, **kwargs)  # restart: empty RAM tier, same SSD tier
    ssd = eng2.generate(ids, max_tokens=MAX_TOKENS)
    assert ssd.token_ids == ref, "SSD hit after restart"
    assert ssd.ssd_hit_tokens == len(ids) - 1
    # a prompt diverging mid-block: the full blocks before it and the shared half of the stored
    # block 2 (a sibling; with state layers block boundaries only) are reused, the rest is prefilled
    div = ids[: 2 * BS + BS // 2] + [t + 1 for t in ids[2 * BS + BS // 2 :]]
    res = eng2.generate(div, max_tokens=MAX_TOKENS)
    assert res.cached_tokens == 2 * BS + (0 if eng2.cache.has_states else BS // 2)
    assert res.token_ids == reference_tokens(loaded.model, loaded.tokenizer, div)
    stats2 = dict(eng2.stats())
    assert eng2.close().shutdown_clean
    assert stats2["ssd_load_hits"] > 0 and stats2.get("ssd_save_fail", 0) == 0


# --------------------------------------------------------------------------- quantized KV
# (family, kv_bits, kv_group_size, quantized_kv_start, prefill_step_size)
QUANT_CASES = [
    pytest.param("llama", 8, 32, 0, 64, id="llama-8bit-switch64"),
    pytest.param("openelm", 4, 32, 100, 64, id="openelm-4bit-switch128", marks=pytest.mark.slow),
    pytest.param("deepseek_v2", 8, 32, 0, 2048, id="mla-8bit-switch-at-prompt-end", marks=pytest.mark.slow),
    pytest.param("qwen3", 8, 32, 5000, 2048, id="qwen3-8bit-mlx-defaults"),
]


def make_quant_engine(loaded, tmp_path, bits, group, start, step):
    return make_engine(loaded, tmp_path, kv_bits=bits, kv_group_size=group, quantized_kv_start=start,
                       prefill_step_size=step)


@pytest.mark.parametrize("family,bits,group,start,step", QUANT_CASES)
def test_kv_bits_equal_mlx_lm_generate_step(zoo, family, bits, group, start, step, tmp_path):
    """Cold, RAM hit, SSD hit after restart and a prompt sharing a prefix: mlx-lm's tokens with the
    same kv_bits / kv_group_size / quantized_kv_start / prefill_step_size; hits only where exact."""
    loaded = loaded_family(zoo, family)
    q = dict(kv_bits=bits, kv_group_size=group, quantized_kv_start=start, prefill_step_size=step)
    ids = prompt_for(loaded)
    shorter = ids[:200]
    ref = reference_tokens(loaded.model, loaded.tokenizer, ids, **q)
    ref_short = reference_tokens(loaded.model, loaded.tokenizer, shorter, **q)
    if start < len(ids):  # the quantized path is really taken: mlx-lm's logprobs differ from plain KV
        lp_q = next(generate_step(mx.array(ids), loaded.model, max_tokens=1, **q))[1]
        lp = next(generate_step(mx.array(ids), loaded.model, max_tokens=1, prefill_step_size=step))[1]
        assert not mx.array_equal(lp_q, lp)

    eng = make_quant_engine(loaded, tmp_path, bits, group, start, step)
    assert eng.uncached_reason is None and eng.cache.kv.bits == bits
    quant = eng.quant
    cold = eng.generate(ids, max_tokens=MAX_TOKENS)
    ram = eng.generate(ids, max_tokens=MAX_TOKENS)
    assert cold.token_ids == ref and ram.token_ids == ref
    replay_ok = quant.usable(len(ids) - 1, len(ids))
    assert ram.cached_tokens == (len(ids) - 1 if replay_ok else 0)
    stats = dict(eng.stats())
    assert eng.close().shutdown_clean
    assert stats.get("ssd_save_fail", 0) == 0 and cold.blocks_written > 0

    eng2 = make_quant_engine(loaded, tmp_path, bits, group, start, step)
    assert eng2.layout_key == eng.layout_key
    ssd = eng2.generate(ids, max_tokens=MAX_TOKENS)
    assert ssd.token_ids == ref and ssd.ssd_hit_tokens == ram.cached_tokens
    short = eng2.generate(shorter, max_tokens=MAX_TOKENS)  # its full blocks are cached
    assert short.token_ids == ref_short
    n_blocks = len(shorter) // BS * BS
    # a sibling (ids' block 3) serves up to all but the last token, where mlx-lm's cache would be
    # quantized alike: whole, or cut at the switch point; else the full blocks where usable
    n = len(shorter)
    partial = [c for c in (n - 1, quant.switch_point(n)) if n_blocks < c < n and quant.usable(c, n)]
    assert short.cached_tokens == (partial[0] if partial else n_blocks if quant.usable(n_blocks, n) else 0)
    stats2 = dict(eng2.stats())
    assert eng2.close().shutdown_clean
    assert stats2.get("ssd_save_fail", 0) == 0
    if replay_ok:
        assert stats2["ssd_load_hits"] > 0


@pytest.mark.parametrize("family,needle", [("gemma3_text", "RotatingKVCache Quantization NYI"),
                                           ("gemma2", "TypeError")])
def test_kv_bits_refused_up_front_where_mlx_lm_cannot_run_it(zoo, family, needle, tmp_path):
    """mlx-lm's own error, named before anything runs, instead of a crash once a prompt reaches
    quantized_kv_start (mlx-lm's generate_step raises it there too)."""
    from kvtool.engine import KVBitsUnsupported

    loaded = loaded_family(zoo, family)
    with pytest.raises(KVBitsUnsupported, match="with a quantized KV cache") as err:
        make_engine(loaded, tmp_path, kv_bits=8, kv_group_size=32)
    assert needle in str(err.value) and err.value.exit_code == 2
    with pytest.raises(Exception) as mlx_err:  # mlx-lm itself, once a prompt reaches quantized_kv_start
        reference_tokens(loaded.model, loaded.tokenizer, prompt_for(loaded, 40), max_tokens=2, kv_bits=8,
                         kv_group_size=32, quantized_kv_start=8)
    assert f"{type(mlx_err.value).__name__}: {mlx_err.value}" in str(err.value)
    assert not (tmp_path / "kv").exists()


def test_kv_bits_miss_names_its_reason_per_request(zoo, tmp_path):
    """A prompt whose shared prefix ends before mlx-lm's quantization start misses, and says why
    in its own `uncached_reason` (the model is cached: its engine-level reason is None)."""
    loaded = loaded_family(zoo, "llama")
    q = dict(kv_bits=8, kv_group_size=32, quantized_kv_start=150, prefill_step_size=64)
    ids = prompt_for(loaded)
    eng = make_engine(loaded, tmp_path, **q)
    assert eng.uncached_reason is None
    first = eng.generate(ids, max_tokens=2)  # 250 tokens: quantized at token 192, blocks 0..2 stored
    assert first.uncached_reason is None and first.blocks_written > 0
    other = ids[:128] + [t + 1 for t in ids[128:180]]  # 180 tokens: mlx-lm's cache is plain up to 179
    res = eng.generate(other, max_tokens=4)
    assert res.cached_tokens == 0 and res.token_ids == reference_tokens(
        loaded.model, loaded.tokenizer, other, max_tokens=4, **q)
    assert res.uncached_reason and "before mlx-lm's quantization start" in res.uncached_reason
    assert "RequestResult" not in res.uncached_reason and res.to_dict()["uncached_reason"] == res.uncached_reason
    eng.close()


def test_kv_bits_namespace_differs_by_bits_group_and_switch(zoo, tmp_path):
    loaded = loaded_family(zoo, "llama")
    keys = set()
    for kw in ({}, {"kv_bits": 8, "kv_group_size": 32}, {"kv_bits": 4, "kv_group_size": 32},
               {"kv_bits": 8, "kv_group_size": 16}, {"kv_bits": 8, "kv_group_size": 32, "quantized_kv_start": 0}):
        eng = make_engine(loaded, tmp_path, **kw)
        keys.add(eng.layout_key)
        eng.close()
    assert len(keys) == 5


def test_kv_bits_unquantisable_head_dim_is_refused_once(zoo, tmp_path, caplog):
    loaded = loaded_family(zoo, "llama")  # head dim 32: group 64 does not divide it
    with caplog.at_level(logging.WARNING, logger="kvtool"):
        eng = make_engine(loaded, tmp_path, kv_bits=8, kv_group_size=64)
    assert eng.uncached_reason and "group_size=64" in eng.uncached_reason
    assert len([r for r in caplog.records if r.name.startswith("kvtool")]) == 1
    ids = prompt_for(loaded, 100)
    assert eng.generate(ids, max_tokens=4).token_ids == reference_tokens(
        loaded.model, loaded.tokenizer, ids, max_tokens=4, kv_bits=8, kv_group_size=64)
    eng.close()


def test_quantized_layout_spec_bytes_and_segment_round_trip(tmp_path):

    from kvtool.disk import segment as seg
    from kvtool.disk.hostblock import HostBlock
    from kvtool.disk.segment import KVLayout

    plain = KVLayout(((2, 64, 64), (4, 192, 128)), "bfloat16")
    assert plain.spec == "2x64x64,4x192x128" and plain.tensors_per_layer == 2
    q = KVLayout(((2, 64, 64), (4, 192, 128)), "bfloat16", bits=4, group_size=64)
    assert q.spec == "q4g64:2x64x64,4x192x128" and KVLayout.parse(q.spec, "bfloat16") == q
    # per token: layer 0 keys 2 heads * (64*4/8 B packed + 2 * 1 group * 2 B), values alike; layer 1 ...
    assert q.token_nbytes() == 2 * (32 + 4) * 2 + 4 * ((96 + 12) + (64 + 8))
    with pytest.raises(ValueError):
        KVLayout(((2, 48, 48),), "float32", bits=8, group_size=64)
    with pytest.raises(ValueError):
        KVLayout.parse("q8:2x64x64", "float32")

    rng = np.random.default_rng(0)
    n = 5
    arrays = [rng.integers(0, 2**32, s, dtype=np.uint32) if st == np.dtype("<u4")
              else rng.integers(0, 2**16, s, dtype=np.uint16) for s, st in zip(q.shapes(n), q.storage_dtypes())]
    keys, values = q.split(arrays)
    block = HostBlock("a" * 32, "b" * 32, np.arange(n, dtype=np.int32), keys, values, "bfloat16")
    bufs, slots = seg.encode([block], "c" * 32, q, 1.0)
    path = tmp_path / "s.safetensors"
    path.write_bytes(b"".join(bytes(b) for b in bufs))
    fd = __import__("os").open(path, __import__("os").O_RDONLY)
    try:
        header = seg.read_header(fd, path.stat().st_size)
        assert header.kv == q and slots[0].nbytes == q.record_nbytes(n)
        back = seg.read_block(fd, header.slots[0], header.kv)
    finally:
        __import__("os").close(fd)
    assert all(np.array_equal(a, b) for a, b in zip(back.keys + back.values, keys + values))


# --------------------------------------------------------------------------- sliding windows
@pytest.mark.parametrize("family,step", [
    pytest.param("mistral_swa", 2048, id="mistral_swa-one-chunk"),
    pytest.param("mistral_swa", 40, id="mistral_swa-chunks-below-window"),
    pytest.param("gemma3_text", 64, id="gemma3-chunks", marks=pytest.mark.slow),
])
def test_sliding_window_regimes_equal_mlx_lm(zoo, family, step, tmp_path):
    """Window 96: prompts shorter and longer than the window, hits ending before and after the
    window wrapped, a hit leaving 2 tokens, full hits, decode running past a wrap; mlx-lm's own
    RotatingKVCache path (same prefill_step_size) is the reference."""
    loaded = loaded_family(zoo, family)
    ids = prompt_for(loaded)
    eng = make_engine(loaded, tmp_path, prefill_step_size=step)
    assert eng.uncached_reason is None and eng.cache.windows and None in eng.cache.windows

    def check(prompt, cached, max_tokens=MAX_TOKENS):
        res = eng.generate(prompt, max_tokens=max_tokens)
        ref = reference_tokens(loaded.model, loaded.tokenizer, prompt, max_tokens=max_tokens, prefill_step_size=step)
        assert res.token_ids == ref, (len(prompt), res.cached_tokens)
        assert cached is None or res.cached_tokens == cached, (len(prompt), res.cached_tokens)

    check(ids[:60], 0)                 # shorter than the window
    check(ids[:60], 59)                # its full hit: restored before any wrap
    check(ids[:90], 60, max_tokens=12)  # the 60-token prompt's tail entry (tail prefix); decode wraps
    check(ids, 90)                     # longer than the window (block 0 + the 90-token prompt's tail)
    check(ids[:64] + [t + 1 for t in ids[64:120]], 64)   # hit ends before the window is full
    check(ids[:130], 129)              # hit ends after a wrap (block 2's first token: a sibling)
    check(ids[:194], 193)              # 1 token left to prefill (a sibling's prefix)
    check(ids, len(ids) - 1)           # full hit
    check(ids[:42], None)              # mlx-lm's last chunk is one token when step is 40 or 41
    check(ids[:122], None)             # (written in place into a grown, partly empty buffer)
    assert eng.close().shutdown_clean

    eng = make_engine(loaded, tmp_path, prefill_step_size=step)  # restart: the same from SSD
    check(ids[:200], 199)              # 3 blocks + the first 7 tokens of ids' block 3 (a sibling)
    check(ids, len(ids) - 1)
    stats = dict(eng.stats())
    assert eng.close().shutdown_clean
    assert stats["ssd_load_hits"] > 0 and stats.get("ssd_save_fail", 0) == 0


def test_rotating_from_full_is_mlx_lm_state():
    """The rebuilt RotatingKVCache equals mlx-lm's after generate_step's chunked prefill (one-token
    chunks are written in place, others concatenated), slot by slot."""
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    from kvtool.kv.windows import rotating_from_full

    for w in (3, 8):
        for step in (1, 2, 5, 8, 13):
            for n in list(range(1, 24)) + [300]:
                full = KVCache()
                kv = mx.random.normal((1, 2, n, 4))
                full.update_and_fetch(kv, kv * 2)
                r = RotatingKVCache(max_size=w)
                pos = 0
                while pos < n:
                    end = min(pos + step, n)
                    r.update_and_fetch(kv[..., pos:end, :], kv[..., pos:end, :] * 2)
                    pos = end
                got = rotating_from_full(full, n, w, step)
                assert (got.offset, got._idx, got.keys.shape) == (r.offset, r._idx, r.keys.shape), (w, step, n)
                assert mx.array_equal(got.keys, r.keys) and mx.array_equal(got.values, r.values), (w, step, n)


# --------------------------------------------------------------------------- state layers
@pytest.mark.parametrize("family,step", [
    pytest.param("lfm2", 2048, id="lfm2-hybrid"),
    pytest.param("mamba", 2048, id="mamba-ssm"),
    pytest.param("lfm2", 40, id="lfm2-small-chunks", marks=pytest.mark.slow),
])
@pytest.mark.slow
def test_state_checkpoints_equal_mlx_lm(zoo, family, step, tmp_path):
    """State layers (ArraysCache): a hit at block k restores the state checkpoint of block k plus
    the attention layers' KV; exact replays (tail entry: the state before the last token), longer
    prompts ending in an earlier prompt's tail entry (tail prefix: one token less), a
    prompt ending on a block boundary (its last block cannot serve a full hit: one block less),
    warm then serve, RAM and SSD, against mlx-lm's own generate_step."""
    loaded = loaded_family(zoo, family)
    ids = prompt_for(loaded)
    eng = make_engine(loaded, tmp_path, prefill_step_size=step)
    assert eng.uncached_reason is None and eng.cache.has_states

    def check(prompt, cached):
        res = eng.generate(prompt, max_tokens=MAX_TOKENS)
        ref = reference_tokens(loaded.model, loaded.tokenizer, prompt, prefill_step_size=step)
        assert res.token_ids == ref, (len(prompt), res.cached_tokens)
        assert cached is None or res.cached_tokens == cached, (len(prompt), res.cached_tokens)
        return res

    check(ids[:128], 0)            # ends on a block boundary
    check(ids[:128], 64)           # full hit impossible without the state at 127: one block less
    check(ids[:129], 128)          # 1 token left
    check(ids[:129], 128)          # replay: the tail entry [128, 129) holds the state at 128
    check(ids[:130], 128)          # the 129-token prompt's 1-token tail: its state is at 128
    check(ids, 129)                # the 130-token prompt's tail (state at 129): a tail prefix hit
    check(ids, len(ids) - 1)       # full hit through the tail entry
    check(ids[:64] + [t + 1 for t in ids[64:200]], 64)
    assert eng.close().shutdown_clean

    eng = make_engine(loaded, tmp_path, prefill_step_size=step)  # restart: from SSD
    check(ids, len(ids) - 1)
    check(ids[:200], 192)
    check(ids[:200], 199)
    check(ids[:230], 199)          # the 200-token prompt's 8-token tail from SSD (state at 199)
    other = [t + 2 for t in ids[:100]]
    pre = eng.prefill(other)       # warm: no decode, written through
    assert pre.blocks_written == 2
    check(other, 99)
    stats = dict(eng.stats())
    assert eng.close().shutdown_clean
    assert stats["ssd_load_hits"] > 0 and stats.get("ssd_save_fail", 0) == 0


@pytest.mark.parametrize("family", ["lfm2", "mamba"])
def test_state_checkpoint_is_what_continues(zoo, family, tmp_path, monkeypatch):
    """The restored checkpoint matters: zeroing it changes the tokens (2 tokens after the hit)."""
    import kvtool.kv.blocks as kb

    loaded = loaded_family(zoo, family)
    ids = prompt_for(loaded, 200)
    eng = make_engine(loaded, tmp_path)
    eng.generate(ids, max_tokens=1)
    prompt = ids[:130]
    ref = reference_tokens(loaded.model, loaded.tokenizer, prompt)
    good = eng.generate(prompt, max_tokens=MAX_TOKENS)
    assert good.cached_tokens == 128 and good.token_ids == ref

    orig = kb.assemble_layers

    def zeroed(kv, kv_caches, state):
        return orig(kv, kv_caches, [mx.zeros_like(mx.array(a)) for a in state] if state is not None else None)

    monkeypatch.setattr(kb, "assemble_layers", zeroed)
    bad = eng.generate(prompt, max_tokens=MAX_TOKENS)
    assert bad.cached_tokens >= 128 and bad.token_ids != ref
    eng.close()


@pytest.mark.parametrize("family,kwargs", [
    pytest.param("lfm2", {}, id="lfm2-states"),
    pytest.param("mistral_swa", {}, id="sliding"),
    pytest.param("llama", dict(kv_bits=8, kv_group_size=32, quantized_kv_start=0, prefill_step_size=64), id="kv8"),
])
def test_pending_writer_buffer_hit(zoo, family, kwargs, tmp_path):
    """RAM keeps nothing, the writer is stuck on the first segment: the next request is served
    from the writer's pending host blocks (states, full views, quantized records alike)."""
    import threading

    from kvtool.disk.fsops import FileOps

    class BlockedWriteFS(FileOps):
        def __init__(self):
            self.entered, self.release = threading.Event(), threading.Event()

        def write_all(self, fd, data):
            self.entered.set()
            assert self.release.wait(timeout=60)
            return super().write_all(fd, data)

    loaded = loaded_family(zoo, family)
    ids = prompt_for(loaded)
    q = {k: v for k, v in kwargs.items()}
    ref = reference_tokens(loaded.model, loaded.tokenizer, ids, **q)
    fs = BlockedWriteFS()
    cfg = KVToolConfig(ssd_cache_dir=tmp_path / "kv", block_size=BS, ssd_async_writes=True, ram_bytes=0)
    eng = Engine(loaded, cfg, fs=fs, **kwargs)
    try:
        assert eng.generate(ids, max_tokens=MAX_TOKENS).token_ids == ref
        assert fs.entered.wait(timeout=60)
        hit = eng.generate(ids, max_tokens=MAX_TOKENS)
        assert hit.token_ids == ref and hit.cached_tokens == len(ids) - 1
        assert eng.stats()["kv_pending_hits"] == len(ids) // BS + 1
        longer = ids + ids[:20]  # its block 3 was never stored: the prompt's pending tail entry serves
        res = eng.generate(longer, max_tokens=MAX_TOKENS)
        assert res.token_ids == reference_tokens(loaded.model, loaded.tokenizer, longer, **q)
        if "kv_bits" not in kwargs:  # a tail prefix hit (with state layers: one token less)
            assert res.cached_tokens == len(ids) - (1 if eng.cache.has_states else 0)
            assert eng.stats()["kv_tail_prefix_hits"] == 1
    finally:
        fs.release.set()
    assert eng.close().shutdown_clean


@pytest.mark.parametrize("family", ["gemma3_text", "lfm2", "qwen3_5"])
def test_bfloat16_sliding_and_state_layers(zoo, family, tmp_path):
    """bfloat16 (the usual KV dtype of real models): cold and SSD full hit equal mlx-lm. qwen3_5
    keeps its gated-delta state in float32 next to bfloat16 KV: records carry each dtype."""
    loaded = load_model(str(zoo[family]))
    loaded.model.set_dtype(mx.bfloat16)
    ids = prompt_for(loaded, 200)
    ref = reference_tokens(loaded.model, loaded.tokenizer, ids)
    eng = make_engine(loaded, tmp_path)
    assert eng.uncached_reason is None and eng.cache.kv.dtype == "bfloat16"
    if family == "qwen3_5":
        assert "float32" in eng.cache.kv.state_dtype_names() and "@float32" in eng.cache.kv.spec
    assert eng.generate(ids, max_tokens=MAX_TOKENS).token_ids == ref
    eng.close()
    eng = make_engine(loaded, tmp_path)
    res = eng.generate(ids, max_tokens=MAX_TOKENS)
    assert res.token_ids == ref and res.ssd_hit_tokens == len(ids) - 1
    eng.close()
