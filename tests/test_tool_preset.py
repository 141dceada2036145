"""The `tiny-tools` preset (`kvtool.models.tool_preset`): a model that writes a tool call itself.

In process: the preset is bit-identical when built twice; mlx-lm infers its `json_tools` parser
from the preset's chat template; greedy `mlx_lm.generate` / `stream_generate` on any chat prompt
give exactly `TOOL_CALL_TEXT` and stop at the end-of-turn token.

End to end against a real `kvtool serve --model tiny-tools`: the same tool call through the three
APIs. The anthropic SDK's `messages.create` gives a `tool_use` block and stop_reason `tool_use`,
`messages.stream` the `tool_use` block start and an `input_json_delta` and the same final message,
and a round trip (the `tool_result` sent back) a well-formed call again (this model calls the tool
whatever the prompt says); the openai SDK's `responses.create` gives a `function_call` item,
streamed too, and a `function_call_output` round trip; `/v1/chat/completions` gives `tool_calls`
and finish_reason `tool_calls`, streamed too.
"""

from __future__ import annotations

import json
import sys

import mlx.core as mx
import mlx_lm
import pytest

from kvtool.models import embedded, tool_preset
from tests.test_models import digest_files, model_files
from tests.test_serve_hostile import HTTP_TIMEOUT_S, Server

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

PRESET = "tiny-tools"
ARGS = tool_preset.TOOL_ARGUMENTS
WEATHER = {"name": "get_weather", "description": "The weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
ANTHROPIC_TOOLS = [{"name": WEATHER["name"], "description": WEATHER["description"],
                    "input_schema": WEATHER["parameters"]}]
QUESTION = "What is the weather in Rome?"
MAX_TOKENS = 32


# ----------------------------------------------------------------------------- in process
def test_the_preset_is_tiny_with_three_tokens_more_and_is_bit_identical(tmp_path):
    preset = embedded.PRESETS[PRESET]
    tiny = embedded.PRESETS["tiny"]
    assert preset.tool_calling and (preset.num_hidden_layers, preset.hidden_size) == (tiny.num_hidden_layers,
                                                                                      tiny.hidden_size)
    assert embedded.vocab_size(preset) == embedded.vocab_size(tiny) + 3 == 4099
    a = embedded.build_preset(preset, tmp_path / "a")
    b = embedded.build_preset(preset, tmp_path / "b")
    assert digest_files(model_files(a)) == digest_files(model_files(b))
    assert digest_files(model_files(a)) == digest_files(model_files(embedded.model_dir(PRESET)))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes()
    weights = mx.load(str(a / embedded.WEIGHTS_FILE))
    assert weights["lm_head.weight"].shape == (4099, 128)
    assert not mx.any(weights["model.layers.1.self_attn.o_proj.weight"]).item()
    assert mx.any(weights["model.layers.1.self_attn.k_proj.weight"]).item()  # the KV is still computed
    assert int(mx.sum(mx.any(weights["lm_head.weight"] != 0, axis=1)).item()) == 4  # the chain's successors


@pytest.fixture(scope="module")
def loaded():
    return mlx_lm.load(str(embedded.model_dir(PRESET)))


def test_mlx_lm_infers_the_json_tools_parser(loaded):
    _, tokenizer = loaded
    assert tokenizer.has_tool_calling
    assert (tokenizer.tool_call_start, tokenizer.tool_call_end) == ("<tool_call>", "</tool_call>")
    assert tokenizer.tool_parser(tool_preset.TOOL_CALL_BODY) == {"name": "get_weather", "arguments": ARGS}
    # the template is Qwen2.5's: tools in the system turn, calls and results as tagged JSON
    prompt = tokenizer.apply_chat_template([
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
        {"role": "tool", "content": "sunny"}], tools=[{"type": "function", "function": WEATHER}],
        add_generation_prompt=True, tokenize=False)
    assert prompt.startswith("<|im_start|>system\n# Tools\n") and json.dumps(WEATHER) in prompt
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n' \
           '</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n' \
           '<|im_start|>assistant\n' in prompt


@pytest.mark.parametrize("messages, tools", [
    ([{"role": "user", "content": QUESTION}], [{"type": "function", "function": WEATHER}]),
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about the sea."}], None),
])
def test_greedy_decoding_is_the_tool_call_then_eos(loaded, messages, tools):
    model, tokenizer = loaded
    prompt = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    steps = list(mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=MAX_TOKENS))
    assert "".join(s.text for s in steps) == tool_preset.TOOL_CALL_TEXT
    assert [s.token for s in steps][1:4] == tool_preset.call_chain(embedded.model_dir(PRESET) / "tokenizer.json")[2:]
    assert steps[-1].finish_reason == "stop" and steps[-1].token in tokenizer.eos_token_ids and len(steps) == 4
    assert mlx_lm.generate(model, tokenizer, prompt, max_tokens=MAX_TOKENS) == tool_preset.TOOL_CALL_TEXT


