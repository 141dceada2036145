"""The load benchmark: load generator, workloads, statistics, charts, `[serve_load]` cells.

Fast tests check the pure parts against hand-computed values (percentiles, the bootstrap
interval, verdicts, trace parsing, config errors) and read a rendered chart back pixel by pixel
(a tie is drawn in the tie colour, never the win colour) or measure its layout (titles and tick
labels stay apart). The slow ones start real servers:
`kvtool serve` on the tiny model driven by the `openai` client, and a whole `[serve_load]` run of
`bench_configs/serve_load_quick.toml` (kvtool serve and plain mlx_lm.server) through the CLI.
No timing assertions.
"""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.image as mpimg  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402
from matplotlib.colors import to_rgb  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from kvtool.bench import loadcharts, loadstats  # noqa: E402
from kvtool.bench.loadcell import is_serve_load_config, load_serve_load, parse_serve_load  # noqa: E402
from kvtool.bench.loadgen import (  # noqa: E402
    WALL_LIMIT_ERROR,
    LoadRequest,
    LoadSpec,
    check_loopback,
    connect_retrying,
    error_text,
    openai_client,
    poisson_arrivals,
    run_load,
)
from kvtool.bench.loadreport import cells_frame, comparison_frame, mismatches_frame  # noqa: E402
from kvtool.bench.loadserver import KVTOOL, ManagedServer, ServerOptions  # noqa: E402
from kvtool.bench.loadworkloads import build_load_workload, load_trace  # noqa: E402
from kvtool.config import ConfigError  # noqa: E402
from kvtool.models.loader import resolve_spec  # noqa: E402
from tests.server_procs import free_port  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
QUICK = REPO / "bench_configs" / "serve_load_quick.toml"


# ------------------------------------------------------------------------------------ loopback
@pytest.mark.parametrize("url", ["http://127.0.0.1:8080/v1", "http://127.9.8.7:1/v1", "http://localhost:80/v1",
                                 "http://[::1]:8080/v1"])
def test_loopback_urls_are_accepted(url):
    check_loopback(url)


@pytest.mark.parametrize("url", ["http://10.0.0.1:8080/v1", "http://example.com/v1", "http://0.0.0.0:8080/v1",
                                 "http://[::]:8080/v1", "ftp://127.0.0.1/", "127.0.0.1:8080"])
def test_non_loopback_urls_are_refused_before_any_request(url):
    with pytest.raises(ValueError):
        check_loopback(url)
    with pytest.raises(ValueError):
        run_load(url, [LoadRequest("k", ({"role": "user", "content": "hi"},), 1)], LoadSpec())


class _Models(BaseHTTPRequestHandler):
    """`GET /v1/models`: an empty list, or 500 where the server says so; counts the requests."""

    def do_GET(self):  # noqa: N802 - http.server's name
        self.server.hits += 1  # type: ignore[attr-defined]
        code = self.server.status  # type: ignore[attr-defined]
        body = json.dumps({"object": "list", "data": []} if code == 200 else {"error": {"message": "boom"}}).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def _models_server(port: int, status: int) -> ThreadingHTTPServer:
    httpd = ThreadingHTTPServer(("127.0.0.1", port), _Models)
    httpd.hits, httpd.status = 0, status  # type: ignore[attr-defined]
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd


