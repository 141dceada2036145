"""The family matrix: every zoo family (tests/model_zoo.py) served by kvtool, against mlx-lm.

`check_family` runs one family: a cold request, its RAM hit, then (a new Engine over the same
cache directory: empty RAM, the stored self-check verdict) its SSD hit, a prompt sharing 60 % of
it, and a prompt extending it. Every request's greedy tokens must equal mlx-lm's own
(`generate_step` on a fresh `make_prompt_cache(model)`); a cached family is also compared bit
for bit (`bitwise`: logits, log-probabilities, cache arrays) after hits ending in an earlier
prompt's tail entry and in a block that ended a prompt; and a cached family must really hit
(RAM, SSD, the shared blocks, the earlier prompt's tail entry); a refused one must name a
measured mismatch (the self-check), mlx-lm's limitation or the cache class kvtool does not
store, and never use the cache. `render` turns the results into docs/models.md
(`scripts/family_table.py` writes it, `tests/test_zoo_matrix.py` checks it is current).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from tests import model_zoo

BS = 32  # tokens per block in the matrix
MAX_TOKENS = 6
N = model_zoo.PROMPT_TOKENS  # 150: every zoo window (24, 96) wraps
SHARED = int(0.6 * N)  # the 60 % prompt shares this many tokens
EXTRA = 40  # the extended prompt adds this many
# the families of the task's acceptance list: cached, or refused for a measured or named reason
ACCEPTANCE = ("qwen3_next", "gemma4_text", "gpt_oss", "cohere2", "olmo3", "nemotron_h", "jamba", "falcon_h1",
              "plamo2", "granitemoehybrid", "kimi_linear")
MODELS_MD = Path(__file__).resolve().parent.parent / "docs" / "models.md"


@dataclass
class FamilyResult:
    """One row of the matrix.

    Attributes:
        family: zoo family name.
        model_type: the config's `model_type`.
        cache: the structure of `make_prompt_cache(model)` (`cache_summary`).
        status: 'cached' | 'refused' | 'not buildable'.
        reason: why refused / not buildable ('' if cached).
        selfcheck: 'pass' | 'fail' | '' (no self-check: plain KV layers, or refused before it).
    """

    family: str
    model_type: str
    cache: str = ""
    status: str = ""
    reason: str = ""
    selfcheck: str = ""

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


def cache_summary(cache) -> str:
    """`RotatingKVCache(24) x2, KVCache x2`: leaf classes in order of first appearance, counted."""
    from mlx_lm.models.cache import ArraysCache, CacheList, RotatingKVCache

    def name(c) -> str:
        if isinstance(c, CacheList):
            return "CacheList(" + ", ".join(name(x) for x in c.caches) + ")"
        if isinstance(c, ArraysCache):
            return f"ArraysCache[{len(c.cache)}]"
        if isinstance(c, RotatingKVCache):
            return f"RotatingKVCache({c.max_size}{', keep ' + str(c.keep) if c.keep else ''})"
        return type(c).__name__

    counts: dict[str, int] = {}
    for c in cache:
        counts[name(c)] = counts.get(name(c), 0) + 1
    return ", ".join(f"{k} x{v}" for k, v in counts.items())


def prompts() -> tuple[list[int], list[int], list[int]]:
    """(the prompt, a prompt sharing its first `SHARED` tokens, the prompt extended by `EXTRA`)."""
    longer = model_zoo.zoo_prompt(N + EXTRA + 60)
    p = longer[:N]
    p60 = p[:SHARED] + longer[N + EXTRA : N + EXTRA + N - SHARED]
    if p60[SHARED] == p[SHARED]:
        p60[SHARED] = p[SHARED] % 4000 + 3
    return p, p60, longer[: N + EXTRA]


def _reference(loaded, ids) -> list[int]:
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    out = []
    for tok, _ in generate_step(mx.array(ids), loaded.model, max_tokens=MAX_TOKENS):
        if tok in loaded.tokenizer.eos_token_ids:
            break
        out.append(int(tok))
    return out


def not_buildable_result(family: str, reason: str) -> FamilyResult:
    cfg = model_zoo.family_config(family)
    return FamilyResult(family, str(cfg.get("model_type", family)), status="not buildable", reason=reason)


def check_family(family: str, path: Path, workdir: Path) -> FamilyResult:
    """Run the matrix for one family; raises AssertionError (naming the request) on any
    difference from mlx-lm or a cached family that does not hit."""
    from mlx_lm.models.cache import make_prompt_cache

    from kvtool.cache import selfcheck
    from kvtool.config import KVToolConfig
    from kvtool.engine import Engine
    from kvtool.models.loader import load_model

    loaded = load_model(str(path))
    res = FamilyResult(family, str(json.loads((path / "config.json").read_text())["model_type"]),
                       cache_summary(make_prompt_cache(loaded.model)))
    p, p60, ext = prompts()
    refs = {"p": _reference(loaded, p), "p60": _reference(loaded, p60), "ext": _reference(loaded, ext)}
    cfg = KVToolConfig(ssd_cache_dir=workdir / "kv", block_size=BS, ssd_async_writes=False)
    eng = Engine(loaded, cfg)
    try:
        cold = eng.generate(p, max_tokens=MAX_TOKENS)
        ram = eng.generate(p, max_tokens=MAX_TOKENS)
        needed = selfcheck.needed(eng.cache._probed[0], eng.cache._probed[1])
    finally:
        eng.close()
    eng2 = Engine(loaded, cfg)  # a fresh engine: empty RAM tier, the same SSD tier and stored verdict
    try:
        ssd = eng2.generate(p, max_tokens=MAX_TOKENS)
        r60 = eng2.generate(p60, max_tokens=MAX_TOKENS)
        rext = eng2.generate(ext, max_tokens=MAX_TOKENS)
        verdict = selfcheck.stored_verdict(eng2.cache.ssd) if eng2.cache.ssd is not None else None
        reason = eng2.uncached_reason
    finally:
        eng2.close()
    for name, r, ref in (("cold", cold, "p"), ("RAM hit", ram, "p"), ("SSD hit in a fresh engine", ssd, "p"),
                         ("60% shared prefix", r60, "p60"), ("extended prompt", rext, "ext")):
        assert r.token_ids == refs[ref], f"{family}: {name}: {r.token_ids} != mlx-lm's {refs[ref]} (cached {r.cached_tokens})"
    if reason is None:
        why = bitwise(loaded, workdir)
        assert why is None, f"{family}: {why}"
        res.status = "cached"
        res.selfcheck = verdict.describe() if verdict is not None else ""
        assert not needed or res.selfcheck == "pass", f"{family}: cached without a passed self-check"
        assert ram.ram_hit_tokens == N - 1, f"{family}: RAM hit {ram.ram_hit_tokens}"
        assert ssd.ssd_hit_tokens == N - 1, f"{family}: SSD hit {ssd.ssd_hit_tokens}"
        assert SHARED // BS * BS <= r60.cached_tokens <= SHARED, f"{family}: 60% prefix hit {r60.cached_tokens}"
        assert rext.cached_tokens >= N - 1, f"{family}: extended prompt hit {rext.cached_tokens}"
    else:
        res.status, res.reason = "refused", reason
        res.selfcheck = "fail" if reason.startswith("self-check failed") else ""
        assert ("self-check failed: " in reason or "mlx-lm" in reason or "not plain KVCache" in reason
                or "several dtypes" in reason), f"{family}: refusal without a measured or named reason: {reason}"
        assert all(r.cached_tokens == 0 for r in (cold, ram, ssd, r60, rext)), f"{family}: refused but hit"
        assert all(r.uncached_reason == reason for r in (cold, ssd)), f"{family}: per-request reason missing"
    return res


CACHE_TYPES = """\
## Cache types

