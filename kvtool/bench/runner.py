"""The sweep runner: every workload x cell x repeat on one resident model.

Between cells the tier is reconfigured live (docs/design.md#live-reconfiguration, `Engine.reconfigure`): quiesce, drain the
writer, flush the index, detach, drop RAM blocks, reattach with the next cell's settings. Each cell
run gets its own cache directory `<cache_root>/<workload>/<cell>/r<repeat>`, so cells never share
blocks. After a cell the engine is *parked* (no tier), which closes the cell's tier: its
`ShutdownStatus` and final writer counters belong to that cell and the drain is verified against
the index and the files on disk. Workloads that measure cold SSD reads drop the page cache of the
block files (`posix_fadvise(POSIX_FADV_DONTNEED)`).

Cells with a remote tier (`remote_policy` not `off`) share one server: `[cache] remote_url`, else a
redis-server the runner starts on loopback for the sweep (`kvtool.bench.redis_local`). The cell's
namespace is removed from it before and after each cell run (after the tier closed, so its writer
drained), so cells never share remote blocks either. With `restart_host = "new"` a `Restart` opens
the tier on a new, empty directory `<cell run dir>-host<n>` (another host on the same server).

Python API::

    from kvtool.bench.sweep import load_sweep
    from kvtool.bench.runner import run_sweep
    result = run_sweep(load_sweep("bench_configs/quick.toml"), out_dir=Path("results"))
    result.cells  # pandas DataFrame, as cells.csv
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import time
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pandas as pd
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kvtool.bench import machine, metrics
from kvtool.bench.baseline_mlxlm import PromptCacheBaseline
from kvtool.bench.restore_pagecache import fadvise_dontneed
from kvtool.bench.sweep import BASELINE_MLXLM, Cell, SweepSpec
from kvtool.bench.workloads import DropPageCache, Request, Restart, Workload, WorkloadContext, build_workload

PAGE_CACHE_METHOD = "posix_fadvise(POSIX_FADV_DONTNEED) per block file, after fsync"
BLOCK_SUFFIX = ".safetensors"


@dataclass
class RunResult:
    """What `run_sweep` produced: the run directory and the `requests.csv` rows, `cells.csv` rows
    and `run.json` document it holds (with the report)."""

    run_dir: Path
    requests: pd.DataFrame
    cells: pd.DataFrame
    run: dict[str, Any]


@dataclass
class _Context:
    spec: SweepSpec
    engine: Any
    cache_root: Path
    parked: Any  # KVToolConfig with no tier
    base: Any = None  # the [cache] KVToolConfig, remote_url set to the sweep's server
    remote: Any = None  # kvtool.ops.remote_ops.Connection to that server (None: no cell uses it)
    remote_own: bool = False  # the runner started the server
    progress: Progress | None = None
    request_task: Any = None
    page_cache_drops: list[dict[str, Any]] = field(default_factory=list)


def kv_bytes_per_token(engine: Any) -> int:
    """Raw KV bytes of one token over all layers (keys and values); 0 if unknown."""
    kv = engine.cache.kv if getattr(engine, "cache", None) is not None else None
    return kv.token_nbytes() if kv is not None else 0


def default_run_id(spec: SweepSpec) -> str:
    """`<UTC timestamp>-<sweep name>`, e.g. `20260101-120000-quick`."""
    return f"{datetime.now(UTC):%Y%m%d-%H%M%S}-{spec.name}"


def run_sweep(
    spec: SweepSpec,
    out_dir: Path | None = None,
    *,
    run_id: str | None = None,
    engine: Any = None,
    progress: bool = True,
    report: bool = True,
    config_path: Path | None = None,
) -> RunResult:
    """Run a sweep and write `requests.csv`, `cells.csv`, `run.json` (and the report).

    Args:
        spec: the sweep.
        out_dir: parent of the run directory (default `results/`); the run goes to
            `<out_dir>/<run_id>/`.
        run_id: default `default_run_id(spec)`.
        engine: an existing `kvtool.engine.Engine` to use (left open); default: load
            `spec.model` once and close it at the end.
        progress: show progress on stderr (a rich bar on a terminal, else a line at most every 10 s).
        report: write the PNGs and report.md at the end (`kvtool.bench.report.write_report`).
        config_path: the sweep file, recorded in run.json.

    Returns:
        The `RunResult`.
    """
    run_id = run_id or default_run_id(spec)
    run_dir = Path(out_dir or "results") / run_id
    run_dir.mkdir(parents=True, exist_ok=False)
    cache_root = (spec.cache_root / run_id) if spec.cache_root else run_dir / "cache"
    started = time.time()
    own_engine = engine is None
    parked = spec.base_config(cache_root).replace(ssd_enabled=False, ram_bytes=0, remote_url=None)
    if own_engine:
        from kvtool.engine import Engine

        engine = Engine.from_spec(spec.model, parked)
    try:
        with ExitStack() as stack:
            ctx = _Context(spec, engine, cache_root, parked, base=spec.base_config(cache_root))
            if spec.needs_remote:
                _remote_server(ctx, stack)
            engine.reconfigure(ctx.parked)
            rows, runs = _run_all(ctx, progress)
    finally:
        if own_engine:
            engine.close()
    requests = metrics.requests_frame(rows)
    runs_df = pd.DataFrame(runs)
    cells = metrics.aggregate_cells(requests, runs_df, kv_bytes_per_token(engine))
    run_doc = _run_document(ctx, run_id, config_path, started, runs)
    result = RunResult(run_dir=run_dir, requests=requests, cells=cells, run=run_doc)
    _write_run(result, report)
    if not spec.keep_cache:
        shutil.rmtree(cache_root, ignore_errors=True)
    return result


def _write_run(result: RunResult, report: bool) -> None:
    """`requests.csv`, `cells.csv`, `run.json` into the run directory; then, with `report`, the report."""
    result.requests.to_csv(result.run_dir / "requests.csv", index=False)
    result.cells.to_csv(result.run_dir / "cells.csv", index=False)
    (result.run_dir / "run.json").write_text(json.dumps(result.run, indent=2, default=str) + "\n")
    if report:
        from kvtool.bench.report import write_report

        write_report(result.run_dir)


def _remote_server(ctx: _Context, stack: ExitStack) -> None:
    """Point `ctx.base` at the sweep's server (`[cache] remote_url`, else one started here for
    the sweep, stopped by `stack`) and open `ctx.remote` on it.

    Raises:
        RedisNotFoundError: no server given and no redis-server binary to start.
        RemoteURLError, RemoteConnectError: the server cannot be used (one line).
    """
    from kvtool.ops.remote_ops import connect

    url = ctx.base.remote_url
    if url is None:
        from kvtool.bench.redis_local import LocalRedis

        url = stack.enter_context(LocalRedis()).url
        ctx.remote_own = True
        ctx.base = ctx.base.replace(remote_url=url)
    ctx.remote = connect(url, cluster=True if ctx.base.remote_cluster else None)
    stack.callback(ctx.remote.close)


def _flush_remote(ctx: _Context, layout_key: str | None) -> int:
    """Remove the namespace `layout_key` from the sweep's server; returns the keys removed."""
    from kvtool.ops.remote_ops import rm

    if ctx.remote is None or layout_key is None:
        return 0
    return rm(ctx.remote, layout_key).removed_keys


