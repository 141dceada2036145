"""Load generator: concurrent streamed chat completions against a loopback OpenAI-compatible server.

Clients are asyncio tasks sharing one `openai.AsyncOpenAI` client (no retries). Every request is
a streamed, greedy `/v1/chat/completions` call (`temperature=0`, `stream_options.include_usage`),
so the server reports `usage.prompt_tokens`, `usage.completion_tokens` and, where it knows it,
`usage.prompt_tokens_details.cached_tokens` (both `mlx_lm.server` and `kvtool serve` do).

Arrival processes (`LoadSpec.arrival`): `closed` (`clients` workers, each sends its next request
as soon as its previous one finished); `poisson` (open loop: arrivals at the times of a Poisson
process, `poisson_arrivals`); `trace` (each request at its own `LoadRequest.arrival_s`). In the
open ones `clients` caps the requests in flight (a request waits for a free slot; the wait is
`queue_ms`). A request may depend on an earlier one (`LoadRequest.after`, the previous turn of the
same conversation): it is sent only once that one finished, whatever the arrival process.

Bounds: at most `max_requests` requests are sent (the first ones of the list) AND nothing runs
past `max_wall_s` seconds: at that deadline requests in flight are cancelled (recorded with
`error = "wall time limit"`) and requests not yet sent are counted in `LoadResult.not_sent`.
Only loopback servers are accepted (`check_loopback`).

    from kvtool.bench.loadgen import LoadRequest, LoadSpec, run_load
    reqs = [LoadRequest(key=f"q{i}", messages=({"role": "user", "content": f"Question {i}"},), max_tokens=8)
            for i in range(8)]
    result = run_load("http://127.0.0.1:8080/v1", reqs, LoadSpec(clients=4))
    result.records[0].ttft_ms
"""

from __future__ import annotations

import asyncio
import ipaddress
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any
from urllib.parse import urlsplit

import numpy as np

ARRIVALS = ("closed", "poisson", "trace")
WALL_LIMIT_ERROR = "wall time limit"
DEFAULT_MODEL_NAME = "default_model"  # the name mlx_lm.server (and kvtool serve) always accept


@dataclass(frozen=True)
class LoadRequest:
    """One chat request of a workload.

    Attributes:
        key: stable identifier (the same request to two servers has the same key; output
            equality is checked per key).
        messages: chat messages (`{"role": ..., "content": ...}`), sent as they are.
        max_tokens: tokens to generate at most (tokens).
        phase: the workload phase it belongs to (e.g. `query`, `warmup`, `before`, `after`).
        session: the conversation / document / group it belongs to.
        after: index (in the request list) of a request that must finish before this one is sent.
        arrival_s: arrival time for `trace` replay (seconds from the start of the run).
    """

    key: str
    messages: tuple[dict[str, str], ...]
    max_tokens: int
    phase: str = "query"
    session: str = ""
    after: int | None = None
    arrival_s: float | None = None


@dataclass(frozen=True)
class LoadSpec:
    """How to send a list of requests.

    Attributes:
        clients: concurrency: workers (`closed`) or the cap on requests in flight (`poisson`,
            `trace`); >= 1.
        arrival: `closed`, `poisson` or `trace`.
        rate_per_s: Poisson arrival rate (requests/s), required for `poisson`.
        max_requests: send at most this many requests (0: all).
        max_wall_s: wall-time bound of the whole run (s).
        request_timeout_s: per-request HTTP timeout (s).
        seed: seed of the Poisson arrival times.
        model: the `model` field of every request.
        time_scale: `trace` arrival times are multiplied by it (0.5: twice as fast).
    """

    clients: int = 1
    arrival: str = "closed"
    rate_per_s: float | None = None
    max_requests: int = 0
    max_wall_s: float = 600.0
    request_timeout_s: float = 600.0
    seed: int = 0
    model: str = DEFAULT_MODEL_NAME
    time_scale: float = 1.0

    def __post_init__(self) -> None:
        if self.clients < 1:
            raise ValueError(f"clients must be >= 1, got {self.clients}")
        if self.arrival not in ARRIVALS:
            raise ValueError(f"arrival must be one of {', '.join(ARRIVALS)}, got {self.arrival!r}")
        if self.arrival == "poisson" and not (self.rate_per_s and self.rate_per_s > 0):
            raise ValueError("arrival 'poisson' needs rate_per_s > 0")
        if self.max_wall_s <= 0 or self.request_timeout_s <= 0 or self.time_scale <= 0:
            raise ValueError("max_wall_s, request_timeout_s and time_scale must be > 0")
        if self.max_requests < 0:
            raise ValueError("max_requests must be >= 0")


