"""Destination buffers of an SSD restore: per-layer MLX arrays with decode room, and the host
views reader threads fill (`KVBuffers`).

The buffers are allocated once per restore, spread over one MLX CPU stream per core and
evaluated asynchronously (`KVBuffers.allocate(wait=False)`), so the page faults and zero fill run
on every core while the request thread checks segment headers; `ready()` waits for them and makes
writable numpy views of their memory (CPU backend: zero copy; elsewhere numpy staging copied in
once). `caches()` hands them to mlx-lm caches, which then own them (in-place decode, no copy).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from kvtool.blocks import _MX_TO_NP_STORAGE, _NAME_TO_MX, Block, _to_mlx, _to_numpy, assemble_layers
from kvtool.hostblock import HostBlock
from kvtool.store.segment import STORAGE_DTYPES, HeadPieces, KVLayout

__all__ = ["KVBuffers", "MAX_ALLOC_STREAMS"]


def _host_view(a: mx.array) -> np.ndarray | None:
    """A writable numpy view of an evaluated MLX array's memory, or None where MLX does not
    share it with the host (then the restore stages in numpy and copies once)."""
    storage = _MX_TO_NP_STORAGE[a.dtype]
    src = a.view(mx.uint16) if a.dtype == mx.bfloat16 else a
    mx.eval(src)
    try:
        view = np.asarray(src)
    except (TypeError, ValueError, RuntimeError):
        return None
    if view.dtype != storage or not view.flags.writeable or view.shape != tuple(a.shape):
        return None
    return view


_ALLOC_STREAMS: list = []
MAX_ALLOC_STREAMS = 4


def _alloc_streams() -> list:
    """Streams that allocate restore buffers. On the CPU backend, one per core (up to
    `MAX_ALLOC_STREAMS`): each CPU stream has its own thread, so the page faults and zero fill of
    a large allocation (a fresh process's largest restore cost) run on every core, as `mx.load`
    spreads its reads. Measured, 400 MB in 96 arrays in a fresh process on 2 cores: 240 ms on one
    stream, 135 ms on two (docs/DESIGN.md, "Where a restore's time goes"). Elsewhere: the default
    stream. Created once, on the first (request) thread that allocates."""
    if not _ALLOC_STREAMS:
        if mx.default_device() == mx.cpu:
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
            n = max(1, min(MAX_ALLOC_STREAMS, cores))
            _ALLOC_STREAMS.extend(mx.new_stream(mx.cpu) for _ in range(n))
        else:
            _ALLOC_STREAMS.append(mx.default_stream(mx.default_device()))
    return _ALLOC_STREAMS


@dataclass
class KVBuffers:
    """Per-layer destination buffers of a restore: `[1, H_l, capacity, D_l]` keys and values.

    Reader threads fill `views` (numpy, storage dtype) at token offsets; `caches()` then hands
    mlx-lm `KVCache`s over the same memory (CPU: zero copy) with decode room after `offset`.

    Attributes:
        arrays: MLX arrays in record order (K0, V0, K1, V1, ...).
        views: writable numpy views of `arrays` (or host staging arrays, see `_host_view`).
        staged: True if `views` are separate host arrays to copy in at `caches()`.
    """

    arrays: list[mx.array]
    views: list[np.ndarray]
    staged: bool = False
    kv: KVLayout | None = None
    # state layers: per restored entry (by token offset) host arrays of its state (small)
    state_scratch: dict[int, list[np.ndarray]] = field(default_factory=dict)
    _heads: HeadPieces | None = field(default=None, repr=False)

    @classmethod
    def allocate(cls, kv: KVLayout, capacity: int, wait: bool = True) -> KVBuffers:
        """Allocate buffers for `capacity` tokens (call on the request thread).

        With `wait=False` the allocation (page faults and MLX's zero fill, the largest fixed
        cost of a restore) runs on MLX's stream while the caller goes on (reading segment
        headers); `ready()` waits for it and must come before `dest`, `pieces` or `place`.
        """
        dtype = _NAME_TO_MX[kv.dtype]
        n_kv = len(kv.shapes(0)) - len(kv.states)
        streams = _alloc_streams()
        arrays = [mx.zeros(shape, mx.uint32 if st == np.dtype("<u4") else dtype, stream=streams[i % len(streams)])
                  for i, (shape, st) in enumerate(list(zip(kv.shapes(capacity), kv.storage_dtypes()))[:n_kv])]
        out = cls(arrays, [], kv=kv)
        if wait:
            out.ready()
        else:
            mx.async_eval(arrays)
        return out

    def ready(self) -> None:
        """Wait for the allocation and make the host views (request thread; idempotent)."""
        if self._heads is not None:
            return
        mx.eval(self.arrays)
        views = [_host_view(a) for a in self.arrays]
        if all(v is not None for v in views):
            self.views = views  # type: ignore[assignment]  # no None view: checked just above
        else:
            self.views = [np.empty(a.shape, _MX_TO_NP_STORAGE[a.dtype]) for a in self.arrays]
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

    def _state_scratch(self, offset: int) -> list[np.ndarray]:
        if self.kv is None or not self.kv.states:
            return []
        storage = STORAGE_DTYPES[self.kv.dtype]
        scratch = [np.empty(s, storage) for s in self.kv.states]
        self.state_scratch[offset] = scratch
        return scratch

    def place(self, offset: int, block: Block) -> None:
        """Copy an MLX block (RAM tier) into the buffers at token `offset`."""
        n = block.num_tokens
        for dst, src in zip(self.dest(offset, n), self._order(block.keys, block.values)):
            dst[...] = _to_numpy(src).reshape(dst.shape)

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
        With state layers, their state is the one of the entry placed at token `state_at`."""
        self._heads = None  # its byte views hold the buffers too: MLX would copy instead of update in place
        if self.kv is not None and self.kv.states:
            state = self.state_scratch.get(state_at) if state_at is not None else None
            plain = KVBuffers(self.arrays, self.views, self.staged, None)
            self.arrays, self.views = [], []
            return assemble_layers(self.kv, plain.caches(offset), state)
        arrays = self.arrays
        if self.staged:
            arrays = [_to_mlx(v, "bfloat16" if a.dtype == mx.bfloat16 else "") for v, a in zip(self.views, arrays)]
            mx.eval(arrays)
        self.arrays, self.views = [], []
        out: list = []
        if self.kv is not None and self.kv.quantized:
            for layer in range(self.kv.n_layers):
                q = QuantizedKVCache(group_size=self.kv.group_size, bits=self.kv.bits)
                q.keys, q.values = arrays[6 * layer : 6 * layer + 3], arrays[6 * layer + 3 : 6 * layer + 6]
                q.offset = offset
                out.append(q)
            return out
        for k, v in zip(arrays[0::2], arrays[1::2]):
            c = KVCache()
            c.keys, c.values, c.offset = k, v, offset
            out.append(c)
        return out