def _run_all(ctx: _Context, show_progress: bool) -> tuple[list[dict], list[dict]]:
    spec, engine = ctx.spec, ctx.engine
    workload_ctx = WorkloadContext(kv_bytes_per_token(engine), spec.base_config(ctx.cache_root).ram_bytes)
    workloads = [
        build_workload(name, params, lambda text: engine.encode(prompt=text), spec.seed, workload_ctx)
        for name, params in spec.workloads.items()
    ]
    cells = spec.cells()
    rows: list[dict] = []
    runs: list[dict] = []
    bar = _progress_bar() if show_progress else None
    with bar or nullcontext():
        ctx.progress = bar
        total = len(workloads) * len(cells) * spec.repeats
        cell_task = bar.add_task("cells", total=total) if bar else None
        ctx.request_task = bar.add_task("requests", total=0) if bar else None
        for workload in workloads:
            for cell in cells:
                for repeat in range(spec.repeats):
                    if bar and cell_task is not None:  # cells done/left and the ETA: kvtool.progress
                        bar.update(cell_task, description=f"{workload.name} {cell.name} r{repeat}")
                        bar.reset(ctx.request_task, total=len(workload.requests))
                    cell_rows, fact = run_cell(ctx, workload, cell, repeat)
                    rows += cell_rows
                    runs.append(fact)
                    if bar and cell_task is not None:
                        bar.advance(cell_task)
    return rows, runs


def _progress_bar() -> Progress:
    """A rich bar on a terminal; without one, a progress line at most every 10 s (kvtool.progress)."""
    from kvtool.progress import make_progress

    return make_progress("kvtool bench", TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                         TimeElapsedColumn(), console=Console(stderr=True), transient=False)


def cell_dir(cache_root: Path, workload: Workload, cell: Cell, repeat: int) -> Path:
    """The cache directory of one cell run."""
    return cache_root / workload.name / cell.slug / f"r{repeat}"


