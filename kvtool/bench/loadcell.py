"""`[serve_load]` bench cells: load through a real `kvtool serve` against plain `mlx_lm.server`.

A bench config whose TOML has a `[serve_load]` table (and nothing else at the top level) is run
by `kvtool bench CONFIG` through this module instead of the policy sweep. Keys (all optional
but `workloads`; see `bench_configs/serve_load.toml`):

    [serve_load]
    name = "serve_load"         # run id suffix (default: the file stem)
    model = "tiny"              # kvtool preset, model directory or HF id (mlx_lm.server gets its path)
    seed = 0                    # workloads and Poisson arrivals are deterministic from it
    repeats = 3                 # batches per cell; kvtool and mlx-lm alternate which goes first
    clients = [1, 4, 16]        # concurrency levels (closed loop) or in-flight caps (poisson, trace)
    servers = ["kvtool", "mlx-lm"]  # mlx-lm is the baseline; outputs are compared when both run
    arrival = "closed"          # closed | poisson (then rate = requests/s); trace workloads use their times
    max_tokens = 8              # generated tokens per request (greedy, temperature 0)
    max_requests = 0            # per phase: send at most this many requests (0: all)
    max_wall_s = 600            # per phase: nothing runs past this (s); cut requests are failures
    request_timeout_s = 600     # HTTP timeout per request (s)
    warmup = true               # one short unrecorded request after every server start
    start_timeout_s = 180       # readiness wait (GET /v1/models) (s)
    stop_timeout_s = 60         # SIGTERM -> SIGKILL (s)
    cache_root = "/mnt/nvme/x"  # where kvtool's cache directories go (default: <run dir>/cache)
    keep_cache = false          # keep them after the run

    [serve_load.kvtool]         # `kvtool serve` cache flags (default: kvtool's)
    block_size = 64             # --block-size
    ram_bytes = "256MiB"        # --ram-bytes (a multi-turn workload's own ram_bytes wins)
    policy = "write_through"    # --policy;  durability = "best_effort" (--durability); async = true (--async/--sync)
    args = []                   # more `kvtool serve` flags, verbatim

    [serve_load.workloads.shared-prefix]   # one table per workload (kvtool.bench.loadworkloads)
    groups = 1
    prompts_per_group = 48
    system_tokens = 2000
    question_tokens = 32

Every batch = (workload, clients, server, repeat) starts its own server subprocess on a free
loopback port (kvtool: an empty cache directory), warms it up, runs the workload's phases
through `kvtool.bench.loadgen` (the `restart` workload restarts the server between its halves),
reads `GET /kvtool/stats` around the measured phases, samples the server's peak RSS and stops it
(SIGTERM, then SIGKILL). Outputs in the run directory: `requests.jsonl` / `requests.csv` (one
row per request), `batches.csv` / `batches.json` (per batch figures, server facts, kvtool
counters), `run.json`, then `kvtool.bench.loadreport.write_load_report`: `cells.csv`,
`comparison.csv`, `mismatches.csv`, charts and `report.md`. A progress line goes to stderr at
least every `PROGRESS_INTERVAL_S` seconds.
"""

from __future__ import annotations

import json
import shutil
import sys
import threading
import time
import tomllib
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kvtool.bench.loadgen import LoadRequest, LoadSpec, run_load
from kvtool.bench.loadserver import KVTOOL, SERVER_KINDS, ManagedServer, ServerOptions
from kvtool.bench.loadstats import batch_figures
from kvtool.bench.loadworkloads import LoadWorkload, build_load_workload, validate_load_params
from kvtool.bench.workloads import size_field
from kvtool.config import ConfigError

SECTION = "serve_load"
PROGRESS_INTERVAL_S = 5.0
WARMUP_MESSAGES = ({"role": "user", "content": "Say hello."},)
TIER_KEYS = ("ram_hit_tokens", "ssd_hit_tokens", "cached_tokens", "prefill_tokens")
SUMMED_COUNTERS = ("ssd_bytes_written", "ssd_bytes_read", "ssd_save_success", "ssd_load_hits", "kv_ram_evictions",
                   "writer_shed_blocks", "writer_shed_bytes", "writer_backpressure_waits", "writer_save_fail",
                   "writer_budget_refused")
KVTOOL_FLAGS = {"block_size": "--block-size", "ram_bytes": "--ram-bytes", "policy": "--policy",
                "durability": "--durability", "codec": "--codec"}


