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

A refused command names the record's kvtool only if that process is alive: otherwise the holder
is said to be unknown, never a stale pid.
"""

from __future__ import annotations

import errno
import fcntl
import math
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from kvtool.disk.fsops import dir_owner, give_to, pid_alive
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
    with suppress(OSError):  # ENOSPC on a full disk (or a quota): the pid is only for the message
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return  # the directory fallback
        os.pwrite(fd, ("" if pid is None else f"{pid}\n").ljust(PID_RECORD_BYTES).encode(), 0)


def _refusal(fd: int, cache_dir: Path, path: Path) -> str:
    """The message of a refused lock: the record's kvtool if that process is alive, else the
    holder is unknown (a flock names no holder; a dead kvtool's record names no one)."""
    try:
        text = os.pread(fd, PID_RECORD_BYTES, 0).decode(errors="replace").split() if stat.S_ISREG(os.fstat(fd).st_mode) else []
    except OSError:
        text = []
    pid = int(text[0]) if text and text[0].isdigit() and 0 < int(text[0]) < 2**31 else None
    if pid is not None and pid_alive(pid, math.inf):
        return f"another kvtool prune, rm or validate is running on {cache_dir} (pid {pid}); try again later"
    return f"the maintenance lock {path} of {cache_dir} is held by another process (holder unknown); try again later"


__all__ = ["cache_lock", "PruneError", "PruneLocked", "EXIT_LOCKED", "LOCK_FILENAME"]
