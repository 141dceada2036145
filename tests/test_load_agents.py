"""The `agents` load workload (`kvtool.bench.loadagents`): agent loops whose turns carry the reply.

Fast: the plan is deterministic and sized in tokens (system prompt, tool results), the phases
split before, at and after T/2 with `restart`, a transcript grows by reply + tool result, the prompt-token check
stops at an agent's first differing output, config errors name the field, the shipped config
parses. Slow: 2 agents x 3 turns on a small system prompt through a real `kvtool serve`
(Messages API, `anthropic` SDK) and a plain `mlx_lm.server` (chat completions, `openai` SDK) with
`run_serve_load`: equal outputs and prompt tokens turn by turn, kvtool's prefix hits from turn 2.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from kvtool.bench.loadagents import EMPTY_REPLY, prompt_token_mismatches
from kvtool.bench.loadcell import load_serve_load, parse_serve_load, run_serve_load
from kvtool.bench.loadworkloads import build_load_workload, validate_load_params
from kvtool.config import ConfigError
from kvtool.models.loader import resolve_spec

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tokenizer():
    from mlx_lm.utils import load_tokenizer

    return load_tokenizer(resolve_spec("tiny")[0])


def test_plan_is_deterministic_and_sized_in_tokens(tokenizer):
    params = {"system_tokens": 600, "turns": 4, "result_min_tokens": 300, "result_max_tokens": 400}
    a = build_load_workload("agents", params, tokenizer, seed=1, max_tokens=8)
    b = build_load_workload("agents", params, tokenizer, seed=1, max_tokens=8)
    assert a.agents is not None and b.agents is not None
    assert a.agents.system == b.agents.system and '"name": "tool_0"' in a.agents.system
    assert abs(len(tokenizer.encode(a.agents.system)) - 600) <= 6
    assert a.phases == ("turn",) and a.measured == ("turn", "after", "rewarm") and len(a.requests) == 4
    for t in range(1, 4):
        text = a.agents.user_text(1, t)
        assert text == b.agents.user_text(1, t) and text.startswith(f"Tool result (agent 1, call {t})")
        assert 300 - 6 <= len(tokenizer.encode(text)) <= 400 + 6
    assert a.agents.user_text(0, 1) != a.agents.user_text(1, 1)
    other = build_load_workload("agents", params, tokenizer, seed=2, max_tokens=8)
    assert other.agents is not None and other.agents.user_text(1, 1) != a.agents.user_text(1, 1)


def test_restart_splits_the_turns_and_a_transcript_grows_by_reply_and_tool_result(tokenizer):
    w = build_load_workload("agents", {"system_tokens": 256, "turns": 4, "restart": True}, tokenizer, 0, 8)
    assert w.agents is not None
    assert w.phases == ("before", "after", "rewarm") and w.restart_before == "after"
    assert [r.phase for r in w.requests] == ["before", "before", "after", "rewarm"]  # as multi-turn's phases
    assert set(w.phases[1:]) <= set(w.measured) and "before" not in w.measured
    two = build_load_workload("agents", {"system_tokens": 256, "turns": 2, "restart": True}, tokenizer, 0, 8)
    assert two.phases == ("before", "after")
    with pytest.raises(ConfigError, match="turns >= 2"):
        build_load_workload("agents", {"system_tokens": 256, "turns": 1, "restart": True}, tokenizer, 0, 8)
    assert w.agents.agent_count(16) == 16
    batch = w.agents.batch("kvtool", 2)
    assert batch.kind == "messages" and w.agents.batch("mlx-lm", 2).kind == "chat" and batch.agents == 2
    first = batch.messages(0, 0)
    assert [m["role"] for m in first] == ["user"] and first[0]["content"] == w.agents.user_text(0, 0)
    batch.transcripts[0].append({"role": "assistant", "content": "reply one"})
    second = batch.messages(0, 1)
    assert second[:2] == [*first, {"role": "assistant", "content": "reply one"}]
    assert second[2] == {"role": "user", "content": w.agents.user_text(0, 1)}
    assert batch.messages(0, 1) == second  # asking again does not append twice
    assert EMPTY_REPLY


def test_prompt_token_check_stops_at_the_first_differing_output():
    def row(server, key, text, prompt):
        return {"workload": "agents", "server": server, "clients": 2, "repeat": 0, "key": key, "text": text,
                "prompt_tokens": prompt, "error": None}

    rows = [row("kvtool", "a0t0", "x", 100), row("mlx-lm", "a0t0", "x", 100),
            row("kvtool", "a0t1", "y", 200), row("mlx-lm", "a0t1", "z", 201),   # counted, then diverged
            row("kvtool", "a0t2", "y", 300), row("mlx-lm", "a0t2", "y", 305),   # not counted
            row("kvtool", "a1t0", "x", 100), row("mlx-lm", "a1t0", "x", 100)]
    assert prompt_token_mismatches(pd.DataFrame(rows)) == 1
    assert prompt_token_mismatches(pd.DataFrame(rows[:2])) == 0


@pytest.mark.parametrize(("params", "field"), [
    ({"turns": 0}, "serve_load.workloads.agents.turns"),
    ({"restart": 1}, "serve_load.workloads.agents.restart"),
    ({"result_min_tokens": 500, "result_max_tokens": 400}, "serve_load.workloads.agents.result_max_tokens"),
    ({"colour": 1}, "serve_load.workloads.agents.colour"),
])
def test_agents_config_errors_name_the_field(params, field):
    with pytest.raises(ConfigError) as exc:
        validate_load_params("agents", params)
    assert exc.value.field == field


def test_shipped_agents_config_parses():
    spec = load_serve_load(REPO / "bench_configs" / "serve_agents.toml")
    assert spec.servers == ("kvtool", "mlx-lm") and set(spec.workloads) == {"agents"}
    assert validate_load_params("agents", spec.workloads["agents"])["turns"] >= 2


@pytest.mark.slow
def test_two_agents_three_turns_through_both_servers(tmp_path):
    doc = {"serve_load": {
        "name": "agents-test", "model": "tiny", "repeats": 1, "clients": [2], "servers": ["kvtool", "mlx-lm"],
        "max_wall_s": 300, "start_timeout_s": 120, "kvtool": {"block_size": 16, "ram_bytes": "64MiB"},
        "workloads": {"agents": {"turns": 3, "system_tokens": 512, "result_min_tokens": 40, "result_max_tokens": 80,
                                 "max_tokens": 16}},
    }}  # fmt: skip
    run = run_serve_load(parse_serve_load(doc), tmp_path, run_id="run", progress=False)
    assert run.ok, run.report.problems
    rows = [json.loads(line) for line in (run.run_dir / "requests.jsonl").read_text().splitlines()]
    by = {(r["server"], r["key"]): r for r in rows}
    keys = [f"a{a}t{t}" for a in range(2) for t in range(3)]
    assert len(rows) == 12 and all(r["error"] is None for r in rows)
    for key in keys:
        k, m = by[("kvtool", key)], by[("mlx-lm", key)]
        assert k["text"] == m["text"] and k["completion_tokens"] == m["completion_tokens"], key
        assert k["prompt_tokens"] == m["prompt_tokens"] > 512, key
    for a in range(2):
        prompts = [by[("kvtool", f"a{a}t{t}")]["prompt_tokens"] for t in range(3)]
        assert prompts[0] < prompts[1] < prompts[2]  # each turn carries the reply and a tool result
        for t in (1, 2):
            assert by[("kvtool", f"a{a}t{t}")]["cached_tokens"] > 0, (a, t)
    cells = pd.read_csv(run.run_dir / "cells.csv")
    kv = cells[cells["server"] == "kvtool"].iloc[0]
    assert kv["outputs_compared"] == 6 and kv["output_mismatches"] == 0
    assert kv["cached_tokens_per_request"] > 0
