"""`kvtool serve` under hostile input: it cannot be wedged, and every bad request gets an answer.

Real processes only: a `kvtool serve` subprocess on the tiny model on a free loopback port, real
sockets (malformed HTTP is sent by hand), the `openai` client. Each case is a request that broke
`kvtool serve` before the request checks (`kvtool.server.validation`) and the generation-thread
watchdog (`kvtool.server.watchdog`); after each one the server must still answer a normal request
with the output it gave before any hostile request (greedy decoding). Plain `mlx_lm.server` is
started once to show that `"stop": 5` wedges it. The CLI cases (`serve-once -f /dev/zero`, ...)
check the bounded reading of prompt sources: one `error:` line and exit 2.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.server_procs import REPO, START_TIMEOUT_S, ServerProc, free_port

openai = pytest.importorskip("openai")

HTTP_TIMEOUT_S = 120.0  # generous: the machine is shared
FAULT = "KVTOOL-TEST-FAULT-7f3e"  # the stop string that makes the generation loop raise (watchdog test seam)
MAX_BODY = 1 << 20  # --max-body-bytes of the shared server
NORMAL = {"model": "default_model", "max_tokens": 12, "temperature": 0.0,
          "messages": [{"role": "user", "content": "Tell me about the sea, briefly."}]}
NO_EOS = {"2": -100.0, "0": -100.0}  # the tiny model's EOS ids: a request that runs to max_tokens


# ----------------------------------------------------------------------------- processes
class Server(ServerProc):
    """A server subprocess (`tests.server_procs.ServerProc`); `baseline` holds the greedy output of
    NORMAL before any hostile request. `stop` SIGKILLs a server that does not exit in time."""

    baseline = ""

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0, kill_late: bool = True) -> int:
        return super().stop(sig, timeout, kill_late)


def start_kvtool(tmp: Path, name: str, *extra: str, env: dict[str, str] | None = None) -> Server:
    server = Server([sys.executable, "-m", "kvtool.cli.app", "serve", "--model", "tiny", "--port", "0",
                     "--cache-dir", str(tmp / f"cache-{name}"), *extra], tmp / f"{name}.log", env)
    m = server.wait_for(r"listening on (http://127\.0\.0\.1:(\d+))")
    server.url, server.port = m.group(1), int(m.group(2))
    return server


def model_path() -> str:
    res = subprocess.run([sys.executable, "-m", "kvtool.cli.app", "model", "path", "tiny"], capture_output=True,
                         text=True, cwd=REPO, timeout=120)
    assert res.returncode == 0, res.stderr
    return res.stdout.strip()


# ----------------------------------------------------------------------------- requests
def post(server: Server, body: dict | None = None, *, raw: bytes | None = None,
         path: str = "/v1/chat/completions") -> tuple[int, dict]:
    """(status, JSON body) of one POST through urllib."""
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(server.url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=HTTP_TIMEOUT_S) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def raw_http(server: Server, data: bytes, timeout: float = HTTP_TIMEOUT_S) -> tuple[int, dict]:
    """Send bytes on a fresh connection; (status, JSON body) of the answer (the server closes)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=timeout) as s:
        s.sendall(data)
        out = b""
        while chunk := s.recv(1 << 16):
            out += chunk
    head, _, body = out.partition(b"\r\n\r\n")
    status = int(head.split()[1])
    return status, json.loads(body)


