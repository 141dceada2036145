"""The files of `kvtool bench-plan --out` (`plan.json`, `plan.csv`) and its chart (`plan.png`,
matplotlib, Agg): hit rate against cache capacity.

One line per trace, policy and the budget that stays fixed: with several SSD budgets, a line per
RAM budget over the SSD budgets (capacity = RAM + SSD); with one SSD budget, a line per SSD budget
over the RAM budgets (a RAM-only sweep, as the Mooncake paper's Figure 9). The x axis is the cache
capacity in tokens ((RAM + SSD bytes) / KV bytes per token, log scale); the top axis marks the
budgets swept (`SSD 256 GiB`, ...) at the capacity they give, every point carries its hit rate,
each trace's maximum (an unbounded cache) is dashed and the RAM budgets of an SSD sweep dotted. A
title names the traces, the KV bytes per token and the policies; the footer (as `kvtool report`'s
charts: `kvtool.bench.report_charts.machine_parts`) the machine, the load average at the start,
the commit, the trace files and their requests, and the replay's wall time.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
from matplotlib.ticker import FuncFormatter, PercentFormatter  # noqa: E402

from kvtool.bench.report_charts import footer_text, machine_parts, save  # noqa: E402
from kvtool.bench.trace_plan import PlanPoint  # noqa: E402
from kvtool.units import MAX_BYTES, format_bytes  # noqa: E402

DPI = 110


def tokens_label(value: float) -> str:
    """A token count as the axis writes it: `10k`, `3M`, `1G` (plain below 1,000)."""
    for scale, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= scale:
            return f"{value / scale:g}{unit}"
    return f"{value:g}"


def _lines(points: Sequence[PlanPoint]) -> tuple[str, dict[tuple[str, str, int], list[PlanPoint]]]:
    """Which budget is swept (`ssd` or `ram`) and the points of each line, keyed by (trace,
    policy, the fixed budget), each line sorted by capacity (unbounded SSD points left out)."""
    swept = "ssd" if len({p.ssd_bytes for p in points}) > 1 else "ram"
    lines: dict[tuple[str, str, int], list[PlanPoint]] = {}
    for p in points:
        if p.ssd_bytes >= MAX_BYTES:
            continue
        fixed = p.ram_bytes if swept == "ssd" else p.ssd_bytes
        lines.setdefault((p.trace, p.policy, fixed), []).append(p)
    for group in lines.values():
        group.sort(key=lambda p: p.ram_bytes + p.ssd_bytes)
    return swept, lines


def _budget_axis(ax: Any, swept: str, first: list[PlanPoint], kv: int) -> None:
    """The top axis: the budgets swept, at the capacity each gives on the first line."""
    top = ax.secondary_xaxis("top")
    xs = [(p.ram_bytes + p.ssd_bytes) / kv for p in first]
    if swept == "ssd":
        labels = ["RAM only" if not p.ssd_bytes else f"SSD {format_bytes(p.ssd_bytes)}" for p in first]
        top.set_xlabel(f"SSD budget (beside RAM {format_bytes(first[0].ram_bytes)})", fontsize=9)
    else:
        labels = [format_bytes(p.ram_bytes) for p in first]
        top.set_xlabel("RAM budget" + (f" (beside SSD {format_bytes(first[0].ssd_bytes)})" if first[0].ssd_bytes else ""),
                       fontsize=9)  # fmt: skip
    top.set_xticks(xs, labels, fontsize=7, rotation=45 if len(xs) > 5 else 0, ha="left" if len(xs) > 5 else "center")
    top.minorticks_off()
    for x in xs:
        ax.axvline(x, color="#DDDDDD", linewidth=0.8, zorder=0)


def _footer(fig: plt.Figure, doc: dict[str, Any], extra: str) -> None:
    traces = doc.get("traces") or {}
    names = ", ".join(f"{Path(t.get('path', n)).name} ({t.get('requests', '?'):,} requests)" for n, t in traces.items())
    commit = str(doc.get("git_commit") or "not recorded")[:10]
    wall = doc.get("wall_s")
    parts = [*machine_parts(doc.get("machine")), f"commit {commit}"]
    second = [f"trace: {names or '?'}", f"replay {wall:,.0f} s" if isinstance(wall, (int, float)) else "replay ? s"]
    footer_text(fig, " | ".join(parts) + "\n" + " | ".join(second) + (f"\n{extra}" if extra else ""))


def plot_plan(doc: dict[str, Any], points: Sequence[PlanPoint], extra: str = "") -> plt.Figure:
    """The chart of a plan: `doc` is bench-plan's JSON document (`kv_bytes_per_token`, `traces`,
    `wall_s`, and where recorded `machine`, `git_commit`), `points` its points; `extra` a last
    footer line. Returns the figure (the caller saves and closes it)."""
    kv = int(doc["kv_bytes_per_token"])
    swept, lines = _lines(points)
    fig, ax = plt.subplots(figsize=(9, 6))
    colors = {t: f"C{i}" for i, t in enumerate(dict.fromkeys(p.trace for p in points))}
    styles = ("-", "-.", ":", "--")
    has_ssd = any(p.ssd_bytes for p in points)  # the write policy means nothing without an SSD tier
    for n, ((trace, policy, fixed), group) in enumerate(lines.items()):
        xs = [(p.ram_bytes + p.ssd_bytes) / kv for p in group]
        ys = [p.hit_rate for p in group]
        budget = f"RAM {format_bytes(fixed)}" if swept == "ssd" else (f"SSD {format_bytes(fixed)}" if fixed else "RAM only")
        ax.plot(xs, ys, marker="o", color=colors[trace], linestyle=styles[n // len(colors) % len(styles)],
                label=f"{trace}, {policy}, {budget}" if has_ssd else f"{trace}, {budget}")  # fmt: skip
        for x, y in zip(xs, ys):  # every other line labels below its points: budgets swept side by side meet
            ax.annotate(f"{y:.1%}", (x, y), textcoords="offset points", xytext=(0, 7 if n % 2 == 0 else -13),
                        ha="center", fontsize=7,
                        color=colors[trace], bbox={"boxstyle": "round,pad=0.1", "fc": "white", "ec": "none", "alpha": 0.85})  # fmt: skip
        if swept == "ssd":
            ax.axvline(fixed / kv, color="grey", linestyle=":", linewidth=1)
    for trace, color in colors.items():
        top = next(p.max_hit_rate for p in points if p.trace == trace)
        ax.axhline(top, color=color, linestyle="--", linewidth=1, label=f"{trace}: maximum, unbounded cache ({top:.1%})")
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: tokens_label(v)))
    if lines:
        _budget_axis(ax, swept, next(iter(lines.values())), kv)
    ax.set_xlabel(f"cache capacity, tokens ((RAM + SSD bytes) / {kv:,} KV bytes per token)"
                  + ("; dotted: the RAM budget" if swept == "ssd" else ""), fontsize=9)  # fmt: skip
    ax.set_ylabel("hit rate: prompt tokens served from the cache")
    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    top_rate = max((p.max_hit_rate for p in points), default=1.0)
    ax.set_ylim(0, min(1.0, math.ceil((top_rate * 1.2 + 0.05) * 10) / 10))  # room above the maxima, from 0
    ax.legend(fontsize=8, loc="upper left")
    policies = ", ".join(dict.fromkeys(p.policy for p in points)) if has_ssd else "RAM only"
    fig.suptitle(f"kvtool bench-plan: hit rate against cache capacity, {', '.join(colors)} "
                 f"({kv:,} KV bytes/token, {policies})", fontsize=10)  # fmt: skip
    _footer(fig, doc, extra)
    fig.tight_layout()
    return fig


def write_plan(out_dir: Path, doc: dict[str, Any], points: Sequence[PlanPoint]) -> list[Path]:
    """Write `plan.json` (`doc`), `plan.csv` (one row per point) and `plan.png` (`plot_plan`) in
    `out_dir`; returns the files (raises OSError if `out_dir` cannot be created or written)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    files = [out_dir / "plan.json", out_dir / "plan.csv", out_dir / "plan.png"]
    files[0].write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    with open(files[1], "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(PlanPoint.__dataclass_fields__))
        writer.writeheader()
        writer.writerows(p.record() for p in points)
    write_plan_chart(files[2], doc, points)
    return files


def write_plan_chart(path: Path, doc: dict[str, Any], points: Sequence[PlanPoint], extra: str = "") -> Path:
    """`plot_plan` saved as a PNG at `path` (raises OSError if it cannot be written)."""
    return save(plot_plan(doc, points, extra), path, dpi=DPI)


__all__ = ["plot_plan", "tokens_label", "write_plan", "write_plan_chart"]
