"""Tests of kvtool.disk.segment: the segment file format (format 2, real safetensors bytes).

A segment holds several block records; each record is verified alone (xxh3-128), and the header
checksum covers the tensor table and the metadata, so a same-length header edit (two records'
offsets swapped, a slot's hash changed) is caught before any record is used.
"""

from __future__ import annotations

import json
import os
import struct

import numpy as np
import pytest
import safetensors
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from kvtool.disk import segment as seg
from kvtool.disk.hostblock import HostBlock
from kvtool.disk.segment import BlockFileError, KVLayout
from tests.store_helpers import (
    assert_same_block,
    encode_segment,
    kv_layout,
    make_block,
    make_chain,
    make_layout,
    random_kv,
)

H = "ab" * 16
P = "cd" * 16
DTYPES = ["float32", "float16", "bfloat16"]


# ----------------------------------------------------------------------------- helpers
def write(tmp_path, data: bytes, name: str = "seg.safetensors"):
    path = tmp_path / name
    path.write_bytes(data)
    return path


def read_all(path, layout: str, kv: KVLayout) -> list[HostBlock]:
    """Open a segment file, verify its header against the namespace, read every record."""
    fd = os.open(path, os.O_RDONLY)
    try:
        header = seg.read_header(fd, os.fstat(fd).st_size)
        seg.check_header(header, layout, kv)
        return [seg.read_block(fd, s, header.kv) for s in header.slots]
    finally:
        os.close(fd)


def header_of(data: bytes) -> tuple[int, dict]:
    (n,) = struct.unpack_from("<Q", data)
    return n, json.loads(data[8 : 8 + n])


def parse(data: bytes) -> seg.SegmentHeader:
    return seg.parse_header(data, len(data))


def chain_segment(dtype="float16", n_tokens=10, **kw):
    """A segment of a chain of 4-token blocks plus the tail entry (n_tokens % 4 tokens)."""
    layout = make_layout(dtype)
    blocks = make_chain(layout, np.arange(100, 100 + n_tokens), dtype, seed=3, tail=True)
    return blocks, layout, encode_segment(blocks, layout, dtype, created=12.5, **kw)


# ----------------------------------------------------------------------------- round trips
@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_of_several_blocks_is_bit_exact(tmp_path, dtype):
    blocks, layout, data = chain_segment(dtype, n_tokens=14)
    assert [b.num_tokens for b in blocks] == [4, 4, 4, 2]  # three blocks + a tail entry
    out = read_all(write(tmp_path, data), layout, kv_layout(dtype))
    assert len(out) == len(blocks)
    for a, b in zip(out, blocks):
        assert_same_block(a, b)
    header = parse(data)
    assert header.meta["created"] == "12.5" and header.layout_key == layout
    assert header.meta["format_version"] == "2" and header.meta["checksum_algo"] == "xxh3-128"
    assert header.file_size == len(data) and header.kv == kv_layout(dtype)
    assert [(s.index, s.block_hash, s.parent_hash, s.n_tokens) for s in header.slots] == [
        (i, b.block_hash, b.parent_hash, b.num_tokens) for i, b in enumerate(blocks)
    ]


def test_encode_returns_slots_matching_the_file_and_zero_copy_buffers():
    blocks = make_chain(make_layout("float32"), np.arange(8), "float32", tail=False)
    buffers, slots = seg.encode(blocks, make_layout("float32"), kv_layout("float32"), 0.0)
    data = b"".join(bytes(b) for b in buffers)
    header = parse(data)
    assert tuple(slots) == header.slots
    assert slots[1].offset == slots[0].offset + slots[0].nbytes
    assert slots[0].nbytes == kv_layout("float32").record_nbytes(4)
    # the KV buffers are views of the blocks' arrays (no serialisation copy)
    assert any(np.shares_memory(np.frombuffer(b, np.uint8), blocks[0].keys[0]) for b in buffers[1:])