def get_json(server: Server, path: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(server.url + path, timeout=HTTP_TIMEOUT_S) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def normal_text(server: Server, body: dict | None = None) -> str:
    status, doc = post(server, body or NORMAL)
    assert status == 200, doc
    return doc["choices"][0]["message"]["content"]


def server_stats(server: Server) -> dict:
    return get_json(server, "/kvtool/stats")[1]


def assert_refused(status_doc: tuple[int, dict], status: int, needle: str = "") -> None:
    got, doc = status_doc
    assert got == status, (got, doc)
    assert isinstance(doc.get("error"), str) and needle in doc["error"], doc


# ----------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    """One `kvtool serve` for the request cases (no Hugging Face cache; the watchdog test seam
    on) and the greedy output of NORMAL taken before any hostile request."""
    tmp = tmp_path_factory.mktemp("hostile")
    server = start_kvtool(tmp, "hostile", "--max-body-bytes", str(MAX_BODY),
                          env={"KVTOOL_TEST_GENERATION_FAULT": FAULT, "HF_HUB_CACHE": str(tmp / "no-hf-cache"),
                               "HF_HOME": str(tmp / "no-hf-home")})
    try:
        server.baseline = normal_text(server)
        yield server
        log = server.text()  # the only tracebacks: the injected loop failures (logged with theirs)
        assert log.count("Traceback") == log.count("the generation loop raised"), log[-4000:]
    finally:
        server.stop()


def still_serves(server: Server) -> None:
    assert normal_text(server) == server.baseline
    assert get_json(server, "/health") == (200, {"status": "ok"})


# ----------------------------------------------------------------------------- the cases
@pytest.mark.slow
def test_stop_int_is_refused_and_the_next_request_matches_a_run_without_it(hostile):
    assert_refused(post(hostile, {**NORMAL, "stop": 5}), 400, "stop")
    still_serves(hostile)
    for stop in ([1, 2], {"a": 1}, ["ok", None], ["x"] * 17, True):
        assert_refused(post(hostile, {**NORMAL, "stop": stop}), 400, "stop")
    # valid forms keep working (a stop string that never occurs leaves the output unchanged)
    for stop in ("\u2603never\u2603", ["\u2603never\u2603", ""], [], None):
        assert normal_text(hostile, {**NORMAL, "stop": stop}) == hostile.baseline
    still_serves(hostile)


@pytest.mark.slow
def test_a_failing_generation_loop_is_restarted_and_its_requests_get_500(hostile):
    """The loop raises (test seam: a stop string) while a long request and a stream are in flight:
    the three requests are answered (500 / an error event), the loop restarts, later requests are
    served with the same output."""
    before = server_stats(hostile)["server"]["generation_restarts"]
    long_body = {**NORMAL, "max_tokens": 6000, "logit_bias": NO_EOS}
    results: dict[str, object] = {}

    def long_request():
        results["long"] = post(hostile, long_body)

    def stream_request():
        c = openai.OpenAI(base_url=hostile.url + "/v1", api_key="unused", max_retries=0, timeout=HTTP_TIMEOUT_S)
        chunks = 0
        try:
            for _ in c.chat.completions.create(stream=True, **{**long_body, "messages": [
                    {"role": "user", "content": "Another, streamed."}]}):
                chunks += 1
            results["stream"] = ("finished", chunks)
        except openai.APIError as exc:
            results["stream"] = ("error", str(exc))

    threads = [threading.Thread(target=long_request), threading.Thread(target=stream_request)]
    n_before = server_stats(hostile)["adapter"]["requests"]
    for t in threads:
        t.start()
    deadline = time.monotonic() + HTTP_TIMEOUT_S
    while time.monotonic() < deadline:  # both taken by the generation loop, neither finished
        stats = server_stats(hostile)
        started = [r for r in stats["requests"] if r["request"] > n_before]
        if len(started) == 2:
            assert not any(r["finished"] for r in started), started
            break
        time.sleep(0.05)
    assert_refused(post(hostile, {**NORMAL, "stop": [FAULT]}), 500, "restarted")
    for t in threads:
        t.join(HTTP_TIMEOUT_S)
        assert not t.is_alive()
    assert_refused(results["long"], 500, "generation failed")  # type: ignore[arg-type]
    assert results["stream"][0] == "error", results["stream"]  # type: ignore[index]
    server = server_stats(hostile)["server"]
    assert server["generation_restarts"] == before + 1 and server["generation_available"]
    still_serves(hostile)


@pytest.mark.slow
def test_malformed_bodies_get_400_with_a_json_error(hostile):
    assert_refused(post(hostile, raw=b"[" * 5000 + b"]" * 5000), 400, "nested too deeply")
    deep = {**NORMAL, "tools": [{"x": json.loads("[" * 100 + "]" * 100)}]}
    assert_refused(post(hostile, deep), 400, "nested too deeply")
    assert_refused(post(hostile, raw=b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}'), 400, "UTF-8")
    assert_refused(post(hostile, raw=b'{"messages": '), 400, "invalid JSON")
    assert_refused(post(hostile, raw=b'{"temperature": NaN, "messages": []}'), 400, "NaN")
    assert_refused(post(hostile, raw=b'{"max_tokens": ' + b"9" * 5000 + b"}"), 400, "invalid JSON")
    assert_refused(post(hostile, raw=b"[1, 2]"), 400, "JSON object")
    still_serves(hostile)


@pytest.mark.slow
def test_bad_content_length_gets_4xx_without_a_traceback(hostile):
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    body = json.dumps(NORMAL).encode()
    assert_refused(raw_http(hostile, head + b"\r\n" + body), 411, "Content-Length")
    assert_refused(raw_http(hostile, head + b"Content-Length: -1\r\n\r\n" + body), 400, "Content-Length")
    assert_refused(raw_http(hostile, head + b"Content-Length: abc\r\n\r\n" + body), 400, "Content-Length")
    assert_refused(raw_http(hostile, head + b"Content-Length: 99999999999999999999999\r\n\r\n"), 400, "Content-Length")
    assert_refused(raw_http(hostile, head + b"Content-Length: 999999999999\r\n\r\n" + body), 413, "--max-body-bytes")
    two = f"Content-Length: {len(body)}\r\nContent-Length: {len(body) + 1}\r\n\r\n".encode()
    assert_refused(raw_http(hostile, head + two + body), 400, "conflicting")
    chunked = head + b"Transfer-Encoding: chunked\r\n\r\n" + f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n"
    assert_refused(raw_http(hostile, chunked), 411, "Content-Length")
    # a body shorter than announced: the client closes its side, the server answers 400
    with socket.create_connection(("127.0.0.1", hostile.port), timeout=HTTP_TIMEOUT_S) as s:
        s.sendall(head + f"Content-Length: {len(body) + 100}\r\n\r\n".encode() + body)
        s.shutdown(socket.SHUT_WR)
        answer = s.recv(1 << 16)
    assert answer.split()[1] == b"400", answer
    assert_refused(post(hostile, NORMAL, path="/v1/nowhere"), 404, "no such route")
    still_serves(hostile)


@pytest.mark.slow
def test_oversized_body_gets_413_and_the_client_reads_it(hostile):
    """The body is read and dropped, so urllib (which sends it whole first) sees the 413."""
    big = {**NORMAL, "messages": [{"role": "user", "content": "x" * (MAX_BODY + 10)}]}
    assert_refused(post(hostile, big), 413, "--max-body-bytes")
    still_serves(hostile)


@pytest.mark.slow
def test_null_optional_fields_are_not_given(hostile):
    """OpenAI's API reads a null optional field as not given, and clients send them: the answer
    equals the request's without them (plain mlx_lm.server refuses them, 'must be of type')."""
    nulls = dict.fromkeys(("temperature", "top_p", "top_k", "min_p", "seed", "logprobs", "top_logprobs", "stream",
                           "stream_options", "stop", "logit_bias", "presence_penalty", "frequency_penalty",
                           "repetition_penalty", "max_completion_tokens", "tools", "tool_choice",
                           "response_format", "user", "n"))  # fmt: skip
    assert normal_text(hostile, {**NORMAL, **nulls}) == hostile.baseline
    assert_refused(post(hostile, {**NORMAL, "messages": None}), 400, "messages")


