"""Request checks of `kvtool serve`, run in the HTTP handler before a request reaches mlx-lm's
generation thread.

A few malformed requests get past mlx-lm's `APIHandler` and break the server (`"stop": 5` kills
the generation thread; a deeply nested or non-UTF-8 body closes the connection without an answer;
a negative or huge `Content-Length` blocks the handler; a huge `max_tokens` or prompt occupies the
generation thread for minutes). Nothing here uses MLX; the fields are checked by pydantic models
(`_schemas`; `StrictModel` and `error_text` serve every API). The handler calls, in order,

    n = content_length(headers.get("Content-Length"), limits.max_body_bytes)   # 400 / 411 / 413
    body = parse_body(raw_bytes)                                               # 400
    body = check_request(body, path, limits)                                   # 400 / 404

then counts the prompt's tokens (413 over `max_prompt_tokens`). Each check raises
`RequestError(status, message)`.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError, field_validator, model_validator

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


@dataclass(frozen=True)
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


# ----------------------------------------------------------------------------- request schemas
class StrictModel(BaseModel):
    """The base of every API's request models: strict types (no "1" for 1, no `true` for 1),
    unknown fields ignored (clients send fields of the API that kvtool passes on or does not use)."""

    model_config = ConfigDict(strict=True, extra="ignore")


Finite = Annotated[float, Field(allow_inf_nan=False)]  # a JSON number; 1e400 parses as inf
BRANCH_WORDS = {"str": "a string", "list": "a list", "dict": "an object"}  # union branches in pydantic's error locations


def _is_branch(part: str | int) -> bool:
    return isinstance(part, str) and (part.removeprefix("constrained-") in BRANCH_WORDS or "[" in part)


def field_path(loc: tuple[str | int, ...], tags: tuple[str, ...] = ()) -> str:
    """`input[0].content` from pydantic's `("input", "list[...]", 0, "message", "content")`: union
    branches and a union's tag (one of `tags`) right after a list index left out."""
    path, prev = "", None
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif not _is_branch(part) and not (isinstance(prev, int) and part in tags):
            path += f".{part}" if path else part
        prev = part
    return path or "body"


def error_text(exc: ValidationError, tags: tuple[str, ...] = ()) -> str:
    """The most specific pydantic error (the longest location) as `field.path: message`; a value
    of no type of a union is `path: must be a string or a list`. `tags`: the tags of the
    models' tagged unions (`field_path`)."""
    errors = exc.errors(include_url=False)
    # the deepest error; at one depth, a value of the right type that breaks a rule (a list too long)
    err = max(errors, key=lambda e: (len(e["loc"]), not e["type"].endswith("_type")))
    path = field_path(err["loc"], tags)
    if err["type"] == "union_tag_invalid":  # a discriminator field's value that no model takes
        return f"{path}: unknown type {err['ctx']['tag']!r}; supported: {err['ctx']['expected_tags']}"
    if err["type"] == "union_tag_not_found":
        return f"{path}: must be an object with a string type"
    branches = [e["loc"][-1] for e in errors if e["loc"][:-1] == err["loc"][:-1] and _is_branch(e["loc"][-1])]
    if len(branches) > 1 and err["type"].endswith("_type"):
        words = [BRANCH_WORDS.get(str(b).split("[")[0].removeprefix("constrained-"), str(b)) for b in branches]
        return f"{path}: must be {' or '.join(words)}"
    if err["type"] in ("model_type", "model_attributes_type", "dict_type"):
        return f"{path}: must be an object"  # (pydantic's text names the model class)
    return f"{path}: {err['msg'].removeprefix('Value error, ')}"


def validated(model: type[BaseModel], body: dict[str, Any], tags: tuple[str, ...] = ()) -> Any:
    """`model.model_validate(body)`.

    Raises:
        RequestError: 400 `field.path: message` (`error_text`; `tags` as there).
    """
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise RequestError(400, error_text(exc, tags)) from None


# OpenAI chat-completions / completions: the fields mlx-lm's handler and generation thread use
class _TextPart(StrictModel):
    type: Literal["text"]
    text: str


class _ImagePart(StrictModel):
    """An image part (`IMAGE_PART_TYPES`): its url in `image_url` (a string or `{"url": ...}`) or `image`."""

    type: str
    image_url: Any = None
    image: Any = None

    @model_validator(mode="after")
    def _url(self) -> _ImagePart:
        url = self.image_url if self.image_url is not None else self.image
        if not isinstance(url.get("url") if isinstance(url, dict) else url, str):
            raise ValueError("the image url must be a string")
        return self


class _NoImagePart(StrictModel):
    @model_validator(mode="before")
    @classmethod
    def _refuse(cls, value: Any) -> Any:
        raise ValueError("this model does not take images")


class _OtherPart(StrictModel):
    @model_validator(mode="before")
    @classmethod
    def _refuse(cls, value: Any) -> Any:
        raise ValueError(f"content type {str(value.get('type'))[:40]!r} is not supported")


def _part_kind(value: Any, images: bool) -> str | None:
    """The tag of a content part: `text`, `image` (`noimage` where the model takes none), `other`."""
    kind = value.get("type") if isinstance(value, dict) else None
    if not isinstance(kind, str):
        return None
    if kind in IMAGE_PART_TYPES:
        return "image" if images else "noimage"
    return "text" if kind == "text" else "other"


PART_TAGS = ("text", "image", "noimage", "other")


class _ToolCall(StrictModel):
    function: dict[str, Any] | None = None


