"""The OpenAI Responses API on `kvtool serve` (`kvtool.server.api_responses`).

Pure translation: a Responses request → the chat-completions body mlx-lm runs; mlx-lm's
`chat.completion` → a `response` and its chunk stream → `response.*` events, each parsed back by
the openai SDK's own pydantic models (`Response`, the `ResponseStreamEvent` union); bad requests
→ 400 with OpenAI's error shape.
"""

from __future__ import annotations

import json

import pytest

from kvtool.server import validation
from kvtool.server.api_responses import ResponsesApi, ResponsesStream, to_chat
from kvtool.server.validation import RequestError

openai = pytest.importorskip("openai")
from openai.types.responses import Response, ResponseStreamEvent  # noqa: E402
from pydantic import TypeAdapter  # noqa: E402

EVENTS = TypeAdapter(ResponseStreamEvent)
API = ResponsesApi()
USAGE = {"prompt_tokens": 40, "completion_tokens": 6, "total_tokens": 46, "prompt_tokens_details": {"cached_tokens": 32}}


def completion(content, finish="stop", tool_calls=None, reasoning=None, usage=USAGE) -> dict:
    """A `chat.completion` as mlx-lm's `generate_response` builds it (non-streamed)."""
    message = {"role": "assistant", "content": content}
    if reasoning:
        message["reasoning"] = reasoning
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"id": "chatcmpl-1", "system_fingerprint": "x", "object": "chat.completion", "model": "default_model",
            "created": 1700000000, "choices": [{"index": 0, "finish_reason": finish, "message": message}],
            "usage": usage}


def chunk(finish=None, **delta) -> dict:
    """A `chat.completion.chunk` as mlx-lm streams it."""
    return {"id": "chatcmpl-1", "system_fingerprint": "x", "object": "chat.completion.chunk", "model": "default_model",
            "created": 1700000000,
            "choices": [{"index": 0, "finish_reason": finish, "delta": {"role": "assistant", **delta}}]}


USAGE_CHUNK = {"id": "chatcmpl-1", "object": "chat.completion", "model": "default_model", "created": 1700000000,
               "choices": [], "usage": USAGE}
CALL = {"function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}, "type": "function", "id": "call-1"}


def refusal(body: dict) -> str:
    with pytest.raises(RequestError) as info:
        API.to_chat(body)
    assert info.value.status == 400
    return info.value.message


# --------------------------------------------------------------------------- request → chat
def test_a_string_input_is_one_user_message_and_the_sampling_fields_map():
    body = {"model": "default_model", "input": "Hello", "instructions": "Be brief.", "max_output_tokens": 12,
            "temperature": 0.0, "top_p": 0.9, "metadata": {"k": "v"}, "store": False, "parallel_tool_calls": True,
            "reasoning": {"effort": "low"}, "include": []}
    assert API.to_chat(body) == {
        "model": "default_model", "max_tokens": 12, "temperature": 0.0, "top_p": 0.9,
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]}


