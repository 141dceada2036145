"""The PNG charts of `kvtool report` (matplotlib, Agg): one chart per question (`kvtool.bench.report.CHARTS`).

Every chart draws medians with their 95 % bootstrap interval (`kvtool.bench.verdicts.spread`,
`kvtool.bench.loadstats.bootstrap_ci`) on **one shared log scale per quantity**, labelled with its
unit, and carries a footer with the machine, the load average, the commit and the repeats
(`footer`). Bars (`interval_bars`) run from the axis start to the median, the whisker is the
interval, and the value with its interval stands in a label column of its own (`LABEL_X`). Each
row is labelled by the cell's dimensions in aligned columns (`grid_label`).

Colours, one meaning each (the loadcharts palette): the **winner** green, cells **tied** with the
lowest grey, cells slower than the lowest beyond the intervals light red, baselines white hatched.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402
from matplotlib.ticker import FuncFormatter, LogLocator  # noqa: E402

from kvtool.bench.loadstats import bootstrap_ci  # noqa: E402
from kvtool.bench.verdicts import (  # noqa: E402
    KIND_KVTOOL,
    MLXLM,
    NO_CACHE,
    num,
    repeat_count,
    spread,
    tie_span,
    value_range,
    verdict_phrase,
    winners,
)

WIN, TIE, SLOWER, BASELINE, PLAIN = "#1A9850", "#A6A6A6", "#F4A582", "#FFFFFF", "#9ECAE1"
WHISKER = "#000000"
BASELINE_LABELS = {NO_CACHE: "no-cache (baseline)", MLXLM: "mlx-lm cache (baseline)"}
GRID_HEADER = ("policy", "writer", "durability")
GRID_WIDTHS = (14, 7, 12)  # characters per column of a row label (monospace)
DPI = 100
MAX_FIG_HEIGHT_IN = 15.5  # 1,550 px at DPI
LABEL_X = 0.70  # the value labels start at this fraction of the axes width; the data ends before it
_INTERVAL = "bar = median over the repeats, whisker = 95% bootstrap interval of the median"


def save(fig: plt.Figure, path: Path, dpi: int = DPI) -> Path:
    """`fig` as a PNG at `path`, then closed (raises OSError if it cannot be written)."""
    try:
        fig.savefig(path, dpi=dpi)
    finally:
        plt.close(fig)
    return path


def footer(fig: plt.Figure, run: dict[str, Any] | None, repeats: int, extra: str = "") -> None:
    """Machine, load average at the start, commit and repeats under the panels (`fig.supxlabel`)."""
    run = run or {}
    parts = [*machine_parts(run.get("machine")), f"commit {str(run.get('git_commit') or '?')[:10]}",
             f"{repeats} repeat(s) per cell", f"run {run.get('run_id') or '?'}"]
    footer_text(fig, " | ".join(parts) + (f"\n{extra}" if extra else ""))


def machine_parts(machine: dict[str, Any] | None) -> list[str]:
    """The footer's machine (CPU, cores, RAM) and load average at the start, from a
    `kvtool.bench.machine.machine_info` record (`?` / `not recorded` where absent)."""
    m = machine or {}
    ram = m.get("ram_bytes")
    load = m.get("load_avg")
    return [f"machine: {m.get('cpu_model') or '?'}, {m.get('cpu_cores') or '?'} cores, "
            + (f"{ram / (1 << 30):.0f} GiB RAM" if isinstance(ram, (int, float)) else "? RAM"),
            "load avg at start: " + (", ".join(f"{x:.2f}" for x in load) if load else "not recorded")]


def footer_text(fig: plt.Figure, text: str) -> None:
    """`text` as the figure's footer (`fig.supxlabel`, the charts' small grey type)."""
    fig.supxlabel(text, fontsize=8, color="#333333")


def grid_label(cell: str, kind: str) -> str:
    """A row label: the cell's dimensions in aligned columns (`GRID_HEADER`), or the baseline's name."""
    if kind != KIND_KVTOOL:
        return f"{BASELINE_LABELS.get(kind, str(cell)):<{sum(GRID_WIDTHS)}}"
    parts = str(cell).split("/") + ["", "", ""]
    return "".join(f"{p:<{w}}" for p, w in zip(parts, GRID_WIDTHS)) + " ".join(parts[3:-3])


def _rows(frame: pd.DataFrame) -> list[tuple[str, str]]:
    """The (cell, kind) rows of a chart: baselines first, then kvtool cells in sweep order."""
    pairs = list(dict.fromkeys(zip(frame["cell"], frame["kind"])))
    return sorted(pairs, key=lambda p: {NO_CACHE: 0, MLXLM: 1}.get(p[1], 2))


def log_limits(lows: np.ndarray, highs: np.ndarray) -> tuple[float, float]:
    """The shared log axis (xmin, xmax): every positive value inside, the data ending before
    `LABEL_X` of the width so the label column never meets a whisker."""
    lows, highs = np.asarray(lows, dtype=float), np.asarray(highs, dtype=float)
    pos = np.concatenate([lows[np.isfinite(lows) & (lows > 0)], highs[np.isfinite(highs) & (highs > 0)]])
    if pos.size == 0:
        return 1e-3, 1.0
    lo, hi = float(pos.min()) / 1.6, float(pos.max()) * 1.15
    span = math.log10(hi / lo) if hi > lo else 1.0
    return lo, lo * 10 ** (span / (LABEL_X - 0.04))


def interval_bars(ax: Any, rows: list[tuple[str, str]], frame: pd.DataFrame, colors: dict[str, str],
                  xmin: float) -> None:
    """One horizontal bar per row (`frame` indexed by cell, with `_c`, `_lo`, `_hi`), the interval
    as a black whisker and `median [lo–hi]` in the label column; a missing cell leaves its row empty."""
    d = frame.reindex([c for c, _ in rows]).assign(_kind=[k for _, k in rows], _y=np.arange(len(rows)))
    d = d[np.isfinite(d["_c"].to_numpy(dtype=float))]
    c, y = d["_c"].to_numpy(dtype=float), d["_y"].to_numpy()
    shown = np.maximum(c, xmin)
    lo = np.clip(np.nan_to_num(d["_lo"].to_numpy(dtype=float), nan=xmin), xmin, shown)
    hi = np.maximum(np.nan_to_num(d["_hi"].to_numpy(dtype=float), nan=xmin), shown)
    baseline = (d["_kind"] != KIND_KVTOOL).to_numpy()
    bars = ax.barh(y, shown - xmin, left=xmin, height=0.7, linewidth=0.8,
                   color=[colors.get(cell, BASELINE if b else PLAIN) for cell, b in zip(d.index, baseline)],
                   edgecolor=["#404040" if b else "none" for b in baseline])
    for patch, b in zip(bars.patches, baseline):
        patch.set_hatch("///" if b else None)
    ax.errorbar(shown, y, xerr=[shown - lo, hi - shown], fmt="none", ecolor=WHISKER, capsize=3, elinewidth=1.2,
                zorder=4)
    for yi, cc, ll, hh in zip(y, c, d["_lo"], d["_hi"]):
        ax.text(LABEL_X, yi, value_range(cc, ll, hh) if cc > 0 else "0", transform=ax.get_yaxis_transform(),
                va="center", ha="left", fontsize=7.5, color="#000000", zorder=5,
                bbox={"boxstyle": "square,pad=0.1", "fc": "#FFFFFF", "ec": "none"})


def _style(ax: Any, rows: list[tuple[str, str]], xlabel: str, title: str) -> None:
    """Log x axis with its unit, the row grid (header row on top), the panel title."""
    ax.set_xscale("log")
    _plain_log_ticks(ax.xaxis)
    ax.set_yticks(np.arange(-1, len(rows)), [grid_label("/".join(GRID_HEADER), KIND_KVTOOL)] + [grid_label(c, k) for c, k in rows],
                  fontfamily="monospace", fontsize=7.5)
    for label in ax.get_yticklabels()[:1]:  # the header row (panels sharing the left column's labels have none)
        label.set_fontweight("bold")
    ax.set_ylim(len(rows) - 0.5, -1.6)
    ax.set_xlabel(xlabel, fontsize=8.5)
    ax.tick_params(axis="x", labelsize=8)
    ax.grid(axis="x", which="both", alpha=0.25)
    ax.set_axisbelow(True)
    ax.set_title(title, fontsize=9, loc="left", fontweight="bold")


def _plain_log_ticks(axis: Any) -> None:
    """Ticks at 1, 2, 5 x 10^k written as plain numbers (`0.5`, `20`), not `2 x 10^1`."""
    axis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(FuncFormatter(lambda v, _: ""))


def _grid(n: int, n_rows: int, ncols: int, width: float, sharex: Any = True) -> tuple[plt.Figure, np.ndarray]:
    nrows = math.ceil(n / ncols)
    height = min(1.9 + nrows * (0.5 + 0.19 * (n_rows + 1)), MAX_FIG_HEIGHT_IN)
    fig, axes = plt.subplots(nrows, ncols, figsize=(width * ncols, height), squeeze=False, sharex=sharex,
                             sharey=True, layout="constrained")
    return fig, axes


def cell_colors(g: pd.DataFrame, v: Any) -> dict[str, str]:
    """Cell -> colour in one workload: `WIN` the winner, `TIE` the cells tied with the lowest (and
    every cell when no winner can be called), `SLOWER` the rest, `BASELINE` the baselines."""
    tied = set(v.tied_cells.split("; ")) if v is not None and v.tied_cells else set()
    out = {}
    for cell, kind in zip(g["cell"], g["kind"]):
        if kind != KIND_KVTOOL:
            out[cell] = BASELINE
        elif v is not None and v.verdict == "winner":
            out[cell] = WIN if cell == v.cell else SLOWER
        elif v is not None and v.verdict == "tie":
            out[cell] = TIE if cell in tied else SLOWER
        else:
            out[cell] = TIE
    return out


def plot_ttft(cells: pd.DataFrame, best: pd.DataFrame | None = None, run: dict[str, Any] | None = None) -> plt.Figure:
    """Question (a): which policy gives the lowest TTFT per workload, and by how much?

    One panel per workload, all on one shared log axis (TTFT p50, ms); rows in the same order in
    every panel (baselines, then the kvtool cells labelled by policy, writer, durability); bar =
    median over the repeats, whisker = its 95 % bootstrap interval; colours per `cell_colors`;
    the title names the winner or says no policy differs beyond the noise, with the tied span.
    """
    best = winners(cells) if best is None else best
    verdicts = {r.workload: r for r in best.itertuples(index=False)}
    center, lo, hi = spread(cells, "ttft_p50_ms")
    data = cells.assign(_c=center, _lo=lo, _hi=hi)
    groups = list(data.groupby("workload", sort=False))
    rows = _rows(data)
    xmin, xmax = log_limits(data["_lo"].to_numpy(), data["_hi"].to_numpy())
    fig, axes = _grid(len(groups) + 1, len(rows), 1 if len(groups) <= 2 else 2, 7.2)
    flat = list(axes.ravel())
    for (workload, g), ax in zip(groups, flat):
        v = verdicts.get(workload)
        interval_bars(ax, rows, g.set_index("cell"), cell_colors(g, v), xmin)
        title = f"{workload}: {_short_verdict(v)}" + (f"\n{tie_span(v)}" if v is not None and v.verdict == "tie" else "")
        _style(ax, rows, "TTFT p50 (ms, log scale)", title)
        ax.set_xlim(xmin, xmax)
    _legend(fig, flat[len(groups):], [(WIN, "winner: interval wholly below every other kvtool cell"),
                                      (TIE, "tie: interval overlaps the lowest cell's (or no verdict)"),
                                      (SLOWER, "slower than the lowest beyond the intervals"),
                                      (BASELINE, "baseline (reference, never wins)")])
    fig.suptitle(f"Which policy gives the lowest TTFT, and by how much? TTFT p50 per cell: {_INTERVAL}", fontsize=10)
    footer(fig, run, repeat_count(cells))
    return fig


def _short_verdict(v: Any) -> str:
    """A panel title's verdict: `verdict_phrase`, a tie shortened to fit a panel."""
    if v is not None and v.verdict == "tie":
        return f"tie, no policy differs beyond the noise ({len(v.tied_cells.split('; '))} of {v.candidates})"
    return verdict_phrase(v)


