"""The OpenAI Responses API (`POST /v1/responses`, as Codex CLI and other agents speak it) on
`kvtool serve`'s chat-completions path.

A Responses request is translated into a chat-completions body (`ResponsesApi.to_chat`), which
then runs through kvtool's request checks and mlx-lm's chat handling unchanged (same cache,
metrics and log line); mlx-lm's `chat.completion` answer is translated back into a `response`
object (`from_chat`), its `chat.completion.chunk` stream into the `response.*` events
(`ResponsesStream`). Shapes follow the openai SDK's own models (`openai.types.responses`:
`Response`, `ResponseStreamEvent`, `ResponseInputItemParam`), which the tests parse the output
with. Source: OpenAI API reference, "Responses" (https://platform.openai.com/docs/api-reference/responses).

Mapping of a request:

- `input`: a string (one user message) or a list of items: `message` items (role `user`,
  `assistant`, `system`, `developer` → `system`; content a string or `input_text` /
  `output_text` parts), `function_call` items (joined to the assistant message before them as
  chat `tool_calls`), `function_call_output` items (→ `role: "tool"` messages), `reasoning`
  items (dropped: the chat template gets no earlier reasoning). Any other item type is a 400.
- `instructions` → a first `system` message; `tools`: function tools → chat function tools,
  other types dropped (built-in tools run on OpenAI's side, custom tools need grammar-constrained
  output: nothing here runs either); `tool_choice` `auto` (default) or `none` (the tools are not sent); `max_output_tokens` →
  `max_tokens`; `temperature`, `top_p`, `model`, `stream` as they are (a stream asks for usage).
- `previous_response_id` is refused (400): the server keeps no responses, so a client resends the
  whole conversation (`store` is accepted and ignored: nothing is stored). `metadata`,
  `parallel_tool_calls` and the other fields of the API are accepted and ignored.

Usage: `input_tokens` = the prompt's tokens (after the chat template), `cached_tokens` = the
tokens kvtool's tiers gave (mlx-lm's `prompt_tokens_details.cached_tokens`), `output_tokens` the
generated ones; `reasoning_tokens` and `cache_write_tokens` are 0 (mlx-lm counts neither).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag

from kvtool.server.validation import RequestError, StrictModel, validated

ROUTE = "/v1/responses"
ERROR_TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 408: "invalid_request_error",
               411: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error"}
ERROR_CODES = {401: "invalid_api_key"}  # OpenAI's `code` where it has one for the status


# ----------------------------------------------------------------------------- request models
class TextPart(StrictModel):
    """A text part of a message: `input_text` (user, system) or `output_text` (an earlier answer)."""

    type: Literal["input_text", "output_text"]
    text: str


class MessageItem(StrictModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[TextPart]


class FunctionCallItem(StrictModel):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str  # a JSON text, as the model wrote it


class FunctionCallOutputItem(StrictModel):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[TextPart]


class ReasoningItem(StrictModel):
    type: Literal["reasoning"]


def _item_type(value: Any) -> str | None:
    """The tag of an input item: its `type`, `message` when absent (an "easy input message")."""
    if isinstance(value, dict):
        kind = value.get("type", "message")
        return kind if isinstance(kind, str) else None
    return None


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")] | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type),
]


class FunctionTool(StrictModel):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class OtherTool(StrictModel):
    """A tool of another type: built-in tools (`web_search`, `file_search`, ...) run on OpenAI's
    side, `custom` tools need grammar-constrained output; none of them runs here: dropped."""

    type: str


def _tool_type(value: Any) -> str | None:
    if isinstance(value, dict):
        return "function" if value.get("type") == "function" else "other"
    return None


Tool = Annotated[Annotated[FunctionTool, Tag("function")] | Annotated[OtherTool, Tag("other")],
                 Discriminator(_tool_type)]


class ResponsesRequest(StrictModel):
    """The fields of a Responses request that kvtool uses (others are ignored)."""

    model: str = "default_model"
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["auto", "none"] | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    metadata: dict[str, str] | None = None
    store: bool | None = None
    previous_response_id: str | None = None


UNION_TAGS = ("message", "function_call", "function_call_output", "reasoning", "function", "other")  # of `InputItem` and `Tool`


def parse_request(body: dict[str, Any]) -> ResponsesRequest:
    """A Responses request body as `ResponsesRequest`.

    Raises:
        RequestError: 400 for a mistyped or missing field, an unknown item type, a
            `tool_choice` other than auto/none, or a `previous_response_id`.
    """
    if body.get("previous_response_id") is not None:
        raise RequestError(400, "previous_response_id is not supported: kvtool serve keeps no responses; "
                                "resend the whole conversation in input (kvtool's cache makes the repeated "
                                "prefix cheap)")
    return validated(ResponsesRequest, body, UNION_TAGS)


# ----------------------------------------------------------------------------- request → chat
def _text(content: str | list[TextPart]) -> str:
    return content if isinstance(content, str) else "".join(p.text for p in content)


def _check_arguments(item: FunctionCallItem, index: int) -> None:
    """mlx-lm `json.loads` an earlier call's arguments for the template: refuse what it would fail on."""
    try:
        json.loads(item.arguments)
    except ValueError:
        raise RequestError(400, f"input[{index}].arguments: not valid JSON") from None


