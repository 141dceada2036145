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
partial block; four requests are compared: the cold prompt (one prefill chunk), its RAM full
hit, its SSD full hit in a fresh cache, and a prompt sharing its first 2 blocks, restored from
SSD with the state at block 2 and prefilled on from there in chunks of `small_step` (no
multiple of the block size: mlx-lm's chunks then cross block ends). For each,
the log-probabilities of `DECODE_STEPS` greedy tokens and every cache array at the end (keys,
values, rotating offsets, state arrays) must be equal bit for bit. The first difference found is
the verdict's reason, and the model then runs uncached, exactly as mlx-lm.

The verdict is stored with the namespace (index meta key `selfcheck`, JSON) and reused by later
processes, so the probe runs once per namespace: the layout key covers the model (weights
digest, class), mlx / mlx-lm versions, dtype, block size and KV quantisation; the verdict also
records a digest of kvtool's cache code and the model's mlx-lm source (`code_digest`) and is
measured again when that changes. Without an SSD tier it is kept for the process only.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import math
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import ArraysCache, RotatingKVCache, make_prompt_cache

from kvtool import blocks, prefill
from kvtool.store.segment import KVLayout

log = logging.getLogger("kvtool")

META_KEY = "selfcheck"  # namespace index meta key holding the verdict (JSON)
VERDICT_VERSION = 1
DECODE_STEPS = 3  # greedy tokens whose log-probabilities are compared per request
BIG_STEP = 2048  # mlx-lm's default prefill chunk: the probe prompt is one chunk
SEED = 0x5C  # probe token ids
# kvtool modules on the path from a prefill to a restored cache (their source is in the digest)
CODE_MODULES = ("blocks", "kvbuffers", "prefill", "selfcheck", "model_kv", "prefix", "store/kvlayout",
                "store/segment", "store/restore")

RUNS = 0  # probes run by this process (tests count them)
_memo: dict[tuple[str, str], Verdict] = {}  # (layout key, code digest) -> verdict, this process


@dataclass
class Verdict:
    """The self-check's result for one namespace.

    Attributes:
        passed: every compared array was bit-identical.
        reason: the first difference found (None if passed).
        code: `code_digest` of the code measured.
        probe_tokens: tokens of the probe prompt.
        block_size: tokens per block of the namespace.
        ms: wall time of the probe (milliseconds).
        checked: when it ran (Unix time, seconds).
        version: `VERDICT_VERSION`.
    """

    passed: bool
    reason: str | None
    code: str
    probe_tokens: int = 0
    block_size: int = 0
    ms: float = 0.0
    checked: float = 0.0
    version: int = VERDICT_VERSION

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | None) -> Verdict | None:
        """Parse a stored verdict; None for anything malformed (then it is measured again)."""
        try:
            doc = json.loads(text or "")
            v = cls(passed=doc["passed"], reason=doc["reason"], code=doc["code"],
                    probe_tokens=int(doc.get("probe_tokens", 0)), block_size=int(doc.get("block_size", 0)),
                    ms=float(doc.get("ms", 0.0)), checked=float(doc.get("checked", 0.0)),
                    version=int(doc.get("version", 0)))
        except (ValueError, TypeError, KeyError, AttributeError):
            return None
        if (not isinstance(v.passed, bool) or not isinstance(v.code, str)
                or (v.reason is not None and not isinstance(v.reason, str)) or v.version != VERDICT_VERSION):
            return None
        return v

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
    root = Path(__file__).resolve().parent
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


def stored_verdict(ssd) -> Verdict | None:
    """The verdict stored in an SSD namespace's index meta, or None."""
    index = getattr(ssd, "index", None) if ssd is not None else None
    if index is None:
        return None
    try:
        return Verdict.from_json(index.get_meta().get(META_KEY))
    except Exception:  # noqa: BLE001 - an unreadable meta: measure again
        log.debug("self-check: stored verdict unreadable", exc_info=True)
        return None


