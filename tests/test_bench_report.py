"""The bench report a reader can trust (docs/benchmarks.md): medians with min-max ranges over the
repeats, a winner only beyond the spread (else a tie), one chart per question at a legible size,
and `kvtool report` on a bad run directory as one `error:` line with exit 2.

Everything here runs on constructed data: no model is loaded.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import typer
from PIL import Image
from typer.testing import CliRunner

from kvtool.bench import metrics, report
from kvtool.bench.report import ReportError, load_run, winners, write_report
from kvtool.cli import cmd_bench, common
from kvtool.errors import KVToolError


# ------------------------------------------------------------------------ constructed data
def cell_row(workload: str, cell: str, per_repeat: list[float], kind: str = "kvtool", **extra) -> dict:
    """A cells.csv row whose TTFT p50 over the repeats was `per_repeat`."""
    return {
        "workload": workload, "cell": cell, "kind": kind, "repeats": len(per_repeat),
        "ttft_p50_ms": float(np.median(per_repeat)), "ttft_p50_ms_min": min(per_repeat),
        "ttft_p50_ms_max": max(per_repeat), **extra,
    }


def verdict(rows: list[dict]) -> pd.Series:
    best = winners(pd.DataFrame(rows))
    assert len(best) == 1
    return best.iloc[0]


def test_clear_winner_beats_the_runner_up_beyond_the_spread():
    v = verdict([
        cell_row("w", "nc", [100, 101, 99], kind="no-cache"),
        cell_row("w", "slow", [20, 18, 22]),
        cell_row("w", "fast", [10, 9, 11]),
        cell_row("w", "slower", [30, 29, 35]),
    ])
    assert v["verdict"] == "winner" and v["cell"] == "fast" and v["tied_cells"] == ""
    assert v["runner_up"] == "slow"
    assert (v["ttft_p50_ms"], v["ttft_p50_ms_lo"], v["ttft_p50_ms_hi"]) == (10, 9, 11)
    assert (v["runner_up_ttft_p50_ms_lo"], v["runner_up_ttft_p50_ms_hi"]) == (18, 22)


def test_overlapping_spreads_are_a_tie_listing_the_tied_cells():
    v = verdict([
        cell_row("w", "a", [10, 8, 15]),
        cell_row("w", "b", [12, 11, 14]),
        cell_row("w", "c", [40, 39, 41]),
    ])
    assert v["verdict"] == "tie" and v["cell"] == "a" and v["candidates"] == 3
    assert v["tied_cells"].split("; ") == ["a", "b"]


def test_a_tie_includes_any_overlapping_cell_not_only_the_runner_up():
    # b has the second-lowest median but a clean gap; c is noisy and reaches below a's max
    v = verdict([
        cell_row("w", "a", [10, 9, 11]),
        cell_row("w", "b", [12, 11.5, 13]),
        cell_row("w", "c", [20, 10.5, 30]),
    ])
    assert v["verdict"] == "tie" and v["runner_up"] == "b"
    assert v["tied_cells"].split("; ") == ["a", "c"]


def test_touching_ranges_and_single_equal_repeats_are_ties():
    assert verdict([cell_row("w", "a", [10, 9, 11]), cell_row("w", "b", [13, 11, 14])])["verdict"] == "tie"
    assert verdict([cell_row("w", "a", [10]), cell_row("w", "b", [10])])["verdict"] == "tie"


def test_baselines_never_win_but_are_compared_by_range():
    v = verdict([
        cell_row("w", "mlx", [5, 4, 6], kind="mlx-lm-prompt-cache"),
        cell_row("w", "a", [10, 9, 11]),
        cell_row("w", "b", [20, 19, 21]),
    ])
    assert v["cell"] == "a" and v["verdict"] == "winner" and v["vs_mlxlm"] == "slower"
    v = verdict([cell_row("w", "mlx", [10, 8, 12], kind="mlx-lm-prompt-cache"), cell_row("w", "a", [9, 7, 10])])
    assert v["verdict"] == "only cell" and v["vs_mlxlm"] == "overlap"


def test_winners_per_workload_and_old_runs_without_ranges():
    cells = pd.DataFrame([
        cell_row("x", "a", [1, 1, 1]), cell_row("x", "b", [2, 2, 2]),
        cell_row("y", "a", [5, 4, 6]), cell_row("y", "b", [5, 4, 6]),
    ])
    best = winners(cells).set_index("workload")
    assert list(best["verdict"]) == ["winner", "tie"]
    old = cells.drop(columns=["ttft_p50_ms_min", "ttft_p50_ms_max"])  # a run from before ranges
    assert list(winners(old)["verdict"]) == ["no spread", "tie"]


def test_one_repeat_has_no_spread_and_calls_no_winner():
    v = verdict([cell_row("w", "a", [10]), cell_row("w", "b", [12])])
    assert v["verdict"] == "no spread" and v["cell"] == "a" and v["runner_up"] == "b"
    text = report.render_markdown(pd.DataFrame([cell_row("w", "a", [10]), cell_row("w", "b", [12])]), {})
    assert "no winner is called" in text and "| w | no spread | a |" in text


# ---------------------------------------------------------------- median / spread columns
def synthetic_requests(repeat_ttfts: dict[str, list[list[float]]], workload: str = "shared-prefix") -> pd.DataFrame:
    """requests.csv rows: per cell, per repeat, the measured TTFTs (one warm-up request first)."""
    rows = []
    for cell, repeats in repeat_ttfts.items():
        kind = cell if cell in ("no-cache", "mlx-lm-prompt-cache") else "kvtool"
        policy, writer, durability = cell.split("/") if kind == "kvtool" else (None, None, None)
        for repeat, ttfts in enumerate(repeats):
            for i, ttft in enumerate([max(ttfts) * 2, *ttfts]):
                ids = {"workload": workload, "cell": cell, "kind": kind, "ssd_policy": policy, "writer": writer,
                       "ssd_durability": durability, "block_size": 16, "ram_bytes": 0, "repeat": repeat,
                       "request": i, "phase": "populate" if i == 0 else "query", "group": "d0", "measured": i > 0}
                hit = 0 if kind == "no-cache" or i == 0 else 64
                res = type("R", (), {"prompt_tokens": 80 + 16 * i, "cached_tokens": hit, "ram_hit_tokens": hit,
                                     "ssd_hit_tokens": 0, "prefill_tokens": 80 + 16 * i - hit, "ttft_ms": ttft,
                                     "prefill_ms": ttft * 0.8, "write_path_ms": 1.0 + repeat, "blocks_written": 1,
                                     "decode_tokens_per_s": 100.0})
                rows.append(metrics.request_row(ids, res))
    return metrics.requests_frame(rows)


def runs_of(requests: pd.DataFrame) -> pd.DataFrame:
    runs = requests[["workload", "cell", "repeat"]].drop_duplicates()
    return runs.assign(bytes_written=2048, tokens_stored=64, shutdown_clean=True, drain_verified=True,
                       page_cache_dropped=None, wall_s=1.0)


def test_cells_carry_the_median_and_range_over_the_repeats():
    req = synthetic_requests({
        "no-cache": [[50, 50], [52, 52], [51, 51]],
        "write_through/async/best_effort": [[10, 12], [20, 20], [14, 16]],  # per-repeat p50: 11, 20, 15
    })
    cells = metrics.aggregate_cells(req, runs_of(req), kv_bytes_per_token=16)
    assert list(cells.columns) == metrics.CELL_COLUMN_NAMES
    for name in metrics.SPREAD_METRICS:
        assert {f"{name}_min", f"{name}_max", f"{name}_lo", f"{name}_hi"} <= set(cells.columns)
    a = cells.set_index("cell").loc["write_through/async/best_effort"]
    assert (a["ttft_p50_ms"], a["ttft_p50_ms_min"], a["ttft_p50_ms_max"]) == (15, 11, 20)
    assert (a["write_path_ms_mean"], a["write_path_ms_mean_min"], a["write_path_ms_mean_max"]) == (2, 1, 3)
    # 3 repeats: the 95 % bootstrap interval of the median is their min-max
    assert (a["ttft_p50_ms_lo"], a["ttft_p50_ms_hi"]) == (11, 20)
    assert a["repeats"] == 3 and a["requests"] == 6
    assert a["ttft_vs_no_cache"] == pytest.approx(51 / 15)
    documented = {name for name, _ in metrics.CELL_COLUMNS}
    readme = (Path(__file__).resolve().parent.parent / "results" / "README.md").read_text()
    assert all(f"`{name}`" in readme for name in documented), "results/README.md documents every cells.csv column"


# ---------------------------------------------------------------------- report and charts
def make_run(tmp_path: Path, *, requests: bool = True, workloads: tuple[str, ...] = ("shared-prefix", "restart")) -> Path:
    """A run directory built from constructed requests: 2 baselines, the 12 kvtool cells."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    rng = np.random.default_rng(0)
    cells_ttfts = {"no-cache": 60.0, "mlx-lm-prompt-cache": 9.0}
    for policy in ("evict_only", "write_through"):
        for writer in ("sync", "async"):
            for durability in ("best_effort", "persistent", "durable"):
                cells_ttfts[f"{policy}/{writer}/{durability}"] = 10.0 + rng.uniform(0, 4)
    frames = []
    for workload in workloads:
        frames.append(synthetic_requests(
            {c: [list(t * rng.uniform(0.9, 1.1, size=3)) for _ in range(3)] for c, t in cells_ttfts.items()},
            workload,
        ))
    req = pd.concat(frames, ignore_index=True)
    cells = metrics.aggregate_cells(req, runs_of(req), kv_bytes_per_token=16)
    cells.to_csv(run_dir / "cells.csv", index=False)
    if requests:
        req.to_csv(run_dir / "requests.csv", index=False)
    (run_dir / "run.json").write_text(json.dumps({"run_id": "constructed", "machine": {}, "model": {"spec": "tiny"}}))
    return run_dir


