"""Chain hashing, layout keys, slicing a cache into blocks and rebuilding it."""

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache

from kvtool.disk.segment import KVLayout
from kvtool.kv import buffers as kvbuffers
from kvtool.kv.blocks import (
    Block,
    cache_capacity,
    chain_hashes,
    from_host,
    layout_key,
    rebuild_cache,
    root_parent,
    run_groups,
    tail_hash,
    to_host_many,
)
from kvtool.kv.buffers import KVBuffers, _blank_arrays
from kvtool.kv.cut import patch_last_token, promote_slices, slice_blocks
from kvtool.kv.tree import kv_layout_of, unsupported_cache_reason

LAYOUT = layout_key("model-x", "2x8x8,2x8x8", "float32", 4, format_version=2)
token_lists = st.lists(st.integers(min_value=0, max_value=2**31 - 1), min_size=0, max_size=64)


@given(token_lists, st.integers(min_value=1, max_value=9))
def test_chain_hash_counts_full_blocks_only(ids, bs):
    hashes = chain_hashes(ids, bs, LAYOUT)
    assert len(hashes) == len(ids) // bs
    assert all(len(h) == 32 for h in hashes)


@given(token_lists, token_lists)
def test_chain_hash_is_prefix_property(a, b):
    """Block i's hash depends on exactly the tokens [0, (i+1)*bs): equal prefixes, equal hashes."""
    bs = 4
    ha, hb = chain_hashes(a, bs, LAYOUT), chain_hashes(b, bs, LAYOUT)
    for i in range(min(len(ha), len(hb))):
        same_prefix = a[: (i + 1) * bs] == b[: (i + 1) * bs]
        assert (ha[i] == hb[i]) == same_prefix


@given(token_lists, st.integers(min_value=1, max_value=9))
def test_chain_hash_fast_path_equals_blake2b_chain_per_block(ids, bs):
    """`chain_hashes` with the default hash (one byte string, no per-block conversion) gives the
    digests `blake2b_chain` gives block by block."""
    from kvtool.hashing import blake2b_chain

    assert chain_hashes(ids, bs, LAYOUT) == chain_hashes(ids, bs, LAYOUT, hash_fn=lambda p, t: blake2b_chain(p, t))


def test_chain_hash_is_stable_across_processes():
    """A known value: blake2b over fixed bytes, so any process or machine computes the same."""
    h = chain_hashes([1, 2, 3, 4], 4, "0" * 32)
    import hashlib
    import struct

    parent = hashlib.blake2b(b"kvtool-root|" + b"0" * 32, digest_size=16).digest()
    expect = hashlib.blake2b(parent + struct.pack("<4i", 1, 2, 3, 4), digest_size=16).hexdigest()
    assert h == [expect]


def test_layout_key_separates_everything_that_changes_kv():
    base = dict(model_id="m", kv_spec="2x8x8,2x8x8", kv_dtype="float32", block_size=4, format_version=2)
    keys = {layout_key(**base)}
    changes = [("model_id", "m2"), ("kv_spec", "2x8x8"), ("kv_spec", "2x8x8,1x8x8"), ("kv_spec", "2x8x4,2x8x4"),
               ("kv_dtype", "bfloat16"), ("block_size", 8), ("format_version", 99), ("model_class", "x.Model"),
               ("versions", "mlx=0.0.1"), ("extra", "kv_bits=8")]
    for field, other in changes:
        keys.add(layout_key(**{**base, field: other}))
    assert len(keys) == len(changes) + 1
    assert chain_hashes([1, 2, 3, 4], 4, layout_key(**base)) != chain_hashes(
        [1, 2, 3, 4], 4, layout_key(**{**base, "model_id": "m2"})
    )


def spans(hashes, bs):
    parents = [root_parent(LAYOUT), *hashes[:-1]]
    return [(h, p, i * bs, (i + 1) * bs) for i, (h, p) in enumerate(zip(hashes, parents))]


