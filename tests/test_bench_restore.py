"""Smoke tests of the restore benchmark (bench_configs/restore.py, kvtool/bench/restore*.py).

The tiniest configuration end to end, checking the output's structure and that every summary
number and ratio is computed from the measured rows. No timing assertion: times belong to the
benchmark, not to the tests. The kvtool side of the load path needs `kvtool.cache.prefix` (skipped until
it exists); the baselines, the TTFT part (current CLI) and dd run now.
"""

from __future__ import annotations

import csv
import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from kvtool.bench import restore, restore_report

REPO = Path(__file__).resolve().parent.parent
TINY = dict(shapes=("tiny",), lengths=(128,), repeats=1)


def _rows(run_dir: Path, name: str = "measurements.csv") -> list[dict]:
    with open(run_dir / name, newline="") as fh:
        return list(csv.DictReader(fh))


def _check_summary_from_rows(run_dir: Path) -> None:
    """Every summary median / min / max is the one of its measured rows."""
    rows, summary = _rows(run_dir), _rows(run_dir, "summary.csv")
    assert summary
    for s in summary:
        ms = [float(r["ms"]) for r in rows if all(r[k] == s[k] for k in restore_report.KEY)]
        assert int(s["n"]) == len(ms) >= 1
        assert float(s["median_ms"]) == pytest.approx(statistics.median(ms))
        assert float(s["min_ms"]) == pytest.approx(min(ms)) and float(s["max_ms"]) == pytest.approx(max(ms))


@pytest.mark.slow
def test_baselines_load_and_writer(tmp_path):
    spec = restore.RestoreSpec(**TINY, parts=("load", "writer"), methods=("raw-read", "mlx-lm"),
                               writer_mb=2, out=tmp_path / "run")
    out = restore.run(spec, log=lambda _: None, command="test")
    assert sorted(p.name for p in out.iterdir()) == ["measurements.csv", "report.md", "run.json", "summary.csv"]
    rows = _rows(out)
    assert list(rows[0]) == restore.COLUMNS
    load = [r for r in rows if r["section"] == "load"]
    cells = {(r["method"], r["cache_state"]) for r in load}
    assert cells == {("raw-read", "cold"), ("raw-read", "warm"), ("mlx-lm", "cold"), ("mlx-lm", "warm"),
                     ("append-after-prefill", "n/a")}
    kv_bytes = 128 * restore.SHAPES["tiny"].bytes_per_token()
    for r in load:
        assert int(r["kv_bytes"]) == kv_bytes == 128 * 2 * 2 * 2 * 32 * 4
        assert float(r["ms"]) > 0
        assert float(r["gbps"]) == pytest.approx(kv_bytes / float(r["ms"]) / 1e6)
        if r["method"] != "append-after-prefill":
            assert r["kv_ok"] == "True"  # crc of the bytes read / loaded == crc of the KV written
            assert float(r["peak_rss_ratio"]) == pytest.approx(int(r["peak_rss_bytes"]) / kv_bytes)
    for r in load:
        if r["cache_state"] == "cold":
            assert float(r["resident_before"]) <= 0.01
        elif r["cache_state"] == "warm":
            assert float(r["resident_before"]) == 1.0
    writer = {r["method"] for r in rows if r["section"] == "writer"}
    assert writer == {"dd-fdatasync", "python-write", "python-write+fdatasync"}
    _check_summary_from_rows(out)
    report = (out / "report.md").read_text()
    assert "### Load path: `tiny` KV, float32" in report and "## Restore targets" in report
    assert json.loads((out / "run.json").read_text())["command"] == "test"
    assert not (out / "data").exists()  # data files removed


@pytest.mark.slow
def test_ttft_with_current_cli(tmp_path):
    spec = restore.RestoreSpec(**TINY, parts=("ttft",), states=("warm",), out=tmp_path / "run")
    out = restore.run(spec, log=lambda _: None)
    rows = _rows(out)
    assert {(r["method"], r["cache_state"]) for r in rows} == {
        ("recompute", "n/a"), ("kvtool-ssd-hit", "warm"), ("mlx-lm-load+last", "warm")}
    by = {r["method"]: r for r in rows}
    assert int(by["recompute"]["ssd_hit_tokens"]) == 0
    assert int(by["kvtool-ssd-hit"]["ssd_hit_tokens"]) > 0
    assert int(by["mlx-lm-load+last"]["cached_tokens"]) == 127
    # the same greedy first token from recompute, the SSD hit and mlx-lm's prompt cache
    assert len({by[m]["first_token"] for m in ("recompute", "kvtool-ssd-hit", "mlx-lm-load+last")}) == 1
    assert all(r["kv_ok"] == "True" for r in rows)
    _check_summary_from_rows(out)
    hit, mlx = (float(by[m]["ms"]) for m in ("kvtool-ssd-hit", "mlx-lm-load+last"))
    assert f"{hit / mlx:.2f}×" in (out / "report.md").read_text()


