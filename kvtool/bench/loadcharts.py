"""Charts of the load benchmark (matplotlib, Agg backend, PNG).

Colours (`COLORS`), one meaning each: verdicts of kvtool against the mlx-lm baseline (**win**
green, **loss** red, **tie** grey: a tie is never drawn in the win or loss colour); the mlx-lm
baseline itself dark grey, dashed lines / hatched bars, as a reference; kvtool curves that carry
no verdict (the TTFT CDF) blue; the RAM / SSD tiers of the hit-rate chart blue / purple.
Whiskers everywhere are the 95 % bootstrap interval over the repeats (`kvtool.bench.loadstats`).
Layout: constrained (matplotlib's), so no title meets the figure's suptitle or a neighbour; at
most `MAX_VALUE_TICKS` ticks on a value axis and category labels turned past
`MAX_FLAT_CATEGORIES` categories (`category_ticks`), so tick labels never run together.

Charts (`write_charts`):
- `ttft_cdf.png`: the empirical CDF of TTFT per cell (requests of all repeats pooled), one panel
  per (workload, clients), kvtool solid blue, mlx-lm dashed grey; markers at the mean p50 / p90 /
  p99 over the repeats with horizontal whiskers (their intervals);
- `throughput_vs_concurrency.png`: requests/s against clients per workload; kvtool points
  coloured by their verdict against mlx-lm at that client count, mlx-lm dashed grey;
- `hit_rate_per_tier.png`: token hit rate per tier (kvtool RAM, kvtool SSD; mlx-lm's in-memory
  prompt cache hatched grey) per workload and client count;
- `ttft_ratio.png`: kvtool / mlx-lm TTFT p50 per (workload, clients), bars coloured by verdict,
  whiskers = the ratio's interval, a dashed line at 1 (below 1: kvtool faster).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.patches import Patch, Rectangle  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from kvtool.bench.loadserver import KVTOOL, MLXLM  # noqa: E402
from kvtool.bench.loadstats import LOSS, TIE, WIN  # noqa: E402
from kvtool.bench.report_charts import DPI, save  # noqa: E402

COLORS = {WIN: "#1A9850", LOSS: "#D73027", TIE: "#A6A6A6", "baseline": "#404040", "kvtool": "#4C72B0",
          "ram": "#4C72B0", "ssd": "#8172B2"}
VERDICT_LABELS = {WIN: "kvtool wins (intervals apart)", LOSS: "kvtool loses (intervals apart)",
                  TIE: "tie (intervals overlap)"}
MAX_VALUE_TICKS = 5  # major ticks on a value axis of a panel (TTFT in ms: 5-digit labels stay apart)
MAX_FLAT_CATEGORIES = 4  # more category labels than this are turned
CATEGORY_ROTATION = 30  # degrees


def verdict_color(verdict: str) -> str:
    """The colour of a verdict; anything but `win` / `loss` is a tie."""
    return COLORS.get(verdict, COLORS[TIE]) if verdict in (WIN, LOSS) else COLORS[TIE]


def draw_verdict_bars(ax: Axes, labels: Sequence[str], values: Sequence[float], lows: Sequence[float],
                      highs: Sequence[float], verdicts: Sequence[str], *, reference: float | None = 1.0
                      ) -> list[Rectangle]:
    """Bars coloured by verdict with interval whiskers; a dashed baseline line at `reference`.

    Returns:
        The bar patches, in the order of `labels`.
    """
    x = np.arange(len(labels))
    vals = np.asarray(values, dtype=float)
    bars = ax.bar(x, np.nan_to_num(vals), color=[verdict_color(v) for v in verdicts], edgecolor="none", width=0.6)
    ax.errorbar(x, vals, yerr=_err(vals, lows, highs), fmt="none", ecolor="black", capsize=4, linewidth=1)
    if reference is not None:
        ax.axhline(reference, color=COLORS["baseline"], linestyle="--", linewidth=1)
    category_ticks(ax, labels)
    present = [v for v in (WIN, LOSS, TIE) if v in {vv if vv in (WIN, LOSS) else TIE for vv in verdicts}]
    handles: list[Any] = [Patch(color=COLORS[v], label=VERDICT_LABELS[v]) for v in present]
    if reference is not None:
        handles.append(Line2D([], [], color=COLORS["baseline"], linestyle="--", label="mlx-lm (reference)"))
    ax.legend(handles=handles, fontsize=8, loc="best")
    return list(bars.patches)


def ratio_chart(path: Path, cmp: pd.DataFrame, figure: str = "ttft_p50_ms") -> Path:
    """`ttft_ratio.png`: kvtool / mlx-lm of `figure` per (workload, clients) from `comparison.csv`
    rows (columns `workload`, `clients`, `figure`, `ratio`, `ratio_lo`, `ratio_hi`, `verdict`)."""
    sel = cmp[cmp["figure"] == figure]
    fig, ax = plt.subplots(figsize=(max(5.0, 1.1 * len(sel) + 2), 4), dpi=DPI, layout="constrained")
    labels = [f"{w}\n{c} client{'s' if int(c) != 1 else ''}" for w, c in zip(sel["workload"], sel["clients"])]
    draw_verdict_bars(ax, labels, sel["ratio"].tolist(), sel["ratio_lo"].tolist(), sel["ratio_hi"].tolist(),
                      sel["verdict"].tolist())
    ax.set_ylabel(f"kvtool / mlx-lm ({figure})")
    ax.set_title(f"kvtool / mlx-lm {figure} (below 1: kvtool faster)\nwhiskers: 95 % interval of the ratio;\n"
                 "colour: verdict on the two cells' intervals", fontsize=9)
    return save(fig, path)


def ttft_cdf_chart(path: Path, requests: pd.DataFrame, cells: pd.DataFrame) -> Path:
    """`ttft_cdf.png` (see the module docstring). `requests`: measured, successful request rows."""
    panels = sorted({(w, int(c)) for w, c in zip(cells["workload"], cells["clients"])}, key=lambda k: (k[0], k[1]))
    fig, axes = _panels(len(panels), 4.6, 3.6)
    for ax, (workload, clients) in zip(axes, panels):
        for server in (MLXLM, KVTOOL):
            sel = requests[(requests["workload"] == workload) & (requests["clients"] == clients)
                           & (requests["server"] == server)]
            if sel.empty:
                continue
            t = np.sort(sel["ttft_ms"].to_numpy(dtype=float))
            style = _server_style(server)
            ax.step(t, np.arange(1, t.size + 1) / t.size, where="post", label=server, **style)
            cell = cells[(cells["workload"] == workload) & (cells["clients"] == clients) & (cells["server"] == server)]
            if not cell.empty:
                row = cell.iloc[0]
                for q, y in (("ttft_p50_ms", 0.5), ("ttft_p90_ms", 0.9), ("ttft_p99_ms", 0.99)):
                    ax.errorbar([row[q]], [y], xerr=_err([row[q]], [row[f"{q}_lo"]], [row[f"{q}_hi"]]), fmt="o",
                                color=style["color"], capsize=3, markersize=3)
        ax.set_title(f"{workload}, {clients} client{'s' if clients != 1 else ''}", fontsize=9)
        ax.set_xlabel("TTFT (ms)")
        ax.xaxis.set_major_locator(MaxNLocator(MAX_VALUE_TICKS, steps=[1, 2, 2.5, 5, 10]))
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    fig.suptitle("TTFT CDF per cell\nmarkers: p50 / p90 / p99, whiskers: 95 % interval over repeats", fontsize=9)
    return save(fig, path)


def throughput_chart(path: Path, cells: pd.DataFrame, cmp: pd.DataFrame) -> Path:
    """`throughput_vs_concurrency.png` (see the module docstring)."""
    workloads = sorted(set(cells["workload"]))
    fig, axes = _panels(len(workloads), 4.8, 3.8)
    for n, (ax, workload) in enumerate(zip(axes, workloads)):
        for server in (MLXLM, KVTOOL):
            sel = cells[(cells["workload"] == workload) & (cells["server"] == server)].sort_values("clients")
            if sel.empty:
                continue
            x = sel["clients"].to_numpy(dtype=float) * (0.94 if server == MLXLM else 1.06)  # side by side
            y = sel["requests_per_s"].to_numpy(dtype=float)
            err = _err(y, sel["requests_per_s_lo"], sel["requests_per_s_hi"])
            if server == MLXLM:
                ax.errorbar(x, y, yerr=err, label="mlx-lm (reference)", capsize=3, marker="s",
                            markersize=4, **_server_style(server))
                continue
            ax.plot(x, y, color=COLORS["kvtool"], linewidth=1, label="kvtool")
            verdicts = [_verdict(cmp, workload, int(c), "requests_per_s") for c in sel["clients"]]
            for xi, yi, lo, hi, v in zip(x, y, err[0], err[1], verdicts):
                ax.errorbar([xi], [yi], yerr=[[lo], [hi]], fmt="o", color=verdict_color(v),
                            ecolor="black", capsize=3, markersize=7)
        ax.set_xscale("log", base=2)
        xs = sorted(set(cells["clients"]))
        ax.set_xticks(xs, [str(int(c)) for c in xs])
        ax.set_xlim(min(xs) / 1.5, max(xs) * 1.5)
        ax.set_xlabel("clients (concurrent requests)")
        ax.set_ylabel("requests/s")
        ax.set_ylim(bottom=0)  # heights compared as ratios: from zero
        ax.set_title(workload, fontsize=9)
        ax.grid(alpha=0.3)
        if n == 0:  # one legend, the same for every panel, below them (inside, it hid the points)
            handles, _ = ax.get_legend_handles_labels()
            handles += [Patch(color=COLORS[v], label=VERDICT_LABELS[v]) for v in (WIN, LOSS, TIE)]
            fig.legend(handles=handles, fontsize=7, loc="outside lower center", ncols=3, frameon=False)
    fig.suptitle("Throughput against concurrency\nwhiskers: 95 % interval over repeats; kvtool points coloured by "
                 "verdict", fontsize=9)
    return save(fig, path)


def hit_rate_chart(path: Path, cells: pd.DataFrame) -> Path:
    """`hit_rate_per_tier.png` (see the module docstring)."""
    keys = sorted({(w, int(c)) for w, c in zip(cells["workload"], cells["clients"])})
    fig, ax = plt.subplots(figsize=(max(5.0, 1.6 * len(keys) + 2), 4), dpi=DPI, layout="constrained")
    width = 0.27
    series = [(KVTOOL, "hit_rate_ram", COLORS["ram"], "kvtool RAM tier", None),
              (KVTOOL, "hit_rate_ssd", COLORS["ssd"], "kvtool SSD tier", None),
              (MLXLM, "hit_rate", "white", "mlx-lm prompt cache (reference)", "//")]
    for s, (server, fig_name, color, label, hatch) in enumerate(series):
        sel = cells[cells["server"] == server].astype({"clients": int}).drop_duplicates(["workload", "clients"])
        sel = sel.set_index(["workload", "clients"]).reindex(pd.MultiIndex.from_tuples(keys))
        v = sel[fig_name].to_numpy(dtype=float)
        x = np.arange(len(keys)) + (s - 1) * width
        ax.bar(x, np.nan_to_num(v), width, color=color, hatch=hatch, label=label,
               edgecolor=COLORS["baseline"] if hatch else "none")
        ax.errorbar(x, v, yerr=_err(v, sel[f"{fig_name}_lo"], sel[f"{fig_name}_hi"]), fmt="none", ecolor="black",
                    capsize=3, linewidth=1)
    category_ticks(ax, [f"{w}\n{c} client{'s' if c != 1 else ''}" for w, c in keys])
    ax.set_ylabel("hit tokens / prompt tokens")
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=8, loc="best")
    ax.set_title("Token hit rate per tier\nwhiskers: 95 % interval over repeats", fontsize=9)
    return save(fig, path)


def category_ticks(ax: Axes, labels: Sequence[str]) -> None:
    """One x tick per category at 0, 1, ... with `labels` (8 pt); past `MAX_FLAT_CATEGORIES`
    turned `CATEGORY_ROTATION` degrees, each anchored at its tick by its right end."""
    turned = len(labels) > MAX_FLAT_CATEGORIES
    ax.set_xticks(np.arange(len(labels)), labels, fontsize=8, rotation=CATEGORY_ROTATION if turned else 0,
                  ha="right" if turned else "center", rotation_mode="anchor" if turned else "default")


def write_charts(run_dir: Path, requests: pd.DataFrame, cells: pd.DataFrame, cmp: pd.DataFrame) -> list[Path]:
    """Write every chart of the module docstring into `run_dir`; returns their paths (a chart
    without data is skipped)."""
    out = []
    measured = requests[(requests["measured"].astype(str) == "True") & requests["error"].isna()] \
        if not requests.empty else requests
    if not measured.empty and not cells.empty:
        out.append(ttft_cdf_chart(run_dir / "ttft_cdf.png", measured, cells))
    if not cells.empty:
        out.append(throughput_chart(run_dir / "throughput_vs_concurrency.png", cells, cmp))
        out.append(hit_rate_chart(run_dir / "hit_rate_per_tier.png", cells))
    if not cmp.empty and (cmp["figure"] == "ttft_p50_ms").any():
        out.append(ratio_chart(run_dir / "ttft_ratio.png", cmp))
    return out


def _server_style(server: str) -> dict[str, Any]:
    if server == MLXLM:
        return {"color": COLORS["baseline"], "linestyle": "--", "linewidth": 1.2}
    return {"color": COLORS["kvtool"], "linestyle": "-", "linewidth": 1.4}


def _verdict(cmp: pd.DataFrame, workload: str, clients: int, figure: str) -> str:
    if cmp.empty:
        return TIE
    sel = cmp[(cmp["workload"] == workload) & (cmp["clients"] == clients) & (cmp["figure"] == figure)]
    return str(sel["verdict"].iloc[0]) if not sel.empty else TIE


def _err(values: Any, lows: Any, highs: Any) -> np.ndarray:
    """Whisker lengths `[2, n]` below and above `values` (the interval `lows`..`highs`; 0 where
    missing or where the value lies outside it)."""
    v = np.asarray(values, dtype=float)
    return np.nan_to_num(np.vstack([np.maximum(0.0, v - np.asarray(lows, dtype=float)),
                                    np.maximum(0.0, np.asarray(highs, dtype=float) - v)]))


def _panels(n: int, width: float, height: float) -> tuple[plt.Figure, list[Axes]]:
    """A figure of `n` panels of `width` x `height` inches, at most 3 a row; the spare ones hidden."""
    cols = min(3, max(1, n))
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(width * cols, height * rows), dpi=DPI, squeeze=False,
                             layout="constrained")
    for ax in list(axes.flat)[n:]:
        ax.set_visible(False)
    return fig, list(axes.flat)


__all__ = ["COLORS", "DPI", "category_ticks", "draw_verdict_bars", "hit_rate_chart", "ratio_chart", "throughput_chart",
           "ttft_cdf_chart", "verdict_color", "write_charts"]
