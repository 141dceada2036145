"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`) on the
chat-completions path of `kvtool serve` (`kvtool.server.apis`).

Protocol source: Anthropic's Messages API reference (docs.anthropic.com/en/api/messages, the
streaming event order of docs.anthropic.com/en/docs/build-with-claude/streaming, the error
shapes of docs.anthropic.com/en/api/errors), as the `anthropic` Python SDK 2.14 speaks it.

Request (pydantic, strict types; unknown top-level fields and `cache_control` are ignored):
`system` (a string or text blocks) becomes a system message; `messages` of text, `tool_use`,
`tool_result`, `thinking` and `redacted_thinking` blocks become OpenAI chat messages (an
assistant's `tool_use` blocks its `tool_calls`, a user's `tool_result` blocks `role: "tool"`
messages placed before the user's text; several text blocks of one message are joined with a
newline; thinking blocks of earlier turns are dropped, as chat templates drop them); `tools`
become OpenAI function tools (server tools, which have a `type` other than `custom`, are
dropped: nothing here runs them); `tool_choice` is passed on as OpenAI's `tool_choice` (mlx-lm
does not enforce it); `thinking` sets the chat template's `enable_thinking`; `stop_sequences`,
`max_tokens`, `temperature`, `top_p`, `top_k` and `stream` map to their chat fields.

Answer: `reasoning` text becomes a `thinking` block, content a `text` block, each parsed tool
call a `tool_use` block. `stop_reason`: `max_tokens` (finish `length`), `tool_use` (finish
`tool_calls`), else `end_turn` (mlx-lm's answer does not say whether a stop string or the
end-of-turn token ended it, so `stop_sequence` is not reported). Usage: `cache_read_input_tokens`
is kvtool's prefix hit (`prompt_tokens_details.cached_tokens`), `input_tokens` the prompt
tokens that were not read from the cache (as Anthropic counts it: prompt = input_tokens +
cache_read_input_tokens + cache_creation_input_tokens), `cache_creation_input_tokens` 0
(kvtool stores blocks as a side effect, with no separate charge), `output_tokens` the
completion tokens.
"""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Any, Literal

from pydantic import Field

from kvtool.server.validation import RequestError, StrictModel, validated

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 408: "timeout_error", 411: "invalid_request_error",
               413: "request_too_large", 429: "rate_limit_error", 500: "api_error", 503: "overloaded_error",
               529: "overloaded_error"}
STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use", "stop": "end_turn"}


# ----------------------------------------------------------------------------- request models
class TextBlock(StrictModel):
    type: Literal["text"]
    text: str
    cache_control: Any = None


class ThinkingBlock(StrictModel):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(StrictModel):
    type: Literal["redacted_thinking"]
    data: str


class ToolUseBlock(StrictModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: Any = None


class ToolResultBlock(StrictModel):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None
    cache_control: Any = None


BLOCK_TYPES = ("text", "thinking", "redacted_thinking", "tool_use", "tool_result")
Block = Annotated[TextBlock | ThinkingBlock | RedactedThinkingBlock | ToolUseBlock | ToolResultBlock,
                  Field(discriminator="type")]


class Message(StrictModel):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class Tool(StrictModel):
    name: str
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    type: str | None = None  # "custom" or absent; others are Anthropic's server tools
    cache_control: Any = None


class ToolChoice(StrictModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(StrictModel):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None


class CountRequest(StrictModel):
    """The body of `POST /v1/messages/count_tokens` (the prompt's fields of a `MessagesRequest`)."""

    model: str
    messages: list[Message] = Field(min_length=1)  # as Anthropic's: a system prompt alone is not a conversation
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None


class MessagesRequest(CountRequest):
    """The body of `POST /v1/messages`."""

    max_tokens: int
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop_sequences: list[str] | None = None
    metadata: dict[str, Any] | None = None


# ----------------------------------------------------------------------------- request -> chat
def _text(blocks: str | list[TextBlock] | None) -> str:
    if blocks is None or isinstance(blocks, str):
        return blocks or ""
    return "\n".join(b.text for b in blocks)


def _user(msg: Message, previous: Message | None, out: list[dict[str, Any]]) -> None:
    """A user message: its tool results as `tool` messages, then its text (if any)."""
    if isinstance(msg.content, str):
        out.append({"role": "user", "content": msg.content})
        return
    calls = {} if previous is None or isinstance(previous.content, str) else \
        {b.id: b.name for b in previous.content if isinstance(b, ToolUseBlock)}
    texts: list[str] = []
    for block in msg.content:
        if isinstance(block, ToolResultBlock):
            if block.tool_use_id not in calls:
                raise RequestError(400, f"tool_result block {block.tool_use_id[:80]!r} has no tool_use block "
                                        "with that id in the previous (assistant) message")
            out.append({"role": "tool", "tool_call_id": block.tool_use_id, "name": calls[block.tool_use_id],
                        "content": _text(block.content)})
        elif isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ToolUseBlock):
            raise RequestError(400, "tool_use blocks belong in assistant messages")
    if texts or not any(isinstance(b, ToolResultBlock) for b in msg.content):
        out.append({"role": "user", "content": "\n".join(texts)})


