"""The cache's maintenance lock, `<cache_dir>/.prune.lock`: one `kvtool prune`, `rm` or
`validate` (repairing) at a time, so that no maintenance command plans from rows or files that
another is removing (e.g. validate re-adopting a segment file that prune has just unindexed).

An exclusive, non-blocking `fcntl.flock`; the kernel releases it when the process dies, so a
crashed prune never leaves it stuck, and the file stays (removing it would let two processes
lock two different files). The cache directory may be writable by others, so the lock file is
opened `O_NOFOLLOW` and used only if it is a regular file with one link: a planted symlink,
hard link, FIFO or device makes prune refuse, and nothing is ever written through it.

The holder's pid is written for the "another ... is running (pid N)" message as a fixed-size
record *in place* (never truncated, so no block is freed and re-allocated), and blanked again
before the lock is released: on a full disk that write may fail and is then skipped — prune must
be able to run exactly when the disk is full. If the lock file cannot even be created (no space
for a new inode), the cache directory itself is flocked instead.

A refused command names the holder only where it is known to hold the lock, never a pid read
from a stale record (a kvtool killed while holding it, or a holder that is no kvtool at all, e.g.
`flock(1)`): on Linux the kernel's `/proc/locks` names the process holding the flock (kept if it
is alive and, where its descriptors can be read, has the file open); else, or where it lists
none, the record's pid if that process is alive (a kvtool blanks its record on release). A
holder that is the record's kvtool is "another kvtool prune, rm or validate"; another is named by
pid and command name; otherwise the holder is said to be unknown.

This module never imports MLX.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kvtool.disk.fsops import dir_owner, give_to
from kvtool.disk.names import LOCK_FILENAME
from kvtool.errors import KVToolError

EXIT_LOCKED = 3
PID_RECORD_BYTES = 32
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
_FLAGS = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)


class PruneError(KVToolError):
    """Prune cannot run: bad arguments, missing cache dir, an unusable lock file (exit 2).
    Also raised by `rm` and `validate` for an unusable lock file."""


class PruneLocked(PruneError):
    """Another process holds the lock on this cache directory (exit 3): a prune, rm or validate,
    or any process that flocked `.prune.lock`; the message names the holder only where known."""

    exit_code = EXIT_LOCKED


@contextmanager
def cache_lock(cache_dir: Path) -> Iterator[Path]:
    """Hold the cache's maintenance lock for the duration of the `with` block.

    Yields:
        The lock file path.

    Raises:
        PruneLocked: another process holds the lock.
        PruneError: the lock is a symlink or not a plain file (refused, never followed), or it
            cannot be created (missing or read-only cache directory).
    """
    path = Path(cache_dir) / LOCK_FILENAME
    fd = _open(path)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise PruneLocked(_refusal(fd, Path(cache_dir), path)) from None
        _write_pid(fd, os.getpid())
        try:
            yield path
        finally:
            _write_pid(fd, None)  # blanked while still held: a record names a live holder only
    finally:
        os.close(fd)  # releases the flock


def _open(path: Path) -> int:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    except OSError as exc:
        raise PruneError(f"cannot use the maintenance lock {path}: {exc.strerror or exc}") from None
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise PruneError(f"refusing the maintenance lock {path}: not a regular file (symlink?); remove it")
    try:
        fd = os.open(path, _FLAGS, 0o600)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise PruneError(f"refusing the maintenance lock {path}: it is a symlink (never followed); remove it") from None
        if exc.errno in _NO_SPACE and Path(path).parent.is_dir():  # a full disk: lock the directory itself
            return os.open(path.parent, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
        raise PruneError(f"cannot create the maintenance lock {path}: {exc.strerror or exc}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
        os.close(fd)
        raise PruneError(f"refusing the maintenance lock {path}: not a regular file with a single link; remove it")
    owner = dir_owner(path.parent)  # root in a user's cache: the user must still be able to lock it
    if owner is not None and st.st_uid != owner[0]:
        try:
            give_to(owner, fd=fd)
        except OSError as exc:
            os.close(fd)
            raise PruneError(f"cannot give the maintenance lock {path} to the cache's owner: {exc.strerror or exc}") from None
    return fd


def _write_pid(fd: int, pid: int | None) -> None:
    """Write `pid` (None: blanks) as the record of lock file `fd`, in place; best effort."""
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return  # the directory fallback
        os.pwrite(fd, ("" if pid is None else f"{pid}\n").ljust(PID_RECORD_BYTES).encode(), 0)
    except OSError:  # ENOSPC on a full disk (or a quota): the pid is only for the message
        pass


def _refusal(fd: int, cache_dir: Path, path: Path) -> str:
    """The message of a refused lock: the holder named only where it is known (module docstring)."""
    pids, recorded = _holders(fd)
    if recorded is not None and recorded in pids:
        return f"another kvtool prune, rm or validate is running on {cache_dir} (pid {recorded}); try again later"
    if pids:
        who = ", ".join(f"pid {p}{_command(p)}" for p in pids[:3]) + (", ..." if len(pids) > 3 else "")
        return f"the maintenance lock {path} of {cache_dir} is held by another process ({who}); try again later"
    return f"the maintenance lock {path} of {cache_dir} is held by another process (holder unknown); try again later"


def _holders(fd: int) -> tuple[list[int], int | None]:
    """(pids known to hold the lock on file `fd`, sorted; the record's pid, or None)."""
    st = os.fstat(fd)
    try:
        text = os.pread(fd, PID_RECORD_BYTES, 0).decode(errors="replace").split() if stat.S_ISREG(st.st_mode) else []
    except OSError:
        text = []
    recorded = int(text[0]) if text and text[0].isdigit() and 0 < int(text[0]) < 2**31 else None
    listed = _flock_pids(st)
    pids = sorted(p for p in listed or () if _has_open(p, st) is not False)
    if not pids and recorded is not None and _has_open(recorded, st) is not False:
        pids = [recorded]  # not in /proc/locks (none there, or released meanwhile): the record's live kvtool
    return pids, recorded


def _flock_pids(st: os.stat_result) -> set[int] | None:
    """The pids `/proc/locks` shows holding a flock on the file of `st` (waiters left out); None
    where there is no `/proc/locks` (not Linux)."""
    key = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks", encoding="ascii", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    pids = set()
    for line in lines:
        parts = line.split()
        if len(parts) > 5 and parts[1] == "FLOCK" and parts[5] == key and parts[4].isdigit() and int(parts[4]) > 0:
            pids.add(int(parts[4]))  # a waiter's line reads "N: -> FLOCK ...": parts[1] is "->"
    return pids


def _has_open(pid: int, st: os.stat_result) -> bool | None:
    """False if process `pid` is gone or has no descriptor on the file of `st`; True if it has one;
    None if it is alive but its descriptors cannot be read (another user's, or no /proc)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    except OSError:
        return False
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except FileNotFoundError:
        return None if not os.path.isdir("/proc/self/fd") else False
    except OSError:
        return None
    for name in names:
        try:
            fst = os.stat(f"/proc/{pid}/fd/{name}")
        except OSError:
            continue
        if (fst.st_dev, fst.st_ino) == (st.st_dev, st.st_ino):
            return True
    return False


def _command(pid: int) -> str:
    """': <command name>' of process `pid` (Linux `/proc/<pid>/comm`), or ''."""
    try:
        with open(f"/proc/{pid}/comm", encoding="utf-8", errors="replace") as f:
            name = f.read().strip()
    except OSError:
        return ""
    return f": {name}" if name.isprintable() and name else ""


__all__ = ["cache_lock", "PruneError", "PruneLocked", "EXIT_LOCKED", "LOCK_FILENAME"]
