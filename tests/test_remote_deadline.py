"""A server that answers every socket read in time but never finishes a reply (a byte every
10 ms of a reply announced as 100 MB) holds no remote call past its whole-call deadline
(`kvtool.tiers.call_deadline`): the call fails, the request misses, `kvtool serve-once`
answers exactly. Real sockets, a real `kvtool serve-once` process."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from kvtool.tiers import call_deadline
from kvtool.tiers.call_deadline import CallWatchdog
from kvtool.tiers.remote_store import RemoteStore
from tests.redis_servers import make_chain

HANG_GUARD_S = 120  # a hang fails the test instead of the suite (not a timing check)
TRICKLE_S = 0.01  # a byte this often: 10x within the tests' 100 ms reads, also on a loaded machine


class TrickleServer:
    """A TCP server that answers any request with `$100000000\\r\\n` and then one byte every
    `TRICKLE_S`, for ever (until the client closes the connection or `close()`); with `pong`, PING and
    CLIENT commands get their proper answers first (a server that trickles only its data)."""

    def __init__(self, pong: bool = False) -> None:
        self.pong = pong
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.stopped = threading.Event()
        self.connections = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.stopped.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._trickle, args=(conn,), daemon=True).start()

    def _trickle(self, conn: socket.socket) -> None:
        with conn:
            try:
                while self.pong and (got := conn.recv(65536)) and _answer_setup(conn, got):
                    pass
                if self.pong or conn.recv(65536):
                    conn.sendall(b"$100000000\r\n")
                    while not self.stopped.is_set():
                        conn.sendall(b"x")
                        time.sleep(TRICKLE_S)
            except OSError:
                return  # the client closed it

    def close(self) -> None:
        self.stopped.set()
        self.sock.close()


SETUP_REPLIES = {b"HELLO": b"%1\r\n$5\r\nproto\r\n:3\r\n", b"CLIENT": b"+OK\r\n", b"PING": b"+PONG\r\n"}


def _answer_setup(conn: socket.socket, got: bytes) -> bool:
    """Answer `got` if it holds only a connection's set-up commands and PING (RESP arrays): True."""
    lines = got.split(b"\r\n")
    names = [lines[i + 2].upper() for i, line in enumerate(lines) if line.startswith(b"*")]
    if not names or any(n not in SETUP_REPLIES for n in names):
        return False
    conn.sendall(b"".join(SETUP_REPLIES[n] for n in names))
    return True


@pytest.fixture
def trickle():
    server = TrickleServer()
    yield server
    server.close()


def test_a_call_to_a_trickling_server_fails_at_its_deadline(trickle, monkeypatch):
    monkeypatch.setattr(call_deadline, "MIN_CALL_DEADLINE_S", 0.5)  # the bound itself, made short
    monkeypatch.setattr(call_deadline, "TIMEOUTS_PER_CALL", 1)
    chain = make_chain(2, model_id="trickle", seed=1)
    t0 = time.monotonic()
    store = RemoteStore(f"redis://127.0.0.1:{trickle.port}/0", chain.layout_key, chain.kv, timeout_s=0.2,
                        breaker_backoff_s=0.01)  # the PING at start: held until the deadline
    started = time.monotonic() - t0
    assert started < HANG_GUARD_S and not store.available
    assert "no whole answer within 0.5 s" in (store.last_error or "") and "too slowly" in store.last_error
    time.sleep(0.05)  # past the breaker's back-off: the next call probes the server again
    assert store.longest_prefix(chain.hashes) == 0  # a miss, not a hang
    assert store.stats()["remote_errors"] >= 2 and trickle.connections >= 2
    store.close()


def test_the_watchdog_closes_only_calls_past_their_deadline():
    dog = CallWatchdog()
    fired: list[str] = []
    with dog.deadline(0.05, lambda: fired.append("slow")) as slow:
        time.sleep(0.3)
    with dog.deadline(60, lambda: fired.append("quick")) as quick:
        pass
    assert fired == ["slow"] and slow.fired and not quick.fired


