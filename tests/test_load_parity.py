"""The parity benchmark: `cold-burst`, `multi-turn` openings and restarts, `mlx-lm-1000`, the parity table.

Fast tests build the workloads with the tiny model's tokenizer (distinct prompts, lengths within
their range, deterministic by seed, the phase split around the restart), check the config errors
and the parity targets on hand-made rows. The slow ones start real servers: `mlx_lm.server
--prompt-cache-size 1000` read back from its command line, and one small `kvtool bench` run with
kvtool and both mlx-lm servers through the CLI. No timing assertions.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

from kvtool.bench.loadconfig import load_serve_load, parse_serve_load
from kvtool.bench.loadparity import (
    parity_frame,
    parity_markdown,
    parity_summary,
    parity_target,
    phase_figures,
    target_met,
)
from kvtool.bench.loadpooled import pooled_groups, pooled_ratio, pooled_verdict
from kvtool.bench.loadserver import MLXLM, MLXLM_1000, ManagedServer, ServerOptions
from kvtool.bench.loadworkloads import build_load_workload, opening_tokens, validate_load_params
from kvtool.config import ConfigError
from kvtool.models.loader import resolve_spec

REPO = Path(__file__).resolve().parent.parent
TURNS = {"turns": 6, "restart_after": 3, "system_tokens": 150, "system_tokens_max": 300, "user_tokens": 8,
         "assistant_tokens": 8, "ram_bytes": "64MiB"}


@pytest.fixture(scope="module")
def tokenizer():
    from mlx_lm.utils import load_tokenizer

    return load_tokenizer(resolve_spec("tiny")[0])


# ------------------------------------------------------------------------------------ cold-burst
def test_cold_burst_prompts_are_distinct_sized_and_seeded(tokenizer):
    params = {"prompts_per_client": 2, "prompt_tokens": 200}
    w = build_load_workload("cold-burst", params, tokenizer, seed=1, max_tokens=4, max_clients=16)
    assert w == build_load_workload("cold-burst", params, tokenizer, seed=1, max_tokens=4, max_clients=16)
    other = build_load_workload("cold-burst", params, tokenizer, seed=2, max_tokens=4, max_clients=16)
    assert [r.messages for r in w.requests] != [r.messages for r in other.requests]
    assert w.phases == ("burst",) and w.measured == ("burst",) and w.restart_before is None
    prompts = [r.messages[0]["content"] for r in w.requests]
    assert len(prompts) == 32 and len(set(prompts)) == 32
    ids = [tokenizer.encode(p) for p in prompts]
    assert all(abs(len(t) - 200) <= 6 for t in ids)
    assert len({tuple(t[:4]) for t in ids}) == 32  # no two share their first tokens
    four = w.phase_requests("burst", 4)
    assert [r.key for r in four] == [f"b{i}" for i in range(8)]  # a cell of 4 clients sends 2 each
    assert len(w.phase_requests("burst", 16)) == 32 and len(w.phase_requests("burst")) == 32


# ------------------------------------------------------------------------------------ conversations
def test_conversation_openings_are_within_range_and_seeded_per_conversation(tokenizer):
    w = build_load_workload("multi-turn@8", {**TURNS, "conversations": 8}, tokenizer, seed=5, max_tokens=4)
    firsts = [r for r in w.requests if r.key.endswith("t0")]
    lengths = [len(tokenizer.encode(r.messages[0]["content"])) for r in firsts]
    assert all(150 - 6 <= n <= 300 + 6 for n in lengths) and len(set(lengths)) > 1
    assert [opening_tokens(w.params, 5, c) for c in range(4)] == \
        [opening_tokens({**w.params, "conversations": 4}, 5, c) for c in range(4)]  # not tied to the count
    assert w.kvtool_ram_bytes == 64 << 20
    same = build_load_workload("multi-turn@8", {**TURNS, "conversations": 8}, tokenizer, seed=5, max_tokens=4)
    assert same == w


def test_restart_after_splits_the_turns_into_cold_warm_after_and_rewarm(tokenizer):
    w = build_load_workload("multi-turn", {**TURNS, "conversations": 3}, tokenizer, seed=0, max_tokens=4)
    assert w.phases == ("cold", "warm", "after", "rewarm") and w.measured == w.phases
    assert w.restart_before == "after"  # the same restart as the `restart` and `agents` workloads
    turns = {p: sorted({int(r.key.split("t")[1]) for r in w.phase_requests(p)}) for p in w.phases}
    assert turns == {"cold": [0], "warm": [1, 2], "after": [3], "rewarm": [4, 5]}
    after, rewarm = w.phase_requests("after"), w.phase_requests("rewarm")
    assert [r.after for r in after] == [None, None, None]  # their previous turns ran before the restart
    assert [r.after for r in rewarm[:3]] == [None, None, None]
    assert [rewarm[r.after].session for r in rewarm[3:]] == [r.session for r in rewarm[3:]]
    plain = build_load_workload("multi-turn", {**TURNS, "conversations": 3, "restart_after": 0}, tokenizer, 0, 4)
    assert plain.phases == ("turn",) and plain.restart_before is None


# ------------------------------------------------------------------------------------ config errors
@pytest.mark.parametrize("table,field", [
    ({"workloads": {"cold-burst": {"prompt_tokenz": 5}}}, "serve_load.workloads.cold-burst.prompt_tokenz"),
    ({"workloads": {"cold-burst": {"prompts_per_client": 0}}}, "serve_load.workloads.cold-burst.prompts_per_client"),
    ({"workloads": {"cold-burst": {"clients": [0]}}}, "serve_load.workloads.cold-burst.clients"),
    ({"workloads": {"multi-turn@8": {"turns": 4, "restart_after": 4}}}, "serve_load.workloads.multi-turn@8.restart_after"),
    ({"workloads": {"multi-turn@8": {"system_tokens": 400, "system_tokens_max": 300}}},
     "serve_load.workloads.multi-turn@8.system_tokens_max"),
    ({"workloads": {"multi-turn@8": {"opening": 3}}}, "serve_load.workloads.multi-turn@8.opening"),
    ({"workloads": {"nope@8": {}}}, "serve_load.workloads.nope@8"),
    ({"servers": ["kvtool", "mlx-lm-10"]}, "serve_load.servers"),
])
def test_parity_config_errors_name_the_field(table, field):
    with pytest.raises(ConfigError) as err:
        parse_serve_load({"serve_load": {"workloads": {"shared-prefix": {}}, **table}})
    assert err.value.field == field


def test_workload_clients_override_the_config_and_instances_keep_their_names():
    spec = parse_serve_load({"serve_load": {"clients": [1, 4], "servers": ["kvtool", "mlx-lm", "mlx-lm-1000"],
                                            "workloads": {"cold-burst": {"clients": [4, 16]},
                                                          "multi-turn@8": {"conversations": 8}}}})
    assert spec.clients_of("cold-burst") == (4, 16) and spec.clients_of("multi-turn@8") == (1, 4)
    assert "clients" not in spec.workloads["cold-burst"] and spec.servers[-1] == MLXLM_1000
    assert validate_load_params("multi-turn@8", {"conversations": 8})["conversations"] == 8


def test_shipped_parity_configs_parse():
    for name in ("serve_parity", "serve_parity_small"):
        spec = load_serve_load(REPO / "bench_configs" / f"{name}.toml")
        assert spec.servers == ("kvtool", "mlx-lm", "mlx-lm-1000") and spec.repeats == 1
        assert spec.clients_of("cold-burst") == (4, 16) and spec.clients_of("shared-prefix") == (1, 4, 16)
        assert {"multi-turn@8", "multi-turn@16", "long-doc-qa"} <= set(spec.workloads)


# ------------------------------------------------------------------------------------ the parity table
def test_targets_follow_the_phase_and_the_conversation_count():
    assert parity_target("cold-burst", {}, "burst") == "parity"
    assert parity_target("multi-turn", {"conversations": 8}, "warm") == "parity"
    assert parity_target("multi-turn", {"conversations": 16}, "warm") == "cached-default"
    assert parity_target("multi-turn", {"conversations": 16}, "rewarm") == "cached-default"
    assert parity_target("multi-turn", {"conversations": 16}, "cold") == "parity"
    assert parity_target("multi-turn", {"conversations": 8}, "after") == "cached-all"
    both = [MLXLM, MLXLM_1000]
    row = {"kvtool_ttft_p50_ms": 104.0, "kvtool_requests_per_s": 9.6, "mlx-lm_ttft_p50_ms": 100.0,
           "mlx-lm_requests_per_s": 10.0, "mlx-lm-1000_ttft_p50_ms": 120.0, "mlx-lm-1000_requests_per_s": 8.0}
    assert target_met("parity", row, both) == "met"  # 1.04x the better TTFT, 0.96x its requests/s
    assert target_met("parity", {**row, "kvtool_requests_per_s": 9.4}, both) == "not met"
    assert target_met("parity", {**row, "kvtool_ttft_p50_ms": 106.0}, both) == "not met"
    assert target_met("cached-default", {**row, "kvtool_ttft_p50_ms": 10.0}, both) == "met"
    assert target_met("cached-all", {**row, "kvtool_ttft_p50_ms": 11.0}, both) == "not met"  # 0.11x mlx-lm
    assert target_met("cached-all", {**row, "kvtool_ttft_p50_ms": 9.9}, both) == "met"
    assert target_met("parity", {"kvtool_ttft_p50_ms": 1.0}, []) == "-"


def test_phase_figures_by_hand():
    rows = [{"workload": "w", "server": "kvtool", "clients": 1, "repeat": 0, "phase": "warm", "measured": True,
             "ttft_ms": t, "latency_ms": 500.0, "sent_s": s, "error": None}
            for t, s in ((100.0, 0.0), (200.0, 0.5), (300.0, 1.0), (400.0, 1.5))]
    rows.append({**rows[0], "phase": "prime", "measured": False})
    rows.append({**rows[0], "ttft_ms": float("nan"), "sent_s": 0.2, "error": "wall time limit"})
    figs = phase_figures(pd.DataFrame(rows))
    assert len(figs) == 1
    got = figs.iloc[0]
    assert got["requests"] == 4 and got["failed"] == 1  # a failed request is counted, not timed
    assert got["ttft_p50_ms"] == 250.0 and math.isclose(got["ttft_p99_ms"], 300.0 + 0.97 * 100.0)
    assert got["ttft_mean_ms"] == (100.0 + 200.0 + 300.0 + 400.0) / 4
    assert got["requests_per_s"] == 4 / 2.0  # first send at 0 s, last answer at 1.5 + 0.5 s


def test_listen_overflows_of_a_cell_are_summed_over_its_repeats_per_server():
    requests = _pool_requests()
    batches = pd.DataFrame([{"workload": "shared-prefix", "server": server, "clients": clients, "repeat": rep,
                             "listen_overflows": (7 + rep if server == "mlx-lm" and clients == 4 else 0)}
                            for (clients, server), ttfts in POOL_TTFT.items() for rep in range(len(ttfts))])
    frame = parity_frame(requests, batches, {}).set_index("clients")
    assert frame.loc[4, "mlx-lm_listen_overflows"] == 7 + 8 + 9
    assert frame.loc[4, "kvtool_listen_overflows"] == 0 and frame.loc[1, "mlx-lm_listen_overflows"] == 0
    uncounted = batches.assign(listen_overflows=None)  # an OS without the counter: unknown, not 0
    assert parity_frame(requests, uncounted, {})["kvtool_listen_overflows"].isna().all()
    assert parity_frame(requests, pd.DataFrame(), {})["kvtool_listen_overflows"].isna().all()
    table = "\n".join(parity_markdown(frame.reset_index()))
    assert "| listen drops |" in table and "| 0 / 24 / 0 |" in table
    lines = parity_summary(frame.reset_index())
    assert [line.endswith("; listen drops mlx-lm 24: compare the mean") for line in lines[:2]] == [False, True]


# TTFT p50 (ms) per (clients, server) and repeat: one request per batch, so its TTFT is the batch's p50
POOL_TTFT = {(1, "kvtool"): [104.0, 106.0, 108.0], (1, "mlx-lm"): [90.0, 100.0, 110.0],
             (1, "mlx-lm-1000"): [130.0, 120.0, 110.0],
             (4, "kvtool"): [300.0, 330.0, 310.0], (4, "mlx-lm"): [280.0, 300.0, 290.0],
             (4, "mlx-lm-1000"): [300.0, 290.0, 310.0]}


def _pool_requests() -> pd.DataFrame:
    """One measured request per (clients, server, repeat) of a `shared-prefix` cell, answered in
    TTFT + 100 ms (so requests/s = 1000 / (TTFT + 100))."""
    return pd.DataFrame([
        {"workload": "shared-prefix", "server": server, "clients": clients, "repeat": rep, "phase": "query",
         "measured": True, "key": f"q{rep}", "ttft_ms": ttft, "latency_ms": ttft + 100.0, "sent_s": 10.0 * rep,
         "error": None, "text": "same", "completion_tokens": 3}
        for (clients, server), ttfts in POOL_TTFT.items() for rep, ttft in enumerate(ttfts)])


def _by_hand(ratios: list[float]) -> tuple[float, float, float]:
    """Geometric mean and exp(mean log -+ 2 standard errors), with the standard library."""
    logs = [math.log(r) for r in ratios]
    mean, se = statistics.fmean(logs), statistics.stdev(logs) / math.sqrt(len(logs))
    return math.exp(mean), math.exp(mean - 2 * se), math.exp(mean + 2 * se)


def test_pooled_ratios_of_synthetic_repeats_match_a_computation_by_hand():
    frame = parity_frame(_pool_requests(), pd.DataFrame(), {})
    one = frame[frame["clients"] == 1].iloc[0].to_dict()
    kv, a, b = (POOL_TTFT[(1, s)] for s in ("kvtool", "mlx-lm", "mlx-lm-1000"))
    ratios = [k / math.sqrt(x * y) for k, x, y in zip(kv, a, b, strict=True)]
    assert [one[f"ttft_p50_ms_ratio_geo_r{r}"] for r in range(3)] == pytest.approx(ratios)
    point, lo, hi = _by_hand(ratios)
    assert (one["ttft_p50_ms_ratio_geo"], one["ttft_p50_ms_ratio_geo_lo"], one["ttft_p50_ms_ratio_geo_hi"]) == \
        pytest.approx((point, lo, hi))
    assert one["ttft_p50_ms_ratio_geo_n"] == 3 and hi < 1.05  # the whole interval within the tolerance
    assert one["pooled_met"] == "met"
    assert one["ttft_p50_ms_noise"] == pytest.approx(_by_hand([x / y for x, y in zip(a, b, strict=True)])[0])
    rps = [(1000 / (k + 100)) / math.sqrt(1000 / (x + 100) * 1000 / (y + 100)) for k, x, y in zip(kv, a, b, strict=True)]
    assert one["requests_per_s_ratio_geo"] == pytest.approx(_by_hand(rps)[0])
    # the per-cell verdict against the better server's mean (mlx-lm, 100 ms): 106 ms is 1.06x
    assert one["met"] == "not met" and one["ttft_p50_ms_ratio_best"] == pytest.approx(1.06)
    four = [POOL_TTFT[(4, "kvtool")][r] / math.sqrt(POOL_TTFT[(4, "mlx-lm")][r] * POOL_TTFT[(4, "mlx-lm-1000")][r])
            for r in range(3)]
    row4 = frame[frame["clients"] == 4].iloc[0]
    assert row4["ttft_p50_ms_ratio_geo_lo"] == pytest.approx(_by_hand(four)[1])
    assert row4["ttft_p50_ms_ratio_geo_lo"] < 1.05 < row4["ttft_p50_ms_ratio_geo_hi"]  # it straddles the tolerance
    assert row4["pooled_met"] == "within noise"
    # pooled over both client counts: 6 samples, the same computation over all of them
    groups = pooled_groups(frame, 1.05)
    assert list(groups["group"]) == ["query"] and groups.loc[0, "clients"] == "1 / 4"
    g = groups.iloc[0].to_dict()
    assert (g["ttft_p50_ms_ratio_geo"], g["ttft_p50_ms_ratio_geo_lo"], g["ttft_p50_ms_ratio_geo_hi"]) == \
        pytest.approx(_by_hand(ratios + four)) and g["ttft_p50_ms_ratio_geo_n"] == 6
    text = "\n".join(parity_markdown(frame))
    assert "### Pooled over clients and repeats" in text and f"{point:.2f} [{lo:.2f}-{hi:.2f}]" in text
    first = _pool_requests()
    single = parity_frame(first[first["repeat"] == 0], pd.DataFrame(), {}).iloc[0]  # one repeat: no interval
    assert single["ttft_p50_ms_ratio_geo"] == pytest.approx(ratios[0]) and math.isnan(single["ttft_p50_ms_ratio_geo_hi"])
    assert single["ttft_p50_ms_ratio_geo_n"] == 1 and single["pooled_met"] == "met"  # 0.96: the point decides


def test_pooled_interval_needs_two_repeats_and_the_verdict_reads_the_interval():
    assert pooled_ratio([]) == (pytest.approx(math.nan, nan_ok=True),) * 3 + (0,)
    point, lo, hi, n = pooled_ratio([1.2, float("nan"), -1.0])  # NaN and non-positive ratios left out
    assert (point, n) == (pytest.approx(1.2), 1) and math.isnan(lo) and math.isnan(hi)
    assert pooled_ratio([0.5, 2.0])[0] == pytest.approx(1.0)  # geometric: 2x and 1/2x cancel
    row = {"ttft_p50_ms_ratio_geo": 1.0, "ttft_p50_ms_ratio_geo_lo": 0.97, "ttft_p50_ms_ratio_geo_hi": 1.03}
    assert pooled_verdict(row, 1.05) == "met"  # no requests/s: TTFT alone
    assert pooled_verdict({**row, "ttft_p50_ms_ratio_geo_hi": 1.08}, 1.05) == "within noise"
    assert pooled_verdict({**row, "ttft_p50_ms_ratio_geo": 1.1, "ttft_p50_ms_ratio_geo_lo": 1.06,
                           "ttft_p50_ms_ratio_geo_hi": 1.15}, 1.05) == "not met"
    rps = {"requests_per_s_ratio_geo": 0.9, "requests_per_s_ratio_geo_lo": 0.88, "requests_per_s_ratio_geo_hi": 0.93}
    assert pooled_verdict({**row, **rps}, 1.05) == "not met"  # requests/s wholly below 1 / 1.05
    assert pooled_verdict({**row, **rps, "requests_per_s_ratio_geo_hi": 0.99}, 1.05) == "within noise"
    assert pooled_verdict({"ttft_p50_ms_ratio_geo": 1.04, "ttft_p50_ms_ratio_geo_lo": math.nan}, 1.05) == "met"
    assert pooled_verdict({"ttft_p50_ms_ratio_geo": 1.06}, 1.05) == "not met"  # one repeat: the point decides
    assert pooled_verdict({}, 1.05) == "-"


# ------------------------------------------------------------------------------------ real servers
@pytest.mark.slow
def test_mlx_lm_1000_server_runs_with_its_prompt_cache_flag(tmp_path):
    options = ServerOptions(MLXLM_1000, "tiny", str(resolve_spec("tiny")[0]), start_timeout_s=120)
    with ManagedServer(options, tmp_path / "mlx.log") as server:
        argv = Path(f"/proc/{server.proc.pid}/cmdline").read_bytes().split(b"\0")  # ready: /v1/models answered
    assert argv[argv.index(b"--prompt-cache-size") + 1] == b"1000"
    assert b"mlx_lm.server" in argv and not server.killed
    assert "--prompt-cache-size" not in ServerOptions(MLXLM, "tiny", "x").command(1)


SMOKE = """
[serve_load]
model = "tiny"
repeats = 1
clients = [1]
servers = ["kvtool", "mlx-lm", "mlx-lm-1000"]
max_tokens = 3
max_wall_s = 120
start_timeout_s = 120

