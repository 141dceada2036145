"""The HTTP side of `kvtool serve`: mlx-lm's `APIHandler` with request checks, and the server.

`make_handler_class(cache, guard, metrics)` subclasses `mlx_lm.server.APIHandler`:

- `POST` completions: the body is read with a size limit and a deadline and checked
  (`kvtool.server.validation`) before mlx-lm's own `do_POST` sees it; refusals are answered 4xx
  in the route's error shape with one log line; the prompt is tokenized on the handler's thread
  (`kvtool.server.watchdog.RequestGuard.pretokenize`);
- an exception of the generator is answered with its own status (`watchdog.error_status`)
  instead of mlx-lm's 404; a failure after the answer started ends the stream with an error
  event (or a 500 if nothing was sent); a client that goes away is one log line;
- `GET /v1/models` lists the served model's names; `GET /kvtool/stats` returns the cache and
  server counters, `GET /metrics` the same for Prometheus (`kvtool.prom`);
- foreign APIs (`kvtool.server.api_routes`) are translated to chat completions and answered in
  their own shapes (`kvtool.server.apis`); with `--api-key` every route checks the key first.

`KVToolHTTPServer` serves at most `MAX_CONNECTIONS` connections at once, and at most
`max_connections_per_peer` from one client address (503 beyond either), and logs a handler's
unexpected exception in one line. The request head must arrive within `head_timeout_s`
(`kvtool.server.head_reader`); an idle keep-alive connection is closed after the same time.
"""

from __future__ import annotations

import io
import json
import logging
import socket
import sys
import threading
import time
from http.server import ThreadingHTTPServer
from typing import Any
from urllib.parse import unquote

from kvtool.prom import CacheMetrics
from kvtool.server import api_routes, apis, http_errors, validation
from kvtool.server.adapter import KVToolPromptCache
from kvtool.server.head_reader import HeadReader
from kvtool.server.http_errors import CLIENT_GONE
from kvtool.server.validation import RequestError
from kvtool.server.watchdog import AdmittedHandler, RequestGuard, error_status

log = logging.getLogger("kvtool.server")

STATS_PATH = "/kvtool/stats"
METRICS_PATH = "/metrics"  # Prometheus text format (kvtool.prom)
SOCKET_TIMEOUT_S = 60.0  # a client silent this long while sending or receiving is dropped
BODY_TIMEOUT_S = 60.0  # the whole request body must arrive within this (else 408)
MAX_CONNECTIONS = 256  # connections served at once; more are answered 503 and closed
HEAD_TIMEOUT_S = 20.0  # the whole request head (request line and headers) must arrive within this (`--head-timeout`)
MAX_CONNECTIONS_PER_PEER = 64  # connections from one client address at once; more: 503 (`--max-connections-per-peer`)
LISTEN_BACKLOG = 128  # connections the kernel queues before they are accepted
LINGER_S = 2.0  # after refusing an unread body, how long the rest is read and dropped


class _Capture:
    """The shared generator, seen by one handler: remembers the exception `generate` raised (the
    handler answers it with its own status); makes the response's `cached_tokens` the tokens the
    cache gave (`KVToolPromptCache.reported_cached`); times the first and last token from the
    request's arrival (`kvtool_t0`) for `/metrics`, observed before the answer's end is written."""

    def __init__(self, generator: Any, handler: Any):
        self._generator = generator
        self._handler = handler

    def generate(self, request, generation_args, *args, **kwargs):
        try:
            guard = getattr(self._handler, "kvtool_guard", None)
            if guard is not None:
                guard.pretokenize(self._generator, request, generation_args)
            ctx, response = self._generator.generate(request, generation_args, *args, **kwargs)
        except Exception as exc:
            self._handler.kvtool_error = exc
            raise
        return ctx, self._true_cached(ctx, response)

    def _true_cached(self, ctx: Any, response):
        """`response`, with `ctx.prompt_cache_count` corrected once the fetch has run (mlx-lm
        reads it when it writes the usage, after the last token)."""
        fixed, ttft = False, None
        for item in response:
            if ttft is None:
                ttft = time.perf_counter() - self._handler.kvtool_t0
            if not fixed:
                fixed = self._fix(ctx)
            yield item
        if not fixed:
            self._fix(ctx)
        metrics = getattr(self._handler, "kvtool_metrics", None)
        if metrics is not None:
            metrics.observe_timing(ttft, time.perf_counter() - self._handler.kvtool_t0)

    def _fix(self, ctx: Any) -> bool:
        cache = getattr(self._handler, "kvtool_cache", None)
        count = getattr(ctx, "prompt_cache_count", -1)
        if cache is None or count is None or count < 0 or not hasattr(cache, "reported_cached"):
            return False
        ctx.prompt_cache_count = cache.reported_cached(ctx.prompt, count)
        return True

    def __getattr__(self, name: str) -> Any:
        return getattr(self._generator, name)


