"""`kvtool bench-plan`: capacity planning on Mooncake request traces (`kvtool.bench.trace_plan`)."""

from __future__ import annotations

import itertools
import time
from pathlib import Path
from typing import Annotated

import typer

from kvtool.cli import common
from kvtool.cli.cmd_serve import make_out_dir
from kvtool.cli.output import Output
from kvtool.progress import progress, stderr_is_terminal
from kvtool.units import MAX_BYTES, format_bytes, parse_size

PLAN_HELP = """Capacity planning: replay a Mooncake request trace's prompt blocks through kvtool's own tier stack and eviction (RAM byte budget, SSD byte budget, write policy) without a model, at every RAM x SSD budget x policy asked for, and print per point the token hit rate per tier, the theoretical maximum (an unbounded cache), the share of it reached, prefill tokens saved, bytes written and read per tier, and the requests whose whole reachable prefix hit. Block payloads are stand-ins sized by the model's KV bytes per token (docs/benchmarks.md#capacity-planning-on-the-mooncake-traces).

--trace is a path, or a name (conversation, toolagent, synthetic, mooncake) looked up in --trace-dir (a copy of Mooncake's FAST25-release/; default $KVTOOL_TRACE_DIR, else the 300-request samples shipped in kvtool/bench/traces/). --kv-bytes-per-token is a number, a shape (8b: 131072, 32b: 262144, 70b: 327680) or a model directory with a config.json.

Examples:

  kvtool bench-plan --trace conversation --kv-bytes-per-token 8b

  kvtool bench-plan --trace conversation --trace-dir ~/Mooncake/FAST25-release --kv-bytes-per-token 8b --ram 24GiB --ssd 0,256GiB,512GiB,1TiB,2TiB,4TiB --out plan/

  kvtool bench-plan --trace synthetic --kv-bytes-per-token 70b --policy write_through,evict_only --json

Exit codes: 0 done; 2 a trace that is missing or malformed (one error line with the line number), or a bad option.
"""

TraceOpt = Annotated[list[str], typer.Option("--trace", help="A trace file or name; repeat for several.")]
TraceDirOpt = Annotated[Path | None, typer.Option("--trace-dir", help="Where trace names are looked up.", show_default=False)]
KVOpt = Annotated[str, typer.Option("--kv-bytes-per-token", help="A number, 8b, 32b, 70b, or a model directory.")]
RamOpt = Annotated[str, typer.Option("--ram", help="RAM budgets, comma-separated (e.g. 16GiB,64GiB).")]
SsdOpt = Annotated[str, typer.Option("--ssd", help="SSD budgets, comma-separated; 0: no SSD tier.")]
PolicyOpt = Annotated[str, typer.Option("--policy", help="SSD write policies, comma-separated: write_through, evict_only.")]
OutOpt = Annotated[Path | None, typer.Option("--out", "-o", help="Also write plan.json, plan.csv and plan.png (hit rate "
                                              "against capacity) to this directory.", show_default=False)]
LimitOpt = Annotated[int | None, typer.Option("--limit", min=1, help="Replay only the first N requests.", show_default=False)]


def _sizes(text: str, flag: str) -> list[int]:
    out = [common.parse_flag(part.strip(), parse_size, flag) for part in text.split(",") if part.strip()]
    if not out:
        raise common.CLIError(f"{flag}: give at least one size")
    return out


def _policies(text: str) -> list[str]:
    from kvtool.bench.trace_plan import POLICIES

    out = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in out if p not in POLICIES]
    if bad or not out:
        raise common.CLIError(f"--policy: {', '.join(bad) or 'nothing given'}: choose from {', '.join(POLICIES)}")
    return out


