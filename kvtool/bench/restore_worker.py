"""Fresh-process measurements of the restore benchmark, and the synthetic KV they share.

The parent (`kvtool.bench.restore`) prepares files, drops or warms the page cache, then runs one
measurement per process:

    python -m kvtool.bench.restore_worker MODE '<json args>'

and reads one JSON object from the last line of stdout. Modes:

- `raw`: `os.preadv` of a file into a preallocated, pre-faulted numpy buffer (the disk ceiling).
- `mlxlm`: `load_prompt_cache` + `mx.eval` of every layer's keys and values, token ids checked.
- `kvtool`: `fetch` through `open_prefix_cache` + `mx.eval` of the restored cache.
- `writer`: store + flush synthetic KV through kvtool (best_effort), then `os.sync()`.
- `ttft_seed_synthetic`: both caches of a prompt seeded with the same synthetic KV (no prefill).
- `mlxlm_ttft_save` / `mlxlm_ttft`: mlx-lm's own prompt cache on a real model: save the KV of
  `ids[:-1]`; later, in a fresh process after a warm-up forward, time `load_prompt_cache` + the
  first (greedy) token of mlx-lm's `generate_step` over the last token: what an mlx-lm user
  runs (its first token also dispatches the second step; kvtool's engine samples the first token
  itself, `kvtool.kv.decode`).

Peak RSS of a restore: `/proc/self/clear_refs` ← "5" resets VmHWM to the current RSS just before
the timed region; `peak_rss_bytes` = VmHWM after it − VmRSS before it (Linux; None elsewhere).
`first_append_ms`: one token appended to every layer (`update_and_fetch` + eval) right after the
restore — what the first decode step pays on top of attention (a cache without spare room is
copied whole). `kv_crc`: crc32 of the restored KV, checked by the parent against the stored KV.

`open_prefix_cache` is the benchmark's one door into kvtool's store/restore API: the public
`kvtool.cache.prefix.PrefixCache` on synthetic KV of a `KVShape` (a full hit comes back trimmed
by one token, `cached_tokens = T - 1`, the last one being re-forwarded).
"""

from __future__ import annotations

import json
import os
import sys
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvtool.bench.loadserver import proc_status_kb

TOKENS_METADATA_KEY = "kvtool_bench_tokens"  # same key as the bench's mlx-lm baseline
READ_CHUNK_BYTES = 64 << 20
PREFILL_STEP = 2048
API_CHOICES = ("auto", "prefix")


@dataclass(frozen=True)
class KVShape:
    """A KV layout to benchmark: `name` labels rows (`tiny`, `qwen0.5b`)."""

    name: str
    n_layers: int
    n_kv_heads: int
    head_dim: int
    dtype: str  # float32 | bfloat16 | float16

    @property
    def itemsize(self) -> int:
        return 4 if self.dtype == "float32" else 2

    def bytes_per_token(self) -> int:
        """KV bytes per token over all layers, keys + values."""
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * self.itemsize

    @property
    def model_id(self) -> str:
        return f"synthetic-{self.name}"


def resolve_api(api: str = "auto") -> str:
    """The restore API a run uses: `prefix` (`kvtool.cache.prefix.PrefixCache`) for `auto` or `prefix`.

    Raises:
        ValueError: unknown `api`.
    """
    if api not in API_CHOICES:
        raise ValueError(f"api must be one of {', '.join(API_CHOICES)}, got {api!r}")
    return "prefix"


def open_prefix_cache(cache_dir: Path, shape: KVShape, *, async_writes: bool = False,
                      block_size: int | None = None) -> Any:
    """A `kvtool.cache.prefix.PrefixCache` on the SSD tier `cache_dir` (no RAM tier, best_effort)
    for synthetic KV of `shape` (its `model_id` names the namespace), with the background writer
    or inline writes, `block_size` tokens per block (None: kvtool's default)."""
    from kvtool.cache.prefix import KVGeometry, PrefixCache
    from kvtool.config import KVToolConfig

    extra = {"block_size": block_size} if block_size else {}
    config = KVToolConfig(ssd_cache_dir=Path(cache_dir), ram_bytes=0, ssd_async_writes=async_writes,
                          ssd_durability="best_effort", **extra)
    geometry = KVGeometry(shape.n_layers, shape.n_kv_heads, shape.head_dim, dtype=shape.dtype)
    return PrefixCache(config, geometry=geometry, model_id=shape.model_id)


