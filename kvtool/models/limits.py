"""How much work one request may ask of a model: the limits `kvtool serve` answers 413 / 400
over, and that `serve-once` and `warm` refuse with one `error:` line. Pure Python (no MLX).

    limits = token_limits(model_dir)                 # from the model's config.json
    limits.check_max_tokens(n)                       # TokenLimitError past the context length
    limits.check_prompt(len(ids), "request 0")       # TokenLimitError past max_prompt_tokens
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_CONTEXT_TOKENS = 32768  # context length assumed when the model's config does not give one
MAX_PROMPT_TOKENS_CAP = 32768  # default max_prompt_tokens: min(model context length, this)
MAX_SEED = (1 << 64) - 1  # mx.random.seed takes an unsigned 64-bit integer


class TokenLimitError(ValueError):
    """A request over a token limit (one-line message naming the limit and the option that sets it)."""


def model_context_length(config: dict[str, Any]) -> int | None:
    """The context length a Hugging Face `config.json` declares (tokens), or None."""
    for doc in (config, config.get("text_config") or {}):
        if not isinstance(doc, dict):
            continue
        for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "n_ctx",
                    "max_sequence_length"):
            value = doc.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def kv_bytes_per_token(model_dir: Path) -> int:
    """KV bytes of one token of a plain-attention model, from its Hugging Face `config.json` (its
    `text_config` where it has one): layers x KV heads x head dim x 2 (keys and values) x bytes per
    element of its `torch_dtype` (or `dtype`; bfloat16 where neither is given). Approximate for
    models with other cache layouts (sliding windows, state layers).

    Raises:
        OSError: config.json cannot be read.
        ValueError: it is not JSON, or a field the product needs is missing or not a number.
    """
    cfg = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    cfg = cfg.get("text_config", cfg) if isinstance(cfg, dict) else cfg
    try:
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
        width = _DTYPE_BYTES.get(str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"), 2)
        return int(cfg["num_hidden_layers"]) * kv_heads * head_dim * 2 * width
    except (KeyError, TypeError, AttributeError, ZeroDivisionError) as exc:
        raise ValueError(f"no KV geometry in {model_dir}/config.json ({exc!r})") from None


@dataclass(frozen=True)
class TokenLimits:
    """The token limits of one served model.

    Attributes:
        max_prompt_tokens: longest prompt (tokens, after the chat template).
        max_tokens_cap: largest `max_tokens` (tokens): the model's context length.
    """

    max_prompt_tokens: int
    max_tokens_cap: int

    def check_max_tokens(self, n: int, what: str = "--max-tokens") -> None:
        """Raises TokenLimitError: `n` (tokens to generate) is more than the context length."""
        if n > self.max_tokens_cap:
            raise TokenLimitError(f"{what} {n} is more than the model's context length ({self.max_tokens_cap} tokens)")

    def check_prompt(self, n: int, what: str = "the prompt") -> None:
        """Raises TokenLimitError: a prompt of `n` tokens is longer than `max_prompt_tokens`."""
        if n > self.max_prompt_tokens:
            raise TokenLimitError(f"{what} has {n} tokens, more than the limit of {self.max_prompt_tokens} "
                                  "(--max-prompt-tokens)")


def token_limits(model_dir: Path | str | None, max_prompt_tokens: int | None = None) -> TokenLimits:
    """The limits for the model in `model_dir` (its `config.json`; unreadable or None: the defaults).

    Args:
        model_dir: the model's local directory.
        max_prompt_tokens: the `--max-prompt-tokens` given, or None: the model's context length,
            at most `MAX_PROMPT_TOKENS_CAP`.
    """
    doc: Any = {}
    if model_dir is not None:
        try:
            doc = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            doc = {}
    context = model_context_length(doc if isinstance(doc, dict) else {}) or DEFAULT_CONTEXT_TOKENS
    if max_prompt_tokens is None:
        max_prompt_tokens = min(context, MAX_PROMPT_TOKENS_CAP)
    return TokenLimits(max_prompt_tokens=max_prompt_tokens, max_tokens_cap=context)


__all__ = ["TokenLimits", "TokenLimitError", "token_limits", "model_context_length", "DEFAULT_CONTEXT_TOKENS",
           "MAX_PROMPT_TOKENS_CAP", "MAX_SEED"]
