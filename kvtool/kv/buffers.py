"""Destination buffers of an SSD restore: per-layer MLX arrays with decode room, and the host
views reader threads fill (`KVBuffers`).

The buffers are allocated once per restore, without a fill for large KV (CPU backend), so the
reader threads' writes are the only pass over that memory; `ready()` waits for the allocation
and makes writable numpy views of their memory (CPU backend: zero copy; elsewhere numpy staging
copied in once). `caches()` hands them to mlx-lm caches, which then own them (in-place decode,
no copy). On Linux a long-lived daemon thread faults their pages in (`prefault`) while the request thread waits
for headers, sockets or reader threads, where they are fresh memory (not recycled by MLX's buffer cache).
"""

from __future__ import annotations

import ctypes
import functools
import io
import json
import logging
import mmap
import os
import queue
import struct
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, BinaryIO, cast

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from kvtool.disk.hostblock import HostBlock
from kvtool.disk.segment import STORAGE_DTYPES, HeadPieces, KVLayout
from kvtool.kv.blocks import (
    MX_TO_NP_STORAGE,
    NAME_TO_MX,
    Block,
    after_restore,
    assemble_layers,
    host_arrays,
    to_mlx,
)

__all__ = ["KVBuffers"]

log = logging.getLogger(__name__)


def _host_views(arrays: list[mx.array]) -> list[np.ndarray | None]:
    """Writable numpy views of MLX arrays' memory (bfloat16 as uint16), each None where MLX
    does not share it with the host (then the restore stages in numpy and copies once). One
    `mx.eval` for all of them."""
    srcs = [a.view(mx.uint16) if a.dtype == mx.bfloat16 else a for a in arrays]
    mx.eval(srcs)
    out: list[np.ndarray | None] = []
    for a, src in zip(arrays, srcs):
        try:
            view = np.asarray(src)
        except (TypeError, ValueError, RuntimeError):
            view = None
        if view is not None and (view.dtype != MX_TO_NP_STORAGE[a.dtype] or not view.flags.writeable
                                 or view.shape != tuple(a.shape)):
            view = None
        out.append(view)
    return out


# Unfilled allocation (`_blank_arrays`) costs ~0.1 ms per tensor (one GIL hand-off each); a zero
# fill costs a pass over the memory, and where MLX's buffer cache cannot hand the bytes back (its
# CPU cache keeps 32 MiB by default) the page faults of fresh memory on one thread: 48 tensors of
# 1.2 MB (`qwen0.5b` f32, 2k tokens) 17-21 ms zero-filled vs 2.4 ms unfilled. Unfilled is faster
# from this many bytes per tensor on average, or whenever the cache holds less than the buffers
# (docs/benchmarks.md).
BLANK_MIN_TENSOR_BYTES = 2 << 20

_SAFETENSORS_DTYPES = {mx.float32: "F32", mx.float16: "F16", mx.bfloat16: "BF16", mx.uint32: "U32"}


class _BlankStream(io.RawIOBase):
    """A read-only file-like object that `mx.load` takes for a safetensors file of the given
    tensors, but whose data reads leave MLX's buffers as they are (`readinto` writes only the
    header). Loading it allocates the tensors without a fill: MLX has no uninitialised
    allocation (`mx.empty` is `mx.zeros`), and a zero fill of a restore's buffers is a pass over
    memory that the restore then overwrites.
    """

    def __init__(self, specs: list[tuple[tuple[int, ...], mx.Dtype]]):
        super().__init__()
        meta, at = {}, 0
        for i, (shape, dtype) in enumerate(specs):
            n = int(np.prod(shape)) * dtype.size
            meta[f"{i:06d}"] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [at, at + n]}
            at += n
        header = json.dumps(meta).encode()
        header += b" " * (-len(header) % 8)
        self._head = struct.pack("<Q", len(header)) + header
        self._size = len(self._head) + at
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        view = memoryview(buffer).cast("B")
        n = min(view.nbytes, self._size - self._pos)
        if self._pos < len(self._head):
            k = min(n, len(self._head) - self._pos)
            view[:k] = self._head[self._pos : self._pos + k]
        self._pos += n
        return n

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self._size}[whence]
        self._pos = base + offset
        return self._pos

    def tell(self) -> int:
        return self._pos


_MADV_POPULATE_WRITE = 23  # Linux >= 5.14 (include/uapi/asm-generic/mman-common.h)
_populate_unusable: list[str] = []  # why prefault is off (set once: old kernel, no libc, not Linux)