[serve_load.kvtool]
block_size = 16
ram_bytes = "64MiB"

[serve_load.workloads.cold-burst]
clients = [2]
prompts_per_client = 1
prompt_tokens = 48

[serve_load.workloads."multi-turn@2"]
conversations = 2
turns = 4
restart_after = 2
system_tokens = 40
system_tokens_max = 80
user_tokens = 8
assistant_tokens = 8
ram_bytes = "64MiB"
"""


@pytest.mark.slow
def test_parity_run_through_the_cli(tmp_path):
    from kvtool.cli.app import _register, app

    config = tmp_path / "parity.toml"
    config.write_text(SMOKE)
    _register()
    result = CliRunner().invoke(app, ["bench", str(config), "--out", str(tmp_path / "out"), "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output[result.output.index("{"):])
    assert doc["ok"] is True
    run_dir = Path(doc["run_dir"])
    parity = pd.read_csv(run_dir / "parity.csv")
    assert [(r.workload, r.clients, r.phase) for r in parity.itertuples()] == [
        ("cold-burst", 2, "burst"), ("multi-turn@2", 1, "cold"), ("multi-turn@2", 1, "warm"),
        ("multi-turn@2", 1, "after"), ("multi-turn@2", 1, "rewarm")]
    for server in ("kvtool", "mlx-lm", "mlx-lm-1000"):
        for fig in ("ttft_p50_ms", "ttft_mean_ms", "ttft_p99_ms", "requests_per_s"):
            assert (parity[f"{server}_{fig}"] > 0).all(), (server, fig)
        # 1-2 clients never fill a listen queue (kvtool's holds 128, mlx_lm.server's 5): counted, all 0
        assert (parity[f"{server}_listen_overflows"] == 0).all(), server
    for col in ("ttft_p50_ms_ratio_mlx-lm", "ttft_p50_ms_ratio_mlx-lm-1000", "ttft_p50_ms_ratio_best",
                "ttft_mean_ms_ratio_best", "requests_per_s_ratio_best", "load_avg_start", "load_avg_end"):
        assert parity[col].notna().all(), col
    assert set(parity["met"]) <= {"met", "not met"}
    assert list(parity["target"]) == ["parity", "parity", "parity", "cached-all", "parity"]
    assert (parity["output_mismatches_kvtool"] == 0).all() and (parity["output_mismatches_mlx-lm-1000"] == 0).all()
    assert (parity[["kvtool_failed", "mlx-lm_failed", "mlx-lm-1000_failed"]] == 0).all().all()
    batches = pd.read_csv(run_dir / "batches.csv")
    turns = batches[batches["workload"] == "multi-turn@2"]
    assert sorted(turns["server"]) == ["kvtool", "mlx-lm", "mlx-lm-1000"] and (turns["restarts"] == 1).all()
    requests = pd.read_csv(run_dir / "requests.csv")
    burst = requests[requests["workload"] == "cold-burst"]
    assert len(burst) == 2 * 3 and burst["error"].isna().all()
    assert "## Parity: kvtool against every mlx_lm.server, per phase" in (run_dir / "report.md").read_text()
    assert "| multi-turn@2 | 1 | after restart |" in (run_dir / "report.md").read_text()
    assert len(json.loads((run_dir / "summary.json").read_text())["parity"]) == 5
    text = CliRunner().invoke(app, ["report", str(run_dir)]).output
    assert "parity multi-turn@2 1 client(s) after restart: kvtool / better mlx-lm TTFT p50" in text