def test_a_refused_connection_is_retried_until_the_server_listens(monkeypatch):
    """No server on the port yet: the call is refused, retried, and answered once the server is
    up; a request the server answered (500) is never sent again."""
    import openai

    monkeypatch.setattr("kvtool.bench.loadgen.CONNECT_RETRY_S", 0.3)
    port = free_port()
    client = openai_client(f"http://127.0.0.1:{port}/v1", 10.0)
    started: list[ThreadingHTTPServer] = []
    timer = threading.Timer(0.5, lambda: started.append(_models_server(port, 200)))
    timer.start()
    try:
        page = asyncio.run(connect_retrying(lambda: client.models.list()))
        assert list(page.data) == [] and started and started[0].hits == 1
    finally:
        timer.join()
        for httpd in started:
            httpd.shutdown()
            httpd.server_close()
    failing = _models_server(free_port(), 500)
    try:
        client = openai_client(f"http://127.0.0.1:{failing.server_address[1]}/v1", 10.0)
        with pytest.raises(openai.InternalServerError):
            asyncio.run(connect_retrying(lambda: client.models.list()))
        assert failing.hits == 1
    finally:
        failing.shutdown()
        failing.server_close()
    refused = openai_client(f"http://127.0.0.1:{free_port()}/v1", 10.0)  # nobody ever listens
    monkeypatch.setattr("kvtool.bench.loadgen.CONNECT_RETRY_S", 0.01)
    with pytest.raises(openai.APIConnectionError) as info:
        asyncio.run(connect_retrying(lambda: refused.models.list()))
    assert "Connection error" in error_text(info.value) and "(ConnectError:" in error_text(info.value)


def test_load_spec_and_dependency_validation():
    with pytest.raises(ValueError, match="rate_per_s"):
        LoadSpec(arrival="poisson")
    with pytest.raises(ValueError, match="clients"):
        LoadSpec(clients=0)
    bad = [LoadRequest("a", ({"role": "user", "content": "x"},), 1, after=0)]  # points at itself
    with pytest.raises(ValueError, match="earlier"):
        run_load("http://127.0.0.1:9/v1", bad, LoadSpec())


def test_poisson_arrivals_are_cumulative_exponential_gaps():
    got = poisson_arrivals(5, 4.0, seed=7)
    assert np.array_equal(got, np.cumsum(np.random.default_rng(7).exponential(0.25, size=5)))
    assert np.all(np.diff(got) > 0)


# ------------------------------------------------------------------------------------ statistics
def test_batch_percentiles_match_hand_computed_linear_interpolation():
    ttft = [10.0, 20.0, 30.0, 40.0, 50.0]
    records = [{"ttft_ms": t, "latency_ms": t + 100, "prompt_tokens": 100, "cached_tokens": 50, "error": None}
               for t in ttft]
    records.append({"ttft_ms": 1e9, "latency_ms": 1e9, "prompt_tokens": 7, "cached_tokens": 0, "error": "boom"})
    fig = loadstats.batch_figures(records, wall_s=2.0, tier_hits={"ram_hit_tokens": 100, "ssd_hit_tokens": 150,
                                                                  "prompt_tokens": 500})
    # rank = q/100 * (n - 1): p50 -> 2 (30), p90 -> 3.6 (40 + 0.6 * 10), p99 -> 3.96 (40 + 0.96 * 10)
    assert fig["ttft_p50_ms"] == 30.0
    assert fig["ttft_p90_ms"] == pytest.approx(46.0)
    assert fig["ttft_p99_ms"] == pytest.approx(49.6)
    assert fig["latency_p99_ms"] == pytest.approx(149.6)
    assert fig["ttft_p90_ms"] == np.percentile(ttft, 90, method="linear")
    assert fig["requests_per_s"] == 2.5 and fig["prompt_tokens_per_s"] == 250.0  # the failed one left out
    assert fig["hit_rate"] == 0.5 and fig["hit_rate_ram"] == 0.2 and fig["hit_rate_ssd"] == 0.3
    assert fig["requests"] == 6 and fig["failed"] == 1


def test_bootstrap_interval_recomputed_by_hand():
    values = np.array([12.0, 15.0, 11.0, 30.0, 14.0])
    iv = loadstats.bootstrap_ci(values)
    idx = np.random.default_rng(loadstats.BOOTSTRAP_SEED).integers(0, 5, size=(loadstats.N_RESAMPLES, 5))
    means = values[idx].mean(axis=1)
    assert iv.point == pytest.approx(16.4)
    assert iv.lo == np.percentile(means, 2.5, method="linear")
    assert iv.hi == np.percentile(means, 97.5, method="linear")
    assert iv.lo <= iv.point <= iv.hi and iv.n == 5
    assert values.min() <= iv.lo < iv.hi <= values.max()
    assert loadstats.bootstrap_ci(values) == iv  # fixed seed: the same interval every time


