"""Import of mlx-lm prompt-cache files (`mlx_lm.cache_prompt`, `save_prompt_cache`) into kvtool's
SSD tier as verified blocks (`import_cache_file`). The export is `kvtool.jobs.interop_export`; token
ids, file loading and the model check are `kvtool.jobs.interop_files`.

Import checks, in order (any failure: `InteropError`, nothing written):
1. the file loads as an mlx-lm prompt cache of plain `KVCache` (or `QuantizedKVCache`, imported
   into the namespace of that quantisation) layers, one per model layer; `RotatingKVCache`
   (sliding windows, `--max-kv-size`) and `ArraysCache` (state layers) are refused: they hold
   only the last window / the final state, not per-block content;
2. every layer's offset equals the token count;
3. array shapes and dtypes equal the model's own cache (heads, head dims, dtype, bits, groups);
4. the file's metadata `model` is the same model: same spec, same directory, or a directory (or
   locally cached Hub snapshot) with the same weights digest (`require_model_match=False` turns a
   mismatch or an unverifiable name into a warning);
5. quantized or not as mlx-lm would have left a prompt of this length (`quantized_kv_start`);
6. the KV itself (`kv_check`): the last `check_tokens` tokens, and `check_positions` single
   tokens spread over the rest, are recomputed from the file's KV before them and compared: a
   different model, or a different token id at a checked position, gives different KV.

A file written by `kvtool export` also carries `kvtool_kv_digest` (`interop_files.kv_digest`): its
KV and token ids must match it, so a damaged or edited export is refused even at positions the KV
check does not recompute.

Then `PrefixCache.store(tokens, cache, persist=True)`, flush, and `PrefixCache.probe(tokens)`
must report every token (`verified`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from kvtool.jobs.interop_files import (
    TOKEN_SOURCES,
    InteropError,
    check_model,
    digest_warning,
    file_quantization,
    file_token_ids,
    load_cache_file,
    resolve_cache_file,
)
from kvtool.jobs.ssd_writes import ssd_write_problem, write_counts

if TYPE_CHECKING:
    from kvtool.engine import Engine  # (MLX: for annotations only)

DEFAULT_CHECK_TOKENS = 32  # last tokens recomputed (one model call) by the KV check of an import
DEFAULT_CHECK_POSITIONS = 64  # single tokens spread over the rest (one decode step each)
EXIT_NOT_CACHED = 1  # export: the prompt is not fully cached (nothing written)
# Relative KV difference (max |a-b| / max |b|) above which the import's KV check fails. A wrong
# model or wrong tokens give differences of order 1; recomputation with another chunking gives
# float noise, quantisation about 2^-bits.
KV_TOLERANCE = {"float32": 1e-3, "float16": 2e-2, "bfloat16": 5e-2}
KV_TOLERANCE_QUANTIZED = 0.25


@dataclass
class ImportReport:
    """What `import_cache_file` did. Tokens in tokens, bytes in bytes, time in s.

    Attributes:
        file: the file imported.
        file_model: its metadata `model` (None if absent).
        model_check: `ModelCheck.status` and detail.
        prompt_tokens: tokens in the prompt (== the file's cache offset).
        token_source: a key of `TOKEN_SOURCES`.
        cache_type: 'KVCache' | 'QuantizedKVCache'.
        kv_bits, kv_group_size: the file's quantisation (None: plain).
        kv_check_tokens: tokens whose KV the check recomputed (0: skipped).
        kv_check_max_rel_diff: the largest relative difference to the file's KV.
        entries_stored: blocks + tail entry handed to the tiers.
        blocks_written, bytes_written, blocks_dedup, blocks_failed, blocks_over_budget: what the
            SSD writer did, after the flush (`kvtool.jobs.ssd_writes.WriteCounts`; blocks over the
            budget leave the import unverified).
        flushed: every accepted write was attempted.
        cached_tokens: `PrefixCache.probe(tokens)` after the flush.
        verified: `cached_tokens == prompt_tokens`.
        layout_key, namespace_dir: where the blocks went.
        warnings: one line each.
        elapsed_s: wall time.
    """

    file: str
    file_model: str | None = None
    model_check: str = "skipped"
    model_check_detail: str = ""
    prompt_tokens: int = 0
    token_source: str = "prompt_chat_template"
    cache_type: str = "KVCache"
    kv_bits: int | None = None
    kv_group_size: int | None = None
    kv_check_tokens: int = 0
    kv_check_max_rel_diff: float = 0.0
    entries_stored: int = 0
    blocks_written: int = 0
    bytes_written: int = 0
    blocks_dedup: int = 0
    blocks_failed: int = 0
    blocks_over_budget: int = 0
    flushed: bool = True
    cached_tokens: int = 0
    verified: bool = False
    layout_key: str | None = None
    namespace_dir: str | None = None
    warnings: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class ExportReport:
    """What `export_cache_file` did.

    Attributes:
        out: the file written.
        metadata_model: its metadata `model` (what `mlx_lm.generate --model` must equal).
        prompt_tokens: tokens in the prompt (== the file's cache offset).
        cached_tokens: leading prompt tokens found in the tiers (== prompt_tokens unless `fill`).
        ram_hit_tokens, ssd_hit_tokens, remote_hit_tokens: where they came from (a full hit
            counts the last token in the tier of the tail entry, RAM or SSD).
        computed_tokens: tokens run through the model (1 on a full hit: the last token is
            re-forwarded as mlx-lm's last prefill step; more with `fill`).
        cache_types: the file's cache classes (mlx-lm's).
        bytes: the file's size.
        layout_key: the namespace read.
        elapsed_s: wall time.
    """

    out: str
    metadata_model: str
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ram_hit_tokens: int = 0
    ssd_hit_tokens: int = 0
    remote_hit_tokens: int = 0
    computed_tokens: int = 0
    cache_types: list[str] = field(default_factory=list)
    bytes: int = 0
    layout_key: str | None = None
    elapsed_s: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


# --------------------------------------------------------------------------- checks
def _arrays(c) -> list:
    """The KV arrays of a plain or quantized layer: [keys, values] or [k_w, k_s, k_b, v_w, v_s, v_b]."""
    if isinstance(c.keys, (tuple, list)):
        return [*c.keys, *c.values]
    return [c.keys, c.values]


def _check_classes(cache: list, path) -> str:
    from mlx_lm.models.cache import KVCache, QuantizedKVCache

    names = sorted({type(c).__name__ for c in cache})
    if all(type(c) is KVCache for c in cache):
        return "KVCache"
    if all(type(c) is QuantizedKVCache for c in cache):
        return "QuantizedKVCache"
    why = ""
    if "RotatingKVCache" in names:
        why = ("; RotatingKVCache (sliding-window layers or --max-kv-size) keeps only the last window, "
               "not every token's KV")
    elif "ArraysCache" in names:
        why = "; ArraysCache (state layers) holds the final state only, not one per block"
    raise InteropError(f"{path}: cache layers of type {', '.join(names)} cannot be imported (plain KVCache "
                       f"or QuantizedKVCache only){why}")


def _reference_cache(engine: Engine, token: int, quantized: bool) -> list:
    """The model's own cache after one token (quantized as the engine quantizes, if `quantized`)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    ref = make_prompt_cache(engine.model)
    engine.model(mx.array([[token]]), cache=ref)
    if quantized and engine.quant is not None:
        ref = [c.to_quantized(group_size=engine.quant.group_size, bits=engine.quant.bits)
               if hasattr(c, "to_quantized") else c for c in ref]
    mx.eval([c.state for c in ref])
    return ref


def _check_shapes(engine: Engine, cache: list, tokens: Sequence[int], path) -> None:
    """Same layer count, batch 1, heads / head dims / packed widths and dtypes as the model's cache."""
    from mlx_lm.models.cache import KVCache, QuantizedKVCache

    ref = _reference_cache(engine, int(tokens[0]), file_quantization(cache) is not None)
    if len(ref) != len(cache):
        raise InteropError(f"{path}: {len(cache)} cache layers, the model has {len(ref)}: made with another model")
    for i, (c, r) in enumerate(zip(cache, ref)):
        if type(r) not in (KVCache, QuantizedKVCache):
            raise InteropError(f"the model's layer {i} uses {type(r).__name__}: not importable")
        if type(c) is not type(r):
            raise InteropError(f"{path}: layer {i} is {type(c).__name__}, the model's cache is {type(r).__name__} here")
        if c.keys is None:
            raise InteropError(f"{path}: layer {i} is empty")
        for a, b in zip(_arrays(c), _arrays(r)):
            if a.ndim != 4 or a.shape[0] != 1:
                raise InteropError(f"{path}: layer {i} arrays of shape {tuple(a.shape)}; expected [1, heads, tokens, dim]")
            if (a.shape[1], a.shape[3], a.dtype) != (b.shape[1], b.shape[3], b.dtype):
                raise InteropError(
                    f"{path}: layer {i} has KV [heads {a.shape[1]}, dim {a.shape[3]}, {a.dtype}] but the model's is "
                    f"[heads {b.shape[1]}, dim {b.shape[3]}, {b.dtype}]: another model or KV dtype")


def _check_quantization(engine: Engine, cache: list, n: int, path) -> None:
    """The file is quantized exactly when mlx-lm's generate_step leaves an n-token prompt quantized."""
    q = engine.quant
    fq = file_quantization(cache)
    if fq is not None and (q is None or (q.bits, q.group_size) != fq):
        raise InteropError(f"{path}: the KV is quantized ({fq[0]} bits, group {fq[1]}); load the engine with "
                           f"kv_bits={fq[0]}, kv_group_size={fq[1]}")
    if q is None:
        return
    switched = q.switch_point(n) <= n  # mlx-lm quantizes after the call ending at >= start
    if switched and fq is None:
        raise InteropError(f"{path}: plain KV, but mlx-lm with --kv-bits {q.bits} --quantized-kv-start {q.start} "
                           f"quantizes a {n}-token prompt; pass the --quantized-kv-start the file was made with")
    if not switched and fq is not None:
        raise InteropError(f"{path}: quantized KV, but mlx-lm with --quantized-kv-start {q.start} leaves a {n}-token "
                           "prompt unquantized; pass the --quantized-kv-start the file was made with")


def truncated(c, n: int):
    """A new cache layer holding the first `n` tokens of `c` (same class)."""
    from mlx_lm.models.cache import KVCache, QuantizedKVCache

    keys, values = c.keys, c.values  # (mlx-lm declares them None until a cache is filled: read untyped)
    out: Any
    if type(c) is QuantizedKVCache:
        out = QuantizedKVCache(group_size=c.group_size, bits=c.bits)
        out.keys = tuple(a[..., :n, :] for a in keys)
        out.values = tuple(a[..., :n, :] for a in values)
    else:
        out = KVCache()
        out.keys, out.values = keys[..., :n, :], values[..., :n, :]
    out.offset = n
    return out


def _dense(c, lo: int, hi: int) -> list:
    """Keys and values of tokens [lo, hi) as float32 (dequantized for a quantized layer)."""
    import mlx.core as mx

    if isinstance(c.keys, (tuple, list)):  # (packed words, scales, biases): mlx-lm's affine quantization
        out = []
        for kv in (c.keys, c.values):
            w, scales, biases = (a[..., lo:hi, :] for a in kv)
            out.append(mx.dequantize(w, scales, biases, group_size=c.group_size, bits=c.bits).astype(mx.float32))
        return out
    return [c.keys[..., lo:hi, :].astype(mx.float32), c.values[..., lo:hi, :].astype(mx.float32)]


def _max_abs(a) -> float:
    """max|a| of a float32 array, as a Python float."""
    import mlx.core as mx

    return float(cast(float, mx.max(mx.abs(a)).item()))  # (item() of a float array is a float)


def kv_check(engine: Engine, cache: list, tokens: Sequence[int], tail: int = DEFAULT_CHECK_TOKENS,
             spread: int = DEFAULT_CHECK_POSITIONS) -> tuple[int, float]:
    """Recompute KV from the file's own KV and compare: the last `tail` tokens in one model call
    (from the file's KV of the tokens before them), and `spread` single tokens evenly spread over
    the rest (each from the file's KV before it: one decode step each). The KV of a token depends
    on its id, so every checked position verifies its token id (and the model); unchecked
    positions are verified by the token count only.

    Returns:
        (tokens checked, largest relative difference max|a-b| / max|b| over layers and checks).
    """
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache, QuantizedKVCache

    n = len(tokens)
    k = min(max(tail, 0), n - 1)
    lo = n - k
    rest = lo  # positions [0, lo) are candidates for single-token checks
    m = min(max(spread, 0), rest)
    singles = sorted({int(i * rest / m) for i in range(m)} | ({rest - 1} if m else set())) if m else []
    worst = 0.0

    def compare(start: int, stop: int) -> None:
        nonlocal worst
        if start == 0:
            probe = [QuantizedKVCache(group_size=c.group_size, bits=c.bits) if type(c) is QuantizedKVCache
                     else KVCache() for c in cache]
        else:
            probe = [truncated(c, start) for c in cache]
        engine.model(mx.array([list(tokens[start:stop])], dtype=mx.int32), cache=probe)
        for c, p in zip(cache, probe):
            for a, b in zip(_dense(p, start, stop), _dense(c, start, stop)):
                scale = max(_max_abs(b), 1e-6)
                worst = max(worst, _max_abs(a - b) / scale)

    for t in singles:
        compare(t, t + 1)
    if k > 0:
        compare(lo, n)
    return k + len(singles), worst


def _tolerance(engine: Engine) -> float:
    if engine.quant is not None:
        return KV_TOLERANCE_QUANTIZED
    return KV_TOLERANCE.get(engine.cache.kv.dtype if engine.cache.kv is not None else "", 5e-2)


def check_writable(engine: Engine) -> None:
    """The engine can store blocks and write them to SSD.

    Raises:
        InteropError: uncacheable model, SSD tier off, disabled or read-only.
    """
    problem = ssd_write_problem(engine, "import")
    if problem is not None:
        raise InteropError(problem)


# --------------------------------------------------------------------------- import
def import_cache_file(
    engine,
    path: str | Path,
    tokens: Sequence[int] | None = None,
    *,
    model_spec: str,
    adapter_path: str | None = None,
    require_model_match: bool = True,
    check_tokens: int = DEFAULT_CHECK_TOKENS,
    check_positions: int = DEFAULT_CHECK_POSITIONS,
    token_source: str = "prompt_chat_template",
    preloaded: tuple[list, dict[str, str]] | None = None,
) -> ImportReport:
    """Import an mlx-lm prompt-cache file into the engine's SSD tier (see the module docstring).

    Args:
        engine: a `kvtool.engine.Engine` (quantized alike if the file is: `file_quantization`).
        path: the `.safetensors` file.
        tokens: the prompt's token ids (`cache_prompt_tokens`); None: the file's
            `kvtool_token_ids` metadata.
        model_spec: the `--model` the engine was loaded from (compared with the metadata).
        adapter_path: the engine's LoRA adapter (part of the weights digest).
        require_model_match: False: a mismatching or unverifiable model is a warning.
        check_tokens, check_positions: the KV check (`kv_check`; both 0: none).
        token_source: recorded in the report.
        preloaded: `load_cache_file(path)` if the caller has it already.

    Returns:
        The report (`verified`: every token is on SSD after the flush). The caller closes the
        engine.

    Raises:
        InteropError: any check failed (nothing written), or the SSD tier is unusable.
    """
    t0 = time.perf_counter()
    check_writable(engine)
    cache, metadata = preloaded if preloaded is not None else load_cache_file(path)
    report = ImportReport(file=str(resolve_cache_file(path)), file_model=metadata.get("model"))
    ids, report.token_source = _prompt_ids(path, tokens, metadata, token_source)
    report.prompt_tokens = len(ids)
    _check_file_cache(engine, cache, ids, path, report)
    if (warning := digest_warning(metadata, path)) is not None:
        report.warnings.append(warning)
    _check_model_and_kv(engine, cache, ids, path, report, model_spec, adapter_path, require_model_match,
                        check_tokens, check_positions)  # fmt: skip
    pc = engine.cache
    report.layout_key, report.namespace_dir = pc.layout_key, str(pc.namespace_dir)
    base = pc.stats().to_dict()
    report.entries_stored = pc.store(ids, cache, persist=True)
    report.flushed = pc.flush()
    write_counts(base, pc.stats().to_dict()).set_on(report)
    report.cached_tokens = pc.probe(ids)
    report.verified = report.cached_tokens == len(ids)
    report.elapsed_s = round(time.perf_counter() - t0, 3)
    return report


def _prompt_ids(path, tokens: Sequence[int] | None, metadata: dict[str, str], token_source: str) -> tuple[list[int], str]:
    """The prompt's token ids and where they came from: `tokens`, else the file's
    `kvtool_token_ids` metadata (which `tokens` must equal where both are given).

    Raises:
        InteropError: no ids, or ids that differ from the file's.
    """
    meta_ids = file_token_ids(metadata)
    if tokens is None:
        if meta_ids is None:
            raise InteropError(f"{path}: mlx-lm prompt caches hold no token ids: give the prompt "
                               "(--prompt / --prompt-file, tokenised as mlx_lm.cache_prompt does) or --token-ids")
        tokens, token_source = meta_ids, "metadata"
    elif meta_ids is not None and list(meta_ids) != list(tokens):
        raise InteropError(f"{path}: the prompt's {len(tokens)} tokens differ from the {len(meta_ids)} token ids "
                           "the file records (kvtool_token_ids)")
    ids = [int(t) for t in tokens]
    if not ids:
        raise InteropError("the prompt has no tokens")
    return ids, token_source


def _check_file_cache(engine: Engine, cache: list, ids: list[int], path, report: ImportReport) -> None:
    """The file's cache fits the engine: plain classes, one token count equal to the prompt's,
    no sliding-window or state layers, the same quantisation and shapes (`report` gets the cache
    type and quantisation).

    Raises:
        InteropError: the first check that fails.
    """
    report.cache_type = _check_classes(cache, path)
    fq = file_quantization(cache)
    if fq is not None:
        report.kv_bits, report.kv_group_size = fq
    offsets = sorted({int(c.offset) for c in cache})
    if len(offsets) != 1:
        raise InteropError(f"{path}: layers hold different token counts {offsets}")
    if offsets[0] != len(ids):
        how = TOKEN_SOURCES.get(report.token_source, report.token_source)
        raise InteropError(
            f"{path}: the cache holds {offsets[0]} tokens but the prompt has {len(ids)} ({how}); "
            "it must be the exact prompt the file was made from",
            hint=("mlx_lm.cache_prompt wraps the prompt in the chat template (kvtool's default); "
                  "--ignore-chat-template tokenises raw text" if report.token_source.startswith("prompt") else None))
    if engine.cache.windows or engine.cache.has_states:
        raise InteropError("this model has sliding-window or state layers: its prompt-cache files cannot be imported")
    _check_quantization(engine, cache, len(ids), path)
    _check_shapes(engine, cache, ids, path)


def _check_model_and_kv(engine: Engine, cache: list, ids: list[int], path, report: ImportReport, model_spec: str,
                        adapter_path: str | None, require_model_match: bool, check_tokens: int,
                        check_positions: int) -> None:  # fmt: skip
    """The file's model is the engine's (`check_model`; a warning only without
    `require_model_match`), and the KV of its last tokens is what the model computes (`kv_check`).

    Raises:
        InteropError: another model, or KV beyond the tolerance (`_tolerance`).
    """
    mc = check_model(report.file_model, model_spec, engine.loaded, adapter_path)
    report.model_check = mc.status if require_model_match else "skipped"
    report.model_check_detail = mc.detail
    if mc.status != "match":
        if require_model_match:
            raise InteropError(f"model check failed: {mc.detail}",
                               hint="pass the same --model as mlx_lm.cache_prompt got, or --skip-model-check")
        report.warnings.append(f"model not verified: {mc.detail}")
    report.kv_check_tokens, report.kv_check_max_rel_diff = kv_check(engine, cache, ids, check_tokens, check_positions)
    tol = _tolerance(engine)
    if report.kv_check_tokens and report.kv_check_max_rel_diff > tol:
        raise InteropError(
            f"{path}: the KV of {report.kv_check_tokens} recomputed tokens is not what the model computes for them "
            f"(relative difference {report.kv_check_max_rel_diff:.3g} > {tol:g}): another model or another prompt")


__all__ = ["InteropError", "ImportReport", "ExportReport", "kv_check", "check_writable", "import_cache_file",
           "DEFAULT_CHECK_TOKENS", "EXIT_NOT_CACHED"]
