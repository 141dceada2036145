"""File operations confined to one namespace directory: nothing followed, nothing outside.

The operator commands read and remove files that an index row or a directory listing named.
Both can be planted by anyone who can write the cache directory, so every path is resolved
component by component with directory descriptors opened `O_NOFOLLOW`: a symlinked namespace,
fan-out directory or file makes the operation fail (`OSError`, errno ELOOP/ENOTDIR) instead of
reaching outside the cache, and only names that match kvtool's own patterns
(`kvtool.disk.names`) are ever opened or removed. The cache directory itself is the owner's
choice and may be a symlink.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from kvtool.disk.names import NAMESPACE_RE, SUBDIR_RE, TEMP_RE, is_kvtool_leaf, segment_relpath

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _NOFOLLOW | _CLOEXEC  # a directory, never a symlink
_READ = os.O_RDONLY | _NOFOLLOW | _CLOEXEC | getattr(os, "O_NONBLOCK", 0)
FULL_DISK_BYTES = 1 << 20  # less free space than this (for an unprivileged user) is a full disk


def _not_regular(what: str) -> OSError:
    return OSError(errno.ELOOP, f"{what} is not a regular file (symlink?): never followed")


class ConfinedDir:
    """One namespace directory, opened without following symlinks.

    Args:
        cache_dir: the cache root (may itself be a symlink: the owner chose it).
        namespace: the namespace directory name (32 hex).

    Raises:
        ValueError: `namespace` is not a namespace name.
        OSError: the namespace is absent, a symlink or not a directory (ENOTDIR).

    Attributes:
        fd: the namespace directory's descriptor; root: the cache root's (for its `rmdir`).
    """

    def __init__(self, cache_dir: Path, namespace: str):
        if not NAMESPACE_RE.match(namespace):
            raise ValueError(f"not a namespace name: {namespace!r}")
        self.namespace = namespace
        self._subdirs: dict[str, int] = {}  # fan-out directory -> descriptor, for open_segment
        self.root = os.open(cache_dir, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _CLOEXEC)  # kept for `rmdir`
        try:
            if not stat.S_ISDIR(os.stat(namespace, dir_fd=self.root, follow_symlinks=False).st_mode):
                raise OSError(errno.ENOTDIR, "not a real directory (symlink?): never followed", namespace)
            self.fd = os.open(namespace, DIR_FLAGS, dir_fd=self.root)
        except BaseException:
            os.close(self.root)
            raise

    def close(self) -> None:
        for fd in self._subdirs.values():
            os.close(fd)
        self._subdirs.clear()
        for fd in (self.fd, self.root):
            if fd >= 0:
                os.close(fd)
        self.fd = self.root = -1

    def __enter__(self) -> ConfinedDir:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ helpers
    def _split(self, relpath: str) -> tuple[int, str]:
        """(descriptor of the directory holding `relpath`, its last component); the caller
        closes the descriptor if it is not `self.fd`."""
        if "/" not in relpath:
            return self.fd, relpath
        sub, name = relpath.split("/", 1)
        if not SUBDIR_RE.match(sub) or "/" in name:
            raise ValueError(f"not a namespace path: {relpath!r}")
        return os.open(sub, DIR_FLAGS, dir_fd=self.fd), name

    def _done(self, fd: int) -> None:
        if fd != self.fd:
            os.close(fd)

    def _unlink(self, relpath: str, regular: bool = True) -> int:
        """Remove `relpath` (never a symlink): a regular file, or (`regular=False`) a FIFO, socket
        or device node; returns the bytes freed (a regular file's size), 0 if it was absent.

        Raises:
            OSError: anything else is there (`_not_regular`, or EINVAL), or the unlink failed.
        """
        try:
            fd, name = self._split(relpath)
        except FileNotFoundError:
            return 0
        try:
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            if regular and not stat.S_ISREG(st.st_mode):
                raise _not_regular(relpath)
            if not regular and (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode) or stat.S_ISLNK(st.st_mode)):
                raise OSError(errno.EINVAL, "a regular file, directory or symlink: not removed as a planted entry", relpath)
            os.unlink(name, dir_fd=fd)
            return st.st_size if regular else 0
        except FileNotFoundError:
            return 0
        finally:
            self._done(fd)

    # ------------------------------------------------------------------ segments
    def open_segment(self, name: str) -> tuple[int, int]:
        """Open segment `name` for reading: `(fd, size)`; close `fd` with `os.close`.

        Raises:
            ValueError: malformed name. OSError: absent, a symlink anywhere below the namespace,
                not a regular file, unreadable.
        """
        rel = segment_relpath(name)
        try:
            return self._open_segment(rel, fresh=False)
        except FileNotFoundError:  # the fan-out directory may have been replaced: look again
            return self._open_segment(rel, fresh=True)

    def _open_segment(self, rel: str, fresh: bool) -> tuple[int, int]:
        """`open_segment` through the fan-out directory's descriptor, opened once per run (each
        segment then costs one `open`); `fresh`: open the directory again."""
        sub, leaf = rel.split("/", 1)
        if fresh and sub in self._subdirs:
            os.close(self._subdirs.pop(sub))
        fd = self._subdirs.get(sub)
        if fd is None:
            fd = self._subdirs[sub] = os.open(sub, DIR_FLAGS, dir_fd=self.fd)
        # a FIFO or device is never opened (and O_NONBLOCK, then fstat, if one is swapped in)
        if not stat.S_ISREG(os.stat(leaf, dir_fd=fd, follow_symlinks=False).st_mode):
            raise _not_regular(rel)
        out = os.open(leaf, _READ, dir_fd=fd)
        st = os.fstat(out)
        if not stat.S_ISREG(st.st_mode):
            os.close(out)
            raise _not_regular(rel)
        return out, st.st_size

    def unlink_segment(self, name: str) -> int:
        """Remove segment file `name` (a regular file only); returns bytes freed (0 if absent).

        Raises:
            ValueError: malformed name. OSError: a symlink on the way (ELOOP), or the unlink failed.
        """
        return self._unlink(segment_relpath(name))

    def unlink_irregular(self, relpath: str) -> int:
        """Remove a FIFO, socket or device node planted under a kvtool name (a segment file or
        temp file name): unlinking a name never opens what it names. Regular files, directories
        and symlinks are refused (they have their own rules); absent is fine. Returns 0 (bytes
        freed: such an entry holds none).

        Raises:
            ValueError: not a segment or temp file path. OSError: a symlink on the way (ELOOP),
                the entry is a regular file, directory or symlink (EINVAL), or the unlink failed.
        """
        sub, _, leaf = relpath.rpartition("/")
        if not TEMP_RE.match(leaf) and not (sub and is_kvtool_leaf(sub, leaf)):
            raise ValueError(f"not a kvtool file name: {relpath!r}")
        return self._unlink(relpath, regular=False)

    def unlink_temp(self, relpath: str) -> int:
        """Remove a kvtool temp file (`.<name>.<pid>.<hex>.tmp`, top level or in a fan-out dir).

        Raises:
            ValueError: not a kvtool temp file name. OSError: as `unlink_segment`.
        """
        if not TEMP_RE.match(relpath.rsplit("/", 1)[-1]):
            raise ValueError(f"not a kvtool temp file: {relpath!r}")
        return self._unlink(relpath)


REMOVE_WORKERS = 8  # threads unlinking fan-out directories at once (an unlink waits on the journal, not the CPU)


def free_bytes(path: Path) -> int | None:
    """Bytes an unprivileged user may still write on `path`'s file system (None if unknown)."""
    try:
        sv = os.statvfs(path)
    except OSError:
        return None
    return sv.f_bavail * sv.f_frsize


def disk_full(path: Path) -> bool:
    """True if `path`'s file system has less than `FULL_DISK_BYTES` free."""
    free = free_bytes(path)
    return free is not None and free < FULL_DISK_BYTES


__all__ = ["ConfinedDir", "DIR_FLAGS", "REMOVE_WORKERS", "free_bytes", "disk_full", "FULL_DISK_BYTES"]
