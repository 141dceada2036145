"""Anthropic's Messages API on `kvtool serve` (`kvtool.server.api_messages`, `kvtool.server.apis`).

End to end against a real `kvtool serve` on the tiny preset through the `anthropic` SDK:
`messages.create`, `messages.stream`, `messages.count_tokens`; the same conversation through
`/v1/messages` and `/v1/chat/completions` (openai SDK) makes the same prompt and the same greedy
output; a repeated conversation reads the prefix cache (`cache_read_input_tokens`); a tool round
trip on the template path; bad input answered in Anthropic's error shape with the server still
answering; `--api-key`. In process: the translation of answers with tool calls and reasoning
(mlx-lm's tiny preset has no tool parser and no thinking tags, so the server never produces them;
tool calls in the output end to end: `tests/test_tool_preset.py`, on the `tiny-tools` preset).

The tiny preset's own chat template renders `role` and `content` only; the server here runs a
Qwen2.5-shaped template given with `--chat-template` (`TOOL_TEMPLATE`), so that tools, tool calls
and tool results reach the prompt. The tool test checks each of them is there and that the prompt
equals the chat-completions one with OpenAI's tools / tool_calls / tool messages. The random-weight
model never emits a tool call itself, so the answer side of tool use is tested in process here and
end to end on `tiny-tools` (`tests/test_tool_preset.py`).
"""

from __future__ import annotations

import io
import json
import socket
import urllib.error
import urllib.request

import pydantic
import pytest

from kvtool.server.api_messages import MessagesApi
from kvtool.server.apis import ApiWriter
from tests.test_serve_hostile import FAULT, HTTP_TIMEOUT_S, Server, raw_http, start_kvtool
from tests.test_serve_http import DEMO

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")


KEY = "kvtool-test-key-5d1c"
GREEDY = {"temperature": 0.0}  # anthropic 2.14's stream() has no temperature argument: extra_body
SYSTEM = "You answer questions about Python's documentation. " + DEMO[:1500]
TURNS = [{"role": "user", "content": "What does the first paragraph say about modules?"},
         {"role": "assistant", "content": "It says modules group code."},
         {"role": "user", "content": "And the second one, in short?"}]
# The tiny preset's own template renders role and content only; the module's server runs this one,
# shaped as Qwen2.5's (tools in the system turn, tool calls as <tool_call> JSON, results as
# <tool_response>), so that tools, tool_use and tool_result blocks reach the prompt. mlx-lm
# infers its `json_tools` parser from it (`<tool_call>` and `tool_call.name`).
TOOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n"
    "{% endif %}# Tools\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n"
    "Call a function as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n"
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{% endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'assistant' %}<|im_start|>assistant\n{{ message.content }}"
    "{%- for tool_call in message.tool_calls or [] %}{%- set tool_call = tool_call.function %}"
    "\n<tool_call>{\"name\": \"{{ tool_call.name }}\", \"arguments\": {{ tool_call.arguments | tojson }}}"
    "</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n"
    "</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TOOLS = [{"name": "get_weather", "description": "The weather of a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]


