"""`kvtool bench` (run a sweep) and `kvtool report` (charts + report.md of a run directory)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kvtool.cli import common
from kvtool.cli.cmd_serve import MetricsFileOpt, check_metrics_file, make_out_dir, write_metrics_file
from kvtool.cli.output import Output
from kvtool.progress import stderr_is_terminal

BENCH_HELP = """Run a benchmark sweep: every workload on every cell (policy x writer x durability, optionally x block size x RAM budget x remote policy: off, write_through, on_evict, against \\[cache] remote_url or a redis-server the bench starts) plus the no-cache and mlx-lm-prompt-cache baselines, on one resident model. Writes requests.csv, cells.csv, run.json, PNG charts and report.md to results/<run-id>/ (or DIR/<run-id>/ with --out DIR).

A config with a \\[serve_load] table instead drives real servers: concurrent streamed clients against kvtool serve and plain mlx_lm.server on the same model, 95 % bootstrap intervals over repeats, greedy outputs compared (kvtool/bench/loadcell.py; exit 1 on a mismatch, a failed request or an unclean stop).

Examples:

  kvtool bench bench_configs/quick.toml                # tiny model, a few minutes on 2 cores

  kvtool bench bench_configs/policies.toml --out /data/kvbench

  kvtool bench bench_configs/quick.toml --json         # print the run summary as JSON

  kvtool bench bench_configs/serve_load_quick.toml     # load through kvtool serve vs mlx_lm.server

  kvtool bench bench_configs/quick.toml --metrics-file run.prom    # Prometheus text format of the kvtool cells

--metrics-file writes the metric names of kvtool serve's GET /metrics for the whole sweep: the tier counters of every kvtool cell run summed (gauges: their values at each cell run's end, summed) and the requests of the kvtool cells (baselines left out). Without a terminal (CI, logs) a progress line goes to stderr at most every 10 s (KVTOOL_PROGRESS_INTERVAL_S).

Exit codes: 0 done and every tier shut down cleanly with its writes drained; 1 done but a cell shut down uncleanly or lost a write; 2 bad sweep file or model.
"""

REPORT_HELP = """Regenerate the PNG charts and report.md of a bench run directory from its cells.csv, requests.csv and run.json.

Every figure is the median over the repeats with its 95% bootstrap interval. A cell wins a workload only when its interval lies wholly below every other kvtool cell's; otherwise the report says no policy differs beyond the noise, lists the tied cells and gives their span. Exit codes: 0 done; 2 not a readable run directory (missing, empty or malformed files).

Examples:

  kvtool report results/20260101-120000-quick

  kvtool report results/20260101-120000-quick --json
"""

OutOpt = Annotated[
    Path | None,
    typer.Option("--out", "-o", help="Parent directory of the run directory (default: results/).", show_default=False),
]


@common.cli_command
def bench(
    config: Annotated[Path, typer.Argument(help="Sweep definition (TOML), e.g. bench_configs/quick.toml.")],
    out: OutOpt = None,
    json_out: common.JsonOpt = False,
    metrics_file: MetricsFileOpt = None,
    verbose: common.VerboseOpt = False,
) -> int:
    common.setup_logging(verbose)
    check_metrics_file(metrics_file)
    from kvtool.bench.runner import run_sweep
    from kvtool.bench.sweep import load_sweep

    if not config.is_file():
        raise common.CLIError(f"sweep file not found: {config}")
    make_out_dir(out if out is not None else Path("results"))
    from kvtool.bench.loadcell import is_serve_load_config

    if is_serve_load_config(config):  # load through real servers (kvtool serve vs mlx_lm.server)
        if metrics_file is not None:
            raise common.CLIError("--metrics-file: a [serve_load] run drives real kvtool serve processes; "
                                  "scrape their GET /metrics instead")
        return _bench_serve_load(config, out, json_out)
    spec = load_sweep(config)
    engine = common.load_engine(spec.model, spec.base_config(Path(".")).replace(ssd_enabled=False, ram_bytes=0))
    try:
        result = run_sweep(spec, out, engine=engine, progress=not json_out or not stderr_is_terminal(),
                           config_path=config)
    finally:
        engine.close()
    _write_metrics(metrics_file, result)
    ok = _all_ok(result.cells)
    Output.from_flags(json_out).emit(lambda: _summary(result.run_dir, result.cells, ok),
                                     lambda: _print_human(result.run_dir, result.cells, ok))
    return common.EXIT_OK if ok else common.EXIT_PROBLEMS


@common.cli_command
def report(
    run_dir: Annotated[Path, typer.Argument(help="A bench run directory (holding cells.csv, requests.csv, run.json).")],
    json_out: common.JsonOpt = False,
) -> None:
    from kvtool.bench.loadreport import is_serve_load_run, write_load_report
    from kvtool.bench.report import load_run, write_report

    output = Output.from_flags(json_out)
    if is_serve_load_run(run_dir):  # a `[serve_load]` run: its own report
        load = write_load_report(run_dir)
        output.emit(lambda: {"run_dir": str(run_dir), "ok": load.ok, "files": [str(p) for p in load.files],
                             "comparison": load.summary_records()}, lambda: _print_lines(load.summary_lines()))
        return
    written = write_report(run_dir)  # a missing, empty or malformed run raises ReportError
    cells, _, _ = load_run(run_dir)
    output.emit(lambda: {**_summary(run_dir, cells, _all_ok(cells)),
                         "files": [str(p) for p in [written.markdown, *written.charts]]},
                lambda: _print_human(run_dir, cells, _all_ok(cells)))


def _write_metrics(path: Path | None, result) -> None:
    """`--metrics-file`: the kvtool cells' summed tier counters (`cell_runs[].counters`) and requests."""
    if path is None:
        return
    stats: dict[str, float] = {}
    for fact in result.run.get("cell_runs", []):
        if fact.get("kind") == "kvtool":
            for key, value in (fact.get("counters") or {}).items():
                stats[key] = stats.get(key, 0) + value
    rows = result.requests
    records = _records(rows[rows["kind"] == "kvtool"]) if "kind" in rows else []
    write_metrics_file(path, stats, records)


