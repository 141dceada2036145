"""Interop with mlx-lm prompt-cache files (`kvtool import` / `kvtool export`, kvtool.jobs.interop).

Against mlx-lm's own tools in subprocesses: a file written by `mlx_lm.cache_prompt` imports as
verified blocks that a new `serve-once` process hits on SSD with the uncached output, and exports
back bit for bit; a prompt warmed by kvtool exports to a file that `mlx_lm.generate
--prompt-cache-file` continues with the output of an uncached `mlx_lm.generate` on the whole
prompt. In process: every refusal (token count, KV check, model, cache types, not cached), a
quantized round trip, and exports of sliding-window and state-layer models equal to mlx-lm's own
prompt cache, array for array.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import (
    KVCache,
    RotatingKVCache,
    load_prompt_cache,
    make_prompt_cache,
    save_prompt_cache,
)
from typer.testing import CliRunner

from kvtool.cli import app as app_module
from kvtool.config import KVToolConfig
from kvtool.engine import Engine
from kvtool.jobs import interop, interop_export, interop_files
from kvtool.jobs.interop import InteropError

REPO = Path(__file__).resolve().parent.parent
BS = 16
PROMPT = ("The quick brown fox jumps over the lazy dog. It was a bright cold day in April, and the clocks were "
          "striking thirteen. Call me Ishmael. Some years ago, never mind how long precisely, having little or no "
          "money in my purse.")
# PREFIX + SUFFIX tokenises as PREFIX's tokens then SUFFIX's ("." then " Then" are separate
# pre-tokens), so a cached PREFIX continued with SUFFIX is the whole prompt (checked below).
PREFIX = ("It was a bright cold day in April, and the clocks were striking thirteen. Winston Smith, his chin "
          "nuzzled into his breast in an effort to escape the vile wind, slipped quickly through the glass doors.")
SUFFIX = " Then he went home and slept."

if not any(c.name == "import" for c in app_module.app.registered_commands):
    app_module._register()
runner = CliRunner()


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], check=False, capture_output=True, text=True, cwd=REPO, timeout=120)


def kvtool(*args: str) -> subprocess.CompletedProcess:
    return run("-m", "kvtool.cli.app", *args)


def mlx_generate(model_dir: Path, *args: str) -> tuple[str, int]:
    """(generated text, prompt tokens mlx-lm processed) of a greedy `mlx_lm.generate` run."""
    r = run("-m", "mlx_lm.generate", "--model", str(model_dir), "--max-tokens", "8", "--temp", "0", *args)
    assert r.returncode == 0, r.stderr[-2000:]
    out = r.stdout
    text = out.split("==========\n", 1)[1].rsplit("\n==========", 1)[0]
    (line,) = [x for x in out.splitlines() if x.startswith("Prompt: ")]
    return text, int(line.split()[1])


def serve_once(cache_dir: Path, *args: str) -> list[dict]:
    r = kvtool("serve-once", "--model", "tiny", "--cache-dir", str(cache_dir), "--block-size", str(BS), "--max-tokens", "8",
               "--json", *args)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout)["requests"]


def assert_same_kv(a_path: Path, b_path: Path) -> None:
    """Same cache classes and offsets, and bit-identical KV up to each offset."""
    a, b = load_prompt_cache(str(a_path)), load_prompt_cache(str(b_path))
    assert [type(c).__name__ for c in a] == [type(c).__name__ for c in b]
    for x, y in zip(a, b):
        assert x.offset == y.offset
        n = x.offset
        xs = [*x.keys, *x.values] if isinstance(x.keys, (tuple, list)) else [x.keys, x.values]
        ys = [*y.keys, *y.values] if isinstance(y.keys, (tuple, list)) else [y.keys, y.values]
        for p, q in zip(xs, ys):
            assert mx.array_equal(p[..., :n, :], q[..., :n, :]).item()


def mlx_cache_file(model, ids, path: Path, metadata: dict, **kw) -> list:
    """What mlx_lm.cache_prompt does, in process: generate_step(max_tokens=0), save_prompt_cache."""
    cache = make_prompt_cache(model)
    for _ in generate_step(mx.array(ids), model, max_tokens=0, prompt_cache=cache, **kw):
        pass
    save_prompt_cache(str(path), cache, metadata)
    return cache


@pytest.fixture(scope="module")
def tiny_dir(tiny_model) -> Path:
    return Path(tiny_model.path)


def engine_for(loaded, cache_dir: Path, **kw) -> Engine:
    return Engine(loaded, KVToolConfig(ssd_cache_dir=cache_dir, block_size=BS), **kw)


# ------------------------------------------------------------------ with mlx-lm's tools
@pytest.mark.slow
def test_cache_prompt_file_imports_and_serves_from_ssd(tmp_path, tiny_model, tiny_dir):
    tok = tiny_model.tokenizer
    f = tmp_path / "doc.safetensors"
    r = run("-m", "mlx_lm.cache_prompt", "--model", str(tiny_dir), "--prompt", PROMPT, "--prompt-cache-file", str(f))
    assert r.returncode == 0, r.stderr[-2000:]
    cache_dir = tmp_path / "cache"
    r = kvtool("import", str(f), "--model", "tiny", "--prompt", PROMPT, "--cache-dir", str(cache_dir),
               "--block-size", str(BS), "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(r.stdout)
    n = doc["prompt_tokens"]
    assert load_prompt_cache(str(f))[0].offset == n
    assert doc["verified"] and doc["cached_tokens"] == n and doc["shutdown_clean"]
    assert doc["model_check"] == "match" and doc["token_source"] == "prompt_chat_template"
    assert doc["entries_stored"] == doc["blocks_written"] == n // BS + 1 and doc["blocks_failed"] == 0
    assert doc["kv_check_tokens"] > 32 and doc["kv_check_max_rel_diff"] < 1e-3

    # The file ends inside the user message (mlx-lm's convention): serve-once's chat prompt is
    # the file's tokens plus the assistant turn, so every imported block is an SSD hit, and so is
    # the file's tail entry (a tail prefix hit): all n tokens ...
    user_only = tok.apply_chat_template([{"role": "user", "content": PROMPT}], tokenize=False,
                                        add_generation_prompt=False, continue_final_message=True)
    chat = tok.apply_chat_template([{"role": "user", "content": PROMPT}], tokenize=False, add_generation_prompt=True)
    (hit,) = serve_once(cache_dir, "--prompt", PROMPT)
    assert hit["prompt_tokens"] > n and hit["cached_tokens"] == hit["ssd_hit_tokens"] == n
    # ... and the file's exact tokens are a full hit (blocks and tail entry from SSD).
    (full,) = serve_once(cache_dir, "--ignore-chat-template", "--prompt", user_only)
    assert full["prompt_tokens"] == n and full["cached_tokens"] == full["ssd_hit_tokens"] == n - 1
    reqs = tmp_path / "reqs.jsonl"
    reqs.write_text(json.dumps({"prompt": chat}) + "\n" + json.dumps({"prompt": user_only}) + "\n")
    base = serve_once(tmp_path / "unused", "--no-ssd", "--ram-bytes", "0", "--ignore-chat-template", "--requests", str(reqs))
    assert [b["cached_tokens"] for b in base] == [0, 0]
    assert [b["prompt_tokens"] for b in base] == [hit["prompt_tokens"], n]
    assert hit["token_ids"] == base[0]["token_ids"] and full["token_ids"] == base[1]["token_ids"]

    # Export gives mlx-lm's file back, bit for bit.
    out = tmp_path / "back.safetensors"
    r = kvtool("export", str(out), "--model", "tiny", "--prompt", PROMPT, "--cache-dir", str(cache_dir),
               "--block-size", str(BS), "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    exp = json.loads(r.stdout)
    assert exp["prompt_tokens"] == exp["cached_tokens"] == exp["ssd_hit_tokens"] == n and exp["computed_tokens"] == 1
    assert_same_kv(f, out)
    _, meta_in = load_prompt_cache(str(f), return_metadata=True)
    _, meta_out = load_prompt_cache(str(out), return_metadata=True)
    assert meta_out["model"] == meta_in["model"] == str(tiny_dir)
    assert json.loads(meta_out["tokenizer_config"]) == json.loads(meta_in["tokenizer_config"])


@pytest.mark.slow
def test_warmed_prompt_exports_for_mlx_generate(tmp_path, tiny_model, tiny_dir):
    tok = tiny_model.tokenizer
    assert tok.encode(PREFIX + SUFFIX) == tok.encode(PREFIX) + tok.encode(SUFFIX)  # a clean token boundary
    pre = tmp_path / "prefix.txt"
    pre.write_text(PREFIX)
    cache_dir, out = tmp_path / "cache", tmp_path / "prefix.safetensors"
    common = ["--model", "tiny", "--ignore-chat-template", "--cache-dir", str(cache_dir), "--block-size", str(BS)]
    r = kvtool("warm", *common, "--whole", str(pre), "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    r = kvtool("export", str(out), *common, "--prompt-file", str(pre), "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    exp = json.loads(r.stdout)
    n = exp["prompt_tokens"]
    assert exp["cached_tokens"] == exp["ssd_hit_tokens"] == n and exp["computed_tokens"] == 1
    cached = mlx_generate(tiny_dir, "--ignore-chat-template", "--prompt-cache-file", str(out), "--prompt", SUFFIX)
    plain = mlx_generate(tiny_dir, "--ignore-chat-template", "--prompt", PREFIX + SUFFIX)
    assert cached[0] == plain[0] and cached[0].strip()
    assert cached[1] == plain[1] - n  # mlx-lm prefilled only the suffix


@pytest.mark.slow
def test_chat_prompt_export_needs_fill_then_continues_in_mlx_generate(tmp_path, tiny_model, tiny_dir):
    cache_dir, out = tmp_path / "cache", tmp_path / "chat.safetensors"
    with engine_for(tiny_model, cache_dir) as eng:  # what serve-once --prompt PREFIX stores
        eng.generate(eng.encode(prompt=PREFIX, chat_template=True), max_tokens=2)
    args = ["export", str(out), "--model", "tiny", "--prompt", PREFIX, "--cache-dir", str(cache_dir),
            "--block-size", str(BS)]
    # The stored prompt's tail differs from the export prompt's, but only after the tokens both
    # share: its last block (a sibling, kvtool.tiers.siblings) serves all of them but the last token.
    r = runner.invoke(app_module.app, [*args, "--json"])
    assert r.exit_code == 0, r.output
    exp = json.loads(r.stdout)
    n = exp["prompt_tokens"]
    assert exp["cached_tokens"] == n - 1 and exp["computed_tokens"] == 1
    cached = mlx_generate(tiny_dir, "--prompt-cache-file", str(out), "--prompt", SUFFIX)
    plain = mlx_generate(tiny_dir, "--prompt", PREFIX + SUFFIX)
    assert cached[0] == plain[0] and cached[1] < plain[1]


# ------------------------------------------------------------------ in process
@pytest.fixture
def made(tmp_path, tiny_model):
    """A prompt, its cache_prompt tokens and the file mlx-lm writes for them."""
    ids = interop_files.cache_prompt_tokens(tiny_model.tokenizer, PROMPT)
    path = tmp_path / "made.safetensors"
    mlx_cache_file(tiny_model.model, ids, path, {"model": str(tiny_model.path), "tokenizer_config": "{}"})
    return ids, path


def test_import_refuses_wrong_prompt_model_and_types(tmp_path, tiny_model, made):
    ids, path = made
    meta = {"model": str(tiny_model.path), "tokenizer_config": "{}"}
    with engine_for(tiny_model, tmp_path / "c") as eng:
        def imp(p=path, tokens=ids, **kw):
            return interop.import_cache_file(eng, p, tokens, model_spec="tiny", **kw)

        with pytest.raises(InteropError, match=f"holds {len(ids)} tokens but the prompt has {len(ids) - 1}"):
            imp(tokens=ids[:-1])
        for pos in (3, len(ids) - 5):  # an early token (spread single-token check), a late one (tail check)
            bad = list(ids)
            bad[pos] = (bad[pos] + 7) % 500
            with pytest.raises(InteropError, match="recomputed tokens is not what the model computes"):
                imp(tokens=bad)
        other = tmp_path / "other.safetensors"
        mlx_cache_file(tiny_model.model, ids, other, {**meta, "model": str(tmp_path / "gone")})
        with pytest.raises(InteropError, match="model check failed") as exc:
            imp(other)
        assert "--skip-model-check" in exc.value.hint
        changed = tmp_path / "changed-model"
        shutil.copytree(tiny_model.path, changed)
        cfg = json.loads((changed / "config.json").read_text())
        (changed / "config.json").write_text(json.dumps({**cfg, "note": "another model"}))
        mlx_cache_file(tiny_model.model, ids, other, {**meta, "model": str(changed)})
        with pytest.raises(InteropError, match="model check failed: the file was made with"):
            imp(other)
        rot = tmp_path / "rot.safetensors"
        rc = [RotatingKVCache(max_size=32) for _ in range(2)]
        tiny_model.model(mx.array([ids]), cache=rc)
        save_prompt_cache(str(rot), rc, meta)
        with pytest.raises(InteropError, match="RotatingKVCache .* keeps only the last window"):
            imp(rot)
        with pytest.raises(InteropError, match="not an mlx-lm prompt cache"):
            mx.save_safetensors(str(tmp_path / "junk.safetensors"), {"a": mx.zeros(2)})
            imp(tmp_path / "junk.safetensors")
        with pytest.raises(InteropError, match="hold no token ids"):
            imp(tokens=None)
        assert eng.cache.probe(ids) == 0  # nothing was written by any refusal
        # --skip-model-check: imported with a warning; a copy with the same weights matches by digest
        rep = imp(other, require_model_match=False)
        assert rep.verified and rep.model_check == "skipped" and "model not verified" in rep.warnings[0]
        same = tmp_path / "same-model"
        shutil.copytree(tiny_model.path, same)
        mlx_cache_file(tiny_model.model, ids, other, {**meta, "model": str(same)})
        rep = imp(other)
        assert rep.model_check == "match" and "same weights digest" in rep.model_check_detail
        assert rep.blocks_written == 0 and rep.verified  # already stored by the import above


def test_exported_file_imports_without_prompt_and_quantized_round_trip(tmp_path, tiny_model, made):
    ids, path = made
    with engine_for(tiny_model, tmp_path / "a") as eng:
        interop.import_cache_file(eng, path, ids, model_spec="tiny")
        interop_export.export_cache_file(eng, ids, tmp_path / "exp.safetensors", metadata_model=str(tiny_model.path))
    with engine_for(tiny_model, tmp_path / "b") as eng:
        rep = interop.import_cache_file(eng, tmp_path / "exp.safetensors", None, model_spec="tiny")
        assert rep.token_source == "metadata" and rep.verified and rep.cached_tokens == len(ids)
    # KV quantized by mlx-lm (8 bits, group 32, from the first token): imported and exported bit for bit
    q = tmp_path / "q.safetensors"
    mlx_cache_file(tiny_model.model, ids, q, {"model": str(tiny_model.path), "tokenizer_config": "{}"},
                   kv_bits=8, kv_group_size=32, quantized_kv_start=0)
    assert interop_files.file_quantization(load_prompt_cache(str(q))) == (8, 32)
    with engine_for(tiny_model, tmp_path / "c") as eng, pytest.raises(InteropError, match="load the engine with kv_bits=8"):
        interop.import_cache_file(eng, q, ids, model_spec="tiny")
    with engine_for(tiny_model, tmp_path / "c", kv_bits=8, kv_group_size=32, quantized_kv_start=0) as eng:
        rep = interop.import_cache_file(eng, q, ids, model_spec="tiny")
        assert rep.verified and rep.cache_type == "QuantizedKVCache" and rep.kv_bits == 8
    with engine_for(tiny_model, tmp_path / "c", kv_bits=8, kv_group_size=32, quantized_kv_start=0) as eng:
        exp = interop_export.export_cache_file(eng, ids, tmp_path / "q2.safetensors", metadata_model="m")
        assert exp.cached_tokens == exp.ssd_hit_tokens == len(ids) and exp.cache_types == ["QuantizedKVCache"]
    assert_same_kv(q, tmp_path / "q2.safetensors")


def test_an_edited_export_is_refused_where_the_kv_check_recomputes_nothing(tmp_path, tiny_model):
    """The last layer's KV of one token the KV check does not recompute, scaled in an exported
    file: no other layer's KV shows it, so only the file's kvtool_kv_digest can; the import is
    refused and writes nothing. Without a digest the import warns that it could not check."""
    ids = [int(t) for t in tiny_model.tokenizer.encode(PROMPT * 8)]
    with engine_for(tiny_model, tmp_path / "a") as eng:
        interop_export.export_cache_file(eng, ids, tmp_path / "exp.safetensors", metadata_model="m", fill=True)
    lo = len(ids) - interop.DEFAULT_CHECK_TOKENS
    m = min(interop.DEFAULT_CHECK_POSITIONS, lo)
    checked = {int(i * lo / m) for i in range(m)} | {lo - 1}
    j = min(set(range(lo)) - checked)  # a position no single-token check recomputes
    arrays, meta = mx.load(str(tmp_path / "exp.safetensors"), return_metadata=True)
    old = {k: v for k, v in meta.items() if k != "0.kvtool_kv_digest"}  # an export of an older kvtool
    mx.save_safetensors(str(tmp_path / "old.safetensors"), dict(arrays), old)
    last = max(int(name.split(".")[0]) for name in arrays if name.split(".")[-1] in ("0", "1") and name.count(".") == 1)
    for name in (f"{last}.0", f"{last}.1"):  # keys, values of the last layer
        a = arrays[name]
        arrays[name] = mx.concatenate([a[:, :, :j], -3 * a[:, :, j : j + 1], a[:, :, j + 1 :]], axis=2)
    mx.save_safetensors(str(tmp_path / "edited.safetensors"), arrays, meta)
    with engine_for(tiny_model, tmp_path / "b") as eng:
        with pytest.raises(InteropError, match="do not match the file's kvtool_kv_digest"):
            interop.import_cache_file(eng, tmp_path / "edited.safetensors", None, model_spec="m", require_model_match=False)
        assert eng.cache.probe(ids) == 0
        rep = interop.import_cache_file(eng, tmp_path / "exp.safetensors", None, model_spec="m", require_model_match=False)
        assert rep.verified and not any("kvtool_kv_digest" in w for w in rep.warnings)
    with engine_for(tiny_model, tmp_path / "c") as eng:
        rep = interop.import_cache_file(eng, tmp_path / "old.safetensors", None, model_spec="m", require_model_match=False)
        assert rep.verified and any("carries no kvtool_kv_digest" in w for w in rep.warnings)
    r = kvtool("import", str(tmp_path / "edited.safetensors"), "--model", "tiny", "--cache-dir", str(tmp_path / "d"))
    assert r.returncode == 2 and "kvtool_kv_digest" in r.stderr, r.stderr  # refused before the model loads:
    assert not (tmp_path / "d").exists()  # no empty namespace left behind


def test_an_export_gets_the_mode_mlx_lm_gives_its_files(tmp_path, tiny_model):
    """0o666 less the umask, as `save_prompt_cache` writes (it was mkstemp's 0o600 whatever the umask)."""
    ids = [int(t) for t in tiny_model.tokenizer.encode(PROMPT)]
    old = os.umask(0o027)
    try:
        with engine_for(tiny_model, tmp_path / "a") as eng:
            interop_export.export_cache_file(eng, ids, tmp_path / "e.safetensors", metadata_model="m", fill=True)
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "e.safetensors").stat().st_mode) == 0o640
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp file left


