"""Prometheus metrics (`kvtool.prom`): the collector on a stats dict, `serve-once --metrics-file`,
and `GET /metrics` of a real `kvtool serve` scraped after requests served from RAM and from SSD.

Every exposition is read back with prometheus_client's own parser
(`text_string_to_metric_families`), and the values are compared with the counters kvtool reports
elsewhere (`serve-once --json`, `GET /kvtool/stats`).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from kvtool.prom import REQUEST_METRICS, STATS_METRICS, CacheMetrics, build_families, metrics_of_run, request_totals

REPO = Path(__file__).resolve().parent.parent
DEMO = (REPO / "kvtool" / "assets" / "demo_prompt.txt").read_text()
NAME = re.compile(r"^kvtool_[a-z][a-z0-9_]*$")


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """(sample name, sorted labels) -> value of an exposition, parsed by prometheus_client."""
    out = {}
    for family in text_string_to_metric_families(text):
        assert NAME.match(family.name) and family.documentation, family
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(parsed: dict, name: str, **labels: str) -> float:
    return parsed[(name, tuple(sorted(labels.items())))]


def tiers(parsed: dict, name: str) -> dict[str, float]:
    return {dict(labels)["tier"]: v for (n, labels), v in parsed.items() if n == name}


# --------------------------------------------------------------------------- collector (fast)
STATS = {
    "kv_lookup_hits": 5, "kv_lookup_miss": 2, "kv_ram_evictions": 3, "kv_ram_evicted_bytes": 3000,
    "kv_ram_inserts": 9, "kv_ram_blocks": 4, "kv_ram_bytes": 4096, "kv_pending_hits": 1, "kv_promote_hits": 2,
    "ssd_load_hits": 6, "ssd_load_miss": 1, "ssd_bytes_read": 60000, "ssd_bytes_written": 90000,
    "ssd_save_success": 9, "ssd_load_corrupt": 1, "ssd_hash_collision_detected": 1, "writer_collision": 0,
    "writer_pending_bytes": 512, "writer_queue_depth": 1, "writer_shed_blocks": 2, "writer_shed_bytes": 2048,
    "writer_enqueue_rejected": 0, "writer_save_fail": 1, "writer_budget_refused": 3,
    "remote_lookups": 4, "remote_hit_blocks": 3, "remote_bytes_read": 3000, "remote_bytes_written": 7000,
    "remote_corrupt": 1, "remote_dropped_writes": 2, "remote_writer_queue_bytes": 100, "remote_breaker_open": 0,
    "remote_something_new": 11,
    "ssd_budget_evictions": 2, "ssd_budget_evicted_bytes": 81920, "ssd_budget_evicted_blocks": 8, "ssd_budget_refused": 3,
}  # fmt: skip
RECORDS = [
    {"prompt_tokens": 100, "cached_tokens": 64, "ram_hit_tokens": 0, "ssd_hit_tokens": 64, "prefill_tokens": 36,
     "ssd_load_ms": 3.0},
    {"prompt_tokens": 120, "cached_tokens": 99, "ram_hit_tokens": 64, "ssd_hit_tokens": 0, "remote_hit_tokens": 35,
     "prefill_tokens": 21, "ssd_load_ms": 0.0, "remote_load_ms": 40.0},
]  # fmt: skip


def test_collector_maps_every_counter_once():
    parsed = samples(metrics_of_run(STATS, RECORDS).text().decode())
    assert value(parsed, "kvtool_requests_total") == 2
    assert value(parsed, "kvtool_prompt_tokens_total") == 220
    assert tiers(parsed, "kvtool_hit_tokens_total") == {"ram": 64, "ssd": 64, "remote": 35}
    assert value(parsed, "kvtool_prefill_tokens_total") == 57
    assert tiers(parsed, "kvtool_read_bytes_total") == {"ssd": 60000, "remote": 3000}
    assert tiers(parsed, "kvtool_written_bytes_total") == {"ssd": 90000, "remote": 7000}
    assert tiers(parsed, "kvtool_hit_blocks_total") == {"pending": 1, "ssd": 6, "remote": 3}
    assert tiers(parsed, "kvtool_writer_queue_bytes") == {"ssd": 512, "remote": 100}
    assert value(parsed, "kvtool_dropped_writes_total", tier="ssd", reason="shed") == 2
    assert value(parsed, "kvtool_dropped_writes_total", tier="ssd", reason="over_budget") == 3  # not "failed"
    assert value(parsed, "kvtool_dropped_writes_total", tier="ssd", reason="failed") == 1
    assert value(parsed, "kvtool_dropped_writes_total", tier="remote", reason="dropped") == 2
    assert tiers(parsed, "kvtool_evictions_total") == {"ram": 3, "ssd": 8}  # ssd: the byte budget's, in blocks
    assert tiers(parsed, "kvtool_evicted_bytes_total") == {"ram": 3000, "ssd": 81920}
    assert value(parsed, "kvtool_evicted_segments_total") == 2
    assert value(parsed, "kvtool_ssd_budget_refused_blocks_total") == 3
    assert tiers(parsed, "kvtool_corrupt_records_total") == {"ssd": 1, "remote": 1}
    assert value(parsed, "kvtool_hash_collisions_total", tier="ssd", op="load") == 1
    assert value(parsed, "kvtool_ram_bytes") == 4096
    assert value(parsed, "kvtool_remote_something_new") == 11  # a remote counter kvtool.prom does not name
    # the restore histogram: one SSD restore of 3 ms, one remote restore of 40 ms
    assert value(parsed, "kvtool_restore_seconds_count", tier="ssd") == 1
    assert value(parsed, "kvtool_restore_seconds_bucket", tier="ssd", le="0.005") == 1
    assert value(parsed, "kvtool_restore_seconds_bucket", tier="ssd", le="0.0025") == 0
    assert value(parsed, "kvtool_restore_seconds_sum", tier="remote") == pytest.approx(0.04)
    # the per-request token histograms: prompts of 100 and 120 tokens, 64 and 99 of them cached
    assert (value(parsed, "kvtool_request_prompt_tokens_count"), value(parsed, "kvtool_request_prompt_tokens_sum")) \
        == (2, 220)
    assert value(parsed, "kvtool_request_prompt_tokens_bucket", le="64.0") == 0
    assert value(parsed, "kvtool_request_cached_tokens_bucket", le="64.0") == 1
    assert value(parsed, "kvtool_request_cached_tokens_sum") == 163
    assert value(parsed, "kvtool_time_to_first_token_seconds_count") == 0  # the records have no ttft_ms


def test_request_timing_histograms():
    metrics = CacheMetrics(lambda: ({}, {}))
    metrics.observe_timing(0.02, 0.3)
    metrics.observe_timing(None, 1.5)  # no token generated: a duration only
    parsed = samples(metrics.text().decode())
    assert value(parsed, "kvtool_time_to_first_token_seconds_count") == 1
    assert value(parsed, "kvtool_time_to_first_token_seconds_bucket", le="0.025") == 1
    assert value(parsed, "kvtool_time_to_first_token_seconds_bucket", le="0.01") == 0
    assert value(parsed, "kvtool_request_duration_seconds_count") == 2
    assert value(parsed, "kvtool_request_duration_seconds_sum") == pytest.approx(1.8)
    assert value(parsed, "kvtool_request_duration_seconds_bucket", le="1.0") == 1


def test_specs_count_nothing_twice():
    # each stats key feeds one sample at most: nothing is counted twice
    keys = [key for spec in STATS_METRICS for _, key in spec.sources]
    assert len(keys) == len(set(keys))
    assert all(spec.kind in ("counter", "gauge") and spec.help.endswith(".") for spec in REQUEST_METRICS + STATS_METRICS)


def test_no_remote_series_without_a_remote_tier_and_a_private_registry():
    local = {k: v for k, v in STATS.items() if not k.startswith("remote_")}
    totals = request_totals(RECORDS)
    names = {(s.name, tuple(sorted(s.labels.items()))) for f in build_families(local, totals) for s in f.samples}
    assert not [n for n in names if "remote" in n[0] or ("tier", "remote") in n[1]]
    metrics = CacheMetrics(lambda: (local, totals))
    assert b"kvtool_hit_tokens_total" in metrics.text()
    assert REGISTRY.get_sample_value("kvtool_requests_total") is None  # never the global registry
    body, content_type = metrics.encode("application/openmetrics-text; version=1.0.0")
    assert content_type.startswith("application/openmetrics-text") and body.rstrip().endswith(b"# EOF")


# --------------------------------------------------------------------------- serve-once --metrics-file
def kvtool(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvtool.cli.app", *args], capture_output=True, text=True, cwd=REPO,
                          timeout=300, env={**os.environ, **(env or {})})


@pytest.mark.slow
def test_serve_once_metrics_file(tmp_path):
    prompt = tmp_path / "doc.txt"
    prompt.write_text(DEMO[:1500])
    docs, parsed = [], []
    for run in ("first", "second"):
        out = tmp_path / f"{run}.prom"
        res = kvtool("serve-once", "--json", "-f", str(prompt), "-n", "4", "--cache-dir", str(tmp_path / "kv"),
                     "--sync", "--metrics-file", str(out))
        assert res.returncode == 0, res.stderr
        docs.append(json.loads(res.stdout))
        parsed.append(samples(out.read_text()))
        assert not list(tmp_path.glob(f"{run}.prom.*"))  # the temp file was renamed into place
    first, second = parsed
    st1, st2 = docs[0]["stats"], docs[1]["stats"]
    assert tiers(first, "kvtool_written_bytes_total")["ssd"] == st1["ssd_bytes_written"] > 0
    assert tiers(first, "kvtool_hit_tokens_total") == {"ram": 0, "ssd": 0}
    (req,) = docs[1]["requests"]
    assert tiers(second, "kvtool_hit_tokens_total") == {"ram": req["ram_hit_tokens"], "ssd": req["ssd_hit_tokens"]}
    assert req["ssd_hit_tokens"] > 0
    assert tiers(second, "kvtool_read_bytes_total")["ssd"] == st2["ssd_bytes_read"] > 0
    assert value(second, "kvtool_restore_seconds_count", tier="ssd") == 1
    assert value(second, "kvtool_prompt_tokens_total") == req["prompt_tokens"]


@pytest.mark.slow
def test_serve_once_metrics_file_counts_the_ssd_budget_evictions(tmp_path):
    """A `serve-once` with a small `--ssd-max-bytes` on a cache a first run (no budget) filled past
    it: the byte budget's evictions in its metrics file are the `ssd_budget_*` counters of its
    stats, and > 0."""
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau".split()
    rng = np.random.default_rng(3)
    runs = []
    for name, n, budget in (("fill", 16, []), ("budget", 4, ["--ssd-max-bytes", str(1 << 20)])):
        requests = tmp_path / f"{name}.jsonl"  # ~170 tokens each: 2 blocks and a tail, ~150 KiB a segment (tiny's KV)
        requests.write_text("".join(json.dumps({"prompt": " ".join(rng.choice(words, 120).tolist())}) + "\n" for _ in range(n)))
        out = tmp_path / f"{name}.prom"
        res = kvtool("serve-once", "--json", "--requests", str(requests), "--max-tokens", "1", "--cache-dir",
                     str(tmp_path / "kv"), "--ram-bytes", "0", "--sync", *budget, "--metrics-file", str(out))  # fmt: skip
        assert res.returncode == 0, res.stderr[-2000:]
        runs.append((json.loads(res.stdout)["stats"], samples(out.read_text())))
        if name == "fill":
            time.sleep(3.5)  # past the budget's protection of recently used segments (3 s)
    (st0, _), (st, parsed) = runs
    assert st0["ssd_bytes_written"] > 2 << 20
    assert tiers(parsed, "kvtool_evictions_total")["ssd"] == st["ssd_budget_evicted_blocks"] > 0
    assert tiers(parsed, "kvtool_evicted_bytes_total")["ssd"] == st["ssd_budget_evicted_bytes"] > 0
    assert value(parsed, "kvtool_evicted_segments_total") == st["ssd_budget_evictions"] > 0
    assert value(parsed, "kvtool_ssd_budget_refused_blocks_total") == st["ssd_budget_refused"]
    assert value(parsed, "kvtool_dropped_writes_total", tier="ssd", reason="over_budget") == st["writer_budget_refused"]


@pytest.mark.slow
def test_metrics_file_in_a_missing_directory_is_one_error_line(tmp_path):
    res = kvtool("serve-once", "-p", "hi", "--cache-dir", str(tmp_path), "--metrics-file", str(tmp_path / "no" / "m.prom"))
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: --metrics-file"), res.stderr


@pytest.mark.slow
def test_metrics_file_in_a_read_only_directory_is_refused_before_the_run(tmp_path, read_only_dir):
    """Checked before any work: a failure at the end lost the run's result."""
    ro = read_only_dir
    res = kvtool("serve-once", "-p", "hi", "--cache-dir", str(tmp_path / "kv"), "--json", "--metrics-file", str(ro / "m.prom"))
    assert res.returncode == 2 and res.stdout == "", res.stderr
    assert res.stderr.strip() == f"error: --metrics-file {ro / 'm.prom'}: cannot write in {ro}"
    assert not (tmp_path / "kv").exists()  # no work done