@dataclass
class RequestRecord:
    """What one request did. Times in ms from the moment the HTTP request is sent, relative times
    in s from the start of the run.

    Attributes:
        index: position in the request list.
        key, phase, session: copied from the `LoadRequest`.
        scheduled_s: when the arrival process released it (s since the run started).
        sent_s: when the HTTP request was sent (s since the run started).
        queue_ms: sent - scheduled (waiting for a client slot or the previous turn) (ms).
        ttft_ms: sent -> first streamed chunk with non-empty `delta.content` (ms).
        latency_ms: sent -> end of the stream (ms).
        prompt_tokens, completion_tokens: from `usage` (tokens; 0 if not reported).
        cached_tokens: `usage.prompt_tokens_details.cached_tokens` (tokens; None if not reported).
        text: the streamed output text.
        finish_reason: the last chunk's `finish_reason`.
        ttft_from_content: False when no chunk carried content (ttft_ms = latency_ms).
        sent: the HTTP request was sent (False: cut off by the deadline while it waited).
        error: None, or why the request failed (`WALL_LIMIT_ERROR` when cut off by the deadline).
    """

    index: int
    key: str
    phase: str
    session: str
    scheduled_s: float = 0.0
    sent_s: float = 0.0
    queue_ms: float = 0.0
    ttft_ms: float = float("nan")
    latency_ms: float = float("nan")
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int | None = None
    text: str = ""
    finish_reason: str | None = None
    ttft_from_content: bool = False
    sent: bool = False
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class LoadResult:
    """A finished run.

    Attributes:
        records: one per request sent (in list order).
        wall_s: first send -> last request finished (s).
        not_sent: requests of the list that were not sent (over `max_requests`, or past the
            wall-time bound).
        stopped_by: `done` (all sent requests finished) or `wall` (the deadline cut the run).
        spec: the `LoadSpec` used.
    """

    records: list[RequestRecord]
    wall_s: float
    not_sent: int
    stopped_by: str
    spec: LoadSpec


def check_loopback(base_url: str) -> None:
    """Refuse any server that is not on this machine.

    Raises:
        ValueError: the URL's host is not in 127.0.0.0/8, `localhost` or `::1` (or the URL has
            no http(s) scheme / host).
    """
    parts = urlsplit(base_url)
    host = parts.hostname
    if parts.scheme not in ("http", "https") or not host:
        raise ValueError(f"not an http(s) URL with a host: {base_url!r}")
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name other than localhost
        loopback = False
    if not loopback:
        raise ValueError(f"refusing non-loopback server {host!r}: the load generator only talks to "
                         "127.0.0.0/8, localhost or ::1")


def poisson_arrivals(n: int, rate_per_s: float, seed: int) -> np.ndarray:
    """Arrival times (s) of the first `n` events of a Poisson process of `rate_per_s` events/s:
    cumulative sums of exponential gaps (mean 1/rate), the first one included, from
    `numpy.random.default_rng(seed)`."""
    gaps = np.random.default_rng(seed).exponential(1.0 / rate_per_s, size=n)
    return np.cumsum(gaps)


def run_load(base_url: str, requests: Sequence[LoadRequest], spec: LoadSpec,
             on_progress: Callable[[int, int], None] | None = None) -> LoadResult:
    """Send `requests` to the server at `base_url` (e.g. `http://127.0.0.1:8080/v1`).

    Args:
        base_url: the OpenAI base URL (with `/v1`); loopback only.
        requests: in order; `after` indices refer to this list.
        spec: arrival process and bounds.
        on_progress: called as `(finished, to_send)` after every request.

    Returns:
        The `LoadResult`.

    Raises:
        ValueError: a non-loopback URL, or an `after` index that does not point backwards.
    """
    check_loopback(base_url)
    chosen = list(requests[: spec.max_requests] if spec.max_requests else requests)
    for i, req in enumerate(chosen):
        if req.after is not None and not 0 <= req.after < i:
            raise ValueError(f"request {i} ({req.key}): 'after' must point to an earlier request, got {req.after}")

    async def run() -> LoadResult:
        client = openai_client(base_url, spec.request_timeout_s)
        try:
            return await _Runner(client, chosen, spec, on_progress).run()
        finally:
            await client.close()

    result = asyncio.run(run())
    result.not_sent += len(requests) - len(chosen)  # over max_requests
    return result