def test_import_over_the_ssd_budget_is_counted_over_budget_not_failed(tmp_path, tiny_model, made):
    """A byte budget with no room for a segment: the import's blocks are over the budget (not
    stored, so not verified), not failed, and never retried."""
    ids, path = made
    cfg = KVToolConfig(ssd_cache_dir=tmp_path / "c", block_size=BS, ssd_max_bytes="512KiB",
                       ssd_durability="persistent")  # the index's log alone is counted at 512 KiB: nothing fits
    with Engine(tiny_model, cfg) as eng:
        rep = interop.import_cache_file(eng, path, ids, model_spec="tiny")
        stats = eng.stats()
    assert rep.blocks_over_budget == rep.entries_stored > 0 and rep.blocks_failed == rep.blocks_written == 0
    assert not rep.verified and rep.flushed
    assert stats["writer_budget_refused"] == stats["ssd_budget_refused"] == rep.entries_stored
    assert stats["writer_retry_attempts"] == stats["writer_save_fail"] == 0


def test_cli_errors_are_one_line(tmp_path):
    r = runner.invoke(app_module.app, ["import", str(tmp_path / "missing.safetensors"), "--model", "tiny",
                                       "--prompt", "x", "--cache-dir", str(tmp_path)])
    assert r.exit_code == 2 and r.stderr.strip() == f"error: file not found: {tmp_path / 'missing.safetensors'}"
    r = runner.invoke(app_module.app, ["export", str(tmp_path / "out.bin"), "--model", "tiny", "--prompt", "x",
                                       "--cache-dir", str(tmp_path)])
    assert r.exit_code == 2 and r.stderr.count("\n") == 1 and "must be named *.safetensors" in r.stderr
    r = runner.invoke(app_module.app, ["export", str(tmp_path / "o.safetensors"), "--model", "tiny",
                                       "--cache-dir", str(tmp_path)])
    assert r.exit_code == 2 and r.stderr.strip().startswith("error: give the prompt")


