"""A RAM hit's cache build and first write: kvtool's `rebuild_cache` against mlx-lm's prompt cache.

On a RAM hit kvtool builds the request's per-layer `KVCache` from the hit's blocks (one
concatenation per layer, with decode room); mlx-lm's `LRUPromptCache` hands out a `deepcopy` of
its stored cache, whose buffer is copied when the first new token is written into it. Both are
timed here up to and including that first write (`update_and_fetch` of one token, evaluated), on
synthetic KV of a given shape, alternated in one process:

- `run views`: blocks cut by `slice_blocks` (one copy per layer, each block a view of it): the
  build takes one view of the run per layer;
- `per block`: the same blocks' views as blocks of their own (no `Block.run`): one piece per block
  and layer, as every RAM hit was built before the run views;
- `mlx-lm`: `copy.deepcopy` of the filled cache, then the same first write.

Prints the median (min-max) wall time in ms per shape and the ratios to `mlx-lm`; then, as
`store`, what the generation thread spends after a request on the same blocks: `slice_blocks`
(the new blocks of a prompt), `promote_slices` (a hit's blocks entering RAM) and `to_host_many`
of the blocks (the SSD writer's host arrays); and `place`: the same blocks copied into restore
buffers, as the RAM part of a hit that also reads SSD blocks (buffers allocated untimed). `--tree` runs another kvtool tree (an older commit's
worktree) for a before/after in one run.

Examples:

    .venv/bin/python bench_configs/ram_hit_build.py                                  # tiny, 2k tokens
    .venv/bin/python bench_configs/ram_hit_build.py --layers 24 --head-dim 64 --dtype bfloat16 --tokens 2048,8192
    .venv/bin/python bench_configs/ram_hit_build.py --json
    .venv/bin/python bench_configs/ram_hit_build.py --tree /tmp/old-worktree --layers 24 --head-dim 64 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

_TREE = sys.argv[sys.argv.index("--tree") + 1] if "--tree" in sys.argv[:-1] else str(Path(__file__).resolve().parent.parent)
sys.path.insert(0, _TREE)

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from mlx_lm.models.cache import KVCache  # noqa: E402

from kvtool.kv import blocks as kvblocks  # noqa: E402
from kvtool.kv.blocks import Block, cache_capacity, rebuild_cache  # noqa: E402
from kvtool.kv.buffers import KVBuffers  # noqa: E402

try:  # where a tree cuts blocks (`--tree`: before kvtool.kv.cut, kvtool.kv.blocks did)
    from kvtool.kv.cut import promote_slices, slice_blocks
except ImportError:
    from kvtool.kv.blocks import promote_slices, slice_blocks  # type: ignore[attr-defined,no-redef]
from kvtool.kv.tree import kv_layout_of  # noqa: E402

BLOCK_SIZE = 64
QUESTION = 30  # tokens of the request beyond the hit: sets the capacity, as a real request does


def _filled(layers: int, heads: int, head_dim: int, tokens: int, dtype: mx.Dtype) -> list[KVCache]:
    cache = [KVCache() for _ in range(layers)]
    for i, c in enumerate(cache):
        k = mx.random.normal((1, heads, tokens, head_dim), key=mx.random.key(i)).astype(dtype)
        c.update_and_fetch(k, -k)
    mx.eval([c.keys for c in cache], [c.values for c in cache])
    return cache


def _first_write(cache: list[KVCache], one: mx.array) -> None:
    mx.eval([c.update_and_fetch(one, one) for c in cache])


def measure(layers: int, heads: int, head_dim: int, tokens: int, dtype: mx.Dtype, rounds: int) -> dict:
    """Median / min / max ms of each way over `rounds` alternated rounds, after checking that
    all three hold the same KV."""
    src = _filled(layers, heads, head_dim, tokens, dtype)
    n = tokens // BLOCK_SIZE * BLOCK_SIZE
    ids = np.arange(tokens, dtype=np.int32)
    spans = [(f"{i + 1:032x}", f"{i:032x}", i * BLOCK_SIZE, (i + 1) * BLOCK_SIZE) for i in range(n // BLOCK_SIZE)]
    runs = slice_blocks(src, ids, spans)
    solo = [Block(b.block_hash, b.parent_hash, b.token_ids, b.keys, b.values) for b in runs]  # no run
    cap = cache_capacity(n + QUESTION)
    one = mx.zeros((1, heads, 1, head_dim), dtype=dtype)
    ways = {
        "run views": lambda: _first_write(rebuild_cache(runs, layers, cap), one),
        "per block": lambda: _first_write(rebuild_cache(solo, layers, cap), one),
        "mlx-lm": lambda: _first_write(copy.deepcopy(src), one),
    }
    a, b = rebuild_cache(runs, layers, cap), rebuild_cache(solo, layers, cap)
    for x, y, z in zip(a, b, src):
        if not (mx.array_equal(x.keys[..., :n, :], z.keys[..., :n, :]).item()
                and mx.array_equal(y.values[..., :n, :], z.values[..., :n, :]).item()):
            raise SystemExit("rebuilt KV differs from the source cache")
    times = _alternated(ways, rounds)
    out = {k: {"median_ms": statistics.median(v), "min_ms": min(v), "max_ms": max(v)} for k, v in times.items()}
    for k in ("run views", "per block"):
        out[k]["vs_mlx_lm"] = out[k]["median_ms"] / out["mlx-lm"]["median_ms"]
    out["store"] = _store_times(src, ids, spans, rounds)
    return out


def _store_times(src: list[KVCache], ids: np.ndarray, spans: list, rounds: int) -> dict[str, float]:
    """Median ms of the per-request work after a request on the same blocks."""
    views = [(h, p, ids[lo:hi], lo) for h, p, lo, hi in spans]
    blocks = slice_blocks(src, ids, spans)
    ways = {"slice_blocks": lambda: slice_blocks(src, ids, spans),
            "promote_slices": lambda: promote_slices(src, views),
            "to_host": lambda: _to_host(slice_blocks(src, ids, spans))}
    ways["place"] = lambda: _place_ms(src, blocks)  # times itself: the buffers' allocation is not timed
    times = _alternated(ways, rounds)
    return {f"{k}_ms": statistics.median(v) for k, v in times.items()}


def _alternated(ways: dict, rounds: int) -> dict[str, list[float]]:
    """ms of each way per round, the ways alternated; a way returning a float timed itself."""
    times: dict[str, list[float]] = {k: [] for k in ways}
    for _ in range(rounds):
        for name, fn in ways.items():
            t0 = time.perf_counter()
            got = fn()
            times[name].append(got if isinstance(got, float) else (time.perf_counter() - t0) * 1e3)
    return times


def _to_host(blocks: list) -> list:
    """The writer's host blocks (`to_host_many`; a tree without it: `to_host` per block)."""
    many = getattr(kvblocks, "to_host_many", None)
    return many(blocks) if many is not None else [kvblocks.to_host(b) for b in blocks]