# --------------------------------------------------------------------------- GET /metrics of kvtool serve
@pytest.mark.slow
def test_serve_metrics_after_requests_from_ram_and_ssd(tmp_path):
    from tests.test_serve_http import client, conversation, start_kvtool, stats

    first = start_kvtool(tmp_path, "first", "--sync")
    try:
        reply = client(first).chat.completions.create(model="default_model", messages=conversation([], 0),
                                                      max_tokens=8, temperature=0.0)
    finally:
        assert first.stop() == 143
    proc = start_kvtool(tmp_path, "second", "--sync")  # a new process: the first turn's blocks are on SSD only
    try:
        c, usages, walls = client(proc), [], []
        for messages in (conversation([], 0), conversation([reply.choices[0].message.content], 1)):  # 2nd: RAM hit
            t0 = time.perf_counter()
            usages.append(c.chat.completions.create(model="default_model", messages=messages, max_tokens=8,
                                                    temperature=0.0).usage)
            walls.append(time.perf_counter() - t0)
        with urllib.request.urlopen(proc.url + "/metrics", timeout=30) as r:
            assert r.headers["Content-Type"].startswith("text/plain")
            parsed = samples(r.read().decode())
        doc = stats(proc)
    finally:
        proc.stop()
    counts, tier_stats = doc["adapter"], doc["cache"]
    hits = tiers(parsed, "kvtool_hit_tokens_total")
    assert hits == {"ram": counts["ram_hit_tokens"], "ssd": counts["ssd_hit_tokens"]}
    assert hits["ram"] > 0 and hits["ssd"] > 0
    assert value(parsed, "kvtool_requests_total") == counts["requests"] == 2
    assert tiers(parsed, "kvtool_read_bytes_total") == {"ssd": tier_stats["ssd_bytes_read"]}
    assert tiers(parsed, "kvtool_read_bytes_total")["ssd"] > 0
    assert tiers(parsed, "kvtool_written_bytes_total")["ssd"] == tier_stats["ssd_bytes_written"] > 0  # the 2nd turn
    assert value(parsed, "kvtool_ram_bytes") == tier_stats["kv_ram_bytes"] > 0
    assert value(parsed, "kvtool_restore_seconds_count", tier="ssd") == 1
    assert value(parsed, "kvtool_writer_queue_bytes", tier="ssd") == 0  # --sync: nothing queued
    # the per-request histograms: one observation per request, sums as the answers' usage says
    hist = {n: (value(parsed, f"kvtool_{n}_count"), value(parsed, f"kvtool_{n}_sum"))
            for n in ("request_prompt_tokens", "request_cached_tokens", "time_to_first_token_seconds",
                      "request_duration_seconds")}  # fmt: skip
    assert hist["request_prompt_tokens"] == (2, sum(u.prompt_tokens for u in usages))
    assert hist["request_cached_tokens"] == (2, sum(u.prompt_tokens_details.cached_tokens for u in usages))
    assert hist["request_cached_tokens"][1] == hits["ram"] + hits["ssd"]
    (ttft_n, ttft_s), (dur_n, dur_s) = hist["time_to_first_token_seconds"], hist["request_duration_seconds"]
    assert ttft_n == dur_n == 2 and 0 < ttft_s <= dur_s <= sum(walls)
    assert value(parsed, "kvtool_request_duration_seconds_bucket", le="+Inf") == 2
    assert value(parsed, "kvtool_request_prompt_tokens_bucket", le="16.0") == 0  # both prompts are longer