class PrefaultJob:
    """One `prefault` request, done when its buffers are populated (or the call failed)."""

    def __init__(self, spans: list[tuple[int, int]], keep: list[np.ndarray]):
        self.spans, self.keep = spans, keep
        self.done = threading.Event()

    def join(self, timeout: float | None = None) -> None:
        """Wait until the job is done (at most `timeout` seconds)."""
        self.done.wait(timeout)

    def is_alive(self) -> bool:
        return not self.done.is_set()


_jobs: queue.SimpleQueue[PrefaultJob] | None = None
_jobs_lock = threading.Lock()


def prefault(views: list[np.ndarray]) -> PrefaultJob | None:
    """Fault in the pages of fresh restore buffers on a daemon thread (`madvise(MADV_POPULATE_WRITE)`,
    one call per buffer, the GIL released), so the readers' first writes do not each take a page
    fault on the request path. Contents are unchanged. A no-op where the call is not available
    (not Linux, kernel < 5.14: logged once at DEBUG).

    One long-lived thread takes the jobs from a queue (a thread per restore cost the request
    thread more than a queue hand-off). Buffers whose pages are all present already (memory that
    MLX's buffer cache recycled) are left out (`mincore`): populating present pages is still a
    walk over them (docs/benchmarks.md).

    Returns:
        The job (`join` waits for it; nobody needs to: it only touches memory the views keep
        alive), or None.
    """
    global _jobs
    if _populate_unusable or sys.platform != "linux" or os.environ.get("KVTOOL_NO_PREFAULT"):
        return None
    spans = [(v.ctypes.data, v.nbytes) for v in views if v.nbytes >= 1 << 20]
    calls = _libc_calls() if spans else None
    if calls is None:
        return None
    spans = [(addr, n) for addr, n in spans if not _resident(calls[1], addr, n)]
    if not spans:
        return None
    with _jobs_lock:
        if _jobs is None:
            _jobs = queue.SimpleQueue()
            threading.Thread(target=_prefault_loop, args=(_jobs,), name="kvtool-prefault", daemon=True).start()
        jobs = _jobs
    job = PrefaultJob(spans, list(views))
    jobs.put(job)
    return job


