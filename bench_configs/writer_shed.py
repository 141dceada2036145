"""Request-thread cost of handing prompts to the async SSD writer when the disk cannot keep up.

Timing belongs here, not in the tests. Each run opens a real `SSDStore` in a fresh temporary
directory and an `AsyncWriter` with the default bounds (512 blocks, 256 MiB queued and being
written, 64 MiB per batch), then "stores" `--prompts` prompts of `--prompt-mib` MiB of KV each
back to back, as the SSD tier (`SsdBlockTier`) does on the request path: each prompt's `HostBlock`s are handed
over in batches of at most 64 MiB, one `enqueue_many` call per batch. The blocks (random KV of the
`qwen0.5b` shape by default: 24 layers, 2 KV heads, head_dim 64, 256-token blocks, bfloat16 =
3 MiB per block) and their chain hashes are built before the timed loop; the KV arrays are shared
between prompts (the hashes differ), so the script itself stays small in memory.

A real request makes host copies of its blocks (`to_host`) on the request thread right before
enqueueing them; by default (`--host-copy`) the script does the same (a fresh numpy copy of each
prompt's KV), which also paces the stores as real ones are. `--no-host-copy` enqueues the prebuilt
blocks with no gap at all (the harshest case: almost everything past the queue bound is shed).

Per store it records the request-thread time of its `enqueue_many` calls (`enqueue_ms`, wall
clock: the acceptance metric), the CPU time the request thread spent in them (`enqueue_cpu_ms`,
`time.thread_time`: wall far above CPU means the thread was waiting — descheduled, or for the
GIL or a lock — not working), of copy + enqueue (`store_ms`), the blocks shed and the blocks
saved on the request thread (`writer_queue_full_sync_fallback`).
Per run: the time `flush()` then waited for the writer to drain, the writer's peak queue bytes,
and the blocks written. The acceptance target under `best_effort`: store p99 <= 5 ms and no
request-thread save.

    .venv/bin/python bench_configs/writer_shed.py                      # 7 runs x 20 x 50 MiB, best_effort
    .venv/bin/python bench_configs/writer_shed.py --durability best_effort,durable --runs 3
    .venv/bin/python bench_configs/writer_shed.py --prompt-mib 10 --runs 2 --json

Prints a table (or, with `--json`, one JSON document) on stdout; `--out FILE` also writes the JSON.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from kvtool.bench.machine import git_commit  # noqa: E402
from kvtool.disk.hostblock import HostBlock  # noqa: E402
from kvtool.disk.kvlayout import KVLayout  # noqa: E402
from kvtool.disk.namespace import SSDStore  # noqa: E402
from kvtool.disk.segment import FORMAT_VERSION  # noqa: E402
from kvtool.hashing import chain_hashes, layout_key, root_parent  # noqa: E402
from kvtool.tiers.writer import DEFAULT_BATCH_MAX_BYTES, DEFAULT_MAX_QUEUE_BYTES, AsyncWriter  # noqa: E402

MiB = 1 << 20
DRAIN_TIMEOUT_S = 300.0


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 1]) of a non-empty list."""
    s = sorted(values)
    return s[max(0, min(len(s) - 1, math.ceil(q * len(s)) - 1))]


def summary(values: list[float]) -> dict[str, float]:
    """median / p99 / max / mean of `values` (same unit), rounded to 3 decimals."""
    return {k: round(v, 3) for k, v in (
        ("median", statistics.median(values)), ("p99", percentile(values, 0.99)),
        ("max", max(values)), ("mean", statistics.fmean(values)),
    )}


class Geometry:
    """KV shape of the blocks: the namespace meta and layout key derive from it."""

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, block_size: int) -> None:
        self.n_layers, self.n_kv_heads, self.head_dim, self.block_size = n_layers, n_kv_heads, head_dim, block_size
        self.kv = KVLayout.uniform(n_layers, n_kv_heads, head_dim, "bfloat16")
        self.model_id = hashlib.blake2b(b"writer-shed-bench", digest_size=16).hexdigest()
        self.layout = layout_key(self.model_id, self.kv.spec, "bfloat16", block_size, format_version=FORMAT_VERSION)
        self.meta = {"model_id": self.model_id, "model_name": "writer-shed-bench", "kv_dtype": "bfloat16",
                     "block_size": str(block_size), "kv_layers": self.kv.spec}

    def pool(self, n_blocks: int, rng: np.random.Generator) -> list[tuple[list[np.ndarray], list[np.ndarray]]]:
        """Random bfloat16 (uint16 bit patterns) keys/values for `n_blocks` block positions."""
        shape = (1, self.n_kv_heads, self.block_size, self.head_dim)

        def arr() -> np.ndarray:
            return rng.integers(0, 1 << 16, size=shape, dtype=np.uint16)

        return [([arr() for _ in range(self.n_layers)], [arr() for _ in range(self.n_layers)]) for _ in range(n_blocks)]

    def prompt(self, kv_pool: list, rng_tokens: np.random.Generator) -> list[HostBlock]:
        """The blocks of one new prompt (fresh token ids, real chain hashes, KV from the pool)."""
        n = len(kv_pool)
        ids = rng_tokens.integers(10, 150_000, size=n * self.block_size).astype(np.int32)
        hashes = chain_hashes(ids, self.block_size, self.layout)
        parents = [root_parent(self.layout), *hashes]
        return [
            HostBlock(h, parents[i], ids[i * self.block_size:(i + 1) * self.block_size],
                      list(kv_pool[i][0]), list(kv_pool[i][1]), "bfloat16")
            for i, h in enumerate(hashes)
        ]


