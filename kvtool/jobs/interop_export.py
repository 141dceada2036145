"""Export of a cached prompt as an mlx-lm prompt-cache file (`kvtool export`) that
`mlx_lm.generate --prompt-cache-file` loads: `PrefixCache.fetch` must find every prompt token
(`fill=True` computes the missing ones instead of refusing); the cache is brought to mlx-lm's own
state after its prefill (`_generation_state`), so the file equals what `mlx_lm.cache_prompt` writes
for the same tokens, then written atomically and read back. Metadata: `model`, `tokenizer_config`
and `chat_template` (the keys mlx-lm's generate reads, across versions), plus `kvtool_*` keys."""

from __future__ import annotations

import json
import os
import secrets
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from kvtool.jobs.interop import EXIT_NOT_CACHED, ExportReport, InteropError, truncated
from kvtool.jobs.interop_files import KV_DIGEST_KEY, SUFFIX, kv_digest

if TYPE_CHECKING:
    from kvtool.engine import Engine  # (MLX: for annotations only)


def _mlx_state_cache(engine: Engine, cache: list, n: int) -> list:
    """mlx-lm's own cache after its prefill of a prompt's first `n` tokens, from kvtool's
    prefill cache holding them: sliding-window full views become `RotatingKVCache`
    (`rotating_from_full`), every other layer stays (state layers hold the state after `n`)."""
    import mlx.core as mx
    from mlx_lm.models.cache import ArraysCache

    from kvtool.kv.windows import rotating_from_full

    windows = engine.cache.windows or (None,) * len(cache)
    out = [rotating_from_full(c, n, w, engine.prefill_step_size) if w is not None and not isinstance(c, ArraysCache)
           else c for c, w in zip(cache, windows)]
    mx.eval([c.state for c in out if isinstance(c, ArraysCache) or c.keys is not None])
    return out


def _compact(c):
    """A plain / quantized layer whose arrays end at its offset (the file then holds no padding)."""
    from mlx_lm.models.cache import KVCache, QuantizedKVCache

    if type(c) in (KVCache, QuantizedKVCache) and c.keys is not None:
        return truncated(c, int(c.offset))
    return c


def export_cache_file(
    engine,
    tokens: Sequence[int],
    out: str | Path,
    *,
    metadata_model: str,
    fill: bool = False,
    extra_metadata: dict[str, str] | None = None,
) -> ExportReport:
    """Write the prompt's cached KV as an mlx-lm prompt-cache file (see the module docstring) and
    return the `ExportReport`.

    Args:
        engine: a `kvtool.engine.Engine` (its namespace: kv_bits, block size as when cached).
        tokens: the prompt's token ids (`cache_prompt_tokens` for `mlx_lm.generate` use).
        out: the file to write (`*.safetensors`; replaced atomically).
        metadata_model: the metadata `model` (`metadata_model_for`).
        fill: compute the tokens the tiers lack instead of refusing (nothing is stored).
        extra_metadata: more string metadata.

    Raises:
        InteropError: bad output name, uncacheable model, or (exit code 1) the prompt is not
            fully cached and `fill` is False. Nothing is written then.
    """
    t0 = time.perf_counter()
    out = _output_path(out)
    ids = [int(t) for t in tokens]
    n = len(ids)
    if n == 0:
        raise InteropError("the prompt has no tokens")
    if engine.uncached_reason is not None:
        raise InteropError(f"this model is not cached by kvtool: {engine.uncached_reason}")
    pc = engine.cache
    report = ExportReport(out=str(out), metadata_model=metadata_model, prompt_tokens=n, layout_key=pc.layout_key)
    hit = pc.fetch(ids, full_views=True)
    try:
        # Every entry found (blocks and tail): trimmed to n-1, the last token is re-forwarded.
        # All but the last token (no tail entry): the same, as the last token is recomputed anyway.
        whole_chain = hit.entries_found == len(hit.hashes) + (hit.tail is not None) and hit.entries_found > 0
        full = hit.cached_tokens >= n - 1
        tiers_hold = n if whole_chain else hit.cached_tokens
        if not full and not fill:
            raise _not_cached(pc.config.block_size, n, tiers_hold, pc.layout_key)
        report.cached_tokens = tiers_hold
        report.ram_hit_tokens = hit.ram_tokens + (1 if whole_chain and not hit.ssd_tokens else 0)
        report.ssd_hit_tokens = hit.ssd_tokens + (1 if whole_chain and hit.ssd_tokens else 0)
        report.remote_hit_tokens = hit.remote_tokens
        gen = _generation_state(engine, hit, ids)
        report.computed_tokens = int(hit.remaining.size)
        _write_checked(out, gen, _metadata(engine, metadata_model, ids, extra_metadata, kv_digest(gen, ids)), ids)
        report.cache_types = sorted({type(c).__name__ for c in gen})
        report.bytes = out.stat().st_size
    finally:
        if not hit.cache:
            hit.cache = []
        pc.release(hit)
    report.elapsed_s = round(time.perf_counter() - t0, 3)
    return report


