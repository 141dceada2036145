"""The self-check: kvtool's block cache measured exact for one model before it is used.

A model whose prompt cache has sliding-window leaves (`RotatingKVCache`), state leaves
(`ArraysCache`: SSM, linear-attention and conv layers) or cache lists (`CacheList`) is served
from kvtool's blocks only if, for that model, a short deterministic probe gives bit-identical
results both ways:

- *straight through*: mlx-lm's own `generate_step` on a fresh `make_prompt_cache(model)`;
- *from kvtool's blocks*: kvtool's prefill (full views, state snapshots at block ends), its
  blocks stored through the real store (`PrefixCache.store`: slicing, RAM tier, segment files
  and index in a temporary directory), fetched back (RAM rebuild, SSD restore of whole blocks
  with their block-boundary states) and handed to the same `generate_step`.

The probe is `n_full` blocks (at least 3, more if a sliding window needs them to wrap) plus a
partial block; six requests are compared: the cold prompt (one prefill chunk), its RAM full
hit, its SSD full hit in a fresh cache; a 2-block prompt stored cold, then extended: its 2
blocks (the last token of the second was that prompt's last) and the state at block 2 restored
from SSD and prefilled on in chunks of `small_step` (no multiple of the block size), once as the
engine serves it and once with the restored cache handed to mlx-lm's `generate_step` as it is
(what `kvtool serve` and the Python API do); and the first prompt extended (a hit ending in its
tail entry, whose last token the cold request computed; the rest crosses a block end). The
log-probabilities of `DECODE_STEPS` greedy tokens, (engine path) every cache array at the end
(keys, values, rotating offsets, state arrays) and, for the cold prompt, the logits of every
prompt token (a state cut at a block end may change later tokens' rounding while the final
state happens to agree) must be equal bit for bit. The first difference found is the verdict's
reason, and the model then runs uncached, exactly as mlx-lm.

The verdict is stored with the namespace (index meta key `selfcheck`, JSON) and reused by later
processes, so the probe runs once per namespace (the layout key covers the model, library
versions, dtype, block size and KV quantisation); it is measured again when `code_digest` (kvtool's
cache code, the model's mlx-lm source) changes or the stored verdict does not parse. Without an
SSD tier it is kept for the process only.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import math
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache, make_prompt_cache

from kvtool.cache.verdict import StoredVerdict, read_meta_record, write_meta_record
from kvtool.config import KVToolConfig
from kvtool.disk.segment import KVLayout
from kvtool.kv import blocks, prefill

log = logging.getLogger("kvtool")

META_KEY = "selfcheck"  # namespace index meta key holding the verdict (JSON)
VERDICT_VERSION = 1
DECODE_STEPS = 2  # greedy tokens whose log-probabilities are compared per request
BIG_STEP = 2048  # mlx-lm's default prefill chunk: the probe prompt is one chunk
SEED = 0x5C  # probe token ids
# the modules of kvtool's cache path (relative to the package) whose source is in the digest (a
# test checks each exists)
CODE_MODULES = ("kv/blocks", "kv/buffers", "kv/prefill", "kv/decode", "kv/model_kv", "kv/windows", "cache/selfcheck",
                "cache/prefix", "cache/hit", "cache/extend", "cache/reply", "disk/kvlayout", "disk/segment", "disk/codec",
                "disk/restore", "disk/verify")  # fmt: skip

RUNS = 0  # probes run by this process (tests count them)
_memo: dict[tuple[str, str], Verdict] = {}  # (layout key, code digest) -> verdict, this process


@dataclass
class Verdict(StoredVerdict):
    """The self-check's result for one namespace (and `StoredVerdict`'s `reason`, `code`, `ms`,
    `checked`).

    Attributes:
        passed: every compared array was bit-identical.
        probe_tokens: tokens of the probe prompt.
        block_size: tokens per block of the namespace.
        version: `VERDICT_VERSION`.
    """

    passed: bool
    probe_tokens: int = 0
    block_size: int = 0
    version: int = VERDICT_VERSION

    def describe(self) -> str:
        """One line for logs and `kvtool inspect`."""
        return "pass" if self.passed else f"fail: {self.reason}"


def needed(kv: KVLayout | None, windows) -> bool:
    """Whether a layout needs the self-check: state leaves, cache lists or sliding windows."""
    return kv is not None and (bool(kv.kinds) or any(w is not None for w in windows or ()))


_code_cache: dict[str, str] = {}


def code_digest(model) -> str:
    """blake2b-64 (hex) of the source of kvtool's cache path (`CODE_MODULES`) and of the mlx-lm
    modules the model runs (its own module, `base`, `cache`)."""
    module = inspect.getmodule(type(model))
    key = getattr(module, "__file__", None) or type(model).__module__
    if key in _code_cache:
        return _code_cache[key]
    h = hashlib.blake2b(digest_size=8)
    root = Path(__file__).resolve().parent.parent  # the kvtool package
    paths = [root / f"{m}.py" for m in CODE_MODULES]
    import mlx_lm.models.base as mbase
    import mlx_lm.models.cache as mcache

    paths += [Path(p) for p in (getattr(module, "__file__", None), mbase.__file__, mcache.__file__) if p]
    for p in paths:
        try:
            h.update(p.read_bytes())
        except OSError:
            h.update(str(p).encode())
    _code_cache[key] = h.hexdigest()
    return _code_cache[key]


def gate(pc, model) -> str | None:
    """The self-check for an attached `PrefixCache` (`pc.kv`, `pc.windows`, `pc.tiered`): the
    stored verdict, this process's, or a fresh measurement (then stored). Returns None if the
    model may be cached, else the reason it must not."""
    if not needed(pc.kv, pc.windows):
        return None
    verdict = ensure(pc, model)
    return None if verdict.passed else f"self-check failed: {verdict.reason}"


def attach(pc, model) -> None:
    """What `PrefixCache` runs when it attaches a namespace for `model`: measure whether a token
    forwarded alone gets the KV a prefill chunk gives it (`alone_exact`), then the self-check
    (`gate`); a failed one detaches the tiers and sets the measured `uncached_reason` (one
    warning): the model then runs exactly as mlx-lm."""
    pc.alone_exact = alone_exact(model)
    reason = gate(pc, model)
    if reason is not None:
        log.warning("kvtool: running uncached: %s", reason)
        pc.tiered.close()
        pc.tiered, pc.layout_key, pc.kv, pc.windows, pc.uncached_reason = None, None, None, (), reason


def alone_exact(model) -> bool:
    """Whether the KV (every plain `KVCache` leaf) of a token forwarded alone, as mlx-lm's
    `generate_step` forwards a prompt's last token, equals its KV inside a prefill chunk, bit for
    bit (16 tokens: two forwards of a few milliseconds, at every attach). False for attention code
    that takes another path for one token (MLA): a cache holding mlx-lm's own decode re-forward of
    a prompt's last token (the server's, the Python API's) is then stored without that entry
    (`PrefixCache.store`)."""
    ids = mx.array([[3 + (7 * i) % 97 for i in range(16)]])
    whole, split = make_prompt_cache(model), make_prompt_cache(model)
    try:
        model(ids, cache=whole)
        model(ids[:, :-1], cache=split)
        model(ids[:, -1:], cache=split)
        pairs = [(a, b) for a, b in zip(blocks.leaves(whole), blocks.leaves(split)) if type(a) is KVCache]
        mx.eval([c.state for c in whole], [c.state for c in split])
        return all(_same(a.keys[..., 15, :], b.keys[..., 15, :]) and _same(a.values[..., 15, :], b.values[..., 15, :])
                   for a, b in pairs)
    except Exception:  # noqa: BLE001 - a model this cannot run: store conservatively
        log.debug("alone_exact raised", exc_info=True)
        return False


def stored_verdict(ssd) -> Verdict | None:
    """The verdict stored in an SSD namespace's index meta, or None."""
    return read_meta_record(ssd, META_KEY, Verdict.from_json, "self-check")


