"""mlx-lm's `ResponseGenerator` with a generation thread that survives its own exceptions.

In mlx-lm 0.32.2 an exception raised in the generation loop outside its per-request `try`
(e.g. `"stop": 5` reaching `_make_state_machine`) ends the generation thread for good: every
later request is answered 404 "generation thread died" while the process keeps its port.
`KVToolResponseGenerator` runs the same loop (`ResponseGenerator._generate`, unchanged) under a
watchdog in the same thread: when the loop raises, every request it had taken or that was queued
is failed with `GenerationFailed` (the handler answers 500), and the loop starts again with
fresh state (the model stays loaded). More than `MAX_RESTARTS` failures within
`RESTART_WINDOW_S` mean the failure is not a single bad request: the thread then stops, `/health`
answers 503 and every request is answered 503 at once (`GenerationUnavailable`).

It also refuses prompts longer than `max_prompt_tokens` at tokenization (`PromptTooLong`, 413):
the backstop of the handler's own check (`RequestGuard.pretokenize`, which tokenizes on the
handler's thread), e.g. for prompts with images, which the handler does not tokenize. The loop
waits for the requests still in admission (`AdmittedHandler`; `kvtool.server.admission`).

Test seam: with the environment variable `KVTOOL_TEST_GENERATION_FAULT` set to a string, a
request whose stop strings include it makes the generation loop raise where `"stop": 5` did
(the handler rejects `"stop": 5` itself, so the restart path needs another trigger).
"""

from __future__ import annotations

import copy
import logging
import os
import threading
import time
import weakref
from collections import deque
from queue import Empty, Queue
from typing import TYPE_CHECKING, Any

from mlx_lm.server import ResponseGenerator

from kvtool.server.admission import Admission, PrefillSlots, PrefillSteps, RecordingQueue, StepClock
from kvtool.server.validation import RequestError

if TYPE_CHECKING:
    from kvtool.server.validation import Limits

log = logging.getLogger("kvtool.server")

PRETOKENIZED = "_kvtool_pretokenized"  # a request's attribute: (tokenizer, `_tokenize` result)
MAX_RESTARTS = 5  # generation loop failures tolerated within RESTART_WINDOW_S
RESTART_WINDOW_S = 60.0
FAULT_ENV = "KVTOOL_TEST_GENERATION_FAULT"


class GenerationFailed(RuntimeError):
    """The generation loop raised while this request was queued or in progress (HTTP 500)."""


class GenerationUnavailable(RuntimeError):
    """The generation loop failed too often and was stopped (HTTP 503)."""


class PromptTooLong(ValueError):
    """The prompt has more tokens than `max_prompt_tokens` (HTTP 413)."""

    def __init__(self, n_tokens: int, limit: int):
        super().__init__(f"the prompt has {n_tokens} tokens, more than this server's limit of {limit} "
                         f"(kvtool serve --max-prompt-tokens)")
        self.n_tokens = n_tokens
        self.limit = limit


def error_status(exc: BaseException) -> int:
    """The HTTP status for an exception raised by the generator for one request."""
    if isinstance(exc, RequestError):
        return exc.status
    if isinstance(exc, PromptTooLong):
        return 413
    if isinstance(exc, GenerationUnavailable):
        return 503
    if isinstance(exc, GenerationFailed):
        return 500
    if isinstance(exc, ValueError | TypeError | LookupError) or type(exc).__module__.startswith("jinja2"):
        return 400  # the request could not be tokenized (chat template, message fields)
    return 500


