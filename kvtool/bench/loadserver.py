"""Server subprocesses for the load benchmark: `kvtool serve` and plain `mlx_lm.server`.

`ManagedServer` starts one server (`ServerOptions.command`, with this interpreter) on a free
loopback port, waits until `GET /v1/models` answers 200, and stops it with SIGTERM, then SIGKILL
after `stop_timeout_s`. Its stderr goes to a log file.

Peak RSS: `VmHWM` of `/proc/<pid>/status` (the kernel's resident-set high-water mark of that
process), read while the process is alive (sampled by the caller and once more just before the
stop); None without `/proc`. `resource.getrusage(RUSAGE_CHILDREN)` would report the maximum over
all waited-for children, not one server.

The other bench children use the same helpers: `child_env`, `free_port` and `proc_status_kb`.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

KVTOOL, MLXLM, MLXLM_1000 = "kvtool", "mlx-lm", "mlx-lm-1000"
# plain mlx_lm.server kinds -> their extra flags: its defaults (a prompt cache of 10 entries), and a
# prompt cache of 1,000 entries (every conversation of a long run stays cached; a second baseline)
MLXLM_FLAGS: dict[str, tuple[str, ...]] = {MLXLM: (), MLXLM_1000: ("--prompt-cache-size", "1000")}
SERVER_KINDS = (KVTOOL, *MLXLM_FLAGS)
DEFAULT_SERVERS = (KVTOOL, MLXLM)
READY_PATH = "/v1/models"
STATS_PATH = "/kvtool/stats"
REPO = Path(__file__).resolve().parent.parent.parent


def child_env() -> dict[str, str]:
    """This environment with the repository (`REPO`) first on PYTHONPATH: a child process imports this kvtool."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the OS picks it; another process may take it
    before the server binds, in which case the server exits and `start` says so)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def proc_status_kb(field: str, pid: int | str = "self") -> int | None:
    """A kB field of `/proc/<pid>/status` (e.g. `VmHWM`, `VmRSS`: resident set sizes, kB); None
    when it cannot be read (no /proc, process gone)."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


@dataclass(frozen=True)
class ServerOptions:
    """How to start a server.

    Attributes:
        kind: `kvtool`, `mlx-lm` or `mlx-lm-1000` (`SERVER_KINDS`).
        model: kvtool model spec (preset, directory, Hugging Face id), given to `kvtool serve`.
        model_path: the resolved model directory, given to `mlx_lm.server --model`.
        cache_dir: kvtool's `--cache-dir` (kvtool only).
        kvtool_args: more `kvtool serve` flags (e.g. `["--ram-bytes", "64MiB"]`).
        start_timeout_s: seconds to wait for readiness (s).
        stop_timeout_s: seconds between SIGTERM and SIGKILL (s).
    """

    kind: str
    model: str
    model_path: str
    cache_dir: Path | None = None
    kvtool_args: tuple[str, ...] = ()
    start_timeout_s: float = 180.0
    stop_timeout_s: float = 60.0

    def command(self, port: int) -> list[str]:
        """The server's argv on `port`."""
        if self.kind == KVTOOL:
            if self.cache_dir is None:
                raise ValueError("a kvtool server needs a cache_dir")
            return [sys.executable, "-m", "kvtool.cli.app", "serve", "--model", self.model, "--host", "127.0.0.1",
                    "--port", str(port), "--cache-dir", str(self.cache_dir), *self.kvtool_args]
        if self.kind in MLXLM_FLAGS:
            return [sys.executable, "-m", "mlx_lm.server", "--model", self.model_path, "--host", "127.0.0.1",
                    "--port", str(port), *MLXLM_FLAGS[self.kind]]
        raise ValueError(f"unknown server kind {self.kind!r}; known: {', '.join(SERVER_KINDS)}")


class ServerError(RuntimeError):
    """A server did not start (exited, or not ready in time); the message names its log."""