def _filled_cache(n_layers, T, dtype):
    cache = [KVCache() for _ in range(n_layers)]
    for li, c in enumerate(cache):
        k = mx.random.normal((1, 2, T, 8), key=mx.random.key(li)).astype(dtype)
        v = mx.random.normal((1, 2, T, 8), key=mx.random.key(100 + li)).astype(dtype)
        c.update_and_fetch(k, v)  # buffer padded to a 256-step, offset = T
    return cache


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_slice_and_rebuild_round_trip_bit_exact(dtype):
    T, bs = 21, 4
    cache = _filled_cache(2, T, dtype)
    ids = np.arange(T, dtype=np.int32)
    hashes = chain_hashes(ids, bs, LAYOUT)
    blocks = slice_blocks(cache, ids, spans(hashes, bs))
    assert blocks[0].parent_hash == root_parent(LAYOUT)
    assert [b.parent_hash for b in blocks[1:]] == hashes[:-1]
    assert all(b.keys[0].shape == (1, 2, bs, 8) for b in blocks)
    # through host memory (what the SSD writer sees) and back
    blocks = [from_host(h) for h in to_host_many(blocks)]
    rebuilt = rebuild_cache(blocks, 2)
    n = len(hashes) * bs
    for c, r in zip(cache, rebuilt):
        assert r.offset == n
        assert mx.array_equal(c.keys[..., :n, :], r.keys).item()
        assert mx.array_equal(c.values[..., :n, :], r.values).item()
        assert r.keys.dtype == dtype


def test_to_host_holds_no_mlx_and_bf16_as_uint16():
    cache = _filled_cache(1, 8, mx.bfloat16)
    ids = np.arange(8, dtype=np.int32)
    hashes = chain_hashes(ids, 4, LAYOUT)
    (host,) = to_host_many(slice_blocks(cache, ids, spans(hashes, 4)[1:2]))
    assert host.dtype == "bfloat16" and host.keys[0].dtype == np.uint16
    assert isinstance(host.values[0], np.ndarray)
    assert host.token_ids.tolist() == [4, 5, 6, 7]


def test_unsupported_cache_types_are_named():
    assert unsupported_cache_reason([KVCache(), KVCache()]) is None
    assert "RotatingKVCache" in unsupported_cache_reason([KVCache(), RotatingKVCache(max_size=8)])
    assert "QuantizedKVCache" in unsupported_cache_reason([QuantizedKVCache()])
    assert unsupported_cache_reason([]) is not None


@given(token_lists, st.integers(min_value=1, max_value=9))
def test_tail_hash_exists_iff_partial_block_and_differs_from_blocks(ids, bs):
    full = chain_hashes(ids, bs, LAYOUT)
    tail = tail_hash(ids, bs, LAYOUT, full)
    assert (tail is None) == (len(ids) % bs == 0)
    if tail is not None:
        assert tail not in full
        longer = chain_hashes(ids + [1] * bs, bs, LAYOUT)
        assert tail not in longer  # a tail never stands in for a full block


def test_tail_hash_changes_with_last_token():
    ids = list(range(10))
    full = chain_hashes(ids, 4, LAYOUT)
    other = ids[:-1] + [99]
    assert tail_hash(ids, 4, LAYOUT, full) != tail_hash(other, 4, LAYOUT, chain_hashes(other, 4, LAYOUT))


def test_cache_capacity_leaves_decode_room_on_the_256_step():
    assert cache_capacity(1) == 256 and cache_capacity(255) == 256
    assert cache_capacity(256) == 512 and cache_capacity(1000) == 1024


@pytest.mark.parametrize("blank", [True, False], ids=["unfilled", "zeros"])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_kv_buffers_are_mlx_memory_and_decode_in_place(dtype, blank, monkeypatch):
    """Restored bytes land in the caches' own buffers; an update within the room copies nothing
    (buffers allocated without a fill, as for large restores, or zero-filled, as for small)."""
    monkeypatch.setattr(kvbuffers, "_unfilled", lambda total, n: blank)
    T = 21
    cache = _filled_cache(2, T, dtype)
    kv = kv_layout_of(cache)
    assert kv == KVLayout.uniform(2, 2, 8, "bfloat16" if dtype == mx.bfloat16 else "float32")
    buf = KVBuffers.allocate(kv, cache_capacity(T))
    (host,) = to_host_many(slice_blocks(cache, np.arange(T, dtype=np.int32), [("a" * 32, "b" * 32, 0, T)]))
    buf.place_host(0, host)
    assert not buf.staged  # CPU: numpy views of MLX memory
    out = buf.caches(T)
    for c, r in zip(cache, out):
        assert r.offset == T and r.keys.shape[2] == cache_capacity(T)
        assert mx.array_equal(c.keys[..., :T, :], r.keys_and_values()[0]).item()
        assert mx.array_equal(c.values[..., :T, :], r.keys_and_values()[1]).item()
    before = np.asarray(out[0].keys.view(mx.uint16) if dtype == mx.bfloat16 else out[0].keys).ctypes.data
    k = mx.ones((1, 2, 1, 8), dtype)
    mx.eval(out[0].update_and_fetch(k, k))
    after = np.asarray(out[0].keys.view(mx.uint16) if dtype == mx.bfloat16 else out[0].keys).ctypes.data
    assert before == after  # no reallocation, no copy