def test_tail_record_only_segment(tmp_path):
    layout = make_layout("bfloat16")
    tail = make_chain(layout, np.arange(3), tail=True)  # 3 tokens < block size 4: only a tail entry
    assert len(tail) == 1 and tail[0].num_tokens == 3
    data = encode_segment(tail, layout, "bfloat16")
    (out,) = read_all(write(tmp_path, data), layout, kv_layout("bfloat16"))
    assert_same_block(out, tail[0])
    assert parse(data).slots[0].nbytes == kv_layout("bfloat16").record_nbytes(3)


@settings(max_examples=25, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    layers=st.lists(st.tuples(st.integers(1, 3), st.integers(1, 5), st.integers(1, 5)), min_size=1, max_size=3),
    lengths=st.lists(st.integers(1, 6), min_size=1, max_size=4),
    seed=st.integers(0, 2**32 - 1),
)
def test_round_trip_property(dtype, layers, lengths, seed):
    """Per-layer shapes may differ (keys and values too, as in MLA); records of any length."""
    kv = KVLayout(tuple(layers), dtype)
    rng = np.random.default_rng(seed)
    blocks = []
    for i, n in enumerate(lengths):
        ids = rng.integers(-(2**31), 2**31 - 1, size=n, dtype=np.int32)
        keys = [random_kv(rng, dtype, (1, h, n, dk)) for h, dk, _ in layers]
        values = [random_kv(rng, dtype, (1, h, n, dv)) for h, _, dv in layers]
        blocks.append(HostBlock(f"{i:032x}", f"{i + 100:032x}", ids, keys, values, dtype))
    buffers, _ = seg.encode(blocks, "f" * 32, kv, 0.0)
    data = b"".join(bytes(b) for b in buffers)
    fd = os.memfd_create("seg")  # no tmp_path in a hypothesis test: an anonymous file
    try:
        os.write(fd, data)
        header = seg.read_header(fd, len(data))
        seg.check_header(header, "f" * 32, kv)
        for slot, b in zip(header.slots, blocks):
            assert_same_block(seg.read_block(fd, slot, kv), b)
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------- safetensors
def test_segment_is_a_real_safetensors_file(tmp_path):
    blocks, layout, data = chain_segment("bfloat16", n_tokens=9)
    path = write(tmp_path, data)
    with safe_open(str(path), framework="numpy") as f:
        assert sorted(f.keys()) == ["b0", "b1", "b2"]
        meta = f.metadata()
        for i, b in enumerate(blocks):
            rec = f.get_tensor(f"b{i}")
            assert rec.dtype == np.uint8
            expect = b.token_ids.astype("<i4").tobytes() + b"".join(
                a.tobytes() for pair in zip(b.keys, b.values) for a in pair
            )
            assert rec.tobytes() == expect  # record = token ids, then K0, V0, K1, V1, ...
            h, parent, n, ck = meta[f"b{i}"].split(":")
            assert (h, parent, int(n)) == (b.block_hash, b.parent_hash, b.num_tokens)
            assert len(ck) == 32
    assert meta["layout_key"] == layout and meta["layers"] == kv_layout("bfloat16").spec
    assert meta["n_blocks"] == "3" and meta["dtype"] == "bfloat16"
    tensors = dict(safetensors.deserialize(data))
    assert tensors["b2"]["dtype"] == "U8" and tensors["b2"]["shape"] == [kv_layout("bfloat16").record_nbytes(1)]
    assert (8 + header_of(data)[0]) % 8 == 0  # records start 8-byte aligned


# ----------------------------------------------------------------------------- damage
@pytest.fixture
def good():
    blocks, layout, data = chain_segment("float16", n_tokens=8)  # two equal-size records, no tail
    assert len(blocks) == 2
    return blocks, layout, bytearray(data)


def kind_of(data, layout=None, kv=None, tmp_path=None) -> str:
    """The BlockFileError kind a full read of `data` raises ('' if it reads fine)."""
    try:
        header = parse(bytes(data))
        seg.check_header(header, layout or make_layout("float16"), kv or kv_layout("float16"))
        fd = os.memfd_create("seg")
        try:
            os.write(fd, bytes(data))
            for s in header.slots:
                seg.read_block(fd, s, header.kv)
        finally:
            os.close(fd)
    except BlockFileError as exc:
        return exc.kind
    return ""