class _KVToolHandler(apis.ApiHandlerMixin, http_errors.JsonErrors):
    """What kvtool adds to mlx-lm's `APIHandler` (`make_handler_class` puts it first in the MRO, so
    that `super()` is mlx-lm's handler): request checks, `GET /kvtool/stats`, `GET /metrics`,
    a served-model `/v1/models`, errors answered with their own status."""

    response_generator: Any  # mlx-lm's APIHandler sets these
    created: int

    kvtool_cache: KVToolPromptCache
    kvtool_guard: RequestGuard
    kvtool_metrics: CacheMetrics | None
    timeout = SOCKET_TIMEOUT_S  # StreamRequestHandler: socket timeout for every read and write
    kvtool_error: BaseException | None = None
    kvtool_headers_sent = False
    kvtool_body_read = False
    kvtool_t0 = 0.0  # perf_counter at the POST's arrival (its head read)

    # ------------------------------------------------------------- request head
    def handle_one_request(self):
        """As `BaseHTTPRequestHandler.handle_one_request`, with a deadline for the whole head:
        each read of the request line and headers waits at most until the deadline (a
        `TimeoutError` past it, which the base class answers by closing the connection)."""
        raw = self.rfile
        limit = getattr(self.server, "kvtool_head_timeout_s", HEAD_TIMEOUT_S)
        self.rfile = HeadReader(raw, self.connection, time.monotonic() + limit, self.timeout, limit)
        self.kvtool_raw_rfile = raw
        try:
            super().handle_one_request()  # BaseHTTPRequestHandler (under mlx-lm's APIHandler)
        finally:
            self._end_head()

    def parse_request(self):
        try:
            return super().parse_request()  # reads the headers through HeadReader
        finally:
            self._end_head()

    def _end_head(self) -> None:
        """The head is read: the body and the answer get the per-read socket timeout again."""
        if isinstance(self.rfile, HeadReader):
            self.rfile = self.kvtool_raw_rfile
            try:
                self.connection.settimeout(self.timeout)
            except OSError:
                pass

    # ------------------------------------------------------------- routes
    def do_GET(self):  # noqa: N802 - http.server naming
        self.kvtool_body_read = True
        if not self.api_authorized(None):
            return
        route = self.path.split("?", 1)[0]
        if route == STATS_PATH:
            stats = self.kvtool_cache.stats()
            generator = self.response_generator
            stats["server"] = {**(generator.stats() if hasattr(generator, "stats") else {}),
                               "rejected_by_status": dict(self.kvtool_guard.rejected),
                               "max_prompt_tokens": self.kvtool_guard.limits.max_prompt_tokens,
                               "max_tokens_cap": self.kvtool_guard.limits.max_tokens_cap,
                               "max_body_bytes": self.kvtool_guard.limits.max_body_bytes}
            self._send_json(200, stats)
            return
        if route == METRICS_PATH and self.kvtool_metrics is not None:
            self._send_metrics()
            return
        super().do_GET()

    def handle_models_request(self):
        """The served model's names (`model` values this server accepts), OpenAI's list shape;
        `/v1/models/<id>` returns one model object (404 for another id)."""
        names = [n for n in self.kvtool_guard.limits.model_names if n != "default_model"]
        entries = [{"id": n, "object": "model", "created": self.created, "owned_by": "kvtool"} for n in names]
        rest = self.path.split("?", 1)[0][len("/v1/models"):]
        wanted = unquote(rest[1:] if rest.startswith("/") else rest)
        if not wanted:
            self._send_json(200, {"object": "list", "data": entries})
        elif wanted in self.kvtool_guard.limits.model_names:
            self._send_json(200, {"id": wanted, "object": "model", "created": self.created, "owned_by": "kvtool"})
        else:
            self._send_json(404, {"error": f"model {wanted[:200]!r} is not served here"})

    def do_POST(self):  # noqa: N802 - http.server naming
        self.kvtool_t0 = time.perf_counter()
        self.kvtool_error, self.kvtool_headers_sent, self.kvtool_body_read = None, False, False
        api, counter = api_routes.lookup(self.path)
        if self.path.split("?", 1)[0] in validation.COMPLETION_PATHS:  # a query string is ignored, as on /v1/messages
            self.path = self.path.split("?", 1)[0]
        if not self.api_authorized(api or counter):
            return
        if self.path not in validation.COMPLETION_PATHS and api is None and counter is None:
            self._refuse(RequestError(404, f"no such route: POST {self.path[:100]}"))
            return
        try:
            body = self._read_body()
            if counter is not None:
                self._send_json(200, self.api_count(counter, body))
                return
            if api is not None:
                body = self.api_begin(api, body)
            validation.check_request(body, self.path, self.kvtool_guard.limits)
        except RequestError as exc:
            self._refuse(exc)
            return
        # mlx-lm's do_POST reads the (checked, normalised) body again, from memory.
        data = json.dumps(body).encode()
        self.headers.replace_header("Content-Length", str(len(data)))
        rfile, self.rfile = self.rfile, io.BytesIO(data)
        wfile = self.wfile
        if api is not None:
            self.wfile = apis.ApiWriter(wfile, api)
        try:
            super().do_POST()
        finally:
            self.rfile, self.wfile = rfile, wfile

    def handle_completion(self, request, stop_words):
        shared = self.response_generator
        self.response_generator = _Capture(shared, self)
        try:
            super().handle_completion(request, stop_words)
        except CLIENT_GONE as exc:
            self.close_connection = True
            log.info("client %s went away during the response (%s)", self.client_address[0], type(exc).__name__)
        except Exception as exc:  # noqa: BLE001 - answered, never a dropped connection
            self._fail_started(exc)
        finally:
            self.response_generator = shared

    # ------------------------------------------------------------- helpers
    def _set_completion_headers(self, status_code: int = 200):
        if status_code == 404 and self.kvtool_error is not None:  # mlx-lm's answer to any generate() error
            exc, self.kvtool_error = self.kvtool_error, None
            status_code = error_status(exc)
            self.kvtool_guard.count_rejected(status_code)
            log.warning("request refused (%d): %s: %s", status_code, type(exc).__name__,
                        " ".join(str(exc).split())[:300])
        super()._set_completion_headers(status_code)  # the mixin, then mlx-lm APIHandler

    def flush_headers(self):
        self.kvtool_headers_sent = True
        super().flush_headers()

    def _send_metrics(self) -> None:
        """The Prometheus scrape: the text format, or OpenMetrics if the scraper's Accept asks."""
        assert self.kvtool_metrics is not None
        data, content_type = self.kvtool_metrics.encode(self.headers.get("Accept"))

        def head() -> None:
            self.send_response(200)
            self.send_header("Content-Type", content_type)

        self._send(data, head)

    def _send_json(self, status: int, doc: Any) -> None:
        data = json.dumps(doc, default=str).encode()
        self._send(data, lambda: super(_KVToolHandler, self)._set_completion_headers(status))

    def _refuse(self, exc: RequestError) -> None:
        self.kvtool_guard.count_rejected(exc.status)
        log.info("request refused (%d): %s", exc.status, exc.message)
        self.close_connection = True
        self._send_json(exc.status, self.api_error_doc(exc.status, exc.message))
        if not self.kvtool_body_read:
            self._linger()

    def _linger(self) -> None:
        """After an answer sent without reading the body: close our side, then read (and drop)
        what the client still sends, briefly, so that closing does not reset the connection
        before the client has read the answer."""
        deadline, left = time.monotonic() + LINGER_S, validation.DRAIN_MAX_BYTES
        try:
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_WR)
            self.connection.settimeout(LINGER_S)
            while left > 0 and time.monotonic() < deadline:
                chunk = self.connection.recv(1 << 16)
                if not chunk:
                    break
                left -= len(chunk)
        except OSError:
            pass

    def _fail_started(self, exc: Exception) -> None:
        """A failure after mlx-lm started answering: a 500 if nothing was sent yet, else an
        error event ending the stream."""
        status = error_status(exc)
        message = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
        log.error("request failed while generating (%d): %s", status, message)
        self.kvtool_guard.count_rejected(status)
        self.close_connection = True
        if not self.kvtool_headers_sent:
            buffered = getattr(self, "_headers_buffer", None)
            if buffered:
                buffered.clear()  # mlx-lm's 200 status line, not sent yet
            self._send_json(status, self.api_error_doc(status, message))
            return
        try:
            self.wfile.write(f"data: {json.dumps({'error': {'message': message, 'code': status}})}\n\n".encode())
            self.wfile.flush()
        except CLIENT_GONE:
            pass

    def _read_body(self) -> dict[str, Any]:
        limits = self.kvtool_guard.limits
        if self.headers.get("Transfer-Encoding") is not None:
            raise RequestError(411, "Transfer-Encoding is not supported; send a Content-Length")
        values = self.headers.get_all("Content-Length") or []
        if len(set(values)) > 1:
            raise RequestError(400, "conflicting Content-Length headers")
        try:
            n = validation.content_length(values[0] if values else None, limits.max_body_bytes)
        except RequestError as exc:
            if exc.status == 413:
                self.kvtool_body_read = self._drain(int(values[0].strip()))
            raise
        raw = self._read_exact(n)
        self.kvtool_body_read = True
        return validation.parse_body(raw)

    def _read_exact(self, n: int) -> bytes:
        chunks: list[bytes] = []
        try:
            left = self._read_chunks(n, chunks.append)
        except CLIENT_GONE:
            raise RequestError(408, "request body not received in time") from None
        if left is None:
            raise RequestError(408, f"request body not received within {BODY_TIMEOUT_S:.0f} s")
        if left:
            raise RequestError(400, f"request body ended after {n - left} of {n} bytes")
        return b"".join(chunks)

    def _drain(self, n: int) -> bool:
        """Read and drop an oversized body (up to DRAIN_MAX_BYTES), so that the client, still
        sending, reads the 413 instead of a reset connection. True when all of it was read."""
        try:
            return n <= validation.DRAIN_MAX_BYTES and self._read_chunks(n, lambda _chunk: None) == 0
        except (OSError, ValueError):
            return False

    def _read_chunks(self, n: int, take: Any) -> int | None:
        """Read `n` body bytes within `BODY_TIMEOUT_S`, each chunk to `take`: the bytes left
        unread when the body ended early (0: all read), None when the deadline passed."""
        deadline = time.monotonic() + BODY_TIMEOUT_S
        while n > 0:
            if time.monotonic() > deadline:
                return None
            chunk = self.rfile.read1(min(n, 1 << 16))
            if not chunk:
                return n
            take(chunk)
            n -= len(chunk)
        return 0


