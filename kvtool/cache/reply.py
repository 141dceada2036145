"""Reply KV reuse: whether the KV mlx-lm's decode steps write may be stored as blocks, measured.

An agent's next turn re-sends the model's previous reply inside its prompt. The KV of the reply's
tokens was written by decode steps (one-token forwards after the prompt's prefill); storing it
saves the next turn that prefill, but kvtool's output must equal an uncached run, whose prefill
computes those tokens' KV inside a prefill chunk. On some backends the two differ in their last
bits (another attention kernel for one query, another matmul tiling), so whether a model's decode
KV equals its prefill KV is measured here, per model and backend, never assumed:

- *decode*: the probe prompt (`PROBE_TOKENS`) through mlx-lm's `generate_step` (its prefill, then
  `DECODE_STEPS` greedy one-token forwards), and the probe prompt
  alone and with three shorter ones through mlx-lm's `BatchGenerator` (what `mlx_lm.server`
  runs: batched prefill with left padding, the prompt's last token forwarded alone, batched
  decode; batches of 1 and 4), the caches taken as the server's final insert gets them
  (`extract_cache`);
- *prefill*: the tokens each cache holds (its `offset`), forwarded as one chunk into a fresh cache.

The keys and values of every position from the prompt's last token (the first one mlx-lm forwards
alone) to the cache's end must be equal bit for bit in every layer. Where the probe cannot
decide, the answer is no: sliding-window and state layers (kvtool prefills those models itself and
mlx-lm's cache after generation cannot be cut into blocks), quantized KV (where mlx-lm switches to
quantized KV depends on the sequence's length, so a reply's blocks have no canonical content), a
token forwarded alone that already differs (`PrefixCache.alone_exact`), a probe that raised.

The verdict is kept as the self-check's is (`ensure`: the namespace's index meta, key `META_KEY`),
with the MLX device it was measured on too. A reconfiguration does not measure (model forwards
while the generation thread runs): a verdict neither stored nor known to the process then means
no reuse until the next start.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, make_prompt_cache

from kvtool.cache.hit import CacheHit
from kvtool.cache.selfcheck import bits, code_digest, greedy
from kvtool.cache.verdict import StoredVerdict, read_meta_record, write_meta_record
from kvtool.kv.tree import kv_offset, leaves

log = logging.getLogger("kvtool")

META_KEY = "selfcheck_reply"  # namespace index meta key holding the verdict (JSON)
VERDICT_VERSION = 1
PROBE_TOKENS = 40  # the probe prompt
SHORT_TOKENS = (25, 33, 17)  # the shorter prompts batched with it (left padding in mlx-lm's batch cache)
DECODE_STEPS = 8  # greedy tokens decoded per probe prompt

RUNS = 0  # probes run by this process (tests count them)
_memo: dict[tuple[str, str, str], ReplyVerdict] = {}  # (model id, code digest, device) -> verdict, this process


@dataclass
class ReplyVerdict(StoredVerdict):
    """The reply probe's result for one namespace on one device (and `StoredVerdict`'s `reason`,
    `code`, `ms`, `checked`).

    Attributes:
        exact: decode-written KV equals prefill KV, bit for bit, at every compared position.
        device: the MLX default device it ran on (`device()`).
        decode_steps: greedy tokens decoded per probe prompt.
        version: `VERDICT_VERSION`.
    """

    exact: bool
    device: str
    decode_steps: int = DECODE_STEPS
    version: int = VERDICT_VERSION

    def describe(self) -> str:
        """One line for logs and stats."""
        how = f"{self.decode_steps} decode steps on {self.device}"
        if self.exact:
            return f"measured: decode KV is bit-identical to prefill KV ({how})"
        return f"measured: {self.reason} ({how})"


@dataclass(frozen=True)
class ReplyReuse:
    """Whether `kvtool serve` stores the KV of a finished request's generated tokens, and why."""

    enabled: bool
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"enabled": self.enabled, "reason": self.reason}


def device() -> str:
    """The MLX default device, e.g. `cpu:0`, or `gpu:0 applegpu_g15s` with the GPU's architecture
    where MLX reports it (KV rounding is per backend and kernel)."""
    name = str(mx.default_device()).removeprefix("Device(").removesuffix(")").replace(", ", ":")
    if name.startswith("gpu"):
        try:
            arch = mx.metal.device_info().get("architecture") if mx.metal.is_available() else None
        except Exception:  # noqa: BLE001 - no architecture: the device name alone
            arch = None
        name += f" {arch}" if arch else ""
    return name


