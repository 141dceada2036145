"""File-system side of the SSD tier: `FileOps` (injectable calls) and the on-disk layout.

`SSDStore` and `kvtool validate` make every file-system call through a `FileOps`, which calls
`os` directly; tests subclass it to raise `OSError` (ENOSPC, EIO, EACCES, EROFS) from the method
they want to fail. The SQLite index does its own I/O. The layout helpers (temp names, namespace
scans) live here too, so the store and `kvtool validate` read the directory the same way.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
import time
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path

from kvtool.disk.names import INDEX_FILENAME, NAMESPACE_RE, SEGMENT_RE, SEGMENT_SUFFIX, SUBDIR_RE, TEMP_RE, TEMP_SUFFIX

TEMP_STALE_S = 600.0  # a temp file older than this is a leftover even if its pid is alive
DEFAULT_DIR_MODE = 0o700

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
# O_NONBLOCK: opening a FIFO or a device planted under a segment's name must not hang; it has
# no effect on a regular file, and anything else is refused right after the open (fstat).
_READ_FLAGS = os.O_RDONLY | _NOFOLLOW | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)
_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
_IOV_MAX = 1024


class NotRegularFileError(OSError):
    """A cache file that is not a regular file (a FIFO, socket, device or directory planted
    under its name): a corrupt entry, never read. `errno` is EINVAL."""

    def __init__(self, path: Path | str, what: str = "not a regular file"):
        super().__init__(errno.EINVAL, what, str(path))


def check_regular(fd: int, path: Path | str, before: os.stat_result | None = None) -> os.stat_result:
    """`fstat` of an open cache file: it must be a regular file (and, if `before` is given, the
    very file an `lstat` saw just before the open).

    Returns:
        The file's `fstat` result.

    Raises:
        NotRegularFileError: anything else (the caller closes `fd`).
    """
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise NotRegularFileError(path, f"not a regular file ({stat.filemode(st.st_mode)[0]})")
    if before is not None and (before.st_dev, before.st_ino) != (st.st_dev, st.st_ino):
        raise NotRegularFileError(path, "replaced while being opened")
    return st


def dir_owner(directory: Path | str) -> tuple[int, int] | None:
    """The `(uid, gid)` that files and directories kvtool creates in `directory` must get: its
    owner's, when this process runs as root and `directory` belongs to another user (root
    writing into a user's cache must leave nothing that user cannot prune); None otherwise
    (nothing to change, or `directory` cannot be stat'ed)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return None
    try:
        st = os.stat(directory)
    except OSError:
        return None
    return (st.st_uid, st.st_gid) if st.st_uid != 0 else None


def give_to(owner: tuple[int, int] | None, path: Path | str | None = None, fd: int | None = None) -> None:
    """`chown` a file kvtool just created (by descriptor, or by path without following a
    symlink) to `owner` (`dir_owner`); nothing if `owner` is None.

    Raises:
        OSError: the chown failed (the caller removes what it created: never leave it behind).
    """
    if owner is None:
        return
    if fd is not None:
        os.fchown(fd, *owner)
    elif path is not None:
        os.chown(path, *owner, follow_symlinks=False)


class FileOps:
    """The real file-system operations (thin wrappers over `os`).

    Every method raises `OSError` (or a subclass such as `FileNotFoundError`) on failure,
    exactly as the underlying `os` call does. Methods are stateless and thread-safe.
    """

    quiet_index = False  # True: a store that cannot write opens its index `quiet` (`BlockIndex`)

    # ------------------------------------------------------------------ write side
    def makedirs(self, path: Path, mode: int = DEFAULT_DIR_MODE) -> None:
        """Create `path` and missing parents with exactly `mode` (whatever the umask); an
        existing directory is fine, but the leaf must be a real directory, not a symlink. Run
        as root under another user's directory, the new directories are given to that user.

        Raises:
            NotADirectoryError: `path` is a symlink or not a directory.
            OSError: a directory cannot be created (or given to its owner: it is removed again).
        """
        path = Path(path)
        missing = []
        p = path
        while not os.path.lexists(p) and p != p.parent:
            missing.append(p)
            p = p.parent
        owner = dir_owner(p) if missing else None
        for d in reversed(missing):
            try:
                os.mkdir(d, mode)
            except FileExistsError:
                continue
            try:
                give_to(owner, d)  # before chmod: chown clears the setgid bit of a directory on some systems
                os.chmod(d, mode)
            except OSError:
                os.rmdir(d)
                raise
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            raise NotADirectoryError(errno.ENOTDIR, "not a real directory (symlink?)", str(path))

    def open_new(self, path: Path) -> int:
        """Create `path` exclusively for writing (mode 0644) and return its descriptor. Run as
        root in another user's directory, the file is given to that user (`dir_owner`).

        Raises:
            FileExistsError: `path` already exists.
            OSError: it cannot be created, or not given to its directory's owner (removed again).
        """
        owner = dir_owner(Path(path).parent)
        fd = os.open(path, _WRITE_FLAGS, 0o644)
        try:
            give_to(owner, fd=fd)
        except OSError:
            os.close(fd)
            os.unlink(path)
            raise
        return fd

    def write_all(self, fd: int, data: bytes | bytearray | memoryview | list | tuple) -> None:
        """Write every byte of `data` (a buffer, or a sequence of buffers written in order with
        `os.writev`) to `fd`, looping over short writes."""
        bufs = [memoryview(data).cast("B")] if not isinstance(data, (list, tuple)) else [memoryview(b).cast("B") for b in data]
        bufs = [b for b in bufs if b.nbytes]
        while bufs:
            n = os.writev(fd, bufs[:_IOV_MAX])
            while n and bufs:
                if n >= bufs[0].nbytes:
                    n -= bufs[0].nbytes
                    bufs.pop(0)
                else:
                    bufs[0] = bufs[0][n:]
                    n = 0

    def fsync(self, fd: int) -> None:
        """Flush a file's data and metadata to stable storage."""
        os.fsync(fd)

    def close(self, fd: int) -> None:
        """Close a descriptor returned by `open_new`."""
        os.close(fd)

    def fsync_dir(self, path: Path) -> None:
        """fsync a directory so a rename or unlink inside it survives a power loss."""
        fd = os.open(path, _DIR_FLAGS)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def replace(self, src: Path, dst: Path) -> None:
        """Atomically rename `src` over `dst` (same directory)."""
        os.replace(src, dst)

    def unlink(self, path: Path, missing_ok: bool = True) -> None:
        """Remove a file.

        Raises:
            FileNotFoundError: the file is absent and `missing_ok` is False.
        """
        try:
            os.unlink(path)
        except FileNotFoundError:
            if not missing_ok:
                raise

    # ------------------------------------------------------------------- read side
    def open_read(self, path: Path) -> int:
        """Open a regular file for reading without following a symlink and without blocking:
        `lstat` first (a FIFO, socket or device is never opened), then `O_NONBLOCK` open and
        `fstat` (the same regular file, or refused).

        Raises:
            NotRegularFileError: not a regular file (FIFO, socket, device, directory).
            OSError: absent (FileNotFoundError), a symlink (ELOOP), unreadable.
        """
        before = os.lstat(path)
        if stat.S_ISLNK(before.st_mode):
            raise OSError(errno.ELOOP, "a symlink: never followed", str(path))
        if not stat.S_ISREG(before.st_mode):
            raise NotRegularFileError(path)
        fd = os.open(path, _READ_FLAGS)
        try:
            check_regular(fd, path, before)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def mtime(self, path: Path) -> float:
        """Modification time of a file (unix seconds), not following a symlink."""
        return os.lstat(path).st_mtime

    def exists(self, path: Path) -> bool:
        """True if `path` exists, a dangling symlink included (other errors count as absent)."""
        return os.path.lexists(path)

    def listdir(self, path: Path) -> list[str]:
        """Names of the entries of a directory (unsorted)."""
        return os.listdir(path)

    def scandir(self, path: Path) -> list[os.DirEntry]:
        """The entries of a directory (unsorted), with their types (no `stat` per entry)."""
        with os.scandir(path) as it:
            return list(it)

    def is_dir(self, path: Path) -> bool:
        """True if `path` is a real directory (not a symlink to one)."""
        try:
            return stat.S_ISDIR(os.lstat(path).st_mode)
        except OSError:
            return False


# ----------------------------------------------------------------------------- layout
def temp_path_for(final: Path, name: str) -> Path:
    """A fresh temp path next to `final`: `.<name>.<pid>.<random>.tmp` (`name` = segment name)."""
    return final.parent / f".{name}.{os.getpid()}.{secrets.token_hex(4)}{TEMP_SUFFIX}"


def pid_alive(pid: int, limit: float = 1 << 22) -> bool:
    """True if process `pid` exists; one this process may not signal (or an absurd pid) counts as
    alive only below `limit`."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return pid < limit  # exists but not ours (or absurd pid -> dead)
    return True


def temp_is_leftover(fs: FileOps, path: Path, now: float | None = None) -> bool:
    """True if a temp file can be removed: its writer process is gone, or it is stale.

    A temp file of a live process may be a write in progress and is kept (unless it is older
    than `TEMP_STALE_S`, which also covers pid reuse).
    """
    m = TEMP_RE.match(path.name)  # the pid of its writer is in its name
    if m is None or not pid_alive(int(m.group("pid"))):
        return True
    try:
        return (time.time() if now is None else now) - fs.mtime(path) > TEMP_STALE_S
    except FileNotFoundError:
        return False


def is_namespace_dir(path: Path, fs: FileOps | None = None) -> bool:
    """True if `path` is a namespace: a real 32-hex directory holding `index.sqlite`."""
    fs = fs or FileOps()
    return bool(NAMESPACE_RE.match(path.name)) and fs.is_dir(path) and fs.exists(path / INDEX_FILENAME)


def holds_segments(path: Path, fs: FileOps | None = None) -> bool:
    """True if directory `path` holds a kvtool segment file in one of its fan-out directories
    (`<2 hex>/<name>.safetensors`, the name starting with those two digits); nothing followed."""
    fs = fs or FileOps()
    try:
        subs = [n for n in fs.listdir(path) if SUBDIR_RE.match(n) and fs.is_dir(path / n)]
        for sub in subs:
            for name in fs.listdir(path / sub):
                stem = name[: -len(SEGMENT_SUFFIX)]
                if name.endswith(SEGMENT_SUFFIX) and SEGMENT_RE.match(stem) and stem.startswith(sub):
                    return True
    except OSError:
        return False
    return False


def list_namespaces(cache_dir: Path, fs: FileOps | None = None) -> list[Path]:
    """Namespace directories directly under `cache_dir`, sorted; other entries are ignored.

    Raises:
        OSError: `cache_dir` cannot be listed (e.g. FileNotFoundError).
    """
    fs = fs or FileOps()
    cache_dir = Path(cache_dir)
    return [cache_dir / n for n in sorted(fs.listdir(cache_dir)) if is_namespace_dir(cache_dir / n, fs)]


@dataclass
class NamespaceScan:
    """What a namespace directory holds on disk (symlinks are never followed).

    Attributes:
        files: segment name -> path relative to the namespace dir, for well-named segment files.
        temps: kvtool temp files (`.<name>.<pid>.<hex>.tmp`, any age or owner).
        other: relative paths of entries that are none of these (ignored, reported); symlinks
            and foreign `*.tmp` files land here.
        symlinks: relative paths of symlinks found (never followed, never removed).
        stats: relative path -> `lstat` of each segment and temp file (`with_stat` only; a file
            gone meanwhile has none).
    """

    files: dict[str, str] = field(default_factory=dict)
    temps: list[Path] = field(default_factory=list)
    other: list[str] = field(default_factory=list)
    symlinks: list[str] = field(default_factory=list)
    stats: dict[str, os.stat_result] = field(default_factory=dict)


def scan_namespace(ns_dir: Path, fs: FileOps | None = None, with_stat: bool = False) -> NamespaceScan:
    """List the segment files and temp files of namespace directory `ns_dir` (one listing per
    fan-out subdir; a symlink is told by the entry's type); `with_stat`: also `lstat` each
    segment and temp file, once (`NamespaceScan.stats`).

    Raises:
        OSError: the namespace directory cannot be listed.
    """
    fs = fs or FileOps()
    scan = NamespaceScan()
    for sub in sorted(fs.listdir(ns_dir)):
        path = ns_dir / sub
        if os.path.islink(path):
            scan.symlinks.append(sub)
            continue
        if not SUBDIR_RE.match(sub):
            if TEMP_RE.match(sub):
                scan.temps.append(path)
                if with_stat:
                    with suppress(OSError):
                        scan.stats[sub] = os.lstat(path)
            elif not sub.startswith(INDEX_FILENAME):
                scan.other.append(sub)
            continue
        try:
            entries = fs.scandir(path)
        except (NotADirectoryError, FileNotFoundError):
            scan.other.append(sub)
            continue
        for entry in sorted(entries, key=lambda e: e.name):
            name = entry.name
            rel = f"{sub}/{name}"
            stem = name[: -len(SEGMENT_SUFFIX)] if name.endswith(SEGMENT_SUFFIX) else None
            if entry.is_symlink():
                scan.symlinks.append(rel)
                continue
            if TEMP_RE.match(name):
                scan.temps.append(path / name)
            elif stem and SEGMENT_RE.match(stem) and stem[:2] == sub:
                scan.files[stem] = rel
            else:
                scan.other.append(rel)
                continue
            if with_stat:
                with suppress(OSError):
                    scan.stats[rel] = entry.stat(follow_symlinks=False)
    return scan


def short_path(path: Path | str, limit: int = 80) -> str:
    """`path` for a one-line message: cut in the middle beyond `limit` characters, with its length."""
    text = str(path)
    if len(text) <= limit:
        return text
    return f"{text[: limit // 2]}...{text[-(limit // 4):]} ({len(text)} characters)"


class NamespaceSelectError(ValueError):
    """The cache dir is missing/unreadable, or a namespace prefix matches none or several."""


def resolve_cache_root(cache_dir: Path | str) -> Path:
    """The cache root with symlinks on its own path followed, once, here (`~/.cache/kvtool ->
    /ssd/kvtool` is the owner's choice); nothing *inside* the cache is ever followed. A root
    that does not exist yet is returned with its existing part resolved.

    Raises:
        OSError: the path cannot even be looked at: a name too long (ENAMETOOLONG), a symlink
            loop (ELOOP), a component that is not a directory (ENOTDIR), no permission (EACCES).
    """
    path = Path(cache_dir)
    try:
        os.stat(path)
    except FileNotFoundError:
        return Path(os.path.realpath(path))
    return Path(os.path.realpath(path, strict=True))


def select_namespaces(cache_dir: Path, namespace: str | None = None, fs: FileOps | None = None) -> list[Path]:
    """Namespace directories of a cache (with an index, or without one but holding segment files:
    an index deleted), optionally only the one matching `namespace`.

    Args:
        cache_dir: the SSD tier root (a symlinked root is followed: `resolve_cache_root`).
        namespace: a layout key or a unique prefix of one (case-insensitive); None = all.
        fs: file-system operations.

    Returns:
        Namespace directories, sorted; none if `cache_dir` does not exist yet (an empty cache).

    Raises:
        NamespaceSelectError: `cache_dir` is not a directory or cannot be looked at (a name too
            long, no permission), or `namespace` matches none or several.
    """
    fs = fs or FileOps()
    cache_dir = Path(cache_dir)
    try:
        st = os.stat(cache_dir)
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise NamespaceSelectError(f"cannot use cache directory {short_path(cache_dir)}: {exc.strerror or exc}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise NamespaceSelectError(f"cache directory {cache_dir} is not a directory")
    try:
        dirs = list_namespaces(cache_dir, fs)
        indexed = {d.name for d in dirs}
        lost = [cache_dir / n for n in fs.listdir(cache_dir)  # an index deleted: its segments must not be invisible
                if NAMESPACE_RE.match(n) and n not in indexed and fs.is_dir(cache_dir / n) and holds_segments(cache_dir / n, fs)]
        dirs = sorted(dirs + lost)
    except OSError as exc:
        raise NamespaceSelectError(f"cannot list {cache_dir}: {exc.strerror or exc}") from None
    if namespace is None:
        return dirs
    picked = [d for d in dirs if d.name.startswith(namespace.lower())]
    if len(picked) != 1:
        what = "no namespace" if not picked else f"{len(picked)} namespaces"
        raise NamespaceSelectError(f"{what} in {cache_dir} match {namespace!r}")
    return picked
