"""`kvtool report`: PNG charts (matplotlib, Agg) and `report.md` from a run directory.

Reads only `cells.csv`, `run.json` and (for the prompt-length chart) `requests.csv`, so a report
can be regenerated at any time from a finished run (`write_report(run_dir)`), also from a
committed summary that kept no `requests.csv`.

Trust rules:
- every latency is the **median over the repeats** of a per-repeat statistic, with its min-max
  range over the repeats (`cells.csv` columns `<metric>_min` / `<metric>_max`);
- a kvtool cell **wins** a workload only when its slowest repeat beats the fastest repeat of every
  other kvtool cell, the runner-up included (`WIN_RULE`); otherwise the workload is a **tie**
  between the best cell and every cell whose range overlaps it;
- one chart per question (`CHARTS`), linear axes, ranges as whiskers, values written on the bars.

A directory that is not a readable run raises `ReportError` (one `error:` line, exit 2, in the CLI).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from kvtool.errors import KVToolError  # noqa: E402

KIND_KVTOOL, NO_CACHE, MLXLM = "kvtool", "no-cache", "mlx-lm-prompt-cache"
KIND_COLORS = {KIND_KVTOOL: "#4C72B0", NO_CACHE: "#C44E52", MLXLM: "#DD8452"}
WIN_COLOR = "#2E8B57"  # the winner, or the cells of a tie
DURABILITY_COLORS = {"best_effort": "#8DA0CB", "persistent": "#4C72B0", "durable": "#1B3A6B"}
DPI = 100
MAX_FIG_HEIGHT_IN = 15.5  # 1,550 px at DPI
OFF_SCALE_FACTOR = 5.0  # bars beyond 5x the fastest median are cut at the axis end and labelled

CHARTS = {
    "ttft_per_workload.png": "Which policy gives the lowest TTFT per workload?",
    "write_path_by_durability.png": "What does each durability cost on the write path?",
    "ttft_vs_prompt_len.png": "How does TTFT grow with prompt length?",
}
WIN_RULE = (
    "A kvtool cell **wins** a workload only when its slowest repeat is faster than the fastest repeat "
    "of every other kvtool cell, the runner-up included (rule: winner's max < runner-up's min, on the "
    "per-repeat TTFT p50, ranges = min-max over the repeats). Otherwise the workload is a **tie** "
    "between the cell with the lowest median and every cell whose range overlaps its range."
)
REQUIRED_CELL_COLUMNS = ("workload", "cell", "kind", "ttft_p50_ms")
REQUIRED_REQUEST_COLUMNS = ("workload", "cell", "kind", "prompt_tokens", "cached_tokens", "ttft_ms")
MIN_TRUSTED_REPEATS = 3


class ReportError(KVToolError):
    """A run directory `kvtool report` cannot read (missing, empty or malformed files)."""

    hint = "expected a run directory written by `kvtool bench`, e.g. results/<run-id>/"


@dataclass
class Report:
    """Files written by `write_report`."""

    markdown: Path
    charts: list[Path]


# ------------------------------------------------------------------------------ reading
def load_run(run_dir: Path) -> tuple[pd.DataFrame, pd.DataFrame | None, dict[str, Any]]:
    """(cells, requests or None if the run kept no requests.csv, run.json) of a run directory.

    Raises:
        ReportError: not a directory, `run.json` or `cells.csv` missing, a file empty or
            malformed, or a CSV without the columns `kvtool bench` writes.
    """
    run_dir = Path(run_dir)
    if not run_dir.exists():
        raise ReportError(f"run directory not found: {run_dir}")
    if not run_dir.is_dir():
        raise ReportError(f"{run_dir} is not a directory")
    missing = [name for name in ("run.json", "cells.csv") if not (run_dir / name).is_file()]
    if missing:
        raise ReportError(f"{run_dir} is not a bench run directory: no {' and no '.join(missing)}")
    run = _read_json(run_dir / "run.json")
    cells = _read_csv(run_dir / "cells.csv", REQUIRED_CELL_COLUMNS)
    requests = None
    if (run_dir / "requests.csv").is_file():
        requests = _read_csv(run_dir / "requests.csv", REQUIRED_REQUEST_COLUMNS)
    return cells, requests, run


def _read_json(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text())
    except UnicodeDecodeError:
        raise ReportError(f"{path} is not a text file") from None
    except json.JSONDecodeError as exc:
        raise ReportError(f"{path} is not valid JSON (line {exc.lineno}: {exc.msg})") from None
    if not isinstance(doc, dict):
        raise ReportError(f"{path} is not a run document (a JSON object)")
    return doc


def _read_csv(path: Path, required: tuple[str, ...]) -> pd.DataFrame:
    try:
        df = pd.read_csv(path)
    except pd.errors.EmptyDataError:
        raise ReportError(f"{path} is empty") from None
    except (pd.errors.ParserError, UnicodeDecodeError, ValueError) as exc:
        raise ReportError(f"{path} is not a valid CSV ({str(exc).splitlines()[0]})") from None
    absent = [c for c in required if c not in df.columns]
    if absent:
        raise ReportError(f"{path} lacks the column(s) {', '.join(absent)}")
    if df.empty:
        raise ReportError(f"{path} has a header but no rows")
    for column in df.columns:  # a stray string makes a numeric column unplottable: read it as NaN
        if column.endswith(("_ms", "_min", "_max", "_tokens", "_rate", "_pct", "_s")) or column.startswith("ttft_"):
            df[column] = pd.to_numeric(df[column], errors="coerce")
    return df


# ------------------------------------------------------------------------------ numbers
def spread(cells: pd.DataFrame, metric: str) -> tuple[pd.Series, pd.Series, pd.Series]:
    """(median, min, max) of `metric` per row; a run without `<metric>_min/_max` columns
    (written before repeats carried ranges) gets min = max = median."""
    center = pd.to_numeric(cells[metric], errors="coerce") if metric in cells else pd.Series(np.nan, cells.index)
    lo = pd.to_numeric(cells[f"{metric}_min"], errors="coerce") if f"{metric}_min" in cells else center
    hi = pd.to_numeric(cells[f"{metric}_max"], errors="coerce") if f"{metric}_max" in cells else center
    return center, lo.fillna(center), hi.fillna(center)


def _repeats(cells: pd.DataFrame) -> int:
    if "repeats" not in cells:
        return 1
    values = pd.to_numeric(cells["repeats"], errors="coerce").dropna()
    return int(values.min()) if len(values) else 1


NO_SPREAD = "no spread"


def _has_spread(cells: pd.DataFrame, metric: str = "ttft_p50_ms") -> bool:
    """True if the rows carry a min-max range over at least 2 repeats."""
    return f"{metric}_min" in cells and f"{metric}_max" in cells and _repeats(cells) >= 2


WINNER_COLUMNS = [
    "workload", "verdict", "cell", "ttft_p50_ms", "ttft_p50_ms_min", "ttft_p50_ms_max", "runner_up",
    "runner_up_ttft_p50_ms", "runner_up_ttft_p50_ms_min", "runner_up_ttft_p50_ms_max", "tied_cells",
    "candidates", "repeats", "ttft_vs_no_cache", "ttft_vs_mlxlm", "vs_mlxlm", "ttft_gain",
]


def winners(cells: pd.DataFrame, metric: str = "ttft_p50_ms") -> pd.DataFrame:
    """Per workload, the kvtool cell with the lowest median `metric` and the verdict (`WIN_RULE`).

    Returns:
        One row per workload with `WINNER_COLUMNS`: `verdict` is `winner` (its max < every other
        kvtool cell's min), `tie` (`tied_cells` lists, `; `-separated, the best cell and every cell
        whose range overlaps it), `only cell`, or `no spread` (one repeat, or a cells.csv without
        ranges: no winner can be called; `cell` is merely the lowest); `runner_up` is the cell with the second-lowest
        median; `candidates` counts the kvtool cells compared; `vs_mlxlm` compares the best cell's range with the mlx-lm baseline's
        (`faster`, `slower` or `overlap`; empty without the baseline or without a spread).
    """
    rows = []
    for workload, g in cells.groupby("workload", sort=False):
        center, lo, hi = spread(g, metric)
        kv = g.assign(_c=center, _lo=lo, _hi=hi)
        kv = kv[(kv["kind"] == KIND_KVTOOL) & kv["_c"].notna()].sort_values(["_c", "_hi"], kind="stable")
        if kv.empty:
            continue
        best, others = kv.iloc[0], kv.iloc[1:]
        tied = others[others["_lo"] <= best["_hi"]]
        verdict = "only cell" if others.empty else ("winner" if tied.empty else "tie")
        if verdict == "winner" and not _has_spread(kv):
            verdict = NO_SPREAD
        runner = others.iloc[0] if len(others) else None
        base = g[g["kind"] == MLXLM]
        vs = ""
        if len(base) and _has_spread(kv):
            _, b_lo, b_hi = (s.iloc[0] for s in spread(base, metric))
            vs = "faster" if best["_hi"] < b_lo else "slower" if best["_lo"] > b_hi else "overlap"
        rows.append({
            "workload": workload, "verdict": verdict, "cell": best["cell"],
            "ttft_p50_ms": best["_c"], "ttft_p50_ms_min": best["_lo"], "ttft_p50_ms_max": best["_hi"],
            "runner_up": runner["cell"] if runner is not None else None,
            "runner_up_ttft_p50_ms": runner["_c"] if runner is not None else np.nan,
            "runner_up_ttft_p50_ms_min": runner["_lo"] if runner is not None else np.nan,
            "runner_up_ttft_p50_ms_max": runner["_hi"] if runner is not None else np.nan,
            "tied_cells": "; ".join([best["cell"], *tied["cell"]]) if len(tied) else "",
            "candidates": len(kv),
            "repeats": _repeats(kv),
            "ttft_vs_no_cache": best.get("ttft_vs_no_cache", np.nan),
            "ttft_vs_mlxlm": best.get("ttft_vs_mlxlm", np.nan),
            "vs_mlxlm": vs,
            "ttft_gain": best.get("ttft_gain", np.nan),
        })
    return pd.DataFrame(rows, columns=WINNER_COLUMNS)


# ------------------------------------------------------------------------------ writing
def write_report(run_dir: Path) -> Report:
    """Write the charts (`CHARTS`) and `report.md` into `run_dir`, replacing earlier ones.

    Raises:
        ReportError: `run_dir` is not a readable run (see `load_run`).

    Returns:
        The paths written (the prompt-length chart only if the run has a `requests.csv`).
    """
    run_dir = Path(run_dir)
    cells, requests, run = load_run(run_dir)
    best = winners(cells)
    charts = [
        _save(plot_ttft(cells, best), run_dir / "ttft_per_workload.png"),
        _save(plot_write_path(cells), run_dir / "write_path_by_durability.png"),
    ]
    if requests is not None:
        charts.append(_save(plot_ttft_vs_prompt(requests), run_dir / "ttft_vs_prompt_len.png"))
    md = run_dir / "report.md"
    md.write_text(render_markdown(cells, run, charts=[p.name for p in charts]))
    return Report(markdown=md, charts=charts)


def _save(fig: plt.Figure, path: Path) -> Path:
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def _num(value: float) -> str:
    """A latency for a label: 3 significant digits, thousands separators, no exponent."""
    if value is None or not np.isfinite(value):
        return "n/a"
    a = abs(value)
    if a >= 100:
        return f"{value:,.0f}"
    if a >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def _range(center: float, lo: float, hi: float) -> str:
    if center is None or not np.isfinite(center):
        return ""
    if not (np.isfinite(lo) and np.isfinite(hi)) or lo == hi:
        return _num(center)
    return f"{_num(center)} [{_num(lo)}–{_num(hi)}]"


def _panel_grid(n: int, panel_h: float, width_per_col: float) -> tuple[plt.Figure, list[Any], Any]:
    """A 2-column grid for `n` panels; returns (figure, the n axes, the spare axis or None)."""
    ncols = 1 if n == 1 else 2
    nrows = math.ceil(n / ncols)
    height = min(1.2 + nrows * panel_h, MAX_FIG_HEIGHT_IN)
    fig, axes = plt.subplots(nrows, ncols, figsize=(width_per_col * ncols, height), squeeze=False,
                             layout="constrained")
    flat = list(axes.ravel())
    spare = flat[n] if len(flat) > n else None
    for ax in flat[n + 1:]:
        ax.axis("off")
    return fig, flat[:n], spare


def _legend(fig: plt.Figure, spare: Any, handles: list, note: str = "") -> None:
    """The legend (and a note) in the spare panel, else below the panels: never over the bars."""
    if spare is not None:
        spare.axis("off")
        spare.legend(handles=handles, loc="upper left", fontsize=9, frameon=False)
        if note:  # anchored at the bottom, the legend at the top: they never meet
            spare.text(0.0, 0.0, note, transform=spare.transAxes, fontsize=9, va="bottom")
    else:
        fig.legend(handles=handles, loc="outside lower center", ncols=len(handles), fontsize=9, frameon=False)
        if note:
            fig.text(0.01, 0.0, note, fontsize=8, va="bottom")


def plot_ttft(cells: pd.DataFrame, best: pd.DataFrame | None = None) -> plt.Figure:
    """Question (a): which policy gives the lowest TTFT per workload?

    One panel per workload, cells sorted fastest first; bar = median over the repeats of the
    per-repeat TTFT p50, whisker = min-max over the repeats, the value and range written at the
    bar end; the winner (or the tied cells) in green; linear axis, bars far beyond the fastest
    (> `OFF_SCALE_FACTOR` x its median) cut at the axis end with their value written in.
    """
    best = winners(cells) if best is None else best
    verdicts = {r.workload: r for r in best.itertuples(index=False)}
    groups = list(cells.groupby("workload", sort=False))
    n_cells = max(len(g) for _, g in groups)
    fig, axes, spare = _panel_grid(len(groups), 0.7 + 0.26 * n_cells, 7.6)
    repeats = _repeats(cells)
    for (workload, g), ax in zip(groups, axes):
        center, lo, hi = spread(g, "ttft_p50_ms")
        g = g.assign(_c=center, _lo=lo, _hi=hi).sort_values(["_c", "_hi"], na_position="last", kind="stable")
        v = verdicts.get(workload)
        highlighted = set(v.tied_cells.split("; ")) if v is not None and v.tied_cells else set()
        if v is not None and v.verdict in ("winner", "only cell"):
            highlighted = {v.cell}
        colors = [WIN_COLOR if c in highlighted else KIND_COLORS.get(k, "gray") for c, k in zip(g["cell"], g["kind"])]
        limit = _axis_limit(g["_c"], g["_hi"], g["kind"] == KIND_KVTOOL)
        y = np.arange(len(g))
        shown = g["_c"].clip(upper=limit).fillna(0)
        off = (g["_hi"] > limit).to_numpy()
        err = np.array([(g["_c"] - g["_lo"]).clip(lower=0).fillna(0), (g["_hi"] - g["_c"]).clip(lower=0).fillna(0)])
        err[:, off] = 0
        ax.barh(y, shown, xerr=err, color=colors, error_kw={"elinewidth": 1.2, "capsize": 3, "ecolor": "#333"})
        for yi, (c, l_, h, o) in enumerate(zip(g["_c"], g["_lo"], g["_hi"], off)):
            if o:  # the bar is cut at the axis end: say so, with its value, inside the bar
                ax.text(limit * 0.985, yi, f"beyond the axis: {_range(c, l_, h)} ▸", va="center", ha="right",
                        fontsize=8, color="white", fontweight="bold")
            elif np.isfinite(c):
                ax.text(h + limit * 0.015, yi, _range(c, l_, h), va="center", ha="left", fontsize=8)
        ax.set_xlim(0, limit * 1.42)  # room for the value labels right of the whiskers
        ax.set_yticks(y, g["cell"], fontsize=8.5)
        ax.invert_yaxis()
        ax.grid(axis="x", alpha=0.3)
        ax.set_axisbelow(True)
        ax.set_xlabel("TTFT p50 (ms)", fontsize=9)
        ax.tick_params(axis="x", labelsize=8)
        ax.set_title(f"{workload}\n{_verdict_phrase(v)}", fontsize=10, loc="left", fontweight="bold")
    fig.suptitle(
        f"Which policy gives the lowest TTFT? TTFT p50 per cell, fastest first: bar = median of {repeats} "
        f"repeat(s), whisker = min–max", fontsize=11,
    )
    handles = [Patch(color=WIN_COLOR, label="winner, or the tied cells"), Patch(color=KIND_COLORS[KIND_KVTOOL], label="kvtool cell"),
               Patch(color=KIND_COLORS[MLXLM], label="mlx-lm prompt cache"), Patch(color=KIND_COLORS[NO_CACHE], label="no cache")]
    note = ("Winner: its slowest repeat beats the fastest\nrepeat of every other kvtool cell. Otherwise a\n"
            "tie: green = the fastest cell and every cell\nwhose range overlaps its range.\n\n"
            "Labels: median [min–max] in ms.") if spare is not None else ""
    _legend(fig, spare, handles, note)
    return fig


def _axis_limit(center: pd.Series, hi: pd.Series, contender: pd.Series) -> float:
    """The axis end: every bar's whisker, unless some are beyond `OFF_SCALE_FACTOR` x the fastest
    kvtool median; then those are cut (a linear axis keeps the contenders readable)."""
    finite_hi = hi[np.isfinite(hi)]
    if finite_hi.empty or not (finite_hi > 0).any():
        return 1.0
    pool = center[contender & (center > 0)]
    pool = pool if len(pool) else center[center > 0]
    fastest = pool.min() if len(pool) else finite_hi.max()
    near = hi[(center <= OFF_SCALE_FACTOR * fastest) & np.isfinite(hi)]
    limit = float(near.max()) if len(near) else float(finite_hi.max())
    return float(finite_hi.max()) if finite_hi.max() <= 1.5 * limit else limit * 1.08


def _verdict_phrase(v: Any) -> str:
    if v is None:
        return "no kvtool cell"
    if v.verdict == "tie":
        return f"tie, {len(v.tied_cells.split('; '))} of {v.candidates} kvtool cells within the spread"
    if v.verdict == "only cell":
        return f"{v.cell} (the only kvtool cell)"
    if v.verdict == NO_SPREAD:
        return f"lowest {v.cell}; no spread, no winner called"
    return f"winner {v.cell}"


def plot_write_path(cells: pd.DataFrame) -> plt.Figure:
    """Question (b): what does each durability cost on the write path?

    One panel per workload: request-thread write time per request (median over the repeats,
    whisker min-max) for every policy/writer pair, one bar per durability, the value on each bar;
    the mlx-lm baseline's save time as a grey bar for reference.
    """
    kv = cells[cells["kind"] == KIND_KVTOOL].copy()
    if kv.empty:
        fig, ax = plt.subplots(figsize=(8, 2))
        ax.axis("off")
        ax.text(0.5, 0.5, "no kvtool cell in this run: no write path to show", ha="center", va="center")
        return fig
    center, lo, hi = spread(kv, "write_path_ms_mean")
    kv = kv.assign(_c=center, _lo=lo, _hi=hi)
    kv["setting"] = kv["cell"].map(_setting_label)
    durabilities = list(dict.fromkeys(kv["ssd_durability"].fillna("?")))
    groups = list(kv.groupby("workload", sort=False))
    fig, axes, spare = _panel_grid(len(groups), 3.3, 7.4)
    width = 0.8 / max(len(durabilities), 1)
    for (workload, g), ax in zip(groups, axes):
        settings = list(dict.fromkeys(g["setting"]))
        x = np.arange(len(settings))
        top = float(np.nanmax(g["_hi"])) if g["_hi"].notna().any() else 1.0
        base = cells[(cells["workload"] == workload) & (cells["kind"] == MLXLM)]
        if len(base):
            top = max(top, float(np.nan_to_num(spread(base, "write_path_ms_mean")[2].iloc[0])))
        top = top if top > 0 else 1.0
        for i, dur in enumerate(durabilities):
            d = g[g["ssd_durability"].fillna("?") == dur].set_index("setting").reindex(settings)
            pos = x - 0.4 + width * (i + 0.5)
            err = [(d["_c"] - d["_lo"]).clip(lower=0).fillna(0), (d["_hi"] - d["_c"]).clip(lower=0).fillna(0)]
            ax.bar(pos, d["_c"].fillna(0), width * 0.92, yerr=err, color=DURABILITY_COLORS.get(dur, "gray"),
                   error_kw={"elinewidth": 1, "capsize": 2, "ecolor": "#333"})
            for p, c in zip(pos, d["_c"]):
                if np.isfinite(c):
                    _bar_label(ax, p, c, top, vertical=len(durabilities) * len(settings) > 14)
        labels = settings
        if len(base):
            b_c, b_lo, b_hi = (float(s.iloc[0]) for s in spread(base, "write_path_ms_mean"))
            bx = len(settings)
            ax.bar([bx], [b_c], 0.8 / max(len(durabilities), 1) * 0.92, color="#999999",
                   yerr=[[max(b_c - b_lo, 0)], [max(b_hi - b_c, 0)]], error_kw={"capsize": 2, "ecolor": "#333"})
            _bar_label(ax, bx, b_c, top)
            labels = settings + ["mlx-lm\nprompt cache"]
            x = np.arange(len(labels))
        ax.set_xticks(x, labels, fontsize=8.5)
        ax.set_ylim(0, top * 1.25)
        ax.set_ylabel("write time per request (ms)", fontsize=9)
        ax.tick_params(axis="y", labelsize=8)
        ax.grid(axis="y", alpha=0.3)
        ax.set_axisbelow(True)
        ax.set_title(workload, fontsize=10, loc="left", fontweight="bold")
    fig.suptitle(
        f"What does each durability cost on the write path? Request-thread write time per request: "
        f"bar = median of {_repeats(cells)} repeat(s), whisker = min–max", fontsize=11,
    )
    handles = [Patch(color=DURABILITY_COLORS.get(d, "gray"), label=f"ssd_durability = {d}") for d in durabilities]
    handles.append(Patch(color="#999999", label="mlx-lm save_prompt_cache (reference)"))
    note = ("Async writers move the SSD write off the\nrequest thread; evict_only writes to SSD\n"
            "only on RAM eviction.") if spare is not None else ""
    _legend(fig, spare, handles, note)
    return fig


def _bar_label(ax: Any, x: float, value: float, top: float, vertical: bool = False) -> None:
    """The bar's value just above its top, on a white box the whisker passes behind."""
    ax.text(x, value + top * 0.015, _num(value), ha="center", va="bottom", fontsize=7.5, zorder=5,
            rotation=90 if vertical else 0, bbox={"boxstyle": "square,pad=0.1", "fc": "white", "ec": "none", "alpha": 0.85})


