"""The PNG charts of `kvtool report` (matplotlib, Agg): one chart per question (`kvtool.bench.report.CHARTS`), linear
axes, ranges over the repeats as whiskers, values written on the bars."""

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

from kvtool.bench.verdicts import (  # noqa: E402
    KIND_KVTOOL,
    MLXLM,
    NO_CACHE,
    num,
    repeat_count,
    spread,
    value_range,
    verdict_phrase,
    winners,
)

KIND_COLORS = {KIND_KVTOOL: "#4C72B0", NO_CACHE: "#C44E52", MLXLM: "#DD8452"}
WIN_COLOR = "#2E8B57"  # the winner, or the cells of a tie
DURABILITY_COLORS = {"best_effort": "#8DA0CB", "persistent": "#4C72B0", "durable": "#1B3A6B"}
DPI = 100
MAX_FIG_HEIGHT_IN = 15.5  # 1,550 px at DPI
OFF_SCALE_FACTOR = 5.0  # bars beyond 5x the fastest median are cut at the axis end and labelled


def save(fig: plt.Figure, path: Path) -> Path:
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


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
    repeats = repeat_count(cells)
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
                ax.text(limit * 0.985, yi, f"beyond the axis: {value_range(c, l_, h)} ▸", va="center", ha="right",
                        fontsize=8, color="white", fontweight="bold")
            elif np.isfinite(c):
                ax.text(h + limit * 0.015, yi, value_range(c, l_, h), va="center", ha="left", fontsize=8)
        ax.set_xlim(0, limit * 1.42)  # room for the value labels right of the whiskers
        ax.set_yticks(y, g["cell"], fontsize=8.5)
        ax.invert_yaxis()
        ax.grid(axis="x", alpha=0.3)
        ax.set_axisbelow(True)
        ax.set_xlabel("TTFT p50 (ms)", fontsize=9)
        ax.tick_params(axis="x", labelsize=8)
        ax.set_title(f"{workload}\n{verdict_phrase(v)}", fontsize=10, loc="left", fontweight="bold")
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
        _style_write_axis(ax, workload, top)
    fig.suptitle(
        f"What does each durability cost on the write path? Request-thread write time per request: "
        f"bar = median of {repeat_count(cells)} repeat(s), whisker = min–max", fontsize=11,
    )
    handles = [Patch(color=DURABILITY_COLORS.get(d, "gray"), label=f"ssd_durability = {d}") for d in durabilities]
    handles.append(Patch(color="#999999", label="mlx-lm save_prompt_cache (reference)"))
    note = ("Async writers move the SSD write off the\nrequest thread; evict_only writes to SSD\n"
            "only on RAM eviction.") if spare is not None else ""
    _legend(fig, spare, handles, note)
    return fig


def _style_write_axis(ax: Any, workload: str, top: float) -> None:
    """The y axis (0 to 1.25 x `top` ms), grid and title of one write-path panel."""
    ax.set_ylim(0, top * 1.25)
    ax.set_ylabel("write time per request (ms)", fontsize=9)
    ax.tick_params(axis="y", labelsize=8)
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)
    ax.set_title(workload, fontsize=10, loc="left", fontweight="bold")


def _bar_label(ax: Any, x: float, value: float, top: float, vertical: bool = False) -> None:
    """The bar's value just above its top, on a white box the whisker passes behind."""
    ax.text(x, value + top * 0.015, num(value), ha="center", va="bottom", fontsize=7.5, zorder=5,
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
