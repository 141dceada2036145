"""Requests that arrive together are prefilled together (`kvtool.server.admission`).

A real `kvtool serve` (tiny model) batching as `mlx_lm.server` does (`--prefill-token-budget 0`)
gets 4 cold prompts at once; its own per-step record (`prefill_steps_recent` in `/kvtool/stats`,
from mlx-lm's progress reports) must show them prefilled in one batch step, and the answers must
equal plain `mlx_lm.server`'s. With kvtool's default token budget on the CPU backend
(`kvtool.server.admission.default_prefill_token_budget`) long prompts arriving together are
prefilled one per step and short ones together, with the same answers.

"At once" is made exact, whatever the load of the machine: each request is sent but for the
last byte of its body, the test waits until the server counts all 4 in admission (heads read,
not yet queued), then sends the last bytes. The generation loop takes the first request
completed and then waits for the others still in admission; the admission window is set long
(`KVTOOL_ADMISSION_WINDOW_MS`) so that a slow machine cannot close it early.
"""

from __future__ import annotations

import json
import random
import socket
import threading
import time
import urllib.request

import pytest

from kvtool.server.admission import COMPUTE_BOUND_TOKEN_BUDGET, default_prefill_token_budget
from tests.test_serve_hostile import HTTP_TIMEOUT_S, server_stats, start_kvtool, start_mlx_lm

pytest.importorskip("openai")

N = 4
WINDOW_MS = "120000"  # the admission window of the server under test (a loaded machine is slow)
MLX_BATCHING = ("--prefill-token-budget", "0")  # batch as mlx_lm.server does (kvtool's default on a GPU)
ANSWER_TIMEOUT_S = 600.0  # 4 prompts of ~1,800 tokens prefilled on a loaded 2-core machine
WORDS = "harbour tide lantern copper meadow quarry saddle thistle orchard beacon ember glacier".split()