def chat_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The chat-completions `messages` of a request: `instructions` first, then one message per
    input item (function calls joined to the assistant message before them; reasoning dropped)."""
    messages: list[dict[str, Any]] = []
    if req.instructions is not None:
        messages.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        return messages + [{"role": "user", "content": req.input}]
    for i, item in enumerate(req.input):
        if isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            messages.append({"role": role, "content": _text(item.content)})
        elif isinstance(item, FunctionCallItem):
            _check_arguments(item, i)
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if messages and messages[-1]["role"] == "assistant":  # the same turn: its text, then its calls
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)})
    if not messages:
        raise RequestError(400, "input: no message to answer (give a string or at least one message item)")
    return messages


def _chat_tool(tool: FunctionTool) -> dict[str, Any]:
    function: dict[str, Any] = {"name": tool.name}
    if tool.description is not None:
        function["description"] = tool.description
    function["parameters"] = tool.parameters if tool.parameters is not None else {"type": "object", "properties": {}}
    return {"type": "function", "function": function}


def to_chat(body: dict[str, Any]) -> dict[str, Any]:
    """A Responses request body → an OpenAI chat-completions body (see the module docstring).

    Raises:
        RequestError: 400 for what `parse_request` refuses, or a `function_call` whose arguments
            are not JSON.
    """
    req = parse_request(body)
    chat: dict[str, Any] = {"model": req.model, "messages": chat_messages(req)}
    if req.tools and req.tool_choice != "none":  # other tool types are dropped (`OtherTool`)
        tools = [_chat_tool(t) for t in req.tools if isinstance(t, FunctionTool)]
        if tools:
            chat["tools"] = tools
    if req.max_output_tokens is not None:
        chat["max_tokens"] = req.max_output_tokens
    for name in ("temperature", "top_p"):
        if getattr(req, name) is not None:
            chat[name] = getattr(req, name)
    if req.stream:
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    return chat


# ----------------------------------------------------------------------------- chat → response
def new_id(prefix: str) -> str:
    """A fresh object id, e.g. `resp_1f0c...` (32 hex digits after the prefix)."""
    return f"{prefix}_{uuid.uuid4().hex}"


def usage(chat_usage: dict[str, Any] | None) -> dict[str, Any] | None:
    """mlx-lm's chat `usage` (prompt / completion tokens, `prompt_tokens_details.cached_tokens`:
    kvtool's hit) → the Responses `usage` (tokens); None without one."""
    if not chat_usage:
        return None
    prompt, completion = chat_usage.get("prompt_tokens") or 0, chat_usage.get("completion_tokens") or 0
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion}


def response_object(resp_id: str, chat: dict[str, Any], status: str, output: list[dict[str, Any]],
                    chat_usage: dict[str, Any] | None) -> dict[str, Any]:
    """A `response` object (`openai.types.responses.Response`): `status` is `in_progress`,
    `completed` or `incomplete` (then `incomplete_details.reason` is `max_output_tokens`)."""
    return {
        "id": resp_id, "object": "response", "created_at": chat.get("created") or int(time.time()),
        "status": status, "model": chat.get("model") or "default_model", "output": output,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "error": None, "instructions": None, "metadata": {}, "parallel_tool_calls": True,
        "tool_choice": "auto", "tools": [], "temperature": None, "top_p": None, "store": False,
        "usage": usage(chat_usage),
    }


