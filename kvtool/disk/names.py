"""Names on disk: what a cache directory may contain, and the only paths kvtool builds from it.

Everything kvtool reads from a cache directory (index rows, file names) is matched against these
patterns *before* a path is built from it, so a tampered row such as `../victim` or `//etc/x`
can never name a file outside the namespace (docs/design.md#threat-model).

    <cache_dir>/<layout_key>/index.sqlite              the namespace's SQLite index (+ -wal, -shm)
    <cache_dir>/<layout_key>/<name[:2]>/<name>.safetensors   a segment file (format 2)
    <cache_dir>/<layout_key>/<sub>/.<name>.<pid>.<hex>.tmp   a write in progress
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Sequence
from pathlib import Path

INDEX_FILENAME = "index.sqlite"
SEGMENT_SUFFIX = ".safetensors"
TEMP_SUFFIX = ".tmp"
LOCK_FILENAME = ".prune.lock"

NAMESPACE_RE = re.compile(r"^[0-9a-f]{32}\Z")
HASH_RE = re.compile(r"^[0-9a-f]{32}\Z")  # blake2b-128 chain hashes, hex
SEGMENT_RE = re.compile(r"^[0-9a-f]{32}\Z")  # random 128-bit segment names, hex
SUBDIR_RE = re.compile(r"^[0-9a-f]{2}\Z")
SIDE_SUFFIXES = ("", "-wal", "-shm", "-journal")  # the database file and every file SQLite opens beside it
INDEX_FILES = tuple(INDEX_FILENAME + s for s in SIDE_SUFFIXES)  # a namespace's index and its side files, by name
# every index file kvtool writes in a namespace directory: the index, what `validate
# --rebuild-index` leaves (`.corrupt`, `.rebuilding`), each with its side files
INDEX_NAMES = frozenset(base + side for base in (INDEX_FILENAME, INDEX_FILENAME + ".corrupt", INDEX_FILENAME + ".rebuilding")
                        for side in SIDE_SUFFIXES)  # fmt: skip
TEMP_RE = re.compile(r"^\.(?P<name>[0-9a-f]{32}|probe)\.(?P<pid>\d{1,10})\.[0-9a-f]{8}\.tmp\Z")


def is_hash(value: object) -> bool:
    """True if `value` is a well-formed chain hash (a str of 32 lowercase hex digits)."""
    return isinstance(value, str) and HASH_RE.match(value) is not None


_HASHES_RE = re.compile(r"(?:[0-9a-f]{32}\n)*")


def all_hashes(values: Sequence[object]) -> bool:
    """True if every value is a well-formed chain hash: one regex pass over them all (a prompt's
    lookup checks hundreds; `is_hash` per value costs ~0.4 us each)."""
    if not values:
        return True
    try:
        text = "\n".join(values) + "\n"  # type: ignore[arg-type]
    except TypeError:  # not all str
        return False
    return len(text) == 33 * len(values) and _HASHES_RE.fullmatch(text) is not None  # no value holds a newline


def is_segment_name(value: object) -> bool:
    """True if `value` is a well-formed segment name."""
    return isinstance(value, str) and SEGMENT_RE.match(value) is not None


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


def segment_relpath(name: str) -> str:
    """Path of a segment relative to its namespace directory: `<name[:2]>/<name>.safetensors`.

    Raises:
        ValueError: `name` is not a segment name (never build a path from an unchecked name).
    """
    if not is_segment_name(name):
        raise ValueError(f"not a segment name: {name!r}")
    return f"{name[:2]}/{name}{SEGMENT_SUFFIX}"


def irregular_index_file(path: Path) -> str | None:
    """The first of the database `path` and its side files (`-wal`, `-shm`, `-journal`) that
    exists and is not a regular file (a symlink, FIFO, socket, device or directory), by name; or
    None. SQLite opens them without `O_NOFOLLOW` or `O_NONBLOCK`: a symlink would be followed and
    a FIFO would block the opening process forever, so none is ever handed to it."""
    for suffix in SIDE_SUFFIXES:
        try:
            st = os.lstat(f"{path}{suffix}")
        except FileNotFoundError:
            continue
        except OSError:
            return Path(path).name + suffix
        if not stat.S_ISREG(st.st_mode):
            return Path(path).name + suffix
    return None


def quiet_signature(path: Path) -> tuple[int, ...] | None:
    """The identity of database `path` (device, inode, size in bytes, mtime and ctime in ns) if no
    side file (`-wal`, `-shm`, `-journal`) is beside it, else None. Without side files no process
    has it open (SQLite removes them when the last connection closes cleanly) and every committed
    transaction is in the file itself; a writer that opens it creates them, and one that changes
    the file changes this identity. Never raises: None also where `path` cannot be stat'ed."""
    for suffix in SIDE_SUFFIXES[1:]:
        try:
            os.lstat(f"{path}{suffix}")
            return None
        except FileNotFoundError:
            continue
        except OSError:
            return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


WAL_INDEX_HEADER_BYTES = 48  # one copy of the WAL-index header (sqlite.org/walformat.html); the -shm file holds two


def wal_index_header(path: Path) -> bytes | None:
    """The WAL-index header of database `path` (the first of the two copies at the start of
    `<path>-shm`; sqlite.org/walformat.html: it holds `iChange`, which every committed
    transaction increments, and `mxFrame`, the last frame of the snapshot a new reader sees), or
    None where it cannot be read consistently (no -shm, not a regular file, or the two copies
    differ: a writer is changing it)."""
    try:
        fd = os.open(f"{path}-shm", os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        head = os.pread(fd, 2 * WAL_INDEX_HEADER_BYTES, 0)
    except OSError:
        return None
    finally:
        os.close(fd)
    first, second = head[:WAL_INDEX_HEADER_BYTES], head[WAL_INDEX_HEADER_BYTES:]
    return first if len(head) == 2 * WAL_INDEX_HEADER_BYTES and first == second else None
