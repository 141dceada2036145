"""The remote dimension of `kvtool bench` sweeps, on the tiny model and real redis-server processes:
cells named and configured per `remote_policy`, a 2-cell sweep whose second host reads the first
host's prompts from the remote tier (a server the bench starts itself, or one given in `[cache]`,
its password never written to run.json), namespaces removed between cells."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import redis

from kvtool.bench import runner
from kvtool.bench.sweep import load_sweep, parse_sweep
from kvtool.config import ConfigError
from kvtool.engine import Engine
from tests import redis_servers
from tests.redis_servers import AUTH_PASSWORD

redis_auth = redis_servers.redis_auth
REPO = Path(__file__).resolve().parent.parent
BS = 32


def two_cells(**top) -> dict:
    """A sweep of 2 kvtool cells (remote off / write_through) on the restart workload, the replay
    on a new host."""
    return {
        "name": "remote-micro", "model": "tiny", "repeats": 1, "max_tokens": 2, "baselines": [],
        "restart_host": "new", **top,
        "cache": {"block_size": BS, "ram_bytes": "1MiB", **top.pop("cache", {})},
        "grid": {"ssd_policy": ["write_through"], "writer": ["sync"], "remote_policy": ["off", "write_through"]},
        "workloads": {"restart": {"prompts": 2, "prompt_tokens": 4 * BS, "question_tokens": 8}},
    }  # fmt: skip


def test_remote_axis_names_cells_and_configures_them(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTOOL_REMOTE_URL", "redis://127.0.0.1:1/0")  # never used by a sweep
    plain = parse_sweep({"model": "tiny", "workloads": {"restart": {}}})
    assert not plain.needs_remote and all(c.remote_policy in (None, "off") for c in plain.cells())
    assert plain.base_config(tmp_path).remote_url is None
    spec = parse_sweep(two_cells())
    off, on = spec.cells()
    assert (off.name, on.name) == ("write_through/sync/best_effort/remote-off", "write_through/sync/best_effort/remote-write_through")
    assert spec.needs_remote and spec.restart_host == "new"
    base = spec.base_config(tmp_path).replace(remote_url="redis://h:6379/0")
    assert on.config(base, tmp_path / "c").remote_enabled and not off.config(base, tmp_path / "c").remote_enabled
    assert on.columns()["remote_policy"] == "write_through"
    shipped = load_sweep(REPO / "bench_configs" / "policies_remote.toml")
    assert shipped.repeats >= 3 and {c.remote_policy for c in shipped.cells() if c.kind == "kvtool"} == {
        "off", "write_through", "on_evict"}
    for doc, field in (({"grid": {"remote_policy": ["sometimes"]}}, "grid.remote_policy"),
                       ({"restart_host": "other"}, "restart_host")):  # fmt: skip
        with pytest.raises(ConfigError) as err:
            parse_sweep({"model": "tiny", "workloads": {"restart": {}}, **doc})
        assert err.value.field == field


def _run(tiny_model, spec: dict, out: Path) -> runner.RunResult:
    engine = Engine(tiny_model, parse_sweep(spec).base_config(out).replace(ssd_enabled=False, ram_bytes=0))
    try:
        return runner.run_sweep(parse_sweep(spec), out, run_id="r", engine=engine, progress=False, report=False)
    finally:
        engine.close()


def _check_second_host(result: runner.RunResult) -> None:
    req = result.requests
    replay = req[req["phase"] == "replay"].set_index("remote_policy")
    full = (replay["prompt_tokens"] // BS * BS).loc["write_through"]
    # host B: empty SSD; with the remote tier every full block of host A's prompt is a remote hit
    assert (replay.loc["write_through", "remote_hit_tokens"] >= full - BS).all()
    assert (replay.loc["write_through", "remote_hit_tokens"] > 0).all()
    # without it host B starts cold: nothing of host A's (a shared leading token of its own at most)
    assert (replay.loc["off", "cached_tokens"] < BS).all() and (replay.loc["off", "remote_hit_tokens"] == 0).all()
    cells = result.cells.set_index("remote_policy")
    assert cells.loc["write_through", "remote_hit_rate"] > 0.5 and cells.loc["off", "remote_hit_rate"] == 0
    assert cells["shutdown_clean"].all() and cells["drain_verified"].all()
    facts = {f["remote_policy"]: f for f in result.run["cell_runs"]}
    assert "remote" not in facts["off"] and facts["write_through"]["remote"]["keys_before"] == 0
    assert facts["write_through"]["remote"]["keys_after"] > 0  # its blocks, removed after the cell ran
    assert facts["write_through"]["counters"]["remote_bytes_written"] > 0
    assert facts["write_through"]["counters"]["remote_errors"] == 0
    on_disk = json.loads((result.run_dir / "run.json").read_text())
    assert on_disk["remote"]["restart_host"] == "new"


@pytest.mark.slow
def test_two_cell_sweep_on_a_server_the_bench_starts(tiny_model, tmp_path):
    result = _run(tiny_model, two_cells(), tmp_path)
    _check_second_host(result)
    assert result.run["remote"]["started_by_bench"]
    port = int(result.run["remote"]["url"].rsplit(":", 1)[1].split("/")[0])
    with pytest.raises(redis.ConnectionError):  # stopped with the sweep
        redis.Redis(port=port, socket_connect_timeout=2).ping()


@pytest.mark.slow
def test_two_cell_sweep_on_a_given_server_keeps_its_password(tiny_model, redis_auth, tmp_path):
    client = redis_auth.client()
    client.set("not-kvtool", b"stays")
    result = _run(tiny_model, two_cells(cache={"remote_url": redis_auth.url}), tmp_path)
    _check_second_host(result)
    assert not result.run["remote"]["started_by_bench"]
    text = (result.run_dir / "run.json").read_text()
    assert AUTH_PASSWORD not in text and "***" in text
    assert client.get("not-kvtool") == b"stays" and not list(client.scan_iter(match="kvtool:*"))