def test_good_fixture_reads(good):
    _, layout, data = good
    assert kind_of(data, layout) == ""


@pytest.mark.parametrize("cut", [0, 5, 8, 40, -1, -100, -600])
def test_truncated_file_is_rejected(good, cut):
    _, layout, data = good
    assert kind_of(data[:cut], layout) in ("truncated", "header")


@pytest.mark.parametrize("cut", [-1, -100])
def test_truncation_is_truncated_not_header(good, cut):
    _, layout, data = good
    assert kind_of(data[:cut], layout) == "truncated"


def test_trailing_garbage_is_rejected(good):
    _, layout, data = good
    assert kind_of(data + b"x", layout) == "truncated"


def test_file_shrunk_after_its_header_was_read_is_truncated(tmp_path, good):
    """The header promised more bytes than a record read finds (file cut concurrently)."""
    _, layout, data = good
    path = write(tmp_path, bytes(data))
    fd = os.open(path, os.O_RDONLY)
    try:
        header = seg.read_header(fd, len(data))
        os.truncate(path, header.slots[1].offset + 10)
        seg.read_block(fd, header.slots[0], header.kv)  # the first record is intact
        with pytest.raises(BlockFileError) as ei:
            seg.read_block(fd, header.slots[1], header.kv)
        assert ei.value.kind == "truncated"
    finally:
        os.close(fd)


def test_unparseable_header_is_rejected(good):
    _, layout, data = good
    data[10] = ord("#")  # JSON now invalid
    assert kind_of(data, layout) == "header"


def test_absurd_header_length_is_rejected(good):
    _, layout, data = good
    struct.pack_into("<Q", data, 0, 1 << 40)
    assert kind_of(data, layout) == "header"


def _swap(data: bytearray, a: bytes, b: bytes) -> bytearray:
    """Swap the first occurrences of `a` and `b` (a same-length edit of the whole file)."""
    n = header_of(bytes(data))[0]
    head = bytes(data[8 : 8 + n])
    i, j = head.index(a), head.index(b)
    assert i < j and head.count(a) == 1 and head.count(b) == 1
    new = head[:i] + b + head[i + len(a) : j] + a + head[j + len(b) :]
    assert len(new) == len(head)
    return bytearray(data[:8] + new + data[8 + n :])


def test_same_length_edit_swapping_two_records_offsets_is_header(good):
    """A header edit that swaps where two records live; the header checksum must catch it."""
    _, layout, data = good
    _, doc = header_of(bytes(data))
    off0 = json.dumps(doc["b0"]["data_offsets"], separators=(",", ":")).encode()
    off1 = json.dumps(doc["b1"]["data_offsets"], separators=(",", ":")).encode()
    swapped = _swap(data, b'"data_offsets":' + off0, b'"data_offsets":' + off1)
    assert len(swapped) == len(data) and swapped != data
    assert kind_of(swapped, layout) == "header"
    with pytest.raises(BlockFileError, match="checksum"):  # refused by the header checksum itself
        parse(bytes(swapped))


def test_same_length_edit_swapping_two_slots_metadata_is_header(good):
    """Slot 0 claiming block 1's hash, parent and checksum (and vice versa): caught by the header
    checksum, whatever the records hold."""
    blocks, layout, data = good
    meta = header_of(bytes(data))[1]["__metadata__"]
    swapped = _swap(data, meta["b0"].encode(), meta["b1"].encode())
    assert kind_of(swapped, layout) == "header"
    # the same swap with the records swapped too is still refused: it is not what was written
    n = 8 + header_of(bytes(data))[0]
    size = (len(data) - n) // 2
    both = swapped[:n] + data[n + size :] + data[n : n + size]
    assert kind_of(both, layout) == "header"