def test_each_successor_wins_by_more_than_50_logits(loaded):
    """A margin that makes sampling at temperature 1 follow the chain too (module docstring)."""
    model, _ = loaded
    chain = tool_preset.call_chain(embedded.model_dir(PRESET) / "tokenizer.json")
    for prev, nxt in zip(chain, chain[1:]):
        logits = model(mx.array([[17, 301, prev]]))[0, -1]
        ranked = mx.argsort(-logits)
        assert ranked[0].item() == nxt
        assert abs(logits[nxt].item() - tool_preset.SUCCESSOR_LOGIT) < 1e-3
        assert logits[nxt].item() - logits[ranked[1]].item() > 50.0


# ----------------------------------------------------------------------------- a real kvtool serve
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tool-preset")
    proc = Server([sys.executable, "-m", "kvtool.cli.app", "serve", "--model", PRESET, "--port", "0",
                   "--cache-dir", str(tmp / "cache")], tmp / "serve.log")
    m = proc.wait_for(r"listening on (http://127\.0\.0\.1:(\d+))")
    proc.url, proc.port = m.group(1), int(m.group(2))
    try:
        yield proc
    finally:
        proc.stop()


def claude(server: Server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=HTTP_TIMEOUT_S)


def oai(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=HTTP_TIMEOUT_S)


def without_ids(message) -> dict:
    """The message as a dict without its ids and usage (a repeated prompt is a prefix hit)."""
    doc = message.model_dump()
    doc.pop("id")
    doc.pop("usage")
    for block in doc["content"]:
        block.pop("id", None)
    return doc


