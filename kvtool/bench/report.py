"""`kvtool report`: PNG charts (matplotlib, Agg) and `report.md` from a run directory.

Reads only `cells.csv`, `requests.csv` and `run.json`, so a report can be regenerated at any time
from a finished run (`write_report(run_dir)`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

KIND_COLORS = {"kvtool": "tab:blue", "no-cache": "tab:red", "mlx-lm-prompt-cache": "tab:orange"}
SUMMARY_COLUMNS = [
    "workload", "cell", "ttft_p50_ms", "ttft_p95_ms", "ram_hit_rate", "ssd_hit_rate", "prefill_saved_pct",
    "write_path_ms_mean", "write_amplification", "ttft_vs_no_cache", "ttft_vs_mlxlm", "shutdown_clean",
    "drain_verified",
]
CHARTS = {
    "ttft_per_cell.png": "TTFT per cell (p50, bar to p95) with both baselines",
    "hit_rate_per_tier.png": "hit rate per tier (measured requests)",
    "prefill_saved.png": "prefill tokens saved (all requests)",
    "write_overhead.png": "request-path write time per request, write_through against evict_only",
    "ttft_vs_prompt_len.png": "TTFT against prompt length (every request)",
}


@dataclass
class Report:
    """Files written by `write_report`."""

    markdown: Path
    charts: list[Path]


def load_run(run_dir: Path) -> tuple[pd.DataFrame, pd.DataFrame, dict[str, Any]]:
    """(cells, requests, run.json) of a run directory.

    Raises:
        FileNotFoundError: a file is missing (not a run directory).
    """
    run_dir = Path(run_dir)
    cells = pd.read_csv(run_dir / "cells.csv")
    requests = pd.read_csv(run_dir / "requests.csv")
    run = json.loads((run_dir / "run.json").read_text())
    return cells, requests, run


def write_report(run_dir: Path) -> Report:
    """Write the charts (`CHARTS`) and `report.md` into `run_dir`, replacing earlier ones.

    Returns:
        The paths written.
    """
    run_dir = Path(run_dir)
    cells, requests, run = load_run(run_dir)
    charts = [
        _save(plot_ttft(cells), run_dir / "ttft_per_cell.png"),
        _save(plot_hit_rates(cells), run_dir / "hit_rate_per_tier.png"),
        _save(plot_prefill_saved(cells), run_dir / "prefill_saved.png"),
        _save(plot_write_overhead(cells), run_dir / "write_overhead.png"),
        _save(plot_ttft_vs_prompt(requests), run_dir / "ttft_vs_prompt_len.png"),
    ]
    md = run_dir / "report.md"
    md.write_text(render_markdown(cells, run))
    return Report(markdown=md, charts=charts)


def _save(fig: plt.Figure, path: Path) -> Path:
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def _per_workload_axes(cells: pd.DataFrame, title: str) -> tuple[plt.Figure, list[tuple[str, pd.DataFrame, Any]]]:
    groups = list(cells.groupby("workload", sort=False))
    n_cells = max(len(g) for _, g in groups)
    fig, axes = plt.subplots(
        len(groups), 1, figsize=(9, 0.5 + len(groups) * (0.8 + 0.28 * n_cells)), squeeze=False,
        layout="constrained",
    )
    fig.suptitle(title)
    return fig, [(name, g.reset_index(drop=True), ax) for (name, g), ax in zip(groups, axes[:, 0])]


def plot_ttft(cells: pd.DataFrame) -> plt.Figure:
    """Horizontal bars of TTFT p50 per cell (error bar up to p95), baselines as dashed lines."""
    fig, panels = _per_workload_axes(cells, "TTFT per cell (ms, log scale): bar p50, whisker p95")
    for name, g, ax in panels:
        y = np.arange(len(g))
        colors = [KIND_COLORS.get(k, "tab:gray") for k in g["kind"]]
        xerr = [np.zeros(len(g)), (g["ttft_p95_ms"] - g["ttft_p50_ms"]).clip(lower=0).fillna(0)]
        ax.barh(y, g["ttft_p50_ms"], xerr=xerr, color=colors)
        for kind in ("no-cache", "mlx-lm-prompt-cache"):
            base = g.loc[g["kind"] == kind, "ttft_p50_ms"]
            if len(base):
                ax.axvline(base.iloc[0], color=KIND_COLORS[kind], linestyle="--", label=kind)
        _cell_axis(ax, g, name, "TTFT (ms)")
        if (g["ttft_p50_ms"] > 0).all():
            ax.set_xscale("log")  # cached and recomputed TTFT differ by orders of magnitude
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="lower right", fontsize=7)
    return fig


def _cell_axis(ax: Any, g: pd.DataFrame, workload: str, xlabel: str) -> None:
    ax.set_yticks(np.arange(len(g)), g["cell"], fontsize=7)
    ax.invert_yaxis()
    ax.set_title(workload, fontsize=9, loc="left")
    ax.set_xlabel(xlabel, fontsize=8)


def plot_hit_rates(cells: pd.DataFrame) -> plt.Figure:
    """Stacked bars: RAM and SSD hit rate per cell."""
    fig, panels = _per_workload_axes(cells, "Hit rate per tier (fraction of prompt tokens, measured requests)")
    for name, g, ax in panels:
        y = np.arange(len(g))
        ram, ssd = g["ram_hit_rate"].fillna(0), g["ssd_hit_rate"].fillna(0)
        ax.barh(y, ram, color="tab:green", label="RAM")
        ax.barh(y, ssd, left=ram, color="tab:purple", label="SSD")
        ax.set_xlim(0, 1)
        _cell_axis(ax, g, name, "hit rate")
        ax.legend(loc="lower right", fontsize=7)
    return fig


def plot_prefill_saved(cells: pd.DataFrame) -> plt.Figure:
    """Bars: prefill tokens saved (%) per cell."""
    fig, panels = _per_workload_axes(cells, "Prefill tokens saved (% of prompt tokens, all requests)")
    for name, g, ax in panels:
        colors = [KIND_COLORS.get(k, "tab:gray") for k in g["kind"]]
        ax.barh(np.arange(len(g)), g["prefill_saved_pct"].fillna(0), color=colors)
        ax.set_xlim(0, 100)
        _cell_axis(ax, g, name, "prefill saved (%)")
    return fig


def write_overhead(cells: pd.DataFrame) -> pd.DataFrame:
    """kvtool cells with `evict_only_ms` (the evict_only cell with the same other settings) and
    `overhead_ms` = write_path_ms_mean - evict_only_ms."""
    kv = cells[cells["kind"] == "kvtool"].copy()
    keys = ["workload", "writer", "ssd_durability", "block_size", "ram_bytes"]
    ref = kv[kv["ssd_policy"] == "evict_only"][keys + ["write_path_ms_mean"]]
    kv = kv.merge(ref.rename(columns={"write_path_ms_mean": "evict_only_ms"}), on=keys, how="left")
    kv["overhead_ms"] = kv["write_path_ms_mean"] - kv["evict_only_ms"]
    return kv


def plot_write_overhead(cells: pd.DataFrame) -> plt.Figure:
    """Grouped bars per setting: request-path write ms of evict_only vs write_through."""
    kv = write_overhead(cells)
    kv["setting"] = kv["cell"].str.split("/", n=1).str[1]
    fig, panels = _per_workload_axes(
        kv.drop_duplicates(["workload", "setting"]) if not kv.empty else cells.head(1),
        "Request-path write time per request (ms), write_through vs evict_only",
    )
    for name, _, ax in panels:
        g = kv[kv["workload"] == name]
        pivot = g.pivot_table(index="setting", columns="ssd_policy", values="write_path_ms_mean", sort=False)
        if pivot.empty:
            continue
        pivot.plot.barh(ax=ax, color={"evict_only": "tab:gray", "write_through": "tab:blue"}, legend=True)
        ax.invert_yaxis()
        ax.set_title(name, fontsize=9, loc="left")
        ax.set_xlabel("write_path_ms per request", fontsize=8)
        ax.set_ylabel("")
        ax.tick_params(axis="y", labelsize=7)
        ax.legend(fontsize=7, loc="lower right")
    return fig


def plot_ttft_vs_prompt(requests: pd.DataFrame) -> plt.Figure:
    """Scatter of every request: TTFT against prompt length, coloured by cell kind."""
    fig, ax = plt.subplots(figsize=(8, 5), layout="constrained")
    for kind, g in requests.groupby("kind", sort=False):
        ax.scatter(g["prompt_tokens"], g["ttft_ms"], s=10, alpha=0.5, label=kind, color=KIND_COLORS.get(kind))
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("TTFT (ms)")
    if (requests["ttft_ms"] > 0).all():
        ax.set_yscale("log")
    ax.set_title("TTFT against prompt length (every request)")
    ax.legend()
    return fig


def winners(cells: pd.DataFrame) -> pd.DataFrame:
    """Per workload, the kvtool cell with the lowest TTFT p50 and its ratios to the baselines."""
    kv = cells[cells["kind"] == "kvtool"].dropna(subset=["ttft_p50_ms"])
    if kv.empty:
        return kv
    best = kv.loc[kv.groupby("workload", sort=False)["ttft_p50_ms"].idxmin()]
    return best[["workload", "cell", "ttft_p50_ms", "ttft_vs_no_cache", "ttft_vs_mlxlm", "ttft_gain"]]


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


def render_markdown(cells: pd.DataFrame, run: dict[str, Any]) -> str:
    """The text of report.md."""
    m = run.get("machine", {})
    disk = m.get("cache_disk", {})
    drop = run.get("page_cache_drop", {})
    lines = [
        f"# kvtool bench report: {run.get('run_id')}",
        "",
        f"- model: `{run.get('model', {}).get('spec')}` (model_id `{run.get('model', {}).get('model_id')}`)",
        f"- machine: {m.get('cpu_model')}, {m.get('cpu_cores')} cores, {_gib(m.get('ram_bytes'))} RAM; "
        f"cache on {disk.get('device')} ({disk.get('filesystem')})",
        f"- versions: {', '.join(f'{k} {v}' for k, v in m.get('versions', {}).items())}",
        f"- git commit: `{run.get('git_commit')}`; started {run.get('started')}, {run.get('duration_s')} s",
        f"- page cache drop before cold reads: {drop.get('ok')} ({drop.get('files')} files; {drop.get('method')})",
        "",
        "Ratios are speed-ups of TTFT p50: baseline / cell (> 1 means the cell is faster).",
        "",
        "## Winning cell per workload",
        "",
    ]
    best = winners(cells)
    for row in best.itertuples(index=False):
        gain = f", TTFT gain warm-up/query {row.ttft_gain:.2f}x" if pd.notna(row.ttft_gain) else ""
        lines.append(
            f"- **{row.workload}**: `{row.cell}`, TTFT p50 {row.ttft_p50_ms:.1f} ms; "
            f"{_x(row.ttft_vs_no_cache)} vs no-cache, {_x(row.ttft_vs_mlxlm)} vs mlx-lm-prompt-cache{gain}"
        )
    if best.empty:
        lines.append("- no kvtool cell in this run")
    lines += ["", "## Summary", "", markdown_table(cells.reindex(columns=SUMMARY_COLUMNS)), "", "## Charts", ""]
    lines += [f"### {title}\n\n![{title}]({name})\n" for name, title in CHARTS.items()]
    return "\n".join(lines)


def _x(value: float) -> str:
    return f"{value:.2f}x" if pd.notna(value) else "n/a"


def _gib(n: Any) -> str:
    return f"{n / (1 << 30):.1f} GiB" if isinstance(n, (int, float)) else "?"
