"""`kvtool remote push` when the push cannot complete, against real redis-server processes: the
connection cut in the middle of the push (a loopback proxy that stops forwarding after a number of
bytes, then refuses connections), a server at `maxmemory` that refuses writes, a namespace whose
index is not a database, a --cache-dir that does not exist. Each is a non-zero exit with the
report (valid JSON) and its reason, never a silent 0 nor a traceback."""

from __future__ import annotations

import json
import socket
import threading
from pathlib import Path

import pytest

from kvtool.config import KVToolConfig
from kvtool.engine import Engine
from tests import redis_servers
from tests.redis_servers import RedisServer
from tests.test_remote_cli import _kvtool
from tests.test_remote_sharing import long_prompt

redis_node, fresh_redis = redis_servers.redis_node, redis_servers.fresh_redis


class CuttingProxy:
    """A TCP proxy on loopback in front of `port` that forwards at most `limit` bytes from its
    clients to the server, then closes every connection and its listening socket (later connects
    are refused): a server lost in the middle of a command."""

    def __init__(self, port: int, limit: int):
        self.port, self.limit, self.sent = port, limit, 0
        self.lock = threading.Lock()
        self.socks: list[socket.socket] = []
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"redis://127.0.0.1:{self.listener.getsockname()[1]}/0"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.port))
            with self.lock:
                self.socks += [client, server]
            threading.Thread(target=self._pipe, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, False), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, counted: bool) -> None:
        try:
            while data := src.recv(65536):
                with self.lock:
                    self.sent += len(data) if counted else 0
                    cut = self.sent > self.limit
                if cut:
                    return self.close()
                dst.sendall(data)
        except OSError:
            pass
        self.close()

    def close(self) -> None:
        with self.lock:
            socks, self.socks = self.socks, []
        for s in [self.listener, *socks]:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()


def _ssd_cache(tiny_model, root: Path, n_tokens: int = 700) -> None:
    """An SSD cache (~700 KB of blocks) written with no remote tier."""
    eng = Engine(tiny_model, KVToolConfig(ssd_cache_dir=root, ssd_async_writes=False, remote_url=None))
    eng.generate(long_prompt(tiny_model.tokenizer, n_tokens), max_tokens=1)
    assert eng.close().shutdown_clean


def _push(root: Path, url: str, *extra: str):
    return _kvtool("remote", "push", "--cache-dir", str(root), "--remote-url", url, *extra)


def _error_lines(result) -> list[str]:
    assert "Traceback" not in result.output, result.output
    return [line for line in result.stderr.splitlines() if line.strip()]


@pytest.mark.slow
def test_a_connection_lost_mid_push_stops_it_with_one_error_line(tiny_model, fresh_redis, tmp_path):
    _ssd_cache(tiny_model, tmp_path / "c")
    proxy = CuttingProxy(fresh_redis.port, limit=300_000)  # the PING goes through, the blocks (~700 KB) do not
    try:
        res = _push(tmp_path / "c", proxy.url, "--timeout", "2s", "--json")
    finally:
        proxy.close()
    (ns,) = json.loads(res.stdout)["namespaces"]
    assert res.exit_code == 2, res.output
    assert ns["stopped"] and ns["blocks_read"] > 0 and ns["blocks_failed"] > 0
    assert ns["blocks_stored"] + ns["blocks_failed"] == ns["blocks_read"] and ns["error"]
    (line,) = _error_lines(res)
    assert line.startswith(f"error: remote push of {ns['namespace']} stopped after") and "127.0.0.1" in line
    again = _push(tmp_path / "c", fresh_redis.url, "--json")  # the server itself lost nothing: a rerun completes
    (ns,) = json.loads(again.stdout)["namespaces"]
    assert again.exit_code == 0 and ns["blocks_stored"] + ns["blocks_existing"] == ns["blocks_read"]


@pytest.mark.slow
def test_writes_refused_by_a_full_server_are_counted_and_exit_1(tiny_model, tmp_path):
    _ssd_cache(tiny_model, tmp_path / "c")
    with RedisServer(["--maxmemory", "1200kb", "--maxmemory-policy", "noeviction"]) as full:
        res = _push(tmp_path / "c", full.url, "--json")
        human = _push(tmp_path / "c", full.url)
        (tmp_path / "p.txt").write_text(tiny_model.tokenizer.decode(long_prompt(tiny_model.tokenizer, 700)))
        warm = _kvtool("warm", str(tmp_path / "p.txt"), "--model", "tiny", "--whole", "--ignore-chat-template",
                       "--cache-dir", str(tmp_path / "w"), "--to-remote", "--remote-url", full.url,
                       env={"KVTOOL_REMOTE_POLICY": "off"})  # only the push writes (it exited 0)
    (ns,) = json.loads(res.stdout)["namespaces"]
    assert res.exit_code == 1 and ns["blocks_failed"] > 0 and not ns["stopped"]
    assert ns["blocks_stored"] + ns["blocks_existing"] + ns["blocks_failed"] == ns["blocks_read"]
    assert "maxmemory" in ns["error"] and json.loads(res.stdout)["problems"] == ns["blocks_failed"]
    assert human.exit_code == 1 and "not stored" in human.stdout and "maxmemory" in human.stderr
    said = " ".join(warm.stderr.split())
    assert warm.exit_code == 1 and "not stored (" in said and "maxmemory" in said, warm.output


@pytest.mark.slow
def test_an_unreadable_index_is_a_problem_and_a_missing_cache_dir_an_error(tiny_model, redis_node, tmp_path):
    _ssd_cache(tiny_model, tmp_path / "c")
    bogus = tmp_path / "c" / ("0123456789abcdef" * 2)
    bogus.mkdir()
    (bogus / "index.sqlite").write_bytes(b"not a database" * 100)
    res = _push(tmp_path / "c", redis_node.url, "--json")
    assert res.exit_code == 1, res.output
    by_ns = {ns["namespace"]: ns for ns in json.loads(res.stdout)["namespaces"]}
    assert "index cannot be read" in by_ns[bogus.name]["error"]
    assert [ns["blocks_read"] > 0 for name, ns in by_ns.items() if name != bogus.name] == [True]
    missing = _push(tmp_path / "nowhere", redis_node.url)
    (line,) = _error_lines(missing)
    assert missing.exit_code == 2 and line.startswith("error: cache directory") and "does not exist" in line
    assert "--create" not in line  # push has no --create: the message does not offer it
    inside = _push(bogus, redis_node.url)  # a namespace directory given for the cache
    (line,) = _error_lines(inside)
    assert inside.exit_code == 2 and "is a namespace directory, not a cache directory" in line, line
    assert f"--cache-dir {tmp_path / 'c'}" in line