def host_copy(b: HostBlock) -> HostBlock:
    """A fresh copy of a block's arrays (what `to_host` costs the request thread)."""
    return HostBlock(b.block_hash, b.parent_hash, b.token_ids.copy(), [k.copy() for k in b.keys],
                     [v.copy() for v in b.values], b.dtype)


def batches(blocks: list[HostBlock], max_bytes: int) -> list[list[HostBlock]]:
    """`SsdBlockTier`'s split of a put into writer batches: consecutive runs of at most `max_bytes` (bytes)."""
    out: list[list[HostBlock]] = []
    cur: list[HostBlock] = []
    size = 0
    for b in blocks:
        if cur and size + b.nbytes > max_bytes:
            out.append(cur)
            cur, size = [], 0
        cur.append(b)
        size += b.nbytes
    if cur:
        out.append(cur)
    return out


def one_run(args: argparse.Namespace, geo: Geometry, durability: str, run: int, kv_pool: list) -> dict[str, Any]:
    """Store `args.prompts` prompts back to back through a fresh writer and store; the run's facts."""
    rng = np.random.default_rng(1000 * run + 7)
    prompts = [batches(geo.prompt(kv_pool, rng), DEFAULT_BATCH_MAX_BYTES) for _ in range(args.prompts)]
    root = Path(tempfile.mkdtemp(prefix="kvtool-writer-shed-", dir=args.dir))
    store = SSDStore(root, geo.layout, geo.meta, durability=durability)
    writer = AsyncWriter(store, durability=durability, max_queue_bytes=args.queue_mib * MiB)
    calls: list[dict[str, Any]] = []
    try:
        t_run = time.perf_counter()
        for p, prompt in enumerate(prompts):
            before = writer.get_stats()
            enqueue_ms = enqueue_cpu_ms = 0.0
            t0 = time.perf_counter()
            for batch in prompt:
                if args.host_copy:
                    batch = [host_copy(b) for b in batch]
                c1, t1 = time.thread_time(), time.perf_counter()
                writer.enqueue_many(batch)
                enqueue_ms += (time.perf_counter() - t1) * 1e3
                enqueue_cpu_ms += (time.thread_time() - c1) * 1e3
            store_ms = (time.perf_counter() - t0) * 1e3
            after = writer.get_stats()
            calls.append({
                "prompt": p, "enqueue_ms": round(enqueue_ms, 4), "enqueue_cpu_ms": round(enqueue_cpu_ms, 4),
                "store_ms": round(store_ms, 3),
                "enqueue_calls": len(prompt),
                "shed_blocks": after["writer_shed_blocks"] - before["writer_shed_blocks"],
                "request_thread_saved_blocks": (after["writer_queue_full_sync_fallback"]
                                                - before["writer_queue_full_sync_fallback"]),
            })
        t_stored = time.perf_counter()
        drained = writer.flush(DRAIN_TIMEOUT_S)
        t_drained = time.perf_counter()
    finally:
        stopped = writer.stop(DRAIN_TIMEOUT_S)
        store.close(shutdown_clean=stopped)
        shutil.rmtree(root, ignore_errors=True)
    stats = writer.get_stats()
    offered = sum(b.nbytes for prompt in prompts for batch in prompt for b in batch)
    return {
        "run": run, "calls": calls, "drained": drained and stopped,
        "store_loop_s": round(t_stored - t_run, 3), "drain_wait_s": round(t_drained - t_stored, 3),
        "offered_bytes": offered, "offered_blocks": sum(len(batch) for prompt in prompts for batch in prompt),
        "saved_blocks": stats["writer_save_success"], "shed_blocks": stats["writer_shed_blocks"],
        "shed_bytes": stats["writer_shed_bytes"],
        "request_thread_saved_blocks": stats["writer_queue_full_sync_fallback"],
        "backpressure_waits": stats["writer_backpressure_waits"],
        "queue_peak_bytes": stats["writer_queue_peak_bytes"],
    }