def _place_ms(src: list[KVCache], blocks: list) -> float:
    """ms to copy `blocks` into fresh restore buffers (a tree without `run_groups`: per block)."""
    buf = KVBuffers.allocate(kv_layout_of(src), cache_capacity(sum(b.num_tokens for b in blocks) + QUESTION))
    buf.ready()
    groups = getattr(kvblocks, "run_groups", lambda bl: [(i, 1, b.num_tokens) for i, b in enumerate(bl)])(blocks)
    t0 = time.perf_counter()
    for i, _, n in groups:
        if n == blocks[i].num_tokens:
            buf.place(i * BLOCK_SIZE, blocks[i])
        else:
            buf.place(i * BLOCK_SIZE, blocks[i], n)
    return (time.perf_counter() - t0) * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=2, help="KV layers (tiny: 2)")
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=32, help="tiny: 32")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--tokens", default="2048", help="comma-separated hit lengths (tokens)")
    ap.add_argument("--rounds", type=int, default=40, help="alternated rounds per shape")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--tree", help="the kvtool tree to import (default: this one)")
    args = ap.parse_args()
    dtype = getattr(mx, args.dtype)
    res = {}
    for t in (int(x) for x in args.tokens.split(",")):
        res[t] = measure(args.layers, args.kv_heads, args.head_dim, t, dtype, args.rounds)
        if not args.json:
            cells = ", ".join(f"{k} {v['median_ms']:.2f} ({v['min_ms']:.2f}-{v['max_ms']:.2f})" for k, v in res[t].items()
                              if k != "store")  # fmt: skip
            ratios = ", ".join(f"{k} / mlx-lm {res[t][k]['vs_mlx_lm']:.2f}x" for k in ("run views", "per block"))
            print(f"{args.layers} layers, {t} tokens, {args.dtype}: {cells} ms; {ratios}")
            print("  store: " + ", ".join(f"{k.removesuffix('_ms')} {v:.2f} ms" for k, v in res[t]["store"].items()))
    if args.json:
        print(json.dumps({"shape": vars(args), "results": res}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