@pytest.mark.parametrize("workloads", [("shared-prefix", "restart"), ("a", "b", "c", "d", "e")])
@pytest.mark.slow
def test_report_writes_one_legible_chart_per_question(tmp_path, workloads):
    run_dir = make_run(tmp_path, workloads=workloads)
    written = write_report(run_dir)
    assert [p.name for p in written.charts] == list(report.CHARTS)
    for path in written.charts:
        width, height = Image.open(path).size
        assert 500 <= width <= 1700 and 300 <= height <= 1600, (path.name, width, height)
    text = written.markdown.read_text()
    assert "## Winning cell per workload" in text and "interval top < runner-up's interval bottom" in text
    assert "median [95% interval]" in text and "not an SSD tier" in text
    for name in report.CHARTS:
        assert f"]({name})" in text


def test_report_without_requests_csv_skips_only_the_prompt_length_chart(tmp_path):
    run_dir = make_run(tmp_path, requests=False)
    written = write_report(run_dir)
    assert [p.name for p in written.charts] == ["ttft_per_workload.png", "write_path_by_durability.png"]
    assert "needs it" in written.markdown.read_text()


def test_report_flags_too_few_repeats_and_ties(tmp_path):
    cells = pd.DataFrame([cell_row("w", "a", [10]), cell_row("w", "b", [10]), cell_row("w", "nc", [50], kind="no-cache")])
    text = report.render_markdown(cells, {"run_id": "x"})
    assert "Caution: 1 repeat per cell" in text
    assert "| w | tie (2 of 2) | a, b |" in text


