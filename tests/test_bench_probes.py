"""Smoke tests of the serving probes under bench_configs/ (no timing asserted): the in-process
replay of the server's prompt-cache calls runs on both caches; the side-by-side serving probe
documents its variants."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_adapter_calls_replays_both_caches():
    proc = subprocess.run([sys.executable, str(REPO / "bench_configs" / "adapter_calls.py"), "--n", "2"],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if " ms" in line]
    assert [line.split()[0] for line in lines] == ["kvtool", "mlx-lm"]
    assert all(("fetch" in line and "segment insert" in line and "final insert" in line) for line in lines)


def test_serve_paired_help_names_the_variants():
    proc = subprocess.run([sys.executable, str(REPO / "bench_configs" / "serve_paired.py"), "--help"],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert "--servers" in proc.stdout and "--clients" in proc.stdout and "--passes" in proc.stdout


def test_ram_hit_build_times_the_three_ways_on_equal_kv():
    proc = subprocess.run([sys.executable, str(REPO / "bench_configs" / "ram_hit_build.py"), "--tokens", "200,300",
                           "--rounds", "2", "--json"], capture_output=True, text=True, timeout=120, cwd=REPO)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    res = json.loads(proc.stdout)["results"]
    assert sorted(res) == ["200", "300"]
    assert all(set(r) == {"run views", "per block", "mlx-lm", "store"} and r["run views"]["vs_mlx_lm"] > 0 for r in res.values())
    assert all(set(r["store"]) == {"slice_blocks_ms", "promote_slices_ms", "to_host_ms", "place_ms"} for r in res.values())
