"""`[serve_load]` bench cells: load through a real `kvtool serve` against plain `mlx_lm.server`.

A bench config whose TOML has a `[serve_load]` table is run by `kvtool bench CONFIG` through this
module instead of the policy sweep; its keys and their validation: `kvtool.bench.loadconfig`.

Every batch = (workload, clients, server, repeat) starts its own server subprocess on a free
loopback port (kvtool: an empty cache directory), warms it up, runs the workload's phases
through `kvtool.bench.loadgen` (restarting the server before the workload's `restart_before`
phase), reads `GET /kvtool/stats` around the measured phases, samples the server's peak RSS and
stops it (SIGTERM, then SIGKILL). The batches of one (workload, clients, repeat) run back to back,
the servers' order rotated by one from repeat to repeat (so each goes first as often as the
others); each batch records the 1-minute load average at its start and end and the host's
listen-queue overflows during its measured phases (`kvtool.bench.machine.listen_overflows`).
Outputs in the run directory: `requests.jsonl` / `requests.csv` (one row per request),
`batches.csv` / `batches.json` (per batch figures, server facts, kvtool counters), `run.json`, then
the report (`kvtool.bench.loadreport.write_load_report`). A progress line goes to stderr at least
every `PROGRESS_INTERVAL_S` seconds.
"""

from __future__ import annotations

import json
import shutil
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kvtool.bench.loadconfig import SECTION, ServeLoadSpec, is_serve_load_config, load_serve_load, parse_serve_load
from kvtool.bench.loadgen import LoadRequest, LoadSpec, run_load
from kvtool.bench.loadserver import KVTOOL, ManagedServer, ServerOptions
from kvtool.bench.loadstats import batch_figures
from kvtool.bench.loadworkloads import LoadWorkload, build_load_workload, workload_kind
from kvtool.bench.machine import listen_overflows, load_average

PROGRESS_INTERVAL_S = 5.0
WARMUP_MESSAGES = ({"role": "user", "content": "Say hello."},)
TIER_KEYS = ("ram_hit_tokens", "ssd_hit_tokens", "cached_tokens", "prefill_tokens")
SUMMED_COUNTERS = ("ssd_bytes_written", "ssd_bytes_read", "ssd_save_success", "ssd_load_hits", "kv_ram_evictions",
                   "writer_shed_blocks", "writer_shed_bytes", "writer_backpressure_waits", "writer_save_fail",
                   "writer_budget_refused")
SERVER_COUNTERS = ("admission_waits", "admission_return_waits", "admission_wait_ms", "prefill_steps")  # /kvtool/stats `server`, summed


# ------------------------------------------------------------------------------------------ progress
class Progress:
    """A status line on stderr: every `PROGRESS_INTERVAL_S` s from a daemon thread (a new line
    each time when stderr is not a TTY; rewritten in place on a TTY), and at every `set`."""

    def __init__(self, enabled: bool = True, interval_s: float = PROGRESS_INTERVAL_S):
        self.enabled, self.interval_s = enabled, interval_s
        self.tty = sys.stderr.isatty()
        self.status = "starting"
        self.t0 = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="serve-load-progress", daemon=True)

    def __enter__(self) -> Progress:
        if self.enabled:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(2)
        if self.enabled and self.tty:
            print(file=sys.stderr, flush=True)

    def set(self, status: str) -> None:
        self.status = status
        self._print()

    def _print(self) -> None:
        if not self.enabled:
            return
        line = f"[serve_load {time.monotonic() - self.t0:7.1f} s] {self.status}"
        print(("\r\x1b[2K" + line) if self.tty else line, end="" if self.tty else "\n", file=sys.stderr, flush=True)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._print()


# ------------------------------------------------------------------------------------------ running
@dataclass
class LoadRun:
    """A finished `[serve_load]` run: its directory, whether every check passed (`ok`) and the
    report's summary (`kvtool.bench.loadreport.LoadReport`)."""

    run_dir: Path
    ok: bool
    report: Any


@dataclass
class _Ctx:
    spec: ServeLoadSpec
    run_dir: Path
    cache_root: Path
    model_path: str
    progress: Progress
    batches: list[dict[str, Any]] = field(default_factory=list)
    requests: list[dict[str, Any]] = field(default_factory=list)