# ---------------------------------------------------------------- synthetic KV
def token_ids(n: int, seed: int = 0, vocab: int = 32000) -> np.ndarray:
    """Deterministic int32 token ids `[n]` (the same for mlx-lm and kvtool)."""
    return np.random.default_rng(seed + n).integers(0, vocab, size=n, dtype=np.int32)


def synthetic_kv(shape: KVShape, n_tokens: int, seed: int = 0) -> list[tuple[Any, Any]]:
    """Random per-layer (keys, values) mx arrays `[1, n_kv_heads, n_tokens, head_dim]`, evaluated."""
    import mlx.core as mx

    dtype = getattr(mx, shape.dtype)
    dims = (1, shape.n_kv_heads, n_tokens, shape.head_dim)
    pairs = []
    for layer in range(shape.n_layers):
        k1, k2 = mx.random.split(mx.random.key(seed * 1000 + layer))
        pair = (mx.random.normal(dims, key=k1).astype(dtype), mx.random.normal(dims, key=k2).astype(dtype))
        mx.eval(pair)
        pairs.append(pair)
    return pairs


def make_cache(pairs: Sequence[tuple[Any, Any]]) -> list:
    """Per-layer mlx-lm `KVCache`s holding exactly the given arrays (no spare room)."""
    from mlx_lm.models.cache import KVCache

    caches = []
    for k, v in pairs:
        c = KVCache()
        c.state = (k, v, int(k.shape[2]))
        caches.append(c)
    return caches


def host_bytes(a) -> memoryview:
    """The bytes of an mx array (bfloat16 as its uint16 bit pattern), C order."""
    import mlx.core as mx

    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    return np.ascontiguousarray(np.asarray(a)).data


def kv_crc(pairs: Sequence[tuple[Any, Any]], n_tokens: int) -> int:
    """crc32 over every layer's keys then values, first `n_tokens` positions only."""
    crc = 0
    for k, v in pairs:
        for a in (k, v):
            crc = zlib.crc32(host_bytes(a[..., :n_tokens, :]), crc)
    return crc


def cache_pairs(cache: list) -> list[tuple[Any, Any]]:
    return [(c.keys, c.values) for c in cache]


def write_raw(path: Path, pairs: Sequence[tuple[Any, Any]]) -> int:
    """Write the KV bytes, layer by layer, to one file; returns the bytes written."""
    total = 0
    with open(path, "wb") as fh:
        for k, v in pairs:
            for a in (k, v):
                total += fh.write(host_bytes(a))
    return total


def load_mlxlm(path: Path | str, ids: np.ndarray) -> tuple[list, bool]:
    """`load_prompt_cache` + eval of every layer's keys and values: (the caches, True if the token
    ids in the file's metadata are `ids`)."""
    import mlx.core as mx
    from mlx_lm.models.cache import load_prompt_cache

    cache, meta = load_prompt_cache(str(path), return_metadata=True)
    mx.eval(cache_pairs(cache))
    return cache, json.loads(meta[TOKENS_METADATA_KEY]) == ids.tolist()


def save_mlxlm(path: Path, cache: list, ids: np.ndarray) -> int:
    """`save_prompt_cache` of per-layer mlx-lm caches, token ids `ids` in the metadata (as the bench
    baseline does); returns the file size (bytes)."""
    from mlx_lm.models.cache import save_prompt_cache

    save_prompt_cache(str(path), cache, metadata={TOKENS_METADATA_KEY: json.dumps(ids.tolist())})
    return path.stat().st_size


