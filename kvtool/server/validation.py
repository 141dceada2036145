"""Request checks of `kvtool serve`, run in the HTTP handler before a request reaches mlx-lm's
generation thread.

mlx-lm's `APIHandler` checks the types of most sampling fields, but a few malformed requests get
past it and break the server: `"stop": 5` kills the generation thread (every later request is
answered 404 "generation thread died"), a deeply nested or non-UTF-8 body closes the connection
without an answer, a negative or huge `Content-Length` blocks or fails the handler, and a huge
`max_tokens` or prompt occupies the generation thread for minutes. Everything here is pure
Python (no MLX): the handler (`kvtool.server.serve`) calls, in order,

    n = content_length(headers.get("Content-Length"), limits.max_body_bytes)   # 400 / 411 / 413
    body = parse_body(raw_bytes)                                               # 400
    body = check_request(body, path, limits)                                   # 400 / 404

and then counts the prompt's tokens with the model's tokenizer (413 over `max_prompt_tokens`).
Each check raises `RequestError(status, message)`; the handler answers it as
`{"error": message}` (mlx-lm's error body) with that HTTP status.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

# the token limits and the seed range are the one-shot commands' too (kvtool.models.limits)
from kvtool.models.limits import DEFAULT_CONTEXT_TOKENS, MAX_PROMPT_TOKENS_CAP, MAX_SEED, model_context_length

MiB = 1 << 20
DEFAULT_MAX_BODY_BYTES = 8 * MiB  # a request body larger than this is answered 413 (`--max-body-bytes`)
DRAIN_MAX_BYTES = 64 * MiB  # an oversized body up to this size is read and dropped before the 413 (else cut off)
MAX_JSON_DEPTH = 64  # nesting of arrays/objects in a request body (tool schemas stay far below)
MAX_STOP_WORDS = 16  # stop strings per request
MAX_STOP_CHARS = 1024  # characters per stop string
MAX_MESSAGES = 10_000  # messages per chat request
COMPLETION_PATHS = ("/v1/completions", "/v1/chat/completions", "/chat/completions")  # as mlx_lm.server
IMAGE_PART_TYPES = ("image_url", "input_image", "image")  # mlx_lm.server._image_url


class RequestError(Exception):
    """A request refused before generation: HTTP `status` and a one-line `message` for the client."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass
class Limits:
    """What `check_request` accepts.

    Attributes:
        max_body_bytes: largest request body (bytes).
        max_prompt_tokens: longest prompt (tokens, after the chat template); checked by the
            handler with the tokenizer, not here.
        max_tokens_cap: largest `max_tokens` / `max_completion_tokens` (tokens).
        vocab_size: token ids in `logit_bias` must be below this (0: not checked).
        model_names: the names a request may give in `model` (the served model only).
        images: the model takes image content parts (it has an mlx-lm processor).
    """

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_prompt_tokens: int = MAX_PROMPT_TOKENS_CAP
    max_tokens_cap: int = DEFAULT_CONTEXT_TOKENS
    vocab_size: int = 0
    model_names: tuple[str, ...] = ("default_model",)
    images: bool = False


