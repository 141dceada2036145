"""Restore per request in a long-lived process: kvtool's SSD `fetch` against mlx-lm's
`load_prompt_cache`, alternated in ONE process, both files in the page cache.

`bench_configs/restore.py` times each restore in a fresh process (what a restart pays: first
allocations fault their pages in, first calls). A server restores many times in one process:
MLX's buffer cache recycles freed arrays, and the per-request fixed costs (index rows, segment
headers, per-block checks) are what is left. This script measures that case: per length, the
same synthetic `tiny`-shaped KV (1 KiB per token) stored through kvtool (SSD tier only, default
block size) and saved with mlx-lm's `save_prompt_cache`; both files read once; `--warmup` untimed
restores of each; then `--iters` rounds of (kvtool fetch + eval, mlx-lm load + eval + token-id
check), the order swapped every round, each followed by its first decode step's append (one
token into every layer, `restore_worker.first_append_ms`: mlx-lm's loaded cache has no spare room,
so its first append copies the cache whole; kvtool's restore leaves room); with `--blocks`, each
restorer on its own for half its rounds, twice (A B A B: a process restores through one of them,
and MLX's buffer cache, 32 MiB on the CPU, then holds only its buffers). Every kvtool restore's
KV is compared (crc32) with mlx-lm's once. Prints per length the median (min-max) ms of each
restore, the ratio of medians, and the ratio of the medians of restore + first append.

    .venv/bin/python bench_configs/restore_steady.py
    .venv/bin/python bench_configs/restore_steady.py --lengths 4096,16384,32768 --iters 30 --json out.json
    .venv/bin/python bench_configs/restore_steady.py --blocks
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import mlx.core as mx  # noqa: E402
import mlx_lm.models.cache  # noqa: E402,F401  (imported before any clock starts)

from kvtool.bench import restore_worker as rw  # noqa: E402
from kvtool.bench.restore import SHAPES  # noqa: E402
from kvtool.bench.restore_pagecache import warm  # noqa: E402


def measure(shape: rw.KVShape, n: int, root: Path, iters: int, warmup: int, blocks: bool = False) -> dict:
    """One length: both restores in this process, alternated (or in blocks); times in ms."""
    ids = rw.token_ids(n)
    pairs = rw.synthetic_kv(shape, n)
    cache_dir, mlx_file = root / f"kvtool-{n}", root / f"mlxlm-{n}.safetensors"
    rw.store_kv(cache_dir, shape, ids, rw.make_cache(pairs))
    rw.save_mlxlm(mlx_file, rw.make_cache(pairs), ids)
    want_crc = rw.kv_crc(pairs, n - 1)
    del pairs
    mx.clear_cache()  # the setup's freed arrays would hold MLX's buffer cache (32 MiB on the CPU) for good
    warm([mlx_file, cache_dir])  # into the page cache
    pc = rw.open_prefix_cache(cache_dir, shape)

    def kvtool() -> tuple[float, float]:
        t0 = time.perf_counter()
        hit = pc.fetch(ids)
        mx.eval(rw.cache_pairs(hit.cache))
        ms = (time.perf_counter() - t0) * 1e3
        if hit.cached_tokens != n - 1:
            raise SystemExit(f"kvtool restored {hit.cached_tokens} tokens, expected {n - 1}")
        append = rw.first_append_ms(hit.cache)
        pc.release(hit)
        return ms, append

    def mlxlm() -> tuple[float, float]:
        t0 = time.perf_counter()
        cache, same = rw.load_mlxlm(mlx_file, ids)
        ms = (time.perf_counter() - t0) * 1e3
        if not same:
            raise SystemExit("mlx-lm's file holds other token ids")
        append = rw.first_append_ms(cache)
        del cache
        return ms, append

    hit = pc.fetch(ids)
    if rw.kv_crc(rw.cache_pairs(hit.cache), n - 1) != want_crc:
        raise SystemExit(f"kvtool's restored KV differs from the stored KV at {n} tokens")
    pc.release(hit)
    for _ in range(warmup):
        kvtool(), mlxlm()
    times: dict[str, list[float]] = {"kvtool": [], "mlx-lm": [], "kvtool+append": [], "mlx-lm+append": []}
    a, b = ("kvtool", kvtool), ("mlx-lm", mlxlm)
    if blocks:  # each restorer on its own for half its rounds, twice: A B A B
        first, second = (iters + 1) // 2, iters // 2
        schedule = [a] * first + [b] * first + [a] * second + [b] * second
    else:  # alternated, the order swapped every round
        schedule = [call for i in range(iters) for call in ((a, b) if i % 2 == 0 else (b, a))]
    for name, fn in schedule:
        ms, append = fn()
        times[name].append(ms)
        times[f"{name}+append"].append(ms + append)
    pc.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"tokens": n, "kv_bytes": n * shape.bytes_per_token(), "iters": iters,
            **{f"{k}_ms": {"median": med[k], "min": min(v), "max": max(v), "n": len(v)} for k, v in times.items()},
            "kvtool_over_mlxlm": med["kvtool"] / med["mlx-lm"],
            "with_first_append": med["kvtool+append"] / med["mlx-lm+append"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--lengths", default="4096,16384", help="prompt lengths (tokens), comma-separated")
    ap.add_argument("--shape", default="tiny", choices=sorted(SHAPES), help="KV shape (default: tiny)")
    ap.add_argument("--iters", type=int, default=25, help="alternated rounds per length (default 25)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed restores of each first (default 3)")
    ap.add_argument("--blocks", action="store_true",
                    help="each restorer on its own for half its rounds, twice (A B A B), instead of alternated "
                         "(a process that restores through one of them; MLX's buffer cache is not shared)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvtool-restore-steady-") as tmp:
        for n in (int(x) for x in args.lengths.split(",")):
            r = measure(SHAPES[args.shape], n, Path(tmp), args.iters, args.warmup, args.blocks)
            rows.append(r)
            k, m = r["kvtool_ms"], r["mlx-lm_ms"]
            print(f"{n:>7,} tokens  kvtool {k['median']:.2f} ms ({k['min']:.2f}-{k['max']:.2f})  "
                  f"mlx-lm {m['median']:.2f} ms ({m['min']:.2f}-{m['max']:.2f})  "
                  f"kvtool/mlx-lm {r['kvtool_over_mlxlm']:.2f}x  with the first append "
                  f"{r['kvtool+append_ms']['median']:.2f} / {r['mlx-lm+append_ms']['median']:.2f} ms "
                  f"{r['with_first_append']:.2f}x", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"shape": args.shape, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