def _store(ssd, verdict: Verdict) -> None:
    index = getattr(ssd, "index", None) if ssd is not None else None
    if index is None or getattr(ssd, "read_only", False):
        return
    try:
        index.set_meta({META_KEY: verdict.to_json()})
    except Exception:  # noqa: BLE001 - not stored: the next process measures again
        log.warning("kvtool: the self-check verdict could not be stored", exc_info=True)


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
    _store(ssd, verdict)
    return verdict


# ----------------------------------------------------------------------------- the probe
def probe_length(block_size: int, windows) -> tuple[int, int]:
    """(full blocks, tokens) of the probe: >= 3 blocks and more than every window, + a partial block."""
    w = max((x for x in windows or () if x is not None), default=0)
    n_full = max(3, math.ceil((w + 1) / block_size))
    return n_full, n_full * block_size + (block_size // 2 if block_size > 1 else 0)


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


def _greedy(logprobs: mx.array) -> mx.array:
    return mx.argmax(logprobs, axis=-1)


def _reference(model, ids: np.ndarray, step: int) -> tuple[list, list, mx.array]:
    """mlx-lm's own generation on a fresh cache: its prefill loop (`generate_step`'s: chunks of
    `step` over all but the last token), then `generate_step` from the last token. Returns per
    decode step (token, log-probabilities), the cache, and the logits of every prefilled token
    `[1, n - 1, vocab]`."""
    from mlx_lm.generate import generate_step

    cache = make_prompt_cache(model)
    logits = []
    pos, n = 0, int(ids.size)
    while n - pos > 1:
        k = min(step, n - 1 - pos)
        logits.append(model(mx.array(ids[pos : pos + k])[None], cache=cache))
        mx.eval([c.state for c in cache], logits[-1])
        pos += k
    out = list(generate_step(mx.array(ids[-1:]), model, max_tokens=DECODE_STEPS, sampler=_greedy,
                             prompt_cache=cache, prefill_step_size=step))
    return out, cache, mx.concatenate(logits, axis=1)


def _through_kvtool(pc, model, ids: np.ndarray, step: int) -> tuple[list, list, int, mx.array | None]:
    """One request as `kvtool.engine.Engine` serves it: fetch, prefill the rest, store, decode.
    Returns what `_reference` does (logits of the prefilled tokens only, None if none) and the
    tokens the fetch found."""
    from mlx_lm.generate import generate_step

    hit = pc.fetch(ids)
    try:
        n = int(ids.size)
        cache = hit.cache or prefill.new_cache(model, pc.windows)
        states: dict | None = {} if pc.has_states else None
        bs = pc.config.block_size
        outputs: list = []
        if pc.windows or pc.has_states:
            prefill.prefill(model, cache, hit.remaining, n, hit.cached_tokens, step=step, states=states,
                            block_size=bs, outputs=outputs)
            gen = prefill.generation_cache(cache, n - 1, pc.windows, step, states)
        else:
            prefill.prefill(model, cache, hit.remaining[:-1], n, hit.cached_tokens, step=step, outputs=outputs)
            gen = cache
        out = list(generate_step(mx.array(ids[-1:]), model, max_tokens=DECODE_STEPS, sampler=_greedy,
                                 prompt_cache=gen, prefill_step_size=step))
        pc.store(ids, cache, hit, states=states)
        logits = mx.concatenate(outputs, axis=1) if outputs else None
        return out, gen, hit.cached_tokens, logits
    finally:
        pc.release(hit)


def _bits(a: mx.array) -> mx.array:
    """The bit pattern of an array (bit-identical means equal patterns, -0.0 != 0.0, NaN == NaN)."""
    width = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32, 8: mx.uint64}[a.dtype.size]
    return a.view(width) if a.dtype not in (mx.uint8, mx.uint16, mx.uint32, mx.uint64) else a


