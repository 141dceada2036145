"""Foreign APIs on the chat-completions path of `kvtool serve` (Anthropic Messages, OpenAI Responses).

A foreign API is an `ApiTranslation`: its request body is translated into an OpenAI
chat-completions body (`to_chat`), which then takes the path every chat request takes, and the
answer is translated back (docs/design.md#kvtool-serve-kvtoolserver, "Foreign APIs"): a
non-streamed one by `ApiHandlerMixin.generate_response`, a streamed one by `ApiWriter` (mlx-lm's
`data: {...}` frames to the API's `event: <name>` events; SSE comments pass), a refusal in the
API's error shape (`error_body`). `check_api_key` is the optional shared secret of every route
(`kvtool serve --api-key`). The registry of translations is `kvtool.server.api_routes`.
"""

from __future__ import annotations

import hmac
import json
import logging
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Protocol

from kvtool.server.validation import RequestError, check_request
from kvtool.server.watchdog import PromptTooLong, take_pretokenized

if TYPE_CHECKING:  # the mixin's view of mlx-lm's APIHandler
    from http.server import BaseHTTPRequestHandler as _Base
else:
    _Base = object

log = logging.getLogger("kvtool.server")

CHAT_PATH = "/v1/chat/completions"  # where a translated request goes


class StreamTranslation(Protocol):
    """One streamed answer's translator (a fresh one per request)."""

    def feed(self, chunk: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        """One `chat.completion.chunk` dict as mlx-lm streams it (delta content / reasoning /
        tool_calls, finish_reason; the final usage-only chunk with
        `usage.prompt_tokens_details.cached_tokens`) -> SSE events `(event name, data)`."""
        ...

    def end(self) -> list[tuple[str, dict[str, Any]]]:
        """The events that close the stream, at mlx-lm's `data: [DONE]`."""
        ...


class ApiTranslation(Protocol):
    """A foreign API served on the chat-completions path."""

    route: str  # the POST path, e.g. "/v1/messages"

    def to_chat(self, body: dict[str, Any]) -> dict[str, Any]:
        """This API's request body -> an OpenAI chat-completions body (pydantic-checked).

        Raises:
            RequestError: 400 for a body this API refuses.
        """
        ...

    def from_chat(self, chat: dict[str, Any]) -> dict[str, Any]:
        """A complete `chat.completion` dict (mlx-lm's `generate_response`, non-stream) -> this API's answer."""
        ...

    def stream(self) -> StreamTranslation:
        """A fresh translator for one streamed answer."""
        ...

    def error_body(self, status: int, message: str) -> dict[str, Any]:
        """This API's error body for HTTP `status`."""
        ...


class TokenCounter(ApiTranslation, Protocol):
    """An API that also counts a request's prompt tokens (Anthropic's `/v1/messages/count_tokens`)."""

    def to_count(self, body: dict[str, Any]) -> dict[str, Any]:
        """A count request's body -> the chat-completions body whose prompt is counted.

        Raises:
            RequestError: 400 for a body this API refuses.
        """
        ...

    def count_answer(self, n_tokens: int) -> dict[str, Any]:
        """The answer for a prompt of `n_tokens` tokens."""
        ...


def sse_event(name: str, data: dict[str, Any]) -> bytes:
    """One server-sent event (`event:` and `data:` lines, blank line)."""
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


class ApiWriter:
    """The handler's `wfile` while a translated request is answered.

    Modes: `pass` (bytes go through: status line and headers, an already translated body),
    `stream` (after mlx-lm's stream headers: its `data:` frames are translated, comments pass),
    `error` (after an error status: mlx-lm's `{"error": "<message>"}` body becomes `error_body`).
    """

    def __init__(self, raw: Any, api: ApiTranslation):
        self.raw = raw
        self.api = api
        self.mode = "pass"
        self.status = 200
        self._translator: StreamTranslation | None = None
        self._pending = b""

    def start_stream(self) -> None:
        self.mode, self._translator = "stream", self.api.stream()

    def start_error(self, status: int) -> None:
        self.mode, self.status = "error", status

    def write(self, data: bytes) -> int:
        if self.mode == "stream":
            self._pending += bytes(data)
            while b"\n\n" in self._pending:
                frame, self._pending = self._pending.split(b"\n\n", 1)
                self.raw.write(self._translate_frame(frame))
        elif self.mode == "error":
            self.raw.write(self._translate_error(bytes(data)))
        else:
            self.raw.write(data)
        return len(data)

    def _translate_error(self, data: bytes) -> bytes:
        try:
            doc = json.loads(data)
        except ValueError:
            return data
        if not isinstance(doc, dict) or not isinstance(doc.get("error"), str):
            return data  # already this API's shape
        return json.dumps(self.api.error_body(self.status, doc["error"])).encode()

    def _translate_frame(self, frame: bytes) -> bytes:
        text = frame.decode("utf-8", errors="replace")
        if not text.startswith("data:"):
            return frame + b"\n\n"  # an SSE comment (`: keepalive`)
        payload = text[len("data:"):].strip()
        assert self._translator is not None
        if payload == "[DONE]":
            events = self._translator.end()
        else:
            chunk = json.loads(payload)
            error = chunk.get("error") if isinstance(chunk, dict) else None
            if error is not None:
                message = error.get("message", str(error)) if isinstance(error, dict) else str(error)
                status = error.get("code", 500) if isinstance(error, dict) else 500
                events = [("error", self.api.error_body(int(status), str(message)))]
            else:
                events = self._translator.feed(chunk)
        return b"".join(sse_event(name, data) for name, data in events)

    def flush(self) -> None:
        self.raw.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.raw, name)