def bodies(seed: int, n_words: int = 600) -> list[dict]:
    """N chat requests with distinct (cold) prompts (600 words: ~1,800 tokens of the tiny model, one
    prefill step of 2048), greedy, a few tokens each."""
    rng = random.Random(seed)
    return [{"model": "default_model", "max_tokens": 8, "temperature": 0.0,
             "messages": [{"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(n_words))}]}
            for _ in range(N)]


def send_but_last_byte(port: int, body: dict) -> tuple[socket.socket, bytes]:
    """A connection with the request sent but the last byte of its body; (socket, that byte)."""
    data = json.dumps(body).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n").encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=ANSWER_TIMEOUT_S)
    s.sendall(head + data[:-1])
    return s, data[-1:]


def answer(s: socket.socket) -> tuple[int, dict]:
    """(status, JSON body) of the answer on `s` (the server closes the connection)."""
    out = b""
    with s:
        while chunk := s.recv(1 << 16):
            out += chunk
    head, _, body = out.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def wait_in_admission(server, n: int) -> None:
    deadline = time.monotonic() + HTTP_TIMEOUT_S
    while server_stats(server)["server"]["requests_in_admission"] < n:
        assert time.monotonic() < deadline, server_stats(server)["server"]
        time.sleep(0.05)


def post(server, doc: dict) -> dict:
    """The answer of one chat request (urllib)."""
    req = urllib.request.Request(server.url + "/v1/chat/completions", data=json.dumps(doc).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=ANSWER_TIMEOUT_S) as r:
        return json.loads(r.read())


def post_together(server, docs: list[dict]) -> list[dict]:
    """The answers of `docs` sent at once (a thread each) with urllib."""
    out: list[dict] = [{}] * len(docs)

    def one(i: int) -> None:
        out[i] = post(server, docs[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(docs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(ANSWER_TIMEOUT_S)
    assert all(out), "a request to mlx_lm.server failed"
    return out


def text(doc: dict) -> str:
    return doc["choices"][0]["message"]["content"]


@pytest.mark.slow
def test_four_prompts_that_arrive_together_are_prefilled_in_one_step(tmp_path):
    """...and so are their clients' next prompts, sent each soon after its answer came (closed-loop
    clients come back one after another: the loop, idle, takes the first and waits for the others)."""
    kv = start_kvtool(tmp_path, "burst", *MLX_BATCHING, env={"KVTOOL_ADMISSION_WINDOW_MS": WINDOW_MS})
    try:
        docs, nexts = bodies(seed=3), bodies(seed=6, n_words=100)
        held = [send_but_last_byte(kv.port, d) for d in docs]
        wait_in_admission(kv, N)
        before = server_stats(kv)["server"]["prefill_steps"]
        answers: list = [None] * N
        second: list = [None] * N

        def client(i: int) -> None:
            answers[i] = answer(held[i][0])
            time.sleep(0.05 * i)  # one after another, as one async client process reads its streams
            second[i] = post(kv, nexts[i])

        clients = [threading.Thread(target=client, args=(i,)) for i in range(N)]
        for t in clients:
            t.start()
        for s, last in held:
            s.sendall(last)
        for t in clients:
            t.join(ANSWER_TIMEOUT_S)
        assert [status for status, _ in answers] == [200] * N, answers
        # the four answers end in the same step, so their clients come back together
        assert [doc["choices"][0]["finish_reason"] for _, doc in answers] == ["length"] * N
        assert all(second), second
        st = server_stats(kv)["server"]
        assert st["requests_in_admission"] == 0
        assert st["prefill_steps"] == before + 2, st  # one step prefilled all four, one the next four
        # every prompt whole but its last token (mlx-lm hands that one to the first decode step)
        first_step, next_step = st["prefill_steps_recent"][-2:]
        assert sorted(first_step) == sorted(doc["usage"]["prompt_tokens"] - 1 for _, doc in answers), (first_step, answers)
        # (the next prompts share the chat template's first tokens with the stored ones: cached)
        assert sorted(next_step) == sorted(doc["usage"]["prompt_tokens"] - 1
                                           - doc["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
                                           for doc in second), (next_step, second)
        assert st["prefill_batch_max"] == N
    finally:
        kv.stop()
    plain = start_mlx_lm(tmp_path)
    try:
        expected = post_together(plain, docs)
        expected_next = post_together(plain, nexts)
    finally:
        plain.stop()
    assert [text(doc) for _, doc in answers] == [text(doc) for doc in expected]
    assert [text(doc) for doc in second] == [text(doc) for doc in expected_next]
    assert all(text(doc) for doc in expected)


@pytest.mark.slow
@pytest.mark.skipif(default_prefill_token_budget() == 0,
                    reason="no default token budget on a GPU backend (mlx-lm's batching: the one-step test covers it)")
def test_at_the_default_budget_long_prompts_go_one_per_step_short_ones_together(tmp_path):
    """The default on the CPU backend (a token budget of 256): 4 cold ~900-token prompts arriving
    together are prefilled one per step (each first token after its own prefill, not after all
    four), then 4 short ones (~40 tokens) in one step; answers equal plain `mlx_lm.server`'s, which
    prefills each burst in one padded step."""
    kv = start_kvtool(tmp_path, "budget", env={"KVTOOL_ADMISSION_WINDOW_MS": WINDOW_MS})
    try:
        assert server_stats(kv)["server"]["prefill_token_budget"] == COMPUTE_BOUND_TOKEN_BUDGET == 256
        long_docs, short_docs = bodies(seed=7, n_words=300), bodies(seed=8, n_words=8)
        answers, steps = [], []
        for docs in (long_docs, short_docs):
            held = [send_but_last_byte(kv.port, d) for d in docs]
            wait_in_admission(kv, N)
            before = server_stats(kv)["server"]["prefill_steps"]
            for s, last in held:
                s.sendall(last)
            answers.append([answer(s) for s, _ in held])
            assert [status for status, _ in answers[-1]] == [200] * N, answers[-1]
            st = server_stats(kv)["server"]
            steps.append(st["prefill_steps_recent"][-(st["prefill_steps"] - before):])
            assert st["requests_prefilling"] == 0 and st["tokens_prefilling"] == 0, st
        assert [len(step) for step in steps[0]] == [1] * N, steps
        assert [len(step) for step in steps[1]] == [N], steps
        # each long prompt but its last token and what it found cached (the chat template's first
        # tokens, stored by the prompt before it: a request is fetched when its prefill starts)
        assert sorted(step[0] for step in steps[0]) == sorted(
            doc["usage"]["prompt_tokens"] - 1 - doc["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
            for _, doc in answers[0]), (steps, answers)
    finally:
        kv.stop()
    plain = start_mlx_lm(tmp_path)
    try:
        expected = [post_together(plain, long_docs), post_together(plain, short_docs)]
    finally:
        plain.stop()
    for got, want in zip(answers, expected, strict=True):
        assert [text(doc) for _, doc in got] == [text(doc) for doc in want]


@pytest.mark.slow
def test_a_too_long_prompt_in_a_burst_is_refused_before_prefill(tmp_path):
    """413 before any prefill still: the handler refuses it, the loop does not wait for it, the
    others are prefilled together."""
    kv = start_kvtool(tmp_path, "burst413", "--max-prompt-tokens", "400", *MLX_BATCHING,
                      env={"KVTOOL_ADMISSION_WINDOW_MS": WINDOW_MS})
    try:
        docs = bodies(seed=4, n_words=60)
        docs[1] = bodies(seed=5, n_words=2000)[0]
        held = [send_but_last_byte(kv.port, d) for d in docs]
        wait_in_admission(kv, N)
        before = server_stats(kv)["server"]["prefill_steps"]
        for s, last in held:
            s.sendall(last)
        answers = [answer(s) for s, _ in held]
        assert [status for status, _ in answers] == [200, 413, 200, 200], answers
        assert "more than this server's limit of 400" in answers[1][1]["error"]
        st = server_stats(kv)["server"]
        assert st["prefill_steps"] == before + 1, st
        assert len(st["prefill_steps_recent"][-1]) == N - 1
        assert st["rejected_by_status"].get("413") == 1
    finally:
        kv.stop()


# ----------------------------------------------------------------------------- the parts, in-process
def _arrive_then_put(admission, queue, go: threading.Event, arrived: threading.Event, item) -> threading.Thread:
    """A handler thread: arrives, then on `go` queues `item` (None: refused) and leaves."""

    def run() -> None:
        admission.arrive()
        arrived.set()
        go.wait(HTTP_TIMEOUT_S)
        if item is not None:
            queue.put(item)
        admission.leave()

    t = threading.Thread(target=run)
    t.start()
    return t


@pytest.mark.parametrize("item", ["request", None])
def test_gather_waits_for_a_request_in_admission(item):
    """The loop's wait ends when the request in admission is queued (it gets it) or refused (None)."""
    from queue import Queue

    from kvtool.server.admission import Admission

    admission, queue, go, arrived = Admission(window_s=HTTP_TIMEOUT_S), Queue(), threading.Event(), threading.Event()
    handler = _arrive_then_put(admission, queue, go, arrived, item)
    arrived.wait(HTTP_TIMEOUT_S)
    got: list = []
    loop = threading.Thread(target=lambda: got.append(admission.gather(queue, time.monotonic() + HTTP_TIMEOUT_S)))
    loop.start()
    go.set()
    loop.join(HTTP_TIMEOUT_S)
    handler.join(HTTP_TIMEOUT_S)
    assert got == [item]
    assert admission.pending == 0


def test_gather_does_not_wait_past_the_window():
    """A request in admission longer than the window (a body that never ends) is not waited for."""
    from queue import Queue

    from kvtool.server.admission import Admission

    admission, queue, go, arrived = Admission(window_s=0.0), Queue(), threading.Event(), threading.Event()
    handler = _arrive_then_put(admission, queue, go, arrived, None)
    arrived.wait(HTTP_TIMEOUT_S)
    assert admission.pending == 1
    assert admission.gather(queue, time.monotonic() + HTTP_TIMEOUT_S) is None
    assert admission.stats()["admission_waits"] == 0
    go.set()
    handler.join(HTTP_TIMEOUT_S)


def test_gather_follows_a_burst_handed_over_one_by_one_past_one_window():
    """Handlers tokenize one at a time: a burst whose hand-overs together outlast one window, each
    within a window of the one before, is gathered whole; the round's cap still ends the wait."""
    from queue import Queue

    from kvtool.server.admission import Admission

    window_s, n = 0.2, 5
    admission, queue = Admission(window_s=window_s), Queue()
    arrived = [threading.Event() for _ in range(n)]
    go = [threading.Event() for _ in range(n)]
    handlers = [_arrive_then_put(admission, queue, g, a, f"request {i}") for i, (g, a) in enumerate(zip(go, arrived))]
    for a in arrived:
        a.wait(HTTP_TIMEOUT_S)
    start = time.monotonic()

    def hand_over_one_by_one() -> None:  # one hand-over every half window: n / 2 windows in all
        for g in go:
            time.sleep(window_s / 2)
            g.set()

    feeder = threading.Thread(target=hand_over_one_by_one)
    feeder.start()
    got = []
    while (item := admission.gather(queue, start + admission.round_s)) is not None:
        got.append(item)
    feeder.join(HTTP_TIMEOUT_S)
    for h in handlers:
        h.join(HTTP_TIMEOUT_S)
    assert got == [f"request {i}" for i in range(n)]
    assert time.monotonic() - start > window_s  # the burst outlasted one window
    assert admission.pending == 0

    # a request that stays in admission (a body that never ends) under a long window: the
    # round's deadline ends the wait, not the window
    admission = Admission(window_s=HTTP_TIMEOUT_S)
    stuck_go, stuck_arrived = threading.Event(), threading.Event()
    stuck = _arrive_then_put(admission, queue, stuck_go, stuck_arrived, None)
    stuck_arrived.wait(HTTP_TIMEOUT_S)
    t0 = time.monotonic()
    assert admission.gather(queue, t0 + 0.05) is None
    assert time.monotonic() - t0 < HTTP_TIMEOUT_S / 2
    stuck_go.set()
    stuck.join(HTTP_TIMEOUT_S)


def test_gather_waits_for_the_clients_of_answers_that_just_ended():
    """4 answers ended together; their clients come back one after another, the first alone: the
    loop that took the first waits for the other three (closed-loop clients). One client never
    waits for itself; clients that do not come back are waited for `return_s` after the last end."""
    from queue import Queue

    from kvtool.server.admission import Admission

    admission, queue = Admission(window_s=HTTP_TIMEOUT_S), Queue()
    for _ in range(4):
        admission.ended()
    arrived = [threading.Event() for _ in range(4)]
    go = [threading.Event() for _ in range(4)]
    first = _arrive_then_put(admission, queue, go[0], arrived[0], "turn 0")
    go[0].set()
    first.join(HTTP_TIMEOUT_S)
    start = time.monotonic()
    assert queue.get_nowait() == "turn 0"  # the loop took the first; nothing else arrived yet
    assert admission.pending == 0

    def come_back_later() -> None:  # the other three, after the loop started waiting
        time.sleep(0.05)
        for i in range(1, 4):
            handler = _arrive_then_put(admission, queue, go[i], arrived[i], f"turn {i}")
            go[i].set()
            handler.join(HTTP_TIMEOUT_S)

    others = threading.Thread(target=come_back_later)
    others.start()
    got = []
    while len(got) < 3 and (item := admission.gather(queue, start + admission.round_s)) is not None:
        got.append(item)
    others.join(HTTP_TIMEOUT_S)
    assert got == ["turn 1", "turn 2", "turn 3"]
    assert admission.gather(queue, start + admission.round_s) is None  # all four back: no more wait
    assert admission.stats()["admission_return_waits"] >= 1

    # one client: its own answer ended, its next request is the arrival: no wait at all
    alone, queue = Admission(window_s=HTTP_TIMEOUT_S), Queue()
    alone.ended()
    go_one, arrived_one = threading.Event(), threading.Event()
    go_one.set()
    _arrive_then_put(alone, queue, go_one, arrived_one, "next turn").join(HTTP_TIMEOUT_S)
    assert queue.get_nowait() == "next turn"
    assert alone.gather(queue, time.monotonic() + alone.round_s) is None
    assert alone.stats()["admission_waits"] == 0

    # two answers ended, one client came back: the other is waited for until return_s after the
    # last end or arrival, not for the whole round
    short, queue = Admission(window_s=2.5), Queue()  # return_s 1 s: a loaded machine stays within it
    short.ended()
    short.ended()
    go_one, arrived_one = threading.Event(), threading.Event()
    go_one.set()
    _arrive_then_put(short, queue, go_one, arrived_one, "next turn").join(HTTP_TIMEOUT_S)
    queue.get_nowait()
    start = time.monotonic()
    assert short.gather(queue, start + short.round_s) is None
    assert short.stats()["admission_waits"] == 1
    assert short.stats()["admission_return_waits"] == 1
    assert short.stats()["admission_wait_ms"] > 0
    assert time.monotonic() - start < short.round_s / 2  # return_s, not the round


def test_prefill_steps_group_the_progress_of_each_step():
    """Each step's record is the tokens each request prefilled in it; the last token (handed to
    decoding) is no prefill."""
    from queue import Queue

    from kvtool.server.admission import PrefillSteps

    steps, a, b, c = PrefillSteps(), Queue(), Queue(), Queue()
    steps.tick()
    steps.progress(a, 2048, 4000)
    steps.progress(b, 1572, 1573)
    steps.tick()
    steps.progress(a, 3999, 4000)
    steps.progress(b, 1573, 1573)
    steps.tick()
    steps.progress(a, 4000, 4000)
    steps.progress(c, 10, 11, alone=True)  # a request served outside the batch
    assert steps.stats() == {"prefill_steps": 3, "prefill_batch_max": 2,
                             "prefill_steps_recent": [[2048, 1572], [1951], [10]]}


@pytest.mark.parametrize(("raw", "window_s"), [(None, 0.25), ("", 0.25), ("50", 0.05), ("0", 0.0), ("abc", None),
                                               ("-1", None), ("nan", None)])
def test_admission_window_from_the_environment(monkeypatch, raw, window_s):
    from kvtool.server.admission import DEFAULT_WINDOW_S, WINDOW_ENV, window_from_env

    assert DEFAULT_WINDOW_S == 0.25  # docs/server.md says 250 ms
    if raw is None:
        monkeypatch.delenv(WINDOW_ENV, raising=False)
    else:
        monkeypatch.setenv(WINDOW_ENV, raw)
    if window_s is None:
        with pytest.raises(ValueError, match=WINDOW_ENV):
            window_from_env()
    else:
        assert window_from_env() == pytest.approx(window_s)


def shared_prefix_bodies(seed: int, n: int, system_words: int = 300) -> list[dict]:
    """`n` chat requests with one shared system message (~900 tokens of the tiny model: 14 full
    blocks of 64) and distinct short user messages, greedy, a few tokens each."""
    rng = random.Random(seed)
    system = " ".join(rng.choice(WORDS) for _ in range(system_words))
    return [{"model": "default_model", "max_tokens": 8, "temperature": 0.0,
             "messages": [{"role": "system", "content": system},
                          {"role": "user", "content": f"task {i}: " + " ".join(rng.choice(WORDS) for _ in range(12))}]}
            for i in range(n)]


def test_prefill_slots_take_no_more_once_the_uncached_tokens_reach_the_budget():
    from queue import Queue

    from kvtool.server.admission import PrefillSlots

    slots = PrefillSlots(8, token_budget=256)
    q = [Queue() for _ in range(4)]
    slots.take(q[0])
    assert not slots.full(queued=True)  # taken, not fetched yet: counts 0
    slots.uncached(q[0], 300)
    assert slots.full(queued=True)  # a long prompt alone, until its prefill completes
    slots.release(q[0])
    assert not slots.full(queued=True)
    for i in range(3):
        slots.take(q[i])
        slots.uncached(q[i], 100)
    assert slots.full(queued=False) and slots.stats()["tokens_prefilling"] == 300
    slots.release(q[1])
    assert not slots.full(queued=False)
    slots.uncached(q[3], 500)  # not taken: ignored
    assert slots.stats() == {"prefill_width": 8, "prefill_token_budget": 256, "requests_prefilling": 2,
                             "tokens_prefilling": 200, "prefill_deferrals": 1}
    slots.clear()
    assert slots.stats()["requests_prefilling"] == 0
    unlimited = PrefillSlots(2)  # no budget: the width alone
    for i in range(2):
        unlimited.take(q[i])
        unlimited.uncached(q[i], 10_000)
    assert unlimited.full(queued=False)
    unlimited.release(q[0])
    assert not unlimited.full(queued=False)


@pytest.mark.slow
def test_requests_beyond_the_prefill_width_are_fetched_when_their_prefill_starts(tmp_path):
    """4 requests sharing a system prompt arrive together at a server that prefills 2 at a time
    (`--prompt-concurrency 2`): the loop takes 2, and leaves the other 2 queued until a prefill
    slot frees; their fetch then finds the system prompt the first 2 stored, so they prefill
    only the rest. Answers equal plain `mlx_lm.server`'s (same prefill width)."""
    kv = start_kvtool(tmp_path, "width", "--prompt-concurrency", "2", *MLX_BATCHING, env={"KVTOOL_ADMISSION_WINDOW_MS": WINDOW_MS})
    try:
        docs = shared_prefix_bodies(seed=6, n=N)
        held = [send_but_last_byte(kv.port, d) for d in docs]
        wait_in_admission(kv, N)
        for s, last in held:
            s.sendall(last)
        answers = [answer(s) for s, _ in held]
        assert [status for status, _ in answers] == [200] * N, answers
        st = server_stats(kv)["server"]
        assert st["prefill_width"] == 2 and st["prefill_batch_max"] == 2, st
        # (whether a step found the last two already queued, counted as a deferral, is timing:
        # on a fast machine they are queued while the first two prefill, and taken after)
        assert isinstance(st["prefill_deferrals"], int), st
        assert st["requests_prefilling"] == 0, st
        cached = sorted(doc["usage"]["prompt_tokens_details"]["cached_tokens"] for _, doc in answers)
        prompt = min(doc["usage"]["prompt_tokens"] for _, doc in answers)
        assert cached[:2] == [0, 0], cached  # the first two, fetched together, found nothing
        # the other two: all but the user message (~45 tokens) and at most one block (64)
        assert min(cached[2:]) >= prompt - 128, (cached, prompt)
    finally:
        kv.stop()
    plain = start_mlx_lm(tmp_path, "--prompt-concurrency", "2")
    try:
        expected = post_together(plain, docs)
    finally:
        plain.stop()
    assert [text(doc) for _, doc in answers] == [text(doc) for doc in expected]
