"""Page-cache control for the restore benchmark: drop (cold), read through (warm), and check.

`drop` evicts the named files (`fadvise_dontneed`) and falls back to `sync; echo 3 >
/proc/sys/vm/drop_caches` (root only) when pages stay resident; `method="global"` always drops the
whole page cache. `resident_fraction` asks the kernel (`mincore`) which part of the files is in
memory, so every measurement records what "cold" and "warm" really were. The writer baselines
(`dd_write`, `python_write`, each after `recycle_pages`) write through the page cache too.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap
import os
import subprocess
import time
from collections.abc import Iterable
from pathlib import Path

import numpy as np

DROP_METHODS = ("fadvise", "global")
RESIDENT_SLACK = 0.01  # after a drop, more than 1% resident counts as a failed drop
READ_CHUNK_BYTES = 16 << 20
DD_BLOCK_BYTES = 16 << 20  # dd's block and the Python write loop's chunk in the writer baselines


def files_under(paths: Iterable[Path]) -> list[Path]:
    """Regular files: each path itself, or every file below it (recursively)."""
    out: list[Path] = []
    for p in paths:
        p = Path(p)
        if p.is_dir():
            out.extend(sorted(q for q in p.rglob("*") if q.is_file()))
        elif p.is_file():
            out.append(p)
    return out


def drop_global() -> bool:
    """`sync; echo 3 > /proc/sys/vm/drop_caches`; False without permission."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def fadvise_dontneed(files: Iterable[Path]) -> str | None:
    """fsync then `POSIX_FADV_DONTNEED` each file (dirty pages are written first, since
    `POSIX_FADV_DONTNEED` keeps them).

    Returns:
        None when every call succeeded; else why not, one line (no `posix_fadvise` on this
        platform, e.g. macOS, or the exception of the call that failed).
    """
    if not hasattr(os, "posix_fadvise"):
        return "os.posix_fadvise is not available on this platform"
    try:
        for path in files:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def drop(paths: Iterable[Path], method: str = "fadvise") -> str:
    """Evict `paths` (files or directories) from the page cache.

    Returns:
        What was done: `fadvise`, `global`, `fadvise+global`, or `failed`.
    """
    files = files_under(paths)
    if method == "global":
        return "global" if drop_global() else "failed"
    ok = fadvise_dontneed(files) is None
    frac = resident_fraction(files)
    if ok and (frac is None or frac <= RESIDENT_SLACK):
        return "fadvise"
    return "fadvise+global" if drop_global() else "failed"


def warm(paths: Iterable[Path]) -> None:
    """Read every file through once so it sits in the page cache."""
    buf = bytearray(READ_CHUNK_BYTES)
    for path in files_under(paths):
        with open(path, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass


@functools.cache
def _c():
    lib = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    lib.mmap.restype = ctypes.c_void_p
    lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    lib.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    return lib


def _resident_pages(path: Path) -> tuple[int, int]:
    size = path.stat().st_size
    if size == 0:
        return 0, 0
    page = mmap.PAGESIZE
    pages = (size + page - 1) // page
    lib = _c()
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = lib.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap failed")
        try:
            vec = (ctypes.c_ubyte * pages)()
            if lib.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore failed")
            return sum(b & 1 for b in vec), pages
        finally:
            lib.munmap(addr, size)
    finally:
        os.close(fd)


def resident_fraction(files: Iterable[Path]) -> float | None:
    """Fraction of the files' pages in the page cache (0..1), None where `mincore` is unavailable."""
    resident = total = 0
    try:
        for path in files:
            r, t = _resident_pages(Path(path))
            resident += r
            total += t
    except (OSError, AttributeError):
        return None
    return resident / total if total else 0.0


def recycle_pages(d: Path, nbytes: int) -> None:
    """Write, sync and delete a scratch file of `nbytes` before a writer measurement: on a VM
    whose host backs guest memory lazily, the first touch of a guest page costs several times a
    write, so each method starts on the same recycled pages and none pays that cost for another."""
    path = d / "recycle.bin"
    chunk = bytes(min(nbytes, DD_BLOCK_BYTES))
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            left -= f.write(chunk[: min(left, len(chunk))])
        f.flush()
        os.fdatasync(f.fileno())
    path.unlink()


def dd_write(path: Path, block: int, count: int) -> dict:
    """`dd if=/dev/zero of=PATH bs=BLOCK count=COUNT conv=fdatasync`, timed from here."""
    os.sync()
    t0 = time.perf_counter()
    subprocess.run(["dd", "if=/dev/zero", f"of={path}", f"bs={block}", f"count={count}", "conv=fdatasync"],
                   check=True, capture_output=True)
    ms = (time.perf_counter() - t0) * 1e3
    size = path.stat().st_size
    path.unlink()
    return {"ms": ms, "bytes_io": size}


def python_write(path: Path, nbytes: int) -> tuple[dict, dict]:
    """Write `nbytes` with a Python `os.write` loop: `({ms, bytes_io} of the writes, of writes + fdatasync)`."""
    chunk = np.random.default_rng(1).integers(0, 255, size=DD_BLOCK_BYTES, dtype=np.uint8).tobytes()
    os.sync()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        t0 = time.perf_counter()
        left = nbytes
        while left > 0:
            left -= os.write(fd, chunk[: min(left, len(chunk))])
        ms = (time.perf_counter() - t0) * 1e3
        os.fdatasync(fd)
        ms_sync = (time.perf_counter() - t0) * 1e3
    finally:
        os.close(fd)
        path.unlink()
    return {"ms": ms, "bytes_io": nbytes}, {"ms": ms_sync, "bytes_io": nbytes}