def openai_client(base_url: str, timeout_s: float) -> Any:
    """An `openai.AsyncOpenAI` client of `base_url` without retries, `timeout_s` (s) per request.

    Raises:
        RuntimeError: the openai package is not installed.
    """
    try:
        from openai import AsyncOpenAI
    except ImportError as exc:  # pragma: no cover - openai is in the bench and test extras
        raise RuntimeError("the load generator needs the openai package: pip install 'kvtool[bench]'") from exc
    return AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=timeout_s)


class _Runner:
    def __init__(self, client: Any, requests: list[LoadRequest], spec: LoadSpec,
                 on_progress: Callable[[int, int], None] | None):
        self.client, self.requests, self.spec, self.on_progress = client, requests, spec, on_progress
        self.done = [asyncio.Event() for _ in requests]
        self.records: dict[int, RequestRecord] = {}
        self.finished = 0
        self.t0 = 0.0

    def _now(self) -> float:
        return time.perf_counter() - self.t0

    async def run(self) -> LoadResult:
        self.t0 = time.perf_counter()
        task = asyncio.ensure_future(self._closed() if self.spec.arrival == "closed" else self._open())
        finished, _ = await asyncio.wait({task}, timeout=self.spec.max_wall_s)
        stopped = "done" if finished else "wall"
        if not finished:
            task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        end = self._now()
        records = [self.records[i] for i in sorted(self.records) if self.records[i].sent]
        ends = [r.sent_s + r.latency_ms / 1e3 for r in records if r.latency_ms == r.latency_ms]  # NaN: cut off
        start = min((r.sent_s for r in records), default=0.0)
        wall = (end if stopped == "wall" or not ends else max(ends)) - start
        return LoadResult(records=records, wall_s=wall, not_sent=len(self.requests) - len(records),
                          stopped_by=stopped, spec=self.spec)

    # ------------------------------------------------------------ arrival processes
    async def _closed(self) -> None:
        queue = iter(range(len(self.requests)))

        async def worker() -> None:
            for i in queue:  # a shared iterator: each index is taken by exactly one worker
                await self._one(i, scheduled=self._now())

        await _gather_cancelling(worker() for _ in range(min(self.spec.clients, len(self.requests))))

    async def _open(self) -> None:
        n = len(self.requests)
        if self.spec.arrival == "poisson":
            assert self.spec.rate_per_s is not None  # LoadSpec checks it
            times = poisson_arrivals(n, self.spec.rate_per_s, self.spec.seed).tolist()
        else:
            times = [float(r.arrival_s or 0.0) * self.spec.time_scale for r in self.requests]
        slots = asyncio.Semaphore(self.spec.clients)

        async def arrive(i: int, at: float) -> None:
            await asyncio.sleep(max(0.0, at - self._now()))
            scheduled = self._now()
            async with slots:
                await self._one(i, scheduled)

        await _gather_cancelling(arrive(i, t) for i, t in enumerate(times))

    # ------------------------------------------------------------ one request
    async def _one(self, i: int, scheduled: float) -> None:
        req = self.requests[i]
        rec = RequestRecord(index=i, key=req.key, phase=req.phase, session=req.session, scheduled_s=scheduled)
        self.records[i] = rec
        try:
            if req.after is not None:
                await self.done[req.after].wait()
            await self._stream(req, rec)
        except asyncio.CancelledError:
            rec.error = WALL_LIMIT_ERROR
            raise
        except Exception as exc:  # noqa: BLE001 - a failed request is recorded, the run goes on
            rec.error = error_text(exc)
        finally:
            self.done[i].set()
        self.finished += 1
        if self.on_progress:
            self.on_progress(self.finished, len(self.requests))

    async def _stream(self, req: LoadRequest, rec: RequestRecord) -> None:
        rec.sent_s, rec.sent = self._now(), True
        rec.queue_ms = (rec.sent_s - rec.scheduled_s) * 1e3
        await stream_chat(self.client, self.spec.model, list(req.messages), req.max_tokens, rec)