def test_bootstrap_degenerate_cases():
    const = loadstats.bootstrap_ci([7.5, 7.5, 7.5])
    assert (const.point, const.lo, const.hi) == (7.5, 7.5, 7.5)
    one = loadstats.bootstrap_ci([3.0, float("nan")])  # NaN dropped: one value left
    assert (one.point, one.lo, one.hi, one.n) == (3.0, 3.0, 3.0, 1)
    assert not loadstats.bootstrap_ci([]).valid
    for values in ([1.0, 2.0], [5.0, 1.0, 9.0], [100.0, 0.0, 0.0, 0.0]):
        iv = loadstats.bootstrap_ci(values)
        assert iv.lo <= iv.point <= iv.hi


def test_paired_ratio_of_proportional_repeats_is_exact():
    iv = loadstats.ratio_ci([2.0, 4.0, 6.0], [1.0, 2.0, 3.0])  # paired: every resample's ratio is 2
    assert (iv.point, iv.lo, iv.hi) == (2.0, 2.0, 2.0)
    unpaired = loadstats.ratio_ci([2.0, 4.0, 6.0], [1.0, 2.0])  # lengths differ: resampled independently
    assert unpaired.point == pytest.approx(4.0 / 1.5) and unpaired.lo < unpaired.point < unpaired.hi
    assert not loadstats.ratio_ci([1.0], [0.0]).valid


def test_compare_calls_a_winner_only_when_intervals_are_apart():
    iv = loadstats.Interval
    fast, slow = iv(10, 9, 11, 3), iv(20, 18, 22, 3)
    assert loadstats.compare(fast, slow) == "win" and loadstats.compare(slow, fast) == "loss"
    assert loadstats.compare(fast, slow, lower_is_better=False) == "loss"  # e.g. requests/s
    assert loadstats.compare(fast, iv(12, 10.5, 14, 3)) == "tie"  # overlap
    assert loadstats.compare(fast, iv(12, 11, 14, 3)) == "tie"  # touching
    assert loadstats.compare(iv(10, 10, 10, 1), iv(20, 20, 20, 1)) == "tie"  # one repeat: no spread
    assert loadstats.compare(fast, loadstats.NAN_INTERVAL) == "tie"


def _batches(kv_ttft, ml_ttft):
    rows = []
    for server, values in (("kvtool", kv_ttft), ("mlx-lm", ml_ttft)):
        for r, v in enumerate(values):
            rows.append({"workload": "w", "server": server, "clients": 4, "repeat": r,
                         **{f: float("nan") for f in loadstats.FIGURES}, "ttft_p50_ms": v})
    return pd.DataFrame(rows)


def test_comparison_frame_verdicts_follow_the_intervals():
    tie = comparison_frame(_batches([10.0, 14.0, 12.0], [11.0, 15.0, 13.0])).iloc[0]
    assert tie["verdict"] == "tie" and tie["kvtool_lo"] <= tie["mlxlm_hi"]
    win = comparison_frame(_batches([10.0, 11.0, 10.5], [20.0, 21.0, 22.0])).iloc[0]
    assert win["verdict"] == "win" and win["ratio"] == pytest.approx(10.5 / 21.0)
    assert win["ratio_lo"] <= win["ratio"] <= win["ratio_hi"]


def test_an_output_mismatch_fails_the_kvtool_cell():
    def req(server, key, text, error=None):
        return {"workload": "w", "clients": 4, "repeat": 0, "server": server, "key": key, "phase": "query",
                "text": text, "completion_tokens": 2, "error": error}

    requests = pd.DataFrame([req("kvtool", "a", "same"), req("mlx-lm", "a", "same"),
                             req("kvtool", "b", "kv"), req("mlx-lm", "b", "ml"),
                             req("kvtool", "c", "", "wall time limit"), req("mlx-lm", "c", "x")])
    bad, counts = mismatches_frame(requests)
    assert list(bad["key"]) == ["b", "c"] and counts == {("w", 4): (3, 2)}
    batches = _batches([10.0], [10.0]).assign(peak_rss_bytes=1 << 20, stopped_clean=True, cut_by_wall=False)
    cells = cells_frame(batches, counts)
    kv = cells[cells["server"] == "kvtool"].iloc[0]
    assert kv["cell_failed"] and kv["output_mismatches"] == 2
    assert not cells[cells["server"] == "mlx-lm"].iloc[0]["cell_failed"]


