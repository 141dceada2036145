"""Chain hashing, layout keys, slicing a cache into blocks and rebuilding it."""

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache

from kvtool.blocks import (
    chain_hashes,
    from_host,
    layout_key,
    rebuild_cache,
    root_parent,
    slice_blocks,
    to_host,
    unsupported_cache_reason,
)

LAYOUT = layout_key("model-x", 2, 2, 8, "float32", 4)
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


def test_chain_hash_is_stable_across_processes():
    """A known value: blake2b over fixed bytes, so any process or machine computes the same."""
    h = chain_hashes([1, 2, 3, 4], 4, "0" * 32)
    import hashlib
    import struct

    parent = hashlib.blake2b(b"kvtool-root|" + b"0" * 32, digest_size=16).digest()
    expect = hashlib.blake2b(parent + struct.pack("<4i", 1, 2, 3, 4), digest_size=16).hexdigest()
    assert h == [expect]


def test_layout_key_separates_everything_that_changes_kv():
    base = dict(model_id="m", n_layers=2, n_kv_heads=2, head_dim=8, kv_dtype="float32", block_size=4)
    keys = {layout_key(**base)}
    for field, other in [("model_id", "m2"), ("n_layers", 3), ("n_kv_heads", 1), ("head_dim", 16),
                         ("kv_dtype", "bfloat16"), ("block_size", 8)]:
        keys.add(layout_key(**{**base, field: other}))
    keys.add(layout_key(**base, format_version=99))
    assert len(keys) == 8
    assert chain_hashes([1, 2, 3, 4], 4, layout_key(**base)) != chain_hashes(
        [1, 2, 3, 4], 4, layout_key(**{**base, "model_id": "m2"})
    )


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
    blocks = slice_blocks(cache, ids, hashes, LAYOUT, 0, len(hashes), bs)
    assert blocks[0].parent_hash == root_parent(LAYOUT)
    assert [b.parent_hash for b in blocks[1:]] == hashes[:-1]
    assert all(b.keys[0].shape == (1, 2, bs, 8) for b in blocks)
    # through host memory (what the SSD writer sees) and back
    blocks = [from_host(to_host(b)) for b in blocks]
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
    host = to_host(slice_blocks(cache, ids, hashes, LAYOUT, 1, 2, 4)[0])
    assert host.dtype == "bfloat16" and host.keys[0].dtype == np.uint16
    assert isinstance(host.values[0], np.ndarray)
    assert host.token_ids.tolist() == [4, 5, 6, 7]


def test_unsupported_cache_types_are_named():
    assert unsupported_cache_reason([KVCache(), KVCache()]) is None
    assert "RotatingKVCache" in unsupported_cache_reason([KVCache(), RotatingKVCache(max_size=8)])
    assert "QuantizedKVCache" in unsupported_cache_reason([QuantizedKVCache()])
    assert unsupported_cache_reason([]) is not None