def _legend(fig: plt.Figure, spare: list[Any], entries: list[tuple[str, str]]) -> None:
    """The colour legend in the first spare panel (the others hidden), else under the title."""
    handles = [Patch(facecolor=c, edgecolor="#404040", hatch="///" if c == BASELINE else None, label=t)
               for c, t in entries]
    for ax in spare:
        ax.axis("off")
    if spare:
        spare[0].legend(handles=handles, loc="center", fontsize=8.5, frameon=False)
    else:
        fig.legend(handles=handles, loc="outside upper center", ncols=2, fontsize=8, frameon=False)


def writer_rates(cells: pd.DataFrame, run: dict[str, Any] | None, cpu: bool = False) -> pd.DataFrame:
    """Per (workload, cell): bytes the cell wrote to its disk per second of the cell run (MB/s),
    or with `cpu` the writer's CPU time per second of the cell run (% of one core: the counter
    `writer_cpu_us`, the saves' CPU on whichever thread ran them), median over the repeats with its
    95 % bootstrap interval (`_c`, `_lo`, `_hi`). From run.json's `cell_runs` (`counters.ssd_bytes_written`,
    else the bytes on disk, over `wall_s`); a run without them uses cells.csv's `bytes_written /
    wall_s` with no interval (and no CPU: NaN)."""
    runs = [r for r in (run or {}).get("cell_runs") or [] if isinstance(r, dict) and r.get("wall_s")]
    if runs:
        def value(r: dict) -> float:
            counters = r.get("counters") or {}
            if cpu:
                return float(counters.get("writer_cpu_us", float("nan"))) / 1e6 / float(r["wall_s"]) * 100
            return float(counters.get("ssd_bytes_written", r.get("bytes_written")) or 0) / float(r["wall_s"]) / 1e6

        rates = pd.DataFrame([{"workload": r.get("workload"), "cell": r.get("cell"), "_rate": value(r)} for r in runs])
        ivs = rates.groupby(["workload", "cell"], sort=False)["_rate"].agg(lambda s: bootstrap_ci(s, median=True))
        return pd.DataFrame({"_c": ivs.map(lambda i: i.point), "_lo": ivs.map(lambda i: i.lo),
                             "_hi": ivs.map(lambda i: i.hi)})
    rate = pd.to_numeric(cells.get("bytes_written"), errors="coerce") / pd.to_numeric(cells.get("wall_s"), errors="coerce")
    frame = pd.DataFrame({"_c": rate.to_numpy() / 1e6 if not cpu else np.full(len(cells), np.nan)},
                         index=pd.MultiIndex.from_frame(cells[["workload", "cell"]]))  # fmt: skip
    return frame.assign(_lo=frame["_c"], _hi=frame["_c"])