# ------------------------------------------------------------------------------------ charts
def _pixel(img: np.ndarray, x_disp: float, y_disp: float) -> np.ndarray:
    """The RGB of the PNG pixel at display coordinates (origin bottom-left, as matplotlib's)."""
    height = img.shape[0]
    return img[int(round(height - y_disp)), int(round(x_disp)), :3]


def test_a_tie_bar_is_drawn_in_the_tie_colour_not_the_win_colour(tmp_path):
    fig, ax = plt.subplots(figsize=(5, 4), dpi=loadcharts.DPI)
    bars = loadcharts.draw_verdict_bars(ax, ["tied cell", "winning cell"], [0.9, 0.5], [0.7, 0.45], [1.1, 0.55],
                                        ["tie", "win"])
    fig.canvas.draw()
    centres = [b.get_window_extent().get_points().mean(axis=0) for b in bars]
    # sample below the whiskers: 20 % up from each bar's base
    spots = [(c[0], b.get_window_extent().y0 + 0.2 * b.get_window_extent().height) for c, b in zip(centres, bars)]
    path = tmp_path / "bars.png"
    fig.savefig(path, dpi=loadcharts.DPI)
    plt.close(fig)
    img = mpimg.imread(path)
    tie_px, win_px = (_pixel(img, x, y) for x, y in spots)
    assert np.allclose(tie_px, to_rgb(loadcharts.COLORS["tie"]), atol=1 / 255)
    assert not np.allclose(tie_px, to_rgb(loadcharts.COLORS["win"]), atol=0.05)
    assert np.allclose(win_px, to_rgb(loadcharts.COLORS["win"]), atol=1 / 255)


def test_ratio_chart_of_a_tie_has_no_winner_colour_anywhere(tmp_path):
    cmp = comparison_frame(_batches([10.0, 14.0, 12.0], [11.0, 15.0, 13.0]))
    assert list(cmp["verdict"]) == ["tie"]
    path = loadcharts.ratio_chart(tmp_path / "ratio.png", cmp)
    img = mpimg.imread(path)[..., :3]
    for colour, present in (("tie", True), ("win", False), ("loss", False)):
        hits = np.all(np.abs(img - np.array(to_rgb(loadcharts.COLORS[colour]))) < 1.5 / 255, axis=-1).sum()
        assert (hits > 100) == present, colour


def test_ttft_cdf_titles_and_tick_labels_stay_apart(tmp_path, monkeypatch):
    """Ten panels (four rows, as a parity run's) of TTFTs up to 16,000 ms (5-digit ticks) under a
    two-line suptitle: every panel title stands clear below the suptitle, and no two x tick labels
    of a panel meet."""
    rng = np.random.default_rng(0)
    requests, cells = [], []
    keys = [(w, c) for w in ("cold-burst", "long-doc-qa", "multi-turn@16", "multi-turn@8", "shared-prefix") for c in (1, 4)]
    for workload, clients in keys:
        for server in ("kvtool", "mlx-lm"):
            t = rng.uniform(100.0, 16_000.0, 40)
            requests += [{"workload": workload, "clients": clients, "server": server, "ttft_ms": x} for x in t]
            q = {f"ttft_p{p}_ms": float(np.percentile(t, p)) for p in (50, 90, 99)}
            cells.append({"workload": workload, "clients": clients, "server": server, **q,
                          **{f"{k}_lo": v * 0.95 for k, v in q.items()}, **{f"{k}_hi": v * 1.05 for k, v in q.items()}})
    boxes: dict[str, list] = {}
    save = loadcharts.save

    def measure_then_save(fig, path):
        fig.canvas.draw()
        boxes["suptitle"] = [t.get_window_extent() for t in fig.texts if t.get_text().startswith("TTFT CDF")]
        axes = [ax for ax in fig.axes if ax.get_visible()]
        boxes["titles"] = [ax.title.get_window_extent() for ax in axes]
        boxes["ticks"] = []
        for ax in axes:
            lo, hi = ax.get_xlim()
            shown = [lab for x, lab in zip(ax.get_xticks(), ax.get_xticklabels()) if lo <= x <= hi and lab.get_text()]
            boxes["ticks"].append([lab.get_window_extent() for lab in shown])
        return save(fig, path)

    monkeypatch.setattr(loadcharts, "save", measure_then_save)
    loadcharts.ttft_cdf_chart(tmp_path / "ttft_cdf.png", pd.DataFrame(requests), pd.DataFrame(cells))
    assert len(boxes["suptitle"]) == 1 and len(boxes["titles"]) == len(keys)
    # wholly below the suptitle, with a gap of at least 0.4 title heights (tight_layout left ~0.1)
    assert all(boxes["suptitle"][0].y0 - title.y1 >= 0.4 * title.height for title in boxes["titles"])
    for panel in boxes["ticks"]:
        assert len(panel) >= 3
        assert not any(a.overlaps(b) for i, a in enumerate(panel) for b in panel[i + 1:])


