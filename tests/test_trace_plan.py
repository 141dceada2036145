"""Mooncake traces and `kvtool bench-plan`: the shipped samples parse, a malformed line is one
`error:` line with its line number (exit 2), hit rates of a hand-made trace match the ones worked
out by hand below, and the same trace served through a real `PrefixCache` leaves the same blocks in
RAM and on SSD as the plan's replay."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache
from typer.testing import CliRunner

from kvtool.bench.trace import (
    SAMPLES_DIR,
    TRACE_BLOCK_TOKENS,
    TRACE_DIR_ENV,
    TraceError,
    TraceRequest,
    read_trace,
    resolve_trace,
)
from kvtool.bench.trace_plan import KV_SHAPES, PlanPoint, kv_bytes_per_token, replay
from kvtool.cli import app as app_module
from kvtool.units import MAX_BYTES
from tests.store_helpers import contains

if not app_module.app.registered_commands:
    app_module._register()
runner = CliRunner()

GOOD = {"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [0, 1]}


def test_the_shipped_samples_parse(monkeypatch):
    monkeypatch.delenv(TRACE_DIR_ENV, raising=False)
    names = sorted(p.name for p in SAMPLES_DIR.glob("*.jsonl"))
    assert names == ["conversation_trace.jsonl", "synthetic_trace.jsonl"]
    for name in ("conversation", "synthetic"):
        requests = read_trace(resolve_trace(name))
        assert len(requests) == 300
        assert all(len(r.hash_ids) == -(-r.input_length // TRACE_BLOCK_TOKENS) for r in requests)
    assert (SAMPLES_DIR / "LICENSE-APACHE").is_file() and "kvcache-ai/Mooncake" in (SAMPLES_DIR / "README.md").read_text()


@pytest.mark.parametrize("line,needle", [
    ("{not json", "not JSON"),
    ("[1, 2]", "not a JSON object"),
    (json.dumps({k: v for k, v in GOOD.items() if k != "timestamp"}), "missing field 'timestamp'"),
    (json.dumps({**GOOD, "timestamp": "0"}), "timestamp must be an integer"),
    (json.dumps({**GOOD, "timestamp": -1}), "timestamp must be >= 0"),
    (json.dumps({**GOOD, "input_length": 0, "hash_ids": []}), "input_length must be >= 1"),
    (json.dumps({**GOOD, "input_length": True}), "input_length must be an integer"),
    (json.dumps({**GOOD, "output_length": 1.5}), "output_length must be an integer"),
    (json.dumps({**GOOD, "output_length": -2}), "output_length must be >= 0"),
    (json.dumps({k: v for k, v in GOOD.items() if k != "hash_ids"}), "missing field 'hash_ids'"),
    (json.dumps({**GOOD, "hash_ids": "0,1"}), "hash_ids must be a list"),
    (json.dumps({**GOOD, "hash_ids": [0, -1]}), "hash_ids must hold non-negative integers, got -1"),
    (json.dumps({**GOOD, "hash_ids": [0, "1"]}), "hash_ids must hold non-negative integers, got '1'"),
    (json.dumps({**GOOD, "hash_ids": [0, 1, 2]}), "3 hash_ids for input_length 1000"),
])  # fmt: skip
def test_a_malformed_line_is_one_error_line_with_its_number(tmp_path, line, needle):
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join([json.dumps(GOOD)] * 3 + [line]) + "\n")
    res = runner.invoke(app_module.app, ["bench-plan", "--trace", str(path), "--ssd", "0"])
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert res.exit_code == 2, res.output
    assert len(lines) == 1 and lines[0].startswith("error: ") and f"t.jsonl:4: {needle}" in lines[0], res.stderr


def test_a_missing_trace_or_bad_size_exits_2(tmp_path):
    for args in (["--trace", "toolagent", "--trace-dir", str(tmp_path)], ["--trace", "conversation", "--ram", "lots"],
                 ["--trace", "conversation", "--kv-bytes-per-token", "huge"]):  # fmt: skip
        res = runner.invoke(app_module.app, ["bench-plan", *args])
        assert res.exit_code == 2 and res.stderr.startswith("error: "), (args, res.output)


def test_kv_bytes_per_token_from_a_number_a_shape_or_a_config(tmp_path):
    assert kv_bytes_per_token("1000") == 1000 and kv_bytes_per_token("8b") == 131072 == KV_SHAPES["8b"]
    assert kv_bytes_per_token("70B") == 327680
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 28, "num_attention_heads": 12,
                                                      "num_key_value_heads": 2, "hidden_size": 1536}))  # fmt: skip
    assert kv_bytes_per_token(str(tmp_path)) == 28 * 2 * 128 * 2 * 2
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {  # a newer config: `dtype`, nested
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "dtype": "float32"}}))
    assert kv_bytes_per_token(str(tmp_path)) == 2 * 2 * 32 * 2 * 4
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 2}))
    with pytest.raises(TraceError, match="cannot compute the KV bytes per token"):
        kv_bytes_per_token(str(tmp_path))


def test_the_kv_bytes_of_an_embedded_preset_from_its_config(tmp_path):
    """The one config.json reader (`kvtool.models.limits`) agrees with the preset's own figure,
    and a load workload sizes with it (0 where there is no readable config)."""
    from kvtool.bench.loadworkloads import _kv_bytes_per_token
    from kvtool.models import embedded

    tiny = embedded.PRESETS["tiny"]
    embedded.build_preset(tiny, tmp_path / "tiny")
    assert _kv_bytes_per_token(tmp_path / "tiny") == tiny.kv_bytes_per_token(4) == 1024
    assert _kv_bytes_per_token(tmp_path / "absent") == 0 and _kv_bytes_per_token(None) == 0


def _req(ids: list[int], n: int, t: int = 0) -> TraceRequest:
    return TraceRequest(t, n, 1, tuple(ids))


# Six requests; blocks 4, 7 and 8 are partial last blocks (276, 464 and 76 tokens).
HAND = [_req([1, 2, 3], 1536), _req([1, 2, 4], 1300), _req([5, 6], 1024), _req([1, 2, 3, 7], 2000),
        _req([5, 6, 8], 1100), _req([1, 2, 4], 1300)]  # fmt: skip
PROMPT = 1536 + 1300 + 1024 + 2000 + 1100 + 1300


def _max_by_hand(requests: list[TraceRequest]) -> int:
    """Tokens an unbounded cache serves: each request's leading blocks seen in earlier requests."""
    seen: set[int] = set()
    total = 0
    for r in requests:
        for i, h in enumerate(r.hash_ids):
            if h not in seen:
                break
            total += min(512, r.input_length - 512 * i)
        seen |= set(r.hash_ids)
    return total


