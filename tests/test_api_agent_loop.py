"""A coding agent's loop on `kvtool serve`'s Messages API, against plain `mlx_lm.server`.

Ten turns over one long system prompt with tool definitions (at least 12k tokens on the tiny
preset's tokenizer, the tool-calling template of `tests/test_api_messages.py` on both servers):
each turn re-sends the transcript, the model's own previous reply (as the server returned it) and
a tool result of 300-800 tokens. From turn 2 on, the tokens the cache gives
(`cache_read_input_tokens`) cover the previous turn's prompt, and its reply as far as plain
`mlx_lm.server`'s own prompt cache (which keeps the KV of generated tokens) reuses it, minus at
most one block; in some turns the hit reaches into the reply (its KV is stored where the reply
probe measured decode KV equal to prefill KV: this CPU backend). Every turn's greedy output
equals plain `mlx_lm.server`'s for the same conversation sent as chat completions, and so does
its prompt length.

Why not "the whole previous reply": a reply is reused only up to where its text, rendered again
in the next prompt, tokenizes to the ids that were generated. The random-weight preset often
generates a non-canonical tokenization of its own text (e.g. `lves` `called` re-encoded as
`l` `v` ...), so the re-render departs after a few tokens, for kvtool and mlx-lm alike; a trained
model's replies are mostly canonical.
"""

from __future__ import annotations

import pytest

from kvtool.cache import reply
from tests.test_api_messages import TOOL_TEMPLATE, TOOLS
from tests.test_serve_hostile import server_stats, start_kvtool, start_mlx_lm
from tests.test_serve_http import DEMO

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

BS = 16  # the kvtool server's block size
TURNS = 10
REPLY_TOKENS = 48
MIN_SYSTEM_TOKENS = 12_000
GREEDY = {"temperature": 0.0}


def system_prompt() -> str:
    """Numbered copies of the demo document: a long, deterministic system prompt."""
    return "You are a coding agent. Use the tools.\n" + "\n".join(
        f"## Part {i}\n{DEMO}" for i in range(6))


def tool_result(turn: int) -> str:
    """A deterministic tool result of a few hundred tokens, different for every turn."""
    words = DEMO.split()
    start = (turn * 97) % (len(words) - 400)
    return f"Tool output {turn}:\n" + " ".join(words[start:start + 150 + 40 * (turn % 6)])


def openai_tools() -> list[dict]:
    return [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                              "parameters": t["input_schema"]}} for t in TOOLS]


@pytest.mark.slow
def test_ten_agent_turns_reuse_prompt_and_reply_and_equal_mlx_lm(tmp_path):
    cfg = tmp_path / "kv.toml"
    cfg.write_text(f"block_size = {BS}\n")
    system = system_prompt()
    kv = start_kvtool(tmp_path, "agent", "--config", str(cfg), "--chat-template", TOOL_TEMPLATE)
    plain = None
    try:
        if not server_stats(kv)["reply_kv_reuse"]["enabled"] and not reply.device().startswith("cpu"):
            pytest.skip(f"decode KV differs from prefill KV here: {server_stats(kv)['reply_kv_reuse']}")
        plain = start_mlx_lm(tmp_path, "--chat-template", TOOL_TEMPLATE)
        ant = anthropic.Anthropic(base_url=kv.url, api_key="unused", max_retries=0, timeout=600)
        oai = openai.OpenAI(base_url=plain.url + "/v1", api_key="unused", max_retries=0, timeout=600)
        assert ant.messages.count_tokens(model="tiny", system=system, tools=TOOLS,
                                         messages=[{"role": "user", "content": "Start."}]).input_tokens >= MIN_SYSTEM_TOKENS
        messages: list[dict] = [{"role": "user", "content": "Start with the first file."}]
        previous = None  # (prompt tokens, reply tokens) of the turn before
        beyond = 0  # turns whose hit reached into the previous reply
        for turn in range(TURNS):
            got = ant.messages.create(model="tiny", system=system, tools=TOOLS, messages=messages,
                                      max_tokens=REPLY_TOKENS, extra_body=GREEDY)
            want = oai.chat.completions.create(model="default_model", max_tokens=REPLY_TOKENS, temperature=0.0,
                                               tools=openai_tools(),
                                               messages=[{"role": "system", "content": system}, *messages])
            text = "".join(b.text for b in got.content if b.type == "text")
            prompt = got.usage.input_tokens + got.usage.cache_read_input_tokens
            assert text == want.choices[0].message.content, turn  # greedy output: plain mlx_lm.server's
            assert prompt == want.usage.prompt_tokens, turn  # the same prompt through both APIs
            cached, plain_cached = got.usage.cache_read_input_tokens, want.usage.prompt_tokens_details.cached_tokens
            print(f"turn {turn}: prompt {prompt}, kvtool cached {cached}, mlx_lm.server cached {plain_cached}")
            if previous is not None:
                # the last turn's prompt always; its reply as far as mlx-lm's own cache (which keeps the
                # KV of generated tokens) reuses it: where the reply re-renders to the ids generated
                assert cached >= previous[0], (turn, previous, got.usage)
                assert cached >= plain_cached - BS, (turn, plain_cached, got.usage)
                beyond += cached > previous[0]
            previous = (prompt, got.usage.output_tokens)
            messages += [{"role": "assistant", "content": text}, {"role": "user", "content": tool_result(turn)}]
        assert server_stats(kv)["adapter"]["reply_blocks_stored"] > 0
        assert beyond > 0  # reply KV was reused, not only prompt KV
    finally:
        kv.stop()
        if plain is not None:
            plain.stop()