@functools.cache
def _libc_calls() -> tuple[Any, Any] | None:
    """libc's `madvise` and `mincore` (ctypes, errno kept), loaded once; None where libc cannot
    be loaded (the reason goes to `_populate_unusable`)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise, mincore = libc.madvise, libc.mincore
    except (OSError, AttributeError) as exc:
        _populate_unusable.append(str(exc))
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    return madvise, mincore


def _resident(mincore: Any, addr: int, n: int) -> bool:
    """True if every page of `[addr, addr + n)` is present in RAM (`mincore(2)`: bit 0 of each
    page's byte); False if one is not, or the call fails."""
    page = mmap.PAGESIZE
    start = addr - addr % page
    vec = np.zeros(-(-(addr + n - start) // page), np.uint8)
    return mincore(start, addr + n - start, vec.ctypes.data) == 0 and bool((vec & 1).all())


def _prefault_loop(jobs: queue.SimpleQueue[PrefaultJob]) -> None:
    calls = _libc_calls()
    madvise = calls[0] if calls is not None else None
    while True:
        job = jobs.get()
        try:
            if madvise is not None and not _populate_unusable:
                _populate(madvise, job.spans)
        finally:
            job.keep = []
            job.done.set()


def _populate(madvise, spans: list[tuple[int, int]]) -> None:
    page = mmap.PAGESIZE
    for addr, n in spans:
        start = addr - addr % page
        if madvise(start, addr + n - start, _MADV_POPULATE_WRITE) != 0:
            err = ctypes.get_errno()
            _populate_unusable.append(os.strerror(err))
            log.debug("restore buffers are not prefaulted: madvise: %s", os.strerror(err))
            return


def _unfilled(total: int, n: int) -> bool:
    """Allocate `n` restore buffers of `total` bytes without a fill (`_blank_arrays`) rather than
    with `mx.zeros`: on the CPU backend, when they average `BLANK_MIN_TENSOR_BYTES` or more, or when
    MLX's buffer cache holds fewer bytes than they need (a zero fill would fault in fresh memory)."""
    return mx.default_device() == mx.cpu and (total >= BLANK_MIN_TENSOR_BYTES * n or total > mx.get_cache_memory())


_blank_unusable: list[str] = []  # why `_blank_arrays` fell back once (then it is not tried again)


def _blank_arrays(specs: list[tuple[tuple[int, ...], mx.Dtype]]) -> list[mx.array]:
    """MLX arrays of the given shapes and dtypes, allocated without a fill (contents undefined,
    one buffer each; see `_BlankStream`). `mx.load` of a Python stream evaluates them before it
    returns, calling `readinto` on its I/O threads: ~0.1 ms per tensor. Should an MLX version
    refuse the stream or return something else, this logs it once and returns `mx.zeros`."""
    if not _blank_unusable:
        try:
            loaded = mx.load(cast(BinaryIO, _BlankStream(specs)), format="safetensors")
            arrays = [loaded[f"{i:06d}"] for i in range(len(specs))] if isinstance(loaded, dict) else []
            if [(tuple(a.shape), a.dtype) for a in arrays] == [(tuple(s), d) for s, d in specs]:
                return arrays
            reason = "mx.load returned other arrays"
        except (ValueError, RuntimeError, TypeError, KeyError, OSError) as exc:
            reason = f"mx.load refused the stream: {exc}"
        _blank_unusable.append(reason)
        log.warning("restore buffers are zero-filled (unfilled allocation unusable: %s)", reason)
    return [mx.zeros(shape, dtype) for shape, dtype in specs]


@dataclass
class KVBuffers:
    """Per-layer destination buffers of a restore: `[1, H_l, capacity, D_l]` keys and values.

    Reader threads fill `views` (numpy, storage dtype) at token offsets; `caches()` then hands
    mlx-lm `KVCache`s over the same memory (CPU: zero copy) with decode room after `offset`.

    Attributes:
        arrays: MLX arrays in record order (K0, V0, K1, V1, ...).
        views: writable numpy views of `arrays` (or host staging arrays, see `_host_views`).
        staged: True if `views` are separate host arrays to copy in at `caches()`.
        fresh: False when every page is known to be in RAM already (zero-filled, or unfilled
            buffers MLX's buffer cache handed back whole): `ready()` then skips `prefault`, whose
            `mincore` check alone walks every buffer's page table (~0.1 ms per 16 MiB).
    """

    arrays: list[mx.array]
    views: list[np.ndarray]
    staged: bool = False
    kv: KVLayout | None = None
    fresh: bool = True
    # state layers: per restored entry (by token offset) host arrays of its state (small)
    state_scratch: dict[int, list[np.ndarray]] = field(default_factory=dict)
    _heads: HeadPieces | None = field(default=None, repr=False)

    @classmethod
    def allocate(cls, kv: KVLayout, capacity: int, wait: bool = True) -> KVBuffers:
        """Allocate buffers for `capacity` tokens (call on the request thread).

        On the CPU backend the buffers are allocated without a fill (`_blank_arrays`: contents
        undefined until written; a cache only reads its first `offset` tokens); elsewhere, and for
        tensors under `BLANK_MIN_TENSOR_BYTES` on average that MLX's buffer cache can recycle
        (it holds at least their bytes), they are `mx.zeros`. With `wait=False`
        their evaluation runs on MLX's stream while the caller goes on (reading segment headers);
        `ready()` waits for it and must come before `dest`, `pieces` or `place`.
        """
        dtype = NAME_TO_MX[kv.dtype]
        n_kv = len(kv.shapes(0)) - len(kv.states)
        specs = [(tuple(shape), mx.uint32 if st == np.dtype("<u4") else dtype)
                 for shape, st in list(zip(kv.shapes(capacity), kv.storage_dtypes()))[:n_kv]]
        total = sum(int(np.prod(shape)) * dt.size for shape, dt in specs)
        fresh = False  # unfilled memory that MLX's buffer cache did not hand back: prefault it
        if _unfilled(total, len(specs)):
            cached = mx.get_cache_memory()
            arrays = _blank_arrays(specs)  # evaluated: taken from the cache or allocated by now
            fresh = cached - mx.get_cache_memory() < total
        else:
            arrays = [mx.zeros(shape, dt) for shape, dt in specs]  # the fill faults every page in
        out = cls(arrays, [], kv=kv, fresh=fresh)
        if wait:
            out.ready()
        else:
            mx.async_eval(arrays)
        return out

    def ready(self) -> None:
        """Wait for the allocation and make the host views (request thread; idempotent)."""
        if self._heads is not None:
            return
        views = _host_views(self.arrays)  # evaluates the arrays (waits for an async allocation)
        if all(v is not None for v in views):
            self.views = views  # type: ignore[assignment]  # no None view: checked just above
            if self.fresh:
                prefault(self.views)
        else:
            self.views = [np.empty(a.shape, MX_TO_NP_STORAGE[a.dtype]) for a in self.arrays]
            self.staged = True
        self._heads = HeadPieces(self.views)

    def dest(self, offset: int, n: int) -> list[np.ndarray]:
        """Views `[1, H, n, D]` of every tensor at token `offset` (for `place`); with state
        layers, then fresh host arrays for the record's state (kept per entry)."""
        out = [v[:, :, offset : offset + n, :] for v in self.views]
        return out + self._state_scratch(offset)

    def pieces(self, offset: int, n: int) -> list[memoryview]:
        """Where a record of `n` tokens placed at token `offset` goes, as byte buffers in file
        order (`segment.HeadPieces`; for `restore_chain`, safe on reader threads: no MLX call)."""
        assert self._heads is not None, "ready() first"
        out = self._heads(offset, n)
        return out + [a.data.cast("B") for a in self._state_scratch(offset)]

    def place_records(self, offset: int, n: int, records: np.ndarray) -> bool:
        """Copy verified records of `n` tokens each (uint8 `[count, bytes after the token ids]`)
        to token `offset`, one copy per tensor (`segment.HeadPieces.place`; for
        `restore_chain`, safe on reader threads: no MLX call). Returns False, copying nothing,
        with state layers (a record's state goes to its entry's scratch arrays: `pieces`)."""
        assert self._heads is not None, "ready() first"
        if self.kv is not None and self.kv.states:
            return False
        self._heads.place(offset, n, records)
        return True

    def _state_scratch(self, offset: int) -> list[np.ndarray]:
        if self.kv is None or not self.kv.states:
            return []
        scratch = [np.empty(s, STORAGE_DTYPES[d]) for s, d in zip(self.kv.states, self.kv.state_dtype_names())]
        self.state_scratch[offset] = scratch
        return scratch

    def place(self, offset: int, block: Block, n: int | None = None) -> None:
        """Copy an MLX block (RAM tier) into the buffers at token `offset`; `n` > its tokens: the
        `n` tokens of its run from it on (`kvtool.kv.blocks.run_groups`: one copy per tensor
        for consecutive blocks of one run, no state layers).

        Raises:
            ValueError: `n` differs from the block's tokens and the block has no run.
        """
        n = block.num_tokens if n is None else n
        keys, values = host_arrays(block, n)
        for dst, src in zip(self.dest(offset, n), self._order(keys, values)):
            dst[...] = src.reshape(dst.shape)

    def place_host(self, offset: int, block: HostBlock) -> None:
        """Copy a host block (writer's pending buffer) into the buffers at token `offset`."""
        n = block.num_tokens
        for dst, src in zip(self.dest(offset, n), self._order(block.keys, block.values)):
            dst[...] = src

    def _order(self, keys, values) -> list:
        if self.kv is not None:
            return self.kv.interleave(keys, values)
        return [a for pair in zip(keys, values) for a in pair]

    def caches(self, offset: int, state_at: int | None = None) -> list[KVCache]:
        """mlx-lm caches over the buffers, holding `offset` tokens; drops this object's
        references so the caches own their buffers (in-place updates, no copy on decode).
        With state layers, their state is the one of the entry placed at token `state_at`; with
        state layers or cache lists the result has the model's structure (`assemble_layers`)."""
        self._heads = None  # its byte views hold the buffers too: MLX would copy instead of update in place
        if self.kv is not None and self.kv.kinds:
            state = self.state_scratch.get(state_at) if state_at is not None and self.kv.states else None
            return after_restore(assemble_layers(self.kv, self._kv_caches(offset, None), state))
        return after_restore(self._kv_caches(offset, self.kv))

    def _kv_caches(self, offset: int, kv: KVLayout | None) -> list:
        """The buffers' KV tensors as mlx-lm caches of `offset` tokens, per layer in order: a
        `QuantizedKVCache` per 6 tensors when `kv` is quantized, else a `KVCache` per keys/values
        pair (also for layouts with other kinds of layers: `assemble_layers` places them). Drops
        this object's references to the buffers."""
        arrays = self.arrays
        if self.staged:
            arrays = [to_mlx(v) for v in self.views]
            mx.eval(arrays)
        self.arrays, self.views = [], []
        out: list = []
        if kv is not None and kv.quantized:
            for layer in range(kv.n_layers):
                q = QuantizedKVCache(group_size=kv.group_size, bits=kv.bits)
                q.keys, q.values = arrays[6 * layer : 6 * layer + 3], arrays[6 * layer + 3 : 6 * layer + 6]
                q.offset = offset
                out.append(q)
            return out
        for k, v in zip(arrays[0::2], arrays[1::2]):
            c = KVCache()
            c.keys, c.values, c.offset = k, v, offset
            out.append(c)
        return out
