"""Measure the block-size trade-off of the SSD tier (how DEFAULT_BLOCK_SIZE was chosen).

Two costs pull in opposite directions:
  * per-file cost: a cached prefix of T tokens is T / block_size files; each is opened, read,
    checksummed and turned into MLX arrays. Smaller blocks = more files = slower loads and writes.
  * granularity: only full blocks are cached, and a prompt diverging mid-block recomputes the
    part of that block before the divergence: on average block_size / 2 tokens of extra prefill
    per request, each costing the model's per-token prefill time.

This script measures, for each block size, writing and loading (cold: page cache dropped with
posix_fadvise(DONTNEED); warm: from page cache) a 4,096-token prefix through the real SSDStore
(verification included), with the KV geometry of a preset; and the model's prefill time per
token. Expected cost per request = load time + (block_size / 2) * prefill time per token.

Usage:
    .venv/bin/python bench_configs/block_size.py --preset base --tokens 4096 --out results/block_size.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from kvtool.bench.runner import drop_page_cache
from kvtool.disk.hostblock import HostBlock
from kvtool.disk.namespace import SSDStore
from kvtool.kv.blocks import chain_hashes, from_host, layout_key, rebuild_cache
from kvtool.models.embedded import get_preset

BLOCK_SIZES = (32, 64, 128, 256, 512, 1024)


def make_blocks(n_tokens, bs, n_layers, n_kv, head_dim, layout):
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 4096, size=n_tokens, dtype=np.int32)
    hashes = chain_hashes(ids, bs, layout)
    blocks, parent = [], None
    for i, h in enumerate(hashes):
        shape = (1, n_kv, bs, head_dim)
        keys = [rng.standard_normal(shape, dtype=np.float32) for _ in range(n_layers)]
        values = [rng.standard_normal(shape, dtype=np.float32) for _ in range(n_layers)]
        blocks.append(HostBlock(h, parent or "0" * 32, ids[i * bs:(i + 1) * bs], keys, values, "float32"))
        parent = h
    return ids, hashes, blocks


def measure(bs, n_tokens, preset, repeats):
    p = get_preset(preset)
    layout = layout_key(f"bench-{preset}", p.num_hidden_layers, p.num_key_value_heads, p.head_dim, "float32", bs)
    meta = {"model_id": "bench", "model_name": preset, "block_size": str(bs), "kv_dtype": "float32",
            "n_layers": str(p.num_hidden_layers), "n_kv_heads": str(p.num_key_value_heads), "head_dim": str(p.head_dim)}
    ids, hashes, blocks = make_blocks(n_tokens, bs, p.num_hidden_layers, p.num_key_value_heads, p.head_dim, layout)
    with tempfile.TemporaryDirectory(dir=os.environ.get("KVTOOL_BENCH_DIR")) as tmp:
        store = SSDStore(Path(tmp), layout, meta)
        t0 = time.perf_counter()
        for b in blocks:
            assert store.save_block(b) == "saved"
        write_s = time.perf_counter() - t0
        cold, warm, dropped = [], [], True
        for _ in range(repeats):
            for kind, samples in (("cold", cold), ("warm", warm)):
                if kind == "cold":
                    dropped &= drop_page_cache(Path(tmp))["ok"]
                t0 = time.perf_counter()
                got = [from_host(store.load_block(h, ids[i * bs:(i + 1) * bs])) for i, h in enumerate(hashes)]
                rebuild_cache(got, p.num_hidden_layers)
                samples.append(time.perf_counter() - t0)
        store.close()
    return {"block_size": bs, "files": len(blocks), "write_s": write_s, "cold_load_s": statistics.median(cold),
            "warm_load_s": statistics.median(warm), "page_cache_dropped": dropped}


def prefill_ms_per_token(preset: str, n: int = 512) -> float:
    from mlx_lm.models.cache import make_prompt_cache

    from kvtool.models.loader import load_model

    loaded = load_model(preset)
    ids = mx.array(np.arange(n, dtype=np.int32) % 4000)[None]
    cache = make_prompt_cache(loaded.model)
    mx.eval(loaded.model(ids[:, :16], cache=make_prompt_cache(loaded.model)))  # warm-up
    t0 = time.perf_counter()
    loaded.model(ids, cache=cache)
    mx.eval([c.state for c in cache])
    return (time.perf_counter() - t0) * 1e3 / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="base")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    per_tok = prefill_ms_per_token(args.preset)
    rows = [measure(bs, args.tokens, args.preset, args.repeats) for bs in BLOCK_SIZES]
    print(f"preset={args.preset} tokens={args.tokens} prefill={per_tok:.3f} ms/token")
    print(f"{'block':>6} {'files':>6} {'write s':>8} {'cold s':>8} {'warm s':>8} {'E[recompute] s':>15} {'E[total] s':>10}")
    for r in rows:
        r["expected_recompute_s"] = r["block_size"] / 2 * per_tok / 1e3
        r["expected_total_s"] = r["cold_load_s"] + r["expected_recompute_s"]
        print(f"{r['block_size']:>6} {r['files']:>6} {r['write_s']:>8.3f} {r['cold_load_s']:>8.3f} "
              f"{r['warm_load_s']:>8.3f} {r['expected_recompute_s']:>15.3f} {r['expected_total_s']:>10.3f}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"preset": args.preset, "tokens": args.tokens,
                                        "prefill_ms_per_token": per_tok, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