@pytest.mark.slow
def test_huge_max_tokens_and_bad_field_types_get_400(hostile):
    for field, value in (("max_tokens", 10**18), ("max_tokens", 0), ("max_tokens", True), ("max_tokens", 2.5),
                         ("max_completion_tokens", 10**9), ("temperature", "hot"), ("temperature", -1),
                         ("top_p", 2), ("top_p", "1"), ("top_k", -3), ("seed", -1), ("stream", "yes"),
                         ("stream_options", "x"), ("logit_bias", {"999999": 1.0}), ("logit_bias", {"a": 1}),
                         ("messages", "hi"), ("messages", []), ("messages", ["hi"]),
                         ("messages", [{"role": 1, "content": "x"}]), ("messages", [{"role": "user", "content": [1]}]),
                         ("messages", [{"role": "user", "content": 5}]),
                         ("messages", [{"role": "user", "content": "x", "tool_calls": 5}]), ("tools", "abc"),
                         ("chat_template_kwargs", "x"), ("role_mapping", 3)):
        assert_refused(post(hostile, {**NORMAL, field: value}), 400, field)
    image = [{"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/x.png"}}]
    assert_refused(post(hostile, {**NORMAL, "messages": [{"role": "user", "content": image}]}), 400, "images")
    assert_refused(post(hostile, {**NORMAL, "model": "Qwen/Qwen2-72B"}), 404, "not served")
    assert_refused(post(hostile, {**NORMAL, "draft_model": "Qwen/Qwen2-0.5B"}), 404, "draft")
    assert_refused(post(hostile, {"model": "tiny", "prompt": ["tokens"]}, path="/v1/completions"), 400, "prompt")
    # the names the server lists and accepts
    assert normal_text(hostile, {**NORMAL, "model": "tiny"}) == hostile.baseline
    status, doc = post(hostile, {**NORMAL, "stream_options": {}, "stream": False})
    assert status == 200, doc
    still_serves(hostile)


