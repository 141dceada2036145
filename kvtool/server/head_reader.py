"""The connection's reader while `kvtool serve` reads a request head: a deadline for the whole head
(the per-read socket timeout alone restarts on every line: a slow-header client kept its slot)."""

from __future__ import annotations

import socket
import time
from typing import Any


class HeadReader:
    """The connection's reader while the request head is read: each `readline` waits at most
    until `deadline` (monotonic seconds).

    Raises (from `readline`):
        TimeoutError: the deadline passed (the head did not arrive within `limit_s`).
    """

    def __init__(self, raw: Any, sock: socket.socket, deadline: float, timeout: float, limit_s: float):
        self._raw, self._sock, self._deadline, self._timeout, self._limit = raw, sock, deadline, timeout, limit_s

    def readline(self, size: int = -1) -> bytes:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"request head not received within {self._limit:g} s")
        self._sock.settimeout(min(self._timeout, left))
        return self._raw.readline(size)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)


__all__ = ["HeadReader"]
