"""Report of a `[serve_load]` run: cells, kvtool / mlx-lm comparison, output equality, charts.

Reads only `requests.jsonl`, `batches.csv` and `run.json` of a run directory, so
`kvtool report RUN_DIR` can regenerate everything. Writes:
- `cells.csv`: one row per (workload, server, clients): every figure of
  `kvtool.bench.loadstats.FIGURES` as the mean over the repeats with `_lo` / `_hi` (95 % percentile
  bootstrap interval), `peak_rss_mib` likewise, kvtool's per-tier counters (means over repeats),
  `failed` requests and, for kvtool cells, `outputs_compared` / `output_mismatches`;
- `comparison.csv`: per (workload, clients, figure): both cells' intervals, the ratio
  kvtool / mlx-lm with its interval (`loadstats.ratio_ci`) and the verdict (`loadstats.compare`);
- `mismatches.csv`: every request whose greedy kvtool output differs from mlx-lm's for the same
  request (same workload, clients, repeat and request key), or that only one server answered;
- `summary.json`: `ok`, the problems found, and the rows of `cells.csv` and `comparison.csv`;
- `parity.csv` and the report's "Parity" section (`kvtool.bench.loadparity`);
- the charts of `kvtool.bench.loadcharts` and `report.md`.

A kvtool cell **fails** when any of its outputs differs from the baseline's; the run is `ok` only
when no cell fails, no request failed, every server stopped cleanly and every `agents` turn whose
transcript was the same on both servers counted the same prompt tokens
(`kvtool.bench.loadagents.prompt_token_mismatches`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from kvtool.bench.loadagents import prompt_token_mismatches
from kvtool.bench.loadcharts import write_charts
from kvtool.bench.loadparity import answered, parity_summary, write_parity
from kvtool.bench.loadpooled import fmt
from kvtool.bench.loadserver import KVTOOL, MLXLM
from kvtool.bench.loadstats import FIGURES, bootstrap_ci, cell_summary, compare, ratio_ci
from kvtool.errors import KVToolError

CELL_KEYS = ["workload", "server", "clients"]
KVTOOL_COUNTERS = ("kvtool_ram_hit_tokens", "kvtool_ssd_hit_tokens", "kvtool_prompt_tokens", "kvtool_ram_bytes_held",
                   "kvtool_ssd_bytes_written", "kvtool_ssd_bytes_read", "kvtool_writer_queue_peak_bytes",
                   "kvtool_writer_shed_blocks")
SUMMARY_FIGURES = ("ttft_p50_ms", "ttft_p99_ms", "latency_p50_ms", "requests_per_s", "hit_rate",
                   "cached_tokens_per_request")


class LoadReportError(KVToolError):
    """The directory is not a readable `[serve_load]` run."""


@dataclass
class LoadReport:
    """What `write_load_report` computed: the frames written as CSV, `ok` (no output mismatch,
    no failed request, every server stopped cleanly, no batch error) with one line of `problems`
    per reason it is False, the files written and the parity table (`kvtool.bench.loadparity`)."""

    run_dir: Path
    cells: pd.DataFrame
    comparison: pd.DataFrame
    mismatches: pd.DataFrame
    ok: bool
    problems: list[str]
    files: list[Path]
    parity: pd.DataFrame | None = None

    def summary_records(self) -> list[dict[str, Any]]:
        """The comparison rows of `SUMMARY_FIGURES` as JSON-able dicts (NaN -> None)."""
        sel = self.comparison[self.comparison["figure"].isin(SUMMARY_FIGURES)] if not self.comparison.empty \
            else self.comparison
        return _records(sel)

    def summary_lines(self) -> list[str]:
        """Human summary: TTFT p50 and requests/s per (workload, clients), ratio and verdict (and
        for `agents` the cached tokens per turn)."""
        out = ["kvtool serve vs mlx_lm.server: mean over repeats [95 % bootstrap interval]; a win needs the two "
               "cells' intervals apart, otherwise tie"]
        for row in self.summary_records():
            if row["figure"] not in ("ttft_p50_ms", "requests_per_s") and not (
                    row["figure"] == "cached_tokens_per_request" and row["workload"] == "agents"):
                continue
            out.append(f"{row['workload']} {row['clients']} client(s) {row['figure']}: kvtool "
                       f"{_fmt_iv(row, 'kvtool')} vs mlx-lm {_fmt_iv(row, 'mlxlm')}, ratio {_fmt_iv(row, 'ratio')} "
                       f"-> {row['verdict']}")
        if not any(r["figure"] == "ttft_p50_ms" for r in self.summary_records()):
            out.append("(no comparison: only one server ran)")
        out += parity_summary(self.parity) if self.parity is not None else []
        out += [f"PROBLEM: {p}" for p in self.problems] or ["checks: outputs equal, no failed request, clean stops"]
        return out


def load_run(run_dir: Path) -> tuple[pd.DataFrame, pd.DataFrame, dict[str, Any]]:
    """(requests, batches, run.json) of a run directory.

    Raises:
        LoadReportError: a file is missing or malformed.
    """
    run_dir = Path(run_dir)
    try:
        doc = json.loads((run_dir / "run.json").read_text())
        rows = [json.loads(line) for line in (run_dir / "requests.jsonl").read_text().splitlines() if line.strip()]
        batches = pd.read_csv(run_dir / "batches.csv")
    except (OSError, ValueError, pd.errors.EmptyDataError) as exc:
        raise LoadReportError(f"not a readable serve_load run directory: {run_dir}: {exc}") from None
    requests = pd.DataFrame(rows)
    if batches.empty or not set(CELL_KEYS + ["repeat"]) <= set(batches.columns):
        raise LoadReportError(f"{run_dir}/batches.csv has no batches")
    return requests, batches, doc


def is_serve_load_run(run_dir: Path) -> bool:
    """True if `run_dir/run.json` says `"kind": "serve_load"`."""
    try:
        return json.loads((Path(run_dir) / "run.json").read_text()).get("kind") == "serve_load"
    except (OSError, ValueError, AttributeError):
        return False


def cells_frame(batches: pd.DataFrame, mismatch_counts: dict[tuple[str, int], tuple[int, int]]) -> pd.DataFrame:
    """`cells.csv` (see the module docstring)."""
    rows = []
    for (workload, server, clients), grp in batches.groupby(CELL_KEYS, sort=True):
        grp = grp.sort_values("repeat")
        row: dict[str, Any] = {"workload": workload, "server": server, "clients": int(clients),
                               **cell_summary(grp.to_dict(orient="records"))}
        rss = bootstrap_ci(pd.to_numeric(grp["peak_rss_bytes"], errors="coerce").to_numpy() / 2**20)
        row["peak_rss_mib"], row["peak_rss_mib_lo"], row["peak_rss_mib_hi"] = rss.point, rss.lo, rss.hi
        for key in KVTOOL_COUNTERS:
            if key in grp:
                vals = pd.to_numeric(grp[key], errors="coerce")
                row[key] = float(vals.mean()) if vals.notna().any() else float("nan")
        row["stopped_clean"] = bool(grp["stopped_clean"].astype(str).eq("True").all())
        row["cut_by_wall"] = bool(grp["cut_by_wall"].astype(str).eq("True").any())
        compared, mismatched = mismatch_counts.get((workload, int(clients)), (0, 0))
        row["outputs_compared"] = compared if server == KVTOOL else None
        row["output_mismatches"] = mismatched if server == KVTOOL else None
        row["cell_failed"] = bool(server == KVTOOL and mismatched > 0)
        rows.append(row)
    return pd.DataFrame(rows)


def comparison_frame(batches: pd.DataFrame) -> pd.DataFrame:
    """`comparison.csv`: kvtool against mlx-lm per (workload, clients, figure)."""
    rows = []
    for (workload, clients), grp in batches.groupby(["workload", "clients"], sort=True):
        k = grp[grp["server"] == KVTOOL].sort_values("repeat")
        m = grp[grp["server"] == MLXLM].sort_values("repeat")
        if k.empty or m.empty:
            continue
        for fig, (lower_better, unit) in FIGURES.items():
            kv, ml = k[fig].to_numpy(dtype=float), m[fig].to_numpy(dtype=float)
            if not (np.isfinite(kv).any() and np.isfinite(ml).any()):
                continue
            a, b = bootstrap_ci(kv), bootstrap_ci(ml)
            r = ratio_ci(kv, ml)
            rows.append({"workload": workload, "clients": int(clients), "figure": fig, "unit": unit,
                         "lower_is_better": lower_better, "kvtool": a.point, "kvtool_lo": a.lo, "kvtool_hi": a.hi,
                         "mlxlm": b.point, "mlxlm_lo": b.lo, "mlxlm_hi": b.hi, "ratio": r.point, "ratio_lo": r.lo,
                         "ratio_hi": r.hi, "repeats": min(a.n, b.n), "verdict": compare(a, b, lower_better)})
    return pd.DataFrame(rows)


def mismatches_frame(requests: pd.DataFrame) -> tuple[pd.DataFrame, dict[tuple[str, int], tuple[int, int]]]:
    """Requests whose kvtool output differs from mlx-lm's (or only one answered), and per
    (workload, clients) the counts (compared, mismatched)."""
    cols = ["workload", "clients", "repeat", "key", "phase", "kvtool_text", "mlxlm_text", "kvtool_tokens",
            "mlxlm_tokens", "kvtool_error", "mlxlm_error"]
    if requests.empty or not {KVTOOL, MLXLM} <= set(requests["server"]):
        return pd.DataFrame(columns=cols), {}
    keys = ["workload", "clients", "repeat", "key"]
    fields = ["phase", "text", "completion_tokens", "error"]
    k = requests[requests["server"] == KVTOOL][keys + fields]
    m = requests[requests["server"] == MLXLM][keys + fields]
    both = k.merge(m, on=keys, how="outer", suffixes=("_k", "_m"))
    counts: dict[tuple[str, int], list[int]] = {}
    bad = []
    for row in both.to_dict(orient="records"):
        cell = counts.setdefault((row["workload"], int(row["clients"])), [0, 0])
        k_ok, m_ok = answered(row, "_k"), answered(row, "_m")
        if not (k_ok or m_ok):
            continue  # neither answered: counted as failed requests, nothing to compare
        cell[0] += 1
        if k_ok and m_ok and row["text_k"] == row["text_m"] and row["completion_tokens_k"] == row["completion_tokens_m"]:
            continue
        cell[1] += 1
        bad.append({"workload": row["workload"], "clients": int(row["clients"]), "repeat": int(row["repeat"]),
                    "key": row["key"], "phase": row["phase_k"] if k_ok else row["phase_m"],
                    "kvtool_text": row["text_k"], "mlxlm_text": row["text_m"],
                    "kvtool_tokens": row["completion_tokens_k"], "mlxlm_tokens": row["completion_tokens_m"],
                    "kvtool_error": row["error_k"], "mlxlm_error": row["error_m"]})
    return pd.DataFrame(bad, columns=cols), {key: (v[0], v[1]) for key, v in counts.items()}


def write_raw(run_dir: Path, requests: list[dict[str, Any]], batches: list[dict[str, Any]]) -> None:
    """Write a run's raw rows, the files `load_run` reads: `requests.jsonl` / `requests.csv` (one
    row per request) and `batches.csv` / `batches.json` (one row per batch)."""
    run_dir = Path(run_dir)
    with open(run_dir / "requests.jsonl", "w") as fh:
        for row in requests:
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")
    pd.DataFrame(requests).to_csv(run_dir / "requests.csv", index=False)
    pd.DataFrame(batches).to_csv(run_dir / "batches.csv", index=False)
    (run_dir / "batches.json").write_text(json.dumps(batches, indent=2, default=str) + "\n")


def write_load_report(run_dir: Path) -> LoadReport:
    """Compute and write `cells.csv`, `comparison.csv`, `mismatches.csv`, the charts and
    `report.md` (see the module docstring).

    Raises:
        LoadReportError: not a readable run directory.
    """
    run_dir = Path(run_dir)
    requests, batches, doc = load_run(run_dir)
    mismatches, counts = mismatches_frame(requests)
    cells = cells_frame(batches, counts)
    cmp = comparison_frame(batches)
    cells.to_csv(run_dir / "cells.csv", index=False)
    cmp.to_csv(run_dir / "comparison.csv", index=False)
    mismatches.to_csv(run_dir / "mismatches.csv", index=False)
    problems = _problems(requests, batches, mismatches)
    parity, parity_md = write_parity(run_dir, requests, batches, doc)
    summary = {"run_id": doc.get("run_id"), "ok": not problems, "problems": problems, "cells": _records(cells),
               "comparison": _records(cmp), "output_mismatches": len(mismatches), "parity": _records(parity)}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    charts = write_charts(run_dir, requests, cells, cmp)
    text = _markdown(doc, cells, cmp, mismatches, problems, charts) + "".join(line + "\n" for line in parity_md)
    (run_dir / "report.md").write_text(text)
    files = [run_dir / n for n in ("cells.csv", "comparison.csv", "mismatches.csv", "parity.csv", "summary.json",
                                   "report.md")]
    files += charts
    return LoadReport(run_dir, cells, cmp, mismatches, not problems, problems, files, parity)


def _records(df: pd.DataFrame) -> list[dict[str, Any]]:
    """Rows as dicts, NaN -> None (strict JSON)."""
    return [{k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
            for row in df.to_dict(orient="records")]


def _problems(requests: pd.DataFrame, batches: pd.DataFrame, mismatches: pd.DataFrame) -> list[str]:
    out = []
    if not mismatches.empty:
        out.append(f"{len(mismatches)} kvtool output(s) differ from mlx-lm's for the same request (mismatches.csv)")
    prompts = prompt_token_mismatches(requests)
    if prompts:
        out.append(f"{prompts} agents turn(s) with the same transcript on both servers counted different prompt "
                   "tokens (the Messages translation and the chat template disagree)")
    failed = requests[requests["error"].notna()] if "error" in requests else requests.iloc[0:0]
    if not failed.empty:
        out.append(f"{len(failed)} request(s) failed, e.g. {failed.iloc[0]['error']}")
    unclean = batches[~batches["stopped_clean"].astype(str).eq("True")]
    if not unclean.empty:
        out.append(f"{len(unclean)} batch(es) whose server did not stop cleanly (exit codes: "
                   f"{', '.join(unclean['exit_codes'].astype(str))})")
    if "error" in batches and batches["error"].notna().any():
        out.append(f"batch error: {batches['error'].dropna().iloc[0]}")
    return out


def _digits(fig: str) -> int:
    return 3 if fig.startswith("hit_rate") else 2 if fig.endswith("_per_s") and "tokens" not in fig else 1


def _fmt_iv(row: dict[str, Any], prefix: str, fig: str | None = None) -> str:
    d = 2 if prefix == "ratio" else _digits(fig or row.get("figure", ""))
    return f"{fmt(row[prefix], d)} [{fmt(row[f'{prefix}_lo'], d)}–{fmt(row[f'{prefix}_hi'], d)}]"


def _markdown(doc: dict[str, Any], cells: pd.DataFrame, cmp: pd.DataFrame, mismatches: pd.DataFrame,
              problems: list[str], charts: list[Path]) -> str:
    cfg = (doc.get("config") or {}).get("serve_load", {})
    lines = [f"# Load through `kvtool serve` vs plain `mlx_lm.server`: {doc.get('run_id')}", "",
             f"Model `{doc.get('model', {}).get('spec')}`, clients {cfg.get('clients')}, arrival "
             f"`{cfg.get('arrival', 'closed')}`, {cfg.get('repeats', 3)} repeat(s) per cell (kvtool and mlx-lm "
             f"alternate which runs first), max_tokens {cfg.get('max_tokens', 8)}, greedy, streamed. Git "
             f"{doc.get('git_commit')}, {doc.get('machine', {}).get('cpu_model')} "
             f"({doc.get('machine', {}).get('cpu_cores')} cores), {doc.get('duration_s')} s."
             + (" The `trace` workload arrives at its own times (`clients` caps the requests in flight); a Mooncake "
                "trace's requests generate their own output lengths." if "trace" in (cfg.get("workloads") or {}) else ""),
             "",
             "Every figure is the **mean over the repeats** of a per-batch value with its **95 % percentile "
             "bootstrap interval** in brackets (10,000 resamples of the repeats, fixed seed; "
             "`kvtool/bench/loadstats.py`). kvtool **wins** or **loses** only when its interval and mlx-lm's do "
             "not overlap; otherwise **tie**. Ratio = kvtool / mlx-lm (paired bootstrap over repeats). "
             "TTFT = request sent to the first streamed content chunk; every server is warmed up by one short "
             "request after each start.", ""]
    lines += ["## Checks", ""]
    lines += [f"- **PROBLEM:** {p}" for p in problems] or [
        "- every kvtool output equals mlx-lm's for the same request; no request failed; every server stopped "
        "cleanly (kvtool: SIGTERM, writer drained)."]
    lines += ["", "## kvtool / mlx-lm", ""]
    if cmp.empty:
        lines.append("No comparison (only one server ran).")
    else:
        lines += ["| workload | clients | figure | kvtool | mlx-lm | kvtool / mlx-lm | verdict |",
                  "|---|---:|---|---|---|---|---|"]
        for row in cmp[cmp["figure"].isin(SUMMARY_FIGURES)].to_dict(orient="records"):
            lines.append(f"| {row['workload']} | {row['clients']} | {row['figure']} ({row['unit']}) | "
                         f"{_fmt_iv(row, 'kvtool')} | {_fmt_iv(row, 'mlxlm')} | {_fmt_iv(row, 'ratio')} | "
                         f"{row['verdict']} |")
        lines += ["", "All figures (TTFT p90, latency p99, prompt tokens/s, ...): `comparison.csv`."]
    lines += ["", "## Cells", "",
              "| workload | server | clients | TTFT p50 ms | TTFT p99 ms | latency p50 ms | requests/s | prompt tok/s "
              "| hit rate | RAM / SSD hit rate | peak RSS MiB | outputs equal |",
              "|---|---|---:|---|---|---|---|---|---|---|---|---|"]
    for row in cells.to_dict(orient="records"):
        tiers = (f"{fmt(row['hit_rate_ram'], 3)} / {fmt(row['hit_rate_ssd'], 3)}" if row["server"] == KVTOOL
                 else "-")
        equal = "-" if row.get("outputs_compared") in (None, 0) or row["outputs_compared"] != row["outputs_compared"] \
            else ("yes" if not row["output_mismatches"] else f"NO ({int(row['output_mismatches'])})")
        lines.append(f"| {row['workload']} | {row['server']} | {row['clients']} | {_fmt_iv(row, 'ttft_p50_ms')} | "
                     f"{_fmt_iv(row, 'ttft_p99_ms')} | {_fmt_iv(row, 'latency_p50_ms')} | "
                     f"{_fmt_iv(row, 'requests_per_s', 'requests_per_s')} | {_fmt_iv(row, 'prompt_tokens_per_s')} | "
                     f"{_fmt_iv(row, 'hit_rate', 'hit_rate')} | {tiers} | {_fmt_iv(row, 'peak_rss_mib')} | {equal} |")
    lines += _tiers_lines(cells)
    if not mismatches.empty:
        lines += ["", "## Output mismatches (first 20)", "", "| workload | clients | repeat | request | kvtool | mlx-lm |",
                  "|---|---:|---:|---|---|---|"]
        for row in mismatches.head(20).to_dict(orient="records"):
            lines.append(f"| {row['workload']} | {row['clients']} | {row['repeat']} | {row['key']} | "
                         f"{_cell_text(row['kvtool_text'], row['kvtool_error'])} | "
                         f"{_cell_text(row['mlxlm_text'], row['mlxlm_error'])} |")
    if charts:
        lines += ["", "## Charts", ""]
        lines += [f"![{p.stem}]({p.name})" for p in charts]
    lines += ["", "Files: requests.jsonl / requests.csv (every request), batches.csv / batches.json (every batch), "
              "cells.csv, comparison.csv, mismatches.csv, summary.json, run.json, logs/ (server stderr).", ""]
    return "\n".join(lines)


def _tiers_lines(cells: pd.DataFrame) -> list[str]:
    """The report's kvtool tiers table (RAM / SSD hit tokens, bytes, writer queue); none without a kvtool cell."""
    kv = cells[cells["server"] == KVTOOL] if not cells.empty else cells
    if kv.empty:
        return []
    lines = ["", "## kvtool tiers (means over repeats; measured phases for hit tokens, whole batch for bytes)",
             "", "| workload | clients | RAM hit tok | SSD hit tok | prompt tok | RAM bytes held | SSD bytes "
             "written | SSD bytes read | writer queue peak bytes | shed blocks |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in kv.to_dict(orient="records"):
        vals = " | ".join(fmt(row.get(k), 0) for k in KVTOOL_COUNTERS)
        lines.append(f"| {row['workload']} | {row['clients']} | {vals} |")
    lines.append("")
    lines.append("`-`: the server does not report the counter (`writer_queue_peak_bytes` is newer than some "
                 "builds).")
    return lines


def _cell_text(text: Any, error: Any) -> str:
    if isinstance(error, str):
        return f"error: {error[:60]}"
    return "`" + repr(text)[:60].replace("|", "\\|").replace("`", "'") + "`"


__all__ = ["LoadReport", "LoadReportError", "cells_frame", "comparison_frame", "is_serve_load_run", "load_run",
           "mismatches_frame", "write_load_report", "write_raw"]