@pytest.mark.slow
def test_oversized_prompt_gets_413_quickly(hostile):
    """A 360k-character prompt (about 150k tokens of the tiny model) is refused before the
    generation thread sees it (it held the server for minutes)."""
    long_prompt = "hello world " * 30_000
    t0 = time.monotonic()
    assert_refused(post(hostile, {**NORMAL, "messages": [{"role": "user", "content": long_prompt}]}), 413,
                   "--max-prompt-tokens")
    assert_refused(post(hostile, {"model": "default_model", "prompt": long_prompt, "max_tokens": 4},
                        path="/v1/completions"), 413, "--max-prompt-tokens")
    assert time.monotonic() - t0 < HTTP_TIMEOUT_S
    recent = server_stats(hostile)["requests"]
    assert all(r["prompt_tokens"] < 32768 for r in recent)  # never reached the cache / generation
    still_serves(hostile)


@pytest.mark.slow
def test_prompts_are_tokenized_once_on_the_handler_thread(hostile):
    """The handler tokenizes every text prompt for the generation thread (same output), long ones
    too; one over the limit is refused there (413) and never reaches the generation thread."""
    pretokenized = lambda: server_stats(hostile)["server"]["prompts_pretokenized"]  # noqa: E731
    before = pretokenized()
    still_serves(hostile)
    assert pretokenized() == before + 1
    limit = server_stats(hostile)["server"]["max_prompt_tokens"]
    text = "hello world " * (limit // 24 + 100)  # 2 tokens a repeat: over a tenth of the limit
    status, doc = post(hostile, {**NORMAL, "max_tokens": 1, "messages": [{"role": "user", "content": text}]})
    assert status == 200, doc
    assert pretokenized() == before + 2
    fetched = server_stats(hostile)["adapter"]["requests"]  # prompts that reached the cache
    too_long = "hello world " * (limit // 2 + 100)
    assert_refused(post(hostile, {**NORMAL, "messages": [{"role": "user", "content": too_long}]}), 413,
                   "--max-prompt-tokens")
    assert pretokenized() == before + 2 and server_stats(hostile)["adapter"]["requests"] == fetched
    still_serves(hostile)


@pytest.mark.slow
def test_client_gone_mid_stream_is_one_line_and_the_server_goes_on(hostile):
    body = json.dumps({**NORMAL, "stream": True, "max_tokens": 3000, "logit_bias": NO_EOS}).encode()
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode())
    with socket.create_connection(("127.0.0.1", hostile.port), timeout=HTTP_TIMEOUT_S) as s:
        s.sendall(head + body)
        assert s.recv(1 << 12).startswith(b"HTTP/1.0 200")
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # RST on close
    still_serves(hostile)


@pytest.mark.slow
def test_models_list_without_a_hugging_face_cache(hostile):
    """mlx-lm answered 200 with an empty body (it scans the Hugging Face cache, and there is none)."""
    c = openai.OpenAI(base_url=hostile.url + "/v1", api_key="unused", max_retries=0, timeout=HTTP_TIMEOUT_S)
    ids = [m.id for m in c.models.list()]
    assert ids[0] == "tiny" and model_path() in ids
    assert c.models.retrieve("tiny").id == "tiny"
    assert get_json(hostile, "/v1/models/no-such-model")[0] == 404
    for name in ids:  # every listed name is accepted
        assert normal_text(hostile, {**NORMAL, "model": name}) == hostile.baseline


@pytest.mark.slow
def test_repeated_loop_failures_stop_generation_with_503(tmp_path):
    """A loop that keeps failing is not restarted forever: /health and requests answer 503 at once."""
    from kvtool.server.watchdog import MAX_RESTARTS

    server = start_kvtool(tmp_path, "giveup", env={"KVTOOL_TEST_GENERATION_FAULT": FAULT})
    try:
        for _ in range(MAX_RESTARTS):
            assert_refused(post(server, {**NORMAL, "stop": [FAULT]}), 500, "restarted")
        assert_refused(post(server, {**NORMAL, "stop": [FAULT]}), 503, "stopped")
        assert get_json(server, "/health") == (503, {"status": "unavailable"})
        assert_refused(post(server, NORMAL), 503, "stopped")
    finally:
        # more than the server's own wait for its generation thread (GENERATION_STOP_TIMEOUT_S):
        # under a heavily loaded machine (a 10-minute soak beside the suite) 60 s was not enough once
        assert server.stop(timeout=90.0) == 128 + signal.SIGTERM


def start_mlx_lm(tmp: Path, *extra: str) -> Server:
    """Plain `mlx_lm.server` on the tiny model (with its options `extra`), once `/health` answers 200."""
    port = free_port()
    server = Server([sys.executable, "-m", "mlx_lm.server", "--model", model_path(), "--port", str(port), *extra],
                    tmp / "mlx_lm.log")
    server.url, server.port = f"http://127.0.0.1:{port}", port
    deadline = time.monotonic() + START_TIMEOUT_S
    while get_health(server) != 200:
        if server.p.poll() is not None or time.monotonic() > deadline:
            server.stop()
            raise AssertionError(server.text()[-3000:])
        time.sleep(0.1)
    return server


@pytest.mark.slow
def test_stop_int_wedges_plain_mlx_lm_server(tmp_path):
    """The bug `kvtool serve` guards against, in plain `mlx_lm.server` 0.32.2: after one
    `"stop": 5` every request is answered 404 "generation thread died"."""
    server = start_mlx_lm(tmp_path)
    try:
        assert post(server, NORMAL)[0] == 200
        post(server, {**NORMAL, "stop": 5})
        assert post(server, NORMAL) == (404, {"error": "generation thread died"})
        assert get_health(server) == 503
    finally:
        server.stop()


def get_health(server: Server) -> int | None:
    try:
        return get_json(server, "/health")[0]
    except OSError:
        return None


# ----------------------------------------------------------------------------- CLI sources
def kvtool(*args: str, stdin=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvtool.cli.app", *args], capture_output=True, text=True,
                          cwd=REPO, timeout=HTTP_TIMEOUT_S, stdin=stdin)


def assert_one_error(res: subprocess.CompletedProcess, needle: str) -> None:
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.returncode == 2, (res.returncode, res.stderr[-2000:])
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], res.stderr[-2000:]


