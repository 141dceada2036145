"""`kvtool validate`: index files that are not files, moved aside before the scan.

SQLite opens `index.sqlite` and its side files (`-wal`, `-shm`, `-journal`) without `O_NOFOLLOW`
or `O_NONBLOCK`, so no kvtool command hands it a namespace where one of them exists and is not a
regular file (`kvtool.disk.names.irregular_index_file`): a FIFO would block the opening process
forever. Left there, such an entry disables its namespace for good. A repairing `validate`
therefore renames every one that is a FIFO, socket, device or directory to `<name>.irregular`
(`.irregular.1`, ... if taken) inside the namespace directory, opened without following symlinks
(a rename opens nothing, and nothing is deleted that kvtool may not have written); the scan that
follows then finds a readable index (a side file moved) or none (the index itself moved: it is
rebuilt from the segment files, as for a corrupt index). A symlink is never touched (the
namespace stays unreadable and reported, as symlinks are everywhere in the cache).

This module never imports MLX.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from kvtool.disk.confined import ConfinedDir
from kvtool.disk.names import INDEX_FILES, NAMESPACE_RE

SUFFIX = ".irregular"


@dataclass(frozen=True)
class MovedIndexFile:
    """One index file moved aside: `name` (e.g. `index.sqlite-journal`) is now `moved_to`; `kind`
    says what it was (fifo, socket, device, directory)."""

    name: str
    moved_to: str
    kind: str


def _kind(mode: int) -> str | None:
    """What a non-regular, non-symlink entry is, or None for a regular file or a symlink."""
    if stat.S_ISREG(mode) or stat.S_ISLNK(mode):
        return None
    return ("fifo" if stat.S_ISFIFO(mode) else "socket" if stat.S_ISSOCK(mode) else
            "directory" if stat.S_ISDIR(mode) else "device")  # fmt: skip


def move_irregular_index_files(cache_dir: Path, only: str | None = None) -> dict[str, list[MovedIndexFile]]:
    """Rename aside every index file of the cache's namespaces (or of namespace `only`: a layout
    key or a unique prefix of one) that is a
    FIFO, socket, device or directory (see the module docstring). Run under the cache's
    maintenance lock.

    Returns:
        namespace -> the files moved (namespaces with none are left out). A namespace that cannot
        be opened (a symlink, gone) or a file that cannot be renamed is skipped: the scan reports
        it as before.
    """
    out: dict[str, list[MovedIndexFile]] = {}
    try:
        names = sorted(e.name for e in os.scandir(cache_dir) if NAMESPACE_RE.match(e.name) and e.is_dir(follow_symlinks=False))
    except OSError:
        return out
    if only is not None:  # a layout key or a unique prefix of one (else the scan says which error)
        names = [n for n in names if n.startswith(only)]
        names = names if len(names) == 1 else []
    for ns in names:
        try:
            with ConfinedDir(cache_dir, ns) as cdir:
                moved = [m for name in INDEX_FILES if (m := _move(cdir.fd, name)) is not None]
        except OSError:
            continue
        if moved:
            out[ns] = moved
    return out


def _move(dir_fd: int, name: str) -> MovedIndexFile | None:
    try:
        kind = _kind(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return None
    if kind is None:
        return None
    for n in range(100):
        dest = name + SUFFIX + (f".{n}" if n else "")
        try:
            os.stat(dest, dir_fd=dir_fd, follow_symlinks=False)
            continue  # taken
        except FileNotFoundError:
            pass
        except OSError:
            return None
        try:
            os.rename(name, dest, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except OSError:
            return None
        return MovedIndexFile(name, dest, kind)
    return None


__all__ = ["move_irregular_index_files", "MovedIndexFile", "SUFFIX"]