class RequestGuard:
    """What the handler checks a request against: `limits` and a private copy of the tokenizer
    (the prompt is tokenized in the handler thread, under a lock, as the generation thread will)."""

    def __init__(self, limits: Limits, tokenizer: Any, admission: Admission | None = None):
        self.limits = limits
        self.admission = admission if admission is not None else Admission()  # shared with the generator
        self.source = tokenizer  # the served tokenizer (the generation thread's)
        self._tokenizer = copy.deepcopy(tokenizer)
        self._lock = threading.Lock()
        self.rejected: dict[str, int] = {}
        self._count_lock = threading.Lock()

    def count_rejected(self, status: int) -> None:
        with self._count_lock:
            self.rejected[str(status)] = self.rejected.get(str(status), 0) + 1

    def pretokenize(self, generator: KVToolResponseGenerator, request: Any, args: Any) -> None:
        """Tokenize a request on its handler's thread exactly as the generation thread would
        (mlx-lm's `ResponseGenerator._tokenize`: chat template, system / user segments, initial
        state), refuse it over `max_prompt_tokens`, and leave the result on the request for the
        generation thread's `_tokenize` (`take_pretokenized`): every text prompt is tokenized
        once, here, overlapping decoding (docs/server.md#tokenization-off-the-generation-thread).
        The work is on a copy of the request (mlx-lm's message processing rewrites its messages)
        with this guard's copy of the tokenizer, one request at a time. A request with images is
        left to the generation thread.

        Raises:
            PromptTooLong: more tokens than `max_prompt_tokens` (answered 413).
            Exception: what `_tokenize` raised (a chat template or tokenizer error: 400).
        """
        if request.request_type == "chat" and any(
                not isinstance(m, dict) or (isinstance(m.get("content"), list)
                and any(not isinstance(p, dict) or p.get("type") != "text" for p in m["content"]))
                for m in request.messages):  # fmt: skip
            return
        try:
            with self._lock:
                out = generator.tokenize_as_mlx_lm(self._tokenizer, copy.deepcopy(request), args)
            if len(out[0]) > self.limits.max_prompt_tokens:
                raise PromptTooLong(len(out[0]), self.limits.max_prompt_tokens)
        except Exception:
            self.admission.leave()  # refused: the generation loop waits for it no longer
            raise
        setattr(request, PRETOKENIZED, (self.source, out))


class AdmittedHandler:
    """The first base of `kvtool serve`'s HTTP handler class (`handler.make_handler_class`): a
    POST is in admission (`RequestGuard.admission`, which the generation loop waits for) from
    its arrival (its head is read) until it is queued for the loop (`KVToolResponseGenerator.generate`)
    or answered otherwise (refused, or failed before it was queued)."""

    kvtool_guard: RequestGuard

    def do_POST(self):  # noqa: N802 - http.server naming
        admission = self.kvtool_guard.admission
        admission.arrive()
        try:
            super().do_POST()  # the handler's next base (kvtool's, then mlx-lm's)
        finally:
            admission.leave()