def text_part(kind: str, text: str) -> dict[str, Any]:
    """The one content part of a `message` (`output_text`) or `reasoning` item (`reasoning_text`)."""
    if kind == "message":
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"type": "reasoning_text", "text": text}


def message_item(item_id: str, text: str | None, status: str = "completed") -> dict[str, Any]:
    """An assistant `message` output item with one `output_text` part (no part when `text` is None:
    the item as a stream opens it)."""
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [] if text is None else [text_part("message", text)]}


def reasoning_item(item_id: str, text: str | None, status: str = "completed") -> dict[str, Any]:
    """A `reasoning` output item carrying mlx-lm's reasoning text as one `reasoning_text` part."""
    return {"id": item_id, "type": "reasoning", "status": status, "summary": [],
            "content": [] if text is None else [text_part("reasoning", text)]}


def call_item(call: dict[str, Any], status: str = "completed") -> dict[str, Any]:
    """A `function_call` output item from one of mlx-lm's parsed chat `tool_calls`
    (`{"id", "type": "function", "function": {"name", "arguments"}}`, arguments a JSON text)."""
    function = call.get("function") or {}
    return {"id": new_id("fc"), "type": "function_call", "status": status,
            "call_id": call.get("id") or new_id("call"), "name": function.get("name", ""),
            "arguments": function.get("arguments") or "{}"}