| mlx-lm cache class | what a kvtool block holds | cached when |
|---|---|---|
| `KVCache` | per layer the K/V slices of the block's tokens (layers may differ in heads and head dims); a prompt's last token as prefilled, not as mlx-lm's decode re-forwards it | always (no self-check; the matrix compares these families bit for bit after hits ending in a tail entry and in a block that ended a prompt) |
| `QuantizedKVCache` (`--kv-bits`) | per layer packed words + scales + biases | where mlx-lm's cache is quantized alike; a request that misses for this says why in its own `uncached_reason`; refused up front (mlx-lm's own error named) where mlx-lm cannot run the model quantized: sliding-window layers (`RotatingKVCache Quantization NYI`), gemma2's attention |
| `RotatingKVCache`, keep 0 (sliding windows, sinks, mixed window sizes, shared-KV layers) | every token's KV (prefilled into a full view, window masked); restored as mlx-lm's own rotating state | the self-check passed |
| `RotatingKVCache`, keep > 0 (`--max-kv-size` on models without `make_cache`) | - | never: mlx-lm's own output then depends on `prefill_step_size` (measured), so no block is reusable |
| `ArraysCache` (SSM, gated delta, linear attention, conv, RG-LRU, rwkv7 state layers) | the attention layers' KV plus every state array after the block's last token | the self-check passed |
| `CacheList` (several caches per layer) | its leaves, as above | the self-check passed |
| other classes (`ChunkedKVCache`, model-specific caches) | - | never (named in `uncached_reason`) |