def _assistant(msg: Message) -> dict[str, Any]:
    if isinstance(msg.content, str):
        return {"role": "assistant", "content": msg.content}
    text = "\n".join(b.text for b in msg.content if isinstance(b, TextBlock))
    calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
             for b in msg.content if isinstance(b, ToolUseBlock)]
    if any(isinstance(b, ToolResultBlock) for b in msg.content):
        raise RequestError(400, "tool_result blocks belong in user messages")
    return {"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}


def _tool_choice(choice: ToolChoice | None) -> Any:
    if choice is None:
        return None
    if choice.type == "tool":
        if not choice.name:
            raise RequestError(400, "tool_choice.name: required when tool_choice.type is 'tool'")
        return {"type": "function", "function": {"name": choice.name}}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def _prompt_fields(req: CountRequest) -> dict[str, Any]:
    """The chat fields that make the prompt: messages, tools, tool_choice, chat_template_kwargs."""
    messages: list[dict[str, Any]] = []
    if req.system is not None:
        messages.append({"role": "system", "content": _text(req.system)})
    previous: Message | None = None
    for msg in req.messages:
        if msg.role == "user":
            _user(msg, previous, messages)
        else:
            messages.append(_assistant(msg))
        previous = msg
    chat: dict[str, Any] = {"model": req.model, "messages": messages}
    tools = [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                               "parameters": t.input_schema}}
             for t in req.tools or [] if t.type in (None, "custom")]
    if tools:
        chat["tools"] = tools
        choice = _tool_choice(req.tool_choice)
        if choice is not None:
            chat["tool_choice"] = choice
    if req.thinking is not None:
        chat["chat_template_kwargs"] = {"enable_thinking": req.thinking.type != "disabled"}
    return chat