# ---------------------------------------------------------------------- bad run directories
def _bad_dirs(tmp_path: Path) -> dict[str, Path]:
    good = make_run(tmp_path)
    out: dict[str, Path] = {"missing": tmp_path / "nope"}

    def variant(name: str, edit) -> None:
        d = tmp_path / name
        d.mkdir()
        for f in ("cells.csv", "requests.csv", "run.json"):
            (d / f).write_bytes((good / f).read_bytes())
        edit(d)
        out[name] = d

    (tmp_path / "empty-dir").mkdir()
    out["empty-dir"] = tmp_path / "empty-dir"
    out["a-file"] = good / "run.json"
    variant("no-run-json", lambda d: (d / "run.json").unlink())
    variant("no-cells", lambda d: (d / "cells.csv").unlink())
    variant("empty-cells", lambda d: (d / "cells.csv").write_text(""))
    variant("header-only-cells", lambda d: (d / "cells.csv").write_text("workload,cell,kind,ttft_p50_ms\n"))
    variant("binary-cells", lambda d: (d / "cells.csv").write_bytes(bytes(range(256)) * 4))
    variant("wrong-columns", lambda d: (d / "cells.csv").write_text("a,b\n1,2\n"))
    variant("ragged-cells", lambda d: (d / "cells.csv").write_text('workload,cell,kind,ttft_p50_ms\nw,"a,kvtool,1\n'))
    variant("empty-requests", lambda d: (d / "requests.csv").write_text(""))
    variant("wrong-requests", lambda d: (d / "requests.csv").write_text("x\n1\n"))
    variant("bad-json", lambda d: (d / "run.json").write_text("{not json"))
    variant("json-list", lambda d: (d / "run.json").write_text("[1, 2]"))
    variant("binary-json", lambda d: (d / "run.json").write_bytes(b"\xff\xfe\x00"))
    return out