def test_plan_hit_rates_match_the_hand_computed_ones():
    """KV bytes per token 1: a block's bytes are its tokens. RAM of 2048 bytes (4 full blocks),
    LRU: r2 hits 1,2 (1024); r3's 5,6 evict 3 and 1; r4 misses (1 is gone) and its store evicts
    2, 4, 5 and 6 while re-inserting 1,2,3,7; r5 evicts 1, 2, 3; r6 misses: 1024 tokens.
    RAM of 3072 bytes (6): r2 1024, r4 1536 (1,2,3; 7 evicts 4), r5 1024 (5,6; 8 evicts 1),
    r6 misses (1 is gone): 3584 tokens. Unbounded: 1024 + 1536 + 1024 + 1300 = 4884."""
    expected_max = _max_by_hand(HAND)
    assert expected_max == 4884
    for ram, hits, whole in ((2048, 1024, 1), (3072, 3584, 3), (MAX_BYTES, 4884, 4)):
        p = PlanPoint("hand", "write_through", ram, 0)
        replay(HAND, p, 1)
        assert (p.ram_hit_tokens, p.ssd_hit_tokens, p.prompt_tokens) == (hits, 0, PROMPT)
        assert p.max_hit_tokens == expected_max and p.hit_rate == pytest.approx(hits / PROMPT)
        assert p.share_of_max == pytest.approx(hits / expected_max)
        assert (p.full_prefix_requests, p.reachable_requests) == (whole, 4)
    p = PlanPoint("hand", "write_through", 0, MAX_BYTES)  # no RAM, an unbounded SSD: every reachable hit from SSD
    replay(HAND, p, 1)
    assert (p.ram_hit_tokens, p.ssd_hit_tokens, p.ssd_read_bytes) == (0, expected_max, expected_max)
    assert p.ssd_written_bytes == 512 * 5 + 276 + 464 + 76  # each distinct block once (1, 2, 3, 5, 6 full)