def test_small_buffers_are_zero_filled_only_where_mlx_recycles_their_bytes():
    """Many small tensors: `mx.zeros` when MLX's buffer cache holds their bytes (a memset of
    recycled memory), unfilled when it does not (a fill would fault in fresh pages); large
    tensors: unfilled either way."""
    specs = [((1, 2, 256, 64), mx.float32)] * 4  # 128 KiB each
    total = 4 * 2 * 256 * 64 * 4
    mx.clear_cache()
    assert kvbuffers._unfilled(total, 4)
    arrays = [mx.zeros(shape, dtype) for shape, dtype in specs]
    mx.eval(arrays)
    del arrays  # their buffers go to MLX's cache
    assert mx.get_cache_memory() >= total and not kvbuffers._unfilled(total, 4)
    assert kvbuffers._unfilled(4 * kvbuffers.BLANK_MIN_TENSOR_BYTES, 4)


def test_only_fresh_unfilled_buffers_are_prefaulted(monkeypatch):
    """`ready()` prefaults unfilled buffers that MLX's buffer cache did not hand back; recycled
    ones (their pages present) and zero-filled ones (the fill faulted them in) are left alone."""
    calls: list[int] = []
    monkeypatch.setattr(kvbuffers, "prefault", lambda views: calls.append(len(views)))
    kv = KVLayout.uniform(2, 2, 8, "float32")
    monkeypatch.setattr(kvbuffers, "_unfilled", lambda total, n: True)
    mx.clear_cache()
    first = KVBuffers.allocate(kv, 512)  # nothing cached: fresh memory
    assert first.fresh and calls == [4]
    del first  # its four buffers go to MLX's cache
    again = KVBuffers.allocate(kv, 512)  # the same shapes: handed back whole
    assert not again.fresh and calls == [4]
    monkeypatch.setattr(kvbuffers, "_unfilled", lambda total, n: False)
    zeros = KVBuffers.allocate(kv, 256)
    assert not zeros.fresh and calls == [4]
    assert all(v is not None for v in (again.views + zeros.views))


def test_unfilled_arrays_have_their_shapes_dtypes_and_own_buffers():
    specs = [((1, 2, 300, 8), mx.float32), ((1, 2, 300, 4), mx.bfloat16), ((1, 2, 300, 2), mx.uint32)] * 2
    arrays = _blank_arrays(specs)
    assert [(tuple(a.shape), a.dtype) for a in arrays] == specs
    views = kvbuffers._host_views(arrays)
    assert all(v is not None for v in views)
    starts = sorted(v.ctypes.data for v in views)
    ends = sorted(v.ctypes.data + v.nbytes for v in views)
    assert all(e <= s for e, s in zip(ends, starts[1:]))  # no two arrays share memory
    for k, v in enumerate(views):
        v[...] = k
    for k, a in enumerate(arrays):
        assert mx.all(a.view(mx.uint16) == k if a.dtype == mx.bfloat16 else a == k).item()


