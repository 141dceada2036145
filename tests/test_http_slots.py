"""The HTTP server's connection slots under a signal: SIGTERM turned into `Interrupted` can land
in the serving thread right after a request's thread started. The slot must be released once
(a second release raised ValueError, which replaced `Interrupted`: the signal was swallowed as
a request error and the server never stopped) and `Interrupted` must reach `serve_forever`."""

from __future__ import annotations

import signal
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler

import pytest

from kvtool.cli.common import Interrupted
from kvtool.server.handler import MAX_CONNECTIONS, KVToolHTTPServer


class _Hello(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's naming)
        body = b"hello"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_a_signal_after_the_request_thread_started_releases_its_slot_once(monkeypatch):
    errors: list[BaseException] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: errors.append(args.exc_value))
    server = KVToolHTTPServer(("127.0.0.1", 0), _Hello)
    ours, theirs = socket.socketpair()
    real_start = threading.Thread.start
    started: list[threading.Thread] = []

    def start_then_signal(thread: threading.Thread) -> None:
        real_start(thread)
        started.append(thread)
        raise Interrupted(signal.SIGTERM)  # as the SIGTERM handler raises it in the serving thread

    try:
        monkeypatch.setattr(threading.Thread, "start", start_then_signal)
        with pytest.raises(Interrupted):
            server.process_request(ours, ("127.0.0.1", 0))
        monkeypatch.setattr(threading.Thread, "start", real_start)
        theirs.sendall(b"GET / HTTP/1.0\r\n\r\n")
        assert theirs.recv(4096).startswith(b"HTTP/1.0 200")
        theirs.close()
        for t in started:
            t.join(10)
            assert not t.is_alive()
        assert errors == []  # no "Semaphore released too many times" in the request thread
        # every slot is free again, and only those
        slots = server._slots
        assert all(slots.acquire(blocking=False) for _ in range(MAX_CONNECTIONS))
        assert not slots.acquire(blocking=False)
    finally:
        server.server_close()


def test_the_server_still_serves_after_a_request_thread_failed_to_start(monkeypatch):
    """A request whose thread never started (here: start raises before starting) frees its slot."""
    server = KVToolHTTPServer(("127.0.0.1", 0), _Hello)

    def fail(thread: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    try:
        for _ in range(MAX_CONNECTIONS + 2):
            ours, theirs = socket.socketpair()
            monkeypatch.setattr(threading.Thread, "start", fail)
            with pytest.raises(RuntimeError):
                server.process_request(ours, ("127.0.0.1", 0))
            monkeypatch.undo()
            ours.close()
            theirs.close()
        deadline = time.monotonic() + 5
        while not server._slots.acquire(blocking=False):  # not exhausted by the failed starts
            assert time.monotonic() < deadline
    finally:
        server.server_close()