def store_kv(cache_dir: Path, shape: KVShape, ids: np.ndarray, cache: list, *, async_writes: bool = False,
             block_size: int | None = None) -> None:
    """Store `cache` (the KV of token ids `ids`) through `open_prefix_cache`, flush and close."""
    pc = open_prefix_cache(cache_dir, shape, async_writes=async_writes, block_size=block_size)
    pc.store(ids, cache)
    pc.flush()
    pc.close()


# ---------------------------------------------------------------- memory
class PeakRSS:
    """Peak RSS growth over a region: reset VmHWM (clear_refs 5), read VmRSS, then VmHWM after."""

    def __enter__(self) -> PeakRSS:
        try:
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            pass
        self.start_kb = proc_status_kb("VmRSS")
        self.bytes: int | None = None
        return self

    def __exit__(self, *exc) -> None:
        hwm = proc_status_kb("VmHWM")
        if hwm is not None and self.start_kb is not None:
            self.bytes = max(0, hwm - self.start_kb) * 1024


def first_append_ms(cache: list) -> float:
    """Time to append one token to every layer of `cache` (`update_and_fetch` + eval)."""
    import mlx.core as mx

    k0 = cache[0].keys
    tok = mx.zeros((1, k0.shape[1], 1, k0.shape[3]), dtype=k0.dtype)
    mx.eval(tok)
    t0 = time.perf_counter()
    out = [c.update_and_fetch(tok, tok) for c in cache]
    mx.eval(out)
    return (time.perf_counter() - t0) * 1e3