class ManagedServer:
    """One server subprocess. Use as a context manager or call `stop()`.

    Attributes:
        options: how it was started.
        port: its port on 127.0.0.1.
        log: its stderr log file.
        proc: the `subprocess.Popen`.
        peak_rss: largest `VmHWM` seen (bytes; None if never readable).
        start_s: seconds from spawn to ready (s).
        exit_code: set by `stop()`; `killed` is True when SIGKILL was needed.
    """

    def __init__(self, options: ServerOptions, log: Path):
        self.options, self.log = options, log
        self.port = free_port()
        self.peak_rss: int | None = None
        self.exit_code: int | None = None
        self.killed = False
        log.parent.mkdir(parents=True, exist_ok=True)
        self._fh = open(log, "a")
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(options.command(self.port), stdout=subprocess.DEVNULL, stderr=self._fh,
                                     stdin=subprocess.DEVNULL, env=child_env(), cwd=REPO)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        self.start_s = time.perf_counter() - t0

    @property
    def url(self) -> str:
        """`http://127.0.0.1:<port>`."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        """The OpenAI base URL (`<url>/v1`)."""
        return self.url + "/v1"

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.options.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerError(f"{self.options.kind} server exited with {self.proc.returncode} before it was "
                                  f"ready; log: {self.log}: {_tail(self.log)}")
            try:
                with urllib.request.urlopen(self.url + READY_PATH, timeout=2) as r:
                    if r.status == 200:
                        self.sample_rss()
                        return
            except OSError:
                pass
            time.sleep(0.1)
        raise ServerError(f"{self.options.kind} server not ready after {self.options.start_timeout_s:.0f} s; "
                          f"log: {self.log}")

    def sample_rss(self) -> int | None:
        """Read `VmHWM` now (`/proc/<pid>/status`, kB) and keep the maximum (bytes)."""
        kb = proc_status_kb("VmHWM", self.proc.pid) if self.proc.poll() is None else None
        if kb is not None:
            self.peak_rss = max(self.peak_rss or 0, kb * 1024)
        return self.peak_rss

    def get_json(self, path: str, timeout: float = 30.0) -> Any:
        """GET `path` and parse the JSON body."""
        with urllib.request.urlopen(self.url + path, timeout=timeout) as r:
            return json.loads(r.read())

    def kvtool_stats(self) -> dict[str, Any] | None:
        """`GET /kvtool/stats` of a kvtool server (None for mlx-lm or when it does not answer)."""
        if self.options.kind != KVTOOL:
            return None
        try:
            doc = self.get_json(STATS_PATH)
        except (OSError, ValueError):
            return None
        return doc if isinstance(doc, dict) else None

    def stop(self) -> int:
        """SIGTERM, wait `stop_timeout_s`, then SIGKILL. Idempotent.

        Returns:
            The exit code (`kvtool serve`: 143 after a clean drain on SIGTERM, 1 if its writer did
            not drain; negative: killed by that signal).
        """
        if self.exit_code is not None:
            return self.exit_code
        if self.proc.poll() is None:
            self.sample_rss()
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(self.options.stop_timeout_s)
            except subprocess.TimeoutExpired:
                self.killed = True
                self.proc.kill()
                self.proc.wait(30)
        self._fh.close()
        self.exit_code = int(self.proc.returncode)
        return self.exit_code

    @property
    def stopped_clean(self) -> bool | None:
        """kvtool: it exited 143 (SIGTERM, writer drained) without SIGKILL; mlx-lm: not killed."""
        if self.exit_code is None:
            return None
        if self.options.kind == KVTOOL:
            return not self.killed and self.exit_code == 128 + signal.SIGTERM
        return not self.killed

    def __enter__(self) -> ManagedServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _tail(path: Path, lines: int = 5) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return ""


__all__ = ["DEFAULT_SERVERS", "KVTOOL", "MLXLM", "MLXLM_1000", "MLXLM_FLAGS", "SERVER_KINDS", "ManagedServer",
           "ServerError", "ServerOptions", "child_env", "free_port", "proc_status_kb"]