def test_load_run_rejects_bad_directories_with_a_kvtool_error(tmp_path):
    for name, path in _bad_dirs(tmp_path).items():
        with pytest.raises(ReportError) as info:
            load_run(path)
        assert isinstance(info.value, KVToolError) and info.value.exit_code == 2, name
        assert "\n" not in str(info.value), name


def report_app() -> typer.Typer:
    """The root group of `kvtool` with only the bench commands (independent of the others)."""
    app = typer.Typer(cls=common.KVToolGroup, add_completion=False, pretty_exceptions_enable=False)

    @app.callback()
    def _root() -> None:
        pass

    cmd_bench.register(app)
    return app


def test_cli_report_on_bad_directories_is_one_error_line_exit_2(tmp_path):
    app = report_app()
    runner = CliRunner()
    for name, path in _bad_dirs(tmp_path).items():
        result = runner.invoke(app, ["report", str(path)])
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert result.exit_code == 2, (name, result.output, result.exception)
        assert len(lines) == 1 and lines[0].startswith("error: "), (name, result.stderr)
        assert "Traceback" not in result.output and result.stdout == "", name


@pytest.mark.slow
def test_cli_report_prints_verdicts_with_ranges(tmp_path):
    run_dir = make_run(tmp_path)
    runner = CliRunner()
    result = runner.invoke(report_app(), ["report", str(run_dir), "--json"])
    assert result.exit_code == 0, (result.output, result.exception)
    doc = json.loads(result.stdout)
    assert {w["workload"] for w in doc["winners"]} == {"shared-prefix", "restart"}
    assert all(w["verdict"] in ("winner", "tie") and w["ttft_p50_ms_lo"] <= w["ttft_p50_ms_hi"]
               for w in doc["winners"])
    result = runner.invoke(report_app(), ["report", str(run_dir)])
    assert result.exit_code == 0 and "95% bootstrap interval" in result.stdout


# ------------------------------------------------------------------- the drawing, read back
def _luminance(color) -> float:
    """WCAG relative luminance of a matplotlib colour."""
    from matplotlib.colors import to_rgb

    channels = [c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4 for c in to_rgb(color)]
    return 0.2126 * channels[0] + 0.7152 * channels[1] + 0.0722 * channels[2]


def _contrast(a, b) -> float:
    hi, lo = sorted((_luminance(a), _luminance(b)), reverse=True)
    return (hi + 0.05) / (lo + 0.05)


def _is_grey(color) -> bool:
    from matplotlib.colors import to_rgb

    r, g, b = to_rgb(color)
    return abs(r - g) < 0.02 and abs(g - b) < 0.02 and 0.3 < r < 0.9


