"""Soak: hostile clients beside four normal ones against one real `kvtool serve`.

For `KVTOOL_SOAK_SECONDS` (default 20 here; `make soak-http` runs 600) a hostile client sends
random malformed requests (broken or deep JSON, invalid UTF-8, bad Content-Length, oversized
bodies and prompts, wrong field types, unknown models), disconnects mid-stream, mid-body and
before reading an answer, while four normal clients send chat requests (streamed or not). Every
normal request must be answered with the greedy output the same prompt got when served alone
before the soak; every hostile request that is answered must get the expected 4xx; the server
must never stop answering (no wedge: every request within a generous timeout, `/health` ok at
the end); its resident memory (/proc/<pid>/status VmRSS) may grow by less than 10 % from the
end of a warm-up round to the end. All loops are bounded in time and count; loopback only.

Beside them (hostile round 3): a header slowloris from another loopback address (rounds of 20
connections that drip one header line every 0.25 s and never finish the head: each is closed at
the 3 s head deadline; the per-peer cap has its own test), and the cache swapped under the running server: a third of the way in its namespace directory is renamed and
a symlink to a directory of a sibling tree put in its place, two thirds in the same is done to
the cache root. The sibling tree (the symlinks' targets and files of its own) is checksummed
before and after: nothing may be written, changed or removed there. The normal clients' outputs
are those of plain `mlx_lm.server` for the same requests, asked before the soak.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import socket
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from tests.test_serve_hostile import (
    HTTP_TIMEOUT_S,
    NO_EOS,
    Server,
    _drip_head,
    get_json,
    post,
    start_kvtool,
    start_mlx_lm,
)

openai = pytest.importorskip("openai")

SOAK_SECONDS = float(os.environ.get("KVTOOL_SOAK_SECONDS", "20"))
MAX_ITERATIONS = 100_000  # per client: the loops end by time, this only bounds them in count
MAX_BODY = 64 << 10  # --max-body-bytes of the soaked server
MAX_PROMPT_TOKENS = 1024  # --max-prompt-tokens of the soaked server
RSS_GROWTH_LIMIT = 0.10
WARMUP_S = 5.0  # seconds of the mixed load before memory is measured (batch shapes, allocator caches)
SAMPLE_S = 0.5  # VmRSS sampling period (seconds; longer for long soaks: 200 samples)
TOPICS = ["the sea", "mountains in winter", "a small town library", "how bread is made"]


def chat_body(i: int, *, stream: bool = False) -> dict:
    """The chat request of normal client `i` (its own prompt, greedy, 12 tokens)."""
    return {"model": "default_model", "max_tokens": 12, "temperature": 0.0, "stream": stream,
            "messages": [{"role": "system", "content": "You write short notes."},
                         {"role": "user", "content": f"Write a note about {TOPICS[i]}."}]}


def chat_text(server: Server, body: dict) -> str:
    """The answer's text, streamed (read with the openai client) or not."""
    if not body.get("stream"):
        status, doc = post(server, body)
        assert status == 200, (status, doc)
        return doc["choices"][0]["message"]["content"] or ""
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=HTTP_TIMEOUT_S)
    args = {k: v for k, v in body.items() if k != "stream"}
    return "".join(chunk.choices[0].delta.content or "" for chunk in c.chat.completions.create(stream=True, **args)
                   if chunk.choices)