@pytest.mark.slow
def test_serve_once_from_dev_zero_is_one_error_line(tmp_path):
    """An endless prompt source is refused after the limit (the kernel killed it before)."""
    cache = ["--cache-dir", str(tmp_path)]
    assert_one_error(kvtool("serve-once", "-f", "/dev/zero", *cache), "--max-prompt-bytes")
    with open("/dev/zero", "rb") as zero:
        assert_one_error(kvtool("serve-once", "-f", "-", *cache, stdin=zero), "--max-prompt-bytes")
    with open("/dev/zero", "rb") as zero:
        assert_one_error(kvtool("serve-once", "--prompt", "-", *cache, stdin=zero), "--max-prompt-bytes")
    assert_one_error(kvtool("serve-once", "--messages", "/dev/zero", *cache), "--max-prompt-bytes")
    assert_one_error(kvtool("serve-once", "--requests", "/dev/zero", "--max-prompt-bytes", "1KiB", *cache),
                     "1.0 KiB")
    assert_one_error(kvtool("warm", "/dev/zero", *cache), "--max-prompt-bytes")


@pytest.mark.slow
def test_prompt_sources_over_the_limit_and_deep_json(tmp_path):
    cache = ["--cache-dir", str(tmp_path / "cache")]
    big = tmp_path / "big.txt"
    big.write_text("word " * 300)
    assert_one_error(kvtool("serve-once", "-f", str(big), "--max-prompt-bytes", "1000", *cache), "1000 B")
    (tmp_path / "a.txt").write_text("one prompt\n")
    (tmp_path / "b.txt").write_text("another prompt\n")
    assert_one_error(kvtool("warm", str(tmp_path / "a.txt"), str(tmp_path / "b.txt"), "--max-prompt-bytes", "15",
                            *cache), "in all")
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 5000 + "]" * 5000)
    assert_one_error(kvtool("serve-once", "--messages", str(deep), *cache), "nested too deeply")
    jsonl = tmp_path / "deep.jsonl"
    jsonl.write_text('{"prompt": "x"}\n' + "[" * 5000 + "]" * 5000 + "\n")
    assert_one_error(kvtool("serve-once", "--requests", str(jsonl), *cache), "deep.jsonl:2")
    assert_one_error(kvtool("serve-once", "-p", "x", "--max-prompt-bytes", "lots", *cache), "--max-prompt-bytes")