def ensure(pc, model) -> Verdict:
    """The verdict for `pc`'s namespace: stored (same code), this process's, or measured now."""
    code = code_digest(model)
    ssd = pc.ssd
    stored = stored_verdict(ssd)
    if stored is not None and stored.code == code:
        return stored
    key = (pc.layout_key or "", code)
    verdict = _memo.get(key)
    if verdict is None:
        verdict = run(model, pc, code)
        _memo[key] = verdict
        log.info("kvtool: self-check of %s (%d tokens, %.0f ms): %s", pc.model_name, verdict.probe_tokens,
                verdict.ms, verdict.describe())
    write_meta_record(ssd, META_KEY, verdict.to_json(), "self-check")
    return verdict


# ----------------------------------------------------------------------------- the probe
def probe_length(block_size: int, windows) -> tuple[int, int]:
    """(full blocks, tokens) of the probe: >= 3 full blocks and a partial block, the whole at
    least 2 tokens longer than every window, so that the full hits restore a wrapped window
    (`n - 1` tokens) and the extension continues one. Longer probes only cost time: the
    self-check's cost is model compute, proportional to the probe's tokens
    (bench_configs/selfcheck_cost.py)."""
    w = max((x for x in windows or () if x is not None), default=0)
    tail = block_size // 2 if block_size > 1 else 0
    n_full = max(3, math.ceil((w + 2 - tail) / block_size))
    return n_full, n_full * block_size + tail