def plot_write_path(cells: pd.DataFrame, run: dict[str, Any] | None = None) -> plt.Figure:
    """Question (b): what does each setting cost on the write path, on the request thread and in total?

    One row of panels per workload. Left: the request thread's write time per request (ms, median
    over the repeats, 95 % interval) of every kvtool cell and the mlx-lm baseline's save. Middle:
    the writer's total output, bytes written per second of the cell run (MB/s, `writer_rates`);
    right: the CPU its saves took, per second of the cell run (% of one core; runs recorded before
    the counter existed show none), so an async writer that leaves the request thread is not
    drawn free. One shared log scale per column.
    """
    shown = cells[cells["kind"].isin([KIND_KVTOOL, MLXLM])]
    if not (shown["kind"] == KIND_KVTOOL).any():
        fig, ax = plt.subplots(figsize=(8, 2))
        ax.axis("off")
        ax.text(0.5, 0.5, "no kvtool cell in this run: no write path to show", ha="center", va="center")
        return fig
    center, lo, hi = spread(shown, "write_path_ms_mean")
    thread = shown.assign(_c=center, _lo=lo, _hi=hi).set_index(["workload", "cell"])[["_c", "_lo", "_hi"]]
    rates = writer_rates(shown, run).reindex(thread.index)
    cpu = writer_rates(shown, run, cpu=True).reindex(thread.index)
    rows = _rows(shown)
    workloads = list(dict.fromkeys(shown["workload"]))
    columns = [(thread, "request-thread write time per request (ms, log scale)", "request thread"),
               (rates, "bytes written per second of the cell run (MB/s, log scale)", "writer's total output")]
    if cpu["_c"].notna().any():
        columns.append((cpu, "writer CPU per second of the cell run (% of one core, log scale)", "writer's CPU"))
    fig, axes = _grid(len(columns) * len(workloads), len(rows), len(columns), 6.8, sharex="col")
    for col, (frame, xlabel, side) in enumerate(columns):
        known = frame.dropna(subset=["_c"])
        xmin, xmax = log_limits(known["_lo"].to_numpy(), known["_hi"].to_numpy())
        for workload, ax in zip(workloads, axes[:, col]):
            interval_bars(ax, rows, frame.loc[workload], {}, xmin)
            _style(ax, rows, xlabel, f"{workload}: {side}")
            ax.set_xlim(xmin, xmax)
    fig.suptitle(f"What does each setting cost on the write path? {_INTERVAL}", fontsize=10)
    note = ("the right columns are its total output and CPU" if len(columns) == 3 else
            "the right column is its total output (this run predates the writer CPU counter)")  # fmt: skip
    footer(fig, run, repeat_count(cells), f"An async writer moves the write off the request thread, not off the machine: {note}.")
    return fig