def run_cell(ctx: _Context, workload: Workload, cell: Cell, repeat: int) -> tuple[list[dict], dict]:
    """Run one workload on one cell from an empty cache directory.

    Returns:
        (request rows, the cell run's facts: the `runs` row of `metrics.aggregate_cells`, writer
        counters and disk scan).
    """
    engine, spec = ctx.engine, ctx.spec
    directory = cell_dir(ctx.cache_root, workload, cell, repeat)
    dirs = [directory]  # one per host: a restart with restart_host = "new" adds one
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    config = cell.config(ctx.base, directory)
    ids_base = {"workload": workload.name, **cell.columns(), "repeat": repeat}
    closed: list = []  # (ShutdownStatus, final tier counters) per tier closed
    drops: list[dict] = []
    rows: list[dict] = []
    t0 = time.perf_counter()
    backend = _open_backend(ctx, cell, config, directory)
    layout_key = engine.layout_key if cell.remote else None
    flushed = _flush_remote(ctx, layout_key)
    for step in workload.steps:
        if isinstance(step, Request):
            res = backend.generate(list(step.ids), max_tokens=spec.max_tokens)
            measured = step.phase in workload.measured_phases
            ids = {**ids_base, "request": len(rows), "phase": step.phase, "group": step.group, "measured": measured}
            rows.append(metrics.request_row(ids, res))
            if ctx.progress:
                ctx.progress.advance(ctx.request_task)
        elif isinstance(step, Restart):
            if spec.restart_host == "new":  # another host: an empty directory, the same remote server
                dirs.append(directory.with_name(f"{directory.name}-host{len(dirs) + 1}"))
                shutil.rmtree(dirs[-1], ignore_errors=True)
                dirs[-1].mkdir(parents=True)
                config = cell.config(ctx.base, dirs[-1])
            if cell.kind == BASELINE_MLXLM:
                backend = PromptCacheBaseline(engine.model, dirs[-1])  # a new process would rescan
            else:
                closed.append(_switch(engine, config))
                # a fresh tier (on the same directory, or a new host's): the RAM tier starts empty
        elif isinstance(step, DropPageCache):
            drops.append({**ids_base, **drop_page_cache(dirs[-1])})
    if cell.kind != BASELINE_MLXLM:
        closed.append(_switch(engine, ctx.parked))
    wall_s = time.perf_counter() - t0
    left = _flush_remote(ctx, layout_key)  # the cell's tier is closed: its remote writer drained
    ctx.page_cache_drops += drops
    fact = _facts(ids_base, dirs, cell, [c for c in closed if c is not None], drops, wall_s)
    if cell.remote:
        fact["remote"] = {"keys_before": flushed, "keys_after": left}
    return rows, fact


def _open_backend(ctx: _Context, cell: Cell, config: Any, directory: Path) -> Any:
    if cell.kind == BASELINE_MLXLM:
        return PromptCacheBaseline(ctx.engine.model, directory)
    ctx.engine.reconfigure(config)  # the engine is parked: nothing to drain
    return ctx.engine


def _switch(engine: Any, config: Any) -> tuple[Any, dict] | None:
    """Reconfigure; return the closed tier's status and its final counters (after the drain),
    or None if the engine had no tier (no-cache)."""
    tier = getattr(engine, "tiered", None)
    status = engine.reconfigure(config)
    return (status, tier.stats()) if tier is not None else None


def _facts(ids_base: dict, dirs: list[Path], cell: Cell, closed: list, drops: list, wall_s: float) -> dict:
    scans = [scan_cache_dir(d) for d in dirs]
    disk = {key: sum(scan[key] for scan in scans) for key in scans[0]}
    counters: dict[str, float] = {}  # (ints, but a float counter is summed too)
    for _, stats in closed:
        for key, value in stats.items():
            if isinstance(value, (int, float)) and key.startswith(("writer_", "ssd_", "kv_", "remote_")):
                counters[key] = counters.get(key, 0) + value
    return {
        **ids_base,
        "bytes_written": disk["bytes"],
        "tokens_stored": disk["tokens"],
        "shutdown_clean": all(status.shutdown_clean for status, _ in closed) if closed else None,
        "drain_verified": verify_drain(counters, disk) if cell.kind == "kvtool" else None,
        "page_cache_dropped": all(d["ok"] for d in drops) if drops and disk["files"] else None,
        "wall_s": wall_s,
        "disk": disk,
        "counters": counters,
    }


def verify_drain(counters: dict[str, float], disk: dict[str, int]) -> bool:
    """True if, after the tier closed, every accepted write was attempted, nothing is pending,
    and the index rows agree with the writer's successful saves and the segment rows with the
    segment files on disk.

    Args:
        counters: `writer_*` counters summed over the tiers closed in the cell run.
        disk: `scan_cache_dir` of the cell's directory.
    """
    accepted = counters.get("writer_enqueue_total", 0)
    attempted = sum(counters.get(k, 0) for k in ("writer_save_success", "writer_dedup", "writer_collision",
                                                   "writer_budget_refused", "writer_save_fail"))
    saved = counters.get("writer_save_success", 0)
    return (
        accepted == attempted
        and counters.get("writer_pending", 0) == 0
        and counters.get("writer_queue_depth", 0) == 0
        and disk["index_rows"] == saved
        and disk["segment_files"] == disk["segment_rows"]
    )