def tool_history(result: str, city: str = "Paris") -> list[dict]:
    return [{"role": "user", "content": f"What is the weather in {city}?"},
            {"role": "assistant", "content": [{"type": "text", "text": "Let me check."},
                                              {"type": "tool_use", "id": "toolu_01", "name": "get_weather",
                                               "input": {"city": city}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_01", "content": result},
                                         {"type": "text", "text": "So, should I take an umbrella?"}]}]


# ----------------------------------------------------------------------------- servers and clients
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One `kvtool serve` (the tool-calling template, the watchdog's fault seam on) for the open tests."""
    tmp = tmp_path_factory.mktemp("messages")
    proc = start_kvtool(tmp, "messages", "--chat-template", TOOL_TEMPLATE, env={"KVTOOL_TEST_GENERATION_FAULT": FAULT})
    try:
        yield proc
    finally:
        proc.stop()


def client(server: Server, key: str = "unused") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=key, max_retries=0, timeout=HTTP_TIMEOUT_S)


def post(server: Server, body: dict | bytes, path: str = "/v1/messages",
         headers: dict[str, str] | None = None) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(server.url + path, data=data,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=HTTP_TIMEOUT_S) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def assert_error(status_doc: tuple[int, dict], status: int, kind: str, needle: str = "") -> None:
    got, doc = status_doc
    assert got == status, (got, doc)
    assert doc["type"] == "error" and doc["error"]["type"] == kind, doc
    assert needle in doc["error"]["message"], doc


def create(server: Server, **kw):
    return client(server).messages.create(model="tiny", max_tokens=kw.pop("max_tokens", 12), extra_body=GREEDY,
                                          **kw)


# ----------------------------------------------------------------------------- the SDK's calls
@pytest.mark.slow
def test_create_stream_and_count_tokens(server):
    msg = create(server, system=SYSTEM, messages=TURNS)
    assert msg.type == "message" and msg.role == "assistant" and msg.model == "tiny"
    assert msg.stop_reason in ("end_turn", "max_tokens")
    text = "".join(b.text for b in msg.content if b.type == "text")
    assert msg.usage.output_tokens >= 1

    with client(server).messages.stream(model="tiny", max_tokens=12, system=SYSTEM, messages=TURNS,
                                        extra_body=GREEDY) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text
    assert final.stop_reason == msg.stop_reason and final.usage.output_tokens == msg.usage.output_tokens

    counted = client(server).messages.count_tokens(model="tiny", system=SYSTEM, messages=TURNS).input_tokens
    # the beta client (Claude Code's) posts to /v1/messages?beta=true
    beta = client(server).beta.messages.create(model="tiny", max_tokens=12, system=SYSTEM, messages=TURNS,
                                               extra_body=GREEDY)
    assert "".join(b.text for b in beta.content if b.type == "text") == text
    assert client(server).beta.messages.count_tokens(model="tiny", system=SYSTEM, messages=TURNS).input_tokens == \
        counted
    for usage in (msg.usage, final.usage, beta.usage):
        assert usage.input_tokens + usage.cache_read_input_tokens == counted
        assert usage.cache_creation_input_tokens == 0


@pytest.mark.slow
def test_same_prompt_and_output_as_chat_completions(server):
    """The conversation through /v1/messages and through /v1/chat/completions: one prompt, one greedy answer."""
    msg = create(server, system=SYSTEM + " (messages vs chat)", messages=TURNS, max_tokens=16)
    oai = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=HTTP_TIMEOUT_S)
    chat = oai.chat.completions.create(model="tiny", max_tokens=16, temperature=0.0,
                                       messages=[{"role": "system", "content": SYSTEM + " (messages vs chat)"},
                                                 *TURNS])
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == chat.usage.prompt_tokens
    assert "".join(b.text for b in msg.content if b.type == "text") == (chat.choices[0].message.content or "")
    assert msg.usage.output_tokens == chat.usage.completion_tokens
    assert {"end_turn": "stop", "max_tokens": "length"}[msg.stop_reason] == chat.choices[0].finish_reason


@pytest.mark.slow
def test_a_repeated_conversation_reads_the_cache(server):
    system = "A new conversation. " + SYSTEM
    first = create(server, system=system, messages=TURNS)
    second = create(server, system=system, messages=TURNS)
    assert second.usage.cache_read_input_tokens > first.usage.cache_read_input_tokens
    assert second.usage.input_tokens < first.usage.input_tokens
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens == \
        first.usage.input_tokens + first.usage.cache_read_input_tokens
    with client(server).messages.stream(model="tiny", max_tokens=4, system=system, messages=TURNS,
                                        extra_body=GREEDY) as stream:
        final = stream.get_final_message()
    assert final.usage.cache_read_input_tokens > 0


