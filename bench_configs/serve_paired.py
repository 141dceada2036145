"""Side-by-side serving probe: several servers up at once, alternated pass by pass on the warm workload.

`kvtool bench bench_configs/serve_load.toml` starts a fresh server per batch, so two variants are
measured minutes apart on a noisy machine. This probe keeps one server of each variant running,
primes each with the shared system prompt, then sends passes of 48 *distinct* requests (a pass
never repeats an earlier prompt: repeats would be full hits) to each server in turn, the order
alternating from pass to pass. It prints per variant the median TTFT p50 over passes, the per-pass
ratio to the first variant (median and the p10-p90 of those ratios), requests/s and the process's
CPU time per request (utime + stime of the server, from /proc: Linux).

A variant is `kvtool`, `mlx-lm`, or `kvtool@TREE` (a kvtool source tree, e.g. a worktree of an
older commit with its extensions built: `python setup.py build_ext --inplace`), optionally with
`:FLAGS` for `kvtool serve` (`kvtool:--policy evict_only`). The workload is `shared-prefix` of
`bench_configs/serve_load.toml` (or `--config`), with `passes x 48` prompts; or, with `--workload
multi-turn` (one client), `--conversations` chats of `--turns` turns as in
`bench_configs/serve_parity.toml`'s `multi-turn@8` (openings of 1,500-3,000 tokens, visited
round-robin, no restart): the first turns are sent unmeasured, every later turn goes to every
server in turn (the all-fits steady state when `--conversations` <= 10).

Examples:

    .venv/bin/python bench_configs/serve_paired.py --servers kvtool,mlx-lm --clients 4 --passes 6
    .venv/bin/python bench_configs/serve_paired.py --servers "kvtool@/tmp/old,kvtool" --clients 1 --passes 2
    .venv/bin/python bench_configs/serve_paired.py --workload multi-turn --clients 1 \
        --servers "mlx-lm-1000,kvtool,kvtool:--no-ssd"

With `--clients 1` every request goes to every server in turn (paired per request).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from kvtool.bench import loadserver  # noqa: E402
from kvtool.bench.loadcell import WARMUP_MESSAGES, build_workloads, load_serve_load  # noqa: E402
from kvtool.bench.loadgen import LoadRequest, LoadSpec, run_load  # noqa: E402
from kvtool.bench.loadserver import ManagedServer, ServerOptions  # noqa: E402
from kvtool.models.loader import resolve_spec  # noqa: E402

PASS = 48  # requests per pass
MULTI_TURN = {"system_tokens": 1500, "system_tokens_max": 3000, "user_tokens": 32,
              "assistant_tokens": 32}  # as serve_parity.toml's multi-turn@8 (the servers' RAM: --config's)


def cpu_s(pid: int) -> float:
    """utime + stime of process `pid` (s), from /proc/<pid>/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start(variant: str, i: int, spec, model_path: str, work: Path) -> ManagedServer:
    """A server of `variant` (`kind[@tree][:flags]`)."""
    head, _, flags = variant.partition(":")
    kind, _, tree = head.partition("@")
    loadserver.REPO = Path(tree).resolve() if tree else REPO  # the tree `python -m kvtool...` runs from
    cache = work / f"cache-{i}"
    opts = ServerOptions(kind, spec.model, model_path, cache if kind == "kvtool" else None,
                         spec.kvtool_args() + tuple(flags.split()))
    return ManagedServer(opts, work / f"server-{i}.log")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--servers", default="kvtool,mlx-lm", help="comma-separated variants (see the module docstring)")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--passes", type=int, default=4)
    ap.add_argument("--config", default=str(REPO / "bench_configs" / "serve_load.toml"))
    ap.add_argument("--workload", choices=("shared-prefix", "multi-turn"), default="shared-prefix")
    ap.add_argument("--conversations", type=int, default=8, help="multi-turn: conversations (default 8)")
    ap.add_argument("--turns", type=int, default=6, help="multi-turn: turns per conversation (default 6)")
    a = ap.parse_args()
    spec = load_serve_load(a.config)
    if a.workload == "multi-turn":
        if a.clients != 1:
            ap.error("--workload multi-turn pairs request by request: use --clients 1")
        w = dict(MULTI_TURN, conversations=a.conversations, turns=a.turns, restart_after=0)  # no restart
        spec = dataclasses.replace(spec, workloads={"multi-turn": w})
    else:
        spec = dataclasses.replace(spec, workloads={"shared-prefix": dict(spec.workloads["shared-prefix"],
                                                                          prompts_per_group=PASS * a.passes)})
    model_path = str(resolve_spec(spec.model)[0])
    (workload,) = build_workloads(spec, model_path)
    prime = [r for ph in workload.phases if ph not in workload.measured for r in workload.phase_requests(ph)]
    measured = [r for ph in workload.measured for r in workload.phase_requests(ph)]
    if a.workload == "multi-turn":  # the first turns (keys `c<i>t0`) prime; the later ones are measured,
        # sent one at a time in order (their `after` indices point into the whole list: dropped)
        reqs = [dataclasses.replace(r, after=None) for r in measured]
        prime, measured = [r for r in reqs if r.key.endswith("t0")], [r for r in reqs if not r.key.endswith("t0")]
    passes = -(-len(measured) // PASS)
    variants = a.servers.split(",")
    work = Path(tempfile.mkdtemp(prefix="kvtool-serve-paired-"))
    servers: list[ManagedServer] = []
    try:
        for i, v in enumerate(variants):
            servers.append(start(v, i, spec, model_path, work))
        for s in servers:
            run_load(s.base_url, [LoadRequest("warmup", WARMUP_MESSAGES, 2, "warmup")], LoadSpec(clients=1))
            run_load(s.base_url, prime, LoadSpec(clients=1))
        ttft: dict[str, list[float]] = {v: [] for v in variants}
        rps: dict[str, list[float]] = {v: [] for v in variants}
        cpu: dict[str, list[float]] = {v: [] for v in variants}
        for p in range(passes):
            batch = measured[PASS * p : PASS * (p + 1)]
            order = list(range(len(servers)))
            for j, req in enumerate(batch if a.clients == 1 else [None]):
                for i in (order if (p + j) % 2 == 0 else order[::-1]):
                    s, v = servers[i], variants[i]
                    c0 = cpu_s(s.proc.pid)
                    res = run_load(s.base_url, [req] if req is not None else batch, LoadSpec(clients=a.clients))
                    ok = [r.ttft_ms for r in res.records if not r.error]
                    ttft[v].append(statistics.median(ok))
                    cpu[v].append((cpu_s(s.proc.pid) - c0) / len(res.records) * 1e3)
                    if req is None:
                        rps[v].append(len(res.records) / res.wall_s)
        ref = ttft[variants[0]]
        for v in variants:
            ratios = [x / y for x, y in zip(ttft[v], ref)]
            q = statistics.quantiles(ratios, n=10) if len(ratios) >= 2 else [ratios[0]] * 9
            line = (f"{v:32s} TTFT p50 {statistics.median(ttft[v]):7.1f} ms | / {variants[0]}: "
                    f"{statistics.median(ratios):.3f} [p10 {q[0]:.3f} p90 {q[-1]:.3f}] | "
                    f"CPU {statistics.median(cpu[v]):.1f} ms/request")
            if rps[v]:
                line += f" | {statistics.median(rps[v]):.2f} requests/s"
            print(line, flush=True)
    finally:
        for s in servers:
            s.stop()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