# --------------------------------------------------------------------------- bench --metrics-file
MICRO_SWEEP = """
model = "tiny"
seed = 1
repeats = 1
max_tokens = 2
baselines = ["no-cache"]

[cache]
block_size = 16
ram_bytes = "1MiB"

[grid]
ssd_policy = ["write_through"]
writer = ["sync"]
ssd_durability = ["best_effort"]

[workloads.restart]
prompts = 2
prompt_tokens = 32
question_tokens = 4
"""


@pytest.mark.slow
def test_bench_metrics_file_sums_the_kvtool_cells(tmp_path):
    import pandas as pd

    sweep = tmp_path / "micro.toml"
    sweep.write_text(MICRO_SWEEP)
    out = tmp_path / "bench.prom"
    with open(tmp_path / "bench.err", "w") as err:  # not a terminal: progress lines, also with --json
        res = subprocess.run([sys.executable, "-m", "kvtool.cli.app", "bench", str(sweep), "--out", str(tmp_path),
                              "--json", "--metrics-file", str(out)], stdout=subprocess.PIPE, stderr=err, text=True,
                             cwd=REPO, timeout=600, env={**os.environ, "KVTOOL_PROGRESS_INTERVAL_S": "0"})
    assert res.returncode == 0, (tmp_path / "bench.err").read_text()
    run_dir = Path(json.loads(res.stdout)["run_dir"])
    rows = pd.read_csv(run_dir / "requests.csv")
    rows = rows[rows["kind"] == "kvtool"]
    runs = [r for r in json.loads((run_dir / "run.json").read_text())["cell_runs"] if r["kind"] == "kvtool"]
    parsed = samples(out.read_text())
    assert value(parsed, "kvtool_requests_total") == len(rows)
    assert tiers(parsed, "kvtool_hit_tokens_total") == {"ram": rows["ram_hit_tokens"].sum(),
                                                        "ssd": rows["ssd_hit_tokens"].sum()}
    assert rows["ssd_hit_tokens"].sum() > 0  # the restart workload replays from SSD
    assert tiers(parsed, "kvtool_written_bytes_total")["ssd"] == sum(r["counters"]["ssd_bytes_written"] for r in runs) > 0
    assert value(parsed, "kvtool_restore_seconds_count", tier="ssd") == (rows["ssd_hit_tokens"] > 0).sum()
    assert value(parsed, "kvtool_time_to_first_token_seconds_count") == len(rows)
    assert value(parsed, "kvtool_time_to_first_token_seconds_sum") == pytest.approx(rows["ttft_ms"].sum() / 1e3)
    assert value(parsed, "kvtool_request_prompt_tokens_sum") == rows["prompt_tokens"].sum()
    assert "[kvtool bench " in (tmp_path / "bench.err").read_text()