def _setting_label(cell: str) -> str:
    """`write_through/async/durable[/bs128]` -> `write_through\\nasync[ bs128]` (durability is the bar)."""
    parts = str(cell).split("/")
    return "\n".join([parts[0], " ".join([parts[1], *parts[3:]])]) if len(parts) >= 3 else str(cell)


def plot_ttft_vs_prompt(requests: pd.DataFrame) -> plt.Figure:
    """Question (c): how does TTFT grow with prompt length?

    Every request of the run (faint dots), split into recomputed requests (no cache hit, any
    cell) and cache hits of kvtool and of the mlx-lm prompt cache; per x value the median (marker)
    with the interquartile range (whisker), and the group's least-squares line (dashed; the
    x values come from different workloads, so medians are not joined). Left: against the prompt length;
    right: against the tokens actually prefilled (prompt minus cached), which is what a cache
    hit leaves to compute. Each panel states each group's least-squares slope. Linear axes.
    """
    df = requests.dropna(subset=["prompt_tokens", "ttft_ms"]).copy()
    cached = pd.to_numeric(df["cached_tokens"], errors="coerce").fillna(0)
    df["_prefilled"] = df["prefill_tokens"] if "prefill_tokens" in df else df["prompt_tokens"] - cached
    df["_prefilled"] = pd.to_numeric(df["_prefilled"], errors="coerce").fillna(df["prompt_tokens"] - cached)
    hit = cached > 0
    series = [
        ("recomputed (no cache hit)", df[~hit], KIND_COLORS[NO_CACHE], "o"),
        ("kvtool cache hit", df[hit & (df["kind"] == KIND_KVTOOL)], KIND_COLORS[KIND_KVTOOL], "s"),
        ("mlx-lm prompt-cache hit", df[hit & (df["kind"] == MLXLM)], KIND_COLORS[MLXLM], "^"),
    ]
    series = [x for x in series if not x[1].empty]
    fig, axes = plt.subplots(1, 2, figsize=(15, 6.4), sharey=True, layout="constrained")
    y_top = float(df["ttft_ms"].quantile(0.995)) * 1.1 if len(df) else 1.0
    for ax, column, xlabel in ((axes[0], "prompt_tokens", "prompt length (tokens)"),
                               (axes[1], "_prefilled", "tokens prefilled = prompt - cached (tokens)")):
        x_max = float(df[column].max()) if len(df) else 1.0
        slopes = []
        for i, (label, s, color, marker) in enumerate(series):
            ax.scatter(s[column], s["ttft_ms"], s=10, alpha=0.12, color=color, linewidths=0)
            q = s.groupby(column)["ttft_ms"].quantile([0.25, 0.5, 0.75]).unstack()
            dodge = (i - (len(series) - 1) / 2) * x_max * 0.006  # keep overlapping whiskers apart
            ax.errorbar(q.index + dodge, q[0.5], yerr=[(q[0.5] - q[0.25]).to_numpy(), (q[0.75] - q[0.5]).to_numpy()],
                        color=color, marker=marker, markersize=6, linestyle="none", capsize=3, zorder=4,
                        label=f"{label} ({len(s)} requests)" if ax is axes[0] else None)
            if s[column].nunique() >= 2:
                slope, intercept = np.polyfit(s[column].astype(float), s["ttft_ms"].astype(float), 1)
                xs = np.array([float(s[column].min()), float(s[column].max())])
                ax.plot(xs, intercept + slope * xs, color=color, linestyle="--", linewidth=1.4, zorder=3)
                slopes.append(f"{label.split(' (')[0]}: {slope * 1000:+,.0f} ms per 1k tokens (dashed)")
        if slopes:
            ax.text(0.02, 0.97, "least-squares slope\n" + "\n".join(slopes), transform=ax.transAxes, va="top",
                    fontsize=9, bbox={"boxstyle": "round,pad=0.4", "fc": "white", "ec": "#bbb", "alpha": 0.9})
        ax.set_xlim(0, x_max * 1.05)
        ax.set_ylim(0, y_top)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
        ax.set_axisbelow(True)
    axes[0].set_ylabel("TTFT (ms)")
    axes[0].set_title("against the prompt length", fontsize=10)
    axes[1].set_title("against the tokens actually prefilled", fontsize=10)
    fig.suptitle("How does TTFT grow with prompt length? Every request of every cell and repeat (dots); "
                 "marker = median, whisker = interquartile range", fontsize=11)
    fig.legend(loc="outside lower center", ncols=len(series), fontsize=9, frameon=False)
    return fig


