"""Tests of the benchmark harness: sweep parsing, workloads, metrics, the mlx-lm baseline, the
runner (a micro sweep on the tiny model, in-process), the report and the CLI wiring."""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pandas as pd
import pytest
from mlx_lm.generate import generate_step
from typer.testing import CliRunner

from kvtool.bench import metrics, report, runner, workloads
from kvtool.bench.baseline_mlxlm import PromptCacheBaseline
from kvtool.bench.machine import git_commit, listen_overflows, machine_info
from kvtool.bench.sweep import load_sweep, parse_sweep
from kvtool.config import ConfigError, KVToolConfig
from kvtool.disk.fsops import FileOps
from kvtool.engine import Engine
from kvtool.models.loader import load_model

REPO = Path(__file__).resolve().parent.parent
BS = 32


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny")


def fake_encode(text: str) -> list[int]:
    """A deterministic toy tokenizer with a BOS: one id per byte, +1."""
    return [0] + [b + 1 for b in text.encode()]


# ------------------------------------------------------------------------------------ sweep
def test_shipped_sweeps_repeat_every_cell_at_least_three_times():
    for name in ("quick", "policies", "policies_subset"):
        assert load_sweep(REPO / "bench_configs" / f"{name}.toml").repeats >= 3, name
    assert parse_sweep({"model": "tiny", "workloads": {"restart": {}}}).repeats == 3  # the default


def test_shipped_sweeps_parse_into_full_grid():
    for name in ("quick", "policies"):
        spec = load_sweep(REPO / "bench_configs" / f"{name}.toml")
        cells = spec.cells()
        kinds = [c.kind for c in cells]
        assert kinds[:2] == ["no-cache", "mlx-lm-prompt-cache"]
        assert kinds.count("kvtool") == 12
        assert len({c.slug for c in cells}) == len(cells)
        assert set(spec.workloads) == set(workloads.WORKLOAD_NAMES)


@pytest.mark.parametrize(
    "doc, field",
    [
        ({"workloads": {"restart": {}}}, "model"),
        ({"model": "tiny", "grid": {"writer": ["sync", "later"]}, "workloads": {"restart": {}}}, "grid.writer"),
        ({"model": "tiny", "grid": {"ssd_durability": ["safe"]}, "workloads": {"restart": {}}}, "grid.ssd_durability"),
        ({"model": "tiny", "grid": {"colour": ["red"]}, "workloads": {"restart": {}}}, "grid.colour"),
        ({"model": "tiny", "cache": {"block_size": 0}, "workloads": {"restart": {}}}, "cache.block_size"),
        ({"model": "tiny", "cache": {"ssd_cache_dir": "/x"}, "workloads": {"restart": {}}}, "cache.ssd_cache_dir"),
        ({"model": "tiny", "workloads": {"restart": {"prompts": 0}}}, "workloads.restart.prompts"),
        ({"model": "tiny", "workloads": {"restart": {"promts": 2}}}, "workloads.restart.promts"),
        ({"model": "tiny", "workloads": {"chat": {}}}, "workloads.chat"),
        ({"model": "tiny"}, "workloads"),
        ({"model": "tiny", "repeats": 0, "workloads": {"restart": {}}}, "repeats"),
        ({"model": "tiny", "baselines": ["vllm"], "workloads": {"restart": {}}}, "baselines"),
    ],
)
def test_sweep_errors_name_the_field(doc, field):
    with pytest.raises(ConfigError) as info:
        parse_sweep(doc)
    assert info.value.field == field


def test_grid_axes_sizes_and_cell_configs(tmp_path):
    spec = parse_sweep({
        "model": "tiny",
        "cache": {"ram_bytes": "1MiB", "block_size": 16},
        "grid": {"ssd_policy": ["evict_only"], "writer": ["async"], "ram_bytes": ["1MiB", 3 << 20]},
        "workloads": {"shared-prefix": {}},
    })
    cells = [c for c in spec.cells() if c.kind == "kvtool"]
    assert [c.name for c in cells] == ["evict_only/async/best_effort/ram1M", "evict_only/async/best_effort/ram3M"]
    cfg = cells[1].config(spec.base_config(tmp_path), tmp_path / "c")
    assert (cfg.ram_bytes, cfg.ssd_async_writes, cfg.block_size, cfg.ssd_cache_dir) == (3 << 20, True, 16, tmp_path / "c")
    nocache = spec.cells()[0].config(spec.base_config(tmp_path), tmp_path / "n")
    assert (nocache.ssd_enabled, nocache.ram_bytes) == (False, 0)


