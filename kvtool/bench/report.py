"""`kvtool report`: PNG charts (matplotlib, Agg) and `report.md` from a run directory.

Reads only `cells.csv`, `run.json` and (for the prompt-length chart) `requests.csv`, so a report
can be regenerated at any time from a finished run (`write_report(run_dir)`), also from a
committed summary that kept no `requests.csv`. Every latency is the median over the repeats with
the 95 % bootstrap interval of that median; a kvtool cell wins a workload only by `WIN_RULE`
(`kvtool.bench.verdicts`), a tie is reported as the span of the tied cells; one chart per question
(`CHARTS`, `kvtool.bench.report_charts`).

A directory that is not a readable run raises `ReportError` (one `error:` line, exit 2, in the CLI).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from kvtool.bench.report_charts import plot_ttft, plot_ttft_vs_prompt, plot_write_path, save
from kvtool.bench.verdicts import (
    KIND_KVTOOL,
    MLXLM,
    NO_CACHE,
    NO_SPREAD,
    repeat_count,
    speedup,
    speedup_span,
    spread,
    tie_span,
    value_range,
    verdict_phrase,
    winners,
)
from kvtool.errors import KVToolError

__all__ = ["CHARTS", "Report", "ReportError", "WIN_RULE", "load_run", "render_markdown", "winners", "write_report"]

CHARTS = {
    "ttft_per_workload.png": "Which policy gives the lowest TTFT per workload, and by how much?",
    "write_path_by_durability.png": "What does each setting cost on the write path, on the request thread and in total?",
    "ttft_vs_prompt_len.png": "How does TTFT grow with prompt length, per cache state?",
}
WIN_RULE = (
    "A kvtool cell **wins** a workload only when its interval lies wholly below every other kvtool cell's, "
    "the runner-up included (rule: winner's interval top < runner-up's interval bottom, on the median over "
    "the repeats of the per-repeat TTFT p50, interval = 95% bootstrap interval of that median). Otherwise "
    "the workload is a **tie** (no policy differs beyond the noise on this machine) between the cell with "
    "the lowest median and every cell whose interval overlaps its interval."
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
        if column.endswith(("_ms", "_min", "_max", "_lo", "_hi", "_tokens", "_rate", "_pct", "_s")) or column.startswith("ttft_"):
            df[column] = pd.to_numeric(df[column], errors="coerce")
    return df


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
        save(plot_ttft(cells, best, run), run_dir / "ttft_per_workload.png"),
        save(plot_write_path(cells, run), run_dir / "write_path_by_durability.png"),
    ]
    if requests is not None:
        charts.append(save(plot_ttft_vs_prompt(requests, run), run_dir / "ttft_vs_prompt_len.png"))
    md = run_dir / "report.md"
    md.write_text(render_markdown(cells, run, charts=[p.name for p in charts]))
    return Report(markdown=md, charts=charts)


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
    """The report's winners table: verdict, winner and runner-up with their intervals; for a tie
    the span of the tied cells' medians, intervals and speed-ups (never the luckiest cell's)."""
    rows = []
    for r in best.itertuples(index=False):
        tie = r.verdict == "tie"
        vs = f"{speedup(r.ttft_vs_mlxlm)} ({r.vs_mlxlm})" if r.vs_mlxlm else speedup(r.ttft_vs_mlxlm)
        rows.append({
            "workload": r.workload,
            "verdict": f"tie ({len(r.tied_cells.split('; '))} of {r.candidates})" if tie else r.verdict,
            "winner / tied cells": r.tied_cells.replace("; ", ", ") if tie else r.cell,
            "TTFT p50 ms, median [95% interval]": tie_span(r) if tie
            else value_range(r.ttft_p50_ms, r.ttft_p50_ms_lo, r.ttft_p50_ms_hi),
            "runner-up": "" if tie else r.runner_up or "",
            "runner-up TTFT p50 ms": "" if tie else value_range(r.runner_up_ttft_p50_ms, r.runner_up_ttft_p50_ms_lo,
                                                                r.runner_up_ttft_p50_ms_hi),
            "vs no-cache": speedup_span(r.tie_vs_no_cache_min, r.tie_vs_no_cache_max) if tie else speedup(r.ttft_vs_no_cache),
            "vs mlx-lm cache": speedup_span(r.tie_vs_mlxlm_min, r.tie_vs_mlxlm_max) if tie else vs,
        })
    return pd.DataFrame(rows)


DISK_HIT = {KIND_KVTOOL: "SSD tier", MLXLM: "mlx-lm's one-file prompt cache, not an SSD tier",
            NO_CACHE: "no cache"}  # what `ssd_hit_rate` measured, per kind of cell
SUMMARY_SPREAD = [("ttft_p50_ms", "TTFT p50 ms"), ("ttft_p95_ms", "TTFT p95 ms"),
                  ("write_path_ms_mean", "write path ms/request")]


def summary_table(cells: pd.DataFrame) -> pd.DataFrame:
    """Every cell: medians with [95% interval], hit rates, ratios, shutdown checks. The disk-hit
    column says per row what it measured (`DISK_HIT`)."""
    out = pd.DataFrame({"workload": cells["workload"], "cell": cells["cell"]})
    for metric, label in SUMMARY_SPREAD:
        c, lo, hi = spread(cells, metric)
        out[label + " [95% interval]"] = [value_range(a, b, d) for a, b, d in zip(c, lo, hi)]
    for column, label, fmt in (("ram_hit_rate", "RAM hit", "{:.2f}"), ("ssd_hit_rate", "disk hit", "{:.2f}"),
                               ("prefill_saved_pct", "prefill saved %", "{:.0f}"),
                               ("write_amplification", "write amp.", "{:.2f}")):
        values = pd.to_numeric(cells[column], errors="coerce") if column in cells else pd.Series(np.nan, cells.index)
        out[label] = [fmt.format(v) if np.isfinite(v) else "" for v in values]
    out["disk hit"] = [f"{v} ({DISK_HIT.get(k, DISK_HIT[KIND_KVTOOL])})" if v else v
                       for v, k in zip(out["disk hit"], cells["kind"])]
    for column, label in (("ttft_vs_no_cache", "vs no-cache"), ("ttft_vs_mlxlm", "vs mlx-lm")):
        values = cells[column] if column in cells else pd.Series(np.nan, cells.index)
        out[label] = [speedup(v) if pd.notna(v) else "" for v in values]
    for column, label in (("shutdown_clean", "clean"), ("drain_verified", "drained")):
        out[label] = cells[column].map(lambda v: "" if pd.isna(v) else str(v)) if column in cells else ""
    return out


def render_markdown(cells: pd.DataFrame, run: dict[str, Any], charts: list[str] | None = None) -> str:
    """The text of report.md (`charts`: the PNG names written, default all of `CHARTS`)."""
    m = run.get("machine") or {}
    disk = m.get("cache_disk") or {}
    drop = run.get("page_cache_drop") or {}
    model = run.get("model") or {}
    repeats = repeat_count(cells)
    has_spread = "ttft_p50_ms_min" in cells or "ttft_p50_ms_lo" in cells
    lines = [
        f"# kvtool bench report: {run.get('run_id')}",
        "",
        f"- model: `{model.get('spec')}` (model_id `{model.get('model_id')}`)",
        (f"- machine: {m.get('cpu_model')}, {m.get('cpu_cores')} cores, {_gib(m.get('ram_bytes'))} RAM; "
         f"cache on {disk.get('device')} ({disk.get('filesystem')})"),
        f"- versions: {', '.join(f'{k} {v}' for k, v in (m.get('versions') or {}).items())}",
        f"- git commit: `{run.get('git_commit')}`; started {run.get('started')}, {run.get('duration_s')} s",
        f"- page cache drop before cold reads: {drop.get('ok')} ({drop.get('files')} files; {drop.get('method')})",
        f"- load average (1, 5, 15 min) at the start: {m.get('load_avg', 'not recorded')}",
        (f"- repeats per cell: {repeats}; every number is the median over the repeats of a per-repeat statistic, "
         "with the 95% bootstrap interval of that median `[lo–hi]`"),
        "",
        "Ratios are speed-ups of the median TTFT p50: baseline / cell (> 1 means the cell is faster).",
        "",
        "## Winning cell per workload",
        "",
        WIN_RULE + (" `vs mlx-lm cache` says whether the winner's interval is entirely below (faster), "
                    "above (slower) or overlapping the mlx-lm prompt cache's interval; for a tie both ratios are "
                    "the span over the tied cells. The `disk hit` column of the mlx-lm baseline is mlx-lm's "
                    "one-file prompt cache, not an SSD tier."),
        "",
    ]
    if repeats < 2:
        lines += [(f"**Caution: {repeats} repeat per cell: no spread, so no winner is called** (verdict "
                   f"`{NO_SPREAD}`; the cell named is merely the lowest). Run with `repeats = 3` or more."), ""]
    elif repeats < MIN_TRUSTED_REPEATS:
        lines += [(f"**Caution: {repeats} repeats per cell.** An interval from fewer than {MIN_TRUSTED_REPEATS} "
                   "repeats says little about noise; treat every winner as provisional."), ""]
    if not has_spread:
        lines += [("**This run's cells.csv has no min/max columns** (written before ranges were recorded): "
                   f"values are shown without a range and no winner is called (`{NO_SPREAD}`)."), ""]
    best = winners(cells)
    lines.append(markdown_table(winners_table(best)) if len(best) else "- no kvtool cell in this run")
    lines += ["", *(f"- {r.workload}: {verdict_phrase(r)}" for r in best.itertuples(index=False))]
    for r in best.itertuples(index=False) if "ttft_gain" in cells else ():  # a tie: the span over its cells
        names = r.tied_cells.split("; ") if r.verdict == "tie" else [r.cell]
        mine = cells[(cells["workload"] == r.workload) & cells["cell"].isin(names)]
        gain = pd.to_numeric(mine["ttft_gain"], errors="coerce").dropna()
        if len(gain):
            who = "the tied cells" if r.verdict == "tie" else f"`{r.cell}`"
            lines += ["", f"{r.workload}: TTFT gain warm-up / query of {who}: {speedup_span(gain.min(), gain.max())}."]
    lines += ["", "## Every cell", "", markdown_table(summary_table(cells)), "", "## Charts", ""]
    names = list(CHARTS) if charts is None else charts
    lines += [f"### {CHARTS.get(name, name)}\n\n![{CHARTS.get(name, name)}]({name})\n" for name in names]
    if charts is not None and "ttft_vs_prompt_len.png" not in charts:
        lines.append("(No requests.csv in this directory: the TTFT-against-prompt-length chart needs it.)\n")
    return "\n".join(lines)


def _gib(n: Any) -> str:
    return f"{n / (1 << 30):.1f} GiB" if isinstance(n, (int, float)) else "?"
