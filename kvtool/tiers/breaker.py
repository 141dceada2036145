"""A consecutive-failure circuit breaker with exponential back-off: the remote tier's guard
(`kvtool.tiers.remote_store.RemoteStore.call`), so a dead server costs a request no more than
its deadline. MLX-free."""

from __future__ import annotations

import threading
from collections.abc import Callable


class Breaker:
    """Consecutive-failure circuit breaker with exponential back-off (thread-safe).

    Closed: every call goes through. After `threshold` consecutive failures (or `trip()`) it is
    open for `backoff_s` seconds, doubling up to `max_s` at each failed probe; after the back-off
    one caller at a time probes (half-open); a success closes it and resets the back-off.
    """

    def __init__(self, threshold: int, base_s: float, max_s: float, clock: Callable[[], float]):
        self.threshold, self.base_s, self.max_s, self.clock = threshold, base_s, max_s, clock
        self._lock = threading.Lock()
        self._failures = 0
        self._open_until: float | None = None
        self._backoff_s = base_s
        self._probing = False
        self.trips = 0

    @property
    def is_open(self) -> bool:
        return self._open_until is not None

    def allow(self) -> bool:
        """May a call go to the server now?"""
        with self._lock:
            if self._open_until is None:
                return True
            if self._probing or self.clock() < self._open_until:
                return False
            self._probing = True
            return True

    def success(self) -> bool:
        """Record a good call; True if this closed an open breaker."""
        with self._lock:
            was_open = self._open_until is not None
            self._failures, self._open_until, self._backoff_s, self._probing = 0, None, self.base_s, False
            return was_open

    def failure(self, trip: bool = False) -> bool:
        """Record a failed call (`trip`: open at once); True if the breaker has just opened (it
        was closed: the start of an outage)."""
        with self._lock:
            self._failures += 1
            was_open = self._open_until is not None
            if was_open:  # a failed probe: wait longer
                self._backoff_s = min(self._backoff_s * 2, self.max_s)
            elif not trip and self._failures < self.threshold:
                return False
            self._open_until = self.clock() + self._backoff_s
            self._probing = False
            if not was_open:
                self.trips += 1
            return not was_open


__all__ = ["Breaker"]