def unmeasurable_reason(pc) -> str | None:
    """Why the probe cannot decide for an attached `PrefixCache` (then reuse is off), or None."""
    if pc.tiered is None:
        return pc.uncached_reason or "the cache is not attached"
    if pc.windows or pc.has_states or (pc.kv is not None and pc.kv.kinds):
        return ("sliding-window or state layers: kvtool prefills these models itself and mlx-lm's cache "
                "after generation cannot be cut into blocks")
    if pc.quant is not None:
        return ("quantized KV (--kv-bits): where mlx-lm switches to quantized KV depends on the sequence's "
                "length, so a reply's blocks have no canonical content (not measured)")
    if not pc.alone_exact:
        return "a token forwarded alone gets other KV than in a prefill chunk (measured at attach)"
    return None


def decide(pc, model, *, off_reason: str | None = None, measure: bool = True) -> ReplyReuse:
    """Whether `kvtool serve` may store reply KV for `pc`'s namespace: the config switch
    (`reply_cache`), `off_reason` (the caller's: e.g. speculative decoding), what the probe
    cannot decide (`unmeasurable_reason`), else the verdict (`ensure`; with `measure` False
    only a stored one or this process's, else no)."""
    if not pc.config.reply_cache:
        return ReplyReuse(False, "turned off (reply_cache = false)")
    reason = off_reason or ("the model is not known to the cache" if model is None else unmeasurable_reason(pc))
    if reason is not None:
        return ReplyReuse(False, reason)
    verdict = ensure(pc, model, measure=measure)
    if verdict is None:
        return ReplyReuse(False, "not measured for this model and device yet (measured at kvtool serve's start)")
    return ReplyReuse(verdict.exact, verdict.describe())


def stored_verdict(ssd) -> ReplyVerdict | None:
    """The reply verdict stored in an SSD namespace's index meta, or None (not measured)."""
    return read_meta_record(ssd, META_KEY, ReplyVerdict.from_json, "reply probe")


def ensure(pc, model, *, measure: bool = True) -> ReplyVerdict | None:
    """The reply verdict for `pc`'s model on this device: stored in its namespace (same code
    digest and device), this process's, or measured now (then stored); None if there is none and
    `measure` is False."""
    code, dev = code_digest(model), device()
    stored = stored_verdict(pc.ssd)
    if stored is not None and (stored.code, stored.device) == (code, dev):
        return stored
    key = (pc.model_id, code, dev)
    verdict = _memo.get(key)
    if verdict is None:
        if not measure:
            return None
        verdict = _memo[key] = run(model, code)
        log.info("kvtool: reply probe of %s (%.0f ms): %s", pc.model_name, verdict.ms, verdict.describe())
    write_meta_record(pc.ssd, META_KEY, verdict.to_json(), "reply probe")
    return verdict


# ----------------------------------------------------------------------------- the probe
def probe_ids(n: int, salt: int = 0) -> list[int]:
    """Deterministic probe token ids (3..99: valid in every vocabulary kvtool caches)."""
    return [3 + (7 * i + salt) % 97 for i in range(n)]


def _decoded_single(model, ids: list[int]) -> tuple[list, list[int]]:
    """mlx-lm's `generate_step` on a fresh cache: (the cache, the tokens it was given and made)."""
    from mlx_lm.generate import generate_step

    cache = make_prompt_cache(model)
    out = [int(t) for t, _ in generate_step(mx.array(ids), model, max_tokens=DECODE_STEPS, sampler=greedy,
                                            prompt_cache=cache)]
    return cache, ids + out


def _decoded_batch(model, prompts: list[list[int]]) -> list[tuple[list, list[int]]]:
    """mlx-lm's `BatchGenerator` (the server's) on `prompts` together: per prompt, the cache and
    tokens its finished response carries (what the server's final `insert_cache` gets)."""
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(model, max_tokens=DECODE_STEPS, sampler=greedy)
    try:
        uids = gen.insert(prompts, max_tokens=[DECODE_STEPS] * len(prompts))
        done: dict[int, tuple[list, list[int]]] = {}
        for _ in range(10 * DECODE_STEPS * len(prompts) + 100):  # bounded: a stuck generator is a failed probe
            _, responses = gen.next()
            for r in responses:
                if r.finish_reason is not None:
                    done[r.uid] = (r.prompt_cache, list(r.all_tokens))
            if len(done) == len(uids):
                return [done[u] for u in uids]
        raise RuntimeError("mlx-lm's BatchGenerator did not finish the probe")
    finally:
        gen.close()


