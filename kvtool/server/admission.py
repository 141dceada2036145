"""When the generation loop starts a prefill step: requests that arrive together are prefilled together.

mlx-lm's generation loop takes every queued request into its batch before its next step. `kvtool
serve` tokenizes on the handler threads (`watchdog.RequestGuard.pretokenize`), one at a time, so
the loop would take the first of a burst alone while the others are still being tokenized
(docs/server.md#a-burst-is-prefilled-together has the measurements).

`Admission` counts the requests between their arrival (the handler read the request head) and
their hand-over to the loop (queued, or refused); the loop, after taking a request that found it
idle, waits for those still in admission before it starts the next step, as long as the burst
makes progress: until `window_s` after the latest arrival or hand-over, and at most
`ROUND_CAP_FACTOR` x `window_s` after the round's first request. A client that never finishes its
body holds the loop once, for at most `window_s` after the last progress.

It also waits for the clients of answers that just ended (closed-loop clients send their next
request tens of milliseconds after their answer): a round that starts within `return_s` of answers
ending waits, while fewer requests arrived since those ends than ended, until `return_s` after the
latest end or arrival (`RETURN_FACTOR` x `window_s`). One client never waits for itself.

`PrefillSteps` records, per batch step, the prompt tokens each request prefilled in it (from
mlx-lm's own progress reports), for `/kvtool/stats` and one DEBUG log line per step.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections import deque
from queue import Empty, Queue
from typing import Any

import mlx.core as mx
from mlx_lm.server import GenerationContext, Response, TimeBudget

log = logging.getLogger("kvtool.server")

WINDOW_ENV = "KVTOOL_ADMISSION_WINDOW_MS"
DEFAULT_WINDOW_S = 0.25  # longest wait for a request still in admission, from the burst's last progress (s)
ROUND_CAP_FACTOR = 8  # a round of waits ends at most this many windows after its first request
RETURN_FACTOR = 0.4  # a client whose answer ended is waited for this many windows after the end
RECENT_STEPS = 32  # prefill steps kept for /kvtool/stats
HISTORY = 256  # arrivals and answer ends remembered (times)


def window_from_env() -> float:
    """The admission window (s): `KVTOOL_ADMISSION_WINDOW_MS` (milliseconds, >= 0), else
    `DEFAULT_WINDOW_S`.

    Raises:
        ValueError: the variable is not a number >= 0.
    """
    raw = os.environ.get(WINDOW_ENV)
    if raw is None or not raw.strip():
        return DEFAULT_WINDOW_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise ValueError(f"{WINDOW_ENV} must be a number of milliseconds >= 0, not {raw!r}")
    return value / 1e3


class Admission:
    """Requests between arrival and hand-over to the generation loop, keyed by handler thread.

    Args:
        window_s: how long after the latest arrival or hand-over the loop may wait for a request
            still in admission (s); 0: never.

    Attributes:
        round_s: the longest round of waits, from the request that started it (s).
        return_s: how long after an answer's end its client is waited for (s).
    """

    def __init__(self, window_s: float = DEFAULT_WINDOW_S):
        self.window_s = window_s
        self.round_s = ROUND_CAP_FACTOR * window_s
        self.return_s = RETURN_FACTOR * window_s
        self._arrived: dict[int, float] = {}  # handler thread id -> arrival (monotonic s)
        self._arrivals: deque[float] = deque(maxlen=HISTORY)  # recent arrivals (monotonic s)
        self._ends: deque[float] = deque(maxlen=HISTORY)  # recent answer ends (monotonic s)
        self._left = 0  # hand-overs so far (a change wakes the waiting loop)
        self._left_at = float("-inf")  # the latest hand-over (monotonic s)
        self._cond = threading.Condition()
        self.waits = 0  # times the loop waited for a request in admission
        self.return_waits = 0  # ... of them, while clients of answers that just ended were expected back
        self.waited_s = 0.0  # the loop's time in those waits (s)
        self.joined = 0  # requests taken while the loop waited

    def arrive(self) -> None:
        """The calling handler thread has a request (its head is read)."""
        with self._cond:
            now = time.monotonic()
            self._arrived[threading.get_ident()] = now
            self._arrivals.append(now)

    def ended(self) -> None:
        """The loop finished generating a request's answer (its client may send the next one)."""
        with self._cond:
            self._ends.append(time.monotonic())

    def leave(self) -> None:
        """The calling handler thread's request was queued for the loop or refused (idempotent)."""
        with self._cond:
            if self._arrived.pop(threading.get_ident(), None) is not None:
                self._left += 1
                self._left_at = time.monotonic()
                self._cond.notify_all()

    @property
    def pending(self) -> int:
        """Requests in admission now."""
        with self._cond:
            return len(self._arrived)

    def _returning_until(self, since: float) -> float | None:
        """Until when the clients of answers that ended within `return_s` before `since` (or
        after it) are waited for: `return_s` after the latest such end or arrival, while fewer
        requests arrived since the first of those ends than ended; None: none is expected."""
        recent = [e for e in self._ends if e >= since - self.return_s]
        if not recent:
            return None
        came = sum(a >= recent[0] for a in self._arrivals)
        if came >= len(recent):
            return None
        return max(recent[-1], self._arrivals[-1] if self._arrivals else recent[-1]) + self.return_s

    def gather(self, requests: Queue, deadline: float) -> Any:
        """The next request of `requests` that a request in admission puts there, waiting while
        one is in admission, at most until `window_s` after the latest arrival or hand-over, and
        while clients of answers that just ended are expected back (`return_s`), at most until
        `deadline` (monotonic s); None when none comes. Called by the generation loop after it took
        a request that found it idle, before its next step (`deadline`: `round_s` after that)."""
        since = deadline - self.round_s  # the round's start
        t0 = time.monotonic()
        try:
            return self._gather(requests, deadline, since)
        finally:
            self.waited_s += time.monotonic() - t0

    def _gather(self, requests: Queue, deadline: float, since: float) -> Any:
        waited = returning = False
        while True:
            with self._cond:
                seen = self._left
                now = time.monotonic()
                last = max(self._arrived.values(), default=None)  # None: nothing in admission
                until = now if last is None else max(last, self._left_at) + self.window_s
                back = self._returning_until(since)
                until = min(deadline, until if back is None else max(until, back))
            try:
                item = requests.get_nowait()
            except Empty:
                item = None
            if item is not None:
                self.joined += waited
                return item
            if until <= now:
                return None
            if not waited:
                waited = True
                self.waits += 1
            if back is not None and not returning:
                returning = True
                self.return_waits += 1
            with self._cond:
                if self._left == seen:  # no hand-over since the queue was read: wait for one
                    self._cond.wait(timeout=until - now)

    def stats(self) -> dict[str, Any]:
        return {"admission_window_ms": round(self.window_s * 1e3, 3), "requests_in_admission": self.pending,
                "admission_waits": self.waits, "admission_return_waits": self.return_waits,
                "admission_wait_ms": round(self.waited_s * 1e3, 1), "admission_joined": self.joined}