def make_handler_class(cache: KVToolPromptCache, guard: RequestGuard, metrics: CacheMetrics | None = None):
    """mlx-lm's `APIHandler` plus request checks, `GET /kvtool/stats`, `GET /metrics` (when
    `metrics` is given) and a served-model `/v1/models` (`_KVToolHandler`)."""
    from mlx_lm.server import APIHandler

    return type("KVToolAPIHandler", (AdmittedHandler, _KVToolHandler, APIHandler),
                {"kvtool_cache": cache, "kvtool_guard": guard, "kvtool_metrics": metrics})


def _busy(message: str) -> bytes:
    body = json.dumps({"error": message}).encode()
    return (b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


BUSY_RESPONSE = _busy("too many connections, try again")
PEER_BUSY_RESPONSE = _busy("too many connections from your address, try again")


class _Slot:
    """One connection's hold on the server's connection semaphore, released at most once."""

    def __init__(self, slots: threading.BoundedSemaphore, on_release: Any):
        self._slots = slots
        self._on_release = on_release  # also given back once: the peer's count
        self._lock = threading.Lock()
        self._held = True

    def release(self) -> None:
        with self._lock:
            if not self._held:
                return
            self._held = False
        self._slots.release()
        self._on_release()


class KVToolHTTPServer(ThreadingHTTPServer):
    """`kvtool serve`'s listener: a thread per connection, at most `MAX_CONNECTIONS` at once and
    `kvtool_max_per_peer` from one client address (503 and closed beyond either; see the module
    docstring). `serve.KVToolServer` builds it and sets the `kvtool_*` attributes before serving."""

    daemon_threads = True  # a request in flight never keeps the process alive after shutdown
    # listen() backlog: socketserver's default of 5 overflows when 16 clients connect at once
    request_queue_size = LISTEN_BACKLOG
    kvtool_holder: dict[str, Any]  # the handler's response generator, set once it exists (`_make_server`)
    kvtool_head_timeout_s: float = HEAD_TIMEOUT_S  # seconds for a whole request head (the handler reads it)
    kvtool_max_per_peer: int = MAX_CONNECTIONS_PER_PEER  # connections at once from one client address
    kvtool_api_key: str | None = None  # the key every request must carry (`--api-key`; never logged)

    def __init__(self, *args: Any, **kwargs: Any):
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._held: dict[int, _Slot] = {}  # id(request socket) -> its connection slot
        self._peers: dict[str, int] = {}  # client address -> its connections being served
        self._peers_lock = threading.Lock()
        super().__init__(*args, **kwargs)

    def _take_peer(self, peer: str) -> bool:
        with self._peers_lock:
            if self._peers.get(peer, 0) >= self.kvtool_max_per_peer:
                return False
            self._peers[peer] = self._peers.get(peer, 0) + 1
            return True

    def _drop_peer(self, peer: str) -> None:
        with self._peers_lock:
            left = self._peers.get(peer, 0) - 1
            if left > 0:
                self._peers[peer] = left
            else:
                self._peers.pop(peer, None)

    def _refuse_connection(self, request, response: bytes) -> None:
        try:
            request.sendall(response)
        except OSError:
            pass
        self.shutdown_request(request)

    def process_request(self, request, client_address):
        peer = str(client_address[0])
        if not self._take_peer(peer):
            self._refuse_connection(request, PEER_BUSY_RESPONSE)
            return
        if not self._slots.acquire(blocking=False):
            self._drop_peer(peer)
            self._refuse_connection(request, BUSY_RESPONSE)
            return
        slot = self._held[id(request)] = _Slot(self._slots, lambda: self._drop_peer(peer))
        try:
            super().process_request(request, client_address)
        except BaseException:
            # the thread may have started (SIGTERM's `Interrupted` can land after `start()`): the
            # slot is released once, whoever comes first, and the exception goes on unchanged
            slot.release()
            self._held.pop(id(request), None)
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            slot = self._held.pop(id(request), None)
            if slot is not None:
                slot.release()

    def handle_error(self, request, client_address):
        """One log line (socketserver prints a traceback); the traceback at DEBUG."""
        exc = sys.exc_info()[1]
        if isinstance(exc, CLIENT_GONE):
            log.info("client %s went away (%s)", client_address[0], type(exc).__name__)
        else:
            log.error("error while handling a request from %s: %s: %s", client_address[0], type(exc).__name__,
                      " ".join(str(exc).split())[:300], exc_info=log.isEnabledFor(logging.DEBUG))


__all__ = ["make_handler_class", "KVToolHTTPServer", "STATS_PATH", "METRICS_PATH", "MAX_CONNECTIONS",
           "HEAD_TIMEOUT_S", "MAX_CONNECTIONS_PER_PEER"]