def error_text(exc: BaseException) -> str:
    """A failed request's `error`: the exception's type and message on one line (at most 300
    characters), then its cause's in parentheses where it has one (the SDKs' `APIConnectionError`
    says only "Connection error."; its cause says refused, reset or timed out)."""
    text = f"{type(exc).__name__}: {' '.join(str(exc).split())}"
    cause = exc.__cause__
    if cause is not None:
        text += f" ({type(cause).__name__}: {' '.join(str(cause).split())})"
    return text[:300]


CONNECT_RETRIES = 3  # extra attempts of a request whose connection was never made
CONNECT_RETRY_S = 0.5  # wait before the first retry (s), doubled for each next one


def _never_connected(exc: BaseException) -> bool:
    """True if `exc` was caused by the HTTP client's `ConnectError` (matched by class name: the
    `openai` and `anthropic` SDKs bundle their own copy of httpx, `httpx2` in the versions here)."""
    cause = exc.__cause__
    return cause is not None and any(c.__name__ == "ConnectError" for c in type(cause).__mro__)


async def connect_retrying(call: Callable[[], Any]) -> Any:
    """`await call()`, again up to `CONNECT_RETRIES` times while it fails to connect (the SDK's
    connection error caused by a `ConnectError`: the server never got the request, e.g. a full
    listen backlog). Any other failure is raised at once: the server may have taken the request
    (the SDK's own retries, off, would repeat it). The wait counts in the request's TTFT.

    Raises:
        whatever `call` raises last.
    """
    attempt = 0
    while True:
        try:
            return await call()
        except Exception as exc:
            if attempt >= CONNECT_RETRIES or not _never_connected(exc):
                raise
        await asyncio.sleep(CONNECT_RETRY_S * 2**attempt)
        attempt += 1


async def stream_chat(client: Any, model: str, messages: list[dict[str, str]], max_tokens: int,
                      rec: RequestRecord) -> None:
    """One streamed greedy chat-completions call (`stream_options.include_usage`); fills `rec`:
    `ttft_ms`, `latency_ms` (ms from the call), `text`, `finish_reason` and the `usage` tokens."""
    t0, first, parts = time.perf_counter(), None, []
    stream = await connect_retrying(lambda: client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0.0,
        stream=True, stream_options={"include_usage": True},
    ))
    async for chunk in stream:
        for choice in chunk.choices or []:
            content = choice.delta.content if choice.delta is not None else None
            if content:
                first = first or time.perf_counter()
                parts.append(content)
            rec.finish_reason = choice.finish_reason or rec.finish_reason
        usage = getattr(chunk, "usage", None)
        if usage is not None:
            rec.prompt_tokens = int(usage.prompt_tokens or 0)
            rec.completion_tokens = int(usage.completion_tokens or 0)
            details = getattr(usage, "prompt_tokens_details", None)
            cached = getattr(details, "cached_tokens", None) if details is not None else None
            rec.cached_tokens = int(cached) if cached is not None else None
    finish_record(rec, t0, first, parts)


def finish_record(rec: RequestRecord, t0: float, first: float | None, parts: list[str]) -> None:
    """Close a streamed request's record: `latency_ms` = now - `t0`, `ttft_ms` = `first` (the first
    content, `time.perf_counter()` s) - `t0` or the latency without content, `text` = `parts` joined."""
    end = time.perf_counter()
    rec.latency_ms = (end - t0) * 1e3
    rec.ttft_from_content = first is not None
    rec.ttft_ms = ((first if first is not None else end) - t0) * 1e3
    rec.text = "".join(parts)


async def _gather_cancelling(coros) -> None:
    """Run the coroutines as tasks; if this is cancelled, cancel them all and wait for them."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


__all__ = ["ARRIVALS", "LoadRequest", "LoadResult", "LoadSpec", "RequestRecord", "WALL_LIMIT_ERROR",
           "check_loopback", "error_text", "finish_record", "openai_client", "poisson_arrivals", "run_load",
           "stream_chat"]