class KVToolResponseGenerator(ResponseGenerator):
    """`mlx_lm.server.ResponseGenerator` whose generation loop is restarted when it raises, and
    waits for the requests in `admission` (`_next_request`); `prefill_steps` records the prompt
    tokens of each request prefilled in each step.

    Args:
        model_provider, prompt_cache: as `ResponseGenerator`.
        max_prompt_tokens: longest prompt accepted (tokens, after the chat template).
        admission: the handlers' arrivals (`RequestGuard.admission`); None: the loop never waits.
        prefill_token_budget: `PrefillSlots`' token budget (uncached prompt tokens; 0: none).
    """

    def __init__(self, model_provider: Any, prompt_cache: Any, *, max_prompt_tokens: int,
                 admission: Admission | None = None, prefill_token_budget: int = 0):
        # Set before the base class starts the generation thread.
        self.admission = admission if admission is not None else Admission(window_s=0.0)
        self.prefill_steps = PrefillSteps()
        self.prefill_slots = PrefillSlots(getattr(model_provider.cli_args, "prompt_concurrency", 0) or 0,
                                          prefill_token_budget)
        self._alone = threading.Event()  # set while the loop serves a request outside the batch
        self._round_until: float | None = None  # the loop took a request: it may wait until then
        self.max_prompt_tokens = max_prompt_tokens
        self.restarts = 0
        self.pretokenized = 0  # prompts the handlers tokenized for this thread (`RequestGuard.pretokenize`)
        self.last_failure: str | None = None
        self._failures: deque[float] = deque()
        self._registry_lock = threading.Lock()
        # The response queue of every request handed to the loop (weak: a finished request's
        # queue goes away with its handler).
        self._in_flight: weakref.WeakKeyDictionary[Queue, None] = weakref.WeakKeyDictionary()
        self._fault = os.environ.get(FAULT_ENV) or None
        super().__init__(model_provider, prompt_cache)
        # The loop reads its time budget at its first step, after a request was queued: no
        # request reaches the queue before this generator is handed to the handlers.
        self._time_budget = StepClock(self.prefill_steps)

    # ------------------------------------------------------------------ the thread
    def _run_generate(self) -> None:
        while not self._stop:
            try:
                self._generate()
                return  # stopped (stop_and_join)
            except Exception as exc:  # noqa: BLE001 - the watchdog: any failure of the loop
                reason = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
                log.exception("the generation loop raised (%s); failing its requests and restarting it", reason)
                del exc  # its traceback holds the dead loop's caches
                if not self._restart(reason):
                    return

    def _restart(self, reason: str) -> bool:
        """Fail the dead loop's requests; False when generation must stop for good."""
        now = time.monotonic()
        self._failures.append(now)
        while self._failures and now - self._failures[0] > RESTART_WINDOW_S:
            self._failures.popleft()
        self.last_failure = reason
        give_up = len(self._failures) > MAX_RESTARTS
        if give_up:
            self._generation_failed = True  # generate() refuses from now on; /health says 503
            log.error("the generation loop failed %d times within %.0f s; generation is stopped (HTTP 503)",
                      len(self._failures), RESTART_WINDOW_S)
        error: Exception = (GenerationUnavailable(f"generation is stopped after repeated failures (last: {reason})")
                            if give_up else
                            GenerationFailed(f"generation failed ({reason}); the request was dropped and the "
                                             "generation thread restarted"))
        with self._registry_lock:
            while True:
                try:
                    self.requests.get_nowait()  # queued: not taken by the loop, failed with the others
                except Empty:
                    break
            for queue in list(self._in_flight):
                queue.put(error)
            self._in_flight.clear()
        if not give_up:
            self.restarts += 1
        return not give_up

    # ------------------------------------------------------------ mlx-lm hooks
    def _next_request(self, timeout=None):
        """As mlx-lm's, then, when nothing is queued and the loop took a request just before
        that found it idle, the requests still in admission, waited for (`Admission.gather`) while
        the burst makes progress, at most `Admission.round_s` after that first request.

        The loop is idle when it asks with a timeout (mlx-lm's loop blocks only when its batch
        holds no request). A busy loop never waits (its decoding would stall), and takes nothing
        while its prefill slots are all taken (`PrefillSlots`)."""
        if self._is_distributed:
            return super()._next_request(timeout)
        if timeout is not None:  # an idle loop: its batch holds no request
            self.prefill_slots.clear()
        elif self.prefill_slots.full(queued=not self.requests.empty()):  # its prefill could not start yet
            self._round_until = None  # a busy loop does not wait for requests in admission
            return None
        got = super()._next_request(timeout)
        if got is None and self._round_until is not None:
            got = self.admission.gather(self.requests, self._round_until)
        if got is None:
            self._round_until = None
            return None
        if self._round_until is None and timeout is not None:  # a burst may be arriving at an idle loop
            self._round_until = time.monotonic() + self.admission.round_s
        self.prefill_slots.take(got[0])
        return got

    def _serve_single(self, request, stream):
        self._alone.set()  # its prefill progress is its own step
        try:
            return super()._serve_single(request, stream)
        finally:
            self._alone.clear()

    def tokenize_as_mlx_lm(self, tokenizer: Any, request: Any, args: Any) -> tuple:
        """mlx-lm's own tokenization of `request` with `tokenizer` (`ResponseGenerator._tokenize`:
        chat template, system / user segments, initial state; the result's first item is the
        prompt's token ids), without this class's pretokenized short cut or token limit.

        Raises:
            Exception: what mlx-lm's tokenization raised (chat template, message fields).
        """
        # mlx-lm 0.32.2 has no public tokenization of a request: the subclass calls its base's own
        return super()._tokenize(tokenizer, request, args)

    def request_stop(self) -> None:
        """Ask the generation loop to end after its current step, without waiting for it (mlx-lm's
        `stop_and_join` without the join)."""
        self._stop = True  # mlx-lm's stop flag, read by its loop (`ResponseGenerator._generate`)

    def _tokenize(self, tokenizer, request, args):
        out = take_pretokenized(request, tokenizer)
        if out is None:
            out = super()._tokenize(tokenizer, request, args)
        else:
            self.pretokenized += 1
        if len(out[0]) > self.max_prompt_tokens:
            raise PromptTooLong(len(out[0]), self.max_prompt_tokens)
        return out

    def _make_state_machine(self, model_key, tokenizer, stop_words):
        if self._fault is not None and self._fault in stop_words:
            raise RuntimeError(f"fault injected by {FAULT_ENV}")
        return super()._make_state_machine(model_key, tokenizer, stop_words)

    def generate(self, request, generation_args, progress_callback=None):
        """As `ResponseGenerator.generate`, with the request registered so that a failure of the
        loop answers it (`GenerationFailed`) instead of leaving it waiting.

        Raises:
            GenerationUnavailable: generation was stopped after repeated failures.
            GenerationFailed: the loop failed before the request started.
            Exception: what the loop put for this request (tokenization, `PromptTooLong`, ...).
        """
        if not self.generation_available():
            raise GenerationUnavailable(
                f"generation is stopped after repeated failures (last: {self.last_failure or 'unknown'})")
        response_queue: Queue = RecordingQueue(self.prefill_steps, self._alone, self.prefill_slots, self.admission)
        with self._registry_lock:
            self._in_flight[response_queue] = None
            self.requests.put((response_queue, request, generation_args))
        self.admission.leave()  # queued: the loop no longer waits for this handler

        def _inner():
            while True:
                response = self._await_response(response_queue)
                if response is None:
                    break
                if isinstance(response, Exception):
                    raise response
                if isinstance(response, tuple):
                    if progress_callback is not None:
                        progress_callback(*response)
                    continue
                yield response

        ctx = self._await_response(response_queue)
        if isinstance(ctx, Exception):
            raise ctx
        return ctx, _inner()

    def stats(self) -> dict[str, Any]:
        """Watchdog counters (JSON-able)."""
        return {"generation_restarts": self.restarts, "prompts_pretokenized": self.pretokenized,
                "generation_available": self.generation_available(),
                "last_generation_failure": self.last_failure,
                **self.admission.stats(), **self.prefill_steps.stats(), **self.prefill_slots.stats()}


def take_pretokenized(request: Any, tokenizer: Any) -> tuple | None:
    """The `_tokenize` result a handler thread left on `request` (`RequestGuard.pretokenize`),
    removed from it; None when there is none or it was made for another tokenizer than the one
    the generation thread holds (e.g. after the model provider loaded another model)."""
    got = request.__dict__.pop(PRETOKENIZED, None) if hasattr(request, "__dict__") else None
    if got is None or got[0] is not tokenizer:
        return None
    return got[1]


__all__ = ["KVToolResponseGenerator", "AdmittedHandler", "RequestGuard", "error_status", "take_pretokenized", "PRETOKENIZED", "GenerationFailed", "GenerationUnavailable", "PromptTooLong",
           "MAX_RESTARTS", "RESTART_WINDOW_S", "FAULT_ENV"]