# ------------------------------------------------------------------------------------ workloads, config
def test_trace_is_parsed_sorted_and_checked(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"t": 0.5, "prompt": "second", "max_tokens": 3}\n\n'
                     '{"t": 0, "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]}\n')
    reqs = load_trace(trace, max_tokens=9)
    assert [r.arrival_s for r in reqs] == [0.0, 0.5]
    assert reqs[0].messages == ({"role": "system", "content": "s"}, {"role": "user", "content": "u"})
    assert reqs[0].max_tokens == 9 and reqs[1].max_tokens == 3
    assert reqs[1].messages == ({"role": "user", "content": "second"},)
    trace.write_text('{"t": 1, "prompt": "x"}\n{"t": -1, "prompt": "y"}\n')
    with pytest.raises(ConfigError, match=r"t\.jsonl:2"):
        load_trace(trace, 4)
    trace.write_text('{"t": 1, "prompt": "x", "messages": []}\n')
    with pytest.raises(ConfigError, match="exactly one"):
        load_trace(trace, 4)


def test_shipped_configs_parse():
    for name in ("serve_load", "serve_load_quick", "serve_load_small"):
        path = REPO / "bench_configs" / f"{name}.toml"
        assert is_serve_load_config(path)
        spec = load_serve_load(path)
        assert spec.servers == ("kvtool", "mlx-lm") and spec.model == ("small" if name.endswith("small") else "tiny")
    full = load_serve_load(REPO / "bench_configs" / "serve_load.toml")
    assert full.clients == (1, 4, 16) and full.repeats == 3
    assert full.workloads["shared-prefix"] == {"groups": 1, "prompts_per_group": 48, "system_tokens": 2000,
                                               "question_tokens": 32, "prime": 1}
    assert not is_serve_load_config(REPO / "bench_configs" / "quick.toml")


@pytest.mark.parametrize("table, field", [
    ({"clients": [0]}, "serve_load.clients"),
    ({"servers": ["vllm"]}, "serve_load.servers"),
    ({"arrival": "poisson"}, "serve_load.rate"),
    ({"kvtool": {"ram_bytes": "lots"}}, "serve_load.kvtool.ram_bytes"),
    ({"workloads": {"shared-prefix": {"groups": 0}}}, "serve_load.workloads.shared-prefix.groups"),
    ({"workloads": {"trace": {}}}, "serve_load.workloads.trace.path"),
    ({"workloads": {"nope": {}}}, "serve_load.workloads.nope"),
    ({"colour": "blue"}, "serve_load.colour"),
    ({"rate": "x"}, "serve_load.rate"),  # a closed loop ignores rate, but not a rate that is no number (it crashed)
    ({"kvtool": {"colour": "blue"}}, "serve_load.kvtool.colour"),
    ({"workloads": {"cold-burst": {"clients": [4, 4]}}}, "serve_load.workloads.cold-burst.clients"),
])
def test_config_errors_name_the_field(table, field):
    doc = {"serve_load": {"workloads": {"shared-prefix": {}}, **table}}
    with pytest.raises(ConfigError) as info:
        parse_serve_load(doc)
    assert info.value.field == field