@dataclass(frozen=True)
class ServeLoadSpec:
    """A parsed `[serve_load]` config (see the module docstring for every key)."""

    name: str
    model: str
    seed: int
    repeats: int
    clients: tuple[int, ...]
    servers: tuple[str, ...]
    arrival: str
    rate: float | None
    max_tokens: int
    max_requests: int
    max_wall_s: float
    request_timeout_s: float
    warmup: bool
    start_timeout_s: float
    stop_timeout_s: float
    kvtool: dict[str, Any]
    workloads: dict[str, dict[str, Any]]
    cache_root: Path | None = None
    keep_cache: bool = False
    base_dir: Path = Path(".")
    raw: dict[str, Any] = field(default_factory=dict)

    def kvtool_args(self, ram_bytes: int | None = None) -> tuple[str, ...]:
        """`kvtool serve` flags from `[serve_load.kvtool]` (`ram_bytes` overrides the table's)."""
        args: list[str] = []
        table = dict(self.kvtool)
        if ram_bytes is not None:
            table["ram_bytes"] = ram_bytes
        for key, flag in KVTOOL_FLAGS.items():
            if key in table:
                args += [flag, str(table[key])]
        if "async" in table:
            args.append("--async" if table["async"] else "--sync")
        return (*args, *table.get("args", []))


def is_serve_load_config(path: Path | str) -> bool:
    """True if `path` is a TOML file with a `[serve_load]` table (False for anything unreadable:
    the sweep loader then reports the error)."""
    try:
        with open(path, "rb") as fh:
            return SECTION in tomllib.load(fh)
    except (OSError, tomllib.TOMLDecodeError):
        return False


def load_serve_load(path: Path | str) -> ServeLoadSpec:
    """Read and validate a `[serve_load]` config.

    Raises:
        ConfigError: invalid TOML or field (the error names it, e.g. `serve_load.clients`).
    """
    path = Path(path)
    with open(path, "rb") as fh:
        try:
            data = tomllib.load(fh)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError("<file>", f"{path}: invalid TOML: {exc}") from None
    return parse_serve_load(data, default_name=path.stem, base_dir=path.resolve().parent)


