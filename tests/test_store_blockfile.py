"""Tests of kvtool.store.blockfile: the block file format (real safetensors bytes)."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import safetensors
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.store_helpers import assert_same_block, make_block, make_layout

from kvtool.store import blockfile
from kvtool.store.blockfile import BlockFileError, Expected

H = "ab" * 16
P = "cd" * 16


def expected_for(dtype: str, layout: str | None = None, **kw) -> Expected:
    g = dict(n_layers=2, n_kv_heads=2, head_dim=8, block_size=4)
    g.update(kw)
    return Expected(layout or make_layout(dtype), dtype=dtype, block_hash=H, **g)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_round_trip_is_bit_exact(dtype):
    layout = make_layout(dtype)
    block = make_block(H, P, [1, 2, 3, 4], dtype, seed=7)
    data = blockfile.encode(block, layout, created=1234.5)
    out, meta = blockfile.verify(bytearray(data), expected_for(dtype), np.array([1, 2, 3, 4]))
    assert_same_block(out, block)
    assert meta["created"] == "1234.5" and meta["layout_key"] == layout and meta["format_version"] == "1"
    assert out.keys[0].flags.writeable  # views of a bytearray: usable without another copy


def test_file_is_real_safetensors_with_design_metadata():
    block = make_block(H, P, [5, 6, 7, 8], "bfloat16")
    data = blockfile.encode(block, make_layout("bfloat16"), created=1.0)
    tensors = dict(safetensors.deserialize(data))
    assert tensors["token_ids"]["dtype"] == "I32" and tensors["token_ids"]["shape"] == [4]
    assert tensors["layers.1.values"]["dtype"] == "BF16" and tensors["layers.1.values"]["shape"] == [1, 2, 4, 8]
    assert bytes(tensors["layers.1.values"]["data"]) == block.values[1].tobytes()
    (n,) = struct.unpack_from("<Q", data)
    meta = json.loads(data[8 : 8 + n])["__metadata__"]
    assert set(meta) == set(blockfile.REQUIRED_META)
    assert meta["checksum"] == blockfile.data_checksum(data[8 + n :])
    assert (meta["block_hash"], meta["parent_hash"], meta["num_tokens"], meta["n_layers"]) == (H, P, "4", "2")


@settings(max_examples=25, deadline=None)
@given(
    dtype=st.sampled_from(["float32", "float16", "bfloat16"]),
    n_layers=st.integers(1, 3),
    heads=st.integers(1, 3),
    block_size=st.integers(1, 6),
    head_dim=st.integers(1, 5),
    seed=st.integers(0, 2**32 - 1),
)
def test_round_trip_property(dtype, n_layers, heads, block_size, head_dim, seed):
    rng = np.random.default_rng(seed)
    ids = rng.integers(-(2**31), 2**31 - 1, size=block_size, dtype=np.int32)
    block = make_block(H, P, ids, dtype, seed, n_layers=n_layers, n_kv_heads=heads, head_dim=head_dim)
    exp = Expected("l" * 32, n_layers, heads, head_dim, block_size, dtype, H)
    out, _ = blockfile.verify(blockfile.encode(block, "l" * 32, 0.0), exp, ids)
    assert_same_block(out, block)


@pytest.fixture
def good():
    block = make_block(H, P, [1, 2, 3, 4], "float16")
    return bytearray(blockfile.encode(block, make_layout("float16"), 0.0)), expected_for("float16")


def header_len(data) -> int:
    return 8 + struct.unpack_from("<Q", data)[0]


@pytest.mark.parametrize("cut", [0, 5, 8, 40, -1, -100])
def test_truncated_file_is_rejected(good, cut):
    data, exp = good
    with pytest.raises(BlockFileError) as ei:
        blockfile.decode(data[:cut], exp)
    assert ei.value.kind in ("truncated", "header")


def test_trailing_garbage_is_rejected(good):
    data, exp = good
    with pytest.raises(BlockFileError) as ei:
        blockfile.decode(data + b"x", exp)
    assert ei.value.kind == "truncated"


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_flipped_data_byte_fails_checksum(good, where):
    data, exp = good
    start = header_len(data)
    pos = {"first": start, "middle": (start + len(data)) // 2, "last": len(data) - 1}[where]
    data[pos] ^= 0x01
    with pytest.raises(BlockFileError) as ei:
        blockfile.decode(data, exp)
    assert ei.value.kind == "checksum"
    blockfile.decode(data, exp, verify_checksum=False)  # structure still fine: only the checksum sees it


def test_flipped_header_byte_is_rejected(good):
    data, exp = good
    data[10] = ord("#")  # JSON now invalid
    with pytest.raises(BlockFileError) as ei:
        blockfile.decode(data, exp)
    assert ei.value.kind == "header"


def test_other_namespace_block_is_rejected(good):
    data, _ = good
    with pytest.raises(BlockFileError) as ei:
        blockfile.decode(data, expected_for("float16", layout="f" * 32))
    assert ei.value.kind == "layout"


def test_wrong_hash_is_rejected(good):
    data, exp = good
    with pytest.raises(BlockFileError) as ei:
        blockfile.decode(data, Expected(**{**exp.__dict__, "block_hash": "0" * 32}))
    assert ei.value.kind == "hash"


@pytest.mark.parametrize("change", [dict(n_layers=3), dict(n_kv_heads=4), dict(head_dim=4), dict(block_size=8)])
def test_geometry_mismatch_is_shape_error(good, change):
    data, exp = good
    with pytest.raises(BlockFileError) as ei:
        blockfile.decode(data, Expected(**{**exp.__dict__, **change}))
    assert ei.value.kind == "shape"


def test_dtype_mismatch_is_shape_error(good):
    data, exp = good
    with pytest.raises(BlockFileError) as ei:
        blockfile.decode(data, Expected(**{**exp.__dict__, "dtype": "bfloat16"}))
    assert ei.value.kind == "shape"


def test_unknown_format_version_is_rejected():
    block = make_block(H, P, [1, 2, 3, 4], "float32")
    data = blockfile.encode(block, make_layout("float32"), 0.0)
    patched = data.replace(b'"format_version":"1"', b'"format_version":"9"')
    assert patched != data
    with pytest.raises(BlockFileError) as ei:
        blockfile.decode(patched, expected_for("float32"))
    assert ei.value.kind == "version"


def test_token_mismatch_is_reported_as_tokens(good):
    data, exp = good
    with pytest.raises(BlockFileError) as ei:
        blockfile.verify(data, exp, np.array([1, 2, 3, 5], dtype=np.int32))
    assert ei.value.kind == "tokens"


def test_encode_rejects_inconsistent_block():
    block = make_block(H, P, [1, 2, 3, 4], "float32")
    block.values[1] = block.values[1][:, :, :2]
    with pytest.raises(BlockFileError) as ei:
        blockfile.encode(block, make_layout("float32"), 0.0)
    assert ei.value.kind == "shape"


def test_header_only_check_matches_full_decode(good):
    data, exp = good
    header = blockfile.read_header(data[: header_len(data)], file_size=len(data))
    blockfile.check_header(header, exp)
    assert header.file_size == len(data)
    with pytest.raises(BlockFileError):
        blockfile.read_header(data[: header_len(data)], file_size=len(data) - 1)
