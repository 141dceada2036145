"""The remote tier's value decoding without a server: the canonical-header fast path
(`remote_value._decode_canonical`, byte comparison against `segment_template`) must decide every
value exactly as the general parse (`segment.parse_header`) does."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from kvtool.disk import segment, segment_template
from kvtool.tiers import remote_value as rv
from tests.redis_servers import make_chain, same_block


def _outcome(fn):
    """`('block', block)`, `('error', kind)` or `('none', None)` of one decode."""
    try:
        got = fn()
    except rv.RemoteValueError as exc:
        return "error", exc.kind
    return ("none", None) if got is None else ("block", got)


def _general(monkeypatch, chain, data, i=0):
    with monkeypatch.context() as m:
        m.setattr(rv, "_decode_canonical", lambda *a: None)
        return _outcome(lambda: rv.decode_value(data, chain.layout_key, chain.kv, "none", chain.hashes[i], chain.parents[i],
                                                expected_tokens=chain.tokens[i]))  # fmt: skip


def _fast(chain, data, i=0):
    return _outcome(lambda: rv._decode_canonical(memoryview(data).cast("B"), chain.layout_key, chain.kv, chain.hashes[i],
                                                 chain.parents[i], chain.tokens[i]))  # fmt: skip


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("created", [0.5, 1732460000.123456, 12345.0, 1e-7])
def test_canonical_values_take_the_fast_path_and_decode_as_the_general_one(monkeypatch, dtype, created):
    chain = make_chain(2, dtype=dtype, block_size=16, n_layers=3, seed=3)
    for i, block in enumerate(chain.blocks):
        value = rv.encode_value(block, chain.layout_key, chain.kv, created=created)
        kind, fast = _fast(chain, value, i)
        assert kind == "block", "a value as encode_value writes it takes the fast path"
        kind, general = _general(monkeypatch, chain, value, i)
        assert kind == "block" and same_block(fast, general) and same_block(fast, block)


def test_every_mutation_is_decided_as_the_general_parse_decides(monkeypatch):
    chain = make_chain(2, dtype="bfloat16", block_size=8, seed=11)
    good = rv.encode_value(chain.blocks[0], chain.layout_key, chain.kv, created=1764000000.25)
    hlen = struct.unpack_from("<Q", good)[0]
    rng = np.random.default_rng(1)
    fast_errors = 0
    for i in range(600):
        data = bytearray(good)
        if i % 5 == 0:
            data = data[: rng.integers(0, len(data))]
        else:  # half the flips in the header, where the fast path compares bytes
            top = 8 + hlen if i % 2 else len(data)
            for _ in range(rng.integers(1, 3)):
                data[rng.integers(0, top)] = int(rng.integers(0, 256))
        fast = _fast(chain, bytes(data))
        general = _general(monkeypatch, chain, bytes(data))
        if fast[0] == "block":  # (a flip to the same byte)
            assert general[0] == "block" and same_block(fast[1], general[1])
        elif fast[0] == "error":
            fast_errors += 1
            assert general == fast, "the fast path raises only where the general parse raises the same"
    assert fast_errors > 100  # record flips: the fast path's own checksum verdicts were exercised


def test_other_headers_go_the_general_way(monkeypatch):
    chain = make_chain(1, dtype="float32", block_size=8, seed=12)
    good = rv.encode_value(chain.blocks[0], chain.layout_key, chain.kv)
    hlen = struct.unpack_from("<Q", good)[0]
    doc = json.loads(good[8 : 8 + hlen])
    meta = doc.pop("__metadata__")
    header = json.dumps({**doc, "__metadata__": meta}, separators=(",", ":")).encode()  # valid, other key order
    header = segment._seal_header(header + b" " * (-(8 + len(header)) % 8))
    other = struct.pack("<Q", len(header)) + header + good[8 + hlen :]
    assert _fast(chain, other) == ("none", None)
    kind, block = _general(monkeypatch, chain, other)
    assert kind == "block" and same_block(block, chain.blocks[0])
    assert rv.decode_value(other, chain.layout_key, chain.kv, "none", chain.hashes[0], chain.parents[0],
                           expected_tokens=chain.tokens[0]) is not None  # fmt: skip
    # another chain's value, another layout's: never a block by the fast path
    two = make_chain(2, dtype="float32", block_size=8, seed=13)
    assert _fast(chain, rv.encode_value(two.blocks[1], chain.layout_key, chain.kv))[0] == "none"
    assert _fast(chain, rv.encode_value(chain.blocks[0], "other-namespace", chain.kv))[0] == "none"


def test_template_positions_match_what_encode_writes():
    chain = make_chain(1, dtype="float32", block_size=8, seed=14)
    value = rv.encode_value(chain.blocks[0], chain.layout_key, chain.kv, created=1732460000.5)
    span = segment_template.created_span(value, 4096)
    assert span is not None and value[span[0] : span[1]] == b"1732460000.5"
    t = segment_template.template(chain.layout_key, chain.kv, (8,), span[1] - span[0])
    assert t is not None and t.file_size == len(value)
    header = segment.parse_header(value, len(value))
    h, p, c = (value[8 + int(i[0]) : 8 + int(i[-1]) + 1].decode() for i in t.hex_idx[0])
    slot = header.slots[0]
    assert (h, p, c) == (slot.block_hash, slot.parent_hash, slot.checksum)
    assert t.records[0] == slice(slot.offset, slot.offset + slot.nbytes)
