"""Train the embedded byte-level BPE tokenizer (run once; its outputs are committed).

The corpus is the public-domain help text shipped with CPython (`pydoc_data.topics`), so the
tokenizer can be rebuilt on any machine without a network. The pipeline mirrors what
transformers >= 5 rebuilds for `model_type: qwen2` (`Qwen2Tokenizer`): NFC normalizer, Qwen2's
split regex, byte-level mapping without prefix space. Training with the same pipeline keeps the
ids of `tokenizers.Tokenizer.from_file` and of mlx-lm's loader identical.

Outputs (in `kvtool/assets/`):
    tokenizer.json          the trained tokenizer
    tokenizer_config.json   Qwen2Tokenizer config with a ChatML chat template, no BOS
    demo_prompt.txt         ~2,000 tokens of English prose for `make demo`

Usage:
    .venv/bin/python scripts/train_tokenizer.py [--out kvtool/assets]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from pydoc_data import topics as pydoc_topics

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

DEFAULT_VOCAB_SIZE = 4096
DEFAULT_OUT_DIR = Path(__file__).resolve().parent.parent / "kvtool" / "assets"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
# Copied from transformers' Qwen2Tokenizer (PRETOKENIZE_REGEX); must stay identical.
QWEN2_SPLIT_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
# Qwen2's ChatML template, without its tool-calling branches and default system prompt.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Prose-heavy topics concatenated (in this order) into the demo prompt.
DEMO_TOPICS = ("execmodel", "import")
DEFAULT_DEMO_TARGET_TOKENS = 2000
DEFAULT_DEMO_MIN_TOKENS = 1500
DEFAULT_DEMO_MAX_TOKENS = 2500


def corpus() -> list[str]:
    """Return the training texts: every `pydoc_data.topics` entry, sorted by topic name."""
    return [pydoc_topics.topics[name] for name in sorted(pydoc_topics.topics)]


def build_tokenizer() -> Tokenizer:
    """Return an untrained BPE tokenizer with Qwen2's normalizer, pre-tokenizer and decoder."""
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def train(vocab_size: int = DEFAULT_VOCAB_SIZE) -> Tokenizer:
    """Train the tokenizer on `corpus()`.

    Args:
        vocab_size: Total vocabulary size, special tokens included.

    Returns:
        The trained `tokenizers.Tokenizer`; special tokens get ids 0..2 in `SPECIAL_TOKENS` order.
    """
    tok = build_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    return tok


def tokenizer_config(tok: Tokenizer) -> dict:
    """Return the `tokenizer_config.json` document for the trained tokenizer."""
    added = {
        str(tok.token_to_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    return {
        "tokenizer_class": "Qwen2Tokenizer",
        "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "add_bos_token": False,
        "add_prefix_space": False,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "model_max_length": 32768,
        "split_special_tokens": False,
    }


def demo_prompt(tok: Tokenizer) -> str:
    """Concatenate `DEMO_TOPICS` paragraphs until about `DEFAULT_DEMO_TARGET_TOKENS` tokens.

    Stops after the first paragraph that reaches the target and does not end with ":" (so the
    text does not end by announcing a code sample).

    Raises:
        RuntimeError: If the result falls outside [DEFAULT_DEMO_MIN_TOKENS, DEFAULT_DEMO_MAX_TOKENS].
    """
    paragraphs = [p.strip() for name in DEMO_TOPICS for p in pydoc_topics.topics[name].split("\n\n")]
    text = ""
    for para in (p for p in paragraphs if p):
        text = f"{text}\n\n{para}" if text else para
        if len(tok.encode(text).ids) >= DEFAULT_DEMO_TARGET_TOKENS and not para.endswith(":"):
            break
    n = len(tok.encode(text).ids)
    if not DEFAULT_DEMO_MIN_TOKENS <= n <= DEFAULT_DEMO_MAX_TOKENS:
        raise RuntimeError(f"demo prompt has {n} tokens, outside the wanted range")
    return text + "\n"


def main() -> None:
    """Train, then write the three asset files."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT_DIR, help="output directory")
    parser.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    tok = train(args.vocab_size)
    tok.save(str(args.out / "tokenizer.json"))
    config = json.dumps(tokenizer_config(tok), indent=2, ensure_ascii=False) + "\n"
    (args.out / "tokenizer_config.json").write_text(config, encoding="utf-8")
    demo = demo_prompt(tok)
    (args.out / "demo_prompt.txt").write_text(demo, encoding="utf-8")
    print(f"vocab={tok.get_vocab_size()} demo_tokens={len(tok.encode(demo).ids)} -> {args.out}")


if __name__ == "__main__":
    main()
