"""Request-path cost of SSD writes: write_through+async vs evict_only vs write_through+sync.

Timing belongs here, not in the tests. One resident model, one workload, six cells:

    policy / writer            x  durability
    write_through / async         best_effort, durable
    evict_only    / async         best_effort, durable
    write_through / sync          best_effort, durable

Workload: `--requests` prompts of `--prompt-tokens` tokens, each a new document (no shared
prefix), so every request stores `prompt_tokens // block_size` new blocks. The RAM tier (1 GiB
default) holds the whole workload, so under evict_only nothing reaches the SSD during the run:
its request-path cost is the RAM insert only (its writes happen at eviction, or never).
Every cell starts from an empty cache directory; cells run round-robin per repeat so slow drifts
of the machine hit every cell alike. One warm-up request (not recorded) runs first.

Per request it records `RequestResult.write_path_ms` (request-thread time spent storing blocks:
slicing, RAM insert, host copy + enqueue (async) or the file writes (sync)), `ttft_ms`,
`prefill_ms`, the wall time of the whole `generate` call (`total_ms`) and `after_first_ms` =
total - TTFT (the blocks are stored right after the first token, so this is decode + store: with
a few decoded tokens it shows the write path without the prefill's noise); per cell run, the time the
end-of-cell `flush()` waited for the async writer to drain (work moved off the request path).

    .venv/bin/python bench_configs/write_path.py                 # small preset, 8 x 2,064 tokens
    .venv/bin/python bench_configs/write_path.py --model tiny --requests 4 --repeats 1

Prints a table and writes JSON to results/summaries/write_path.json (`--out`).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from kvtool.bench.machine import git_commit, machine_info  # noqa: E402
from kvtool.bench.workloads import TokenPool  # noqa: E402
from kvtool.config import KVToolConfig  # noqa: E402
from kvtool.engine import Engine  # noqa: E402
from kvtool.models.loader import load_model  # noqa: E402

CELLS = [
    ("write_through", "async"),
    ("evict_only", "async"),
    ("write_through", "sync"),
]
DURABILITIES = ("best_effort", "durable")
METRICS = ("write_path_ms", "ttft_ms", "prefill_ms", "total_ms", "after_first_ms")


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def _summary(values: list[float]) -> dict[str, float]:
    return {
        "median": statistics.median(values),
        "mean": statistics.fmean(values),
        "p95": _pct(values, 0.95),
        "min": min(values),
        "max": max(values),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="small", help="preset / model dir (default: small)")
    ap.add_argument("--requests", type=int, default=8, help="requests per cell run")
    ap.add_argument("--prompt-tokens", type=int, default=2064, help="tokens per prompt (new document each)")
    ap.add_argument("--block-size", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2, help="round-robin passes over the cells")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache-root", type=Path, default=None, help="where cell caches go (default: a temp dir)")
    ap.add_argument("--out", type=Path, default=REPO / "results" / "write_path.json")
    args = ap.parse_args(argv)

    cache_root = Path(args.cache_root or tempfile.mkdtemp(prefix="kvtool-write-path-"))
    cache_root.mkdir(parents=True, exist_ok=True)
    t_load = time.perf_counter()
    loaded = load_model(args.model)
    load_s = time.perf_counter() - t_load
    pool = TokenPool(lambda text: loaded.tokenizer.encode(text), args.seed)
    warmup = list(pool.head + pool.document(args.prompt_tokens, "warmup"))
    # the same prompts for every cell and repeat; each a new document (new prefix)
    prompts = [list(pool.head + pool.document(args.prompt_tokens, f"doc{i}")) for i in range(args.requests)]

    base = KVToolConfig(ssd_cache_dir=cache_root / "warmup", block_size=args.block_size)
    engine = Engine(loaded, base)
    engine.generate(warmup, max_tokens=args.max_tokens)
    engine.close()
    geometry = engine.geometry
    kv_bytes_per_token = 2 * geometry.n_layers * geometry.n_kv_heads * geometry.head_dim * (4 if geometry.dtype == "float32" else 2)

    rows: list[dict] = []
    runs: list[dict] = []
    for repeat in range(args.repeats):
        for policy, writer in CELLS:
            for durability in DURABILITIES:
                cell = f"{policy}/{writer}/{durability}"
                cache_dir = cache_root / f"r{repeat}" / cell.replace("/", "-")
                cfg = base.replace(
                    ssd_cache_dir=cache_dir, ssd_policy=policy, ssd_async_writes=writer == "async",
                    ssd_durability=durability,
                )  # fmt: skip
                engine.reconfigure(cfg)
                for i, ids in enumerate(prompts):
                    t0 = time.perf_counter()
                    res = engine.generate(ids, max_tokens=args.max_tokens)
                    total_ms = (time.perf_counter() - t0) * 1e3
                    assert res.cached_tokens == 0, f"{cell}: request {i} was not a new prefix"
                    rows.append({
                        "cell": cell, "policy": policy, "writer": writer, "durability": durability,
                        "repeat": repeat, "request": i, "prompt_tokens": res.prompt_tokens,
                        "blocks_written": res.blocks_written, "write_path_ms": res.write_path_ms,
                        "ttft_ms": res.ttft_ms, "prefill_ms": res.prefill_ms, "total_ms": total_ms,
                        "after_first_ms": total_ms - res.ttft_ms,
                        "writer_queue_depth": res.writer_queue_depth, "backpressure_events": res.backpressure_events,
                    })  # fmt: skip
                t0 = time.perf_counter()
                drained = engine.flush()
                drain_ms = (time.perf_counter() - t0) * 1e3
                stats = engine.stats()
                status = engine.close()
                runs.append({
                    "cell": cell, "repeat": repeat, "drain_ms": drain_ms, "drained": drained,
                    "shutdown_clean": status.shutdown_clean, "ssd_save_success": stats.get("ssd_save_success", 0),
                    "ssd_bytes_written": stats.get("ssd_bytes_written", 0),
                    "kv_ram_evictions": stats.get("kv_ram_evictions", 0),
                })  # fmt: skip
                shutil.rmtree(cache_dir, ignore_errors=True)
    engine.close()

    cells: dict[str, dict] = {}
    for policy, writer in CELLS:
        for durability in DURABILITIES:
            cell = f"{policy}/{writer}/{durability}"
            mine = [r for r in rows if r["cell"] == cell]
            my_runs = [r for r in runs if r["cell"] == cell]
            cells[cell] = {
                "requests": len(mine),
                "blocks_per_request": statistics.fmean(r["blocks_written"] for r in mine),
                **{m: _summary([r[m] for r in mine]) for m in METRICS},
                "drain_ms_mean": statistics.fmean(r["drain_ms"] for r in my_runs),
                "ssd_blocks_saved_per_run": statistics.fmean(r["ssd_save_success"] for r in my_runs),
                "all_shutdowns_clean": all(r["shutdown_clean"] for r in my_runs),
            }

    doc = {
        "description": "request-path write cost by policy / writer / durability (bench_configs/write_path.py)",
        "command": " ".join([".venv/bin/python", "bench_configs/write_path.py", *(argv if argv is not None else sys.argv[1:])]),
        "params": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "model": {"name": loaded.name, "model_id": loaded.model_id, "load_s": load_s,
                  "kv_bytes_per_token": kv_bytes_per_token,
                  "block_file_bytes_approx": kv_bytes_per_token * args.block_size},  # fmt: skip
        "machine": machine_info(cache_root),
        "git_commit": git_commit(REPO),
        "cells": cells,
        "runs": runs,
        "requests": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2))
    if args.cache_root is None:
        shutil.rmtree(cache_root, ignore_errors=True)

    head = (f"{'cell':34} {'blk/req':>7} {'write_path ms':>22} {'TTFT ms':>16} {'total ms':>16} "
            f"{'total-TTFT ms':>13} {'drain ms':>9}")
    print(f"model {loaded.name} ({kv_bytes_per_token} B/token KV, block file ~{kv_bytes_per_token * args.block_size / 2**20:.2f} MiB), "
          f"{args.requests} x {args.prompt_tokens} tokens x {args.repeats} repeats, block_size {args.block_size}")  # fmt: skip
    print("write_path: median / mean / p95; TTFT and total: median / p95; total-TTFT: median")
    print(head)
    print("-" * len(head))
    for cell, c in cells.items():
        w, t, tot = c["write_path_ms"], c["ttft_ms"], c["total_ms"]
        print(f"{cell:34} {c['blocks_per_request']:7.1f} {w['median']:6.2f} / {w['mean']:6.2f} / {w['p95']:6.2f} "
              f"{t['median']:7.1f} / {t['p95']:6.1f} {tot['median']:7.1f} / {tot['p95']:6.1f} "
              f"{c['after_first_ms']['median']:13.1f} {c['drain_ms_mean']:9.1f}")  # fmt: skip
    print(f"JSON: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