def known_cells() -> pd.DataFrame:
    """Two workloads with known values: `outlier` has a clear leader, bars near and far and one
    whisker far past the rest; `all-tie` has every kvtool interval overlapping."""
    rows = [cell_row("outlier", "no-cache", [400, 390, 410], kind="no-cache"),
            cell_row("outlier", "mlx-lm-prompt-cache", [90, 85, 95], kind="mlx-lm-prompt-cache"),
            cell_row("outlier", "evict_only/sync/best_effort", [8.78, 8.32, 9.0]),
            cell_row("outlier", "evict_only/sync/durable", [80.7, 70, 90]),
            cell_row("outlier", "evict_only/async/durable", [97.0, 93, 120]),
            cell_row("outlier", "write_through/sync/best_effort", [199, 150, 230]),
            cell_row("outlier", "write_through/sync/durable", [222, 180, 260]),
            cell_row("outlier", "write_through/async/durable", [275, 68, 9000])]  # the far whisker
    rows += [cell_row("all-tie", "no-cache", [60, 59, 61], kind="no-cache")]
    rows += [cell_row("all-tie", c, [10 + i, 8, 15]) for i, c in enumerate(
        ["evict_only/sync/best_effort", "evict_only/sync/durable", "evict_only/async/durable",
         "write_through/sync/best_effort", "write_through/sync/durable", "write_through/async/durable"])]
    return pd.DataFrame(rows)


def test_ttft_chart_reads_back_legibly():
    from kvtool.bench import report_charts
    from kvtool.bench.verdicts import NO_DIFFERENCE, num, summary_lines, value_range

    cells = known_cells()
    fig = report_charts.plot_ttft(cells, winners(cells))
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    panels = [ax for ax in fig.axes if ax.patches]
    assert len(panels) == 2
    assert len({ax.get_xlim() for ax in panels}) == 1 and len({ax.get_xscale() for ax in panels}) == 1, \
        "every panel shares one scale"
    for ax in panels:
        box = ax.get_window_extent(renderer)
        face = ax.get_facecolor()
        assert "ms" in ax.get_xlabel()
        bars = list(ax.patches)
        values = [t for t in ax.texts if t.get_text().strip()]
        assert len(values) == len(bars), (ax.get_title(), [t.get_text() for t in values])
        for text in values:  # every label inside the axes, readable on what is behind it
            ext = text.get_window_extent(renderer)
            assert box.x0 - 1 <= ext.x0 and ext.x1 <= box.x1 + 1, (text.get_text(), ext, box)
            patch = text.get_bbox_patch()
            behind = patch.get_facecolor() if patch is not None else face
            assert _contrast(text.get_color(), behind) >= 4.5, text.get_text()
        for coll in ax.collections:  # whiskers inside the axes, readable on the bars and the background
            for seg in coll.get_segments():
                xs = ax.transData.transform(seg)[:, 0]
                assert (xs >= box.x0 - 1).all() and (xs <= box.x1 + 1).all(), ax.get_title()
            for color in coll.get_colors():
                assert _contrast(color, face) >= 3
                assert all(_contrast(color, bar.get_facecolor()) >= 3 for bar in bars)
    tie_panel = next(ax for ax in panels if ax.get_title(loc="left").startswith("all-tie"))
    kv_bars = [p for p in tie_panel.patches if not p.get_hatch() and p.get_width() > 0]
    greys = [p for p in tie_panel.patches if _is_grey(p.get_facecolor())]
    assert len(greys) == 6 and len(kv_bars) == 6, "the tied cells are grey"
    lines = summary_lines(cells)
    best = winners(cells).set_index("workload")
    tie = best.loc["all-tie"]
    assert f"all-tie: {NO_DIFFERENCE}" in "\n".join(lines)
    assert f"their intervals {num(8)}–{num(15)} ms" in "\n".join(lines)
    assert tie["tie_lo"] == 8 and tie["tie_hi"] == 15
    lead = best.loc["outlier"]
    assert lead["verdict"] == "winner" and lead["cell"] == "evict_only/sync/best_effort"
    assert "outlier: winner evict_only/sync/best_effort" in lines
    assert any(value_range(8.78, 8.32, 9.0) in line for line in lines)
    assert any("tie" in ax.get_title(loc="left") for ax in panels)