def run_serve_load(spec: ServeLoadSpec, out_dir: Path | None = None, *, run_id: str | None = None,
                   progress: bool = True, config_path: Path | None = None) -> LoadRun:
    """Run every batch of `spec`, write the outputs and the report into `<out_dir>/<run_id>/`.

    Args:
        spec: the parsed config.
        out_dir: parent of the run directory (default `results/`).
        run_id: default `<UTC timestamp>-<name>`.
        progress: status lines on stderr.
        config_path: recorded in run.json.
    """
    from kvtool.bench.loadreport import write_load_report, write_raw
    from kvtool.bench.machine import git_commit, machine_info
    from kvtool.models.loader import resolve_spec

    run_id = run_id or f"{datetime.now(UTC):%Y%m%d-%H%M%S}-{spec.name}"
    run_dir = Path(out_dir or "results") / run_id
    run_dir.mkdir(parents=True, exist_ok=False)
    cache_root = (spec.cache_root / run_id) if spec.cache_root else run_dir / "cache"
    model_path = str(resolve_spec(spec.model)[0])
    started = time.time()
    with Progress(progress) as bar:
        ctx = _Ctx(spec, run_dir, cache_root, model_path, bar)
        bar.set("building workloads")
        workloads = build_workloads(spec, model_path)
        try:
            for workload in workloads:
                for clients in spec.clients_of(workload.name):
                    for repeat in range(spec.repeats):
                        shift = repeat % len(spec.servers)
                        for server in spec.servers[shift:] + spec.servers[:shift]:
                            run_batch(ctx, workload, clients, server, repeat)
        finally:
            write_raw(ctx.run_dir, ctx.requests, ctx.batches)
            if not spec.keep_cache:
                shutil.rmtree(cache_root, ignore_errors=True)
    doc = {
        "kind": SECTION, "run_id": run_id, "started": datetime.fromtimestamp(started, UTC).isoformat(),
        "duration_s": round(time.time() - started, 3), "config_path": str(config_path) if config_path else None,
        "config": spec.raw, "model": {"spec": spec.model, "path": model_path},
        "workloads": {w.name: {"kind": workload_kind(w.name), "params": w.params, "phases": list(w.phases), "measured": list(w.measured),
                               "requests": len(w.requests), "kvtool_ram_bytes": w.kvtool_ram_bytes}
                      for w in workloads},
        "git_commit": git_commit(), "machine": machine_info(cache_root), "command": " ".join(sys.argv),
    }
    (run_dir / "run.json").write_text(json.dumps(doc, indent=2, default=str) + "\n")
    report = write_load_report(run_dir)
    return LoadRun(run_dir, report.ok, report)


def build_workloads(spec: ServeLoadSpec, model_path: str) -> list[LoadWorkload]:
    """Every workload of `spec`, materialised with the tokenizer of the model at `model_path`
    (one per `[serve_load.workloads.<name>]` table, in the config's order; a `cold-burst` has
    prompts for the largest client count)."""
    from mlx_lm.utils import load_tokenizer

    tokenizer = load_tokenizer(Path(model_path))
    return [build_load_workload(name, params, tokenizer, spec.seed, spec.max_tokens, model_dir=Path(model_path),
                                base_dir=spec.base_dir, max_clients=max(spec.clients_of(name)))
            for name, params in spec.workloads.items()]


def run_batch(ctx: _Ctx, workload: LoadWorkload, clients: int, server_kind: str, repeat: int) -> dict[str, Any]:
    """One batch: start the server, warm it up, run the phases, collect, stop. Appends the
    request rows and the batch row to `ctx` and returns the batch row."""
    spec = ctx.spec
    ids = {"workload": workload.name, "server": server_kind, "clients": clients, "repeat": repeat}
    label = f"{workload.name} {clients} client(s) {server_kind} r{repeat}"
    cache_dir = ctx.cache_root / workload.name / f"c{clients}" / f"r{repeat}"
    options = ServerOptions(server_kind, spec.model, ctx.model_path, cache_dir if server_kind == KVTOOL else None,
                            spec.kvtool_args(workload.kvtool_ram_bytes), spec.start_timeout_s, spec.stop_timeout_s)
    log = ctx.run_dir / "logs" / f"{workload.name}-c{clients}-{server_kind}-r{repeat}.log"
    lives: list[dict[str, Any]] = []
    tier = dict.fromkeys((*TIER_KEYS, "prompt_tokens"), 0)
    measured_wall, not_sent, cut, failed_phase = 0.0, 0, False, None
    overflows: int | None = 0
    load_start = _load_avg()
    ctx.progress.set(f"{label}: starting the server")
    server = _start(ctx, options, log)
    agents = workload.agents.batch(server_kind, clients) if workload.agents else None  # built turn by turn
    try:
        for phase in workload.phases:
            if phase == workload.restart_before:
                ctx.progress.set(f"{label}: restarting the server")
                lives.append(_stop(server))
                server = _start(ctx, options, log)
            reqs = workload.phase_requests(phase, clients)
            load = _load_spec(spec, workload, clients, repeat)
            before, drops_before = server.kvtool_stats(), listen_overflows()

            def on_progress(done: int, total: int, phase: str = phase) -> None:
                ctx.progress.status = f"{label}: {phase} {done}/{total} requests"

            ctx.progress.set(f"{label}: {phase} 0/{min(len(reqs), spec.max_requests or len(reqs))} requests")
            result = (agents.run_phase(server.base_url, phase, load, on_progress) if agents
                      else run_load(server.base_url, reqs, load, on_progress))
            after, drops_after = server.kvtool_stats(), listen_overflows()
            server.sample_rss()
            measured = phase in workload.measured
            not_sent += result.not_sent
            cut = cut or result.stopped_by == "wall"
            if measured:
                overflows = _add_drops(overflows, drops_before, drops_after)
                measured_wall += result.wall_s
                _add_tier(tier, before, after)
            ctx.requests += [{**ids, "measured": measured, **r.to_dict()} for r in result.records]
    except Exception as exc:
        failed_phase = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        lives.append(_stop(server))
        rows = [r for r in ctx.requests if all(r[k] == v for k, v in ids.items()) and r["measured"]]
        figures = batch_figures(rows, measured_wall, tier if server_kind == KVTOOL else None)
        row = {**ids, **figures, "measured_wall_s": measured_wall, "not_sent": not_sent, "cut_by_wall": cut,
               "error": failed_phase, "load_avg_start": load_start, "load_avg_end": _load_avg(),
               "listen_overflows": overflows,
               **_life_facts(lives, tier if server_kind == KVTOOL else None)}
        ctx.batches.append(row)
    ctx.progress.set(f"{label}: done, TTFT p50 {row['ttft_p50_ms']:.1f} ms, {row['requests_per_s']:.2f} req/s")
    return row