@pytest.mark.slow  # a tiny model in two fresh processes, one 5 s deadline
def test_serve_once_with_a_trickling_remote_answers_exactly(trickle, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTOOL_REMOTE")}
    args = [sys.executable, "-m", "kvtool.cli.app", "serve-once", "--model", "tiny", "--json", "-n", "6",
            "--prompt", "A remote tier that never finishes an answer makes a request miss.", "--ignore-chat-template"]
    plain = subprocess.run([*args, "--cache-dir", str(tmp_path / "a")], capture_output=True, text=True, env=env,
                           timeout=HANG_GUARD_S)  # fmt: skip
    assert plain.returncode == 0, plain.stderr[-2000:]
    cfg = tmp_path / "remote.toml"
    cfg.write_text('remote_timeout = "100ms"\n')  # reads of 100 ms (a byte comes every 10 ms): a 5 s bound
    slow = subprocess.run([*args, "--cache-dir", str(tmp_path / "b"), "--config", str(cfg),
                           "--remote-url", f"redis://127.0.0.1:{trickle.port}/0"], capture_output=True, text=True,
                          env=env, timeout=HANG_GUARD_S)  # fmt: skip (before: still waiting when killed)
    assert slow.returncode == 0, slow.stderr[-2000:]
    said = " ".join(slow.stderr.split())  # (the log line may be wrapped)
    assert "Traceback" not in said and "every read answered within 0.1 s (the server sends too slowly)" in said, said
    got, want = json.loads(slow.stdout)["requests"][0], json.loads(plain.stdout)["requests"][0]
    assert got["token_ids"] == want["token_ids"] and got["remote_hit_tokens"] == 0


def test_remote_commands_refuse_a_server_that_trickles_its_pong(trickle):
    from kvtool.config.remote_url import RemoteConnectError
    from kvtool.ops import remote_ops

    t0 = time.monotonic()
    with pytest.raises(RemoteConnectError, match=r"no whole answer within 0.4 s .* too slowly"):
        remote_ops.connect(f"redis://127.0.0.1:{trickle.port}/0", timeout_s=0.2)  # before: waited for ever
    assert time.monotonic() - t0 < HANG_GUARD_S


def test_remote_commands_after_the_ping_fail_at_their_deadline(monkeypatch):
    """A server that answers PING and trickles its data: `remote inspect` (a SCAN) and the
    pipelined batches fail at the whole-call deadline, one line each (before: a wedge)."""
    from kvtool.config.remote_url import RemoteConnectError
    from kvtool.ops import remote_ops

    monkeypatch.setattr(call_deadline, "MIN_CALL_DEADLINE_S", 0.5)
    monkeypatch.setattr(call_deadline, "TIMEOUTS_PER_CALL", 1)
    server = TrickleServer(pong=True)
    try:
        conn = remote_ops.connect(f"redis://127.0.0.1:{server.port}/0", timeout_s=0.2)  # PING answered
        for what, call in (("SCAN", lambda: remote_ops.scan(conn, "kvtool:*")),
                           ("UNLINK", lambda: remote_ops.unlink(conn, ["kvtool:x"])),
                           ("INFO", lambda: remote_ops.server_info(conn))):
            t0 = time.monotonic()
            with pytest.raises(RemoteConnectError, match=rf"{what}: .*no whole answer within 0.5 s .*too slowly"):
                call()
            assert time.monotonic() - t0 < HANG_GUARD_S
        conn.close()
    finally:
        server.close()


def test_a_renewed_deadline_fires_only_after_progress_stops():
    dog = CallWatchdog()
    fired: list[str] = []
    with dog.deadline(0.2, lambda: fired.append("x")) as expiry:
        for _ in range(6):  # 0.3 s in all, renewed every 0.05 s: never 0.2 s without progress
            time.sleep(0.05)
            expiry.renew()
        assert not expiry.fired
        time.sleep(0.5)
    assert fired == ["x"] and expiry.fired