def test_prefault_keeps_contents_and_faults_pages_in(monkeypatch):
    """`prefault` populates fresh buffers on a thread: what readers wrote before or while it runs
    stays; on Linux >= 5.14 every page is resident afterwards (/proc/self/pagemap's present bit;
    the memory is a fresh anonymous mapping, so none of it was before the first write)."""
    import mmap
    import sys

    monkeypatch.setattr(kvbuffers, "_populate_unusable", [])
    maps = [mmap.mmap(-1, 16 << 20) for _ in range(2)]  # fresh, untouched pages
    views = [np.frombuffer(m, dtype=np.float32).reshape(1, 4, 16384, 64) for m in maps]
    views[0][0, 0, :8, :] = 7.0  # a reader's write before the prefault
    thread = kvbuffers.prefault(views)
    if sys.platform != "linux":
        assert thread is None
        return
    assert thread is not None
    views[1][0, 3, -8:, :] = 5.0  # and one while it runs
    thread.join(30)
    assert not thread.is_alive()
    assert (views[0][0, 0, :8, :] == 7.0).all() and (views[1][0, 3, -8:, :] == 5.0).all()
    assert (views[0][0, 1:] == 0).all() and (views[1][0, :3] == 0).all()  # nothing else written
    if kvbuffers._populate_unusable:  # a kernel without MADV_POPULATE_WRITE: a no-op, said once
        assert kvbuffers.prefault(views) is None
        return
    assert all(_resident_fraction(v) == 1.0 for v in views)
    fresh = mmap.mmap(-1, 4 << 20)  # the instrument: an untouched mapping is not resident
    assert _resident_fraction(np.frombuffer(fresh, dtype=np.uint8)) < 0.5


def test_prefault_leaves_out_buffers_whose_pages_are_all_present(monkeypatch):
    """Recycled memory (every page written before) is not queued; a buffer with one page never
    touched is, whole."""
    import mmap
    import sys

    if sys.platform != "linux":
        pytest.skip("prefault is Linux-only")
    monkeypatch.setattr(kvbuffers, "_populate_unusable", [])
    maps = [mmap.mmap(-1, 4 << 20) for _ in range(2)]
    views = [np.frombuffer(m, dtype=np.float32).reshape(1, 2, 16384, 32) for m in maps]
    views[0][...] = 1.0  # every page present
    views[1][0, 0] = 1.0  # the second head's pages untouched
    job = kvbuffers.prefault(views)  # Linux: libc's madvise and mincore load
    assert job is not None
    assert job.spans == [(views[1].ctypes.data, views[1].nbytes)]
    job.join(30)
    assert _resident_fraction(views[1]) == 1.0
    assert kvbuffers.prefault(views) is None  # now both are present
    assert (views[0] == 1.0).all() and (views[1][0, 0] == 1.0).all() and (views[1][0, 1] == 0).all()


def _resident_fraction(a: np.ndarray) -> float:
    """Fraction of `a`'s pages present in RAM (/proc/self/pagemap: bit 63 of each entry)."""
    import mmap

    first, last = a.ctypes.data // mmap.PAGESIZE, (a.ctypes.data + a.nbytes - 1) // mmap.PAGESIZE
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        entries = np.frombuffer(f.read((last - first + 1) * 8), dtype=np.uint64)
    return float(((entries >> np.uint64(63)) & np.uint64(1)).mean())


def test_unfilled_allocation_that_mlx_refuses_falls_back_to_zeros(monkeypatch, caplog):
    """An MLX that refuses the blank stream (or returns other arrays) costs a zero fill, once
    logged, never a failed restore."""
    monkeypatch.setattr(kvbuffers, "_blank_unusable", [])

    def refuse(*_a, **_k):
        raise ValueError("no file-like objects here")

    monkeypatch.setattr(kvbuffers.mx, "load", refuse)
    specs = [((1, 2, 40, 8), mx.float32)] * 3
    for _ in range(2):
        arrays = _blank_arrays(specs)
        assert [(tuple(a.shape), a.dtype) for a in arrays] == specs
        assert all(mx.all(a == 0).item() for a in arrays)
    assert len(kvbuffers._blank_unusable) == 1 and "refused" in kvbuffers._blank_unusable[0]
    assert sum("zero-filled" in r.message for r in caplog.records) == 1


def test_promote_slices_share_the_cache_buffers():
    cache = _filled_cache(2, 12, mx.float32)
    blocks = promote_slices(cache, [("a" * 32, "b" * 32, np.arange(4, 8, dtype=np.int32), 4)])
    assert mx.array_equal(blocks[0].keys[1], cache[1].keys[..., 4:8, :]).item()
    assert blocks[0].token_ids.tolist() == [4, 5, 6, 7]