@common.cli_command
def bench_plan(
    trace: TraceOpt,
    kv_bytes_per_token: KVOpt = "8b",
    ram: RamOpt = "24GiB",
    ssd: SsdOpt = "0,256GiB,512GiB,1TiB,2TiB,4TiB",
    policies: PolicyOpt = "write_through",
    trace_dir: TraceDirOpt = None,
    limit: LimitOpt = None,
    out: OutOpt = None,
    json_out: common.JsonOpt = False,
) -> None:
    from kvtool.bench.machine import git_commit, machine_info
    from kvtool.bench.plan_chart import write_plan
    from kvtool.bench.trace import read_trace, resolve_trace
    from kvtool.bench.trace_plan import PlanPoint, replay
    from kvtool.bench.trace_plan import kv_bytes_per_token as kv_of

    kv = kv_of(kv_bytes_per_token)
    if out is not None:
        make_out_dir(out)
    grid = list(itertools.product(_sizes(ram, "--ram"), _sizes(ssd, "--ssd"), _policies(policies)))
    traces = {name: resolve_trace(name, trace_dir) for name in trace}
    loaded = {name: read_trace(path, limit) for name, path in traces.items()}
    total = sum(len(r) for r in loaded.values()) * len(grid)
    points: list[PlanPoint] = []
    machine = machine_info(out if out is not None else Path("."))  # the load average at the start
    t0 = time.monotonic()
    with progress("kvtool bench-plan", bar=not json_out or not stderr_is_terminal()) as bar:
        task = bar.add_task("requests", total=total) if bar is not None else None

        def tick() -> None:
            if bar is not None and task is not None:
                done = bar.tasks[0].completed + 1
                eta = (time.monotonic() - t0) / done * (total - done)
                bar.update(task, completed=done, eta=f"{eta:.0f} s")

        for name, requests in loaded.items():
            for ram_b, ssd_b, pol in grid:
                point = PlanPoint(name, pol, ram_b, ssd_b)
                replay(requests, point, kv, tick)
                points.append(point)
    doc = {"kv_bytes_per_token": kv, "traces": {n: {"path": str(p), "requests": len(loaded[n])} for n, p in traces.items()},
           "wall_s": round(time.monotonic() - t0, 2), "machine": machine, "git_commit": git_commit(),
           "points": [p.record() for p in points]}  # fmt: skip
    if out is not None:
        try:
            doc["files"] = [str(f) for f in write_plan(out, doc, points)]
        except OSError as exc:
            raise common.CLIError(f"--out {out}: cannot write the plan: {exc.strerror or exc}") from None
    output = Output.from_flags(json_out)
    output.emit(doc, lambda: output.lines(plan_lines(points)))


def plan_lines(points: list) -> list[str]:
    """The human table: one line per point (`PlanPoint`s)."""
    head = f"{'trace':<14}{'policy':<15}{'RAM':>10}{'SSD':>10}{'hit':>8}{'RAM':>8}{'SSD':>8}{'max':>8}{'of max':>8}{'whole':>8}{'SSD writes':>12}"
    lines = [head]
    for p in points:
        ssd = "-" if not p.ssd_bytes else "unbounded" if p.ssd_bytes >= MAX_BYTES else format_bytes(p.ssd_bytes)
        whole = p.full_prefix_requests / p.reachable_requests if p.reachable_requests else 1.0
        lines.append(f"{p.trace:<14}{p.policy:<15}{format_bytes(p.ram_bytes):>10}{ssd:>10}{p.hit_rate:>8.1%}"
                     f"{p.ram_hit_rate:>8.1%}{p.ssd_hit_rate:>8.1%}{p.max_hit_rate:>8.1%}{p.share_of_max:>8.1%}"
                     f"{whole:>8.1%}{format_bytes(p.ssd_written_bytes):>12}")  # fmt: skip
    lines.append("hit: prompt tokens served from the cache (prefill saved); max: an unbounded cache; whole: requests "
                 "whose whole reachable prefix hit")  # fmt: skip
    return lines


def register(app: typer.Typer) -> None:
    app.command("bench-plan", help=PLAN_HELP)(bench_plan)