def scan_cache_dir(directory: Path) -> dict[str, int]:
    """Files under a cell's cache directory.

    Returns:
        `files` and `bytes` (everything on disk), `segment_files` (kvtool segment files in
        namespace directories), `segment_rows`, `index_rows` and `tokens` (segment rows, block
        rows and summed `num_tokens` of the namespace indexes; for mlx-lm prompt-cache files,
        `tokens` is read from their metadata).
    """
    out = {"files": 0, "bytes": 0, "segment_files": 0, "segment_rows": 0, "index_rows": 0, "tokens": 0}
    if not directory.exists():
        return out
    for path in directory.rglob("*"):
        if path.is_file():
            out["files"] += 1
            out["bytes"] += path.stat().st_size
    for index in directory.glob("*/index.sqlite"):
        out["segment_files"] += sum(1 for p in index.parent.rglob(f"*{BLOCK_SUFFIX}") if not p.name.startswith("."))
        con = sqlite3.connect(f"{index.resolve().as_uri()}?mode=ro", uri=True)  # as_uri needs an absolute path
        try:
            rows, tokens = con.execute("SELECT count(*), coalesce(sum(num_tokens), 0) FROM blocks").fetchone()
            out["segment_rows"] += con.execute("SELECT count(*) FROM segments").fetchone()[0]
        finally:
            con.close()
        out["index_rows"] += rows
        out["tokens"] += tokens
    if out["index_rows"] == 0:
        out["tokens"] = sum(len(t) for t in PromptCacheBaseline.scan(directory).values())
    return out


def drop_page_cache(directory: Path) -> dict[str, Any]:
    """Drop the OS page cache of every block / prompt-cache file under `directory`
    (`restore_pagecache.fadvise_dontneed`).

    Returns:
        `{"files": n, "ok": bool, "error": str | None}`; `ok` is False where the platform has no
        `posix_fadvise` (e.g. macOS) or a call failed.
    """
    files = [p for p in directory.rglob(f"*{BLOCK_SUFFIX}") if not p.name.startswith(".")]
    error = fadvise_dontneed(files)
    return {"files": len(files), "ok": error is None, "error": error}


def _masked(raw: dict[str, Any]) -> dict[str, Any]:
    """The sweep document with the password of `[cache] remote_url` masked."""
    url = raw.get("cache", {}).get("remote_url") if isinstance(raw.get("cache"), dict) else None
    if not isinstance(url, str):
        return raw
    from kvtool.config.remote_url import parse_remote_url

    return {**raw, "cache": {**raw["cache"], "remote_url": parse_remote_url(url).masked}}


def _run_document(ctx: _Context, run_id: str, config_path: Path | None, started: float, runs: list) -> dict:
    engine = ctx.engine
    loaded = getattr(engine, "loaded", None)
    drops = ctx.page_cache_drops
    return {
        "run_id": run_id,
        "started": datetime.fromtimestamp(started, UTC).isoformat(),
        "duration_s": round(time.time() - started, 3),
        "config_path": str(config_path) if config_path else None,
        "sweep": _masked(ctx.spec.raw),
        "remote": None if ctx.remote is None else {"url": ctx.remote.remote.masked, "started_by_bench": ctx.remote_own,
                                                   "restart_host": ctx.spec.restart_host},
        "cells": [c.columns() for c in ctx.spec.cells()],
        "git_commit": machine.git_commit(),
        "machine": machine.machine_info(ctx.cache_root),
        "cache_root": str(ctx.cache_root),
        "model": {
            "spec": ctx.spec.model,
            "name": getattr(loaded, "name", None),
            "model_id": getattr(loaded, "model_id", None),
            "path": str(getattr(loaded, "path", "")) or None,
            "kv_layout": {"layers": engine.cache.kv.spec, "dtype": engine.cache.kv.dtype} if engine.cache.kv else None,
            "kv_bytes_per_token": kv_bytes_per_token(engine),
        },
        "page_cache_drop": {
            "method": PAGE_CACHE_METHOD,
            "supported": hasattr(os, "posix_fadvise"),
            "attempts": len(drops),
            "files": sum(d["files"] for d in drops),
            "ok": all(d["ok"] for d in drops) if drops else None,
            "errors": sorted({d["error"] for d in drops if d["error"]}),
        },
        "cell_runs": runs,
        "columns": {"requests.csv": metrics.REQUEST_COLUMNS, "cells.csv": metrics.CELL_COLUMNS},
    }