# ------------------------------------------------------------------------------ markdown
def markdown_table(df: pd.DataFrame, floatfmt: str = "{:.3g}") -> str:
    """A GitHub-flavoured markdown table (pandas' `to_markdown` would need `tabulate`)."""

    def fmt(value: Any) -> str:
        if value is None or (isinstance(value, float) and np.isnan(value)):
            return ""
        if isinstance(value, (float, np.floating)):
            return floatfmt.format(value)
        return str(value).replace("|", "\\|")

    lines = ["| " + " | ".join(map(str, df.columns)) + " |", "|" + "---|" * len(df.columns)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in df.itertuples(index=False)]
    return "\n".join(lines)


def winners_table(best: pd.DataFrame) -> pd.DataFrame:
    """The report's winners table: verdict, best cell and runner-up with their ranges."""
    rows = []
    for r in best.itertuples(index=False):
        cells = r.tied_cells.replace("; ", ", ") if r.verdict == "tie" else r.cell
        vs = f"{_x(r.ttft_vs_mlxlm)} ({r.vs_mlxlm})" if r.vs_mlxlm else _x(r.ttft_vs_mlxlm)
        rows.append({
            "workload": r.workload,
            "verdict": f"tie ({len(r.tied_cells.split('; '))} of {r.candidates})" if r.verdict == "tie" else r.verdict,
            "winner / tied cells": cells,
            "best TTFT p50 ms, median [min–max]": _range(r.ttft_p50_ms, r.ttft_p50_ms_min, r.ttft_p50_ms_max)
            + (f" ({r.cell})" if r.verdict == "tie" else ""),
            "runner-up": r.runner_up or "",
            "runner-up TTFT p50 ms": _range(r.runner_up_ttft_p50_ms, r.runner_up_ttft_p50_ms_min,
                                             r.runner_up_ttft_p50_ms_max),
            "vs no-cache": _x(r.ttft_vs_no_cache),
            "vs mlx-lm cache": vs,
        })
    return pd.DataFrame(rows)


