"""Removing a whole namespace directory: only what kvtool writes there, nothing else.

`kvtool rm NAMESPACE` (and `prune` of an outdated namespace) removes, without following any
symlink, only entries under kvtool's own names (`kvtool.disk.names`):

- in a fan-out directory (`<2 hex>/`): segment files (`<name>.safetensors` whose name starts with
  the directory's two digits) and temp files (`.<name>.<pid>.<hex>.tmp`);
- at the top: the index and its side files (`index.sqlite`, `-wal`, `-shm`, `-journal`), what
  `validate --rebuild-index` leaves (`index.sqlite.corrupt`, `index.sqlite.rebuilding`, with
  their side files) and temp files;
- a symlink or a FIFO, socket or device node under such a name is removed itself (an unlink
  never follows or opens what it names); a directory under a file's name is not.

Fan-out directories and then the namespace directory are `rmdir`ed when that leaves them empty.
Everything else (a user's `notes.txt`, a `sub/` directory, a directory under a kvtool file name)
is left where it is and listed (`left`), and the directories holding it stay.

Order (a removal killed half-way leaves a namespace `validate` repairs or `rm` finishes): the
fan-out directories first (several at once: `unlink` releases the GIL and mostly waits on the
file system's journal), then the other top-level entries, the index last.

Before any of this, `kvtool_index_problem` tells a namespace directory whose `index.sqlite` is not
a kvtool index (another program's database, a text file): `rm` refuses it whole.

This module never imports MLX.
"""

from __future__ import annotations

import errno
import os
import sqlite3
import stat
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from kvtool.disk.index import read_only_uri
from kvtool.disk.names import INDEX_FILENAME, NAMESPACE_RE, SEGMENT_RE, SEGMENT_SUFFIX, SUBDIR_RE, TEMP_RE

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_DIR = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0) | _CLOEXEC
_SIDES = ("", "-wal", "-shm", "-journal")
INDEX_NAMES = frozenset(base + side for base in (INDEX_FILENAME, INDEX_FILENAME + ".corrupt", INDEX_FILENAME + ".rebuilding")
                        for side in _SIDES)  # fmt: skip


@dataclass
class TreeRemoval:
    """What removing a namespace's kvtool entries did (or, planned, would do).

    Attributes:
        bytes: bytes of the regular files under kvtool names (removed, or to remove).
        files: entries under kvtool names removed (or to remove).
        left: paths relative to the namespace directory of the entries that are not kvtool's
            (left where they are), sorted.
        removed: the namespace directory itself is gone.
    """

    bytes: int = 0
    files: int = 0
    left: list[str] = field(default_factory=list)
    removed: bool = False


def is_kvtool_top(name: str) -> bool:
    """True if `name` (an entry directly in a namespace directory, not a fan-out directory) is one
    kvtool writes: the index or its side files, a rebuild's leftovers, a temp file."""
    return name in INDEX_NAMES or TEMP_RE.match(name) is not None


def is_kvtool_leaf(sub: str, name: str) -> bool:
    """True if `name` in fan-out directory `sub` is one kvtool writes: a segment file of that
    directory, or a temp file."""
    if TEMP_RE.match(name):
        return True
    stem = name[: -len(SEGMENT_SUFFIX)] if name.endswith(SEGMENT_SUFFIX) else ""
    return SEGMENT_RE.match(stem) is not None and stem[:2] == sub


def kvtool_index_problem(ns_dir: Path) -> str | None:
    """Why `ns_dir/index.sqlite` is not a kvtool index, or None: absent, not a regular file (a
    planted link or node: removed itself, never opened), an empty database (a creation killed
    before its first commit), or a database whose `meta` table has kvtool's `format_version` or
    names this namespace as its `layout_key` (an index rebuilt without its meta). Read-only,
    `immutable=1` (no side file is opened or created)."""
    path = Path(ns_dir) / INDEX_FILENAME
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"{INDEX_FILENAME} cannot be looked at: {exc.strerror or exc}"
    if not stat.S_ISREG(st.st_mode):
        return None
    try:
        conn = sqlite3.connect(read_only_uri(path, immutable=True), uri=True)
    except sqlite3.Error as exc:
        return f"{INDEX_FILENAME} cannot be opened ({exc})"
    try:
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        if not tables:
            return None
        if "meta" in tables:
            meta = {str(k): str(v) for k, v in conn.execute("SELECT key, value FROM meta") if k is not None}
            if "format_version" in meta or meta.get("layout_key") == Path(ns_dir).name:
                return None
        return f"{INDEX_FILENAME} is an SQLite database without kvtool's meta: not a kvtool index"
    except sqlite3.Error as exc:
        return f"{INDEX_FILENAME} is not a kvtool index ({exc})"
    finally:
        conn.close()


def plan_tree(cache_dir: Path, namespace: str) -> TreeRemoval:
    """What `remove_tree` would remove and leave (changes nothing).

    Raises:
        ValueError: not a namespace name. OSError: the namespace is a symlink or cannot be listed.
    """
    out = TreeRemoval()
    with _namespace_fd(cache_dir, namespace) as (_, ns_fd):
        for name, kind in _entries(ns_fd):
            if kind == "dir" and SUBDIR_RE.match(name):
                sub = os.open(name, _DIR, dir_fd=ns_fd)
                try:
                    for leaf, leaf_kind in _entries(sub):
                        slash = "/" if leaf_kind == "dir" else ""
                        _count(out, sub, leaf, leaf_kind != "dir" and is_kvtool_leaf(name, leaf), f"{name}/{leaf}{slash}")
                finally:
                    os.close(sub)
            else:
                _count(out, ns_fd, name, _top_goes(name, kind), name + ("/" if kind == "dir" else ""))
    out.left.sort()
    return out