def test_the_ssd_stand_in_evicts_as_the_budget_does():
    """Blocks of 500 bytes, one segment each, a budget of 2000: a 1000-byte segment that does not
    fit frees least recently used segments down to 5 % below the budget (1900 - 1000 = 900 kept),
    deepest first on a tie; a prefix is as recent as its newest continuation (a2 touched: b1 goes
    first, then a2, deeper than a1 at the same effective access)."""
    from kvtool.bench.trace_plan import ROOT, PlanSsdTier
    from kvtool.kv.blocks import Block
    from kvtool.tiers.base import Put, WritePolicy

    def block(h: str, parent: str, n: int = 500) -> Block:
        return Block(h, parent, np.zeros(1, np.int64), [], [], nbytes=n)

    for touched, kept in ((None, {"b1", "c1"}), ("a1", {"a1", "c1"}), ("a2", {"a1", "c1"})):
        ssd = PlanSsdTier(2000, WritePolicy.THROUGH)
        ssd.put([block("a1", ROOT)], Put.NEW)
        ssd.put([block("a2", "a1")], Put.NEW)
        ssd.now = 10.0
        ssd.put([block("b1", ROOT)], Put.NEW)
        ssd.now = 20.0
        if touched:
            ssd.touch([touched])
        ssd.now = 100.0
        assert ssd.put([block("c1", ROOT, 1000)], Put.NEW) == 1
        assert ssd.resident() == kept, touched
        assert ssd.used == 500 * len(kept) + 500 and ssd.evicted == 4 - len(kept)


def test_cli_json_on_the_sample(monkeypatch, tmp_path):
    monkeypatch.delenv(TRACE_DIR_ENV, raising=False)
    res = runner.invoke(app_module.app, ["bench-plan", "--trace", "synthetic", "--limit", "50", "--ram", "1GiB",
                                         "--ssd", "0,64GiB", "--policy", "write_through,evict_only", "--json",
                                         "--out", str(tmp_path / "plan")])  # fmt: skip
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["kv_bytes_per_token"] == 131072 and doc["traces"]["synthetic"]["requests"] == 50
    points = doc["points"]
    assert len(points) == 4 and all(0 <= p["hit_rate"] <= p["max_hit_rate"] <= 1 for p in points)
    assert points[2]["hit_rate"] >= points[0]["hit_rate"]  # an SSD tier never loses hits here
    assert sorted(Path(f).name for f in doc["files"]) == ["plan.csv", "plan.json", "plan.png"]
    assert len((tmp_path / "plan" / "plan.csv").read_text().splitlines()) == 5
    assert doc["git_commit"] and doc["machine"]["cpu_cores"] >= 1 and doc["machine"]["load_avg"]


def test_plan_chart_marks_the_budgets_and_names_machine_commit_and_trace():
    from kvtool.bench.plan_chart import plot_plan, tokens_label
    from kvtool.bench.trace_plan import PlanPoint

    points = [PlanPoint("conversation", "write_through", 1 << 30, ssd, prompt_tokens=100, ram_hit_tokens=10,
                        ssd_hit_tokens=10 * i, max_hit_tokens=40) for i, ssd in enumerate((0, 1 << 33, 1 << 34))]
    for p in points:
        p.finish()
    doc = {"kv_bytes_per_token": 1024, "traces": {"conversation": {"path": "/x/conversation_trace.jsonl", "requests": 300}},
           "wall_s": 12.0, "git_commit": "0123456789abcdef", "machine": {"cpu_model": "CPU X", "cpu_cores": 2,
                                                                       "ram_bytes": 8 << 30, "load_avg": [1.5, 1.0, 0.5]}}
    fig = plot_plan(doc, points)
    try:
        (ax,) = fig.axes[:1]
        (top,) = ax.child_axes  # the budgets swept, at the capacity each gives
        assert [t.get_text() for t in top.get_xticklabels()] == ["RAM only", "SSD 8.0 GiB", "SSD 16.0 GiB"]
        assert list(top.get_xticks()) == [(1 << 30) / 1024, ((1 << 30) + (1 << 33)) / 1024, ((1 << 30) + (1 << 34)) / 1024]
        assert "conversation" in fig.get_suptitle() and "1,024 KV bytes/token" in fig.get_suptitle()
        foot = fig.get_supxlabel()
        for part in ("CPU X, 2 cores, 8 GiB RAM", "1.50, 1.00, 0.50", "commit 0123456789", "conversation_trace.jsonl (300 requests)"):
            assert part in foot, foot
        assert [t.get_text() for t in ax.texts] == ["10.0%", "20.0%", "30.0%"]  # each point's hit rate
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)
    assert [tokens_label(v) for v in (999, 1e4, 3e6, 1e9)] == ["999", "10k", "3M", "1G"]


