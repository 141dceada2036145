"""JSON answers of `kvtool serve` outside its routes (the handler's `JsonErrors` base).

Where mlx-lm's `APIHandler` and http.server answer with a text or HTML body: a GET of a POST
route is 405 with `Allow: POST` in that route's error shape; a GET of no route is 404
`{"error": "no such route: GET <path>"}`; `/health` takes a query string; every `send_error` of
http.server (400, 414, 431, 501...) has a JSON body in the request's API's error shape.
"""

from __future__ import annotations

import json
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

from kvtool.server import api_routes
from kvtool.server.apis import ApiTranslation
from kvtool.server.validation import COMPLETION_PATHS

if TYPE_CHECKING:  # the mixin's view of mlx-lm's APIHandler
    from http.server import BaseHTTPRequestHandler as _Base
else:
    _Base = object

GET_ROUTES = ("/health", "/v1/models")  # mlx-lm's own GET routes (`/v1/models/<id>` too)
CLIENT_GONE = (BrokenPipeError, ConnectionResetError, ConnectionAbortedError, TimeoutError)


class JsonErrors(_Base):
    """The handler's base just above mlx-lm's `APIHandler`: JSON for the answers mlx-lm and
    http.server give outside the routes (see the module docstring)."""

    kvtool_api: ApiTranslation | None = None  # the error shape (ApiHandlerMixin's)

    def api_error_doc(self, status: int, message: str) -> dict[str, Any]:  # ApiHandlerMixin's
        raise NotImplementedError

    def do_GET(self):  # noqa: N802 - http.server naming
        route = self.path.split("?", 1)[0]
        if route in GET_ROUTES or route.startswith("/v1/models/"):
            self.path = route if route == "/health" else self.path  # mlx-lm compares /health whole
            super().do_GET()  # mlx-lm APIHandler
            return
        api, counter = api_routes.lookup(route)
        if route in COMPLETION_PATHS or api is not None or counter is not None:
            self.kvtool_api = api or counter  # the route's error shape
            self._json_error(HTTPStatus.METHOD_NOT_ALLOWED, f"{route[:100]} takes POST, not GET",
                             {"Allow": "POST"})
        else:
            self._json_error(HTTPStatus.NOT_FOUND, f"no such route: GET {route[:100]}")

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """http.server's error answer (a bad request line, an unknown method...) as JSON."""
        text = message or self.responses.get(code, ("error",))[0]
        self.log_error("code %d, message %s", code, text)
        self.close_connection = True
        self._json_error(code, text, {"Connection": "close"})

    def _json_error(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        def head() -> None:
            self.send_response(status)
            for name, value in {"Content-Type": "application/json", **(headers or {})}.items():
                self.send_header(name, value)

        data = json.dumps(self.api_error_doc(int(status), message)).encode()
        self._send(data, head, body=getattr(self, "command", None) != "HEAD")

    def _send(self, data: bytes, head: Any, body: bool = True) -> None:
        """`head()` (the status line and headers but the length), then `data` (not for a HEAD
        request: `body` False); a client gone meanwhile closes. Every answer kvtool writes itself."""
        try:
            head()
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if body:
                self.wfile.write(data)
            self.wfile.flush()
        except CLIENT_GONE:
            self.close_connection = True


__all__ = ["CLIENT_GONE", "JsonErrors"]