def small_step(block_size: int) -> int:
    """A prefill chunk that is no multiple of the block size (chunks cross block ends)."""
    return max(2, (3 * block_size) // 4 + 1)


def _vocab(model) -> int:
    cache = make_prompt_cache(model)
    logits = model(mx.array([[0]]), cache=cache)
    return int(logits.shape[-1])


def _ids(rng: np.random.Generator, vocab: int, n: int) -> np.ndarray:
    hi = max(2, min(vocab, 1 << 15))
    return rng.integers(1, hi, size=n, dtype=np.int64).astype(np.int32)


def greedy(logprobs: mx.array) -> mx.array:
    """mlx-lm sampler: the most likely token."""
    return mx.argmax(logprobs, axis=-1)


def _reference(model, ids: np.ndarray, step: int, with_logits: bool = True) -> tuple[list, list, mx.array | None]:
    """mlx-lm's own generation on a fresh cache: its prefill loop (`generate_step`'s: chunks of
    `step` over all but the last token), then `generate_step` from the last token. Returns per
    decode step (token, log-probabilities), the cache, and (`with_logits`) the logits of every
    prefilled token `[1, n - 1, vocab]` (the lm_head over every token: mlx-lm skips it)."""
    from mlx_lm.generate import generate_step

    cache = make_prompt_cache(model)
    logits = []
    pos, n = 0, int(ids.size)
    while n - pos > 1:
        k = min(step, n - 1 - pos)
        out = model(mx.array(ids[pos : pos + k])[None], cache=cache)
        if with_logits:
            logits.append(out)
        mx.eval([c.state for c in cache], logits[-1] if with_logits else [])
        pos += k
    steps = list(generate_step(mx.array(ids[-1:]), model, max_tokens=DECODE_STEPS, sampler=greedy,
                               prompt_cache=cache, prefill_step_size=step))
    return steps, cache, mx.concatenate(logits, axis=1) if logits else None


def _through_kvtool(pc, model, ids: np.ndarray, step: int,
                    with_logits: bool = True) -> tuple[list, list, int, mx.array | None]:
    """One request as `kvtool.engine.Engine` serves it: fetch, prefill the rest, store, decode.
    Returns what `_reference` does (logits of the prefilled tokens only, None if none) and the
    tokens the fetch found."""
    from mlx_lm.generate import generate_step

    hit = pc.fetch(ids, full_views=True)
    try:
        cache = hit.cache or prefill.new_cache(model, pc.windows)
        states: dict | None = {} if pc.has_states else None
        outputs: list = []
        gen, last_kv, first = prefill.for_generation(model, cache, ids, hit.cached_tokens, step=step,
                                                     windows=pc.windows, states=states, quant=pc.quant,
                                                     block_size=pc.config.block_size,
                                                     outputs=outputs if with_logits else None)
        out = list(generate_step(mx.array(ids[-1:]), model, max_tokens=DECODE_STEPS, sampler=greedy,
                                 prompt_cache=gen, prefill_step_size=step))
        pc.store(ids, cache, hit, states=states, last_kv=last_kv)
        if outputs and first < hit.cached_tokens:  # (a recomputed token before the hit's end: not compared)
            outputs[0] = outputs[0][:, hit.cached_tokens - first :]
        logits = mx.concatenate(outputs, axis=1) if outputs else None
        return out, gen, hit.cached_tokens, logits
    finally:
        pc.release(hit)


AS_IS = "SSD hit of the 2-block prompt's blocks used as-is by mlx-lm (its server, the Python API)"
SETUP = "a 2-block prompt, cold (stores blocks whose last token was a prompt's last)"


def _as_is(pc, model, ids: np.ndarray, step: int) -> tuple[list, None, int, None]:
    """A hit as `kvtool serve` and the documented Python use take it: `hit.cache` (full views of
    sliding windows, restored states) handed to mlx-lm's `generate_step` with the rest of the
    prompt. Its cache classes differ from mlx-lm's own, so only the outputs are compared."""
    from mlx_lm.generate import generate_step

    hit = pc.fetch(ids)
    try:
        out = list(generate_step(mx.array(hit.remaining), model, max_tokens=DECODE_STEPS, sampler=greedy,
                                 prompt_cache=hit.cache or None, prefill_step_size=step))
        return out, None, hit.cached_tokens, None
    finally:
        pc.release(hit)


def bits(a: mx.array) -> mx.array:
    """The bit pattern of an array (bit-identical means equal patterns, -0.0 != 0.0, NaN == NaN)."""
    width = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32, 8: mx.uint64}[a.dtype.size]
    return a.view(width) if a.dtype not in (mx.uint8, mx.uint16, mx.uint32, mx.uint64) else a


