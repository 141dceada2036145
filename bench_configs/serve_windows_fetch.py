"""Generation-thread cost of `kvtool serve`'s own prefill for windowed and state-layer models.

For a model whose cache has sliding-window or state layers, `KVToolPromptCache.fetch_nearest_cache`
prefills the prompt itself (kvtool/server/adapter.py) and stores its blocks, on mlx-lm's generation
thread. This times, per zoo family (tests/model_zoo.py), the time until the first token's logits:

- `mlx_lm`: mlx-lm's own cold path (`make_prompt_cache`, the prompt but its last token in chunks
  of `--step`, then the last token alone), what `mlx_lm.server` does without a prompt cache hit;
- `cold`: the adapter's fetch of the same prompt in an empty cache (kvtool's prefill, full views
  of the windows, state snapshots at block ends, the store: slicing, RAM insert, SSD hand-over to
  the background writer) plus mlx-lm's forward of the last token;
- `ram_hit`: the same prompt again (the tail entry: only the last token is forwarded);
- `ssd_hit`: the same prompt in a fresh adapter over the same directory (empty RAM).

Each repeat uses a new cache directory; the cells alternate within a repeat. Prints medians and
spread; writes JSON.

    .venv/bin/python bench_configs/serve_windows_fetch.py --families gemma3_text lfm2 --tokens 1024 --repeats 5
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
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from kvtool.cache.prefix import PrefixCache  # noqa: E402
from kvtool.config import KVToolConfig  # noqa: E402
from kvtool.models.loader import compute_model_id, load_model  # noqa: E402
from kvtool.server.adapter import KVToolPromptCache  # noqa: E402
from tests import model_zoo  # noqa: E402

CELLS = ("mlx_lm", "cold", "ram_hit", "ssd_hit")


def _first_logits(model, cache: list, rest) -> None:
    mx.eval(model(mx.array(list(rest))[None], cache=cache))


def _mlx_lm(model, ids: list[int], step: int) -> float:
    t0 = time.perf_counter()
    cache = make_prompt_cache(model)
    for i in range(0, len(ids) - 1, step):
        model(mx.array(ids[i : min(i + step, len(ids) - 1)])[None], cache=cache)
        mx.eval([c.state for c in cache])
    _first_logits(model, cache, ids[-1:])
    return (time.perf_counter() - t0) * 1e3


def _adapter(model, path: Path, cache_dir: Path, block_size: int, step: int) -> KVToolPromptCache:
    cfg = KVToolConfig(ssd_cache_dir=cache_dir, block_size=block_size)
    pc = PrefixCache.for_model(model, cfg, model_id=compute_model_id(path, None), model_name=path.name)
    if pc.uncached_reason is not None:
        raise SystemExit(f"{path.name}: uncached: {pc.uncached_reason}")
    return KVToolPromptCache(pc, model_key="M", model=model, prefill_step=step)


def _fetch(model, adapter: KVToolPromptCache, ids: list[int]) -> tuple[float, dict]:
    t0 = time.perf_counter()
    cache, rest = adapter.fetch_nearest_cache("M", ids)
    _first_logits(model, cache if cache is not None else make_prompt_cache(model), rest)
    ms = (time.perf_counter() - t0) * 1e3
    adapter.insert_cache("M", ids, cache)
    return ms, adapter.stats()["requests"][-1]


def run_family(family: str, n_tokens: int, block_size: int, step: int, repeats: int) -> dict:
    path = model_zoo.family_dir(family)
    model = load_model(str(path)).model
    base = model_zoo.zoo_prompt(model_zoo.PROMPT_TOKENS)
    ids = (base * (n_tokens // len(base) + 1))[:n_tokens]
    times: dict[str, list[float]] = {c: [] for c in CELLS}
    records: dict[str, dict] = {}
    _mlx_lm(model, ids[:64], step)  # warm-up
    for _ in range(repeats):
        times["mlx_lm"].append(_mlx_lm(model, ids, step))
        with tempfile.TemporaryDirectory(prefix="kvtool-swf-") as tmp:
            a = _adapter(model, path, Path(tmp), block_size, step)
            for cell in ("cold", "ram_hit"):
                ms, records[cell] = _fetch(model, a, ids)
                times[cell].append(ms)
            a.close()
            b = _adapter(model, path, Path(tmp), block_size, step)
            ms, records["ssd_hit"] = _fetch(model, b, ids)
            times["ssd_hit"].append(ms)
            b.close()
    out = {c: {"median": statistics.median(v), "min": min(v), "max": max(v)} for c, v in times.items()}
    out["records"] = {c: {k: r[k] for k in ("cached_tokens", "ssd_hit_tokens", "prefill_ms", "store_ms",
                                               "blocks_stored", "fetch_ms")} for c, r in records.items()}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", nargs="*", default=["gemma3_text", "lfm2", "qwen3_next"])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--step", type=int, default=2048, help="prefill_step_size")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=REPO / "results" / "summaries" / "serve_windows_fetch.json")
    args = ap.parse_args()
    from kvtool.bench.machine import git_commit

    doc: dict = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "commit": git_commit(REPO),
                 "tokens": args.tokens, "block_size": args.block_size, "step": args.step, "families": {}}
    print(f"{'family':14} " + " ".join(f"{c + ' ms':>22}" for c in CELLS) + "   cold/mlx_lm  hit/mlx_lm")
    for family in args.families:
        r = run_family(family, args.tokens, args.block_size, args.step, args.repeats)
        doc["families"][family] = r
        cells = " ".join(f"{r[c]['median']:8.1f} [{r[c]['min']:.0f}-{r[c]['max']:.0f}]".rjust(22) for c in CELLS)
        print(f"{family:14} {cells}   {r['cold']['median'] / r['mlx_lm']['median']:10.2f}x"
              f" {r['ram_hit']['median'] / r['mlx_lm']['median']:10.2f}x")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