def _buckets(prompt: pd.Series, most: int = 8) -> pd.Series:
    """Prompt-length bucket of every request: the length itself for few lengths, else quantile bins."""
    if prompt.nunique() <= most:
        return prompt
    return pd.qcut(prompt, most, duplicates="drop").cat.codes


def _labels_apart(ax: Any, points: list[tuple[float, float]], gap_pt: float = 9.0, width_pt: float = 40.0) -> None:
    """Value labels beside their points, none over another: points less than `width_pt` apart
    across form a group, whose labels go top down, each moved down until it is `gap_pt` points
    below the one above it (close medians of the cache states otherwise print over each other)."""
    to_pt = 72.0 / ax.figure.dpi
    at = [(float(px) * to_pt, float(py) * to_pt, x, y)
          for (px, py), (x, y) in zip(ax.transData.transform(points), points)] if points else []
    groups: list[list[tuple[float, float, float, float]]] = []
    for p in sorted(at):
        if groups and p[0] - groups[-1][-1][0] < width_pt:
            groups[-1].append(p)
        else:
            groups.append([p])
    for group in groups:
        above: float | None = None
        for _, py, x, y in sorted(group, key=lambda p: -p[1]):
            want = py + 4 if above is None else min(py + 4, above - gap_pt)
            ax.annotate(num(y), (x, y), textcoords="offset points", xytext=(6, want - py), fontsize=7.5)
            above = want