def _same(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.shape == b.shape and a.dtype == b.dtype and bool(mx.array_equal(_bits(a), _bits(b)))


def _leaf_arrays(c) -> tuple[list[Any], list[Any]]:
    """(arrays, scalars) that define a leaf cache's state, for comparison."""
    if isinstance(c, ArraysCache):
        return list(c.cache), []
    if isinstance(c, RotatingKVCache):
        return [c.keys, c.values], [c.offset, c._idx, c.keep, c.max_size]
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


def _diff_prefill(ref: mx.array, got: mx.array | None, start: int) -> str | None:
    """Logits of the prompt tokens kvtool prefilled (from token `start`) against mlx-lm's."""
    if got is None:
        return None
    n = ref.shape[1] - start  # kvtool's prefill may include the last prompt token: not compared here
    if got.shape[1] < n:
        return f"kvtool prefilled {got.shape[1]} tokens, expected {n}"
    a, b = ref[:, start:], got[:, :n]
    if _same(a, b):
        return None
    diff = np.flatnonzero(np.asarray(mx.any(_bits(a) != _bits(b), axis=-1))[0])
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
    from kvtool.config import FIELD_NAMES, KVToolConfig

    fields: dict[str, Any] = dict(ssd_cache_dir=tmp, block_size=config.block_size, ssd_async_writes=False,
                                  ssd_codec=config.ssd_codec, ssd_durability="best_effort")
    if not ram:
        fields["ram_bytes"] = 0
    if "remote_url" in FIELD_NAMES:
        fields["remote_url"] = None
    return KVToolConfig(**fields)


def run(model, pc, code: str = "") -> Verdict:
    """Measure `pc`'s layout on `model` (see the module docstring). Never raises: an error is a
    failed verdict naming it."""
    global RUNS
    from kvtool.prefix import PrefixCache

    RUNS += 1
    t0 = time.perf_counter()
    bs = pc.config.block_size
    n_full, n = probe_length(bs, pc.windows)
    verdict = Verdict(False, None, code or code_digest(model), n, bs, checked=time.time())
    small = small_step(bs)
    try:
        rng = np.random.default_rng(SEED)
        vocab = _vocab(model)
        probe = _ids(rng, vocab, n)
        other = np.concatenate([probe[: 2 * bs], _ids(rng, vocab, n - 2 * bs)])
        if other[2 * bs] == probe[2 * bs]:  # the prompts part at block 2's first token
            other[2 * bs] = 1 if probe[2 * bs] != 1 else 2
        kw = dict(layout=pc.kv, model_id=pc.model_id, model_name=pc.model_name, model_class=pc.model_class,
                  quant=pc.quant, windows=pc.windows)
        with tempfile.TemporaryDirectory(prefix="kvtool-selfcheck-") as tmp:
            requests = [("cold prompt", probe, BIG_STEP, 0, True), ("RAM full hit", probe, BIG_STEP, n - 1, True),
                        ("SSD full hit", probe, BIG_STEP, n - 1, False),
                        ("SSD hit of 2 blocks + prefill", other, small, 2 * bs, False)]
            refs: dict[tuple[int, int], tuple[list, list, mx.array]] = {}
            caches: dict[bool, Any] = {}
            try:
                for name, ids, step, expect, ram in requests:
                    if ram not in caches:
                        caches[ram] = PrefixCache(_config(pc.config, Path(tmp), ram), **kw)
                    key = (id(ids), step)
                    if key not in refs:
                        refs[key] = _reference(model, ids, step)
                    ref_out, ref_cache, ref_logits = refs[key]
                    out, gen, cached, logits = _through_kvtool(caches[ram], model, ids, step)
                    where = f"{name} ({cached} of {ids.size} tokens from kvtool's blocks, chunks of {step})"
                    if cached != expect:
                        verdict.reason = f"{where}: expected {expect} cached tokens"
                        break
                    why = (_diff_prefill(ref_logits, logits, cached) or _diff_outputs(ref_out, out)
                           or _diff_caches(ref_cache, gen))
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


__all__ = ["META_KEY", "Verdict", "code_digest", "ensure", "gate", "needed", "probe_length", "run",
           "stored_verdict"]