def test_export_into_a_read_only_directory_is_one_line(tmp_path, tiny_model, read_only_dir):
    ro = read_only_dir
    out = ro / "o.safetensors"
    r = runner.invoke(app_module.app, ["export", str(out), "--model", "tiny", "--prompt", PROMPT, "--fill",
                                       "--cache-dir", str(tmp_path / "kv")])  # fmt: skip
    assert r.exit_code == 2, r.exception  # was an OSError traceback, exit 1
    assert r.stderr.strip() == f"error: {out}: cannot write in {ro}: Read-only file system", r.stderr
    assert list(ro.iterdir()) == []


@pytest.mark.parametrize("family", ["gemma3_text", pytest.param("lfm2", marks=pytest.mark.slow),
                                    pytest.param("deepseek_v2", marks=pytest.mark.slow)])
def test_export_equals_mlx_cache_of_other_families(tmp_path, family):
    """Sliding-window layers (RotatingKVCache), state layers (ArraysCache) and K/V head dims that
    differ: the exported file equals mlx-lm's own prompt cache of the same tokens, every array."""
    from mlx.utils import tree_flatten

    from kvtool.models.loader import load_model
    from tests.model_zoo import build_family

    loaded = load_model(str(build_family(family, tmp_path / family)))
    ids = interop_files.cache_prompt_tokens(loaded.tokenizer, PREFIX * 2)  # longer than the 96-token window
    ref_path = tmp_path / "ref.safetensors"
    ref = mlx_cache_file(loaded.model, ids, ref_path, {"model": "m", "tokenizer_config": "{}"}, prefill_step_size=64)
    with engine_for(loaded, tmp_path / "c", prefill_step_size=64) as eng:
        eng.prefill(ids)
    with engine_for(loaded, tmp_path / "c", prefill_step_size=64) as eng:
        exp = interop_export.export_cache_file(eng, ids, tmp_path / "exp.safetensors", metadata_model="m")
        assert exp.cached_tokens == len(ids) and exp.computed_tokens == 1
    got = load_prompt_cache(str(tmp_path / "exp.safetensors"))
    assert [type(c) for c in got] == [type(c) for c in ref]
    for a, b in zip(ref, got):
        if type(a) is KVCache:
            assert a.offset == b.offset
            pairs = [(x[..., : a.offset, :], y[..., : a.offset, :]) for x, y in zip(a.state[:2], b.state[:2])]
        else:  # every array and scalar of the state (RotatingKVCache: offset, keep, max_size, _idx)
            xs, ys = ([v for _, v in tree_flatten(c.state)] for c in (a, b))
            assert [type(x) for x in xs] == [type(y) for y in ys]
            assert [x for x in xs if not isinstance(x, mx.array)] == [y for y in ys if not isinstance(y, mx.array)]
            pairs = [(x, y) for x, y in zip(xs, ys) if isinstance(x, mx.array)]
        assert pairs and all(x.shape == y.shape and mx.array_equal(x, y).item() for x, y in pairs)
    if family == "deepseek_v2":  # plain KVCache layers: mlx-lm's file imports too
        with engine_for(loaded, tmp_path / "d", prefill_step_size=64) as eng:
            rep = interop.import_cache_file(eng, ref_path, ids, model_spec=str(loaded.path),
                                            require_model_match=False)
            assert rep.verified and rep.kv_check_max_rel_diff < 1e-3