@pytest.mark.slow
def test_tool_round_trip_on_the_template_path(server):
    """tools, an assistant's tool_use and the user's tool_result make the prompt the chat-completions
    request with OpenAI's tools, tool_calls and tool message makes, and each of them is in it."""
    history = tool_history("sunny, 21 C, no rain expected")
    msg = create(server, messages=history, tools=TOOLS, tool_choice={"type": "auto"})
    assert msg.stop_reason in ("end_turn", "max_tokens") and msg.content
    c = client(server)

    def count(messages: list[dict], tools: list[dict] | None = None) -> int:
        extra = {"tools": tools} if tools else {}
        return c.messages.count_tokens(model="tiny", messages=messages, **extra).input_tokens

    counted = count(history, TOOLS)
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == counted
    assert count(history) < counted  # the tool definitions are in the prompt
    assert count(tool_history("sunny, 21 C, no rain expected, light wind"), TOOLS) > counted  # the result
    assert count(tool_history("sunny, 21 C, no rain expected", "Rio de Janeiro"), TOOLS) - counted > \
        count([{"role": "user", "content": "What is the weather in Rio de Janeiro?"}]) - \
        count([{"role": "user", "content": "What is the weather in Paris?"}])  # the tool_use input too

    oai = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=HTTP_TIMEOUT_S)
    chat = oai.chat.completions.create(model="tiny", max_tokens=12, temperature=0.0, tools=[
        {"type": "function", "function": {"name": "get_weather", "description": "The weather of a city",
                                          "parameters": TOOLS[0]["input_schema"]}}], messages=[
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": "Let me check.", "tool_calls": [
            {"id": "toolu_01", "type": "function",
             "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]},
        {"role": "tool", "tool_call_id": "toolu_01", "name": "get_weather", "content": "sunny, 21 C, no rain expected"},
        {"role": "user", "content": "So, should I take an umbrella?"}])
    assert chat.usage.prompt_tokens == counted
    assert "".join(b.text for b in msg.content if b.type == "text") == (chat.choices[0].message.content or "")
    assert "Received tools but model does not support tool calling" not in server.text()  # json_tools inferred


# ----------------------------------------------------------------------------- bad input
@pytest.mark.slow
def test_bad_input_is_answered_in_anthropic_shape(server):
    ok = {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    assert_error(post(server, {**ok, "max_tokens": "4"}), 400, "invalid_request_error", "max_tokens")
    assert_error(post(server, {k: v for k, v in ok.items() if k != "max_tokens"}), 400, "invalid_request_error",
                 "max_tokens")
    assert_error(post(server, {**ok, "messages": [{"role": "user", "content": [{"type": "video", "url": "x"}]}]}),
                 400, "invalid_request_error", "video")
    assert_error(post(server, {**ok, "messages": [{"role": "user", "content": 5}]}), 400, "invalid_request_error")
    assert_error(post(server, {**ok, "system": {"text": "x"}}), 400, "invalid_request_error", "system")
    orphan = [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x", "content": "1"}]}]
    assert_error(post(server, {**ok, "messages": orphan}), 400, "invalid_request_error", "toolu_x")
    assert_error(post(server, {**ok, "max_tokens": 10**9}), 400, "invalid_request_error", "max_tokens")
    assert_error(post(server, {**ok, "max_tokens": 10**9, "stream": True}), 400, "invalid_request_error")
    assert_error(post(server, {**ok, "model": "claude-sonnet-4-5"}), 404, "not_found_error", "not served")
    assert_error(post(server, b"{not json"), 400, "invalid_request_error", "JSON")
    assert_error(post(server, {**ok, "messages": []}, "/v1/messages/count_tokens"), 400, "invalid_request_error")
    # with a system prompt the chat messages were not empty: the system prompt alone was answered
    assert_error(post(server, {**ok, "system": "s", "messages": []}), 400, "invalid_request_error", "messages")
    assert_error(post(server, {**ok, "system": "s", "messages": []}, "/v1/messages/count_tokens"), 400,
                 "invalid_request_error", "messages")
    # a failure of the generation loop (the watchdog's seam), before any answer was sent
    assert_error(post(server, {**ok, "stop_sequences": [FAULT]}), 500, "api_error")
    assert_error(post(server, {**ok, "stop_sequences": [FAULT], "stream": True}), 500, "api_error")
    with pytest.raises(anthropic.BadRequestError) as info:
        client(server).messages.create(model="tiny", max_tokens=4, messages=orphan)
    assert info.value.body["error"]["type"] == "invalid_request_error"
    assert create(server, messages=[{"role": "user", "content": "still there?"}], max_tokens=4).content


def _raw_answer(server: Server, data: bytes) -> tuple[int, dict[str, str], dict]:
    """(status, headers lower-cased, JSON body) of bytes sent on a fresh connection."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=HTTP_TIMEOUT_S) as s:
        s.sendall(data)
        out = b""
        while chunk := s.recv(1 << 16):
            out += chunk
    head, _, body = out.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return int(lines[0].split()[1]), headers, json.loads(body)


@pytest.mark.slow
def test_wrong_methods_and_routes_get_json_errors(server):
    """mlx-lm answered a GET of a POST route (or of no route) 404 with a `Not Found` text body
    labelled application/json, and an unknown method or a malformed request line with
    http.server's HTML page."""
    status, headers, doc = _raw_answer(server, b"GET /v1/messages?beta=true HTTP/1.1\r\nHost: x\r\n\r\n")
    assert (status, headers["allow"]) == (405, "POST") and headers["content-type"] == "application/json"
    assert doc["type"] == "error" and doc["error"]["type"] == "invalid_request_error", doc
    status, headers, doc = _raw_answer(server, b"GET /v1/responses HTTP/1.1\r\nHost: x\r\n\r\n")
    assert (status, headers["allow"]) == (405, "POST") and set(doc["error"]) == {"message", "type", "param", "code"}
    status, headers, doc = _raw_answer(server, b"GET /v1/chat/completions HTTP/1.1\r\nHost: x\r\n\r\n")
    assert (status, headers["allow"]) == (405, "POST") and "POST" in doc["error"]
    status, _, doc = _raw_answer(server, b"GET /no/such/route HTTP/1.1\r\nHost: x\r\n\r\n")
    assert status == 404 and "no such route: GET /no/such/route" in doc["error"]
    status, _, doc = _raw_answer(server, b"PUT /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
    assert status == 501 and "PUT" in doc["error"]
    with socket.create_connection(("127.0.0.1", server.port), timeout=HTTP_TIMEOUT_S) as s:
        s.sendall(b"GARBAGE\r\n\r\n")  # an HTTP/0.9 request line: the answer is a body without a head
        assert "GARBAGE" in json.loads(s.makefile("rb").read())["error"]
    assert _raw_answer(server, b"GET /health?probe=1 HTTP/1.1\r\nHost: x\r\n\r\n")[::2] == (200, {"status": "ok"})
    assert create(server, messages=[{"role": "user", "content": "still there?"}], max_tokens=4).content


@pytest.mark.slow
def test_a_client_dropping_a_stream_leaves_the_server_answering(server):
    body = json.dumps({"model": "tiny", "max_tokens": 200, "stream": True,
                       "messages": [{"role": "user", "content": "Tell me a long story about the sea."}]}).encode()
    for _ in range(2):
        with socket.create_connection(("127.0.0.1", server.port), timeout=HTTP_TIMEOUT_S) as s:
            s.sendall(b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n" % len(body) + body)
            assert b"event: message_start" in _read_until(s, b"content_block_delta")
    msg = create(server, messages=[{"role": "user", "content": "after the drop"}], max_tokens=4)
    assert msg.usage.output_tokens >= 1


def _read_until(s: socket.socket, marker: bytes) -> bytes:
    out = b""
    while marker not in out:
        chunk = s.recv(1 << 14)
        assert chunk, out
        out += chunk
    return out


# ----------------------------------------------------------------------------- --api-key
@pytest.mark.slow
def test_api_key_is_required_on_every_route(tmp_path):
    proc = start_kvtool(tmp_path, "keyed", env={"KVTOOL_API_KEY": KEY})
    try:
        ok = {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
        assert_error(post(proc, ok), 401, "authentication_error")
        assert_error(post(proc, ok, headers={"x-api-key": KEY + "x"}), 401, "authentication_error")
        with pytest.raises(anthropic.AuthenticationError):
            client(proc, "wrong").messages.create(model="tiny", max_tokens=4, messages=ok["messages"])
        assert client(proc, KEY).messages.create(model="tiny", max_tokens=4, messages=ok["messages"]).content
        assert post(proc, ok, "/v1/messages/count_tokens", {"x-api-key": KEY})[0] == 200
        chat = {"model": "tiny", "max_tokens": 4, "messages": ok["messages"]}
        assert post(proc, chat, "/v1/chat/completions")[0] == 401
        assert post(proc, chat, "/v1/chat/completions", {"Authorization": f"Bearer {KEY}"})[0] == 200
        assert post(proc, ok, headers={"x-api-key": "stale", "Authorization": f"Bearer {KEY}"})[0] == 200
        assert post(proc, ok, headers={"Authorization": f"Basic {KEY}"})[0] == 401
        for path in ("/v1/models", "/kvtool/stats", "/metrics", "/health"):
            status, _ = raw_http(proc, f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            assert status == 401, path
        req = urllib.request.Request(proc.url + "/v1/models", headers={"x-api-key": KEY})
        with urllib.request.urlopen(req, timeout=HTTP_TIMEOUT_S) as r:
            assert r.status == 200
        assert KEY not in proc.text() and "API key required" in proc.text()
    finally:
        proc.stop()


# ----------------------------------------------------------------------------- translation in process
def test_answers_with_tool_calls_and_reasoning_translate():
    api = MessagesApi()
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    chat = {"id": "chatcmpl-1234-abcd", "model": "tiny", "choices": [
        {"index": 0, "finish_reason": "tool_calls",
         "message": {"role": "assistant", "content": "Checking.", "reasoning": "The user wants weather.",
                     "tool_calls": [call]}}],
        "usage": {"prompt_tokens": 100, "completion_tokens": 7, "prompt_tokens_details": {"cached_tokens": 64}}}
    msg = anthropic.types.Message.model_validate(api.from_chat(chat))
    assert [b.type for b in msg.content] == ["thinking", "text", "tool_use"]
    assert msg.content[2].input == {"city": "Oslo"} and msg.content[2].id == "call_1"
    assert msg.stop_reason == "tool_use"
    assert (msg.usage.input_tokens, msg.usage.cache_read_input_tokens, msg.usage.output_tokens) == (36, 64, 7)

    stream = api.stream()
    chunks = [{"id": "chatcmpl-1", "model": "tiny", "choices": [{"index": 0, "finish_reason": None,
                                                                 "delta": {"reasoning": "Hmm."}}]},
              {"id": "chatcmpl-1", "model": "tiny", "choices": [{"index": 0, "finish_reason": None,
                                                                 "delta": {"content": "Checking."}}]},
              {"id": "chatcmpl-1", "model": "tiny", "choices": [{"index": 0, "finish_reason": "tool_calls",
                                                                 "delta": {"tool_calls": [{**call, "index": 0}]}}]},
              {"id": "chatcmpl-1", "model": "tiny", "choices": [], "usage": chat["usage"]}]
    events = [e for chunk in chunks for e in stream.feed(chunk)] + stream.end()
    names = [name for name, _ in events]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    assert names.count("content_block_start") == names.count("content_block_stop") == 3
    deltas = [data["delta"]["type"] for name, data in events if name == "content_block_delta"]
    assert deltas == ["thinking_delta", "text_delta", "input_json_delta"]
    adapter = pydantic.TypeAdapter(anthropic.types.RawMessageStreamEvent)
    parsed = [adapter.validate_python(data) for _, data in events]  # the SDK's own event types
    assert [e.type for e in parsed] == names
    partial = "".join(e.delta.partial_json for e in parsed
                      if e.type == "content_block_delta" and e.delta.type == "input_json_delta")
    assert json.loads(partial) == {"city": "Oslo"}
    assert parsed[-2].delta.stop_reason == "tool_use" and parsed[-2].usage.cache_read_input_tokens == 64


def test_the_writer_translates_mlx_lm_frames_and_errors():
    """`ApiWriter` on a byte buffer: mlx-lm's frames (split anywhere) become Anthropic's events,
    comments pass, an error frame is an `error` event, an error body Anthropic's error shape."""
    out = io.BytesIO()
    writer = ApiWriter(out, MessagesApi())
    writer.write(b"HTTP/1.0 200 OK\r\n\r\n")  # before the stream starts: passed through
    writer.start_stream()
    chunk = {"id": "chatcmpl-9", "model": "tiny", "choices": [{"index": 0, "finish_reason": None,
                                                               "delta": {"content": "Hi"}}]}
    frames = (b": keepalive 1/2\n\n" + f"data: {json.dumps(chunk)}\n\n".encode()
              + b'data: {"error": {"message": "boom", "code": 500}}\n\n')
    for i in range(0, len(frames), 7):
        writer.write(frames[i:i + 7])
    text = out.getvalue().decode()
    assert text.startswith("HTTP/1.0 200 OK\r\n\r\n: keepalive 1/2\n\nevent: message_start\n")
    events = [block.split("\n", 1) for block in text.split("\r\n\r\n", 1)[1].split("\n\n") if block.startswith("event:")]
    assert [e[0] for e in events] == ["event: message_start", "event: content_block_start",
                                      "event: content_block_delta", "event: error"]
    assert json.loads(events[-1][1][len("data: "):]) == {"type": "error", "error": {"type": "api_error",
                                                                                    "message": "boom"}}
    out = io.BytesIO()
    writer = ApiWriter(out, MessagesApi())
    writer.start_error(413)
    writer.write(b'{"error": "the prompt has 9 tokens"}')
    assert json.loads(out.getvalue()) == {"type": "error", "error": {"type": "request_too_large",
                                                                     "message": "the prompt has 9 tokens"}}