def parse_serve_load(data: dict[str, Any], default_name: str = SECTION, base_dir: Path = Path(".")) -> ServeLoadSpec:
    """Validate a parsed config document (see `load_serve_load`)."""
    extra = sorted(set(data) - {SECTION})
    if extra:
        raise ConfigError(extra[0], f"a [{SECTION}] config has no other top-level keys")
    t = data[SECTION]
    if not isinstance(t, dict):
        raise ConfigError(SECTION, "must be a table")
    known = {"name", "model", "seed", "repeats", "clients", "servers", "arrival", "rate", "max_tokens", "max_requests",
             "max_wall_s", "request_timeout_s", "warmup", "start_timeout_s", "stop_timeout_s", "cache_root",
             "keep_cache", "kvtool", "workloads"}
    for key in t:
        if key not in known:
            raise ConfigError(f"{SECTION}.{key}", f"unknown key; known: {', '.join(sorted(known))}")
    clients = t.get("clients", [1])
    if not isinstance(clients, list) or not clients or any(_bad_int(c, 1) for c in clients) \
            or len(set(clients)) != len(clients):
        raise ConfigError(f"{SECTION}.clients", f"must be a non-empty list of distinct integers >= 1, got {clients!r}")
    servers = t.get("servers", list(SERVER_KINDS))
    if not isinstance(servers, list) or not servers or any(s not in SERVER_KINDS for s in servers) \
            or len(set(servers)) != len(servers):
        raise ConfigError(f"{SECTION}.servers", f"must be a list drawn from {', '.join(SERVER_KINDS)}, got {servers!r}")
    arrival = t.get("arrival", "closed")
    if arrival not in ("closed", "poisson"):
        raise ConfigError(f"{SECTION}.arrival", f"must be closed or poisson (trace workloads use their times), "
                                                f"got {arrival!r}")
    rate = t.get("rate")
    if arrival == "poisson" and not (isinstance(rate, (int, float)) and not _bad_num(rate) and rate > 0):
        raise ConfigError(f"{SECTION}.rate", f"arrival = 'poisson' needs rate = requests/s > 0, got {rate!r}")
    name = t.get("name", default_name)
    if not isinstance(name, str) or not name or any(not (ch.isalnum() or ch in "_.-") for ch in name):
        raise ConfigError(f"{SECTION}.name", "must be a non-empty string of letters, digits, '_', '.', '-'")
    model = t.get("model", "tiny")
    if not isinstance(model, str) or not model:
        raise ConfigError(f"{SECTION}.model", "must be a preset name, model directory or Hugging Face id")
    for key in ("warmup", "keep_cache"):
        if not isinstance(t.get(key, True), bool):
            raise ConfigError(f"{SECTION}.{key}", "must be true or false")
    cache_root = t.get("cache_root")
    if cache_root is not None and (not isinstance(cache_root, str) or not cache_root):
        raise ConfigError(f"{SECTION}.cache_root", "must be a directory path")
    workloads = t.get("workloads")
    if not isinstance(workloads, dict) or not workloads:
        raise ConfigError(f"{SECTION}.workloads", f"at least one [{SECTION}.workloads.<name>] table is required")
    for wname, params in workloads.items():
        if not isinstance(params, dict):
            raise ConfigError(f"{SECTION}.workloads.{wname}", "must be a table")
        validate_load_params(wname, params)
    return ServeLoadSpec(
        name=name, model=model, seed=_int(t, "seed", 0, 0), repeats=_int(t, "repeats", 3, 1),
        clients=tuple(clients), servers=tuple(servers), arrival=arrival, rate=float(rate) if rate else None,
        max_tokens=_int(t, "max_tokens", 8, 1), max_requests=_int(t, "max_requests", 0, 0),
        max_wall_s=_num(t, "max_wall_s", 600.0), request_timeout_s=_num(t, "request_timeout_s", 600.0),
        warmup=t.get("warmup", True), start_timeout_s=_num(t, "start_timeout_s", 180.0),
        stop_timeout_s=_num(t, "stop_timeout_s", 60.0), kvtool=_parse_kvtool(t.get("kvtool", {})),
        workloads={k: dict(v) for k, v in workloads.items()},
        cache_root=Path(cache_root).expanduser() if cache_root else None, keep_cache=t.get("keep_cache", False),
        base_dir=base_dir, raw=data,
    )  # fmt: skip


def _bad_int(value: Any, minimum: int) -> bool:
    return isinstance(value, bool) or not isinstance(value, int) or value < minimum


def _bad_num(value: Any) -> bool:
    return isinstance(value, bool) or not isinstance(value, (int, float)) or value != value