def test_rebuild_cache_with_capacity_keeps_room():
    cache = _filled_cache(1, 8, mx.float32)
    ids = np.arange(8, dtype=np.int32)
    blocks = slice_blocks(cache, ids, spans(chain_hashes(ids, 4, LAYOUT), 4))
    (r,) = rebuild_cache(blocks, 1, capacity=256)
    assert r.offset == 8 and r.keys.shape[2] == 256
    assert mx.array_equal(r.keys_and_values()[0], cache[0].keys[..., :8, :]).item()


def test_blocks_of_one_run_rebuild_from_one_view_and_bit_exact():
    """Consecutive blocks viewing adjacent tokens of one copy (one `slice_blocks` run, or
    `promote_slices` of one cache) rebuild from one view per layer; a gap between runs, a block of
    its own arrays and a block whose last token was patched each start a new piece. The rebuilt
    cache equals the source cache in every case."""
    T, bs = 24, 4
    cache = _filled_cache(2, T, mx.float32)
    ids = np.arange(T, dtype=np.int32)
    sp = spans(chain_hashes(ids, bs, LAYOUT), bs)
    first = slice_blocks(cache, ids, sp[:3])  # tokens 0-11: one run
    second = slice_blocks(cache, ids, sp[3:5])  # tokens 12-19: another run
    own = from_host(to_host_many(slice_blocks(cache, ids, sp[5:]))[0])  # tokens 20-23: arrays of its own
    promoted = promote_slices(cache, [(h, p, ids[lo:hi], lo) for h, p, lo, hi in sp[:4]])
    cases = {
        "one run": (first, [12]),
        "two runs and a block of its own": (first + second + [own], [12, 8, 4]),
        "promoted from one cache": (promoted, [16]),
    }
    for name, (blocks, want) in cases.items():
        assert [n for _, _, n in run_groups(blocks)] == want, name
        n = sum(want)
        for c, r in zip(cache, rebuild_cache(blocks, 2, capacity=256)):
            assert r.offset == n and r.keys.shape[2] == 256, name
            assert mx.array_equal(r.keys[..., :n, :], c.keys[..., :n, :]).item(), name
            assert mx.array_equal(r.values[..., :n, :], c.values[..., :n, :]).item(), name
    # a patched block holds new arrays: it leaves the run, and its new KV is what is rebuilt
    last_k = mx.full((1, 2, 1, 8), 7.0)
    patch_last_token(first, sp[:3], 8, [(0, last_k, last_k), (1, last_k, last_k)])
    assert [n for _, _, n in run_groups(first)] == [4, 4, 4]
    r = rebuild_cache(first, 2)[0]
    assert mx.array_equal(r.keys[..., 7:8, :], last_k).item()
    assert mx.array_equal(r.keys[..., 8:12, :], cache[0].keys[..., 8:12, :]).item()


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_host_copy_of_a_run_block_equals_the_block_s_own(dtype):
    """`to_host_many` converts a run group once per tensor and slices it per block; the bytes equal
    those of each block's own arrays (as the writer saw them before), for cut and promoted blocks."""
    T, bs = 20, 4
    cache = _filled_cache(2, T, dtype)
    ids = np.arange(T, dtype=np.int32)
    sp = spans(chain_hashes(ids, bs, LAYOUT), bs)
    cut = slice_blocks(cache, ids, sp)
    promoted = promote_slices(cache, [(h, p, ids[lo:hi], lo) for h, p, lo, hi in sp])
    for blocks in (cut, promoted):
        assert all(b.run is not None for b in blocks) and len(run_groups(blocks)) == 1
        singles = [Block(b.block_hash, b.parent_hash, b.token_ids, b.keys, b.values) for b in blocks]
        for via_run, own in zip(to_host_many(blocks), to_host_many(singles), strict=True):
            assert via_run.dtype == own.dtype and via_run.token_ids.tolist() == own.token_ids.tolist()
            assert (via_run.block_hash, via_run.parent_hash) == (own.block_hash, own.parent_hash)
            for x, y in zip(via_run.keys + via_run.values, own.keys + own.values):
                assert x.shape == y.shape == (1, 2, bs, 8) and x.dtype == y.dtype
                assert np.array_equal(x, y)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_blocks_of_runs_placed_into_restore_buffers_one_copy_per_group(dtype):
    """A RAM hit placed into restore buffers (beside SSD blocks) copies each run group whole
    (`KVBuffers.place(offset, first, n)`); the buffers then hold exactly the source cache's KV.
    A group's `n` on a block without a run is refused."""
    T, bs = 24, 4
    cache = _filled_cache(2, T, dtype)
    ids = np.arange(T, dtype=np.int32)
    sp = spans(chain_hashes(ids, bs, LAYOUT), bs)
    blocks = slice_blocks(cache, ids, sp[:3]) + promote_slices(cache, [(h, p, ids[lo:hi], lo) for h, p, lo, hi in sp[3:]])
    assert [(i, k, n) for i, k, n in run_groups(blocks)] == [(0, 3, 12), (3, 3, 12)]
    buf = KVBuffers.allocate(kv_layout_of(cache), cache_capacity(T))
    buf.ready()
    for i, _, n in run_groups(blocks):
        buf.place(i * bs, blocks[i], n)
    for c, r in zip(cache, buf.caches(T)):
        assert mx.array_equal(c.keys[..., :T, :], r.keys_and_values()[0]).item()
        assert mx.array_equal(c.values[..., :T, :], r.keys_and_values()[1]).item()
    own = Block(blocks[0].block_hash, blocks[0].parent_hash, blocks[0].token_ids, blocks[0].keys, blocks[0].values)
    with pytest.raises(ValueError, match="has no run"):
        KVBuffers.allocate(kv_layout_of(cache), cache_capacity(T)).place(0, own, 8)