# ---------------------------------------------------------------- serving vs plan
N_LAYERS, N_HEADS, HEAD_DIM = 1, 1, 2
TOKEN_BYTES = N_LAYERS * 2 * N_HEADS * HEAD_DIM * 2 + 4  # float16 K and V, plus the int32 token id a Block holds


def _tokens(hash_ids: tuple[int, ...]) -> np.ndarray:
    """Each id's 512 tokens, deterministic from the id (equal ids, equal tokens)."""
    return np.concatenate([np.random.default_rng(h).integers(0, 50_000, TRACE_BLOCK_TOKENS) for h in hash_ids]).astype(np.int32)


def _serve(pc, tokens: np.ndarray) -> None:
    """One request as a server runs it: fetch, prefill (stand-in KV of the whole prompt), store, release."""
    hit = pc.fetch(tokens)
    cache = KVCache()
    kv = mx.array(np.random.default_rng(int(tokens[0])).standard_normal((1, N_HEADS, tokens.size, HEAD_DIM)).astype(np.float16))
    cache.update_and_fetch(kv, kv)
    pc.store(tokens, [cache], hit)
    pc.release(hit)


@pytest.mark.parametrize("policy", ["write_through", "evict_only"])
def test_serving_and_plan_leave_the_same_blocks_resident(tmp_path, policy, monkeypatch):
    """40 requests of the conversation sample (whole blocks) through a real PrefixCache (RAM of 12
    blocks, a synchronous SSD tier) and through the plan: the same blocks in RAM and on SSD."""
    from kvtool.cache.prefix import KVGeometry, PrefixCache
    from kvtool.config import KVToolConfig

    monkeypatch.delenv(TRACE_DIR_ENV, raising=False)
    requests = [TraceRequest(r.timestamp_ms, len(r.hash_ids) * TRACE_BLOCK_TOKENS, 1, r.hash_ids)
                for r in read_trace(resolve_trace("conversation"), 40)]  # fmt: skip
    ram = 12 * TRACE_BLOCK_TOKENS * TOKEN_BYTES
    cfg = KVToolConfig(ssd_cache_dir=tmp_path, ram_bytes=ram, block_size=TRACE_BLOCK_TOKENS, ssd_policy=policy,
                       ssd_async_writes=False)  # fmt: skip
    pc = PrefixCache(cfg, geometry=KVGeometry(N_LAYERS, N_HEADS, HEAD_DIM, "float16"), model_id="m" * 32)
    name_of: dict[str, str] = {}
    for r in requests:
        tokens = _tokens(r.hash_ids)
        hashes, tail = pc.hashes(tokens)
        assert tail is None and len(hashes) == len(r.hash_ids)
        name_of.update(zip(hashes, map(str, r.hash_ids)))
        _serve(pc, tokens)
    assert pc.tiered is not None and pc.tiered.ssd is not None
    served_ram = {name_of[h] for h in name_of if h in pc.tiered.ram}
    served_ssd = {name_of[h] for h in name_of if contains(pc.tiered.ssd, h)}
    pc.close()

    point = PlanPoint("conversation", policy, ram, MAX_BYTES)
    stack = replay(requests, point, TOKEN_BYTES)
    planned_ram = {h for h in map(str, {i for r in requests for i in r.hash_ids}) if h in stack.ram}
    assert stack.backing is not None
    assert served_ram == planned_ram and len(planned_ram) == 12
    assert served_ssd == stack.backing.resident()
    assert point.ram_hit_tokens > 0 and (point.ssd_hit_tokens > 0 or policy == "write_through")