@pytest.mark.parametrize("field", ["created", "layout_key", "layers", "n_blocks_digit", "b1_tokens"])
def test_any_same_length_metadata_edit_is_header(good, field):
    blocks, layout, data = good
    meta = header_of(bytes(data))[1]["__metadata__"]
    old = {
        "created": b'"created":"12.5"',
        "layout_key": f'"layout_key":"{layout}"'.encode(),
        "layers": f'"layers":"{meta["layers"]}"'.encode(),
        "n_blocks_digit": b'"n_blocks":"2"',
        "b1_tokens": f':{blocks[1].parent_hash}:4:'.encode(),
    }[field]
    new = {
        "created": b'"created":"13.5"',
        "layout_key": f'"layout_key":"{"0" * 32}"'.encode(),
        "layers": old.replace(b"2x8x8", b"1x8x8", 1),
        "n_blocks_digit": b'"n_blocks":"1"',
        "b1_tokens": f':{blocks[1].parent_hash}:3:'.encode(),
    }[field]
    assert len(old) == len(new) and old != new and bytes(data).count(old) == 1
    edited = bytearray(bytes(data).replace(old, new))
    assert kind_of(edited, layout) == "header"


def test_header_checksum_value_edit_is_header(good):
    _, layout, data = good
    meta = header_of(bytes(data))[1]["__metadata__"]
    ck = meta["header_checksum"].encode()
    bad = ck[:-1] + (b"0" if ck[-1:] != b"0" else b"1")
    assert kind_of(bytearray(bytes(data).replace(ck, bad)), layout) == "header"