def test_progress_prints_whole_lines_when_stderr_is_not_a_tty(capsys):
    from kvtool.bench.loadcell import Progress

    with Progress(enabled=True, interval_s=3600) as bar:
        bar.set("shared-prefix 4 client(s) kvtool r0: query 3/48 requests")
    err = capsys.readouterr().err
    assert err.endswith("query 3/48 requests\n") and "\r" not in err


@pytest.fixture(scope="module")
def tokenizer():
    from mlx_lm.utils import load_tokenizer

    return load_tokenizer(resolve_spec("tiny")[0])


def test_workloads_are_deterministic_and_sized_in_tokens(tokenizer):
    params = {"groups": 2, "prompts_per_group": 3, "system_tokens": 300, "question_tokens": 20}
    a = build_load_workload("shared-prefix", params, tokenizer, seed=3, max_tokens=4)
    assert a == build_load_workload("shared-prefix", params, tokenizer, seed=3, max_tokens=4)
    assert a != build_load_workload("shared-prefix", params, tokenizer, seed=4, max_tokens=4)
    assert len(a.requests) == 6 and len({r.key for r in a.requests}) == 6
    systems = {r.session: r.messages[0]["content"] for r in a.requests}
    assert len(set(systems.values())) == 2
    for r in a.requests:
        assert r.messages[0]["content"] == systems[r.session]
        assert abs(len(tokenizer.encode(r.messages[0]["content"])) - 300) <= 6
    chat = build_load_workload("multi-turn", {"turns": 3, "system_tokens": 64, "user_tokens": 16,
                                              "assistant_tokens": 16, "ram_bytes": 65536}, tokenizer, 0, 4,
                               model_dir=resolve_spec("tiny")[0])
    assert chat.params["working_set_bytes"] > 65536 and chat.kvtool_ram_bytes == 65536
    for i, r in enumerate(chat.requests):
        if r.after is not None:
            prev = chat.requests[r.after]
            assert prev.session == r.session and r.after < i
            assert r.messages[:len(prev.messages)] == prev.messages  # the next turn extends the previous one
    restart = build_load_workload("restart", {"prompts": 2, "prompt_tokens": 64}, tokenizer, 0, 4)
    assert restart.phases == ("before", "after") and restart.restart_before == "after"