def append_after_prefill_ms(pairs: Sequence[tuple[Any, Any]]) -> float:
    """The reference for `first_append_ms`, a decode step's append after a cold prefill: fill
    fresh `KVCache`s as a prefill does (`update_and_fetch` in 2,048-token chunks), append one
    token untimed (it grows the buffers when the prompt filled them exactly), time the next."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    caches = [KVCache() for _ in pairs]
    n = int(pairs[0][0].shape[2])
    for i in range(0, n, PREFILL_STEP):
        for c, (k, v) in zip(caches, pairs):
            c.update_and_fetch(k[..., i : i + PREFILL_STEP, :], v[..., i : i + PREFILL_STEP, :])
        mx.eval([(c.keys, c.values) for c in caches])
    first_append_ms(caches)
    ms = first_append_ms(caches)
    del caches
    return ms


# ---------------------------------------------------------------- modes
def mode_raw(args: dict) -> dict:
    """Read `nbytes` of `path` with `os.preadv` into a pre-faulted buffer."""
    nbytes = int(args["nbytes"])
    buf = np.zeros(nbytes, dtype=np.uint8)
    buf.fill(1)  # fault every page in before timing
    view = buf.data
    fd = os.open(args["path"], os.O_RDONLY)
    try:
        with PeakRSS() as rss:
            t0 = time.perf_counter()
            off = 0
            while off < nbytes:
                n = os.preadv(fd, [view[off : off + READ_CHUNK_BYTES]], off)
                if n <= 0:
                    break
                off += n
            ms = (time.perf_counter() - t0) * 1e3
    finally:
        os.close(fd)
    return {"ms": ms, "bytes_io": off, "peak_rss_bytes": rss.bytes, "kv_crc": zlib.crc32(view[:off])}


def mode_mlxlm(args: dict) -> dict:
    """`load_prompt_cache` + eval; the token ids in the metadata are checked (as a user must)."""
    import mlx_lm.models.cache  # noqa: F401  (imported before the clock starts: ~1 s in a fresh process)

    ids = np.load(args["ids"])
    with PeakRSS() as rss:
        t0 = time.perf_counter()
        cache, same = load_mlxlm(args["path"], ids)
        ms = (time.perf_counter() - t0) * 1e3
    n = int(cache[0].offset)
    return {
        "ms": ms, "bytes_io": Path(args["path"]).stat().st_size, "peak_rss_bytes": rss.bytes,
        "cached_tokens": n, "tokens_ok": same, "first_append_ms": first_append_ms(cache),
        "kv_crc": kv_crc(cache_pairs(cache), n),
    }


def mode_kvtool(args: dict) -> dict:
    """`fetch` in this fresh process (index open timed apart as `open_ms`)."""
    import mlx.core as mx

    shape = KVShape(**args["shape"])
    ids = np.load(args["ids"])
    t_open = time.perf_counter()
    pc = open_prefix_cache(Path(args["cache_dir"]), shape, block_size=args.get("block_size"))
    open_ms = (time.perf_counter() - t_open) * 1e3
    with PeakRSS() as rss:
        t0 = time.perf_counter()
        hit = pc.fetch(ids)
        mx.eval(cache_pairs(hit.cache))
        ms = (time.perf_counter() - t0) * 1e3
    cached = int(hit.cached_tokens)
    out = {
        "ms": ms, "open_ms": open_ms, "bytes_io": int(hit.ssd_bytes_read), "peak_rss_bytes": rss.bytes,
        "cached_tokens": cached, "ssd_hit_tokens": int(hit.ssd_tokens), "ssd_load_ms": float(hit.ssd_load_ms),
        "kvtool_api": resolve_api(),
    }
    if cached:
        out["first_append_ms"] = first_append_ms(hit.cache)
        out["kv_crc"] = kv_crc(cache_pairs(hit.cache), cached)
    pc.release(hit)
    pc.close()
    return out


def mode_writer(args: dict) -> dict:
    """Store + flush `n_tokens` of synthetic KV through kvtool's async writer (best_effort).

    A first store of other token ids (same size) runs before the timed one and its files are
    deleted: the timed store is the steady state of a serving process (MLX's buffer cache and
    the page cache recycle memory), as dd is measured right after a scratch write. The first
    store's time is returned too (`first_ms`)."""
    import shutil

    shape = KVShape(**args["shape"])
    n = int(args["n_tokens"])
    seed = args.get("seed", 0)
    root = Path(args["cache_dir"])
    first_dir = root.parent / (root.name + "-first")
    ids, cache = token_ids(n, seed), make_cache(synthetic_kv(shape, n, seed))
    first_ids, first_cache = token_ids(n, seed + 1), make_cache(synthetic_kv(shape, n, seed + 1))
    t0 = time.perf_counter()
    store_kv(first_dir, shape, first_ids, first_cache, async_writes=True, block_size=args.get("block_size"))
    first_ms = (time.perf_counter() - t0) * 1e3
    del first_cache
    shutil.rmtree(first_dir)  # its page cache is free again for the timed store, right away
    pc = open_prefix_cache(root, shape, async_writes=True, block_size=args.get("block_size"))
    os.sync()
    with PeakRSS() as rss:
        t0 = time.perf_counter()
        pc.store(ids, cache)
        pc.flush()
        ms = (time.perf_counter() - t0) * 1e3
    t1 = time.perf_counter()
    os.sync()
    sync_ms = (time.perf_counter() - t1) * 1e3
    pc.close()
    written = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
    return {"ms": ms, "sync_ms": sync_ms, "first_ms": first_ms, "bytes_io": written, "peak_rss_bytes": rss.bytes,
            "kvtool_api": resolve_api()}


def mode_mlxlm_ttft_save(args: dict) -> dict:
    """Prefill `ids[:-1]` on the model and `save_prompt_cache` it (what an mlx-lm user keeps)."""
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.models.cache import make_prompt_cache

    model, *_ = mlx_lm.load(args["model_path"])
    ids = np.load(args["ids"])[:-1]
    cache = make_prompt_cache(model)
    for i in range(0, len(ids), PREFILL_STEP):
        model(mx.array(ids[i : i + PREFILL_STEP])[None], cache=cache)
        mx.eval(cache_pairs(cache))
    return {"bytes_io": save_mlxlm(Path(args["path"]), cache, ids)}