def assert_one_tool_use(message) -> None:
    assert message.stop_reason == "tool_use", message
    uses = [b for b in message.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather" and uses[0].input == ARGS and uses[0].id
    assert "".join(b.text for b in message.content if b.type == "text") == ""


@pytest.mark.slow
def test_e2e_messages_create_stream_and_the_round_trip(server):
    c = claude(server)
    question = [{"role": "user", "content": QUESTION}]
    msg = c.messages.create(model=PRESET, max_tokens=MAX_TOKENS, messages=question, tools=ANTHROPIC_TOOLS,
                            extra_body={"temperature": 0.0})
    assert_one_tool_use(msg)
    assert msg.usage.output_tokens == 4  # <tool_call>, the call's JSON, </tool_call>, <|im_end|>

    with c.messages.stream(model=PRESET, max_tokens=MAX_TOKENS, messages=question, tools=ANTHROPIC_TOOLS,
                           extra_body={"temperature": 0.0}) as stream:
        events = list(stream)
        final = stream.get_final_message()
    starts = [e.content_block for e in events if e.type == "content_block_start"]
    assert [b.type for b in starts if b.type == "tool_use"] == ["tool_use"] and starts[-1].name == "get_weather"
    deltas = [e.delta for e in events if e.type == "content_block_delta" and e.delta.type == "input_json_delta"]
    assert json.loads("".join(d.partial_json for d in deltas)) == ARGS
    assert without_ids(final) == without_ids(msg)
    assert final.usage.output_tokens == msg.usage.output_tokens
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == \
        msg.usage.input_tokens + msg.usage.cache_read_input_tokens

    use = next(b for b in msg.content if b.type == "tool_use")
    history = [*question, {"role": "assistant", "content": [b.model_dump() for b in msg.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny, 21 C"}]}]
    again = c.messages.create(model=PRESET, max_tokens=MAX_TOKENS, messages=history, tools=ANTHROPIC_TOOLS,
                              extra_body={"temperature": 0.0})
    assert_one_tool_use(again)  # the model calls the tool whatever the prompt says
    assert again.usage.cache_read_input_tokens > 0  # the first turn's prefix came from kvtool's cache
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens > \
        msg.usage.input_tokens + msg.usage.cache_read_input_tokens + 10  # the call and its result are in it


@pytest.mark.slow
def test_e2e_responses_create_and_stream(server):
    c = oai(server)
    tool = {"type": "function", **WEATHER}
    r = c.responses.create(model=PRESET, input=QUESTION, tools=[tool], max_output_tokens=MAX_TOKENS, temperature=0.0)
    assert r.status == "completed"
    calls = [item for item in r.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and json.loads(calls[0].arguments) == ARGS
    assert calls[0].call_id and r.output_text == ""

    events = list(c.responses.create(model=PRESET, input=QUESTION, tools=[tool], max_output_tokens=MAX_TOKENS,
                                     temperature=0.0, stream=True))
    assert events[-1].type == "response.completed"
    done = [e.item for e in events if e.type == "response.output_item.done" and e.item.type == "function_call"]
    assert len(done) == 1 and done[0].name == "get_weather" and json.loads(done[0].arguments) == ARGS
    args = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(args) == 1 and json.loads(args[0].arguments) == ARGS
    streamed = [item for item in events[-1].response.output if item.type == "function_call"]
    assert [(i.name, i.arguments) for i in streamed] == [(calls[0].name, calls[0].arguments)]

    output = {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny, 21 C"}
    again = c.responses.create(model=PRESET, input=[{"role": "user", "content": QUESTION}, calls[0].model_dump(),
                                                    output], tools=[tool], max_output_tokens=MAX_TOKENS,
                               temperature=0.0)
    called = [item for item in again.output if item.type == "function_call"]
    assert len(called) == 1 and called[0].name == "get_weather" and json.loads(called[0].arguments) == ARGS
    assert again.usage.input_tokens_details.cached_tokens > 0


@pytest.mark.slow
def test_e2e_chat_completions_gives_the_same_call(server):
    chat = oai(server).chat.completions.create(model=PRESET, max_tokens=MAX_TOKENS, temperature=0.0,
                                               messages=[{"role": "user", "content": QUESTION}],
                                               tools=[{"type": "function", "function": WEATHER}])
    choice = chat.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    calls = choice.message.tool_calls
    assert len(calls) == 1 and calls[0].type == "function" and calls[0].id
    assert calls[0].function.name == "get_weather" and json.loads(calls[0].function.arguments) == ARGS
    chunks = list(oai(server).chat.completions.create(model=PRESET, max_tokens=MAX_TOKENS, temperature=0.0,
                                                      messages=[{"role": "user", "content": QUESTION}],
                                                      tools=[{"type": "function", "function": WEATHER}], stream=True))
    deltas = [call for c in chunks if c.choices for call in c.choices[0].delta.tool_calls or []]
    assert [(d.function.name, json.loads(d.function.arguments)) for d in deltas] == [("get_weather", ARGS)]
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]
    assert "Received tools but model does not support tool calling" not in server.text()