def test_a_refused_import_or_an_export_leaves_no_namespace_behind(tmp_path, tiny_model):
    """A namespace the command opened and stored nothing in goes again (an import refused after
    the model loaded, an export refused or `--fill`ed), with the cache directory if the command
    made it; a namespace that holds blocks and a user's files stay."""
    ids = [int(t) for t in tiny_model.tokenizer.encode(PROMPT)]
    src, out = tmp_path / "e.safetensors", tmp_path / "o.safetensors"
    with engine_for(tiny_model, tmp_path / "a") as eng:
        eng.prefill(ids)
        interop_export.export_cache_file(eng, ids, src, metadata_model="m")
    new = tmp_path / "new"
    bad_import = ["import", str(src), "--model", "tiny", "--prompt", "another prompt", "--block-size", str(BS)]
    r = runner.invoke(app_module.app, [*bad_import, "--cache-dir", str(new)])
    assert r.exit_code == 2 and "differ from the" in r.stderr and not new.exists()  # was: an empty namespace
    export = ["export", str(out), "--model", "tiny", "--prompt", "never cached", "--cache-dir"]
    r = runner.invoke(app_module.app, [*export, str(new)])
    assert r.exit_code == 1 and "not fully cached" in r.stderr and not new.exists()
    (tmp_path / "kept" / "mine").mkdir(parents=True)
    r = runner.invoke(app_module.app, [*export, str(tmp_path / "kept"), "--fill"])
    assert r.exit_code == 0 and out.is_file() and [p.name for p in (tmp_path / "kept").iterdir()] == ["mine"]
    before = sorted(p.relative_to(tmp_path) for p in (tmp_path / "a").rglob("*"))
    r = runner.invoke(app_module.app, [*bad_import, "--cache-dir", str(tmp_path / "a")])
    assert r.exit_code == 2 and sorted(p.relative_to(tmp_path) for p in (tmp_path / "a").rglob("*")) == before
    with engine_for(tiny_model, tmp_path / "a") as eng:
        assert eng.cache.probe(ids) == len(ids)