def _int(t: dict[str, Any], key: str, default: int, minimum: int) -> int:
    value = t.get(key, default)
    if _bad_int(value, minimum):
        raise ConfigError(f"{SECTION}.{key}", f"must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _num(t: dict[str, Any], key: str, default: float) -> float:
    value = t.get(key, default)
    if _bad_num(value) or value <= 0:
        raise ConfigError(f"{SECTION}.{key}", f"must be a number of seconds > 0, got {value!r}")
    return float(value)


def _parse_kvtool(table: Any) -> dict[str, Any]:
    where = f"{SECTION}.kvtool"
    if not isinstance(table, dict):
        raise ConfigError(where, "must be a table of kvtool serve cache flags")
    out: dict[str, Any] = {}
    for key, value in table.items():
        if key == "ram_bytes":
            value = size_field(f"{where}.ram_bytes", value)
            if _bad_int(value, 0):
                raise ConfigError(f"{where}.ram_bytes", f"must be a size (bytes or e.g. '64MiB'), got {value!r}")
        elif key == "block_size":
            if _bad_int(value, 1):
                raise ConfigError(f"{where}.block_size", f"must be an integer >= 1, got {value!r}")
        elif key in ("policy", "durability", "codec"):
            if not isinstance(value, str):
                raise ConfigError(f"{where}.{key}", f"must be a string, got {value!r}")
        elif key == "async":
            if not isinstance(value, bool):
                raise ConfigError(f"{where}.async", "must be true or false")
        elif key == "args":
            if not isinstance(value, list) or any(not isinstance(a, str) for a in value):
                raise ConfigError(f"{where}.args", "must be a list of strings")
        else:
            raise ConfigError(f"{where}.{key}", "unknown key; known: block_size, ram_bytes, policy, durability, "
                                                "codec, async, args")
        out[key] = value
    return out


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
                for clients in spec.clients:
                    for repeat in range(spec.repeats):
                        order = spec.servers if repeat % 2 == 0 else tuple(reversed(spec.servers))
                        for server in order:
                            run_batch(ctx, workload, clients, server, repeat)
        finally:
            write_raw(ctx.run_dir, ctx.requests, ctx.batches)
            if not spec.keep_cache:
                shutil.rmtree(cache_root, ignore_errors=True)
    doc = {
        "kind": SECTION, "run_id": run_id, "started": datetime.fromtimestamp(started, UTC).isoformat(),
        "duration_s": round(time.time() - started, 3), "config_path": str(config_path) if config_path else None,
        "config": spec.raw, "model": {"spec": spec.model, "path": model_path},
        "workloads": {w.name: {"params": w.params, "phases": list(w.phases), "measured": list(w.measured),
                               "requests": len(w.requests), "kvtool_ram_bytes": w.kvtool_ram_bytes}
                      for w in workloads},
        "git_commit": git_commit(), "machine": machine_info(cache_root), "command": " ".join(sys.argv),
    }
    (run_dir / "run.json").write_text(json.dumps(doc, indent=2, default=str) + "\n")
    report = write_load_report(run_dir)
    return LoadRun(run_dir, report.ok, report)


def build_workloads(spec: ServeLoadSpec, model_path: str) -> list[LoadWorkload]:
    """Every workload of `spec`, materialised with the tokenizer of the model at `model_path`
    (one per `[serve_load.workloads.<name>]` table, in the config's order)."""
    from mlx_lm.utils import load_tokenizer

    tokenizer = load_tokenizer(Path(model_path))
    return [build_load_workload(name, params, tokenizer, spec.seed, spec.max_tokens, model_dir=Path(model_path),
                                base_dir=spec.base_dir) for name, params in spec.workloads.items()]


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
    ctx.progress.set(f"{label}: starting the server")
    server = _start(ctx, options, log)
    agents = workload.agents.batch(server_kind, clients) if workload.agents else None  # built turn by turn
    try:
        for phase in workload.phases:
            if phase == workload.restart_before:
                ctx.progress.set(f"{label}: restarting the server")
                lives.append(_stop(server))
                server = _start(ctx, options, log)
            reqs = workload.phase_requests(phase)
            load = LoadSpec(clients=clients, arrival="trace" if workload.name == "trace" else spec.arrival,
                            rate_per_s=spec.rate, max_requests=spec.max_requests, max_wall_s=spec.max_wall_s,
                            request_timeout_s=spec.request_timeout_s, seed=spec.seed + repeat,
                            time_scale=float(workload.params.get("time_scale", 1.0)))
            before = server.kvtool_stats()

            def on_progress(done: int, total: int, phase: str = phase) -> None:
                ctx.progress.status = f"{label}: {phase} {done}/{total} requests"

            ctx.progress.set(f"{label}: {phase} 0/{min(len(reqs), spec.max_requests or len(reqs))} requests")
            result = (agents.run_phase(server.base_url, phase, load, on_progress) if agents
                      else run_load(server.base_url, reqs, load, on_progress))
            after = server.kvtool_stats()
            server.sample_rss()
            measured = phase in workload.measured
            not_sent += result.not_sent
            cut = cut or result.stopped_by == "wall"
            if measured:
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
               "error": failed_phase, **_life_facts(lives, tier if server_kind == KVTOOL else None)}
        ctx.batches.append(row)
    ctx.progress.set(f"{label}: done, TTFT p50 {row['ttft_p50_ms']:.1f} ms, {row['requests_per_s']:.2f} req/s")
    return row


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
    for key in SUMMED_COUNTERS:
        present = [c[key] for c in counters if key in c]
        out[f"kvtool_{key}"] = sum(present) if present else None
    peaks = [c["writer_queue_peak_bytes"] for c in counters if "writer_queue_peak_bytes" in c]
    out["kvtool_writer_queue_peak_bytes"] = max(peaks) if peaks else None
    out["kvtool_stats_missing"] = any(lf["stats"] is None for lf in lives)
    return out


__all__ = ["LoadRun", "Progress", "ServeLoadSpec", "build_workloads", "is_serve_load_config", "load_serve_load",
           "parse_serve_load", "run_batch", "run_serve_load"]