class PrefillSteps:
    """The prompt tokens each request prefilled in each batch step of the generation loop.

    `StepClock` (the loop's `TimeBudget`) numbers the steps; a request's response queue
    (`RecordingQueue`) reports the progress mlx-lm puts on it, `(tokens processed, total)`
    after each step that prefilled part of its prompt. A step's record is the list of tokens
    each request prefilled in it, in report order (e.g. `[2048, 1572, 1588, 1534]`: four prompts
    in one step).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done: weakref.WeakKeyDictionary[Queue, int] = weakref.WeakKeyDictionary()
        self._recent: deque[list[int]] = deque(maxlen=RECENT_STEPS)
        self._step = 0  # the loop's step now
        self._current: list[int] = []
        self._current_step = -1
        self.steps = 0  # batch steps that prefilled prompt tokens
        self.max_batch = 0  # most requests prefilled in one step

    def tick(self) -> None:
        """A new step of the loop starts (or a run of steps ends)."""
        with self._lock:
            self._close()
            self._step += 1

    def progress(self, queue: Queue, processed: int, total: int, *, alone: bool = False) -> None:
        """`queue`'s request has `processed` of its `total` prompt tokens processed after the
        current step; `alone`: it was prefilled outside the batch (its own step)."""
        with self._lock:
            delta = processed - self._done.get(queue, 0)
            self._done[queue] = processed
            if processed >= total or delta <= 0:
                return  # the last token, handed to the first decode step
            if alone or self._current_step != self._step:
                self._close()
                self._current_step = self._step
            self._current.append(delta)
            if alone:
                self._close()

    def _close(self) -> None:
        if not self._current:
            return
        self.steps += 1
        self.max_batch = max(self.max_batch, len(self._current))
        self._recent.append(self._current)
        log.debug("prefill step: %d prompts, tokens %s", len(self._current), self._current)
        self._current = []

    def stats(self) -> dict[str, Any]:
        with self._lock:
            recent = [*self._recent, *([self._current] if self._current else [])]
            return {"prefill_steps": self.steps + bool(self._current),
                    "prefill_batch_max": max(self.max_batch, len(self._current)),
                    "prefill_steps_recent": [list(s) for s in recent]}


class StepClock(TimeBudget):
    """mlx-lm's `TimeBudget` (the loop runs one `BatchGenerator.next` per item) that numbers the steps."""

    def __init__(self, steps: PrefillSteps):
        super().__init__()
        self._steps = steps

    def __next__(self):
        self._steps.tick()
        return super().__next__()


