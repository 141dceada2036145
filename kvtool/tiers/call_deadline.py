"""A bound on a whole remote call, not only on each socket read.

redis-py bounds every socket operation, not a reply: a server that announces a large reply and
then sends a byte every 100 ms answers every read in time and holds the call, and the request
waiting on it, for ever. `CallWatchdog.deadline` registers a call with one daemon thread per
process, which closes the call's connections once the deadline has passed (`close_connections`):
the blocked read fails, the call is a failed call (`remote_errors`, the circuit breaker) and the
request a miss. `call_deadline_s(timeout_s)`: 40 socket timeouts, at least 5 s, far above what a
pipelined batch of values takes on any working link. MLX-free; imports no redis.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Any

from kvtool.config.remote_url import RemoteURL, describe_error

logger = logging.getLogger(__name__)

MIN_CALL_DEADLINE_S = 5.0
TIMEOUTS_PER_CALL = 40


class Expiry:
    """A call's deadline: `seconds` from its start or its last `renew()`, at clock time `at`;
    `fired` once the watchdog acted on it."""

    fired = False
    seconds = 0.0
    at = 0.0
    clock: Callable[[], float] = staticmethod(time.monotonic)

    def renew(self) -> None:
        """Start the `seconds` again (a long call that made progress: a SCAN page arrived). One
        float store, no lock (the watchdog reads `at` when it wakes)."""
        self.at = self.clock() + self.seconds


def call_deadline_s(timeout_s: float) -> float:
    """The whole-call bound (seconds) for a socket timeout of `timeout_s` seconds."""
    return max(MIN_CALL_DEADLINE_S, TIMEOUTS_PER_CALL * timeout_s)


def failure_text(exc: BaseException, expiry: Expiry, remote: RemoteURL, timeout_s: float) -> str:
    """One line on a failed call (URL masked): the deadline's, if it fired, else `describe_error`'s."""
    if expiry.fired:
        return (f"{remote.masked}: no whole answer within {expiry.seconds:g} s although every read "
                f"answered within {timeout_s:g} s (the server sends too slowly); its connections were closed")
    return describe_error(exc, remote, timeout_s)


def close_connections(client: Any) -> None:
    """Close every connection of a redis-py client, those in use included (a `redis.Redis`'s
    pool, or each node's pool of a `RedisCluster`): a thread blocked reading one gets an error."""
    pool = getattr(client, "connection_pool", None)
    if pool is not None:
        pool.disconnect(inuse_connections=True)
    else:
        client.disconnect_connection_pools()


class CallWatchdog:
    """Deadlines of calls in flight, kept by one daemon thread (started with the first call) that
    sleeps until the earliest one, and while there is none."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self._cond = threading.Condition()
        self._calls: dict[int, tuple[Expiry, Callable[[], None]]] = {}
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None

    @contextmanager
    def deadline(self, seconds: float, on_expiry: Callable[[], None]) -> Iterator[Expiry]:
        """Run the `with` block under a deadline of `seconds` (from its start or the yielded
        `Expiry`'s last `renew()`): past it, `on_expiry()` is called once on the watchdog's thread
        (it must make the block fail, e.g. `close_connections`), and `Expiry.fired` is True."""
        token, state = next(self._ids), Expiry()
        state.seconds, state.clock = seconds, self.clock
        state.renew()
        with self._cond:
            self._calls[token] = (state, on_expiry)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="kvtool-remote-deadline", daemon=True)
                self._thread.start()
            self._cond.notify()
        try:
            yield state
        finally:
            with self._cond:
                self._calls.pop(token, None)

    def _loop(self) -> None:
        while True:
            with self._cond:
                now = self.clock()
                due = [token for token, (state, _) in self._calls.items() if state.at <= now]
                expired = [self._calls.pop(token) for token in due]
                if not expired:
                    first = min((state.at for state, _ in self._calls.values()), default=None)
                    self._cond.wait(None if first is None else first - now)
                    continue
            for state, on_expiry in expired:
                state.fired = True
                logger.debug("a remote call passed its deadline: closing its connections")
                with suppress(Exception):  # closing what is broken anyway: nothing more to do
                    on_expiry()


WATCHDOG = CallWatchdog()

__all__ = ["CallWatchdog", "Expiry", "WATCHDOG", "call_deadline_s", "close_connections", "failure_text"]