# -------------------------------------------------------------------------------- workloads
CTX = workloads.WorkloadContext(kv_bytes_per_token=1024, ram_bytes=64 * 1024)


def build(name, **params):
    return workloads.build_workload(name, params, fake_encode, seed=3, ctx=CTX)


def test_workloads_are_deterministic_and_seed_dependent():
    a = build("long-doc-qa", documents=3, doc_tokens=64, queries=5)
    assert a == build("long-doc-qa", documents=3, doc_tokens=64, queries=5)
    b = workloads.build_workload("long-doc-qa", dict(documents=3, doc_tokens=64, queries=5), fake_encode, 4, CTX)
    assert a.requests[0].ids != b.requests[0].ids


def test_shared_prefix_and_multi_turn_shapes():
    sp = build("shared-prefix", requests=4, system_tokens=100, question_tokens=10)
    ids = [r.ids for r in sp.requests]
    assert all(len(i) == 1 + 110 and i[:101] == ids[0][:101] for i in ids)  # BOS + system shared
    assert len({i[101:] for i in ids}) == 4  # distinct questions
    mt = build("multi-turn", conversations=2, turns=3, system_tokens=20, user_tokens=5, assistant_tokens=7)
    conv0 = [r.ids for r in mt.requests if r.group == "conv0"]
    assert [len(i) for i in conv0] == [1 + 20 + 5, 1 + 20 + 5 + 7 + 5, 1 + 20 + 2 * 12 + 5]
    assert all(later[: len(earlier)] == earlier for earlier, later in zip(conv0, conv0[1:]))
    assert [r.group for r in mt.requests][:2] == ["conv0", "conv1"]  # interleaved


def test_long_doc_qa_restart_and_ram_pressure_shapes():
    qa = build("long-doc-qa", documents=2, doc_tokens=40, question_tokens=4, queries=6)
    assert [r.phase for r in qa.requests] == ["warmup"] * 2 + ["query"] * 6
    docs = {r.group: r.ids[:41] for r in qa.requests if r.phase == "warmup"}
    assert all(r.ids[:41] == docs[r.group] for r in qa.requests)
    assert docs["doc0"][1:3] != docs["doc1"][1:3]  # unique document headers up front

    rs = build("restart", prompts=3, prompt_tokens=30)
    kinds = [type(s).__name__ for s in rs.steps]
    assert kinds == ["Request"] * 3 + ["Restart", "DropPageCache"] + ["Request"] * 3
    assert sorted(r.ids for r in rs.requests[3:]) == sorted(r.ids for r in rs.requests[:3])
    assert rs.measured_phases == ("replay",)

    params = workloads.validate_params("ram-pressure", {"working_set_factor": 3.0, "doc_tokens": 16})
    n = workloads.ram_pressure_documents(params, CTX)
    assert n == 12  # 3 x 64 KiB / (16 tokens x 1 KiB)
    rp = build("ram-pressure", working_set_factor=3.0, doc_tokens=16, requests=40)
    assert len({r.group for r in rp.requests if r.phase == "populate"}) == n
    counts = pd.Series([r.group for r in rp.requests if r.phase == "query"]).value_counts()
    assert counts.iloc[0] > counts.iloc[-1]  # Zipf: a few documents dominate


# ---------------------------------------------------------------------------------- metrics
def synthetic_requests() -> pd.DataFrame:
    rows = []
    for cell, kind, ttft in (("no-cache", "no-cache", 100.0), ("mlx", "mlx-lm-prompt-cache", 40.0), ("a", "kvtool", 20.0)):
        for i, (phase, t) in enumerate([("warmup", 2 * ttft), ("query", ttft), ("query", ttft / 2)]):
            ids = {"workload": "long-doc-qa", "cell": cell, "kind": kind, "ssd_policy": None, "writer": None,
                   "ssd_durability": None, "block_size": 16, "ram_bytes": 0, "repeat": 0, "request": i,
                   "phase": phase, "group": "d0", "measured": phase == "query"}
            hit = 0 if kind == "no-cache" or phase == "warmup" else 64
            res = type("R", (), dict(prompt_tokens=80, cached_tokens=hit, ram_hit_tokens=hit // 4,
                                     ssd_hit_tokens=hit - hit // 4, prefill_tokens=80 - hit, ttft_ms=t,
                                     write_path_ms=1.0, blocks_written=1))
            rows.append(metrics.request_row(ids, res))
    return metrics.requests_frame(rows)