The self-check (`kvtool/cache/selfcheck.py`, docs/design.md) runs once per namespace: a probe of
3+ blocks and a partial block (longer than every window) is prefilled by mlx-lm straight through
and by kvtool, stored, restored from RAM and SSD (with the block-boundary states) and continued,
also as extensions of earlier prompts and handed to mlx-lm as `fetch` returns it; decode
log-probabilities, cache arrays and the cold prompt's logits must be bit-identical. The verdict
is kept in the namespace (`kvtool inspect --namespace` shows it); a failing model runs uncached,
exactly as mlx-lm, with the first difference as its `uncached_reason`.
"""


def bitwise(loaded, workdir: Path) -> str | None:
    """Bit for bit (logits of every prefilled prompt token, decode log-probabilities, every cache
    array at the end; the self-check's comparison): the prompt after a 100-token prompt (a hit
    ending in its tail entry) and after a 64-token prompt (a hit ending in a block whose last
    token was that prompt's last), each against mlx-lm's own run. None if identical."""
    import numpy as np

    from kvtool.cache import selfcheck
    from kvtool.cache.prefix import PrefixCache
    from kvtool.config import KVToolConfig

    ids = np.asarray(prompts()[0], dtype=np.int32)
    ref_out, ref_cache, ref_logits = selfcheck._reference(loaded.model, ids, 2048)
    for first in (100, 2 * BS):
        cfg = KVToolConfig(ssd_cache_dir=workdir / f"bits{first}", block_size=BS, ssd_async_writes=False)
        with PrefixCache.for_model(loaded.model, cfg, model_id=loaded.model_id, model_name=loaded.name) as pc:
            selfcheck._through_kvtool(pc, loaded.model, ids[:first], 2048)
            out, gen, cached, logits = selfcheck._through_kvtool(pc, loaded.model, ids, 2048)
        why = (selfcheck._diff_prefill(ref_logits, logits, cached) or selfcheck._diff_outputs(ref_out, out)
               or selfcheck._diff_caches(ref_cache, gen))
        if why is not None or cached < first - 1:
            return f"after a {first}-token prompt ({cached} cached): {why or 'no hit'}"
    return None


def render(results: list[FamilyResult]) -> str:
    """docs/models.md from the matrix results (deterministic: no timings)."""
    by = {s: [r for r in results if r.status == s] for s in ("cached", "refused", "not buildable")}
    lines = [
        "# Model families: what kvtool caches",
        "",
        "<!-- Generated by scripts/family_table.py from the family matrix (tests/zoo_matrix.py); do not edit. -->",
        "",
        "Every model type of the pinned mlx-lm, built small with random weights (tests/model_zoo.py: the output "
        "must depend on the first prompt token), served by kvtool with "
        f"{BS}-token blocks: cold, RAM hit, SSD hit in a fresh engine, a prompt sharing 60 % of the prompt, and "
        f"the prompt extended by {EXTRA} tokens, each against mlx-lm's own greedy tokens ({N}-token prompt: every "
        "sliding window wraps). Output equals mlx-lm's in every row; *cached* rows also hit every time; "
        "*refused* rows run uncached for the reason shown; *not buildable* rows could not be built small "
        "(the error, or no weight scale that makes the output depend on the context).",
        "",
        f"**{len(by['cached'])} cached, {len(by['refused'])} refused, {len(by['not buildable'])} not buildable** "
        f"({len(results)} families, {len({r.model_type for r in results if r.status != 'not buildable'})} model "
        "types run).",
        "",
        CACHE_TYPES,
        "## Families",
        "",
        "| family | model_type | cache (make_prompt_cache) | status | self-check | reason |",
        "|---|---|---|---|---|---|",
    ]
    for status in ("cached", "refused", "not buildable"):
        for r in sorted(by[status], key=lambda r: r.family.lower()):
            reason = r.reason.replace("|", "\\|").replace("\n", " ")
            lines.append(f"| {r.family} | {r.model_type} | {r.cache} | {r.status} | {r.selfcheck} | {reason} |")
    return "\n".join(lines) + "\n"


def rows(text: str) -> dict[str, str]:
    """family -> its table row, from a rendered docs/models.md."""
    out = {}
    table = text.split("## Families", 1)[-1]
    for line in table.splitlines():
        if line.startswith("| ") and not line.startswith("| family "):
            out[line.split("|")[1].strip()] = line
    return out


def row_of(r: FamilyResult) -> str:
    return rows(render([r]))[r.family]