def _all_ok(cells) -> bool:
    """No cell with shutdown_clean or drain_verified false (empty = not applicable)."""
    for column in ("shutdown_clean", "drain_verified"):
        values = cells[column].dropna().astype(str)
        if (values == "False").any():
            return False
    return True


def _summary(run_dir: Path, cells, ok: bool) -> dict:
    from kvtool.bench.report import winners

    return {
        "run_dir": str(run_dir),
        "report": str(Path(run_dir) / "report.md"),
        "ok": ok,
        "winners": _records(winners(cells)),
        "cells": _records(cells),
    }


def _records(df) -> list[dict]:
    """Rows as dicts with NaN turned into None (strict JSON)."""
    return df.astype(object).where(df.notna(), None).to_dict(orient="records")


def _print_lines(lines: list[str], *wrapped: str) -> None:
    """Plain `lines` on stdout (no markup, not wrapped), then `wrapped` (wrapped at the console's width)."""
    for line in lines:
        common.console.print(line, highlight=False, markup=False, soft_wrap=True)
    for line in wrapped:
        common.console.print(line, highlight=False, markup=False)


def _print_human(run_dir: Path, cells, ok: bool) -> None:
    from kvtool.bench.verdicts import summary_lines

    _print_lines([], *summary_lines(cells), f"report: {Path(run_dir) / 'report.md'}")
    if not ok:
        common.err_console.print("[bold red]warning:[/] a cell shut down uncleanly or failed the drain check")


def register(app: typer.Typer) -> None:
    app.command("bench", help=BENCH_HELP)(bench)
    app.command("report", help=REPORT_HELP)(report)


def _bench_serve_load(config: Path, out: Path | None, json_out: bool) -> int:
    """`kvtool bench CONFIG` for a `[serve_load]` config: run, print a summary, return the exit
    code (0 all checks passed; 1 an output mismatch, a failed request or an unclean server stop).

    Raises:
        ConfigError: a bad config (exit 2 through the CLI's error handling).
    """
    from kvtool.bench.loadcell import load_serve_load, run_serve_load

    spec = load_serve_load(config)
    try:
        run = run_serve_load(spec, out, progress=True, config_path=config)
    except (RuntimeError, OSError) as exc:
        raise common.CLIError(f"serve_load run failed: {exc}", code=common.EXIT_PROBLEMS) from None
    Output.from_flags(json_out).emit(
        lambda: {"run_dir": str(run.run_dir), "report": str(run.run_dir / "report.md"), "ok": run.ok,
                 "comparison": run.report.summary_records()},
        lambda: _print_lines(run.report.summary_lines(), f"report: {run.run_dir / 'report.md'}"))
    return common.EXIT_OK if run.ok else common.EXIT_PROBLEMS