def compare(model, cache: list, tokens: Sequence[int], start: int) -> str | None:
    """Compare a decoded cache with a prefill of the tokens it holds, from position `start`.

    Args:
        model: the mlx-lm model.
        cache: per-layer caches after decoding (plain `KVCache` leaves; offset = tokens held).
        tokens: the token ids of the sequence (at least the cache's offset).
        start: first compared position (the prompt's last token: the first one forwarded alone).

    Returns:
        None if every KV leaf's keys and values at positions `[start, offset)` are bit-identical
        to those of one prefill chunk of `tokens[:offset]` on a fresh cache; else the first
        difference (layer, position).
    """
    held = kv_offset(cache)
    if held is None or held > len(tokens) or held <= start:
        return f"the decoded cache holds {held} tokens of {len(tokens)}: nothing to compare from {start}"
    ref = make_prompt_cache(model)
    model(mx.array(list(tokens[:held]))[None], cache=ref)
    pairs = list(zip(leaves(cache), leaves(ref)))
    mx.eval([[a.keys, a.values, b.keys, b.values] for a, b in pairs])
    for i, (a, b) in enumerate(pairs):
        if type(a) is not KVCache or type(b) is not KVCache:
            return f"cache leaf {i} is a {type(a).__name__}, not a plain KVCache"
        for name, x, y in (("keys", a.keys, b.keys), ("values", a.values, b.values)):
            x, y = x[..., start:held, :], y[..., start:held, :]
            if x.shape != y.shape or x.dtype != y.dtype:
                return f"layer {i} {name}: {x.shape} {x.dtype} after decode, {y.shape} {y.dtype} after prefill"
            same = np.asarray(mx.all(bits(x) == bits(y), axis=(0, 1, 3)))
            if not same.all():
                pos = start + int(np.flatnonzero(~same)[0])
                return f"layer {i} {name} of position {pos} differ between decode and prefill"
    return None


def run(model, code: str = "") -> ReplyVerdict:
    """Measure `model` on this device (see the module docstring). Never raises: an error is a
    verdict of no, naming it."""
    global RUNS
    RUNS += 1
    t0 = time.perf_counter()
    verdict = ReplyVerdict(False, device(), reason=None, code=code, checked=time.time())
    try:
        long = probe_ids(PROBE_TOKENS)
        short = [probe_ids(n, salt=11 * (i + 1)) for i, n in enumerate(SHORT_TOKENS)]
        runs = [("generate_step", len(long), *_decoded_single(model, long))]
        for group in ([long], [long, *short]):
            runs += [(f"BatchGenerator, batch of {len(group)}", len(p), *out)
                     for p, out in zip(group, _decoded_batch(model, group))]
        for name, n_prompt, cache, tokens in runs:
            why = compare(model, cache, tokens, n_prompt - 1)
            if why is not None:
                verdict.reason = f"{name}: {why}"
                break
        else:
            verdict.exact = True
    except Exception as exc:  # noqa: BLE001 - a model the probe cannot run: no reply reuse
        log.debug("reply probe raised", exc_info=True)
        verdict.exact, verdict.reason = False, f"the probe raised {type(exc).__name__}: {exc}"
    verdict.ms = round((time.perf_counter() - t0) * 1e3, 1)
    return verdict


# ----------------------------------------------------------------------------- storing a reply
def reply_span(pc, prompt: np.ndarray, tokens: np.ndarray, cache: list) -> tuple[np.ndarray, CacheHit] | None:
    """The reply entries of a finished request to hand to `PrefixCache.store`.

    Args:
        pc: the `PrefixCache` (attached).
        prompt: int32 prompt token ids (its full blocks were found or stored already).
        tokens: int32 prompt + generated token ids, as mlx-lm's final `insert_cache` gives them.
        cache: the request's per-layer caches; only the tokens it holds count (`kv_offset`:
            mlx-lm's cache may lack the last sampled token's KV).

    Returns:
        `(ids, hit)`: `ids` = `tokens` up to the cache's offset, `hit` its chain hashes and tail
        entry key, the prompt's full blocks counted as found; so the reply's full blocks and its
        tail entry (the reply tokens after its last full block, < block size) are stored. The next
        turn finds the tail entry as an earlier prompt's tail (the reply re-sent token for token)
        or as a sibling's common prefix (a re-rendered reply that differs near its end), which is
        as much of the reply as mlx-lm's own cache reuses. None if the cache holds no reply token.
    """
    held = min(int(kv_offset(cache) or 0), int(tokens.size))
    if held <= prompt.size or not np.array_equal(tokens[: prompt.size], prompt):
        return None
    ids = tokens[:held]
    full, tail = pc.hashes(ids)
    return ids, CacheHit(cache=[], prompt_tokens=held, hashes=full, tail=tail,
                         entries_found=int(prompt.size) // pc.config.block_size)


__all__ = ["META_KEY", "ReplyReuse", "ReplyVerdict", "compare", "decide", "device", "ensure", "reply_span", "run",
           "stored_verdict", "unmeasurable_reason"]