class _StreamOptions(StrictModel):
    include_usage: bool = False


class _Sampling(StrictModel):
    """The fields both paths share; ranges that depend on the server are set by `_schemas`."""

    model: str = "default_model"
    adapters: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    stream: bool = False
    logprobs: bool = False
    stream_options: _StreamOptions | None = None
    stop: Annotated[str, Field(max_length=MAX_STOP_CHARS)] | Annotated[
        list[Annotated[str, Field(max_length=MAX_STOP_CHARS)]], Field(max_length=MAX_STOP_WORDS)] | None = None
    temperature: Annotated[Finite, Field(ge=0.0)] | None = None
    top_p: Annotated[Finite, Field(ge=0.0, le=1.0)] | None = None
    min_p: Annotated[Finite, Field(ge=0.0, le=1.0)] | None = None
    seed: Annotated[int, Field(ge=0, le=MAX_SEED)] | None = None
    top_logprobs: Annotated[int, Field(ge=-1, le=11)] | None = None
    repetition_penalty: Finite | None = None
    presence_penalty: Finite | None = None
    frequency_penalty: Finite | None = None


@functools.lru_cache(maxsize=8)
def _schemas(limits: Limits) -> tuple[type[StrictModel], type[StrictModel]]:
    """(completions, chat) request models with `limits`' ranges (one pair per server)."""
    tokens = Annotated[int, Field(ge=1, le=limits.max_tokens_cap)] | None
    window = Annotated[int, Field(ge=0, le=limits.max_tokens_cap + limits.max_prompt_tokens)] | None

    def part_kind(value: Any) -> str | None:
        return _part_kind(value, limits.images)

    part = Annotated[Annotated[_TextPart, Tag("text")] | Annotated[_ImagePart, Tag("image")]
                     | Annotated[_NoImagePart, Tag("noimage")] | Annotated[_OtherPart, Tag("other")],
                     Discriminator(part_kind)]
    vocab = limits.vocab_size

    class Message(StrictModel):
        role: str
        content: str | list[part] | None = None
        tool_calls: list[_ToolCall] | None = None

    class Common(_Sampling):
        max_tokens: tokens = None
        max_completion_tokens: tokens = None
        top_k: Annotated[int, Field(ge=0, le=vocab or 1 << 31)] | None = None
        repetition_context_size: window = None
        presence_context_size: window = None
        frequency_context_size: window = None
        logit_bias: Annotated[dict[str, Finite], Field(max_length=max(vocab, 1 << 20))] | None = None

        @field_validator("logit_bias")
        @classmethod
        def _token_ids(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
            for key in bias or {}:
                token = key.strip()
                if not (token.isascii() and token.isdigit() and len(token) < 20) or (vocab and int(token) >= vocab):
                    span = f" (0 to {vocab - 1})" if vocab else ""
                    raise ValueError(f"keys must be token ids{span}, got {key[:40]!r}")
            return bias

    class Completion(Common):
        prompt: Annotated[str, Field(min_length=1)]

    class Chat(Common):
        messages: Annotated[list[Message], Field(min_length=1, max_length=MAX_MESSAGES)]
        tools: list[dict[str, Any]] | None = None
        role_mapping: dict[str, str] | None = None

    return Completion, Chat


def check_request(body: dict[str, Any], path: str, limits: Limits) -> dict[str, Any]:
    """Check (and normalise in place) the fields mlx-lm's handler and generation thread use
    (pydantic models, strict types; `_schemas`).

    Normalisation: a top-level null (other than `model`, `messages`, `prompt`) is dropped, as
    OpenAI's API reads it as "not given" (clients send `"temperature": null`; mlx-lm's handler
    refuses it); empty strings are dropped from a `stop` list; `stream_options` without
    `include_usage` gets `include_usage: false` (mlx-lm indexes it).

    Returns:
        `body`.

    Raises:
        RequestError: 400 for a missing or mistyped field or a value out of range
            (`field.path: message`); 404 for a `model` (or `draft_model`) that this server does
            not serve.
    """
    for name in [k for k, v in body.items() if v is None and k not in ("model", "messages", "prompt")]:
        del body[name]
    _check_model(body, limits.model_names)
    completion, chat = _schemas(limits)
    validated(completion if path == "/v1/completions" else chat, body, PART_TAGS)
    if isinstance(body.get("stop"), list):
        body["stop"] = [s for s in body["stop"] if s]  # as mlx-lm drops an empty `stop`
    if "stream_options" in body:
        body["stream_options"].setdefault("include_usage", False)
    return body


def _check_model(body: dict[str, Any], names: tuple[str, ...]) -> None:
    """`model` one of `names` (404 otherwise), no `draft_model` (404)."""
    model = body.get("model", "default_model")
    if not isinstance(model, str):
        raise RequestError(400, "model must be a string")
    if model not in names:
        raise RequestError(404, f"model {model[:200]!r} is not served here; use one of: "
                                f"{', '.join(repr(n) for n in names)}")
    draft = body.get("draft_model", "default_model")
    if draft not in (None, "default_model"):
        raise RequestError(404, "draft_model: this server has no draft model")


__all__ = ["RequestError", "Limits", "StrictModel", "Finite", "error_text", "field_path", "validated", "content_length", "parse_body", "check_request", "model_context_length",
           "DEFAULT_MAX_BODY_BYTES", "DRAIN_MAX_BYTES", "MAX_JSON_DEPTH", "MAX_PROMPT_TOKENS_CAP",
           "DEFAULT_CONTEXT_TOKENS", "COMPLETION_PATHS"]