# ------------------------------------------------------------------------------------ real servers
@pytest.mark.slow
def test_loadgen_against_kvtool_serve(tmp_path):
    options = ServerOptions(KVTOOL, "tiny", str(resolve_spec("tiny")[0]), tmp_path / "cache",
                            ("--block-size", "16"), start_timeout_s=120, stop_timeout_s=60)
    system = {"role": "system", "content": "You answer questions about Python modules. " * 6}
    reqs = [LoadRequest(f"q{i}", (system, {"role": "user", "content": f"Question {i}: what is item {i}?"}), 4)
            for i in range(6)]
    reqs.append(LoadRequest("follow-up", (*reqs[0].messages, {"role": "assistant", "content": "fine"},
                                          {"role": "user", "content": "And then?"}), 4, after=0))
    with ManagedServer(options, tmp_path / "kvtool.log") as server:
        result = run_load(server.base_url, reqs, LoadSpec(clients=4))
        capped = run_load(server.base_url, reqs, LoadSpec(clients=4, max_requests=3))
        cut = run_load(server.base_url, [LoadRequest("long", ({"role": "user", "content": "x " * 1500},), 64)],
                       LoadSpec(clients=1, max_wall_s=0.001))
        poisson = run_load(server.base_url, reqs[:3], LoadSpec(clients=2, arrival="poisson", rate_per_s=50.0))
        timed = [LoadRequest(r.key, r.messages, r.max_tokens, arrival_s=0.05 * (2 - i)) for i, r in enumerate(reqs[:3])]
        trace = run_load(server.base_url, timed, LoadSpec(clients=2, arrival="trace"))
        stats = server.kvtool_stats()
        assert server.sample_rss() and server.peak_rss > 0
    assert server.exit_code == 143 and server.stopped_clean
    assert result.stopped_by == "done" and result.not_sent == 0
    assert [r.key for r in result.records] == [r.key for r in reqs]
    for rec in result.records:
        assert rec.error is None and rec.ttft_from_content, rec
        assert 0 < rec.ttft_ms <= rec.latency_ms
        assert rec.prompt_tokens > 0 and 1 <= rec.completion_tokens <= 4 and rec.cached_tokens is not None
        assert rec.text
    follow = result.records[-1]
    first = result.records[0]
    assert follow.sent_s >= first.sent_s + first.latency_ms / 1e3  # sent only after its previous turn finished
    assert len(capped.records) == 3 and capped.not_sent == len(reqs) - 3
    assert [r.text for r in capped.records] == [r.text for r in result.records[:3]]  # greedy: same outputs
    for run in (poisson, trace):  # open-loop arrivals: every request answered, same greedy outputs
        assert [r.error for r in run.records] == [None] * 3
        assert [r.text for r in run.records] == [r.text for r in result.records[:3]]
        assert all(r.sent_s >= r.scheduled_s for r in run.records)
    assert [r.index for r in sorted(trace.records, key=lambda r: r.scheduled_s)] == [2, 1, 0]  # by arrival time
    assert cut.stopped_by == "wall" and len(cut.records) + cut.not_sent == 1
    assert all(r.error == WALL_LIMIT_ERROR for r in cut.records)
    assert stats is not None and stats["adapter"]["requests"] >= len(reqs) + 9
    assert stats["adapter"]["cached_tokens"] > 0


@pytest.mark.slow
def test_serve_load_quick_run_through_the_cli(tmp_path):
    from kvtool.cli.app import _register, app

    _register()
    result = CliRunner().invoke(app, ["bench", str(QUICK), "--out", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output[result.output.index("{"):])
    assert doc["ok"] is True
    run_dir = Path(doc["run_dir"])
    for name in ("requests.jsonl", "requests.csv", "batches.csv", "cells.csv", "comparison.csv", "mismatches.csv",
                 "run.json", "summary.json", "report.md", "ttft_cdf.png", "throughput_vs_concurrency.png", "hit_rate_per_tier.png",
                 "ttft_ratio.png"):
        assert (run_dir / name).is_file(), name
    cells = pd.read_csv(run_dir / "cells.csv")
    assert set(cells["server"]) == {"kvtool", "mlx-lm"}
    kv = cells[cells["server"] == "kvtool"].iloc[0]
    assert kv["outputs_compared"] == 6 and kv["output_mismatches"] == 0 and not kv["cell_failed"]
    assert kv["ttft_p50_ms_lo"] <= kv["ttft_p50_ms"] <= kv["ttft_p50_ms_hi"]
    cmp = pd.read_csv(run_dir / "comparison.csv")
    assert set(cmp["verdict"]) == {"tie"}  # one repeat: never a winner
    assert "| workload | clients | figure | kvtool | mlx-lm | kvtool / mlx-lm | verdict |" in \
        (run_dir / "report.md").read_text()
    again = CliRunner().invoke(app, ["report", str(run_dir), "--json"])
    assert again.exit_code == 0 and json.loads(again.output)["ok"] is True


def test_shared_prefix_prime_phase_is_unmeasured_and_first(tiny_model):
    from kvtool.bench.loadworkloads import build_load_workload

    w = build_load_workload("shared-prefix", {"groups": 2, "prompts_per_group": 3, "system_tokens": 40, "prime": 1},
                            tiny_model.tokenizer, 0, 2)
    assert w.phases == ("prime", "query") and w.measured == ("query",)
    primes = w.phase_requests("prime")
    assert [r.key for r in primes] == ["g0p0", "g1p0"]
    # each prime request carries its group's system prompt, as the measured queries do
    systems = {r.session: r.messages[0]["content"] for r in w.phase_requests("query")}
    assert all(r.messages[0]["content"] == systems[r.session] for r in primes)