@pytest.mark.parametrize("source", ["plain", "quantized"])
def test_quantized_blocks_of_one_run_equal_blocks_quantized_one_by_one(source):
    """In a quantized layout a run is quantized (or sliced from a `QuantizedKVCache`) once per
    layer: every block's packed words, scales and biases equal those of the block quantized
    alone (`mx.quantize` works per token and group), and the rebuilt cache (one view per run
    and tensor) equals the one rebuilt from per-block arrays."""
    T, bs, D = 24, 4, 64
    kv = KVLayout.uniform(2, 2, D, "float32", bits=8, group_size=64)
    cache = [KVCache() for _ in range(2)]
    for li, c in enumerate(cache):
        k = mx.random.normal((1, 2, T, D), key=mx.random.key(li))
        c.update_and_fetch(k, -k)
    if source == "quantized":
        cache = [c.to_quantized(group_size=64, bits=8) for c in cache]
    ids = np.arange(T, dtype=np.int32)
    sp = spans(chain_hashes(ids, bs, LAYOUT), bs)
    blocks = slice_blocks(cache, ids, sp, kv)
    assert len(run_groups(blocks)) == 1 and len(blocks[0].keys) == 6  # 3 tensors per layer
    alone = [slice_blocks(cache, ids, [s], kv)[0] for s in sp]
    for b, a in zip(blocks, alone):
        for x, y in zip(b.keys + b.values, a.keys + a.values):
            assert x.shape == y.shape and mx.array_equal(x, y).item()
    if source == "quantized":  # a hit's blocks entering RAM: views of the cache, one run
        promoted = promote_slices(cache, [(h, p, ids[lo:hi], lo) for h, p, lo, hi in sp], kv)
        assert len(run_groups(promoted)) == 1
        for b, a in zip(promoted, alone):
            assert all(mx.array_equal(x, y).item() for x, y in zip(b.keys + b.values, a.keys + a.values))
    singles = [Block(b.block_hash, b.parent_hash, b.token_ids, b.keys, b.values) for b in blocks]
    for r, s in zip(rebuild_cache(blocks, 2, cache_capacity(T), kv=kv), rebuild_cache(singles, 2, cache_capacity(T), kv=kv)):
        assert r.offset == s.offset == T
        for x, y in zip([*r.keys, *r.values], [*s.keys, *s.values]):
            assert mx.array_equal(x, y).item()