def aggregate(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-store times over all runs, plus totals and per-run shed counts."""
    enqueue_ms = [c["enqueue_ms"] for r in runs for c in r["calls"]]
    return {
        "stores": len(enqueue_ms),
        "enqueue_ms": summary(enqueue_ms),
        "enqueue_cpu_ms": summary([c["enqueue_cpu_ms"] for r in runs for c in r["calls"]]),
        "stores_over_5ms": sum(1 for v in enqueue_ms if v > 5.0),
        "store_ms": summary([c["store_ms"] for r in runs for c in r["calls"]]),
        "shed_blocks_total": sum(r["shed_blocks"] for r in runs),
        "shed_blocks_per_run": [r["shed_blocks"] for r in runs],
        "stores_with_shed": sum(1 for r in runs for c in r["calls"] if c["shed_blocks"]),
        "request_thread_saved_blocks": sum(r["request_thread_saved_blocks"] for r in runs),
        "runs_with_request_thread_save": sum(1 for r in runs if r["request_thread_saved_blocks"]),
        "saved_blocks_total": sum(r["saved_blocks"] for r in runs),
        "offered_blocks_total": sum(r["offered_blocks"] for r in runs),
        "queue_peak_mib_max": round(max(r["queue_peak_bytes"] for r in runs) / MiB, 1),
        "drain_wait_s": summary([r["drain_wait_s"] for r in runs]),
        "all_drained": all(r["drained"] for r in runs),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=7, help="runs per durability (default 7)")
    ap.add_argument("--prompts", type=int, default=20, help="prompts stored back to back per run (default 20)")
    ap.add_argument("--prompt-mib", type=float, default=50.0, help="KV per prompt in MiB (default 50)")
    ap.add_argument("--durability", default="best_effort",
                    help="comma-separated: best_effort, persistent, durable (default best_effort)")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=256, help="tokens per block")
    ap.add_argument("--queue-mib", type=int, default=DEFAULT_MAX_QUEUE_BYTES // MiB,
                    help="writer byte bound in MiB (default: the writer's default)")
    ap.add_argument("--host-copy", action=argparse.BooleanOptionalAction, default=True,
                    help="copy each prompt's KV on the request thread before enqueueing (default: on)")
    ap.add_argument("--dir", default=None, help="parent of the temporary cache directories (default: $TMPDIR)")
    ap.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = ap.parse_args(argv)
    modes = [m.strip() for m in args.durability.split(",") if m.strip()]
    bad = [m for m in modes if m not in ("best_effort", "persistent", "durable")]
    if bad or args.runs < 1 or args.prompts < 1 or args.prompt_mib <= 0:
        ap.error(f"bad arguments (durability {bad or modes}, runs {args.runs}, prompts {args.prompts})")

    geo = Geometry(args.layers, args.kv_heads, args.head_dim, args.block_size)
    block_bytes = geo.prompt(geo.pool(1, np.random.default_rng(0)), np.random.default_rng(0))[0].nbytes
    blocks_per_prompt = max(1, round(args.prompt_mib * MiB / block_bytes))
    kv_pool = geo.pool(blocks_per_prompt, np.random.default_rng(1))
    results: dict[str, Any] = {}
    for mode in modes:
        runs = [one_run(args, geo, mode, r, kv_pool) for r in range(args.runs)]
        results[mode] = {"summary": aggregate(runs), "runs": runs}
    doc: dict[str, Any] = {
        "bench": "writer_shed", "commit": git_commit(REPO),
        "config": {"runs": args.runs, "prompts": args.prompts, "blocks_per_prompt": blocks_per_prompt,
                   "block_bytes": block_bytes, "prompt_bytes": blocks_per_prompt * block_bytes,
                   "queue_bytes": args.queue_mib * MiB, "host_copy": args.host_copy, "batch_max_bytes": DEFAULT_BATCH_MAX_BYTES,
                   "geometry": {"layers": args.layers, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
                                "block_size": args.block_size, "dtype": "bfloat16"},
                   "dir": args.dir or tempfile.gettempdir()},
        "results": results,
    }
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
    if args.json:
        print(json.dumps(doc, indent=1))
        return 0
    cfg: dict[str, Any] = doc["config"]
    print(f"{args.runs} runs x {args.prompts} prompts x {cfg['prompt_bytes'] / MiB:.1f} MiB "
          f"({blocks_per_prompt} blocks of {block_bytes / MiB:.2f} MiB), queue {args.queue_mib} MiB, "
          f"host copy {'on' if args.host_copy else 'off'}, dir {cfg['dir']}")
    print("request-thread ms per store: enqueue_many calls only (copy + enqueue in brackets)")
    print(f"{'durability':<12} {'stores':>6} {'median':>16} {'p99':>16} {'max':>16} {'shed blocks':>12} "
          f"{'req-thread saves':>17} {'peak MiB':>9} {'drain s':>8}")
    for mode, res in results.items():
        s = res["summary"]
        cols = [f"{s['enqueue_ms'][k]:.3f} ({s['store_ms'][k]:.1f})" for k in ("median", "p99", "max")]
        print(f"{mode:<12} {s['stores']:>6} {cols[0]:>16} {cols[1]:>16} {cols[2]:>16} {s['shed_blocks_total']:>12} "
              f"{s['request_thread_saved_blocks']:>17} {s['queue_peak_mib_max']:>9} {s['drain_wait_s']['median']:>8.3f}")
        print(f"{'':<12} shed per run: {s['shed_blocks_per_run']}  written {s['saved_blocks_total']}"
              f"/{s['offered_blocks_total']} blocks; enqueue CPU ms median {s['enqueue_cpu_ms']['median']:.3f} "
              f"max {s['enqueue_cpu_ms']['max']:.3f}; stores over 5 ms: {s['stores_over_5ms']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
