"""Mooncake traces replayed against real servers (`kvtool.bench.trace_replay`, the `trace` workload).

Fast tests check the block text on the tiny preset's own tokenizer (a block is the same tokens
wherever it stands, a block boundary merges nothing, the chat template keeps the block tokens
whole), the scaling and the window. The slow one replays 20 requests of the conversation sample
through a real `kvtool serve` and a plain `mlx_lm.server` (`run_serve_load`): equal outputs, and
kvtool's prefix hits are > 0 where the trace repeats block ids and never longer than the prompt
shared with another request. No timing assertions.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from kvtool.bench.loadcell import parse_serve_load, run_serve_load
from kvtool.bench.loadworkloads import build_load_workload, validate_load_params
from kvtool.bench.trace import SAMPLES_DIR, read_trace
from kvtool.bench.trace_replay import BlockText, output_tokens, scaled_tokens, single_token_words
from kvtool.config import ConfigError
from kvtool.models.loader import resolve_spec

SAMPLE = SAMPLES_DIR / "conversation_trace.jsonl"
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tokenizer():
    from mlx_lm.utils import load_tokenizer

    return load_tokenizer(resolve_spec("tiny")[0])


def _sublist_at(seq: list[int], part: list[int]) -> int:
    return next((i for i in range(len(seq) - len(part) + 1) if seq[i:i + len(part)] == part), -1)


def test_block_text_is_stable_tokens_and_boundaries_merge_nothing(tokenizer):
    words = single_token_words(tokenizer)
    assert len(words) >= 64 and all(tokenizer.encode(w) == [i] for w, i in words[:50])
    blocks = BlockText(tokenizer, 32)
    a, ids_a = blocks.prompt([7], 32)
    b, ids_b = blocks.prompt([9], 32)
    assert a != b and tokenizer.encode(a) == ids_a.tolist() and len(ids_a) == 32
    assert BlockText(tokenizer, 32).prompt([7], 32)[0] == a  # from the id alone: another instance, same text
    both, ids = blocks.prompt([7, 9], 64)
    assert both == a + b and tokenizer.encode(both) == ids_a.tolist() + ids_b.tolist()  # no merge at the boundary
    cut, ids_cut = blocks.prompt([7, 9], 40)
    assert tokenizer.encode(cut) == ids.tolist()[:40] and both.startswith(cut)
    templated = tokenizer.apply_chat_template([{"role": "user", "content": both}], add_generation_prompt=True)
    assert _sublist_at(list(templated), ids.tolist()) > 0  # the template keeps the block tokens whole
    with pytest.raises(ValueError):
        blocks.prompt([7], 33)


def test_lengths_scale_with_the_block_and_keep_the_block_count():
    assert scaled_tokens(512, 32) == 32 and scaled_tokens(513, 32) == 33 and scaled_tokens(1, 32) == 1
    for n in (1, 511, 512, 513, 6758, 87169):
        blocks = -(-n // 512)
        assert (blocks - 1) * 32 < scaled_tokens(n, 32) <= blocks * 32
    assert scaled_tokens(6758, 512) == 6758
    assert output_tokens(500, 0.0625, 0) == 31 and output_tokens(500, 0.0625, 8) == 8 and output_tokens(0, 1.0, 0) == 1


def test_mooncake_workload_follows_the_trace(tokenizer):
    trace = read_trace(SAMPLE)
    params = {"path": str(SAMPLE), "block_tokens": 32, "requests": 20, "max_output_tokens": 4, "speedup": 2.0}
    w = build_load_workload("trace", params, tokenizer, 0, 8)
    assert w.params["format"] == "mooncake" and [r.key for r in w.requests] == [f"r{i}" for i in range(20)]
    assert w == build_load_workload("trace", params, tokenizer, 5, 8)  # the text depends on the ids, not the seed
    texts = [r.messages[0]["content"] for r in w.requests]
    for r, t, req in zip(trace, texts, w.requests):
        assert len(tokenizer.encode(t)) == scaled_tokens(r.input_length, 32)
        assert req.max_tokens == min(4, max(1, r.output_length)) and req.arrival_s == r.timestamp_ms / 1000 / 2
    first = BlockText(tokenizer, 32).prompt([0], 32)[0]
    assert all(t.startswith(first) for t in texts)  # every request of the sample starts with block 0
    assert len({t[len(first):len(first) + 40] for t in texts}) == 20  # and goes its own way after it
    late = build_load_workload("trace", {**params, "start_s": 3.0, "end_s": 9.0, "requests": 0}, tokenizer, 0, 8)
    inside = [i for i, r in enumerate(trace) if 3000 <= r.timestamp_ms < 9000]
    assert [r.key for r in late.requests] == [f"r{i}" for i in inside]
    assert late.requests[0].arrival_s == 0.0  # a later window starts at its first request
    by_index = build_load_workload("trace", {**params, "start": 5, "end": 8}, tokenizer, 0, 8)
    assert [r.key for r in by_index.requests] == ["r5", "r6", "r7"]


def test_shared_prefix_blocks_keeps_requests_whose_head_repeats(tokenizer):
    params = {"path": str(SAMPLE), "block_tokens": 16, "shared_prefix_blocks": 2, "max_output_tokens": 2}
    w = build_load_workload("trace", params, tokenizer, 0, 8)
    trace = read_trace(SAMPLE)
    heads = [trace[int(r.key[1:])].hash_ids[:2] for r in w.requests]
    assert w.requests and all(heads.count(h) >= 2 for h in heads)


@pytest.mark.parametrize("params, field", [
    ({"format": "csv"}, "serve_load.workloads.trace.format"),
    ({"start_s": -1}, "serve_load.workloads.trace.start_s"),
    ({"start": 4, "end": 2}, "serve_load.workloads.trace.end"),
    ({"block_tokens": 0}, "serve_load.workloads.trace.block_tokens"),
    ({"speedup": 0}, "serve_load.workloads.trace.speedup"),
])
def test_trace_window_errors_name_the_field(params, field):
    with pytest.raises(ConfigError) as info:
        validate_load_params("trace", {"path": "x.jsonl", **params})
    assert info.value.field == field


def test_prompt_traces_take_the_window_and_refuse_block_options(tokenizer, tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"t": t, "prompt": f"p{t}"}) + "\n" for t in (0, 1, 2, 3)))
    w = build_load_workload("trace", {"path": str(trace), "start": 1, "requests": 2, "speedup": 2.0}, tokenizer, 0, 3)
    assert w.params["format"] == "prompts"
    assert [(r.messages[0]["content"], r.arrival_s) for r in w.requests] == [("p1", 0.0), ("p2", 0.5)]
    with pytest.raises(ConfigError) as info:
        build_load_workload("trace", {"path": str(trace), "block_tokens": 32}, tokenizer, 0, 3)
    assert info.value.field == "serve_load.workloads.trace.block_tokens"


def test_shipped_trace_config_parses():
    from kvtool.bench.loadcell import load_serve_load

    spec = load_serve_load(REPO / "bench_configs" / "serve_trace.toml")
    assert spec.servers == ("kvtool", "mlx-lm") and spec.model == "tiny"
    assert (spec.base_dir / spec.workloads["trace"]["path"]).resolve() == SAMPLE.resolve()


# ------------------------------------------------------------------------------------ real servers
@pytest.mark.slow
def test_conversation_sample_replays_through_both_servers(tmp_path, tokenizer):
    doc = {"serve_load": {
        "name": "trace-test", "model": "tiny", "repeats": 1, "clients": [2], "servers": ["kvtool", "mlx-lm"],
        "max_wall_s": 300, "start_timeout_s": 120, "kvtool": {"block_size": 4, "ram_bytes": "64MiB"},
        "workloads": {"trace": {"path": str(SAMPLE), "block_tokens": 8, "requests": 20, "max_output_tokens": 4,
                                "speedup": 100.0}},
    }}  # fmt: skip
    run = run_serve_load(parse_serve_load(doc), tmp_path, run_id="run", progress=False)
    assert run.ok
    cells = pd.read_csv(run.run_dir / "cells.csv")
    kv = cells[cells["server"] == "kvtool"].iloc[0]
    assert kv["outputs_compared"] == 20 and kv["output_mismatches"] == 0 and not kv["cell_failed"]
    rows = [json.loads(line) for line in (run.run_dir / "requests.jsonl").read_text().splitlines()]
    kv_rows = {r["key"]: r for r in rows if r["server"] == "kvtool"}
    assert len(kv_rows) == 20 and all(r["error"] is None for r in kv_rows.values())
    w = build_load_workload("trace", doc["serve_load"]["workloads"]["trace"], tokenizer, 0, 4)
    ids = {r.key: list(tokenizer.apply_chat_template(list(r.messages), add_generation_prompt=True)) for r in w.requests}
    trace = read_trace(SAMPLE, limit=20)
    repeated = [f"r{i}" for i, r in enumerate(trace) if any(r.hash_ids[0] == o.hash_ids[0] for o in trace[:i])]
    assert repeated and sum(kv_rows[k]["cached_tokens"] for k in repeated) > 0  # the trace's repeats hit
    for key, row in kv_rows.items():  # a hit never covers more than the prompt shares with another one
        shared = max(_common(ids[key], ids[other]) for other in ids if other != key)
        assert 0 <= row["cached_tokens"] <= shared, (key, row["cached_tokens"], shared)
    batches = pd.read_csv(run.run_dir / "batches.csv")
    assert batches.loc[batches["server"] == "kvtool", "kvtool_cached_tokens"].iloc[0] > 0


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n