def test_aggregate_cells_columns_and_values():
    req = synthetic_requests()
    assert list(req.columns) == metrics.REQUEST_COLUMN_NAMES
    runs = pd.DataFrame([{"workload": "long-doc-qa", "cell": c, "bytes_written": 2048, "tokens_stored": 64,
                          "shutdown_clean": True, "drain_verified": None, "page_cache_dropped": None, "wall_s": 1.0}
                         for c in ("no-cache", "mlx", "a")])
    cells = metrics.aggregate_cells(req, runs, kv_bytes_per_token=16)
    assert list(cells.columns) == metrics.CELL_COLUMN_NAMES
    cells = cells.set_index("cell")
    a = cells.loc["a"]
    assert a["requests"] == 2 and a["ttft_p50_ms"] == pytest.approx(15.0)
    assert a["ram_hit_rate"] == pytest.approx(16 / 80) and a["ssd_hit_rate"] == pytest.approx(48 / 80)
    assert a["prefill_saved_pct"] == pytest.approx(100 * 128 / 240)
    assert a["ttft_gain"] == pytest.approx(40 / 15)
    assert a["ttft_vs_no_cache"] == pytest.approx(75 / 15) and a["ttft_vs_mlxlm"] == pytest.approx(30 / 15)
    assert a["write_amplification"] == pytest.approx(2.0)  # 2048 B / 64 tokens / 16 B per token
    assert cells.loc["no-cache", "hit_rate"] == 0


# ----------------------------------------------------------------------- mlx-lm baseline
def greedy(model, ids, n):
    return [int(t) for t, _ in generate_step(mx.array(ids), model, max_tokens=n)]


def test_prompt_cache_baseline_reuses_longest_prefix_and_survives_restart(tiny, tmp_path):
    rng = np.random.default_rng(0)
    prompt = [int(x) for x in rng.integers(10, 200, size=120)]
    other = prompt[:90] + [int(x) for x in rng.integers(10, 200, size=20)]
    base = PromptCacheBaseline(tiny.model, tmp_path)
    first = base.generate(prompt, max_tokens=5)
    assert first.cached_tokens == 0 and first.token_ids == greedy(tiny.model, prompt, 5)
    second = base.generate(other, max_tokens=5)  # trimmed to the 90-token common prefix
    assert second.cached_tokens == 90 and second.prefill_tokens == 20 and second.ssd_bytes_read > 0
    assert second.token_ids == greedy(tiny.model, other, 5)
    restarted = PromptCacheBaseline(tiny.model, tmp_path)  # rescans the files' metadata
    assert len(restarted.files) == 2
    again = restarted.generate(prompt, max_tokens=5)
    assert again.cached_tokens == len(prompt) - 1 and again.token_ids == first.token_ids


# --------------------------------------------------------------------------------- runner
MICRO = {
    "name": "micro",
    "model": "tiny",
    "seed": 1,
    "repeats": 2,
    "max_tokens": 2,
    "baselines": ["no-cache"],
    "keep_cache": True,
    "cache": {"block_size": BS, "ram_bytes": "1MiB"},
    "grid": {"ssd_policy": ["write_through"], "writer": ["async"], "ssd_durability": ["best_effort"]},
    "workloads": {
        "shared-prefix": {"requests": 2, "system_tokens": 2 * BS, "question_tokens": 4},
        "restart": {"prompts": 2, "prompt_tokens": 2 * BS, "question_tokens": 4},
    },
}


def parked(tmp_path) -> KVToolConfig:
    return KVToolConfig(ssd_cache_dir=tmp_path / "unused", ssd_enabled=False, ram_bytes=0, block_size=BS)


