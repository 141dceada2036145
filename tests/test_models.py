"""Embedded presets, tokenizer assets, the loader and `kvtool model`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx_lm
import pytest
import typer
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from tokenizers import Tokenizer
from typer.testing import CliRunner

from kvtool.cli import cmd_model
from kvtool.models import embedded
from kvtool.models.loader import ModelLoadError, compute_model_id, digest_files, is_hub_id, load_model, model_files

ASSETS = embedded.ASSETS_DIR
DEMO_TEXT = (ASSETS / "demo_prompt.txt").read_text(encoding="utf-8")
TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "naïve café — “quotes” 日本語 😀 Ünïcödé",
    "def f(x):\n\treturn x ** 2  # square\n\n\nclass A(B): pass\n",
    "   leading spaces, trailing tabs\t\t",
    "It's 12345 o'clock; they'll say \"we've\" IT'S",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
]


def greedy(model, prompt_ids, n=16, cache=None) -> list[int]:
    """`n` greedy tokens after `prompt_ids` (a list of ints), optionally from a filled cache."""
    cache = make_prompt_cache(model) if cache is None else cache
    steps = generate_step(mx.array(prompt_ids), model, max_tokens=n, prompt_cache=cache)
    return [int(tok) for tok, _ in steps]


def run_cli(args: list[str]):
    app = typer.Typer()
    cmd_model.register(app)
    app.command("noop")(lambda: None)  # a second command keeps `model` a named sub-command
    return CliRunner().invoke(app, args)


# --- tokenizer assets -----------------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS + [DEMO_TEXT])
def test_tokenizer_ids_equal_between_tokenizers_and_mlx_lm(tiny_model, text):
    raw = Tokenizer.from_file(str(ASSETS / "tokenizer.json"))
    assert tiny_model.tokenizer.encode(text) == raw.encode(text).ids


def test_tokenizer_shape_and_special_tokens(tiny_model):
    raw = Tokenizer.from_file(str(ASSETS / "tokenizer.json"))
    assert raw.get_vocab_size() == 4096
    assert [raw.token_to_id(t) for t in embedded.SPECIAL_TOKENS] == [0, 1, 2]
    tok = tiny_model.tokenizer
    assert tok.bos_token is None
    assert tok.eos_token == "<|im_end|>"
    assert set(tok.eos_token_ids) == {0, 2}
    assert tok.decode(tok.encode("def f(x):\n    return 1\n")) == "def f(x):\n    return 1\n"


def test_demo_prompt_length():
    raw = Tokenizer.from_file(str(ASSETS / "tokenizer.json"))
    assert 1500 <= len(raw.encode(DEMO_TEXT).ids) <= 2500


def test_chat_template_renders_chatml_without_bos(tiny_model):
    tok = tiny_model.tokenizer
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a block?"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat is a block?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = list(tok.apply_chat_template(messages, add_generation_prompt=True))
    im_start = tok.convert_tokens_to_ids("<|im_start|>")
    assert ids[0] == im_start and ids[1] != im_start  # exactly one leading special, no BOS
    assert ids == tok.encode(text)  # encoding adds nothing on top of the template
    assert ids.count(im_start) == 3


# --- embedded presets -----------------------------------------------------------------------


def test_preset_dir_is_a_plain_mlx_lm_model():
    path = embedded.model_dir("tiny")
    assert path == embedded.models_root() / "tiny-v1" and embedded.is_built("tiny")
    model, tokenizer = mlx_lm.load(str(path))
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "qwen2" and config["tie_word_embeddings"] is False
    assert config["vocab_size"] == 4096 and config["eos_token_id"] == [2, 0]
    assert model.args.num_hidden_layers == 2 and model.args.hidden_size == 128
    assert model.lm_head.weight.dtype == mx.float32
    assert tokenizer.encode("hello") == Tokenizer.from_file(str(path / "tokenizer.json")).encode("hello").ids


def test_presets_api():
    assert set(embedded.PRESETS) == {"tiny", "small", "base", "qwen0.5b", "tiny-bf16", "qwen0.5b-bf16", "tiny-4bit",
                                     "tiny-8bit", "tiny-tools"}
    assert embedded.PRESETS["tiny-bf16"].dtype == "bfloat16" and embedded.PRESETS["tiny"].dtype == "float32"
    assert embedded.is_preset("tiny") and not embedded.is_preset("huge")
    q = embedded.PRESETS["qwen0.5b"]
    assert (q.num_hidden_layers, q.hidden_size, q.num_attention_heads, q.num_key_value_heads) == (24, 896, 14, 2)
    assert q.intermediate_size == 4864 and q.head_dim == 64
    shapes = embedded.parameter_shapes(embedded.PRESETS["tiny"], 4096)
    assert sum(mx.zeros(s).size for s in shapes.values()) == embedded.PRESETS["tiny"].num_params(4096)
    with pytest.raises(embedded.UnknownPresetError, match="huge"):
        embedded.model_dir("huge")


def test_weights_are_deterministic(tmp_path, tiny_model):
    tiny = embedded.PRESETS["tiny"]
    a = embedded.build_preset(tiny, tmp_path / "a")
    b = embedded.build_preset(tiny, tmp_path / "b")
    assert digest_files(model_files(a)) == digest_files(model_files(b)) == tiny_model.model_id
    other = embedded.build_preset(tiny, tmp_path / "c", seed=embedded.DEFAULT_SEED + 1)
    assert digest_files(model_files(other)) != tiny_model.model_id


def test_build_race_loser_uses_the_winner(tmp_path):
    tiny = embedded.PRESETS["tiny"]
    dest = embedded.build_preset(tiny, tmp_path / "tiny-v1")
    before = digest_files(model_files(dest))
    assert embedded.build_preset(tiny, dest) == dest  # rename fails: dest is complete, keep it
    assert digest_files(model_files(dest)) == before
    assert [p.name for p in tmp_path.iterdir()] == ["tiny-v1"]  # no temp dir left behind


@pytest.mark.slow
def test_two_processes_build_at_once(tmp_path):
    code = "from kvtool.models import embedded; print(embedded.model_dir('tiny'))"
    env = {**__import__("os").environ, "KVTOOL_MODELS_DIR": str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE) for _ in range(2)]
    outs = [p.communicate(timeout=120)[0].decode().strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert outs == [str(tmp_path / "tiny-v1")] * 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny-v1"]


# --- behaviour of the random weights --------------------------------------------------------


def test_greedy_output_is_varied(tiny_model):
    ids = tiny_model.tokenizer.encode("A Python program is constructed from code blocks.")
    out = greedy(tiny_model.model, ids)
    assert len(set(out)) >= 8, out
    assert not set(out) & {0, 1, 2}  # special tokens are never chosen greedily


def test_different_prompts_give_different_outputs(tiny_model):
    enc = tiny_model.tokenizer.encode
    a = greedy(tiny_model.model, enc("The quick brown fox jumps over the lazy dog."))
    b = greedy(tiny_model.model, enc("Exceptions are identified by class instances."))
    assert a != b


@pytest.mark.parametrize("start,stop", [(0, 256), (256, 512)])
def test_zeroing_one_kv_block_changes_the_output(tiny_model, start, stop):
    model = tiny_model.model
    ids = tiny_model.tokenizer.encode(DEMO_TEXT)[:600]

    def decode_after(zero: bool) -> list[int]:
        cache = make_prompt_cache(model)
        model(mx.array(ids[:-1])[None], cache=cache)
        if zero:
            for layer in cache:
                layer.keys[..., start:stop, :] = 0.0
                layer.values[..., start:stop, :] = 0.0
        mx.eval([layer.state for layer in cache])
        return greedy(model, ids[-1:], cache=cache)

    assert decode_after(False) != decode_after(True)


# --- loader ---------------------------------------------------------------------------------


def test_load_preset(tiny_model):
    assert tiny_model.name == "tiny"
    assert tiny_model.path == embedded.model_dir("tiny", build=False)
    assert len(tiny_model.model_id) == 32 and int(tiny_model.model_id, 16) >= 0


def test_load_local_dir_has_same_model_id(tiny_model):
    loaded = load_model(str(tiny_model.path))
    assert loaded.name == "tiny-v1" and loaded.path == tiny_model.path
    assert loaded.model_id == tiny_model.model_id


def test_model_id_is_cached_and_follows_file_changes(tmp_path):
    path = embedded.build_preset(embedded.PRESETS["tiny"], tmp_path / "m")
    first = compute_model_id(path)
    assert first in json.loads((embedded.models_root() / "model_ids.json").read_text()).values()
    assert compute_model_id(path) == first
    config = json.loads((path / "config.json").read_text())
    config["rms_norm_eps"] = 1e-5
    (path / "config.json").write_text(json.dumps(config))
    assert compute_model_id(path) != first


def test_weights_edited_in_place_with_size_and_mtime_restored_get_a_new_model_id(tmp_path):
    """The digest cache must not serve a stale id (the old namespace's KV would be used)."""
    import os

    path = embedded.build_preset(embedded.PRESETS["tiny"], tmp_path / "m")
    first = compute_model_id(path)
    (weights,) = sorted(path.glob("*.safetensors"))[:1]
    st = weights.stat()
    with open(weights, "r+b") as fh:  # same size, one byte changed, deep in the tensor data
        fh.seek(st.st_size - 100)
        b = fh.read(1)
        fh.seek(st.st_size - 100)
        fh.write(bytes([b[0] ^ 0xFF]))
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert weights.stat().st_size == st.st_size and weights.stat().st_mtime_ns == st.st_mtime_ns
    assert compute_model_id(path) != first


@pytest.mark.parametrize("spec", ["./nope", "nope", "a/b/c", "/definitely/not/here", "~/nope-kvtool", "!!"])
def test_unresolvable_specs_raise_model_load_error(spec):
    with pytest.raises(ModelLoadError, match="model path not found"):
        load_model(spec)


def test_hub_download_failure_is_one_line(monkeypatch):
    def offline(*args, **kwargs):
        raise ConnectionError("Name or service not known\nlong traceback-ish details")

    monkeypatch.setattr("mlx_lm.utils.snapshot_download", offline)
    with pytest.raises(ModelLoadError) as info:
        load_model("some-org/some-model")
    assert "\n" not in str(info.value) and "some-org/some-model" in str(info.value)


def test_directory_that_is_not_a_model_raises(tmp_path):
    with pytest.raises(ModelLoadError, match="cannot load model"):
        load_model(str(tmp_path))


@pytest.mark.parametrize(
    "spec,expected",
    [("Qwen/Qwen2.5-0.5B", True), ("mlx-community/x_y.z", True), ("./a", False), ("a/b/c", False),
     ("/abs/x", False), ("~/x", False), (".hidden/x", False), ("tiny", False)],
)
def test_is_hub_id(spec, expected):
    assert is_hub_id(spec) is expected


# --- CLI ------------------------------------------------------------------------------------


def test_cli_model_path_prints_existing_dir():
    result = run_cli(["model", "path", "tiny"])
    assert result.exit_code == 0, result.output
    path = Path(result.output.strip())
    assert path == embedded.model_dir("tiny", build=False) and (path / "config.json").is_file()


def test_cli_model_path_unknown_preset_is_one_line_exit_2():
    result = run_cli(["model", "path", "huge"])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        "error: unknown model preset 'huge' (choose from: tiny, small, base, qwen0.5b, tiny-bf16, qwen0.5b-bf16, "
        "tiny-4bit, tiny-8bit, tiny-tools)"
    ]