def remove_tree(cache_dir: Path, namespace: str, workers: int = 1) -> TreeRemoval:
    """Remove the kvtool entries of a namespace directory, then the directories left empty (see
    the module docstring); never follows a symlink.

    Args:
        cache_dir: the cache root.
        namespace: the namespace directory name (32 hex).
        workers: threads removing fan-out directories at once (1: one after the other).

    Returns:
        What was removed and left (`removed`: the namespace directory is gone).

    Raises:
        ValueError: not a namespace name. OSError: the namespace is a symlink, or an entry could
            not be removed (what could be removed is gone).
    """
    out = TreeRemoval()
    with _namespace_fd(cache_dir, namespace) as (root, ns_fd):
        entries = _entries(ns_fd)
        subdirs = sorted(name for name, kind in entries if kind == "dir" and SUBDIR_RE.match(name))
        parts: list[TreeRemoval] = []
        if workers > 1 and len(subdirs) > 1:
            with ThreadPoolExecutor(min(workers, len(subdirs)), thread_name_prefix="kvtool-rm") as pool:
                parts = [fut.result() for fut in [pool.submit(_remove_subdir, ns_fd, name) for name in subdirs]]
        else:
            parts = [_remove_subdir(ns_fd, name) for name in subdirs]
        for part in parts:
            out.bytes, out.files = out.bytes + part.bytes, out.files + part.files
            out.left += part.left
        others = sorted((e for e in entries if e[0] not in subdirs),
                        key=lambda e: (e[0] in INDEX_NAMES, e[0] == INDEX_FILENAME, e[0]))  # fmt: skip
        for name, kind in others:
            if _top_goes(name, kind):
                _unlink(out, ns_fd, name)
            else:
                out.left.append(name + ("/" if kind == "dir" else ""))
        if not out.left:
            try:
                os.rmdir(namespace, dir_fd=root)
                out.removed = True
            except OSError as exc:
                if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):  # created meanwhile: listed next time
                    raise
    out.left.sort()
    return out


def _top_goes(name: str, kind: str) -> bool:
    """A top-level entry to remove: a kvtool file name (not a directory), or a fan-out name that
    is not a directory but a symlink (removed itself)."""
    if kind == "dir":
        return False
    return is_kvtool_top(name) or (kind == "link" and SUBDIR_RE.match(name) is not None)


def _count(out: TreeRemoval, dir_fd: int, name: str, goes: bool, rel: str) -> None:
    if not goes:
        out.left.append(rel)
        return
    out.files += 1
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return
    if stat.S_ISREG(st.st_mode):
        out.bytes += st.st_size


def _unlink(out: TreeRemoval, dir_fd: int, name: str) -> None:
    """Unlink entry `name` (never followed: a symlink goes itself), counting a regular file's bytes."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return
    out.files += 1
    if stat.S_ISREG(st.st_mode):
        out.bytes += st.st_size


def _remove_subdir(ns_fd: int, name: str) -> TreeRemoval:
    """Remove the kvtool files of fan-out directory `name`, and the directory if that empties it."""
    out = TreeRemoval()
    try:
        fd = os.open(name, _DIR, dir_fd=ns_fd)
    except FileNotFoundError:
        return out
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        if stat.S_ISLNK(os.stat(name, dir_fd=ns_fd, follow_symlinks=False).st_mode):
            os.unlink(name, dir_fd=ns_fd)  # swapped for a symlink since listed: the link itself goes
        else:
            out.left.append(name)
        return out
    try:
        for leaf, kind in _entries(fd):
            if kind != "dir" and is_kvtool_leaf(name, leaf):
                _unlink(out, fd, leaf)
            else:
                out.left.append(f"{name}/{leaf}" + ("/" if kind == "dir" else ""))
    finally:
        os.close(fd)
    if not out.left:
        try:
            os.rmdir(name, dir_fd=ns_fd)
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            out.left.append(name + "/")
    return out


def _entries(dir_fd: int) -> list[tuple[str, str]]:
    """(name, 'dir' | 'link' | 'other') of each entry of `dir_fd`, symlinks never followed."""
    with os.scandir(dir_fd) as it:
        return [(e.name, "link" if e.is_symlink() else "dir" if e.is_dir(follow_symlinks=False) else "other") for e in it]


@contextmanager
def _namespace_fd(cache_dir: Path, namespace: str) -> Iterator[tuple[int, int]]:
    """`(cache root descriptor, namespace directory descriptor)`, the namespace opened
    `O_NOFOLLOW` (swapped for a symlink: ELOOP); both closed on exit.

    Raises:
        ValueError: not a namespace name. OSError: absent, a symlink or not a directory.
    """
    if not NAMESPACE_RE.match(namespace):
        raise ValueError(f"not a namespace name: {namespace!r}")
    root = os.open(cache_dir, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _CLOEXEC)
    try:
        if not stat.S_ISDIR(os.stat(namespace, dir_fd=root, follow_symlinks=False).st_mode):
            raise OSError(errno.ENOTDIR, "not a real directory (symlink?): never followed", namespace)
        fd = os.open(namespace, _DIR, dir_fd=root)
        try:
            yield root, fd
        finally:
            os.close(fd)
    finally:
        os.close(root)


__all__ = ["TreeRemoval", "plan_tree", "remove_tree", "kvtool_index_problem", "is_kvtool_top", "is_kvtool_leaf", "INDEX_NAMES"]