@pytest.mark.parametrize("where", ["first", "middle", "last"])
@pytest.mark.parametrize("record", [0, 1])
def test_record_byte_flip_is_checksum_of_that_record_only(good, where, record):
    blocks, layout, data = good
    header = parse(bytes(data))
    s = header.slots[record]
    pos = {"first": s.offset, "middle": s.offset + s.nbytes // 2, "last": s.offset + s.nbytes - 1}[where]
    data[pos] ^= 0x01
    fd = os.memfd_create("seg")
    try:
        os.write(fd, bytes(data))
        header = seg.read_header(fd, len(data))  # the header is intact
        for other in header.slots:
            if other.index == record:
                with pytest.raises(BlockFileError) as ei:
                    seg.read_block(fd, other, header.kv)
                assert ei.value.kind == "checksum"
            else:
                assert_same_block(seg.read_block(fd, other, header.kv), blocks[other.index])
    finally:
        os.close(fd)


def test_token_id_byte_flip_is_checksum(good):
    """Token ids are part of the record: a flipped id is caught by the checksum too."""
    _, layout, data = good
    data[parse(bytes(data)).slots[0].offset] ^= 0x02
    assert kind_of(data, layout) == "checksum"


def test_other_namespace_segment_is_layout(good):
    _, _, data = good
    assert kind_of(data, layout="f" * 32) == "layout"


@pytest.mark.parametrize(
    "kv",
    [
        KVLayout.uniform(3, 2, 8, "float16"),  # more layers
        KVLayout.uniform(2, 4, 8, "float16"),  # more heads
        KVLayout.uniform(2, 2, 4, "float16"),  # other head_dim
        KVLayout(((2, 8, 4), (2, 8, 4)), "float16"),  # other value dim (MLA-like)
        KVLayout.uniform(2, 2, 8, "bfloat16"),  # other dtype
    ],
    ids=["layers", "heads", "head_dim", "v_dim", "dtype"],
)
def test_other_kv_layout_is_shape(good, kv):
    _, layout, data = good
    assert kind_of(data, layout, kv) == "shape"


def test_unknown_format_version_is_version():
    layout = make_layout("float32")
    data = encode_segment(make_chain(layout, np.arange(4), "float32"), layout, "float32")
    patched = data.replace(b'"format_version":"2"', b'"format_version":"9"')
    assert patched != data
    assert kind_of(patched, layout, kv_layout("float32")) == "version"
    foreign = data.replace(b'"format":"kvtool-segment"', b'"format":"kvtool-sEgment"')
    assert kind_of(foreign, layout, kv_layout("float32")) == "version"


def test_encode_rejects_inconsistent_block():
    block = make_block(H, P, [1, 2, 3, 4], "float32")
    block.values[1] = block.values[1][:, :, :2]
    with pytest.raises(BlockFileError) as ei:
        seg.encode([block], make_layout("float32"), kv_layout("float32"), 0.0)
    assert ei.value.kind == "shape"
    other_dtype = make_block(H, P, [1, 2, 3, 4], "float16")
    with pytest.raises(BlockFileError) as ei:
        seg.encode([other_dtype], make_layout("float32"), kv_layout("float32"), 0.0)
    assert ei.value.kind == "shape"
    with pytest.raises(ValueError):
        seg.encode([], make_layout("float32"), kv_layout("float32"), 0.0)


def test_destination_of_the_wrong_size_is_slot(good):
    blocks, _, data = good
    header = parse(bytes(data))
    fd = os.memfd_create("seg")
    try:
        os.write(fd, bytes(data))
        s = header.slots[0]
        dest = [np.empty(shape, np.float16) for shape in header.kv.shapes(s.n_tokens - 1)]
        with pytest.raises(BlockFileError) as ei:
            seg.read_record(fd, s, np.empty(s.n_tokens, np.int32), dest)
        assert ei.value.kind == "slot"
    finally:
        os.close(fd)


def test_large_header_needs_a_second_read(tmp_path):
    """A header over the first 64 KiB read (hundreds of slots) is read in full."""
    layout = make_layout("float16")
    blocks = make_chain(layout, np.arange(4 * 700), "float16")
    data = encode_segment(blocks, layout, "float16")
    assert header_of(data)[0] > 64 << 10
    out = read_all(write(tmp_path, data), layout, kv_layout("float16"))
    assert len(out) == 700
    assert_same_block(out[-1], blocks[-1])


# ----------------------------------------------------------------------------- scatter reads
def test_read_record_scatters_into_a_strided_destination(tmp_path):
    """Records land in a cache-shaped buffer [1, H, T, D] at their token offsets, one preadv each;
    nothing outside their slices is written."""
    dtype = "float32"
    layout = make_layout(dtype)
    blocks = make_chain(layout, np.arange(14), dtype, seed=5, tail=True)  # 4+4+4+2 tokens
    path = write(tmp_path, encode_segment(blocks, layout, dtype))
    kv = kv_layout(dtype)
    cap = 20  # capacity beyond the prompt (decode room), filled with a sentinel
    bufs = [np.full((1, h, cap, d), -7.0, np.float32) for h, dk, dv in kv.layers for d in (dk, dv)]
    tokens = np.full(cap, -1, np.int32)
    fd = os.open(path, os.O_RDONLY)
    try:
        header = seg.read_header(fd, os.fstat(fd).st_size)
        off = 0
        for s in header.slots:
            dest = [b[:, :, off : off + s.n_tokens, :] for b in bufs]
            assert not dest[0].flags.c_contiguous  # strided: heads are apart
            seg.read_record(fd, s, tokens[off : off + s.n_tokens], dest)
            off += s.n_tokens
    finally:
        os.close(fd)
    assert np.array_equal(tokens[:14], np.arange(14)) and (tokens[14:] == -1).all()
    for layer in range(kv.n_layers):
        k = np.concatenate([b.keys[layer] for b in blocks], axis=2)
        v = np.concatenate([b.values[layer] for b in blocks], axis=2)
        assert bufs[2 * layer][:, :, :14].tobytes() == k.tobytes()
        assert bufs[2 * layer + 1][:, :, :14].tobytes() == v.tobytes()
        assert (bufs[2 * layer][:, :, 14:] == -7.0).all() and (bufs[2 * layer + 1][:, :, 14:] == -7.0).all()


def test_read_record_checks_what_landed_in_the_destination(tmp_path):
    """A corrupt record is reported after the scatter: the checksum covers the bytes read."""
    layout = make_layout("float16")
    blocks = make_chain(layout, np.arange(4), "float16")
    data = bytearray(encode_segment(blocks, layout, "float16"))
    data[-1] ^= 0x10
    path = write(tmp_path, bytes(data))
    fd = os.open(path, os.O_RDONLY)
    try:
        header = seg.read_header(fd, len(data))
        s = header.slots[0]
        dest = [np.zeros(shape, np.float16) for shape in header.kv.shapes(s.n_tokens)]
        with pytest.raises(BlockFileError) as ei:
            seg.read_record(fd, s, np.empty(s.n_tokens, np.int32), dest)
        assert ei.value.kind == "checksum"
    finally:
        os.close(fd)


class ShortReads:
    """`os.preadv` that returns at most a few bytes per call (like a slow network file system)."""

    def __init__(self, sizes):
        self.sizes = list(sizes)
        self.calls = 0
        self.real = os.preadv

    def __call__(self, fd, buffers, offset):
        limit = self.sizes[self.calls % len(self.sizes)]
        self.calls += 1
        cut, left = [], limit
        for b in buffers:
            m = memoryview(b).cast("B")
            if left <= 0:
                break
            cut.append(m[:left])
            left -= len(cut[-1])
        return self.real(fd, cut, offset)


@pytest.mark.parametrize("sizes", [[1], [3, 17, 1000], [7, 64]], ids=["byte-by-byte", "mixed", "odd"])
def test_short_reads_are_resumed(tmp_path, monkeypatch, sizes):
    layout = make_layout("bfloat16")
    blocks = make_chain(layout, np.arange(6), "bfloat16", tail=True)
    path = write(tmp_path, encode_segment(blocks, layout, "bfloat16"))
    fd = os.open(path, os.O_RDONLY)
    try:
        header = seg.read_header(fd, os.fstat(fd).st_size)
        short = ShortReads(sizes)
        monkeypatch.setattr(seg.os, "preadv", short)
        out = [seg.read_block(fd, s, header.kv) for s in header.slots]
        monkeypatch.undo()
    finally:
        os.close(fd)
    assert short.calls > len(header.slots)  # it really was resumed
    for a, b in zip(out, blocks):
        assert_same_block(a, b)


def test_short_reads_across_the_iov_limit(tmp_path, monkeypatch):
    """A record with more pieces than IOV_MAX (1024) is read in several preadv batches; a short
    read inside a batch resumes mid-buffer."""
    kv = KVLayout.uniform(300, 2, 1, "float32")  # 1 + 300 * 2 * 2 = 1201 pieces per record
    rng = np.random.default_rng(1)
    ids = np.arange(3, dtype=np.int32)
    block = HostBlock(
        H, P, ids,
        [random_kv(rng, "float32", (1, 2, 3, 1)) for _ in range(300)],
        [random_kv(rng, "float32", (1, 2, 3, 1)) for _ in range(300)],
        "float32",
    )  # fmt: skip
    buffers, _ = seg.encode([block], "e" * 32, kv, 0.0)
    path = write(tmp_path, b"".join(bytes(b) for b in buffers))
    fd = os.open(path, os.O_RDONLY)
    try:
        header = seg.read_header(fd, os.fstat(fd).st_size)
        assert_same_block(seg.read_block(fd, header.slots[0], kv), block)
        short = ShortReads([4090, 5, 13])
        monkeypatch.setattr(seg.os, "preadv", short)
        got = seg.read_block(fd, header.slots[0], kv)
        monkeypatch.undo()
    finally:
        os.close(fd)
    assert short.calls >= 3
    assert_same_block(got, block)


def test_read_past_end_of_file_is_truncated_not_a_hang(tmp_path, monkeypatch):
    layout = make_layout("bfloat16")
    blocks = make_chain(layout, np.arange(4), "bfloat16")
    path = write(tmp_path, encode_segment(blocks, layout, "bfloat16"))
    fd = os.open(path, os.O_RDONLY)
    try:
        header = seg.read_header(fd, os.fstat(fd).st_size)
        monkeypatch.setattr(seg.os, "preadv", lambda fd, bufs, off: 0)  # EOF at once
        with pytest.raises(BlockFileError) as ei:
            seg.read_block(fd, header.slots[0], header.kv)
        assert ei.value.kind == "truncated"
    finally:
        os.close(fd)


def test_tokens_digest_is_xxh3_of_int32_le():
    import xxhash

    ids = np.array([1, -2, 3], dtype=np.int64)
    assert seg.tokens_digest(ids) == xxhash.xxh3_128_hexdigest(np.array([1, -2, 3], "<i4").tobytes())
    assert len(seg.tokens_digest(ids)) == 32


def test_kv_layout_spec_round_trip_and_validation():
    kv = KVLayout(((2, 64, 64), (4, 192, 128)), "bfloat16")
    assert kv.spec == "2x64x64,4x192x128" and KVLayout.parse(kv.spec, "bfloat16") == kv
    assert kv.token_nbytes() == (2 * 128 + 4 * 320) * 2 and kv.record_nbytes(3) == 3 * (4 + kv.token_nbytes())
    with pytest.raises(ValueError):
        KVLayout(((2, 0, 4),), "float32")
    with pytest.raises(ValueError):
        KVLayout(((2, 4, 4),), "int8")
    with pytest.raises(ValueError):
        KVLayout.parse("2x4", "float32")


# ----------------------------------------------------------------------------- HeadPieces
def test_head_pieces_are_each_heads_rows_in_file_order():
    """`HeadPieces(arrays)(offset, n)`: per tensor, per head, the bytes of rows offset..offset+n,
    writable views of the arrays (a preadv into them places a record)."""
    rng = np.random.default_rng(0)
    arrays = [rng.random((1, h, 10, d)).astype(np.float32) for h, d in ((2, 3), (2, 3), (1, 5))]
    pieces = seg.HeadPieces(arrays)(4, 3)
    want = [a[0, h, 4:7].tobytes() for a in arrays for h in range(a.shape[1])]
    assert [bytes(p) for p in pieces] == want
    pieces[0][:] = bytes(len(pieces[0]))  # writes land in the array
    assert not arrays[0][0, 0, 4:7].any() and arrays[0][0, 0, 3].all() and arrays[0][0, 0, 7].all()
    sliced = seg.HeadPieces([a[:, :, 2:9, :] for a in arrays])(2, 3)  # a T-slice: offsets relative to it
    assert [bytes(p) for p in sliced] == [a[0, h, 4:7].tobytes() for a in arrays for h in range(a.shape[1])]


@pytest.mark.parametrize("bad", [np.zeros((2, 2, 4, 3), np.float32), np.zeros((1, 2, 4), np.float32),
                                 np.zeros((1, 2, 4, 6), np.float32)[..., ::2]])
def test_head_pieces_refuse_what_a_record_cannot_scatter_into(bad):
    with pytest.raises(ValueError):
        seg.HeadPieces([bad])
    ro = np.zeros((1, 2, 4, 3), np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError):
        seg.HeadPieces([ro])



def test_head_pieces_place_equals_copying_into_the_pieces():
    """`HeadPieces.place(offset, n, records)`: records (bytes after their token ids, in file
    order) land where `__call__`'s pieces would take them, record after record; nothing else is
    written; a destination too short or records of another size are refused."""
    rng = np.random.default_rng(5)
    shapes = [(1, 2, 20, 4), (1, 2, 20, 6), (1, 3, 20, 2), (1, 3, 20, 2)]
    n, count, offset = 3, 4, 5
    width = sum(s[1] * n * s[3] * 2 for s in shapes)
    records = rng.integers(0, 256, (count, width), dtype=np.uint8)
    by_place = [np.zeros(s, np.float16) for s in shapes]
    by_pieces = [np.zeros(s, np.float16) for s in shapes]
    seg.HeadPieces(by_place).place(offset, n, records)
    pieces = seg.HeadPieces(by_pieces)
    for k in range(count):
        at = 0
        for m in pieces(offset + k * n, n):
            m[:] = records[k, at : at + m.nbytes].tobytes()
            at += m.nbytes
    assert all(a.tobytes() == b.tobytes() for a, b in zip(by_place, by_pieces))
    assert all((a[:, :, : offset] == 0).all() and (a[:, :, offset + count * n :] == 0).all() for a in by_place)
    with pytest.raises(ValueError):
        seg.HeadPieces(by_place).place(18, n, records)
    with pytest.raises(ValueError):
        seg.HeadPieces(by_place).place(0, n, records[:, :-2])