COMPUTE_BOUND_TOKEN_BUDGET = 256  # uncached prompt tokens prefilling at once where prefill is compute-bound


def default_prefill_token_budget(device: mx.Device | None = None) -> int:
    """The prefill token budget `kvtool serve` uses when none is given (`PrefillSlots`, tokens; 0:
    none): `COMPUTE_BOUND_TOKEN_BUDGET` on MLX's CPU backend, none on a GPU.

    Where prefill is compute-bound a padded step of k long prompts takes as long as prefilling
    them one after another, but every first token waits for the whole step; with the budget long
    prompts go one at a time and short ones together. The idea is vLLM's token budget per
    scheduler step (`max_num_batched_tokens`); measured in docs/server.md#the-prefill-token-budget.

    Args:
        device: the device prefill runs on; None: `mx.default_device()`.
    """
    device = mx.default_device() if device is None else device
    return COMPUTE_BOUND_TOKEN_BUDGET if device.type == mx.DeviceType.cpu else 0


class PrefillSlots:
    """The requests the generation loop took whose prompt is not prefilled yet, at most the batch's
    prefill width (mlx-lm's `--prompt-concurrency`, `BatchGenerator.prefill_batch_size`) and, with a
    token budget, only while their uncached tokens (summed) are fewer than the budget.

    mlx-lm's loop fetches each queued request's cached prefix when it takes it, though its
    generator prefills at most `prefill_batch_size` prompts at a time; a request whose prefill
    cannot start yet is better left queued: taken when a slot frees, its fetch then finds what the
    requests before it stored (their system prompt's blocks). `full` says the loop should step
    instead of taking another request. A slot frees when its request's prefill completes (its last
    progress report), when it ends, when its response queue is gone (weak: a dropped request), or
    when the loop is idle (`clear`), so a miscount cannot hold requests back beyond a busy spell.
    A request's uncached tokens are known once the loop fetched its cached prefix (`uncached`; 0
    before, so the loop always takes at least one), and count whole until its prefill completes: a
    request taken while another prefills joins that prompt batch, left-padded to its offset, and
    counting only what is left let a long prompt's last chunk pad every next one.
    docs/server.md#requests-beyond-the-prefill-width-are-fetched-when-their-prefill-starts.

    Args:
        width: the prefill width (requests); 0: no limit.
        token_budget: uncached prompt tokens (summed over the requests prefilling) at which the
            loop takes no more; 0: no budget (`default_prefill_token_budget`).
    """

    def __init__(self, width: int, token_budget: int = 0):
        self.width = max(0, int(width))
        self.token_budget = max(0, int(token_budget))
        self._lock = threading.Lock()
        self._taken: weakref.WeakKeyDictionary[Queue, int] = weakref.WeakKeyDictionary()
        self.deferred = 0  # loop steps that left queued requests for a later step

    def take(self, queue: Queue) -> None:
        """The loop took the request answered on `queue`."""
        with self._lock:
            self._taken[queue] = 0

    def uncached(self, queue: Queue, tokens: int) -> None:
        """`queue`'s request has `tokens` uncached prompt tokens to prefill (after its cached prefix)."""
        with self._lock:
            if queue in self._taken:
                self._taken[queue] = max(0, int(tokens))

    def release(self, queue: Queue) -> None:
        """`queue`'s request finished its prefill (or ended)."""
        with self._lock:
            self._taken.pop(queue, None)

    def clear(self) -> None:
        """The loop is idle: no request of its batch is prefilling."""
        with self._lock:
            self._taken.clear()

    def full(self, queued: bool) -> bool:
        """Every slot is taken, or the requests prefilling hold the token budget: leave queued
        requests for a later step (counted when `queued`)."""
        with self._lock:
            full = (self.width > 0 and len(self._taken) >= self.width) or (
                self.token_budget > 0 and sum(self._taken.values()) >= self.token_budget)
            self.deferred += full and queued
            return full

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"prefill_width": self.width, "prefill_token_budget": self.token_budget,
                    "requests_prefilling": len(self._taken), "tokens_prefilling": sum(self._taken.values()),
                    "prefill_deferrals": self.deferred}