def mode_ttft_seed_synthetic(args: dict) -> dict:
    """Seed both caches of one prompt with the same synthetic KV instead of a prefill (a 32k
    prefill of the `qwen0.5b` shape takes hours on this CPU): random normal keys and values
    `[1, n_kv_heads, n, head_dim]` in the model's dtype for every layer, stored in kvtool's SSD
    tier through `Engine` (the namespace `serve-once` opens: same model, config and block size,
    `persist=True`, flushed) and, trimmed to `ids[:-1]`, as mlx-lm's prompt-cache file. Both
    TTFTs then forward the last token over the same KV, so their first tokens must agree."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from kvtool.config import KVToolConfig
    from kvtool.engine import Engine
    from kvtool.models.loader import load_model

    ids = np.load(args["ids"])
    n = int(ids.size)
    loaded = load_model(args["model"])
    cfg = {"ssd_cache_dir": args["cache_dir"], "ssd_async_writes": False}
    if args.get("block_size"):
        cfg["block_size"] = int(args["block_size"])
    engine = Engine(loaded, KVToolConfig(**cfg))
    cache = make_prompt_cache(loaded.model)
    dtype = loaded.model.parameters()["model"]["embed_tokens"]["weight"].dtype
    assert engine.cache.kv is not None, engine.cache.uncached_reason
    layers = engine.cache.kv.layers
    key = mx.random.key(int(args.get("seed", 0)))
    for (h, d_k, d_v), c in zip(layers, cache):
        k1, k2, key = mx.random.split(key, 3)
        c.keys = mx.random.normal((1, h, n, d_k), key=k1).astype(dtype)
        c.values = mx.random.normal((1, h, n, d_v), key=k2).astype(dtype)
        c.offset = n
        mx.eval(c.keys, c.values)
    stored = engine.cache.store(ids, cache, persist=True)
    engine.cache.flush()
    engine.close()
    for c in cache:
        c.trim(1)
    return {"entries": stored, "bytes_io": save_mlxlm(Path(args["path"]), cache, ids[:-1])}


def mode_mlxlm_ttft(args: dict) -> dict:
    """Warm-up forward, then time load_prompt_cache (+ token check) + the first token of
    `generate_step`, `max_tokens=1`, greedy."""
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    model, *_ = mlx_lm.load(args["model_path"])
    ids = np.load(args["ids"])
    warm = make_prompt_cache(model)
    mx.eval(model(mx.array(ids[:8])[None], cache=warm))  # kernels and weights touched before timing
    del warm
    t0 = time.perf_counter()
    cache, same = load_mlxlm(args["path"], ids[:-1])
    load_ms = (time.perf_counter() - t0) * 1e3
    cached = int(cache[0].offset)
    token, _ = next(generate_step(mx.array(ids[-1:]), model, max_tokens=1, prompt_cache=cache))
    ms = (time.perf_counter() - t0) * 1e3
    return {"ms": ms, "ssd_load_ms": load_ms, "bytes_io": Path(args["path"]).stat().st_size,
            "cached_tokens": cached, "first_token": int(token), "tokens_ok": same}


MODES: dict[str, Callable[[dict], dict]] = {
    "raw": mode_raw,
    "mlxlm": mode_mlxlm,
    "kvtool": mode_kvtool,
    "writer": mode_writer,
    "mlxlm_ttft_save": mode_mlxlm_ttft_save,
    "mlxlm_ttft": mode_mlxlm_ttft,
    "ttft_seed_synthetic": mode_ttft_seed_synthetic,
}


def main(argv: list[str] | None = None) -> int:
    """`python -m kvtool.bench.restore_worker MODE JSON`: print one JSON object."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2 or argv[0] not in MODES:
        print(f"usage: restore_worker {{{','.join(MODES)}}} JSON_ARGS", file=sys.stderr)
        return 2
    result = MODES[argv[0]](json.loads(argv[1]))
    sys.stdout.write("\n" + json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
