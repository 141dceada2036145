"""Mooncake traces replayed against real servers: the requests of `[serve_load]`'s `trace` workload
when its file is a Mooncake trace (`kvtool.bench.trace`: `timestamp` ms, `input_length`,
`output_length`, `hash_ids` of 512-token blocks), and the window every trace workload can take.

A trace has no text, only block ids; equal ids mean an equal prefix (each id is a chain hash). Each
id becomes a fixed block of `block_tokens` tokens (`BlockText`): words drawn by
`numpy.random.default_rng(id)` from the tokenizer's single-token words (`single_token_words`). A
byte-level BPE whose pre-tokenizer splits before a space and letters (GPT-2, Llama 3, Qwen2) never
merges two such words, so a block's text is the same tokens wherever it stands and a block
boundary merges nothing; `BlockText.prompt` checks this on every prompt and raises when a
tokenizer does not keep it. A request is its blocks cut to `scaled_tokens` (the block count and
the sharing structure kept, every length scaled by `block_tokens / 512`), sent as one user
message; it generates `output_tokens`.

The window (both trace formats): requests sorted by time, those in the index and time window of
`window_indices` kept; for a Mooncake trace `shared_prefix_blocks` > 0 then keeps only the
conversations with more than one turn in the window (`shared_prefix`); then the first `requests`
(0: all). Arrival times are divided by `speedup`, and count from the first request kept when the
window starts later than the trace (`start` or `start_s` set).
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from kvtool.bench.loadgen import LoadRequest
from kvtool.bench.trace import TRACE_BLOCK_TOKENS, TraceError, TraceRequest, read_trace
from kvtool.config import ConfigError

FIELD = "serve_load.workloads.trace"
TRACE_FORMATS = ("auto", "prompts", "mooncake")
# window and scaling parameters of the `trace` workload, with their defaults
TRACE_REPLAY_DEFAULTS: dict[str, Any] = {
    "format": "auto", "speedup": 1.0, "start": 0, "end": 0, "start_s": 0.0, "end_s": 0.0, "requests": 0,
    "block_tokens": TRACE_BLOCK_TOKENS, "output_scale": 1.0, "max_output_tokens": 0, "shared_prefix_blocks": 0,
}
MOONCAKE_ONLY = ("block_tokens", "output_scale", "max_output_tokens", "shared_prefix_blocks")
MIN_WORDS = 64  # fewer single-token words than this: the tokenizer cannot make varied blocks


def trace_format(path: Path, declared: str) -> str:
    """`prompts` or `mooncake`: `declared`, or for `auto` what the first non-blank line holds (a
    `hash_ids` field: Mooncake).

    Raises:
        ConfigError: the file cannot be read or its first line is not a JSON object.
    """
    if declared != "auto":
        return declared
    try:
        with open(path, encoding="utf-8") as fh:
            first = next((line for line in fh if line.strip()), "")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{FIELD}.path", f"cannot read trace {path}: {exc}") from None
    try:
        doc = json.loads(first) if first else {}
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{FIELD}.path", f"{path}:1: invalid JSON: {exc.msg}") from None
    return "mooncake" if isinstance(doc, dict) and "hash_ids" in doc else "prompts"


def single_token_words(tokenizer: Any) -> list[tuple[str, int]]:
    """The tokenizer's words that are one token with their leading space: `(" word", id)` in
    token-id order, for every id whose decoded text is a space and >= 2 ASCII letters and which
    encodes back to exactly that id.

    Raises:
        ConfigError: fewer than `MIN_WORDS` such words.
    """
    words = []
    for i in range(len(tokenizer.get_vocab()) if hasattr(tokenizer, "get_vocab") else tokenizer.vocab_size):
        text = tokenizer.decode([i])
        body = text[1:]
        if text.startswith(" ") and len(body) >= 2 and body.isascii() and body.isalpha() and _encode(tokenizer, text) == [i]:
            words.append((text, i))
    if len(words) < MIN_WORDS:
        raise ConfigError(f"{FIELD}.path", f"the model's tokenizer has {len(words)} single-token words, "
                                           f"{MIN_WORDS} are needed to turn a Mooncake trace's block ids into text")
    return words


def _encode(tokenizer: Any, text: str) -> list[int]:
    try:
        return list(tokenizer.encode(text, add_special_tokens=False))
    except TypeError:  # a tokenizer without the keyword
        return list(tokenizer.encode(text))


class BlockText:
    """The fixed text of a trace's block ids, `block_tokens` tokens each.

    Args:
        tokenizer: the model's tokenizer (`encode`, `decode`, `get_vocab`).
        block_tokens: tokens per block id (512 in the trace; fewer scales every prompt down).
    """

    def __init__(self, tokenizer: Any, block_tokens: int = TRACE_BLOCK_TOKENS):
        self.tokenizer, self.block_tokens = tokenizer, block_tokens
        words = single_token_words(tokenizer)
        self.texts = [w for w, _ in words]
        self.ids = np.array([i for _, i in words], dtype=np.int64)
        self._blocks: dict[int, np.ndarray] = {}

    def block(self, hash_id: int) -> np.ndarray:
        """Indices into the word list of block `hash_id` (int64, shape (block_tokens,)): the same
        for the same id, from `numpy.random.default_rng(hash_id)`."""
        found = self._blocks.get(hash_id)
        if found is None:
            found = self._blocks[hash_id] = np.random.default_rng(hash_id).integers(0, len(self.texts), self.block_tokens)
        return found

    def prompt(self, hash_ids: Sequence[int], n_tokens: int) -> tuple[str, np.ndarray]:
        """The text of the first `n_tokens` tokens of the blocks `hash_ids`, and its token ids
        (int64, shape (n_tokens,)).

        Raises:
            ValueError: `n_tokens` is not in 1 .. len(hash_ids) x block_tokens, or the tokenizer
                does not encode the text back to those ids (it merges across words).
        """
        if not 1 <= n_tokens <= len(hash_ids) * self.block_tokens:
            raise ValueError(f"{n_tokens} tokens asked of {len(hash_ids)} blocks of {self.block_tokens}")
        words = np.concatenate([self.block(h) for h in hash_ids])[:n_tokens]
        text = "".join(self.texts[w] for w in words.tolist())
        ids = self.ids[words]
        if _encode(self.tokenizer, text) != ids.tolist():
            raise ValueError("the tokenizer does not encode the block text word by word (it merges across words)")
        return text, ids


def scaled_tokens(input_length: int, block_tokens: int) -> int:
    """Prompt tokens of a trace request at `block_tokens` per block: `ceil(input_length x
    block_tokens / 512)` (tokens; the block count stays `ceil(input_length / 512)`)."""
    return max(1, math.ceil(input_length * block_tokens / TRACE_BLOCK_TOKENS))


def output_tokens(output_length: int, scale: float, cap: int) -> int:
    """Tokens to generate: `max(1, round(output_length x scale))`, at most `cap` (0: no cap)."""
    n = max(1, round(output_length * scale))
    return min(n, cap) if cap else n


def mooncake_requests(path: Path, params: dict[str, Any], tokenizer: Any) -> list[LoadRequest]:
    """The requests of a Mooncake trace file, windowed and scaled by `params` (see the module
    docstring); keys `r<i>` (`i`: the request's index in the file), phase `trace`, `arrival_s`
    in seconds (`speedup` applied).

    Raises:
        ConfigError: the trace cannot be read or is malformed, the window is empty, or the
            tokenizer cannot make stable block text.
    """
    try:
        trace = read_trace(path)
    except TraceError as exc:
        raise ConfigError(f"{FIELD}.path", str(exc)) from None
    order = sorted(range(len(trace)), key=lambda i: trace[i].timestamp_ms)
    kept = window_indices([trace[i].timestamp_ms / 1000 for i in order], params, skip_cap=True)
    chosen = [(order[k], trace[order[k]]) for k in kept]
    if params["shared_prefix_blocks"]:
        chosen = shared_prefix(chosen, params["shared_prefix_blocks"])
    if params["requests"]:
        chosen = chosen[: params["requests"]]
    if not chosen:
        raise ConfigError(FIELD, f"{path}: no request in the window")
    text = BlockText(tokenizer, params["block_tokens"])
    t0 = chosen[0][1].timestamp_ms if params["start"] or params["start_s"] else 0
    out = []
    for i, r in chosen:
        try:
            prompt, _ = text.prompt(r.hash_ids, scaled_tokens(r.input_length, params["block_tokens"]))
        except ValueError as exc:
            raise ConfigError(f"{FIELD}.path", f"{path}, request {i}: {exc}") from None
        out.append(LoadRequest(f"r{i}", ({"role": "user", "content": prompt},),
                               output_tokens(r.output_length, params["output_scale"], params["max_output_tokens"]),
                               "trace", f"r{i}", None, (r.timestamp_ms - t0) / 1000 / params["speedup"]))
    return out


def shared_prefix(chosen: list[tuple[int, TraceRequest]], blocks: int) -> list[tuple[int, TraceRequest]]:
    """The requests whose first `blocks` ids are also the first ids of another request of `chosen`."""
    heads = Counter(r.hash_ids[:blocks] for _, r in chosen if len(r.hash_ids) >= blocks)
    return [(i, r) for i, r in chosen if len(r.hash_ids) >= blocks and heads[r.hash_ids[:blocks]] >= 2]


def window_indices(times_s: Sequence[float], params: dict[str, Any], skip_cap: bool = False) -> list[int]:
    """Positions of `times_s` (seconds, ascending) in the window of `params`: index in [`start`,
    `end`), time in [`start_s`, `end_s`) (0 ends: to the end), then the first `requests` (0: all;
    not applied with `skip_cap`)."""
    end = params["end"] or len(times_s)
    end_s = params["end_s"] or math.inf
    out = [k for k in range(params["start"], min(end, len(times_s))) if params["start_s"] <= times_s[k] < end_s]
    return out if skip_cap or not params["requests"] else out[: params["requests"]]


def window_prompts(requests: list[LoadRequest], params: dict[str, Any]) -> list[LoadRequest]:
    """A prompt trace's requests (sorted by `arrival_s`) in the window of `params`, arrivals
    divided by `speedup` (from the first one kept when the window starts later than the trace).

    Raises:
        ConfigError: the window is empty.
    """
    kept = [requests[k] for k in window_indices([r.arrival_s or 0.0 for r in requests], params)]
    if not kept:
        raise ConfigError(FIELD, "no request in the window")
    t0 = (kept[0].arrival_s or 0.0) if params["start"] or params["start_s"] else 0.0
    return [replace(r, arrival_s=((r.arrival_s or 0.0) - t0) / params["speedup"]) for r in kept]


__all__ = ["MOONCAKE_ONLY", "TRACE_FORMATS", "TRACE_REPLAY_DEFAULTS", "BlockText", "mooncake_requests",
           "output_tokens", "scaled_tokens", "shared_prefix", "single_token_words", "trace_format", "window_indices",
           "window_prompts"]