# ----------------------------------------------------------------------------- hostile actions
def _send(server: Server, data: bytes, *, read: bool = True, close_after: int | None = None) -> int | None:
    """Send raw bytes; the answer's status (None when not read, or when the server closed first)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=HTTP_TIMEOUT_S) as s:
        try:
            if close_after is not None:
                s.sendall(data[:close_after])
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                return None
            s.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            pass
        if not read:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            return None
        head = b""
        while b"\r\n" not in head:
            chunk = s.recv(4096)
            if not chunk:
                return None
            head += chunk
        return int(head.split()[1])


def _request(body: bytes, *, length: str | None = None, extra: bytes = b"") -> bytes:
    cl = str(len(body)) if length is None else length
    return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            + (f"Content-Length: {cl}\r\n".encode() if cl != "" else b"") + extra + b"\r\n" + body)


HOSTILE_KINDS = 14


def hostile_action(server: Server, rng: random.Random, kind: int | None = None) -> tuple[str, int | None, set[int | None]]:
    """One hostile request (`kind`, or a random one): (name, status got, statuses accepted)."""
    normal = json.dumps(chat_body(rng.randrange(4))).encode()
    kind = rng.randrange(HOSTILE_KINDS) if kind is None else kind
    if kind == 0:
        return "truncated json", _send(server, _request(normal[: rng.randrange(1, len(normal))])), {400}
    if kind == 1:
        depth = rng.randrange(65, 20000)
        return "deep json", _send(server, _request(b"[" * depth + b"]" * depth)), {400, 413}
    if kind == 2:
        junk = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 300)))
        return "random bytes", _send(server, _request(junk)), {400}
    if kind == 3:
        return "invalid utf-8", _send(server, _request(normal.replace(b"note", b"\xff\xfe", 1))), {400}
    if kind == 4:
        length = rng.choice(["-1", "abc", "1e9", "99999999999999999999999", "", " 12x"])
        return f"content-length {length!r}", _send(server, _request(normal, length=length)), {400, 411}
    if kind == 5:
        big = json.dumps({**chat_body(0), "pad": "x" * rng.randrange(MAX_BODY, 4 * MAX_BODY)}).encode()
        return "oversized body", _send(server, _request(big)), {413}
    if kind == 6:
        huge = json.dumps({**chat_body(0), "messages": [{"role": "user", "content": "word " * 3000}]}).encode()
        return "oversized prompt", _send(server, _request(huge)), {413}
    if kind == 7:
        field, value = rng.choice([("stop", 5), ("stop", [1]), ("max_tokens", 10**18), ("max_tokens", -1),
                                   ("temperature", "x"), ("top_p", 9), ("messages", "hi"), ("messages", [3]),
                                   ("logit_bias", {"99999999": 1}), ("stream", "yes"), ("seed", -5)])
        return f"bad {field}", _send(server, _request(json.dumps({**chat_body(1), field: value}).encode())), {400}
    if kind == 8:
        body = json.dumps({**chat_body(2), "model": "someone/else"}).encode()
        return "unknown model", _send(server, _request(body)), {404}
    if kind == 9:  # reads the 200 headers of a long stream, then resets the connection
        body = json.dumps({**chat_body(rng.randrange(4), stream=True), "max_tokens": 2000, "logit_bias": NO_EOS})
        return "gone mid-stream", _send(server, _request(body.encode())), {200}
    if kind == 10:
        return "gone mid-body", _send(server, _request(normal), close_after=rng.randrange(1, len(normal) + 100)), {None}
    if kind == 11:
        return "gone before the answer", _send(server, _request(normal), read=False), {None}
    if kind == 12:
        return "wrong route", _send(server, _request(normal).replace(b"/v1/chat/completions", b"/v1/nothing", 1)), {404}
    return "short body", _send(server, _request(normal, length=str(len(normal) + 50)), read=False), {None}


def rss_growth(samples: list[tuple[float, int]]) -> tuple[int, int]:
    """(median VmRSS of the first fifth, lowest of the last fifth) of the samples after the warm-up
    (KiB). A leak raises the floor: memory that is never freed lifts every late sample, while the
    allocator's and MLX's transient buffers (batch shapes coming and going) only make peaks, which
    once moved the median of the last fifth past the limit with no growth behind it."""
    by_time = [rss for t, rss in samples if t >= WARMUP_S]
    assert len(by_time) >= 2, samples
    fifth = max(1, len(by_time) // 5)
    first = sorted(by_time[:fifth])
    return first[len(first) // 2], min(by_time[-fifth:])


def mlx_lm_outputs(tmp_path: Path) -> list[str]:
    """The four normal prompts' greedy outputs from plain `mlx_lm.server` (the same tiny model)."""
    plain = start_mlx_lm(tmp_path)
    try:
        return [chat_text(plain, chat_body(i)) for i in range(4)]
    finally:
        plain.stop()


