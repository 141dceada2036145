"""What the self-check costs per family, and where the time goes (kvtool/cache/selfcheck.py).

The self-check runs once per namespace, the first time a process attaches a model whose cache
has sliding windows, state layers or cache lists. This measures it as a user meets it: every
sample is a fresh Python process that loads the zoo model (tests/model_zoo.py, small random
weights) and builds its `PrefixCache` over an empty cache directory, timing

- `attach_ms`: `PrefixCache.for_model` wall time (namespace, `alone_exact`, the self-check);
- `selfcheck_ms`: the probe itself (`Verdict.ms`, what `kvtool inspect` shows);
- a breakdown of the probe by phase (functions of kvtool.cache.selfcheck wrapped with timers):
  `alone_exact`, `code_digest`, `vocab`, `reference` (mlx-lm's own runs), `through_kvtool`
  (kvtool's runs: fetch, prefill, store, decode), `as_is`, `cache_setup` (the probe's
  temporary `PrefixCache`s: SQLite index, segment files) and `close`;
- `load_ms` (the model load, not part of the self-check) for scale.

Samples of a family run in turn with other families' (round-robin), and with `--trees` the
same sample of each tree back to back (two worktrees: before / after), so drifts of a shared
machine hit every family and tree alike. Prints medians and spread per family; writes JSON.

    .venv/bin/python bench_configs/selfcheck_cost.py                          # every family that needs it, 5 samples
    .venv/bin/python bench_configs/selfcheck_cost.py --families gemma3_text lfm2 --samples 3
    .venv/bin/python bench_configs/selfcheck_cost.py --trees /tmp/before /tmp/after --families gemma3_text
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

BLOCK_SIZE = 32  # the family matrix's block size (tests/zoo_matrix.py)
PHASES = ("alone_exact", "code_digest", "vocab", "reference", "through_kvtool", "as_is", "cache_setup", "close")


def _child(family: str, block_size: int) -> dict:
    """One sample, in this (fresh) process."""
    t_start = time.perf_counter()
    from kvtool.cache import prefix, selfcheck
    from kvtool.config import KVToolConfig
    from kvtool.models.loader import compute_model_id, load_model
    from tests import model_zoo

    phases = dict.fromkeys(PHASES, 0.0)

    def timed(owner, name: str, phase: str) -> None:
        fn = getattr(owner, name)

        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                phases[phase] += (time.perf_counter() - t0) * 1e3

        setattr(owner, name, wrapper)

    for name, phase in (("alone_exact", "alone_exact"), ("code_digest", "code_digest"), ("_vocab", "vocab"),
                        ("_reference", "reference"), ("_through_kvtool", "through_kvtool"), ("_as_is", "as_is")):
        timed(selfcheck, name, phase)
    real_init, real_close = prefix.PrefixCache.__init__, prefix.PrefixCache.close

    def init(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            real_init(self, *args, **kwargs)
        finally:
            if kwargs.get("check_model") is None:  # the probe's own caches
                phases["cache_setup"] += (time.perf_counter() - t0) * 1e3

    def close(self):
        t0 = time.perf_counter()
        try:
            return real_close(self)
        finally:
            phases["close"] += (time.perf_counter() - t0) * 1e3

    prefix.PrefixCache.__init__, prefix.PrefixCache.close = init, close  # type: ignore[method-assign]
    t_imported = time.perf_counter()
    path = model_zoo.family_dir(family)
    lm = load_model(str(path))
    t_loaded = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvtool-sc-bench-") as tmp:
        cfg = KVToolConfig(ssd_cache_dir=Path(tmp), block_size=block_size, ssd_async_writes=False)
        t0, c0 = time.perf_counter(), time.process_time()
        pc = prefix.PrefixCache.for_model(lm.model, cfg, model_id=compute_model_id(path, None), model_name=family)
        attach_ms, cpu_ms = (time.perf_counter() - t0) * 1e3, (time.process_time() - c0) * 1e3
        verdict = selfcheck.stored_verdict(pc.ssd)
        pc.close()
    return {
        "family": family, "import_ms": (t_imported - t_start) * 1e3, "load_ms": (t_loaded - t_imported) * 1e3,
        "attach_ms": attach_ms, "attach_cpu_ms": cpu_ms, "load_avg_1m": os.getloadavg()[0],
        "selfcheck_ms": verdict.ms if verdict else None,
        "verdict": verdict.describe() if verdict else pc.uncached_reason,
        "probe_tokens": verdict.probe_tokens if verdict else 0, "runs": selfcheck.RUNS, **phases,
    }


def families_needing_check() -> list[str]:
    """Zoo families whose rows in docs/models.md carry a self-check verdict (pass or fail)."""
    out = []
    for line in (REPO / "docs" / "models.md").read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.split("|")]
        if len(cells) > 6 and cells[5] in ("pass", "fail"):  # | family | model_type | cache | status | self-check |
            out.append(cells[1].strip("`"))
    return out


def _stats(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def _sample(tree: Path, family: str, block_size: int) -> list[dict]:
    """One fresh process of `tree`'s copy of this script ([] if it failed)."""
    script = tree / "bench_configs" / Path(__file__).name
    env = dict(os.environ, PYTHONPATH=str(tree))
    proc = subprocess.run([sys.executable, str(script), "--child", family, "--block-size", str(block_size)],
                          cwd=tree, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        print(f"{family} ({tree}): sample failed: {proc.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
        return []
    return [json.loads(proc.stdout.strip().splitlines()[-1])]


def _summarise(samples: dict[str, list[dict]], label: str) -> dict:
    """Per family: median / min / max of every measured key; prints a table."""
    keys = ("attach_ms", "attach_cpu_ms", "selfcheck_ms", "load_ms", "load_avg_1m", *PHASES)
    summary = {}
    print(f"\n{label}\n{'family':22} {'attach ms':>18} {'CPU ms':>18} {'self-check ms':>18} "
          + " ".join(f"{p[:10]:>10}" for p in PHASES))
    for family, rows in samples.items():
        if not rows:
            continue
        s = {k: _stats([float(r[k]) for r in rows if r.get(k) is not None]) for k in keys
             if any(r.get(k) is not None for r in rows)}
        s["verdict"], s["probe_tokens"] = rows[-1]["verdict"], rows[-1]["probe_tokens"]
        summary[family] = s
        print(f"{family:22} {_cell(s, 'attach_ms'):>18} {_cell(s, 'attach_cpu_ms'):>18} "
              f"{_cell(s, 'selfcheck_ms'):>18} " + " ".join(f"{s[p]['median']:10.0f}" for p in PHASES))
    return summary


def _cell(s: dict, key: str) -> str:
    return f"{s[key]['median']:7.0f} [{s[key]['min']:.0f}-{s[key]['max']:.0f}]" if key in s else "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", nargs="*", help="zoo families (default: every family with a self-check)")
    ap.add_argument("--samples", type=int, default=5, help="fresh processes per family")
    ap.add_argument("--block-size", type=int, default=BLOCK_SIZE)
    ap.add_argument("--out", type=Path, default=REPO / "results" / "summaries" / "selfcheck_cost.json")
    ap.add_argument("--trees", nargs="*", type=Path, default=[REPO],
                    help="source trees to compare side by side (worktrees of two commits); samples alternate")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(_child(args.child, args.block_size)))
        return
    from kvtool.bench.machine import git_commit, machine_info

    families = args.families or families_needing_check()
    trees = [t.resolve() for t in args.trees]
    labels = [f"{git_commit(t) or t.name}"[:12] for t in trees]
    samples: dict[str, dict[str, list[dict]]] = {lab: {f: [] for f in families} for lab in labels}
    for _ in range(args.samples):
        for family in families:
            for tree, label in zip(trees, labels):
                samples[label][family] += _sample(tree, family, args.block_size)
    summary = {lab: _summarise(samples[lab], lab) for lab in labels}
    doc = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "commits": labels,
           "machine": machine_info(REPO), "block_size": args.block_size, "samples": args.samples,
           "summary": summary, "raw": samples}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
