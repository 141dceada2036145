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
Everything else is left where it is and listed (`left`), and the directories holding it stay.
Order (a removal killed half-way leaves a namespace `validate` repairs or `rm` finishes): the
fan-out directories first (several at once), then the other top-level entries, the index last.
`kvtool_index_problem` tells a directory whose `index.sqlite` is not a kvtool index: `rm` refuses it.
"""

from __future__ import annotations

import errno
import os
import sqlite3
import stat
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from kvtool.disk.confined import DIR_FLAGS, ConfinedDir
from kvtool.disk.index import index_uri
from kvtool.disk.names import INDEX_FILENAME, INDEX_NAMES, SUBDIR_RE, is_kvtool_leaf, is_kvtool_top


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

    def add(self, part: TreeRemoval) -> None:
        """Count `part` (a fan-out directory's) in."""
        self.bytes, self.files = self.bytes + part.bytes, self.files + part.files
        self.left += part.left


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
        conn = sqlite3.connect(index_uri(path, immutable=True), uri=True)
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
    return _tree(cache_dir, namespace, remove=False)


def remove_tree(cache_dir: Path, namespace: str, workers: int = 1) -> TreeRemoval:
    """Remove the kvtool entries of namespace directory `cache_dir/namespace`, then the
    directories left empty (see the module docstring), `workers` fan-out directories at once;
    never follows a symlink. Returns what was removed and left.

    Raises:
        ValueError: not a namespace name. OSError: the namespace is a symlink, or an entry could
            not be removed (what could be removed is gone).
    """
    return _tree(cache_dir, namespace, remove=True, workers=workers)


def drop_unused(cache_dir: Path, namespace: str, created_since: float) -> bool:
    """Remove a namespace that holds nothing, for a command that opened one it did not find and
    stored nothing in it (a refused `kvtool import`, `kvtool export`): its index was created at or
    after `created_since` (unix s; meta `created`), its directory (no symlink) holds only index
    files, the index no block or segment row, and it was closed cleanly (no process has it open:
    an open sets `shutdown_clean = 0`). Checked and removed under the index's write lock (a process
    opening it meanwhile waits). Returns True if it was removed; never raises."""
    ns_dir = Path(cache_dir) / namespace
    try:
        if not stat.S_ISDIR(os.lstat(ns_dir).st_mode) or set(os.listdir(ns_dir)) - set(INDEX_NAMES):
            return False
        conn = sqlite3.connect(index_uri(ns_dir / INDEX_FILENAME, "rw"), uri=True,
                               timeout=0, isolation_level=None)  # fmt: skip
    except (OSError, sqlite3.Error):
        return False
    try:
        conn.execute("BEGIN IMMEDIATE")
        rows = conn.execute("SELECT (SELECT count(*) FROM blocks) + (SELECT count(*) FROM segments)").fetchone()
        meta = dict(conn.execute("SELECT key, value FROM meta WHERE key IN ('shutdown_clean', 'created')"))
        if rows != (0,) or meta.get("shutdown_clean") != "1" or float(meta.get("created", "-inf")) < created_since:
            return False
        return remove_tree(Path(cache_dir), namespace).removed
    except (OSError, ValueError, sqlite3.Error):
        return False
    finally:
        conn.close()


def _tree(cache_dir: Path, namespace: str, remove: bool, workers: int = 1) -> TreeRemoval:
    """`remove_tree`, or with `remove=False` only what it would do (`plan_tree`)."""
    out = TreeRemoval()
    with ConfinedDir(cache_dir, namespace) as cdir:
        entries = _entries(cdir.fd)
        subdirs = sorted(name for name, kind in entries if kind == "dir" and SUBDIR_RE.match(name))
        if remove and workers > 1 and len(subdirs) > 1:
            with ThreadPoolExecutor(min(workers, len(subdirs)), thread_name_prefix="kvtool-rm") as pool:
                parts = list(pool.map(lambda name: _fan_out(cdir.fd, name, remove), subdirs))
        else:
            parts = [_fan_out(cdir.fd, name, remove) for name in subdirs]
        for part in parts:
            out.add(part)
        others = sorted((e for e in entries if e[0] not in subdirs),
                        key=lambda e: (e[0] in INDEX_NAMES, e[0] == INDEX_FILENAME, e[0]))  # fmt: skip
        for name, kind in others:
            if _top_goes(name, kind):
                _take(out, cdir.fd, name, remove)
            else:
                out.left.append(name + ("/" if kind == "dir" else ""))
        if remove and not out.left:
            out.removed = _rmdir(cdir.root, namespace)
    out.left.sort()
    return out


def _top_goes(name: str, kind: str) -> bool:
    """A top-level entry to remove: a kvtool file name (not a directory), or a fan-out name that
    is not a directory but a symlink (removed itself)."""
    if kind == "dir":
        return False
    return is_kvtool_top(name) or (kind == "link" and SUBDIR_RE.match(name) is not None)


def _take(out: TreeRemoval, dir_fd: int, name: str, remove: bool) -> None:
    """Count entry `name` (a regular file's bytes too) and, with `remove`, unlink it (never
    followed: a symlink goes itself). Planned, an entry that cannot be looked at counts without
    bytes; removed, one gone meanwhile does not count.

    Raises:
        OSError: (`remove`) it could not be removed.
    """
    st: os.stat_result | None = None
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if remove:
            os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        if remove:
            return
    except OSError:
        if remove:
            raise
    out.files += 1
    if st is not None and stat.S_ISREG(st.st_mode):
        out.bytes += st.st_size


def _fan_out(ns_fd: int, name: str, remove: bool) -> TreeRemoval:
    """The kvtool files of fan-out directory `name`, counted and (`remove`) removed, and the
    directory too if that empties it."""
    out = TreeRemoval()
    try:
        fd = os.open(name, DIR_FLAGS, dir_fd=ns_fd)
    except OSError as exc:
        if not remove:
            raise
        if isinstance(exc, FileNotFoundError):
            return out
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
                _take(out, fd, leaf, remove)
            else:
                out.left.append(f"{name}/{leaf}" + ("/" if kind == "dir" else ""))
    finally:
        os.close(fd)
    if remove and not out.left and not _rmdir(ns_fd, name):
        out.left.append(name + "/")
    return out


def _rmdir(dir_fd: int, name: str) -> bool:
    """`rmdir` directory `name`; False if it is not empty (an entry created meanwhile: listed next time)."""
    try:
        os.rmdir(name, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
        return False
    return True


def _entries(dir_fd: int) -> list[tuple[str, str]]:
    """(name, 'dir' | 'link' | 'other') of each entry of `dir_fd`, symlinks never followed."""
    with os.scandir(dir_fd) as it:
        return [(e.name, "link" if e.is_symlink() else "dir" if e.is_dir(follow_symlinks=False) else "other") for e in it]


__all__ = ["TreeRemoval", "drop_unused", "plan_tree", "remove_tree", "kvtool_index_problem"]
