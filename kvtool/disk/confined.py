"""File operations confined to one namespace directory: nothing followed, nothing outside.

The operator commands read and remove files that an index row or a directory listing named.
Both can be planted by anyone who can write the cache directory, so every path is resolved
component by component with directory descriptors opened `O_NOFOLLOW`: a symlinked namespace,
fan-out directory or file makes the operation fail (`OSError`, errno ELOOP/ENOTDIR) instead of
reaching outside the cache, and only names that match kvtool's own patterns
(`kvtool.disk.names`) are ever opened or removed. The cache directory itself is the owner's
choice and may be a symlink.

This module never imports MLX.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kvtool.disk.names import (
    INDEX_FILENAME,
    NAMESPACE_RE,
    SEGMENT_RE,
    SEGMENT_SUFFIX,
    SUBDIR_RE,
    TEMP_RE,
    segment_relpath,
)

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_DIR = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _NOFOLLOW | _CLOEXEC
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
        OSError: the namespace is absent, a symlink (ELOOP) or not a directory.
    """

    def __init__(self, cache_dir: Path, namespace: str):
        if not NAMESPACE_RE.match(namespace):
            raise ValueError(f"not a namespace name: {namespace!r}")
        self.namespace = namespace
        self._subdirs: dict[str, int] = {}  # fan-out directory -> descriptor, for open_segment
        root = os.open(cache_dir, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _CLOEXEC)
        try:
            self.fd = os.open(namespace, _DIR, dir_fd=root)
        finally:
            os.close(root)

    def close(self) -> None:
        for fd in self._subdirs.values():
            os.close(fd)
        self._subdirs.clear()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

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
        return os.open(sub, _DIR, dir_fd=self.fd), name

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
            fd = self._subdirs[sub] = os.open(sub, _DIR, dir_fd=self.fd)
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
        leaf = relpath.rsplit("/", 1)[-1]
        stem = leaf[: -len(SEGMENT_SUFFIX)] if leaf.endswith(SEGMENT_SUFFIX) else ""
        if not TEMP_RE.match(leaf) and not (SEGMENT_RE.match(stem) and relpath == segment_relpath(stem)):
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


def remove_namespace_tree(cache_dir: Path, namespace: str, size: int | None = None, workers: int = 1) -> int:
    """Remove a whole namespace directory without following any symlink inside it.

    Order (a removal killed half-way leaves a namespace `validate` repairs or `rm` finishes): the
    fan-out directories with their segment files first (`workers` threads at once, one directory
    each: `unlink` releases the GIL and mostly waits on the file system's journal), then the other
    entries, the index last (its `-wal`/`-shm`, then `index.sqlite`), then the directory.

    Args:
        cache_dir: the cache root.
        namespace: the namespace directory name.
        size: its bytes if already counted (`tree_bytes`, when the removal was planned); None:
            counted here, before the removal.
        workers: threads removing fan-out directories (1: one after the other).

    Returns:
        Bytes of the regular files removed (as counted).

    Raises:
        ValueError: not a namespace name. OSError: the namespace is a symlink or the removal failed
            (what could be removed is gone).
    """
    if not NAMESPACE_RE.match(namespace):
        raise ValueError(f"not a namespace name: {namespace!r}")
    root = os.open(cache_dir, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _CLOEXEC)
    try:
        if not stat.S_ISDIR(os.stat(namespace, dir_fd=root, follow_symlinks=False).st_mode):
            raise OSError(errno.ENOTDIR, "not a real directory (symlink?): never followed", namespace)
        size = tree_bytes(cache_dir, namespace) if size is None else size
        ns_fd = os.open(namespace, _DIR, dir_fd=root)  # O_NOFOLLOW: swapped for a symlink since -> ELOOP
        try:
            _remove_entries(ns_fd, max(1, workers))
        finally:
            os.close(ns_fd)
        os.rmdir(namespace, dir_fd=root)
        return size
    finally:
        os.close(root)


def _remove_entries(ns_fd: int, workers: int) -> None:
    """Empty the namespace directory `ns_fd`: fan-out directories (in threads), other entries, the index."""
    with os.scandir(ns_fd) as it:
        entries = [(e.name, e.is_dir(follow_symlinks=False)) for e in it]
    subdirs = sorted(name for name, is_dir in entries if is_dir and SUBDIR_RE.match(name))
    if workers > 1 and len(subdirs) > 1:
        with ThreadPoolExecutor(min(workers, len(subdirs)), thread_name_prefix="kvtool-rm") as pool:
            for fut in [pool.submit(_remove_subdir, ns_fd, name) for name in subdirs]:
                fut.result()  # the first failure propagates (the other directories are still removed)
    else:
        for name in subdirs:
            _remove_subdir(ns_fd, name)
    index_last = sorted((name for name, is_dir in entries if name not in subdirs),
                        key=lambda n: (n.startswith(INDEX_FILENAME), n == INDEX_FILENAME, n))  # fmt: skip
    for name in index_last:
        try:
            if stat.S_ISDIR(os.stat(name, dir_fd=ns_fd, follow_symlinks=False).st_mode):
                shutil.rmtree(name, dir_fd=ns_fd)  # not kvtool's: fd-based, never follows a symlink inside
            else:
                os.unlink(name, dir_fd=ns_fd)  # a symlink is removed itself, never followed
        except FileNotFoundError:
            pass


def _remove_subdir(ns_fd: int, name: str) -> None:
    """Remove fan-out directory `name` of `ns_fd` and what it holds, without following symlinks."""
    try:
        fd = os.open(name, _DIR, dir_fd=ns_fd)
    except FileNotFoundError:
        return
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        os.unlink(name, dir_fd=ns_fd)  # swapped for a symlink or a file since listed: remove the entry itself
        return
    try:
        with os.scandir(fd) as it:
            names = [(e.name, e.is_dir(follow_symlinks=False)) for e in it]
        for leaf, is_dir in names:
            try:
                if is_dir:
                    shutil.rmtree(leaf, dir_fd=fd)  # not kvtool's: fd-based, never follows a symlink inside
                else:
                    os.unlink(leaf, dir_fd=fd)
            except FileNotFoundError:
                pass
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=ns_fd)


def tree_bytes(cache_dir: Path, namespace: str) -> int:
    """Bytes of the regular files below a namespace directory (symlinks not followed)."""
    total = 0
    root = os.open(cache_dir, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _CLOEXEC)
    try:
        for _, _, files, dfd in os.fwalk(namespace, dir_fd=root, follow_symlinks=False):
            for f in files:
                try:
                    st = os.stat(f, dir_fd=dfd, follow_symlinks=False)
                except OSError:
                    continue
                if stat.S_ISREG(st.st_mode):
                    total += st.st_size
    finally:
        os.close(root)
    return total


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


__all__ = ["ConfinedDir", "remove_namespace_tree", "REMOVE_WORKERS", "tree_bytes", "free_bytes", "disk_full", "FULL_DISK_BYTES"]