def test_cli_model_list_json():
    result = run_cli(["model", "list", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["schema_version"] == 1
    rows = {r["name"]: r for r in doc["models"]}
    assert list(rows) == list(embedded.PRESETS)
    assert rows["tiny"]["layers"] == 2 and rows["qwen0.5b"]["hidden"] == 896
    assert rows["tiny"]["kv_bytes_per_token"] == 2 * 2 * 2 * 32 * 4
    assert rows["tiny-4bit"]["params"] == rows["tiny-8bit"]["params"] == rows["tiny"]["params"]
    assert rows["tiny-tools"]["vocab"] == rows["tiny"]["vocab"] + 3  # the tool-call tokens


def test_cli_model_list_table_shows_kv_bytes_below_one_kib():
    result = run_cli(["model", "list"])
    rows = {line.split()[0]: line.split() for line in result.output.splitlines()[1:] if line.strip()}
    assert result.exit_code == 0 and rows["tiny-bf16"][-3:-1] == ["512", "B"], result.output  # was "0 KiB"
    assert rows["tiny"][-3:-1] == ["1", "KiB"] and rows["qwen0.5b"][-3:-1] == ["24", "KiB"]


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_presets_are_tiny_as_mlx_lm_convert_q_writes_it(bits, tiny_model):
    """The weights people download are quantized: `tiny-<bits>bit` is the float `tiny`, every linear
    and embedding packed in groups of 64 (mlx_lm.convert -q's defaults), `quantization` in config.json."""
    path = embedded.model_dir(f"tiny-{bits}bit")
    config = json.loads((path / "config.json").read_text())
    assert config["quantization"] == {"group_size": 64, "bits": bits, "mode": "affine"}
    assert config["kvtool_preset"] == f"tiny-{bits}bit" and config["kvtool_seed"] == embedded.DEFAULT_SEED
    packed = mx.load(str(path / "model.safetensors"))
    float_weights = mx.load(str(embedded.model_dir("tiny") / "model.safetensors"))
    for name in ("model.layers.0.self_attn.q_proj", "model.embed_tokens", "lm_head"):
        w, scales, biases = mx.quantize(float_weights[f"{name}.weight"], group_size=64, bits=bits)
        assert packed[f"{name}.weight"].dtype == mx.uint32
        assert mx.array_equal(packed[f"{name}.weight"], w) and mx.allclose(packed[f"{name}.scales"], scales)
        assert mx.allclose(packed[f"{name}.biases"], biases)
    model, _ = mlx_lm.load(str(path))
    assert type(model.model.layers[0].mlp.down_proj).__name__ == "QuantizedLinear"


@pytest.mark.parametrize("args", [["model"], ["model", "path"], ["model", "list"]])
def test_cli_help_has_an_example(args):
    result = run_cli([*args, "--help"])
    assert result.exit_code == 0 and "Example" in result.output and "kvtool model" in result.output


def test_bf16_preset_gives_bf16_kv_and_ssd_hits_equal_mlx_lm(tmp_path):
    """The common KV dtype of real models (bfloat16) through the whole cache path."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    from kvtool.config import KVToolConfig
    from kvtool.engine import Engine
    from kvtool.models.loader import load_model

    loaded = load_model("tiny-bf16")
    assert loaded.model.model.embed_tokens.weight.dtype == mx.bfloat16
    ids = loaded.tokenizer.encode(open("kvtool/assets/demo_prompt.txt", encoding="utf-8").read())[:200]
    ref = [int(t) for t, _ in generate_step(mx.array(ids), loaded.model, max_tokens=6)]
    cfg = KVToolConfig(ssd_cache_dir=tmp_path, ssd_async_writes=False)
    with Engine(loaded, cfg) as eng:
        assert eng.cache.kv.dtype == "bfloat16"
        assert eng.generate(ids, max_tokens=6).token_ids == ref[: len(eng.generate(ids, max_tokens=6).token_ids)]
    with Engine(loaded, cfg) as eng:  # a restart: SSD hits
        res = eng.generate(ids, max_tokens=6)
        assert res.ssd_hit_tokens == len(ids) - 1 and res.token_ids == ref[: len(res.token_ids)]
