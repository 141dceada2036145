"""Who holds the maintenance lock (`kvtool.disk.lock`): a refused prune, rm or validate names a
live kvtool holder, never the pid of a stale record (a kvtool killed while holding the lock) nor
one of a process that is gone; a holder that is no kvtool is not called one (holder unknown).
Real processes, real flocks, the real CLI."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvtool.disk.lock import PID_RECORD_BYTES, cache_lock
from kvtool.disk.names import LOCK_FILENAME

REPO = Path(__file__).resolve().parent.parent
HANG_GUARD_S = 120  # a subprocess that hangs fails the test instead of the suite (not a timing check)
KVTOOL_HOLDER = """
import sys
from pathlib import Path
from kvtool.disk.lock import cache_lock
with cache_lock(Path(sys.argv[1])):
    print("locked", flush=True)
    sys.stdin.readline()  # hold the lock until the test closes stdin (or kills this process)
"""
FOREIGN_HOLDER = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR)
fcntl.flock(fd, fcntl.LOCK_EX)  # not kvtool: writes no record
print("locked", flush=True)
sys.stdin.readline()
"""
HANDED_DOWN = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR)
fcntl.flock(fd, fcntl.LOCK_EX)
if os.fork() == 0:  # the child keeps the locked descriptor; the process that took the lock exits
    print(os.getpid(), flush=True)
    sys.stdin.readline()
os._exit(0)
"""


def popen(code: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code, *args], cwd=REPO, text=True, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE)  # fmt: skip


def refused(cache_dir: Path, command: str) -> str:
    """The one error line of `kvtool <command>` refused by the lock (exit 3)."""
    extra = {"prune": ["--ttl", "0s", "--yes"], "validate": [], "rm": ["0123456789abcdef", "--yes"]}[command]
    res = subprocess.run([sys.executable, "-m", "kvtool.cli.app", command, "--cache-dir", str(cache_dir), *extra],
                         capture_output=True, text=True, cwd=REPO, timeout=HANG_GUARD_S)  # fmt: skip
    assert res.returncode == 3, (res.returncode, res.stdout, res.stderr)
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in res.stderr, res.stderr
    return lines[0]


def record(cache_dir: Path) -> str:
    return (cache_dir / LOCK_FILENAME).read_bytes().decode()


@pytest.fixture
def stale(tmp_path):
    """A cache dir whose lock file records the pid of a kvtool killed while holding the lock:
    (cache_dir, that pid)."""
    cache_dir = tmp_path / "kv"
    cache_dir.mkdir()
    holder = popen(KVTOOL_HOLDER, str(cache_dir))
    assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
    holder.send_signal(signal.SIGKILL)
    holder.communicate(timeout=HANG_GUARD_S)
    assert record(cache_dir).split() == [str(holder.pid)]  # killed: its record stays
    return cache_dir, holder.pid


@pytest.mark.parametrize("command", ["prune", "validate", "rm"])
def test_a_foreign_holder_is_unknown_never_the_stale_record(stale, command):
    cache_dir, dead = stale
    holder = popen(FOREIGN_HOLDER, str(cache_dir / LOCK_FILENAME))
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        line = refused(cache_dir, command)
    finally:
        holder.communicate("\n", timeout=HANG_GUARD_S)
    assert f"pid {dead}" not in line and "kvtool prune, rm or validate is running" not in line
    assert "is held by another process (holder unknown)" in line


def test_a_holder_that_cannot_be_known_is_said_unknown(stale):
    """The process that took the lock is gone, its child holds it: no pid is named (neither the
    gone one, which the kernel still shows, nor the stale record's)."""
    cache_dir, dead = stale
    parent = popen(HANDED_DOWN, str(cache_dir / LOCK_FILENAME))
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    parent.wait(timeout=HANG_GUARD_S)
    try:
        line = refused(cache_dir, "prune")
    finally:
        assert parent.stdin is not None
        parent.stdin.write("\n")
        parent.stdin.close()
        deadline = time.monotonic() + HANG_GUARD_S
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
    assert "holder unknown" in line and "pid" not in line, line


def test_a_kvtool_holder_is_named_and_its_record_blanked_on_release(tmp_path):
    cache_dir = tmp_path / "kv"
    cache_dir.mkdir()
    holder = popen(KVTOOL_HOLDER, str(cache_dir))
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        line = refused(cache_dir, "prune")
    finally:
        holder.communicate("\n", timeout=HANG_GUARD_S)
    assert f"another kvtool prune, rm or validate is running on {cache_dir} (pid {holder.pid})" in line
    assert record(cache_dir) == " " * PID_RECORD_BYTES  # released: blanked, the file keeps its size
    with cache_lock(cache_dir):
        assert record(cache_dir).split() == [str(os.getpid())]
    assert record(cache_dir) == " " * PID_RECORD_BYTES


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not Path(f"/proc/{pid}/status").exists() or "zombie" not in Path(f"/proc/{pid}/status").read_text()