def check_api_key(headers: Any, key: str | None) -> bool:
    """True when no key is required or the request carries it (`x-api-key: KEY` or
    `Authorization: Bearer KEY`; either may be the one), compared in constant time
    (`hmac.compare_digest`)."""
    if not key:
        return True
    scheme, _, token = (headers.get("Authorization") or "").partition(" ")
    given = [headers.get("x-api-key"), token.strip() if scheme.lower() == "bearer" else None]
    return any(g is not None and hmac.compare_digest(g.encode(), key.encode()) for g in given)


def count_prompt_tokens(guard: Any, generator: Any, chat: dict[str, Any]) -> int:
    """Tokens of the prompt a chat-completions body makes (tokens), built as the generation thread
    builds it: mlx-lm's `_tokenize` (chat template, tools, `chat_template_kwargs`) on the
    handler's thread (`RequestGuard.pretokenize`). A prompt over `max_prompt_tokens` is counted
    all the same.

    Raises:
        RequestError: 400 when the template fails or the prompt has images (not counted here).
    """
    from mlx_lm.server import CompletionRequest

    request = CompletionRequest("chat", "", chat["messages"], chat.get("tools") or None, chat.get("role_mapping"))
    args = SimpleNamespace(chat_template_kwargs=chat.get("chat_template_kwargs"))
    try:
        guard.pretokenize(generator, request, args)
    except PromptTooLong as exc:
        return exc.n_tokens
    except Exception as exc:  # noqa: BLE001 - a chat template's error is the client's
        raise RequestError(400, f"the prompt could not be built: {' '.join(str(exc).split())[:300]}") from None
    out = take_pretokenized(request, guard.source)
    if out is None:
        raise RequestError(400, "prompts with images are not counted")
    return len(out[0])


class ApiHandlerMixin(_Base):
    """What a handler needs to answer a translated request (between kvtool's handler and
    mlx-lm's `APIHandler` in the MRO): the answer and its errors in the API's shapes."""

    kvtool_api: ApiTranslation | None = None  # the request's API (None: OpenAI's own routes)
    stream: bool  # mlx-lm's APIHandler sets these per request
    object_type: str
    response_generator: Any
    kvtool_guard: Any  # the handler's RequestGuard

    def _refuse(self, exc: RequestError) -> None:  # the handler's: answer a refusal and log it
        raise NotImplementedError

    def api_authorized(self, api: ApiTranslation | None) -> bool:
        """True when the request carries the server's key (`kvtool serve --api-key`), else it is
        answered 401 (in `api`'s error shape)."""
        self.kvtool_api = api
        if check_api_key(self.headers, getattr(self.server, "kvtool_api_key", None)):
            return True
        self._refuse(RequestError(401, "invalid or missing API key (send x-api-key or Authorization: Bearer)"))
        return False

    def api_count(self, counter: TokenCounter, body: dict[str, Any]) -> dict[str, Any]:
        """The answer to a token count request: the prompt `body` makes, counted as it would be built.

        Raises:
            RequestError: 400 for a body the API or `check_request` refuses.
        """
        chat = counter.to_count(body)
        check_request(chat, CHAT_PATH, self.kvtool_guard.limits)
        return counter.count_answer(count_prompt_tokens(self.kvtool_guard, self.response_generator, chat))

    def api_error_doc(self, status: int, message: str) -> dict[str, Any]:
        """The error body for the request's API (mlx-lm's `{"error": message}` for OpenAI's)."""
        return {"error": message} if self.kvtool_api is None else self.kvtool_api.error_body(status, message)

    def api_begin(self, api: ApiTranslation, body: dict[str, Any]) -> dict[str, Any]:
        """Translate `body` to chat completions and route the request there.

        Raises:
            RequestError: what `api.to_chat` raised.
        """
        self.kvtool_api = api
        chat = api.to_chat(body)
        self.path = CHAT_PATH
        return chat

    def generate_response(self, *args: Any, **kwargs: Any) -> dict:
        resp = super().generate_response(*args, **kwargs)  # type: ignore[misc]  # mlx-lm APIHandler
        if self.kvtool_api is not None and not self.stream and self.object_type == "chat.completion":
            return self.kvtool_api.from_chat(resp)
        return resp

    def _set_stream_headers(self, status_code: int = 200):
        if isinstance(self.wfile, ApiWriter):
            self.wfile.start_stream()
        super()._set_stream_headers(status_code)  # type: ignore[misc]  # mlx-lm APIHandler

    def _set_completion_headers(self, status_code: int = 200):
        if status_code >= 400 and isinstance(self.wfile, ApiWriter):
            self.wfile.start_error(status_code)
        super()._set_completion_headers(status_code)  # type: ignore[misc]  # mlx-lm APIHandler

    def flush_headers(self):
        """The status line and headers go to the socket untranslated."""
        writer = self.wfile
        if isinstance(writer, ApiWriter):
            self.wfile = writer.raw
        try:
            super().flush_headers()
        finally:
            self.wfile = writer


__all__ = ["ApiTranslation", "StreamTranslation", "TokenCounter", "ApiWriter", "ApiHandlerMixin", "check_api_key",
           "count_prompt_tokens", "sse_event", "CHAT_PATH"]