SUMMARY_SPREAD = [("ttft_p50_ms", "TTFT p50 ms"), ("ttft_p95_ms", "TTFT p95 ms"),
                  ("write_path_ms_mean", "write path ms/request")]


def summary_table(cells: pd.DataFrame) -> pd.DataFrame:
    """Every cell: medians with [min–max] over the repeats, hit rates, ratios, shutdown checks."""
    out = pd.DataFrame({"workload": cells["workload"], "cell": cells["cell"]})
    for metric, label in SUMMARY_SPREAD:
        c, lo, hi = spread(cells, metric)
        out[label + " [min–max]"] = [_range(a, b, d) for a, b, d in zip(c, lo, hi)]
    for column, label, fmt in (("ram_hit_rate", "RAM hit", "{:.2f}"), ("ssd_hit_rate", "SSD hit", "{:.2f}"),
                               ("prefill_saved_pct", "prefill saved %", "{:.0f}"),
                               ("write_amplification", "write amp.", "{:.2f}")):
        values = pd.to_numeric(cells[column], errors="coerce") if column in cells else pd.Series(np.nan, cells.index)
        out[label] = [fmt.format(v) if np.isfinite(v) else "" for v in values]
    for column, label in (("ttft_vs_no_cache", "vs no-cache"), ("ttft_vs_mlxlm", "vs mlx-lm")):
        values = cells[column] if column in cells else pd.Series(np.nan, cells.index)
        out[label] = [_x(v) if pd.notna(v) else "" for v in values]
    for column, label in (("shutdown_clean", "clean"), ("drain_verified", "drained")):
        out[label] = cells[column].map(lambda v: "" if pd.isna(v) else str(v)) if column in cells else ""
    return out