def plot_ttft_vs_prompt(requests: pd.DataFrame, run: dict[str, Any] | None = None) -> plt.Figure:
    """Question (c): how does TTFT grow with prompt length, per cache state?

    Requests of every cell and repeat, bucketed by prompt length (`_buckets`); per bucket and
    cache state (recomputed, kvtool cache hit, mlx-lm prompt-cache hit) the median TTFT with the
    95 % bootstrap interval of that median (`bootstrap_ci(median=True)`), at the bucket's median
    prompt length, joined by one line per state. Log TTFT axis (ms), linear prompt axis (tokens).
    No fitted slopes.
    """
    df = requests.dropna(subset=["prompt_tokens", "ttft_ms"]).copy()
    hit = pd.to_numeric(df["cached_tokens"], errors="coerce").fillna(0) > 0
    df["_state"] = np.where(~hit, "recomputed (no cache hit)",
                            np.where(df["kind"] == MLXLM, "mlx-lm prompt-cache hit", "kvtool cache hit"))
    df["_bucket"] = _buckets(df["prompt_tokens"])
    colors = {"recomputed (no cache hit)": "#D73027", "kvtool cache hit": "#1F4E9A", "mlx-lm prompt-cache hit": "#E08214"}
    fig, ax = plt.subplots(figsize=(11, 6.4), layout="constrained")
    labels: list[tuple[float, float]] = []  # (bucket's prompt length, median TTFT) of each state
    for state, s in df.groupby("_state", sort=False):
        per = s.groupby("_bucket")
        ivs = per["ttft_ms"].agg(lambda v: bootstrap_ci(v, median=True))
        x = per["prompt_tokens"].median().to_numpy(dtype=float)
        c = ivs.map(lambda i: i.point).to_numpy(dtype=float)
        err = [c - ivs.map(lambda i: i.lo).to_numpy(dtype=float), ivs.map(lambda i: i.hi).to_numpy(dtype=float) - c]
        ax.errorbar(x, c, yerr=np.clip(err, 0, None), color=colors[str(state)], marker="o", capsize=3,
                    label=f"{state} ({len(s)} requests)")
        labels += zip(x.tolist(), c.tolist())
    ax.set_yscale("log")
    ax.autoscale_view()
    _labels_apart(ax, labels)
    _plain_log_ticks(ax.yaxis)
    ax.set_xlabel("prompt length (tokens; bucket median)")
    ax.set_ylabel("TTFT (ms, log scale)")
    ax.grid(which="both", alpha=0.25)
    ax.legend(fontsize=9, loc="best")
    fig.suptitle("How does TTFT grow with prompt length? Per length bucket: median TTFT of the requests, "
                 "whisker = 95% bootstrap interval of the median", fontsize=10)
    footer(fig, run, int(df["repeat"].nunique()) if "repeat" in df else 1)
    return fig
