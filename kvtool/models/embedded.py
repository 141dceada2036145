"""Embedded default models: small Qwen2 presets with deterministic random weights, built on demand.

A preset is written once as an ordinary mlx-lm model directory (config.json, model.safetensors and
the tokenizer shipped in `kvtool/assets/`), so `mlx_lm.load(path)` loads it unchanged and every
machine gets bit-identical weights without a network.

Weights are not trained. The init is chosen so that the output depends on the context: untied
embeddings, sharp attention (large q/k gain) and residual branches as strong as the embedding, so
greedy decoding neither repeats one token nor ignores the KV cache. The lm_head rows of the special
tokens are zero, so greedy decoding never emits an end-of-sequence token (runs reach max_tokens).

The quantized presets (`tiny-4bit`, `tiny-8bit`) are a float preset run through mlx-lm's own
converter (`write_quantized_files`), as the mlx-community models people download are.
`tiny-tools` answers every chat prompt with one fixed tool call (`kvtool.models.tool_preset`).
Presets are built in `models_root()/<name>-v1/` (`$KVTOOL_MODELS_DIR` or `~/.cache/kvtool-models`).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import math
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kvtool.models import tool_preset

ENV_MODELS_DIR = "KVTOOL_MODELS_DIR"
DEFAULT_MODELS_DIR = Path("~/.cache/kvtool-models")
DEFAULT_PRESET = "tiny"
DEFAULT_SEED = 0x6B76  # "kv"
# Bump when the init or the config changes: directories are named `<name>-<INIT_VERSION>`.
INIT_VERSION = "v1"
ASSETS_DIR = Path(__file__).resolve().parent.parent / "assets"
TOKENIZER_ASSETS = ("tokenizer.json", "tokenizer_config.json")
WEIGHTS_FILE = "model.safetensors"
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS_TOKENS = ("<|im_end|>", "<|endoftext|>")
DEFAULT_RMS_NORM_EPS = 1e-6
DEFAULT_ROPE_THETA = 1_000_000.0
DEFAULT_MAX_POSITIONS = 32768

# Init gains by weight name (standard deviations are gain / sqrt(fan_in); embeddings have std EMBED_STD).
EMBED_STD = 1.0
GAINS = {"q_proj": 2.0, "k_proj": 2.0, "v_proj": 1.0, "o_proj": 2.0, "gate_proj": 1.0, "up_proj": 1.0,
         "down_proj": 1.0, "lm_head": 1.0}


@dataclass(frozen=True)
class Preset:
    """Shape of one embedded Qwen2 model; `dtype` is its weights' (and so its KV's) dtype."""

    name: str
    num_hidden_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    description: str = ""
    dtype: str = "float32"  # or "bfloat16": the common KV dtype of real models
    bits: int | None = None  # quantized weights: bits per weight (mlx_lm.convert -q --q-bits); None: float
    quantized_from: str | None = None  # the float preset quantized (same shape and seed)
    tool_calling: bool = False  # answers every chat request with one tool call (kvtool.models.tool_preset)

    @property
    def head_dim(self) -> int:
        """Per-head dimension (hidden_size // num_attention_heads)."""
        return self.hidden_size // self.num_attention_heads

    def num_params(self, vocab_size: int) -> int:
        """Parameter count of the model (untied embedding and lm_head of `vocab_size` rows each)."""
        h, kv = self.hidden_size, self.num_key_value_heads * self.head_dim
        attn = 2 * (h * h + h) + 2 * (h * kv + kv) - h  # q, k, v with biases; o without
        layer = attn + 3 * h * self.intermediate_size + 2 * h
        return 2 * vocab_size * h + self.num_hidden_layers * layer + h

    def kv_bytes_per_token(self, dtype_bytes: int = 4) -> int:
        """KV-cache bytes per token over all layers (keys + values), at `dtype_bytes` per element."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * dtype_bytes


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset("tiny", 2, 128, 4, 2, 384, "default: tests and demos"),
        Preset("small", 4, 256, 4, 2, 768, "quick benchmarks"),
        Preset("base", 8, 512, 8, 2, 1536, "benchmarks with a heavier prefill"),
        Preset("qwen0.5b", 24, 896, 14, 2, 4864, "Qwen2.5-0.5B layer shapes (small vocab), ~1.4 GB"),
        Preset("tiny-bf16", 2, 128, 4, 2, 384, "tiny in bfloat16 (bf16 KV, as most real models)", "bfloat16"),
        Preset("qwen0.5b-bf16", 24, 896, 14, 2, 4864, "qwen0.5b in bfloat16, ~0.7 GB", "bfloat16"),
        Preset("tiny-4bit", 2, 128, 4, 2, 384, "tiny quantized as mlx_lm.convert -q (4-bit, group 64)",
               bits=4, quantized_from="tiny"),
        Preset("tiny-8bit", 2, 128, 4, 2, 384, "tiny quantized as mlx_lm.convert -q --q-bits 8",
               bits=8, quantized_from="tiny"),
        Preset("tiny-tools", 2, 128, 4, 2, 384, "tiny with a tool-aware template; always calls get_weather",
               tool_calling=True),
    )
}


class UnknownPresetError(ValueError):
    """The name is not one of `PRESETS`."""


def is_preset(name: str) -> bool:
    """Return True if `name` is an embedded preset name."""
    return name in PRESETS


def get_preset(name: str) -> Preset:
    """Return the preset called `name`.

    Raises:
        UnknownPresetError: If `name` is not in `PRESETS`.
    """
    try:
        return PRESETS[name]
    except KeyError:
        choices = ", ".join(PRESETS)
        raise UnknownPresetError(f"unknown model preset {name!r} (choose from: {choices})") from None


def models_root() -> Path:
    """Directory holding the built presets: `$KVTOOL_MODELS_DIR` or `~/.cache/kvtool-models`."""
    env = os.environ.get(ENV_MODELS_DIR)
    return Path(env).expanduser() if env else DEFAULT_MODELS_DIR.expanduser()


def is_built(name: str) -> bool:
    """Return True if preset `name` has a complete directory (config.json is written last)."""
    return (model_dir(name, build=False) / "config.json").is_file()


def model_dir(name: str = DEFAULT_PRESET, build: bool = True) -> Path:
    """The mlx-lm model directory of preset `name`, `<models_root()>/<name>-v1`, built first if it
    is not complete (`build` False: only the path, which may not exist).

    Raises:
        UnknownPresetError: If `name` is not a preset.
        OSError: If the directory cannot be written.
    """
    preset = get_preset(name)
    path = models_root() / f"{preset.name}-{INIT_VERSION}"
    if build and not (path / "config.json").is_file():
        build_preset(preset, path)
    return path


def build_preset(preset: Preset, dest: Path, seed: int = DEFAULT_SEED) -> Path:
    """Write `preset` (weights drawn from `seed`) into `dest`, which must not exist or be a complete
    model directory, atomically: a temp dir in the same parent, then a rename. Safe when several
    processes build at once: the first rename wins, the others discard their temp directory and
    use the winner's. Returns `dest`.

    Raises:
        OSError: If writing fails (the temp directory is removed).
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the finished model is a shared cache entry
    try:
        write_model_files(preset, tmp, seed)
        try:
            os.rename(tmp, dest)
        except OSError:
            if not (dest / "config.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


def write_model_files(preset: Preset, out: Path, seed: int = DEFAULT_SEED) -> None:
    """Write weights, tokenizer files and (last) config.json into the existing directory `out`
    (a quantized preset: `write_quantized_files`).

    Raises:
        OSError: If a file cannot be written.
    """
    import mlx.core as mx

    if preset.quantized_from is not None:
        write_quantized_files(preset, out, seed)
        return
    write_tokenizer_files(preset, out)
    vocab = tokenizer_vocab(out)
    weights = init_weights(preset, len(vocab), seed, [vocab[t] for t in SPECIAL_TOKENS])
    if preset.tool_calling:
        weights = tool_preset.successor_weights(weights, tool_preset.call_chain(out / "tokenizer.json"))
    if preset.dtype != "float32":  # the same float32 draw, rounded: bf16 presets shadow their f32 twin
        weights = {k: v.astype(getattr(mx, preset.dtype)) for k, v in weights.items()}
    mx.save_safetensors(str(out / WEIGHTS_FILE), weights, metadata={"format": "mlx"})
    specials = {
        "eos_token": EOS_TOKENS[0],
        "pad_token": "<|endoftext|>",
        "additional_special_tokens": list(SPECIAL_TOKENS[1:]),
    }
    _write_json(out / "special_tokens_map.json", specials)
    _write_json(out / "config.json", model_config(preset, vocab, seed))
    _fsync_dir(out)


def write_quantized_files(preset: Preset, out: Path, seed: int = DEFAULT_SEED) -> None:
    """Write the quantized preset `preset` into the existing directory `out`: its float twin
    (`preset.quantized_from`, same seed) built in a scratch directory, then converted by
    `mlx_lm.convert.convert(..., quantize=True, q_bits=preset.bits)` (default group size 64,
    affine mode: what `mlx_lm.convert -q` writes), config.json moved in last and named after
    `preset`. The converter's progress messages are kept off stdout.

    Raises:
        OSError: If a file cannot be written.
        ValueError: If `preset` is not a quantized preset.
    """
    from mlx_lm.convert import convert

    if preset.quantized_from is None or preset.bits is None:
        raise ValueError(f"preset {preset.name!r} is not quantized")
    scratch = Path(tempfile.mkdtemp(prefix=".convert.", dir=out))
    try:
        (scratch / "float").mkdir()
        write_model_files(get_preset(preset.quantized_from), scratch / "float", seed)
        with contextlib.redirect_stdout(io.StringIO()):
            convert(str(scratch / "float"), str(scratch / "q"), quantize=True, q_bits=preset.bits)
        for child in sorted((scratch / "q").iterdir(), key=lambda p: p.name == "config.json"):
            if child.name == "config.json":
                config = json.loads(child.read_text(encoding="utf-8"))
                _write_json(out / "config.json", {**config, "kvtool_preset": preset.name})
            else:
                os.replace(child, out / child.name)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    _fsync_dir(out)


def write_tokenizer_files(preset: Preset, out: Path) -> None:
    """Write the tokenizer files of float preset `preset` into `out`: the shipped ones
    (`TOKENIZER_ASSETS`), or for a tool-calling preset those plus its tool-call tokens and chat
    template (`tool_preset.write_tokenizer`)."""
    if preset.tool_calling:
        tool_preset.write_tokenizer(ASSETS_DIR, out)
        return
    for fname in TOKENIZER_ASSETS:
        shutil.copyfile(ASSETS_DIR / fname, out / fname)


def tokenizer_vocab(model_path: Path = ASSETS_DIR) -> dict[str, int]:
    """Return the vocabulary (added tokens included), token -> id, of the tokenizer.json in
    `model_path`: by default the shipped tokenizer's."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(model_path / "tokenizer.json")).get_vocab(with_added_tokens=True)


def vocab_size(preset: Preset) -> int:
    """Rows of `preset`'s embedding and lm_head: the shipped vocabulary, plus the tool-call tokens
    of a tool-calling preset."""
    return len(tokenizer_vocab()) + (len(tool_preset.ADDED_TOKENS) if preset.tool_calling else 0)


def model_config(preset: Preset, vocab: dict[str, int], seed: int = DEFAULT_SEED) -> dict:
    """The Hugging Face style config.json document of `preset` (`model_type: qwen2`); `vocab`
    (token -> id) must contain `SPECIAL_TOKENS`; `seed` is recorded as `kvtool_seed`."""
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_act": "silu",
        "hidden_size": preset.hidden_size,
        "intermediate_size": preset.intermediate_size,
        "num_hidden_layers": preset.num_hidden_layers,
        "num_attention_heads": preset.num_attention_heads,
        "num_key_value_heads": preset.num_key_value_heads,
        "max_position_embeddings": DEFAULT_MAX_POSITIONS,
        "rms_norm_eps": DEFAULT_RMS_NORM_EPS,
        "rope_theta": DEFAULT_ROPE_THETA,
        "tie_word_embeddings": False,
        "torch_dtype": preset.dtype,
        "vocab_size": len(vocab),
        "eos_token_id": [vocab[t] for t in EOS_TOKENS],
        "pad_token_id": vocab["<|endoftext|>"],
        "kvtool_preset": preset.name,
        "kvtool_init_version": INIT_VERSION,
        "kvtool_seed": seed,
    }


def init_weights(preset: Preset, vocab_size: int, seed: int, silent_ids: list[int]) -> dict:
    """Deterministic float32 weights for `preset`, keyed like mlx-lm's qwen2 `Model`: name ->
    mx.array (e.g. `model.embed_tokens.weight` [vocab_size, hidden]); the lm_head rows of
    `silent_ids` are zero (never chosen greedily).

    Each tensor draws uniformly from its own key (seed + tensor name) on the CPU stream, so the
    bytes depend neither on module construction order nor on the device.
    """
    import mlx.core as mx

    weights = {}
    with mx.stream(mx.cpu):
        for name, shape in parameter_shapes(preset, vocab_size).items():
            weights[name] = _init_tensor(name, shape, seed)
        head = weights["lm_head.weight"]
        mask = mx.ones((vocab_size, 1), dtype=mx.float32)
        mask[mx.array(silent_ids)] = 0.0
        weights["lm_head.weight"] = head * mask
        mx.eval(weights)
    return weights


def parameter_shapes(preset: Preset, vocab_size: int) -> dict[str, tuple[int, ...]]:
    """Return name -> shape of every parameter of mlx-lm's qwen2 `Model` for `preset`, sorted."""
    from mlx.utils import tree_flatten
    from mlx_lm.models import qwen2

    args = qwen2.ModelArgs(
        model_type="qwen2",
        hidden_size=preset.hidden_size,
        num_hidden_layers=preset.num_hidden_layers,
        intermediate_size=preset.intermediate_size,
        num_attention_heads=preset.num_attention_heads,
        rms_norm_eps=DEFAULT_RMS_NORM_EPS,
        vocab_size=vocab_size,
        num_key_value_heads=preset.num_key_value_heads,
        tie_word_embeddings=False,
    )
    model = qwen2.Model(args)  # parameters are lazy: only shapes are used, nothing is computed
    flat = tree_flatten(model.parameters())
    assert isinstance(flat, list)  # (name, array) pairs: a dict only with a dict `destination`
    return {name: tuple(p.shape) for name, p in sorted(flat)}


def _init_tensor(name: str, shape: tuple[int, ...], seed: int):
    """Return one float32 tensor: ones for norms, zeros for biases, scaled uniform otherwise."""
    import mlx.core as mx

    if name.endswith("norm.weight"):
        return mx.ones(shape, dtype=mx.float32)
    if name.endswith(".bias"):
        return mx.zeros(shape, dtype=mx.float32)
    std = _std(name, shape)
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    key = mx.random.key(int.from_bytes(digest, "little") >> 1)
    # uniform(-1, 1) has std 1/sqrt(3).
    return mx.random.uniform(-1.0, 1.0, shape, dtype=mx.float32, key=key) * (std * math.sqrt(3.0))


def _std(name: str, shape: tuple[int, ...]) -> float:
    """Standard deviation of weight `name` (shape [out, in] for linears)."""
    if name.endswith("embed_tokens.weight"):
        return EMBED_STD
    gain = next(g for part, g in GAINS.items() if f"{part}." in name)
    return gain / math.sqrt(shape[-1])


def _write_json(path: Path, doc: dict) -> None:
    """Write `doc` as indented JSON (`_fsync_dir` syncs it)."""
    path.write_text(json.dumps(doc, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _fsync_dir(path: Path) -> None:
    """fsync every file in `path` and the directory itself (best effort on exotic file systems)."""
    for child in path.iterdir():
        with open(child, "rb") as fh:
            os.fsync(fh.fileno())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