def render_markdown(cells: pd.DataFrame, run: dict[str, Any], charts: list[str] | None = None) -> str:
    """The text of report.md (`charts`: the PNG names written, default all of `CHARTS`)."""
    m = run.get("machine") or {}
    disk = m.get("cache_disk") or {}
    drop = run.get("page_cache_drop") or {}
    model = run.get("model") or {}
    repeats = _repeats(cells)
    has_spread = "ttft_p50_ms_min" in cells
    lines = [
        f"# kvtool bench report: {run.get('run_id')}",
        "",
        f"- model: `{model.get('spec')}` (model_id `{model.get('model_id')}`)",
        (f"- machine: {m.get('cpu_model')}, {m.get('cpu_cores')} cores, {_gib(m.get('ram_bytes'))} RAM; "
         f"cache on {disk.get('device')} ({disk.get('filesystem')})"),
        f"- versions: {', '.join(f'{k} {v}' for k, v in (m.get('versions') or {}).items())}",
        f"- git commit: `{run.get('git_commit')}`; started {run.get('started')}, {run.get('duration_s')} s",
        f"- page cache drop before cold reads: {drop.get('ok')} ({drop.get('files')} files; {drop.get('method')})",
        (f"- repeats per cell: {repeats}; every number is the median over the repeats of a per-repeat statistic, "
         "with its range `[min–max]` over the repeats"),
        "",
        "Ratios are speed-ups of the median TTFT p50: baseline / cell (> 1 means the cell is faster).",
        "",
        "## Winning cell per workload",
        "",
        WIN_RULE + (" `vs mlx-lm cache` says whether the best cell's range is entirely below (faster), "
                    "above (slower) or overlapping the mlx-lm prompt cache's range."),
        "",
    ]
    if repeats < 2:
        lines += [(f"**Caution: {repeats} repeat per cell: no spread, so no winner is called** (verdict "
                   f"`{NO_SPREAD}`; the cell named is merely the lowest). Run with `repeats = 3` or more."), ""]
    elif repeats < MIN_TRUSTED_REPEATS:
        lines += [(f"**Caution: {repeats} repeats per cell.** A range from fewer than {MIN_TRUSTED_REPEATS} "
                   "repeats says little about noise; treat every winner as provisional."), ""]
    if not has_spread:
        lines += [("**This run's cells.csv has no min/max columns** (written before ranges were recorded): "
                   f"values are shown without a range and no winner is called (`{NO_SPREAD}`)."), ""]
    best = winners(cells)
    lines.append(markdown_table(winners_table(best)) if len(best) else "- no kvtool cell in this run")
    gains = best[best["ttft_gain"].notna()] if len(best) else best
    for r in gains.itertuples(index=False):
        lines += ["", f"{r.workload}: TTFT gain warm-up / query of `{r.cell}`: {r.ttft_gain:.2f}x."]
    lines += ["", "## Every cell", "", markdown_table(summary_table(cells)), "", "## Charts", ""]
    names = list(CHARTS) if charts is None else charts
    lines += [f"### {CHARTS.get(name, name)}\n\n![{CHARTS.get(name, name)}]({name})\n" for name in names]
    if charts is not None and "ttft_vs_prompt_len.png" not in charts:
        lines.append("(No requests.csv in this directory: the TTFT-against-prompt-length chart needs it.)\n")
    return "\n".join(lines)


def _x(value: float) -> str:
    return f"{value:.2f}x" if pd.notna(value) else "n/a"


def _gib(n: Any) -> str:
    return f"{n / (1 << 30):.1f} GiB" if isinstance(n, (int, float)) else "?"
