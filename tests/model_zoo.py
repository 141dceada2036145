"""A test-time model zoo: tiny random-weight mlx-lm models of several families.

Each family is written once per test session as an ordinary local mlx-lm model directory
(config.json + model.safetensors + the tokenizer files of kvtool's embedded `tiny` preset), so
`mlx_lm.load(path)` and `kvtool.models.loader.load_model(path)` load it unchanged. Weights are
initialised as the embedded presets' (`kvtool.models.embedded`): deterministic per tensor name,
untied lm_head, sharp attention (q/k gain 2), strong residual branches, lm_head rows of the
special tokens zeroed (greedy decoding never stops early), so the output depends on the context
and any wrong KV changes it.

Families and the mlx-lm cache types they exercise:

| family | cache layers |
|---|---|
| llama | KVCache |
| qwen3 | KVCache (q/k norms) |
| gemma3_text | RotatingKVCache (sliding layers) + KVCache (global layer) |
| mistral_swa | llama code with `sliding_window` layers: RotatingKVCache + KVCache |
| phi3 | KVCache (fused qkv) |
| deepseek_v2 | KVCache with K head dim != V head dim (MLA) |
| openelm | KVCache with per-layer KV head counts |
| lfm2 | ArraysCache (short conv) + KVCache (attention layers): a hybrid |
| mamba | ArraysCache only (SSM) |
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from pathlib import Path

VOCAB_PAD = 0  # the vocab is exactly the tiny tokenizer's

# family -> config.json (vocab_size and the common fields are added by `_config`)
FAMILIES: dict[str, dict] = {
    "llama": {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"],
        "hidden_size": 128, "num_hidden_layers": 2, "intermediate_size": 256,
        "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "tie_word_embeddings": False,
    },
    "qwen3": {
        "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"],
        "hidden_size": 128, "num_hidden_layers": 2, "intermediate_size": 256,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096, "rope_theta": 1_000_000.0, "tie_word_embeddings": False,
    },
    "gemma3_text": {
        "model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"],
        "hidden_size": 128, "num_hidden_layers": 3, "intermediate_size": 256,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "rms_norm_eps": 1e-6,
        "query_pre_attn_scalar": 32, "sliding_window": 96, "sliding_window_pattern": 3,
        "max_position_embeddings": 4096,
    },
    "mistral_swa": {
        "model_type": "mistral", "architectures": ["MistralForCausalLM"],
        "hidden_size": 128, "num_hidden_layers": 2, "intermediate_size": 256,
        "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "tie_word_embeddings": False, "sliding_window": 96,
        "layer_types": ["sliding_attention", "full_attention"],
    },
    "phi3": {
        "model_type": "phi3", "architectures": ["Phi3ForCausalLM"],
        "hidden_size": 128, "num_hidden_layers": 2, "intermediate_size": 256,
        "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "tie_word_embeddings": False, "max_position_embeddings": 4096,
        "original_max_position_embeddings": 4096,
    },
    "deepseek_v2": {
        "model_type": "deepseek_v2", "architectures": ["DeepseekV2ForCausalLM"],
        "hidden_size": 128, "num_hidden_layers": 2, "intermediate_size": 256,
        "moe_intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 4,
        "n_shared_experts": 1, "n_routed_experts": 4, "num_experts_per_tok": 2,
        "first_k_dense_replace": 1, "moe_layer_freq": 1, "kv_lora_rank": 32, "q_lora_rank": None,
        "qk_rope_head_dim": 16, "v_head_dim": 32, "qk_nope_head_dim": 48, "topk_method": "greedy",
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 4096,
        "rope_scaling": {"type": "yarn", "factor": 1.0, "original_max_position_embeddings": 4096,
                         "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0},
    },
    "openelm": {
        "model_type": "openelm", "architectures": ["OpenELMForCausalLM"],
        "head_dim": 32, "num_transformer_layers": 3, "model_dim": 128, "ffn_dim_divisor": 32,
        "num_query_heads": [4, 4, 4], "num_kv_heads": [1, 2, 4], "ffn_multipliers": [1.0, 1.5, 2.0],
        "ffn_with_glu": True, "normalize_qk_projections": True, "share_input_output_layers": False,
        "rms_norm_eps": 1e-6, "rope_freq_constant": 10000,
    },
    "lfm2": {
        "model_type": "lfm2", "architectures": ["Lfm2ForCausalLM"],
        "hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 4096, "norm_eps": 1e-5, "conv_bias": False, "conv_L_cache": 3,
        "block_dim": 128, "block_ff_dim": 256, "block_multiple_of": 32, "block_ffn_dim_multiplier": 1.0,
        "block_auto_adjust_ff_dim": False, "full_attn_idxs": [1, 3], "rope_theta": 1_000_000.0,
        "tie_word_embeddings": False,
    },
    "mamba": {
        "model_type": "mamba", "architectures": ["MambaForCausalLM"],
        "hidden_size": 64, "intermediate_size": 128, "state_size": 8, "num_hidden_layers": 2,
        "conv_kernel": 4, "use_bias": False, "use_conv_bias": True, "time_step_rank": 8,
        "tie_word_embeddings": False,
    },
}

SEED = 0x7A6F  # "zo"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def _config(family: str, vocab: dict[str, int]) -> dict:
    from kvtool.models import embedded

    cfg = dict(FAMILIES[family])
    cfg.update({
        "vocab_size": len(vocab) + VOCAB_PAD,
        "torch_dtype": "float32",
        "eos_token_id": [vocab[t] for t in embedded.EOS_TOKENS],
        "pad_token_id": vocab["<|endoftext|>"],
        "bos_token_id": vocab["<|endoftext|>"],
        "kvtool_zoo_family": family,
    })  # fmt: skip
    return cfg


def _gain(name: str) -> float:
    """Init gain of a weight by its name (as `kvtool.models.embedded._std`)."""
    for part, g in (("q_proj", 2.0), ("k_proj", 2.0), ("qkv_proj", 2.0), ("q_b_proj", 2.0), ("q_a_proj", 2.0),
                    ("kv_a_proj", 2.0), ("kv_b_proj", 2.0), ("o_proj", 2.0), ("out_proj", 2.0)):
        if f"{part}." in name:
            return g
    return 1.0


def _init(name: str, shape: tuple[int, ...], seed: int, family: str = ""):
    import mlx.core as mx

    if family.startswith("gemma") and "norm" in name:  # gemma's RMSNorm scales by 1 + weight
        return mx.zeros(shape, dtype=mx.float32)
    if "norm" in name and name.endswith(".weight") and len(shape) == 1:
        return mx.ones(shape, dtype=mx.float32)
    if name.endswith(".bias") and "dt_proj" not in name:
        return mx.zeros(shape, dtype=mx.float32)
    if name.endswith("A_log"):  # mamba: A = -exp(A_log) = -(1..N), the usual S4D-real init
        n = shape[-1]
        return mx.broadcast_to(mx.log(mx.arange(1, n + 1, dtype=mx.float32)), shape)
    if name.endswith(".D") or name == "D":
        return mx.ones(shape, dtype=mx.float32)
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    key = mx.random.key(int.from_bytes(digest, "little") >> 1)
    if "embed" in name:
        # gemma scales embeddings by sqrt(hidden); lfm2 ties them to the lm_head: keep both at std 1
        std = 1.0 / math.sqrt(shape[-1]) if family.startswith(("gemma", "lfm2")) else 1.0
    elif name.endswith("dt_proj.bias"):  # softplus^-1 of dt in [1e-3, 1e-1]
        dt = mx.exp(mx.random.uniform(math.log(1e-3), math.log(1e-1), shape, key=key))
        return dt + mx.log(-mx.expm1(-dt))
    else:
        fan_in = shape[-1] if len(shape) > 1 else shape[0]
        if "conv" in name and len(shape) == 3:
            fan_in = shape[1] * shape[2]
        std = _gain(name) / math.sqrt(fan_in)
    return mx.random.uniform(-1.0, 1.0, shape, dtype=mx.float32, key=key) * (std * math.sqrt(3.0))


def build_family(family: str, dest: Path, seed: int = SEED) -> Path:
    """Write the model directory of `family` into `dest` (created; must not exist)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes as get_model_classes

    from kvtool.models import embedded

    vocab = embedded.tokenizer_vocab()
    cfg = _config(family, vocab)
    model_cls, args_cls = get_model_classes(cfg)
    model = model_cls(args_cls.from_dict(cfg))
    silent = [vocab[t] for t in embedded.SPECIAL_TOKENS]
    weights = {}
    with mx.stream(mx.cpu):
        for name, p in sorted(tree_flatten(model.parameters())):
            weights[name] = _init(name, tuple(p.shape), seed, family).astype(p.dtype)
        for name in list(weights):
            if name.endswith("lm_head.weight"):
                mask = mx.ones((weights[name].shape[0], 1), dtype=mx.float32)
                mask[mx.array(silent)] = 0.0
                weights[name] = weights[name] * mask
        mx.eval(weights)
    dest.mkdir(parents=True)
    mx.save_safetensors(str(dest / "model.safetensors"), weights, metadata={"format": "mlx"})
    src = embedded.model_dir("tiny")
    for f in TOKENIZER_FILES:
        if (src / f).exists():
            shutil.copyfile(src / f, dest / f)
    (dest / "config.json").write_text(json.dumps(cfg, indent=2))
    return dest


def build_zoo(root: Path, families=None) -> dict[str, Path]:
    """Build every family (or `families`) under `root`; returns family -> model directory."""
    out = {}
    for fam in families or FAMILIES:
        d = root / fam
        if not (d / "config.json").exists():
            build_family(fam, d)
        out[fam] = d
    return out
