"""Server subprocesses for the HTTP tests: `kvtool serve` and plain `mlx_lm.server` started on a
loopback port, stderr in a log file read while they run, every wait bounded in time."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 60.0  # generous: the suite runs two workers on a shared 2-core machine
STOP_TIMEOUT_S = 60.0


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (free when asked: a server started from it may still race)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProc:
    """A server subprocess (cwd: the repository), stderr in `log`; `url` once it listens."""

    def __init__(self, args: list[str], log: Path, env: dict[str, str] | None = None):
        self.log = log
        self._fh = open(log, "w")
        self.p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=self._fh, cwd=REPO,
                                  env={**os.environ, **(env or {})})
        self.url = ""
        self.port = 0

    def text(self) -> str:
        """The log so far."""
        return self.log.read_text(errors="replace")

    def wait_for(self, pattern: str, timeout: float = START_TIMEOUT_S) -> re.Match:
        """The first match of `pattern` in the log; fails if the server exits or `timeout` (s) passes."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = re.search(pattern, self.text())
            if m:
                return m
            if self.p.poll() is not None:
                raise AssertionError(f"server exited {self.p.returncode}:\n{self.text()[-3000:]}")
            time.sleep(0.05)
        raise AssertionError(f"timeout waiting for {pattern!r}:\n{self.text()[-3000:]}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = STOP_TIMEOUT_S, kill_late: bool = False) -> int:
        """Send `sig` and wait for the exit code. Past `timeout` (s): SIGKILL and its code with
        `kill_late`, else `subprocess.TimeoutExpired` (the process killed all the same)."""
        try:
            if self.p.poll() is None:
                self.p.send_signal(sig)
            return self.p.wait(timeout)
        except subprocess.TimeoutExpired:
            self.p.kill()
            code = self.p.wait(10)
            if kill_late:
                return code
            raise
        finally:
            self._fh.close()

    def kill(self) -> None:
        """SIGKILL (if still running) and reap."""
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait(10)
        self._fh.close()

    def vm_rss_kib(self) -> int:
        """The server's resident set (KiB, /proc/<pid>/status VmRSS)."""
        for line in Path(f"/proc/{self.p.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise AssertionError("no VmRSS")