class RecordingQueue(Queue):
    """A request's response queue that reports the loop's prefill progress to `PrefillSteps`, tells
    `PrefillSlots` its uncached tokens once the loop fetched its cached prefix and frees its slot
    once the prompt is prefilled or the request ends, and tells `Admission` when its answer ends
    (`Admission.ended`: its client may send the next request)."""

    def __init__(self, steps: PrefillSteps, alone: threading.Event, slots: PrefillSlots, admission: Admission):
        super().__init__()
        self._steps = steps
        self._alone = alone  # set while the loop serves a request outside the batch
        self._slots: PrefillSlots | None = slots  # None once released
        self._admission = admission  # told when the answer ends (its client may come back)

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        if type(item) is tuple and len(item) == 2 and all(isinstance(x, int) for x in item):
            self._steps.progress(self, item[0], item[1], alone=self._alone.is_set())
            if item[0] >= item[1]:
                self._release()
        elif isinstance(item, GenerationContext):  # put right after the loop fetched its cached prefix
            if self._slots is not None and item.prompt_cache_count >= 0:
                self._slots.uncached(self, len(item.prompt) - item.prompt_cache_count)
        elif item is None or isinstance(item, (BaseException, Response)):
            self._release()
            if item is None:
                self._admission.ended()
        super().put(item, block, timeout)

    def _release(self) -> None:
        """Free this request's prefill slot, once (not again for each decoded token)."""
        if self._slots is not None:
            self._slots.release(self)
            self._slots = None


__all__ = ["Admission", "PrefillSlots", "PrefillSteps", "StepClock", "RecordingQueue", "window_from_env", "WINDOW_ENV",
           "default_prefill_token_budget", "COMPUTE_BOUND_TOKEN_BUDGET",
           "DEFAULT_WINDOW_S"]