def test_drop_unused_removes_only_an_empty_closed_namespace(tmp_path, tiny_model):
    from kvtool.ops.remove_tree import drop_unused

    since = time.time()
    with engine_for(tiny_model, tmp_path / "c") as eng:
        ns = Path(eng.namespace_dir)
        assert not drop_unused(tmp_path / "c", ns.name, since)  # open (shutdown_clean = 0): kept
    (ns / "notes.txt").write_text("mine")
    assert not drop_unused(tmp_path / "c", ns.name, since) and (ns / "index.sqlite").is_file()  # a user's file: kept
    (ns / "notes.txt").unlink()
    (tmp_path / "link").mkdir()
    os.symlink(ns, tmp_path / "link" / ns.name)
    assert not drop_unused(tmp_path / "link", ns.name, since) and ns.is_dir()  # a symlink: never followed
    assert not drop_unused(tmp_path / "c", ns.name, time.time() + 60) and ns.is_dir()  # made before the job: kept
    assert drop_unused(tmp_path / "c", ns.name, since) and not ns.exists()
    with engine_for(tiny_model, tmp_path / "d") as eng:
        eng.prefill([int(t) for t in tiny_model.tokenizer.encode(PROMPT)])
        ns = Path(eng.namespace_dir)
    assert not drop_unused(tmp_path / "d", ns.name, since) and ns.is_dir()  # holds blocks: kept


def test_import_and_warm_without_an_ssd_tier_say_why_in_one_line(tmp_path, tiny_model):
    from kvtool.jobs.warm import WarmError, check_engine

    eng = Engine(tiny_model, KVToolConfig(ssd_cache_dir=tmp_path, ssd_enabled=False))
    try:
        with pytest.raises(InteropError, match=r"^the SSD tier is off \(ssd_enabled = false\): import writes blocks"):
            interop.check_writable(eng)
        with pytest.raises(WarmError, match=r"^the SSD tier is off \(ssd_enabled = false\): warm writes blocks"):
            check_engine(eng)
    finally:
        eng.close()
