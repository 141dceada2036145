"""Per-call cost of the server's prompt cache: kvtool's `KVToolPromptCache` against mlx-lm's `LRUPromptCache`.

Replays in one process the calls mlx-lm's server makes on its generation thread for a warm
request (`tiny`; a 2,000-token shared system prompt, then a distinct 60-token user turn and a
3-token generation prompt): `fetch_nearest_cache`, the prefill of the rest, the insert at the end
of the user segment (a lazy copy of the whole cache, as `BatchKVCache.extract` hands it over), 8
greedy decode steps and the final insert. Prints the median wall time (ms) of each call over
`--n` requests and, with `--profile FILE`, a cProfile of kvtool's calls. `--which` takes `mlx-lm`,
`kvtool` (write-through SSD tier), `kvtool-evict` (`ssd_policy = evict_only`) and `kvtool-nossd`
(RAM only).

Examples:

    .venv/bin/python bench_configs/adapter_calls.py
    .venv/bin/python bench_configs/adapter_calls.py --which kvtool --profile /tmp/adapter.prof
    .venv/bin/python bench_configs/adapter_calls.py --tree /tmp/old-worktree    # another kvtool tree
    .venv/bin/python bench_configs/adapter_calls.py --which kvtool,kvtool-evict,kvtool-nossd,mlx-lm

Run alternated with `--tree` to compare commits (the machine is noisy: several runs each).
"""

from __future__ import annotations

import argparse
import cProfile
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

SYSTEM, USER, GEN_PROMPT = 2000, 60, [5, 6, 7]
VARIANTS: dict[str, dict] = {"kvtool": {}, "kvtool-evict": {"ssd_policy": "evict_only"},
                             "kvtool-nossd": {"ssd_enabled": False}}  # KVToolConfig fields per kvtool variant


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=48, help="measured requests per cache")
    ap.add_argument("--which", default="kvtool,mlx-lm")
    ap.add_argument("--tree", default=str(Path(__file__).resolve().parent.parent), help="kvtool source tree")
    ap.add_argument("--profile", default="", help="write a cProfile of kvtool's requests here")
    a = ap.parse_args()
    sys.path.insert(0, a.tree)
    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.cache import KVCache, LRUPromptCache, make_prompt_cache

    from kvtool import KVToolConfig, PrefixCache
    from kvtool.models.loader import load_model
    from kvtool.server.adapter import KVToolPromptCache

    tiny = load_model("tiny")
    system = np.random.default_rng(0).integers(10, 1000, SYSTEM).tolist()
    segment_end = SYSTEM + USER

    def prompt(i: int) -> list[int]:
        return system + np.random.default_rng(100 + i).integers(10, 1000, USER).tolist() + GEN_PROMPT

    def extract(cache: list) -> list:
        """`BatchKVCache.extract`: a lazy contiguous copy of each layer."""
        out = []
        for c in cache:
            n = KVCache()
            n.keys, n.values = mx.contiguous(c.keys[..., : c.offset, :]), mx.contiguous(c.values[..., : c.offset, :])
            n.offset = c.offset
            out.append(n)
        return out

    def request(pc, p: list[int], times: dict[str, list[float]]) -> None:
        t = time.perf_counter()
        cache, rest = pc.fetch_nearest_cache("m", p)
        times["fetch"].append((time.perf_counter() - t) * 1e3)
        cache = cache if cache is not None else make_prompt_cache(tiny.model)
        start = len(p) - len(rest)
        if start < segment_end:
            tiny.model(mx.array([p[start:segment_end]]), cache=cache)
            mx.eval([c.state for c in cache])
            t = time.perf_counter()
            pc.insert_cache("m", p[:segment_end], extract(cache), cache_type="user")
            times["segment insert"].append((time.perf_counter() - t) * 1e3)
        tiny.model(mx.array([p[max(start, segment_end) : -1]]), cache=cache)
        tokens = [p[-1]]
        for _ in range(8):
            logits = tiny.model(mx.array([[tokens[-1]]]), cache=cache)
            tokens.append(int(mx.argmax(logits[0, -1]).item()))
        t = time.perf_counter()
        pc.insert_cache("m", p + tokens[1:-1], extract(cache), cache_type="assistant")
        times["final insert"].append((time.perf_counter() - t) * 1e3)

    for which in a.which.split(","):
        work = Path(tempfile.mkdtemp(prefix="kvtool-adapter-calls-"))
        if which == "mlx-lm":
            pc = LRUPromptCache(max_size=10)
        else:
            cfg = KVToolConfig(ssd_cache_dir=work, block_size=64, ram_bytes=256 << 20, **VARIANTS[which])
            pc = KVToolPromptCache(PrefixCache.for_model(tiny.model, cfg, model_id="m" * 32), model_key="m")
        times: dict[str, list[float]] = {"fetch": [], "segment insert": [], "final insert": []}
        request(pc, prompt(-1), {k: [] for k in times})  # the system prompt is cached: warm
        prof = cProfile.Profile() if a.profile and which == "kvtool" else None
        for i in range(a.n):
            if prof:
                prof.enable()
            request(pc, prompt(i), times)
            if prof:
                prof.disable()
        medians = {k: statistics.median(v) for k, v in times.items()}
        print(f"{which:12s} " + " | ".join(f"{k} {v:.3f} ms" for k, v in medians.items())
              + f" | sum {sum(medians.values()):.3f} ms", flush=True)
        if prof:
            prof.dump_stats(a.profile)
        if which != "mlx-lm":
            pc.close()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