def _same(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.shape == b.shape and a.dtype == b.dtype and bool(mx.array_equal(bits(a), bits(b)))


def _leaf_arrays(c) -> tuple[list[Any], list[Any]]:
    """(arrays, scalars) that define a leaf cache's state, for comparison."""
    if isinstance(c, ArraysCache):
        return list(c.cache), []
    if isinstance(c, RotatingKVCache):
        keys, values, offset, keep, max_size, idx = c.state  # mlx-lm 0.32.2's order
        return [keys, values], [offset, idx, keep, max_size]
    n = int(c.offset)
    keys = c.keys[..., :n, :] if c.keys is not None else None
    values = c.values[..., :n, :] if c.values is not None else None
    return [keys, values], [n]


def _diff_caches(ref: list, got: list) -> str | None:
    a, b = blocks.leaves(ref), blocks.leaves(got)
    if [type(x).__name__ for x in a] != [type(x).__name__ for x in b]:
        return f"cache leaf types {[type(x).__name__ for x in b]} != mlx-lm's {[type(x).__name__ for x in a]}"
    for i, (x, y) in enumerate(zip(a, b)):
        xa, xs = _leaf_arrays(x)
        ya, ys = _leaf_arrays(y)
        if xs != ys:
            return f"cache leaf {i} ({type(x).__name__}) offsets {ys} != mlx-lm's {xs}"
        for j, (p, q) in enumerate(zip(xa, ya)):
            if not _same(p, q):
                return f"cache leaf {i} ({type(x).__name__}) array {j} differs from mlx-lm's"
    return None


def _diff_prefill(ref: mx.array | None, got: mx.array | None, start: int) -> str | None:
    """Logits of the prompt tokens kvtool prefilled (from token `start`) against mlx-lm's."""
    if got is None or ref is None:
        return None
    n = ref.shape[1] - start  # kvtool's prefill may include the last prompt token: not compared here
    if got.shape[1] < n:
        return f"kvtool prefilled {got.shape[1]} tokens, expected {n}"
    a, b = ref[:, start:], got[:, :n]
    if _same(a, b):
        return None
    diff = np.flatnonzero(np.asarray(mx.any(bits(a) != bits(b), axis=-1))[0])
    return f"logits of prompt token {start + int(diff[0])} differ from mlx-lm's"


def _diff_outputs(ref: list, got: list) -> str | None:
    for k, ((t0, l0), (t1, l1)) in enumerate(zip(ref, got)):
        if not _same(l0, l1):
            d = float(mx.max(mx.abs(l0.astype(mx.float32) - l1.astype(mx.float32))))
            return f"log-probabilities of decode step {k} differ (max |diff| {d:.3g}; token {int(t1)} vs {int(t0)})"
    if len(ref) != len(got):
        return f"{len(got)} decode steps, mlx-lm {len(ref)}"
    return None


def _config(config, tmp: Path, ram: bool):
    fields: dict[str, Any] = dict(ssd_cache_dir=tmp, block_size=config.block_size, ssd_async_writes=False,
                                  ssd_codec=config.ssd_codec, ssd_durability="best_effort", remote_url=None)
    if not ram:
        fields["ram_bytes"] = 0
    return KVToolConfig(**fields)


def _requests(vocab: int, bs: int, n: int, states: int) -> list[tuple[str, np.ndarray, int, int, bool]]:
    """The probe's requests, in order: (name, int32 token ids, prefill step, cached tokens
    expected, in the RAM cache (else a fresh SSD-only one)). `states`: 1 with state layers (a hit
    ending in a tail entry re-forwards its last token)."""
    rng = np.random.default_rng(SEED)
    small = small_step(bs)
    probe = _ids(rng, vocab, n)
    extra = bs // 2 + 3
    longer = np.concatenate([probe, _ids(rng, vocab, extra)])  # ends in the probe's tail entry, crosses a block end
    short = _ids(rng, vocab, 2 * bs)  # its last token is its last block's last token
    short_ext = np.concatenate([short, _ids(rng, vocab, extra)])
    return [("cold prompt", probe, BIG_STEP, 0, True), ("RAM full hit", probe, BIG_STEP, n - 1, True),
            (SETUP, short, BIG_STEP, 0, True),
            ("SSD full hit", probe, BIG_STEP, n - 1, False),
            (AS_IS, short_ext, small, 2 * bs, False),  # (stores nothing: the next one finds 2 blocks too)
            ("SSD hit of the 2-block prompt's blocks, extended", short_ext, small, 2 * bs, False),
            ("SSD hit of the prompt's tail entry, extended", longer, small, n - states, False)]


def run(model, pc, code: str = "") -> Verdict:
    """Measure `pc`'s layout on `model` (see the module docstring). Never raises: an error is a
    failed verdict naming it."""
    global RUNS
    RUNS += 1
    t0 = time.perf_counter()
    bs = pc.config.block_size
    n_full, n = probe_length(bs, pc.windows)
    verdict = Verdict(False, n, bs, reason=None, code=code or code_digest(model), checked=time.time())
    try:
        requests = _requests(_vocab(model), bs, n, 1 if pc.has_states else 0)
        kw = dict(layout=pc.kv, model_id=pc.model_id, model_name=pc.model_name, model_class=pc.model_class,
                  quant=pc.quant, windows=pc.windows)
        with tempfile.TemporaryDirectory(prefix="kvtool-selfcheck-") as tmp:
            refs: dict[tuple[int, int], tuple[list, list, mx.array | None]] = {}
            caches: dict[bool, Any] = {}
            try:
                for name, ids, step, expect, ram in requests:
                    if ram not in caches:
                        caches[ram] = type(pc)(_config(pc.config, Path(tmp), ram), **kw)  # a PrefixCache: the class of `pc`
                    if name == SETUP:  # (its cold path is the first request's: only its blocks matter)
                        _through_kvtool(caches[ram], model, ids, step)
                        continue
                    key = (id(ids), step)
                    cold = expect == 0  # prompt logits compared for the cold prefill (the lm_head over every token)
                    if key not in refs:
                        refs[key] = _reference(model, ids, step, with_logits=cold)
                    ref_out, ref_cache, ref_logits = refs[key]
                    if name == AS_IS:
                        out, gen, cached, logits = _as_is(caches[ram], model, ids, step)
                    else:
                        out, gen, cached, logits = _through_kvtool(caches[ram], model, ids, step, with_logits=cold)
                    where = f"{name} ({cached} of {ids.size} tokens from kvtool's blocks, chunks of {step})"
                    if cached != expect:
                        verdict.reason = f"{where}: expected {expect} cached tokens"
                        break
                    why = (_diff_prefill(ref_logits, logits, cached) or _diff_outputs(ref_out, out)
                           or (_diff_caches(ref_cache, gen) if gen is not None else None))
                    if why is not None:
                        verdict.reason = f"{where}: {why}"
                        break
                else:
                    verdict.passed = True
            finally:
                for c in caches.values():
                    c.close()
    except Exception as exc:  # noqa: BLE001 - a model the probe cannot run is not cached
        log.debug("self-check raised", exc_info=True)
        verdict.passed, verdict.reason = False, f"the probe raised {type(exc).__name__}: {exc}"
    verdict.ms = round((time.perf_counter() - t0) * 1e3, 1)
    return verdict


__all__ = ["META_KEY", "Verdict", "alone_exact", "attach", "bits", "code_digest", "ensure", "gate", "greedy", "needed",
           "probe_length", "run", "stored_verdict"]