def status_of(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def from_chat(chat: dict[str, Any]) -> dict[str, Any]:
    """A complete `chat.completion` (mlx-lm's `generate_response`, non-streamed) → a `response`:
    output items in the order reasoning, message (when there is text), function calls."""
    choice = (chat.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    output = []
    if message.get("reasoning"):
        output.append(reasoning_item(new_id("rs"), message["reasoning"]))
    if message.get("content") or not message.get("tool_calls"):
        output.append(message_item(new_id("msg"), message.get("content") or "", status_of(choice.get("finish_reason"))))
    output += [call_item(call) for call in message.get("tool_calls") or []]
    return response_object(new_id("resp"), chat, status_of(choice.get("finish_reason")), output, chat.get("usage"))


def error_body(status: int, message: str) -> dict[str, Any]:
    """OpenAI's error shape: `{"error": {"message", "type", "param", "code"}}` (type by status).
    A message of the chat-completions checks about `max_tokens` names this API's `max_output_tokens`."""
    if message.startswith("max_tokens:"):
        message = "max_output_tokens" + message[len("max_tokens"):]
    kind = ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    code = "model_not_found" if status == 404 and message.startswith("model ") else ERROR_CODES.get(status)
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


# ----------------------------------------------------------------------------- stream
class ResponsesStream:
    """One streamed request: mlx-lm's `chat.completion.chunk` dicts → `response.*` SSE events.

    The sequence (each event's data has `type` and a `sequence_number` counting from 0):
    `response.created`, `response.in_progress`; per output item `response.output_item.added`, for
    text `response.content_part.added`, `response.output_text.delta`... (`reasoning_text` for
    reasoning), `response.output_text.done`, `response.content_part.done`; for a function call
    `response.function_call_arguments.delta` (mlx-lm hands a call over whole: one delta) and
    `.done`; then `response.output_item.done`; last `response.completed` (or
    `response.incomplete` when generation stopped at `max_output_tokens`) with the whole
    response and its usage (from mlx-lm's final usage-only chunk).
    """

    def __init__(self) -> None:
        self.resp_id = new_id("resp")
        self._seq = 0
        self._chat: dict[str, Any] | None = None  # created/model of the first chunk
        self._output: list[dict[str, Any]] = []  # finished items
        self._open: dict[str, Any] | None = None  # the text item being streamed (message or reasoning)
        self._text = ""
        self._finish: str | None = None
        self._usage: dict[str, Any] | None = None

    def _event(self, name: str, **data: Any) -> tuple[str, dict[str, Any]]:
        event = (name, {"type": name, "sequence_number": self._seq, **data})
        self._seq += 1
        return event

    def _start(self, chunk: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        self._chat = {"created": chunk.get("created"), "model": chunk.get("model")}
        response = response_object(self.resp_id, self._chat, "in_progress", [], None)
        return [self._event("response.created", response=response),
                self._event("response.in_progress", response=response)]

    def feed(self, chunk: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        """Events for one chunk: text and reasoning deltas, whole tool calls, the finish reason,
        the usage (kept for the end)."""
        events = [] if self._chat is not None else self._start(chunk)
        if chunk.get("usage"):
            self._usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("reasoning"):
                events += self._delta("reasoning", delta["reasoning"])
            if delta.get("content"):
                events += self._delta("message", delta["content"])
            for call in delta.get("tool_calls") or []:
                events += self._call(call)
            self._finish = choice.get("finish_reason") or self._finish
        return events

    def _delta(self, kind: str, text: str) -> list[tuple[str, dict[str, Any]]]:
        events = self._close() if self._open is not None and self._open["type"] != kind else []
        if self._open is None:
            events += self._open_item(kind)
        assert self._open is not None
        self._text += text
        extra: dict[str, Any] = {"logprobs": []} if kind == "message" else {}
        name = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        events.append(self._event(name, item_id=self._open["id"], output_index=len(self._output),
                                  content_index=0, delta=text, **extra))
        return events

    def _open_item(self, kind: str) -> list[tuple[str, dict[str, Any]]]:
        make = message_item if kind == "message" else reasoning_item
        self._open, self._text = make(new_id("msg" if kind == "message" else "rs"), None, "in_progress"), ""
        where = {"item_id": self._open["id"], "output_index": len(self._output), "content_index": 0}
        return [self._event("response.output_item.added", output_index=len(self._output), item=self._open),
                self._event("response.content_part.added", part=text_part(kind, ""), **where)]

    def _close(self) -> list[tuple[str, dict[str, Any]]]:
        """Events that finish the open text item; the item joins the output."""
        item = self._open
        if item is None:
            return []
        kind, text = item["type"], self._text
        where = {"item_id": item["id"], "output_index": len(self._output), "content_index": 0}
        done = {"text": text, "logprobs": []} if kind == "message" else {"text": text}
        name = "response.output_text.done" if kind == "message" else "response.reasoning_text.done"
        status = status_of(self._finish) if kind == "message" else "completed"
        final = (message_item if kind == "message" else reasoning_item)(item["id"], text, status)
        events = [self._event(name, **where, **done),
                  self._event("response.content_part.done", part=text_part(kind, text), **where),
                  self._event("response.output_item.done", output_index=len(self._output), item=final)]
        self._output.append(final)
        self._open, self._text = None, ""
        return events

    def _call(self, call: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        events = self._close()
        final = call_item(call)
        index, where = len(self._output), {"item_id": final["id"], "output_index": len(self._output)}
        events += [self._event("response.output_item.added", output_index=index,
                               item={**final, "arguments": "", "status": "in_progress"}),
                   self._event("response.function_call_arguments.delta", delta=final["arguments"], **where),
                   self._event("response.function_call_arguments.done", arguments=final["arguments"], **where),
                   self._event("response.output_item.done", output_index=index, item=final)]
        self._output.append(final)
        return events

    def end(self) -> list[tuple[str, dict[str, Any]]]:
        """The closing events at mlx-lm's `data: [DONE]`: the open item done (an empty message when
        nothing was generated), then `response.completed` or `response.incomplete`."""
        events = [] if self._chat is not None else self._start({})
        if self._open is None and not self._output:
            events += self._open_item("message")
        events += self._close()
        status = status_of(self._finish)
        response = response_object(self.resp_id, self._chat or {}, status, self._output, self._usage)
        name = "response.incomplete" if status == "incomplete" else "response.completed"
        return events + [self._event(name, response=response)]


class ResponsesApi:
    """The Responses API as a `kvtool.server.apis.ApiTranslation` (route `/v1/responses`)."""

    route = ROUTE
    to_chat = staticmethod(to_chat)
    from_chat = staticmethod(from_chat)
    stream = ResponsesStream  # a fresh translator per streamed request
    error_body = staticmethod(error_body)