@pytest.mark.slow
def test_kvtool_synthetic_restore(tmp_path):
    spec = restore.RestoreSpec(**TINY, parts=("load", "writer"), methods=("kvtool",), kvtool_api="prefix",
                               writer_mb=2, out=tmp_path / "run")
    out = restore.run(spec, log=lambda _: None)
    rows = [r for r in _rows(out) if r["method"] in ("kvtool", "kvtool-writer")]
    assert {(r["method"], r["cache_state"]) for r in rows} == {("kvtool", "cold"), ("kvtool", "warm"),
                                                               ("kvtool-writer", "n/a")}
    for r in rows:
        assert r["kvtool_api"] == "prefix"
        if r["method"] == "kvtool":
            assert r["kv_ok"] == "True" and int(r["cached_tokens"]) in (127, 128)  # a full hit may trim one
    _check_summary_from_rows(out)


def _fake_rows() -> list[dict]:
    rows = []
    for method, cold, warm in (("raw-read", [10, 12, 11], [2, 2, 2]), ("mlx-lm", [20, 40, 30], [5, 6, 4]),
                               ("kvtool", [50, 60, 40], [9, 8, 10])):
        for state, values in (("cold", cold), ("warm", warm)):
            for rep, ms in enumerate(values):
                rows.append(dict({c: "" for c in restore.COLUMNS}, section="load", shape="qwen0.5b", dtype="float32",
                                 prompt_tokens=4096, kv_bytes=100_000_000, method=method, cache_state=state,
                                 repeat=rep, ms=float(ms), peak_rss_ratio=1.0 if method == "kvtool" else ""))
    return rows


def test_report_ratios_come_from_medians():
    summary = restore_report.summarize(_fake_rows())
    text = restore_report.render(summary, {"spec": {"repeats": 3}, "kvtool_api": "prefix"})
    # cold medians: raw 11, mlx-lm 30, kvtool 50 -> kvtool/mlx-lm 1.67x, kvtool/raw 0.22x
    assert "| 4,096 | 100.0 | cold | 11.0 (10.0–12.0) | 30.0 (20.0–40.0) | 50.0 (40.0–60.0) |" in text
    assert "| 1.67× | 0.22× |" in text
    assert "| 1.80× | 0.22× |" in text  # warm: 9 / 5, 2 / 9
    targets = {t: (m, st) for t, m, st in restore_report.target_rows(restore_report.Summary(summary))}
    raw = next(v for k, v in targets.items() if k.startswith("Cold restore"))
    assert raw[0] == "qwen0.5b float32 4096: 22%" and raw[1].startswith("**not met**")
    rss = next(v for k, v in targets.items() if k.startswith("Peak RSS"))
    assert rss[1] == "**met**"


@pytest.mark.slow
def test_cli_help():
    proc = subprocess.run([sys.executable, str(REPO / "bench_configs" / "restore.py"), "--help"],
                          capture_output=True, text=True, check=True)
    assert "--lengths" in proc.stdout and "--kvtool-api" in proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("blocks", [False, True], ids=["alternated", "blocks"])
def test_restore_steady_runs_and_checks_kv(tmp_path, blocks):
    """The in-process restore comparison restores the stored KV exactly (its crc check would
    exit non-zero) and reports both medians, alone and with the first decode step's append,
    with the restorers alternated or in blocks (each timed `--iters` times either way)."""
    out = tmp_path / "steady.json"
    subprocess.run([sys.executable, str(REPO / "bench_configs" / "restore_steady.py"), "--lengths", "300",
                    "--iters", "4", "--warmup", "0", "--json", str(out)] + (["--blocks"] if blocks else []),
                   capture_output=True, text=True, check=True)
    (row,) = json.loads(out.read_text())["rows"]
    assert row["tokens"] == 300 and row["kv_bytes"] == 300 * 1024 and row["iters"] == 4
    assert row["kvtool_ms"]["n"] == row["mlx-lm_ms"]["n"] == 4
    assert row["kvtool_ms"]["median"] > 0 and row["mlx-lm_ms"]["median"] > 0
    assert row["kvtool_over_mlxlm"] == pytest.approx(row["kvtool_ms"]["median"] / row["mlx-lm_ms"]["median"])
    for side in ("kvtool", "mlx-lm"):  # each restore plus its first decode step's append
        assert row[f"{side}+append_ms"]["min"] > row[f"{side}_ms"]["min"]
    assert row["with_first_append"] == pytest.approx(row["kvtool+append_ms"]["median"] / row["mlx-lm+append_ms"]["median"])