def tree_digest(root: Path) -> dict[str, str]:
    """Every entry below `root` (symlinks not followed) -> its kind and content digest."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        if p.is_symlink():
            out[rel] = "link " + os.readlink(p)
        elif p.is_dir():
            out[rel] = "dir"
        else:
            out[rel] = "file " + hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def sibling_tree(tmp_path: Path) -> Path:
    """A tree beside the cache: the targets the swapped symlinks point at, and files of its own."""
    root = tmp_path / "sibling"
    for sub in ("namespace-target", "root-target", "docs"):
        (root / sub).mkdir(parents=True)
    (root / "docs" / "notes.txt").write_text("not kvtool's\n")
    (root / "root-target" / ".keep").write_text("")
    return root


def swap_for_symlink(path: Path, target: Path) -> None:
    """Rename `path` aside (`<path>.old`) and put a symlink to `target` in its place."""
    os.rename(path, path.with_name(path.name + ".old"))
    path.symlink_to(target, target_is_directory=True)


# ----------------------------------------------------------------------------- the soak
@pytest.mark.slow
def test_hostile_client_beside_normal_clients(tmp_path):
    plain = mlx_lm_outputs(tmp_path)
    sibling = sibling_tree(tmp_path)
    server = start_kvtool(tmp_path, "soak", "--max-body-bytes", str(MAX_BODY), "--max-prompt-tokens",
                          str(MAX_PROMPT_TOKENS), "--head-timeout", "3s")
    try:
        baseline = [chat_text(server, chat_body(i)) for i in range(4)]  # each prompt served alone
        assert baseline == plain  # kvtool's answers are plain mlx_lm.server's
        assert [chat_text(server, chat_body(i, stream=True)) for i in range(4)] == baseline
        namespace = Path(get_json(server, "/kvtool/stats")[1]["namespace_dir"])
        before = tree_digest(sibling)
        rng = random.Random(1234)
        for kind in range(HOSTILE_KINDS):  # warm-up: every hostile action once, then RSS is the reference
            name, status, ok = hostile_action(server, rng, kind)
            assert status in ok or status is None, (name, status)
        assert [chat_text(server, chat_body(i)) for i in range(4)] == baseline

        start = time.monotonic()
        deadline = start + WARMUP_S + SOAK_SECONDS
        failures: list[str] = []
        served: Counter[str] = Counter()
        lock = threading.Lock()

        def normal_client(i: int) -> None:
            crng = random.Random(i)
            for _ in range(MAX_ITERATIONS):
                if time.monotonic() > deadline or failures:
                    return
                j = crng.randrange(4)
                stream = crng.random() < 0.5
                try:
                    text = chat_text(server, chat_body(j, stream=stream))
                except Exception as exc:  # noqa: BLE001 - recorded, fails the test
                    with lock:
                        failures.append(f"normal client {i}: {type(exc).__name__}: {exc}")
                    return
                with lock:
                    served["normal"] += 1
                    if text != baseline[j]:
                        failures.append(f"normal client {i}: prompt {j} (stream={stream}) gave {text!r}, "
                                        f"alone {baseline[j]!r}")

        def hostile_client() -> None:
            hrng = random.Random(99)
            for _ in range(MAX_ITERATIONS):
                if time.monotonic() > deadline or failures:
                    return
                try:
                    name, status, ok = hostile_action(server, hrng)
                except OSError as exc:  # a reset after an answer the server chose not to wait for
                    name, status, ok = f"raw ({type(exc).__name__})", None, {None}
                with lock:
                    served[name] += 1
                    if status not in ok and status is not None:
                        failures.append(f"hostile {name}: status {status}, expected {sorted(map(str, ok))}")

        def slowloris() -> None:  # rounds of 20 dripping heads from another loopback address
            while time.monotonic() < deadline - 5 and not failures:
                got: list = []
                drips = [threading.Thread(target=_drip_head, args=(server.port, got, lock, time.monotonic(),
                                                                    time.monotonic() + 6.0), daemon=True)
                         for _ in range(20)]  # fmt: skip
                for t in drips:
                    t.start()
                for t in drips:
                    t.join(30)
                with lock:
                    served["slowloris connections"] += len(got)

        def swapper() -> None:  # the namespace, then the cache root, swapped for symlinks into the sibling tree
            for at, path, target in ((1 / 3, namespace, sibling / "namespace-target"),
                                     (2 / 3, namespace.parent, sibling / "root-target")):  # fmt: skip
                while time.monotonic() < start + WARMUP_S + at * SOAK_SECONDS and not failures:
                    time.sleep(0.2)
                swap_for_symlink(path, target)
                with lock:
                    served["swaps"] += 1

        samples: list[tuple[float, int]] = []

        def sampler() -> None:  # VmRSS every SAMPLE_S (the first WARMUP_S are the load's own warm-up)
            while time.monotonic() < deadline and len(samples) < 100_000:
                samples.append((round(time.monotonic() - start, 1), server.vm_rss_kib()))
                time.sleep(max(SOAK_SECONDS / 200, SAMPLE_S))

        threads = [threading.Thread(target=normal_client, args=(i,), daemon=True) for i in range(4)]
        threads.append(threading.Thread(target=hostile_client, daemon=True))
        threads += [threading.Thread(target=slowloris, daemon=True), threading.Thread(target=swapper, daemon=True)]
        threads.append(threading.Thread(target=sampler, daemon=True))
        for t in threads:
            t.start()
        for t in threads:
            t.join(SOAK_SECONDS + 2 * HTTP_TIMEOUT_S)
            assert not t.is_alive(), "a client is stuck: the server is wedged"
        assert not failures, failures[:10]
        assert served["normal"] >= 4 and served["swaps"] == 2, served
        assert tree_digest(sibling) == before  # nothing written, changed or removed outside the cache
        assert get_json(server, "/health") == (200, {"status": "ok"})
        assert [chat_text(server, chat_body(i)) for i in range(4)] == baseline
        rss0, rss1 = rss_growth(samples)
        print(f"\nsoak {SOAK_SECONDS:.0f} s after {WARMUP_S:.0f} s warm-up: {dict(served)}; "
              f"VmRSS {rss0} -> {rss1} KiB (median of the first fifth, floor of the last)")
        assert rss1 < rss0 * (1 + RSS_GROWTH_LIMIT), (rss0, rss1, samples)
        stats = get_json(server, "/kvtool/stats")[1]["server"]
        assert stats["generation_restarts"] == 0, stats
        log = server.text()
        assert "Traceback" not in log, log[-4000:]
    finally:
        server.stop()