def _metadata(engine: Engine, metadata_model: str, ids: list[int], extra: dict[str, str] | None,
              digest: str) -> dict[str, str]:  # fmt: skip
    """The file's string metadata: mlx-lm's (`model`, `tokenizer_config`, `chat_template`),
    kvtool's token ids, layout key and KV digest (`interop_files.kv_digest`), then `extra`."""
    return {
        "model": metadata_model,
        "tokenizer_config": json.dumps({"trust_remote_code": False}),
        "chat_template": str(getattr(engine.tokenizer, "chat_template", None) or ""),
        "kvtool_token_ids": json.dumps(ids),
        "kvtool_layout_key": str(engine.cache.layout_key),
        KV_DIGEST_KEY: digest,
        **(extra or {}),
    }


def _output_path(out: str | Path) -> Path:
    """`out` as the file to write: named `*.safetensors` (mlx-lm's loader picks the format by the
    suffix), not a directory, in a directory that exists.

    Raises:
        InteropError: it is not.
    """
    out = Path(out).expanduser()
    if out.suffix != SUFFIX:
        raise InteropError(f"{out}: the output must be named *{SUFFIX} (mlx-lm's loader picks the format by the suffix)")
    if out.is_dir():
        raise InteropError(f"{out} is a directory")
    if not out.parent.is_dir():
        raise InteropError(f"directory not found: {out.parent}")
    return out


def _not_cached(block_size: int, n: int, tiers_hold: int, layout_key: str) -> InteropError:
    """The refusal (exit `EXIT_NOT_CACHED`) of a prompt of `n` tokens whose tiers hold `tiers_hold`."""
    if tiers_hold == (n // block_size) * block_size and tiers_hold > 0:
        hint = (f"only the last {n - tiers_hold} token(s), less than a block, are missing (serve-once and warm "
                "cache a chat prompt with its assistant turn, so its tail differs): --fill computes them")
    else:
        hint = ("warm it first (kvtool warm / serve-once with the same model, block size and tokenisation) "
                "or pass --fill to compute the rest")
    return InteropError(f"the prompt is not fully cached: {tiers_hold} of its {n} tokens are (namespace {layout_key})",
                        exit_code=EXIT_NOT_CACHED, hint=hint)


def _generation_state(engine: Engine, hit, ids: list[int]) -> list:
    """mlx-lm's cache after its own prefill of the prompt `ids`: the hit's cache (the rest
    prefilled kvtool's exact way where `--fill` left some), trimmed to all but the last token,
    then the last token forwarded alone and mlx-lm's quantisation check, as its last prefill
    step does; compacted and evaluated."""
    import mlx.core as mx
    from mlx_lm.generate import maybe_quantize_kv_cache

    n = len(ids)
    cache = hit.cache or engine.new_cache()
    states: dict | None = {} if engine.cache.has_states else None
    if hit.remaining.size > 1:  # only with fill: kvtool's exact prefill (chunks, quant switch, states)
        engine.prefill_into(cache, hit.remaining[:-1], n, hit.cached_tokens, states)
    gen = _mlx_state_cache(engine, cache, n - 1)
    engine.model(mx.array([[ids[-1]]], dtype=mx.int32), cache=gen)
    q = engine.quant
    if q is not None:
        maybe_quantize_kv_cache(gen, q.start, q.group_size, q.bits)
    gen = [_compact(c) for c in gen]
    mx.eval([c.state for c in gen])
    return gen


def _write_checked(out: Path, gen: list, metadata: dict[str, str], ids: list[int]) -> None:
    """Save `gen` with `metadata` as mlx-lm's `save_prompt_cache` does, through a temp file in
    `out`'s directory that is loaded back and checked to hold the prompt `ids` (its token count
    and its `kvtool_kv_digest`), then renamed to `out`.

    Raises:
        InteropError: `out`'s directory cannot be written, or the written file does not hold the
            prompt (nothing is left behind).
    """
    from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

    tmp = str(out.parent / f".{out.stem}.{secrets.token_hex(8)}{SUFFIX}")
    try:  # mode 0o666 less the umask, as mlx-lm's own files (mkstemp's 0o600 is not what mlx-lm users get)
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    except OSError as exc:  # a read-only or full file system, no write permission
        raise InteropError(f"{out}: cannot write in {out.parent}: {exc.strerror or exc}") from None
    try:
        save_prompt_cache(tmp, gen, metadata)
        check = load_prompt_cache(tmp)
        offsets = [int(c.offset) for c in check if hasattr(c, "offset")]
        if offsets != [len(ids)] * len(offsets) or kv_digest(check, ids) != metadata[KV_DIGEST_KEY]:
            raise InteropError(f"{out}: the written file does not read back as the {len(ids)} tokens' KV (internal error)")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


__all__ = ["export_cache_file"]
