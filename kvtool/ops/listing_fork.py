"""A namespace's file listing made in a forked child while this process reads the index rows.

The scan reads the rows first and lists the files once the rows' snapshot is fixed (a row is never
inserted before its file exists, so the listing then sees every file a row names). The Arrow way
of reading the rows (`kvtool.disk.rowtable_arrow`) holds the GIL, so a listing in a thread beside
it slows both: at a million blocks the listing (0.4 s alone) took 1.2-1.7 s. Here it runs in a
child forked before the read starts, which waits until `go()` (the snapshot is fixed), lists with
the scanner's own code (`_Scanner._list_files`), and sends the result back through a pipe as
columns (names, paths, sizes, times: no pickled object per file). Nothing the child does is seen
here but that result; if it fails or dies, the caller lists here instead (`result()` returns None).

Linux only (`fork`); elsewhere, and for a scanner whose file operations are not the plain
`FileOps` (tests inject faults there, and count calls), the caller lists in process.

This module never imports MLX.
"""

from __future__ import annotations

import os
import pickle
import sys
from types import MappingProxyType
from typing import Any

from kvtool.disk.fsops import FileOps

_KEYS = ("temps", "symlinks", "irregular", "other")  # the listing's fields besides `files`


class ForkedListing:
    """`scanner._list_files()` in a forked child, started at once, listing only after `go()`.

    Args:
        scanner: a `kvtool.ops.scan._Scanner` (its `f` gets the listing's fields in `result`).
        segment_file: the `SegmentFile` class (rows of the listing are rebuilt as it).

    Raises:
        OSError: no child could be made (the caller lists in process).
    """

    def __init__(self, scanner: Any, segment_file: type):
        self.scanner, self.segment_file = scanner, segment_file
        r_go, self._w_go = os.pipe()
        self._r_out, w_out = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # the child: never returns
            _child(scanner, r_go, w_out, (self._w_go, self._r_out))
        os.close(r_go)
        os.close(w_out)

    @staticmethod
    def usable(scanner: Any) -> bool:
        """Whether a forked listing can stand for this scanner's own (see the module docstring)."""
        return sys.platform.startswith("linux") and hasattr(os, "fork") and type(scanner.fs) is FileOps

    def go(self) -> None:
        """Let the child list (the rows' snapshot is fixed)."""
        if self._w_go >= 0:
            os.write(self._w_go, b"1")
            os.close(self._w_go)
            self._w_go = -1

    def result(self) -> bool | None:
        """Wait for the child and put its listing into the scanner's fields: what `_list_files`
        returned, or None if the child failed (nothing is put; list in process)."""
        self.go()
        chunks = []
        try:
            while chunk := os.read(self._r_out, 1 << 20):
                chunks.append(chunk)
        finally:
            os.close(self._r_out)
            _reap(self.pid)
        try:
            listed, fields, files = pickle.loads(b"".join(chunks))
        except Exception:  # the child died before its answer was whole
            return None
        if listed:
            make = self.segment_file
            by_name = {n: make(n, rel, size, mtime) for n, rel, size, mtime in zip(*files, strict=True)}
            self.scanner.f.update(files=MappingProxyType(by_name), **fields)
        return listed

    def cancel(self) -> None:
        """Stop the child without its listing (it exits at once) and reap it."""
        if self._w_go >= 0:
            os.close(self._w_go)  # EOF: the child exits without listing
            self._w_go = -1
        try:
            os.close(self._r_out)
        finally:
            _reap(self.pid)


def _child(scanner: Any, r_go: int, w_out: int, parent_ends: tuple[int, int]) -> None:
    code = 1
    try:
        for fd in parent_ends:
            os.close(fd)
        if os.read(r_go, 1) == b"1":
            listed = scanner._list_files()
            f = scanner.f
            files = f.get("files", {}) if listed else {}
            cols = ([s.name for s in files.values()], [s.relpath for s in files.values()],
                    [s.size for s in files.values()], [s.mtime for s in files.values()])  # fmt: skip
            data = pickle.dumps((listed, {k: f[k] for k in _KEYS} if listed else {}, cols), protocol=pickle.HIGHEST_PROTOCOL)
            view = memoryview(data)
            while view:
                view = view[os.write(w_out, view) :]
        code = 0
    except BaseException:  # the parent sees an incomplete answer and lists itself
        pass
    finally:
        os._exit(code)  # no atexit handlers, no buffers of the parent flushed twice


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass


__all__ = ["ForkedListing"]