def _load_spec(spec: ServeLoadSpec, workload: LoadWorkload, clients: int, repeat: int) -> LoadSpec:
    """The load generator's settings for one phase of a batch (a trace replays its own arrivals)."""
    trace = workload_kind(workload.name) == "trace"
    return LoadSpec(clients=clients, arrival="trace" if trace else spec.arrival, rate_per_s=spec.rate,
                    max_requests=spec.max_requests, max_wall_s=spec.max_wall_s,
                    request_timeout_s=spec.request_timeout_s, seed=spec.seed + repeat,
                    time_scale=float(workload.params.get("time_scale", 1.0)))


def _add_drops(total: int | None, before: int | None, after: int | None) -> int | None:
    """`total` plus the listen-queue overflows between two reads; None once any read was None."""
    return None if total is None or before is None or after is None else total + after - before


def _load_avg() -> float | None:
    """The 1-minute load average now (None where the OS has none)."""
    averages = load_average(2)
    return averages[0] if averages else None


def _start(ctx: _Ctx, options: ServerOptions, log: Path) -> ManagedServer:
    server = ManagedServer(options, log)
    if ctx.spec.warmup:
        warm = LoadSpec(clients=1, max_wall_s=ctx.spec.start_timeout_s, request_timeout_s=ctx.spec.start_timeout_s)
        result = run_load(server.base_url, [LoadRequest("warmup", WARMUP_MESSAGES, 2, "warmup")], warm)
        if result.records and result.records[0].error:
            server.stop()
            raise RuntimeError(f"{options.kind} server's warm-up request failed: {result.records[0].error}")
    return server


def _stop(server: ManagedServer) -> dict[str, Any]:
    """Final stats, peak RSS, stop; the facts of one server lifetime."""
    stats = server.kvtool_stats()
    server.sample_rss()
    code = server.stop()
    return {"kind": server.options.kind, "start_s": getattr(server, "start_s", None), "peak_rss_bytes": server.peak_rss,
            "exit_code": code, "killed": server.killed, "stopped_clean": server.stopped_clean,
            "stats": stats, "log": str(server.log)}


def _add_tier(tier: dict[str, int], before: dict[str, Any] | None, after: dict[str, Any] | None) -> None:
    if not before or not after:
        return
    a, b = after.get("adapter", {}), before.get("adapter", {})
    for key in TIER_KEYS:
        tier[key] += int(a.get(key, 0)) - int(b.get(key, 0))
    tier["prompt_tokens"] = tier["cached_tokens"] + tier["prefill_tokens"]


def _life_facts(lives: list[dict[str, Any]], tier: dict[str, int] | None) -> dict[str, Any]:
    rss = [lf["peak_rss_bytes"] for lf in lives if lf["peak_rss_bytes"] is not None]
    out: dict[str, Any] = {
        "peak_rss_bytes": max(rss) if rss else None,
        "server_start_s": max((lf["start_s"] or 0.0) for lf in lives),
        "restarts": len(lives) - 1,
        "exit_codes": " ".join(str(lf["exit_code"]) for lf in lives),
        "stopped_clean": all(bool(lf["stopped_clean"]) for lf in lives),
    }
    if tier is None:
        return out
    counters = [(lf["stats"] or {}).get("cache", {}) for lf in lives]
    out.update({f"kvtool_{k}": tier[k] for k in (*TIER_KEYS, "prompt_tokens")})
    out["kvtool_ram_bytes_held"] = counters[-1].get("kv_ram_bytes") if counters else None
    loops = [(lf["stats"] or {}).get("server", {}) for lf in lives]
    for dicts, keys in ((counters, SUMMED_COUNTERS), (loops, SERVER_COUNTERS)):
        for key in keys:
            present = [c[key] for c in dicts if key in c]
            out[f"kvtool_{key}"] = sum(present) if present else None
    peaks = [c["writer_queue_peak_bytes"] for c in counters if "writer_queue_peak_bytes" in c]
    out["kvtool_writer_queue_peak_bytes"] = max(peaks) if peaks else None
    out["kvtool_stats_missing"] = any(lf["stats"] is None for lf in lives)
    return out


__all__ = ["SECTION", "LoadRun", "Progress", "ServeLoadSpec", "build_workloads", "is_serve_load_config", "load_serve_load",
           "parse_serve_load", "run_batch", "run_serve_load"]