def test_bench_progress_says_cells_done_left_and_an_eta_from_the_mean_cell_time():
    """The sweep's progress lines (no terminal: `runner._progress_bar` is a `LineProgress`) count
    cells done and left and give an ETA from the mean time per cell (`kvtool.progress`, shared
    with warm, validate and prune)."""
    import io

    from kvtool.progress import LineProgress

    stream = io.StringIO()
    with LineProgress("kvtool bench", interval=0, stream=stream) as bar:
        task = bar.add_task("shared-prefix evict_only/sync/best_effort r0", total=42)
        bar.update(task, completed=3)
    first = stream.getvalue().splitlines()[0]
    assert "shared-prefix evict_only/sync/best_effort r0 3/42 | 39 left, ETA" in first, first


def test_write_path_and_prompt_length_charts_share_scales_and_fit_no_slopes(tmp_path):
    from kvtool.bench import report_charts

    run_dir = make_run(tmp_path)
    cells, requests, run = load_run(run_dir)
    fig = report_charts.plot_write_path(cells, run)
    panels = [ax for ax in fig.axes if ax.patches]
    for unit in ("ms", "MB/s"):  # the request thread's time and the writer's total output, one scale each
        column = [ax for ax in panels if f"({unit}," in ax.get_xlabel()]
        assert len(column) == 2 and len({ax.get_xlim() for ax in column}) == 1 and column[0].get_xscale() == "log"
    assert not any("% of one core" in ax.get_xlabel() for ax in fig.axes)  # no writer CPU counter in this run
    # with the writer's CPU counter (a run from a writer that records it): a third column, % of one core
    kv = cells[cells["kind"] == "kvtool"]
    run = {**run, "cell_runs": [{"workload": w, "cell": c, "wall_s": 2.0, "bytes_written": 10**6,
                                 "counters": {"ssd_bytes_written": 10**6, "writer_cpu_us": 10**5 * (1 + i % 3)}}
                                for i, (w, c) in enumerate(zip(kv["workload"], kv["cell"]))]}  # fmt: skip
    fig = report_charts.plot_write_path(cells, run)
    cpu = [ax for ax in fig.axes if ax.patches and "% of one core" in ax.get_xlabel()]
    assert len(cpu) == 2 and len({ax.get_xlim() for ax in cpu}) == 1  # one per workload, one scale
    labels = {t.get_text().split(" ")[0] for ax in cpu for t in ax.texts}
    assert {"5.00", "10.0", "15.0"} <= labels, labels  # 0.1-0.3 s of CPU over 2 s: 5-15 % of a core
    fig = report_charts.plot_ttft_vs_prompt(requests, run)
    (ax,) = fig.axes
    texts = [t.get_text() for t in ax.texts] + [fig.get_suptitle()]
    assert ax.get_yscale() == "log" and "ms" in ax.get_ylabel()
    assert not any("slope" in t or "least-squares" in t for t in texts)
    assert len(ax.containers) == 3, "one median line with intervals per cache state"


def test_ttft_vs_prompt_value_labels_never_overlap():
    """Close medians of the three cache states in one length bucket (and in neighbouring
    buckets) get their value labels one below another, not printed over each other."""
    from kvtool.bench import report_charts

    rng = np.random.default_rng(0)
    rows = [dict(prompt_tokens=n + int(rng.integers(-5, 5)), ttft_ms=ms * f * rng.uniform(0.97, 1.03), cached_tokens=c,
                 kind=kind, repeat=r % 3)
            for n, ms in [(192, 90), (272, 92), (278, 91), (320, 71), (528, 19), (544, 27)]
            for kind, c, f in [("kvtool", 100, 1.0), (report_charts.MLXLM, 100, 0.98), ("kvtool", 0, 1.02)]
            for r in range(24)]  # fmt: skip
    fig = report_charts.plot_ttft_vs_prompt(pd.DataFrame(rows), None)
    renderer = fig.canvas.get_renderer()
    fig.draw(renderer)
    (ax,) = fig.axes
    boxes = [t.get_window_extent(renderer) for t in ax.texts]
    assert len(boxes) >= 6 * 3  # one per state and length bucket
    overlaps = [(a, b) for i, a in enumerate(boxes) for b in boxes[i + 1 :] if a.overlaps(b)]
    assert not overlaps, f"{len(overlaps)} value labels print over another"
