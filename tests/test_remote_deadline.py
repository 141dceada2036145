"""A server that answers every socket read in time but never finishes a reply (a byte every
50 ms of a reply announced as 100 MB) holds no remote call past its whole-call deadline
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


class TrickleServer:
    """A TCP server that answers any request with `$100000000\\r\\n` and then one byte every
    50 ms, for ever (until the client closes the connection or `close()`)."""

    def __init__(self) -> None:
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
                if conn.recv(65536):
                    conn.sendall(b"$100000000\r\n")
                    while not self.stopped.is_set():
                        conn.sendall(b"x")
                        time.sleep(0.05)
            except OSError:
                return  # the client closed it

    def close(self) -> None:
        self.stopped.set()
        self.sock.close()


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
    cfg.write_text('remote_timeout = "100ms"\n')  # reads of 100 ms (one byte comes every 50 ms): a 5 s bound
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