# ----------------------------------------------------------------------------- header slowloris
SLOW_PEER = "127.0.0.2"  # the attacker's source address: another loopback address than the normal client's


def _drip_head(port: int, out: list, lock: threading.Lock, t0: float, stop_at: float) -> None:
    """One slow-header connection from SLOW_PEER: a request line, then one header line every
    0.25 s, never the blank line; records (seconds until the server answered or closed, bytes)."""
    got, when = b"", None
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(SLOW_PEER, 0)) as s:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
            s.settimeout(0.25)
            i = 0
            while time.monotonic() < stop_at and when is None:
                try:
                    chunk = s.recv(4096)
                    got += chunk
                    if not chunk:
                        when = time.monotonic() - t0
                except TimeoutError:
                    s.sendall(f"X-Slow-{i}: {i}\r\n".encode())
                    i += 1
    except OSError:  # reset or refused while sending: the server closed it
        when = time.monotonic() - t0 if when is None else when
    with lock:
        out.append((when, got))


@pytest.mark.slow
def test_header_slowloris_is_capped_per_peer_and_cut_at_the_head_deadline(tmp_path):
    """Hostile round 3, finding 6: connections sending one header line every few seconds held every
    connection slot for as long as they kept sending (the per-read timeout restarts on each line).
    Now one address holds at most --max-connections-per-peer connections (more: 503 and closed),
    a head that does not arrive within --head-timeout is closed, and a normal client (another
    address) is served while the attack runs."""
    server = start_kvtool(tmp_path, "slowloris", "--max-connections-per-peer", "4", "--head-timeout", "3s")
    try:
        baseline = normal_text(server)
        results: list = []
        lock = threading.Lock()
        t0 = time.monotonic()
        threads = [threading.Thread(target=_drip_head, args=(server.port, results, lock, t0, t0 + 12.0), daemon=True)
                   for _ in range(12)]
        for t in threads:
            t.start()
        time.sleep(1.0)  # every slow connection is open and dripping
        assert normal_text(server) == baseline  # served during the attack
        assert get_health(server) == 200
        for t in threads:
            t.join(20)
        refused = [(w, g) for w, g in results if g.startswith(b"HTTP/1.0 503") and b"from your address" in g]
        held = [(w, g) for w, g in results if (w, g) not in refused]
        assert len(results) == 12 and len(refused) == 8, results
        assert all(w is not None and w < 2.0 for w, _ in refused), refused  # refused at once
        # the 4 admitted ones never finished their head: closed at the deadline, not when the client stopped
        assert all(w is not None and 2.5 <= w <= 8.0 and g == b"" for w, g in held), held
        assert normal_text(server) == baseline
    finally:
        server.stop()