# ----------------------------------------------------------------------------- chat -> answer
def usage(chat_usage: dict[str, Any] | None) -> dict[str, int]:
    """Anthropic's usage from a chat-completions usage: input_tokens excludes the cache's hit.

    Args:
        chat_usage: `{"prompt_tokens", "completion_tokens", "prompt_tokens_details": {"cached_tokens"}}` (tokens).
    """
    chat_usage = chat_usage or {}
    prompt = int(chat_usage.get("prompt_tokens") or 0)
    cached = int((chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    return {"input_tokens": prompt - cached, "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached,
            "output_tokens": int(chat_usage.get("completion_tokens") or 0)}


def _message_id(chat_id: Any) -> str:
    text = str(chat_id or "")
    return "msg_" + (text.split("-", 1)[1].replace("-", "") if "-" in text else uuid.uuid4().hex)


def _tool_use(call: dict[str, Any]) -> dict[str, Any]:
    func = call.get("function") or {}
    try:
        args = json.loads(func.get("arguments") or "{}")
    except ValueError:
        args = {}
    return {"type": "tool_use", "id": call.get("id") or f"toolu_{uuid.uuid4().hex}", "name": func.get("name", ""),
            "input": args if isinstance(args, dict) else {"value": args}}


class MessagesApi:
    """Anthropic's Messages API as an `ApiTranslation` and `TokenCounter` (`kvtool.server.apis`)."""

    route = "/v1/messages"

    def to_chat(self, body: dict[str, Any]) -> dict[str, Any]:
        """A Messages request -> a chat-completions body (streamed ones ask for the usage chunk).

        Raises:
            RequestError: 400 for a field of the wrong type, an unknown content block type, a
                tool_result without its tool_use, a missing `max_tokens`.
        """
        req = validated(MessagesRequest, body, BLOCK_TYPES)
        chat = _prompt_fields(req)
        chat["max_tokens"] = req.max_tokens
        for name in ("temperature", "top_p", "top_k"):
            value = getattr(req, name)
            if value is not None:
                chat[name] = value
        if req.stop_sequences:
            chat["stop"] = req.stop_sequences
        if req.stream:
            chat["stream"] = True
            chat["stream_options"] = {"include_usage": True}
        return chat

    def to_count(self, body: dict[str, Any]) -> dict[str, Any]:
        """A count_tokens request -> the chat-completions body whose prompt is counted.

        Raises:
            RequestError: 400 as `to_chat`.
        """
        return _prompt_fields(validated(CountRequest, body, BLOCK_TYPES))

    def count_answer(self, n_tokens: int) -> dict[str, Any]:
        return {"input_tokens": n_tokens}

    def from_chat(self, chat: dict[str, Any]) -> dict[str, Any]:
        """mlx-lm's complete `chat.completion` -> an Anthropic `message`."""
        choice = (chat.get("choices") or [{}])[0]
        msg = choice.get("message") or {}
        content: list[dict[str, Any]] = []
        if msg.get("reasoning"):
            content.append({"type": "thinking", "thinking": msg["reasoning"], "signature": ""})
        if msg.get("content"):
            content.append({"type": "text", "text": msg["content"]})
        content += [_tool_use(call) for call in msg.get("tool_calls") or []]
        return {"id": _message_id(chat.get("id")), "type": "message", "role": "assistant",
                "model": chat.get("model", ""), "content": content,
                "stop_reason": STOP_REASONS.get(choice.get("finish_reason") or "stop", "end_turn"),
                "stop_sequence": None, "usage": usage(chat.get("usage"))}

    def stream(self) -> MessagesStream:
        return MessagesStream()

    def error_body(self, status: int, message: str) -> dict[str, Any]:
        """`{"type": "error", "error": {"type": ..., "message": ...}}` (Anthropic's error shape)."""
        kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
        return {"type": "error", "error": {"type": kind, "message": message}}


class MessagesStream:
    """One streamed answer: mlx-lm's chunks -> Anthropic's events (message_start,
    content_block_start / _delta / _stop per block, message_delta with stop_reason and usage,
    message_stop)."""

    def __init__(self) -> None:
        self._started = False
        self._block: str | None = None  # the open block's type
        self._index = -1
        self._stop_reason = "end_turn"
        self._usage: dict[str, Any] | None = None

    def _start(self, chunk: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        if self._started:
            return []
        self._started = True
        message = {"id": _message_id(chunk.get("id")), "type": "message", "role": "assistant",
                   "model": chunk.get("model", ""), "content": [], "stop_reason": None, "stop_sequence": None,
                   "usage": {"input_tokens": 0, "output_tokens": 0}}
        return [("message_start", {"type": "message_start", "message": message})]

    def _close(self) -> list[tuple[str, dict[str, Any]]]:
        if self._block is None:
            return []
        self._block = None
        return [("content_block_stop", {"type": "content_block_stop", "index": self._index})]

    def _open(self, kind: str, block: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        events = self._close()
        self._block, self._index = kind, self._index + 1
        return events + [("content_block_start", {"type": "content_block_start", "index": self._index,
                                                  "content_block": block})]

    def _delta(self, kind: str, delta: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        events = []
        if self._block != kind:
            empty = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else \
                {"type": "text", "text": ""}
            events = self._open(kind, empty)
        return events + [("content_block_delta", {"type": "content_block_delta", "index": self._index,
                                                  "delta": delta})]

    def feed(self, chunk: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        events = self._start(chunk)
        if chunk.get("usage") is not None:
            self._usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("reasoning"):
                events += self._delta("thinking", {"type": "thinking_delta", "thinking": delta["reasoning"]})
            if delta.get("content"):
                events += self._delta("text", {"type": "text_delta", "text": delta["content"]})
            for call in delta.get("tool_calls") or []:
                block = _tool_use(call)
                events += self._open("tool_use", {**block, "input": {}})
                events.append(("content_block_delta", {"type": "content_block_delta", "index": self._index,
                                                       "delta": {"type": "input_json_delta",
                                                                 "partial_json": json.dumps(block["input"])}}))
                events += self._close()
            if choice.get("finish_reason"):
                self._stop_reason = STOP_REASONS.get(choice["finish_reason"], "end_turn")
        return events

    def end(self) -> list[tuple[str, dict[str, Any]]]:
        events = self._start({}) + self._close()
        events.append(("message_delta", {"type": "message_delta",
                                         "delta": {"stop_reason": self._stop_reason, "stop_sequence": None},
                                         "usage": usage(self._usage)}))
        events.append(("message_stop", {"type": "message_stop"}))
        return events


__all__ = ["MessagesApi", "MessagesStream", "MessagesRequest", "CountRequest", "usage", "ERROR_TYPES"]