def test_items_become_chat_messages_with_tool_calls_and_tool_results():
    body = {"model": "m", "stream": True, "input": [
        {"role": "developer", "content": "Use tools."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather "},
                                                        {"type": "input_text", "text": "in Paris?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "18 C"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "noon"}]},
        {"type": "function_call", "call_id": "c3", "name": "get_time", "arguments": "{}"},
    ], "tools": [{"type": "function", "name": "get_weather", "description": "Weather of a city",
                  "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
                 {"type": "function", "name": "get_time"}]}
    chat = API.to_chat(body)
    assert chat["stream"] is True and chat["stream_options"] == {"include_usage": True}
    assert chat["messages"] == [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "18 C"},
        {"role": "tool", "tool_call_id": "c2", "content": "noon"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c3", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
    ]
    assert chat["tools"] == [
        {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                          "parameters": body["tools"][0]["parameters"]}},
        {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]
    # the chat body passes kvtool's own request checks unchanged
    assert validation.check_request(chat, "/v1/chat/completions", validation.Limits(model_names=("m",))) is chat


def test_tool_choice_none_sends_no_tools_and_other_tool_types_are_dropped():
    chat = to_chat({"input": "hi", "tool_choice": "none", "tools": [{"type": "function", "name": "f"}]})
    assert "tools" not in chat and chat["model"] == "default_model"
    chat = to_chat({"input": "hi", "tools": [{"type": "web_search"}, {"type": "custom", "name": "apply_patch"},
                                             {"type": "function", "name": "f"}]})
    assert [t["function"]["name"] for t in chat["tools"]] == ["f"]
    assert "tools" not in to_chat({"input": "hi", "tools": [{"type": "file_search", "vector_store_ids": []}]})


@pytest.mark.parametrize("body, message", [
    ({}, "input: Field required"),
    ({"input": 5}, "input: must be a string or a list"),
    ({"input": [1]}, "input[0]: must be an object with a string type"),
    ({"input": [{"type": "web_search_call"}]}, "input[0]: unknown type 'web_search_call'"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role: Input should be"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type: Input should be 'input_text' or 'output_text'"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": 5}]},
     "input[0].output: must be a string or a list"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{oops"}]},
     "input[0].arguments: not valid JSON"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input: no message to answer"),
    ({"input": "x", "temperature": "0.5"}, "temperature: Input should be a valid number"),
    ({"input": "x", "stream": "yes"}, "stream: Input should be a valid boolean"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens: Input should be greater than or equal to 1"),
    ({"input": "x", "tools": [{"type": "function", "description": "no name"}]}, "tools[0].name: Field required"),
    ({"input": "x", "tools": [5]}, "tools[0]: must be an object with a string type"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice: Input should be 'auto' or 'none'"),
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id is not supported: kvtool serve keeps "
                                                       "no responses; resend the whole conversation"),
])
def test_bad_requests_are_400_naming_the_field(body, message):
    assert refusal(body).startswith(message)


def test_errors_have_openais_shape():
    body = API.error_body(400, "input: Field required")
    assert body == {"error": {"message": "input: Field required", "type": "invalid_request_error",
                              "param": None, "code": None}}
    assert API.error_body(404, "model 'x' is not served here")["error"]["code"] == "model_not_found"
    assert API.error_body(503, "generation stopped")["error"]["type"] == "server_error"
    assert API.error_body(401, "invalid or missing API key")["error"]["code"] == "invalid_api_key"
    assert API.error_body(400, "max_tokens: Input should be less than or equal to 8")["error"]["message"] == \
        "max_output_tokens: Input should be less than or equal to 8"  # kvtool's chat check, in this API's terms


# --------------------------------------------------------------------------- chat → response
def test_a_completion_becomes_a_response_the_sdk_parses():
    r = Response.model_validate(API.from_chat(completion("Hello there.")))
    assert r.id.startswith("resp_") and r.object == "response" and r.status == "completed"
    assert r.output_text == "Hello there." and [o.type for o in r.output] == ["message"]
    assert r.output[0].id.startswith("msg_") and r.output[0].role == "assistant"
    assert r.usage.input_tokens == 40 and r.usage.output_tokens == 6 and r.usage.total_tokens == 46
    assert r.usage.input_tokens_details.cached_tokens == 32 and r.usage.output_tokens_details.reasoning_tokens == 0
    assert r.model == "default_model" and r.created_at == 1700000000


def test_tool_calls_and_reasoning_become_output_items():
    chat = completion(None, "tool_calls", tool_calls=[CALL, {**CALL, "id": "call-2"}], reasoning="The user wants weather.")
    r = Response.model_validate(API.from_chat(chat))
    assert [o.type for o in r.output] == ["reasoning", "function_call", "function_call"]
    assert r.output[0].content[0].text == "The user wants weather."
    call = r.output[1]
    assert (call.call_id, call.name, json.loads(call.arguments)) == ("call-1", "get_weather", {"city": "Paris"})
    assert r.output[2].call_id == "call-2" and r.status == "completed" and r.output_text == ""


def test_a_length_stop_is_incomplete_at_max_output_tokens():
    r = Response.model_validate(API.from_chat(completion("cut", "length")))
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].status == "incomplete"


def test_no_text_and_no_call_is_one_empty_message():
    r = Response.model_validate(API.from_chat(completion(None)))
    assert [o.type for o in r.output] == ["message"] and r.output_text == ""


# --------------------------------------------------------------------------- stream
def run_stream(chunks: list[dict]) -> list:
    """Feed `chunks` and end; every event parsed by the SDK's union, its name its `type`."""
    stream, events = API.stream(), []
    assert isinstance(stream, ResponsesStream)
    for c in chunks:
        events += stream.feed(c)
    events += stream.end()
    parsed = [EVENTS.validate_python(data) for _, data in events]
    assert [e.type for e in parsed] == [name for name, _ in events]
    assert [e.sequence_number for e in parsed] == list(range(len(parsed)))
    return parsed


def test_a_text_stream_is_the_sdks_event_sequence():
    events = run_stream([chunk(content="Hel"), chunk(content="lo"), chunk("stop"), USAGE_CHUNK])
    assert [e.type for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    item_id = events[2].item.id
    assert all(e.item_id == item_id for e in events[3:8]) and events[6].text == "Hello"
    final = events[-1].response
    assert final.status == "completed" and final.output_text == "Hello" and final.output[0].id == item_id
    assert final.id == events[0].response.id and events[0].response.status == "in_progress"
    assert final.usage.input_tokens_details.cached_tokens == 32


def test_a_stream_with_reasoning_and_a_tool_call():
    events = run_stream([chunk(reasoning="Think"), chunk(reasoning="ing."), chunk(content="Calling."),
                         chunk("tool_calls", tool_calls=[{**CALL, "index": 0}]), USAGE_CHUNK])
    names = [e.type for e in events]
    assert names[2:8] == ["response.output_item.added", "response.content_part.added",
                          "response.reasoning_text.delta", "response.reasoning_text.delta",
                          "response.reasoning_text.done", "response.content_part.done"]
    assert names[-5:] == ["response.output_item.added", "response.function_call_arguments.delta",
                          "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    final = events[-1].response
    assert [o.type for o in final.output] == ["reasoning", "message", "function_call"]
    assert [e.output_index for e in events if e.type == "response.output_item.done"] == [0, 1, 2]
    assert final.output[2].call_id == "call-1" and events[-3].arguments == '{"city": "Paris"}'
    assert final.output_text == "Calling."


def test_a_stream_cut_at_max_tokens_ends_incomplete_and_an_empty_one_has_a_message():
    cut = run_stream([chunk(content="a"), chunk("length", content="b"), USAGE_CHUNK])
    assert cut[-1].type == "response.incomplete" and cut[-1].response.incomplete_details.reason == "max_output_tokens"
    assert cut[-1].response.output[0].status == "incomplete"
    empty = run_stream([chunk("stop"), USAGE_CHUNK])
    assert empty[-1].response.output_text == "" and [o.type for o in empty[-1].response.output] == ["message"]


# --------------------------------------------------------------------------- end to end
# A real `kvtool serve` on the tiny preset, driven by the openai SDK. The preset's own template
# renders neither tools nor an assistant's tool calls (the call would vanish from the prompt), so
# the server runs with a template that renders both (`--chat-template`, an mlx_lm.server option);
# without tools or calls it renders what the preset's template does. The random tiny model never
# writes a tool call itself: calls in the output are checked by the pure tests above, and end to
# end on the `tiny-tools` preset (`tests/test_tool_preset.py`).
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "{% for call in message.tool_calls or [] %}<tool_call>{{ call.function.name }} "
    "{{ call.function.arguments | tojson }}</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WEATHER_TOOL = {"type": "function", "name": "get_weather", "description": "The weather in a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from tests.test_serve_http import client, start_kvtool
    tmp = tmp_path_factory.mktemp("responses")
    proc = start_kvtool(tmp, "kvtool", "--chat-template", TOOL_TEMPLATE)
    try:
        yield proc, client(proc)
    finally:
        proc.stop()


def greedy(c, input, **kw):
    from tests.test_serve_http import MAX_TOKENS
    return c.responses.create(model="default_model", input=input, max_output_tokens=MAX_TOKENS, temperature=0.0, **kw)


def first_turn():
    from tests.test_serve_http import SYSTEM, USERS
    return [{"role": "developer", "content": SYSTEM}, {"role": "user", "content": USERS[0]}]


@pytest.mark.slow
def test_e2e_plain_and_streamed_give_the_same_greedy_answer(served):
    _, c = served
    r = greedy(c, first_turn())
    assert r.object == "response" and r.id.startswith("resp_") and r.status in ("completed", "incomplete")
    assert r.output_text and r.usage.input_tokens > 100 and r.usage.output_tokens > 0
    events = list(greedy(c, first_turn(), stream=True))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert streamed == final.output_text == r.output_text
    assert final.status == r.status and final.usage.input_tokens == r.usage.input_tokens
    assert final.usage.output_tokens == r.usage.output_tokens


@pytest.mark.slow
def test_e2e_a_cut_answer_is_incomplete(served):
    _, c = served
    r = c.responses.create(model="default_model", input="Count to one hundred.", max_output_tokens=2, temperature=0.0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 2
    events = list(c.responses.create(model="default_model", input="Count to one hundred.", max_output_tokens=2,
                                     temperature=0.0, stream=True))
    assert events[-1].type == "response.incomplete" and events[-1].response.output_text == r.output_text


@pytest.mark.slow
def test_e2e_the_next_turn_is_cached_and_matches_chat_completions(served):
    from tests.test_serve_http import MAX_TOKENS, SYSTEM, USERS
    _, c = served
    answer = greedy(c, first_turn()).output_text
    turn = first_turn() + [{"type": "message", "role": "assistant",
                            "content": [{"type": "output_text", "text": answer}]},
                           {"role": "user", "content": [{"type": "input_text", "text": USERS[1]}]}]
    r = greedy(c, turn)
    assert r.usage.input_tokens_details.cached_tokens > 0  # the first turn's blocks, from kvtool's tiers
    chat = c.chat.completions.create(model="default_model", max_tokens=MAX_TOKENS, temperature=0.0, messages=[
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": USERS[0]},
        {"role": "assistant", "content": answer}, {"role": "user", "content": USERS[1]}])
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.output_tokens == chat.usage.completion_tokens


@pytest.mark.slow
def test_e2e_a_function_call_round_trip(served):
    from tests.test_serve_http import MAX_TOKENS
    _, c = served
    question = {"role": "user", "content": "What is the weather in Paris?"}
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'}
    result = {"type": "function_call_output", "call_id": "call_1", "output": "18 C and sunny"}
    asked = greedy(c, [question], tools=[WEATHER_TOOL])
    answered = greedy(c, [question, call, result], tools=[WEATHER_TOOL])
    assert answered.status in ("completed", "incomplete") and answered.output_text
    # the call and its result are in the prompt: more tokens than the question alone, exactly as
    # many as the same conversation in chat completions, with the same greedy answer
    assert answered.usage.input_tokens > asked.usage.input_tokens + 10
    assert answered.usage.input_tokens_details.cached_tokens > 0
    chat = c.chat.completions.create(model="default_model", max_tokens=MAX_TOKENS, temperature=0.0, messages=[
        question, {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C and sunny"}],
        tools=[{"type": "function", "function": {k: WEATHER_TOOL[k] for k in ("name", "description", "parameters")}}])
    assert answered.usage.input_tokens == chat.usage.prompt_tokens
    assert answered.output_text == chat.choices[0].message.content
    no_tools = greedy(c, [question], tools=[WEATHER_TOOL], tool_choice="none")
    assert no_tools.usage.input_tokens < asked.usage.input_tokens  # tool_choice none: the tools are not sent


def post_raw(url: str, body: dict) -> tuple[int, dict]:
    import urllib.error
    import urllib.request
    request = urllib.request.Request(url + "/v1/responses", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.mark.slow
@pytest.mark.parametrize("body, status, message", [
    ({"model": "default_model", "input": 5}, 400, "input: must be a string or a list"),
    ({"model": "default_model", "input": [{"type": "file_search_call", "id": "x"}]}, 400,
     "input[0]: unknown type 'file_search_call'"),
    ({"model": "default_model", "input": "hi", "max_output_tokens": "many"}, 400, "max_output_tokens: "),
    ({"model": "default_model", "input": "hi", "previous_response_id": "resp_abc"}, 400,
     "previous_response_id is not supported"),
    ({"model": "gpt-nothing", "input": "hi"}, 404, "model 'gpt-nothing' is not served here"),
    ({"model": "default_model", "input": "hi", "max_output_tokens": 10 ** 9}, 400,
     "max_output_tokens: Input should be less than or equal to"),
])
def test_e2e_bad_input_is_openais_error_shape(served, body, status, message):
    proc, c = served
    code, doc = post_raw(proc.url, body)
    assert code == status and set(doc) == {"error"}
    assert set(doc["error"]) == {"message", "type", "param", "code"} and doc["error"]["message"].startswith(message)
    assert doc["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.APIStatusError) as info:
        c.responses.create(**body)
    assert info.value.status_code == status and info.value.body["message"].startswith(message)
    assert greedy(c, "Still there?").output_text  # the server answers after


@pytest.mark.slow
def test_e2e_a_query_string_on_the_openai_routes_is_ignored(served):
    """`/v1/responses?x` and `/v1/messages?beta=true` were answered, `/v1/chat/completions?x` was 404
    "no such route" (a client with a default query, e.g. `api-version`, could not chat)."""
    proc, c = served
    query = openai.OpenAI(base_url=proc.url + "/v1", api_key="unused", max_retries=0, timeout=60,
                          default_query={"api-version": "2024-10-21"})
    messages = [{"role": "user", "content": "Say something."}]
    plain = c.chat.completions.create(model="default_model", messages=messages, max_tokens=4, temperature=0.0)
    asked = query.chat.completions.create(model="default_model", messages=messages, max_tokens=4, temperature=0.0)
    assert asked.choices[0].message.content == plain.choices[0].message.content
    assert query.completions.create(model="default_model", prompt="Say", max_tokens=2, temperature=0.0).usage
    assert query.responses.create(model="default_model", input="Say", max_output_tokens=2).usage.output_tokens == 2


@pytest.mark.slow
def test_e2e_the_api_key_is_required_in_openais_error_shape(tmp_path):
    from tests.test_serve_http import start_kvtool
    proc = start_kvtool(tmp_path, "keyed", "--api-key", "s3cret")
    try:
        wrong = openai.OpenAI(base_url=proc.url + "/v1", api_key="wrong", max_retries=0, timeout=60)
        with pytest.raises(openai.AuthenticationError) as info:
            wrong.responses.create(model="default_model", input="hi", max_output_tokens=2)
        assert info.value.status_code == 401 and info.value.body["code"] == "invalid_api_key"
        assert set(info.value.body) == {"message", "type", "param", "code"}
        right = openai.OpenAI(base_url=proc.url + "/v1", api_key="s3cret", max_retries=0, timeout=60)
        assert right.responses.create(model="default_model", input="hi", max_output_tokens=2).usage.output_tokens == 2
    finally:
        proc.stop()