# ----------------------------------------------------------------------------- transport
def content_length(value: str | None, max_body_bytes: int) -> int:
    """The body size from a `Content-Length` header value (bytes).

    Raises:
        RequestError: 411 missing; 400 not a non-negative decimal integer; 413 over `max_body_bytes`.
    """
    if value is None:
        raise RequestError(411, "Content-Length header is required")
    text = value.strip()
    if not text.isascii() or not text.isdigit() or len(text) > 19:
        raise RequestError(400, f"invalid Content-Length header: {value[:40]!r}")
    n = int(text)
    if n > max_body_bytes:
        raise RequestError(413, f"request body of {n} bytes is larger than the server's limit of "
                                f"{max_body_bytes} bytes (kvtool serve --max-body-bytes)")
    return n


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def parse_body(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object: strict UTF-8, no NaN/Infinity, nesting at most `MAX_JSON_DEPTH`.

    Raises:
        RequestError: 400 for invalid UTF-8, invalid JSON, too deep a nesting, or a body that is
            not a JSON object.
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RequestError(400, f"request body is not valid UTF-8 (byte {exc.start})") from None
    try:
        body = json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise RequestError(400, f"request body is nested too deeply (at most {MAX_JSON_DEPTH} levels)") from None
    except json.JSONDecodeError as exc:
        raise RequestError(400, f"invalid JSON in request body: {exc.msg} (line {exc.lineno} column {exc.colno})") from None
    except ValueError as exc:  # NaN/Infinity, or an integer of more than 4300 digits
        raise RequestError(400, f"invalid JSON in request body: {exc}") from None
    if _depth(body) > MAX_JSON_DEPTH:
        raise RequestError(400, f"request body is nested too deeply (at most {MAX_JSON_DEPTH} levels)")
    if not isinstance(body, dict):
        raise RequestError(400, "request body must be a JSON object")
    return body


def _depth(value: Any) -> int:
    """Nesting depth of a parsed JSON value (a scalar is 0), without recursion."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict):
            item = list(item.values())
        if isinstance(item, list):
            level += 1
            deepest = max(deepest, level)
            if level <= MAX_JSON_DEPTH:
                stack.extend((child, level) for child in item if isinstance(child, dict | list))
    return deepest


# ----------------------------------------------------------------------------- fields
def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _bad(field_name: str, what: str) -> RequestError:
    return RequestError(400, f"{field_name} must be {what}")


def _check_int(body: dict, name: str, lo: int, hi: int) -> None:
    value = body.get(name)
    if value is None:
        return
    if not _is_int(value) or not lo <= value <= hi:
        raise _bad(name, f"an integer from {lo} to {hi}")


def _check_number(body: dict, name: str, lo: float | None = None, hi: float | None = None) -> None:
    value = body.get(name)
    if value is None:
        return
    if not _is_number(value) or (lo is not None and value < lo) or (hi is not None and value > hi):
        span = f" from {lo} to {hi}" if lo is not None and hi is not None else f" >= {lo}" if lo is not None else ""
        raise _bad(name, f"a finite number{span}")


def _check_stop(body: dict) -> None:
    """`stop`: absent, null, a string or a list of strings (empty strings are dropped, as mlx-lm
    drops an empty `stop`)."""
    stop = body.get("stop")
    if stop is None or isinstance(stop, str):
        if isinstance(stop, str) and len(stop) > MAX_STOP_CHARS:
            raise _bad("stop", f"at most {MAX_STOP_CHARS} characters long")
        return
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise _bad("stop", "a string or a list of strings")
    if len(stop) > MAX_STOP_WORDS or any(len(s) > MAX_STOP_CHARS for s in stop):
        raise _bad("stop", f"at most {MAX_STOP_WORDS} strings of at most {MAX_STOP_CHARS} characters")
    body["stop"] = [s for s in stop if s]


def _check_content(content: Any, where: str, images: bool) -> None:
    if content is None or isinstance(content, str):
        return
    if not isinstance(content, list):
        raise _bad(f"{where}.content", "a string, null or a list of content parts")
    for j, part in enumerate(content):
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise _bad(f"{where}.content[{j}]", "an object with a string 'type'")
        if part["type"] == "text":
            if not isinstance(part.get("text"), str):
                raise _bad(f"{where}.content[{j}].text", "a string")
        elif part["type"] in IMAGE_PART_TYPES:
            if not images:
                raise RequestError(400, f"{where}.content[{j}]: this model does not take images")
            url = part.get("image_url", part.get("image"))
            url = url.get("url") if isinstance(url, dict) else url
            if not isinstance(url, str):
                raise _bad(f"{where}.content[{j}] image url", "a string")
        else:
            raise RequestError(400, f"{where}.content[{j}]: content type {part['type'][:40]!r} is not supported")


def _check_messages(messages: Any, images: bool) -> None:
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "a non-empty list of message objects")
    if len(messages) > MAX_MESSAGES:
        raise _bad("messages", f"at most {MAX_MESSAGES} messages")
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise _bad(where, "an object with 'role' and 'content'")
        if not isinstance(msg.get("role"), str):
            raise _bad(f"{where}.role", "a string")
        _check_content(msg.get("content"), where, images)
        calls = msg.get("tool_calls")
        if calls is not None and (not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls)):
            raise _bad(f"{where}.tool_calls", "a list of objects")
        for c in calls or []:
            func = c.get("function")
            if func is not None and not isinstance(func, dict):
                raise _bad(f"{where}.tool_calls[].function", "an object")


def check_request(body: dict[str, Any], path: str, limits: Limits) -> dict[str, Any]:
    """Check (and normalise in place) the fields mlx-lm's handler and generation thread use.

    Normalisation: a top-level null (other than `model`, `messages`, `prompt`) is dropped, as
    OpenAI's API reads it as "not given" (clients send `"temperature": null`; mlx-lm's handler
    refuses it); empty strings are dropped from a `stop` list; `stream_options` without
    `include_usage` gets `include_usage: false` (mlx-lm indexes it).

    Returns:
        `body`.

    Raises:
        RequestError: 400 for a missing or mistyped field or a value out of range; 404 for a
            `model` (or `draft_model`) that this server does not serve.
    """
    for name in [k for k, v in body.items() if v is None and k not in ("model", "messages", "prompt")]:
        del body[name]
    _check_model(body, limits.model_names)
    if path == "/v1/completions":
        prompt = body.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise _bad("prompt", "a non-empty string")
    else:
        _check_messages(body.get("messages"), limits.images)
        tools = body.get("tools")
        if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
            raise _bad("tools", "a list of objects")
        role_mapping = body.get("role_mapping")
        if role_mapping is not None and (not isinstance(role_mapping, dict)
                                         or not all(isinstance(v, str) for v in role_mapping.values())):
            raise _bad("role_mapping", "an object of strings")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise _bad("chat_template_kwargs", "an object")
    for name in ("stream", "logprobs"):
        if name in body and not isinstance(body[name], bool):
            raise _bad(name, "true or false")
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
            raise _bad("stream_options", "an object with a boolean include_usage")
        options.setdefault("include_usage", False)
    _check_stop(body)
    for name in ("max_tokens", "max_completion_tokens"):
        _check_int(body, name, 1, limits.max_tokens_cap)
    _check_number(body, "temperature", 0.0)
    _check_number(body, "top_p", 0.0, 1.0)
    _check_number(body, "min_p", 0.0, 1.0)
    _check_int(body, "top_k", 0, limits.vocab_size or 1 << 31)
    _check_int(body, "seed", 0, MAX_SEED)
    _check_int(body, "top_logprobs", -1, 11)
    for name in ("repetition_penalty", "presence_penalty", "frequency_penalty"):
        _check_number(body, name)
    for name in ("repetition_context_size", "presence_context_size", "frequency_context_size"):
        _check_int(body, name, 0, limits.max_tokens_cap + limits.max_prompt_tokens)
    _check_logit_bias(body.get("logit_bias"), limits.vocab_size)
    return body


def _check_model(body: dict[str, Any], names: tuple[str, ...]) -> None:
    """`model` one of `names` (404 otherwise), no `draft_model` (404), `adapters` a string or null."""
    model = body.get("model", "default_model")
    if not isinstance(model, str):
        raise _bad("model", "a string")
    if model not in names:
        raise RequestError(404, f"model {model[:200]!r} is not served here; use one of: "
                                f"{', '.join(repr(n) for n in names)}")
    draft = body.get("draft_model", "default_model")
    if draft not in (None, "default_model"):
        raise RequestError(404, "draft_model: this server has no draft model")
    adapters = body.get("adapters")
    if adapters is not None and not isinstance(adapters, str):
        raise _bad("adapters", "a string or null")


def _check_logit_bias(bias: Any, vocab_size: int) -> None:
    if bias is None:
        return
    what = f"an object of token id (0 to {vocab_size - 1}) -> finite number" if vocab_size else \
        "an object of token id -> finite number"
    if not isinstance(bias, dict) or len(bias) > max(vocab_size, 1 << 20):
        raise _bad("logit_bias", what)
    for key, value in bias.items():
        token = key.strip()
        if not (token.isascii() and token.isdigit() and len(token) < 20) or not _is_number(value):
            raise _bad("logit_bias", what)
        if vocab_size and int(token) >= vocab_size:
            raise _bad("logit_bias", what)


__all__ = ["RequestError", "Limits", "content_length", "parse_body", "check_request", "model_context_length",
           "DEFAULT_MAX_BODY_BYTES", "DRAIN_MAX_BYTES", "MAX_JSON_DEPTH", "MAX_PROMPT_TOKENS_CAP",
           "DEFAULT_CONTEXT_TOKENS", "COMPLETION_PATHS"]