@pytest.fixture(scope="module")
def micro_run(tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    engine = Engine(tiny, parked(out))
    try:
        return runner.run_sweep(parse_sweep(MICRO), out, run_id="micro", engine=engine, progress=False)
    finally:
        engine.close()


@pytest.mark.slow
def test_micro_sweep_writes_documented_files(micro_run):
    run_dir = micro_run.run_dir
    cells = pd.read_csv(run_dir / "cells.csv")
    assert list(cells.columns) == metrics.CELL_COLUMN_NAMES
    assert list(pd.read_csv(run_dir / "requests.csv").columns) == metrics.REQUEST_COLUMN_NAMES
    assert sorted(cells["cell"].unique()) == ["no-cache", "write_through/async/best_effort"]
    assert (cells["repeats"] == 2).all()
    run = json.loads((run_dir / "run.json").read_text())
    assert run["sweep"]["name"] == "micro" and run["machine"]["cpu_cores"] >= 1
    assert run["page_cache_drop"]["attempts"] == 4 and "ok" in run["page_cache_drop"]
    for name in ["report.md", *report.CHARTS]:
        assert (run_dir / name).stat().st_size > 0


@pytest.mark.slow
def test_restart_shows_ssd_hits_and_no_cache_none(micro_run):
    req = micro_run.requests
    replay = req[(req["workload"] == "restart") & (req["phase"] == "replay")]
    kv = replay[replay["kind"] == "kvtool"]
    # a replay is a full hit (tail entries): every prompt token but the re-forwarded last one
    assert (kv["ssd_hit_tokens"] == kv["prompt_tokens"] - 1).all() and (kv["ram_hit_tokens"] == 0).all()
    assert (req.loc[req["kind"] == "no-cache", ["cached_tokens", "ssd_hit_tokens", "ram_hit_tokens"]] == 0).all().all()
    cell = micro_run.cells.set_index(["workload", "cell"]).loc[("restart", "write_through/async/best_effort")]
    assert cell["ssd_hit_rate"] > 0 and cell["shutdown_clean"] and cell["drain_verified"]


@pytest.mark.slow
def test_cells_never_share_blocks(micro_run):
    req = micro_run.requests
    first = req.sort_values("request").groupby(["workload", "cell", "repeat"]).head(1)
    assert (first["cached_tokens"] == 0).all()  # every cell run starts from an empty namespace
    cache_root = micro_run.run_dir / "cache"
    run_dirs = sorted(p.parent for p in cache_root.glob("*/*/r*/*/index.sqlite"))
    assert len(run_dirs) == 4  # 2 workloads x 1 kvtool cell x 2 repeats
    for d in run_dirs:
        scan = runner.scan_cache_dir(d.parent)
        assert scan["index_rows"] > 0 and scan["segment_files"] == scan["segment_rows"] > 0


class GatedFileOps(FileOps):
    """Block writes hold until `gate` is set: writes pile up in the async writer's queue."""

    def __init__(self) -> None:
        self.gate = threading.Event()

    def write_all(self, fd, data) -> None:
        assert self.gate.wait(60), "test gate never opened"
        super().write_all(fd, data)


def test_reconfigure_between_cells_loses_no_queued_write(tiny, tmp_path):
    fs = GatedFileOps()
    cfg = KVToolConfig(ssd_cache_dir=tmp_path / "cell1", block_size=BS, ssd_async_writes=True)
    engine = Engine(tiny, cfg, fs=fs)
    ids = [int(x) for x in np.random.default_rng(1).integers(10, 200, size=6 * BS + 3)]
    res = engine.generate(ids, max_tokens=2)
    assert res.blocks_written == 7  # 6 full blocks + the tail entry
    assert engine.tiered.writer.get_stats()["writer_pending"] == 7  # writes are queued, not done
    tier = engine.tiered
    close = tier.close

    def open_gate_then_close(*args, **kwargs):  # the writer resumes only once the drain has begun
        fs.gate.set()
        return close(*args, **kwargs)

    tier.close = open_gate_then_close
    status, counters = runner._switch(engine, cfg.replace(ssd_cache_dir=tmp_path / "cell2"))
    engine.close()
    disk = runner.scan_cache_dir(tmp_path / "cell1")
    assert status.shutdown_clean and counters["writer_save_success"] == 7
    assert disk["index_rows"] == 7 and disk["segment_files"] == disk["segment_rows"] == 1
    assert runner.verify_drain(counters, disk)
    assert not runner.verify_drain({**counters, "writer_save_success": 6}, disk)
    # a block the SSD byte budget refused was attempted too (not stored, not a failure)
    assert runner.verify_drain({**counters, "writer_save_success": 6, "writer_budget_refused": 1},
                               {**disk, "index_rows": 6})


@pytest.mark.slow
def test_report_regenerates_from_run_dir(micro_run):
    run_dir = micro_run.run_dir
    for name in ["report.md", *report.CHARTS]:
        (run_dir / name).unlink()
    written = report.write_report(run_dir)
    assert written.markdown.read_text().count("write_through/async/best_effort") >= 2
    assert all(p.exists() for p in written.charts)


def test_drop_page_cache_reports_files(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x.safetensors").write_bytes(b"0" * 4096)
    (tmp_path / "a" / ".x.1.tmp.safetensors").write_bytes(b"0")
    result = runner.drop_page_cache(tmp_path)
    assert result["files"] == 1 and result["ok"] is True and result["error"] is None


@pytest.mark.skipif(listen_overflows() is None, reason="the OS does not count listen-queue overflows")
def test_listen_overflows_counts_connections_a_full_accept_queue_drops():
    """A real listening socket that never accepts, with a backlog of 0 (Linux queues 1): the
    connections beyond the queue are dropped by the kernel, and the host's counter grows."""

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(0)
    clients = []
    try:
        before = listen_overflows()
        assert before is not None
        deadline = time.monotonic() + 5.0
        while listen_overflows() == before and time.monotonic() < deadline:
            client = socket.socket()
            client.setblocking(False)
            client.connect_ex(server.getsockname())
            clients.append(client)
            time.sleep(0.02)
        after = listen_overflows()
        assert after is not None and after > before, "no drop counted with the accept queue full"
    finally:
        for client in clients:
            client.close()
        server.close()


def test_machine_info_describes_cache_disk(tmp_path):
    info = machine_info(tmp_path / "not" / "yet")
    assert info["cpu_cores"] >= 1 and info["versions"]["mlx-lm"]
    assert info["cache_disk"]["path"] == str(tmp_path.resolve())
    commit = git_commit()
    assert commit is None or len(commit) == 40


# ------------------------------------------------------------------------------------ CLI
def cli():
    from kvtool.cli.app import _register, app

    _register()
    return app


def test_cli_help_has_examples_and_bad_sweep_names_field(tmp_path):
    app = cli()
    runner_ = CliRunner()
    for command in ("bench", "report"):
        result = runner_.invoke(app, [command, "--help"])
        assert result.exit_code == 0 and "Examples" in result.output
    bad = tmp_path / "bad.toml"
    bad.write_text('model = "tiny"\n[grid]\nwriter = ["soon"]\n[workloads.restart]\n')
    result = runner_.invoke(app, ["bench", str(bad)])
    assert result.exit_code == 2 and "grid.writer" in result.output
    result = runner_.invoke(app, ["report", str(tmp_path / "missing")])
    assert result.exit_code == 2


@pytest.mark.slow
def test_cli_report_json(micro_run):
    result = CliRunner().invoke(cli(), ["report", str(micro_run.run_dir), "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["ok"] is True and {w["workload"] for w in doc["winners"]} == {"shared-prefix", "restart"}
    for w in doc["winners"]:  # one kvtool cell in MICRO: nothing to beat, but its range is stated
        assert w["verdict"] == "only cell" and w["repeats"] == 2
        assert w["ttft_p50_ms_lo"] <= w["ttft_p50_ms"] <= w["ttft_p50_ms_hi"]


@pytest.mark.slow
def test_micro_sweep_cells_carry_ranges_over_the_repeats(micro_run):
    cells = micro_run.cells
    for name in metrics.SPREAD_METRICS:
        lo, mid, hi = cells[f"{name}_min"], cells[name], cells[f"{name}_max"]
        ok = lo.isna() | ((lo <= mid + 1e-9) & (mid <= hi + 1e-9))
        assert ok.all(), name
    stats = metrics.repeat_stats(micro_run.requests)
    assert len(stats) == 2 * 2 * 2  # workloads x cells x repeats
    kv = cells.set_index(["workload", "cell"]).loc[("restart", "write_through/async/best_effort")]
    per_repeat = stats[(stats["workload"] == "restart") & (stats["cell"] == "write_through/async/best_effort")]
    assert kv["ttft_p50_ms_min"] == per_repeat["ttft_p50_ms"].min()
    assert kv["ttft_p50_ms_max"] == per_repeat["ttft_p50_ms"].max()
