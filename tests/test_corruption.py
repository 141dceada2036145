"""Damaged SSD entries are misses plus clean-up, with unchanged output (issues 2 and 8).

Each case: a first engine writes the prompt's entries in two segments (blocks 0-1 from a first
request for the prompt's first two blocks, then blocks 2-4 and the tail entry from the full
prompt); the files are damaged on disk; a new engine (empty RAM tier, like a restarted process)
serves the same prompt. The chain must be cut exactly at the damaged block (block 2, the first of
the second segment, or the middle of it), the bad entry removed (a record: its row; a segment
header or size: the whole segment), the matching counter raised, and the generated tokens equal
to mlx-lm's uncached greedy output.
"""

from __future__ import annotations

import json
import os
import shutil
import struct

import numpy as np
import pytest

from kvtool.config import KVToolConfig
from kvtool.disk.names import segment_relpath
from kvtool.disk.verify import header_digest
from kvtool.engine import Engine
from kvtool.kv import buffers as kvbuffers
from kvtool.kv.blocks import chain_hashes
from kvtool.ops.validate import validate
from tests.store_helpers import contains, read_segment_header, record_span
from tests.test_engine import BS, MAX_TOKENS, reference_tokens

DAMAGED = 2  # index of the damaged block (of 5 full blocks + a tail entry)
FIRST_SEGMENT = 2  # blocks in the first segment


@pytest.fixture(scope="module")
def prompt(tiny_model):
    text = open("kvtool/assets/demo_prompt.txt", encoding="utf-8").read()
    return tiny_model.tokenizer.encode(text)[: 5 * BS + 7]


@pytest.fixture(scope="module")
def reference(tiny_model, prompt):
    return reference_tokens(tiny_model.model, tiny_model.tokenizer, prompt)


def _config(tmp_path, **kw):
    # evict_only + a large RAM budget: the damaged run writes nothing back, so clean-up shows
    return KVToolConfig(ssd_cache_dir=tmp_path / "kv", block_size=BS, ssd_async_writes=False, **kw)


class Populated:
    """What `_populate` wrote: the namespace, the chain hashes and each block's segment file."""

    def __init__(self, ns, hashes, index):
        self.ns = ns
        self.hashes = hashes
        self.index = index

    def path(self, i: int):
        """The segment file holding block i (from the index)."""
        return self.ns / segment_relpath(self.index[self.hashes[i]])


def _segment_of(ns, h: str) -> str:
    import sqlite3

    with sqlite3.connect(f"file:{ns / 'index.sqlite'}?mode=ro", uri=True) as con:
        return con.execute("SELECT segment FROM blocks WHERE hash=?", (h,)).fetchone()[0]


def _populate(tiny_model, prompt, tmp_path, **kw) -> Populated:
    eng = Engine(tiny_model, _config(tmp_path, **kw))
    eng.generate(prompt[: FIRST_SEGMENT * BS], max_tokens=1)  # segment 1: blocks 0-1
    eng.generate(prompt, max_tokens=1)  # segment 2: blocks 2-4 + the tail entry
    ns = eng.namespace_dir
    layout = eng.layout_key
    assert eng.close().shutdown_clean
    hashes = chain_hashes(np.asarray(prompt), BS, layout)
    segs = {h: _segment_of(ns, h) for h in hashes}
    assert len(set(segs.values())) == 2 and segs[hashes[0]] == segs[hashes[1]] != segs[hashes[2]]
    assert len(read_segment_header(ns / segment_relpath(segs[hashes[2]])).slots) == 4  # 3 blocks + tail
    return Populated(ns, hashes, segs)


def _serve_after_damage(tiny_model, prompt, tmp_path):
    eng = Engine(tiny_model, _config(tmp_path, ssd_policy="evict_only"))
    res = eng.generate(prompt, max_tokens=MAX_TOKENS)
    stats = eng.stats()
    index = eng.tiered.ssd.index
    return eng, res, stats, index


# --------------------------------------------------------------------------- damage kinds
def _flip_record(pop: Populated, k: int):
    """One bit of block k's record (its KV bytes); the segment's other records stay intact."""
    path = pop.path(k)
    off, n = record_span(path, pop.hashes[k])
    data = bytearray(path.read_bytes())
    data[off + n - 100] ^= 0xFF
    path.write_bytes(bytes(data))


def _flip_token_id(pop: Populated, k: int):
    path = pop.path(k)
    off, _ = record_span(path, pop.hashes[k])
    data = bytearray(path.read_bytes())
    data[off] ^= 0x01
    path.write_bytes(bytes(data))


def _swap_records(pop: Populated, k: int):
    """Records k and k+1 swapped in the file (same size; header untouched)."""
    path = pop.path(k)
    (a, n), (b, m) = record_span(path, pop.hashes[k]), record_span(path, pop.hashes[k + 1])
    assert n == m
    data = bytearray(path.read_bytes())
    data[a : a + n], data[b : b + n] = data[b : b + n], data[a : a + n]
    path.write_bytes(bytes(data))


def _swap_header_offsets(pop: Populated, k: int):
    """A same-length header edit: records k and k+1 swap places in the tensor table."""
    path = pop.path(k)
    data = path.read_bytes()
    (hn,) = struct.unpack_from("<Q", data)
    head = data[8 : 8 + hn]
    doc = json.loads(head)
    slots = {s.block_hash: s.index for s in read_segment_header(path).slots}
    i, j = slots[pop.hashes[k]], slots[pop.hashes[k + 1]]
    a = b'"data_offsets":' + json.dumps(doc[f"b{i}"]["data_offsets"], separators=(",", ":")).encode()
    b = b'"data_offsets":' + json.dumps(doc[f"b{j}"]["data_offsets"], separators=(",", ":")).encode()
    x, y = head.index(a), head.index(b)
    new = head[:x] + b + head[x + len(a) : y] + a + head[y + len(b) :]
    assert len(new) == len(head)
    path.write_bytes(data[:8] + new + data[8 + hn :])


def _truncate(pop: Populated, k: int):
    path = pop.path(k)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


# (damage, what is dropped: 'row' = block k's row only, 'segment' = every row of k's segment)
DAMAGES = {
    "record_flip": (_flip_record, "row"),
    "token_id_flip": (_flip_token_id, "row"),
    "swapped_records": (_swap_records, "row"),
    "swapped_header_offsets": (_swap_header_offsets, "segment"),
    "truncated_segment": (_truncate, "segment"),
}


@pytest.mark.parametrize("case", sorted(DAMAGES))
def test_damaged_block_is_a_miss_with_clean_up(tiny_model, prompt, reference, tmp_path, case):
    pop = _populate(tiny_model, prompt, tmp_path)
    damage, dropped = DAMAGES[case]
    bad = pop.path(DAMAGED)
    damage(pop, DAMAGED)
    eng, res, stats, index = _serve_after_damage(tiny_model, prompt, tmp_path)
    assert res.token_ids == reference
    assert res.ssd_hit_tokens == DAMAGED * BS and res.prefill_tokens == len(prompt) - DAMAGED * BS
    assert stats["ssd_load_corrupt"] == 1
    assert not contains(index, pop.hashes[DAMAGED])
    assert all(contains(index, h) for h in pop.hashes[:DAMAGED])  # the first segment is untouched
    if dropped == "row":  # the segment keeps its intact blocks
        assert bad.exists() and all(contains(index, h) for h in pop.hashes[DAMAGED + 1 :])
    else:
        assert not bad.exists() and not any(contains(index, h) for h in pop.hashes[DAMAGED:])
    eng.close()


@pytest.mark.parametrize("blank", [False, True], ids=["zeros", "unfilled"])
def test_damaged_block_in_the_middle_of_a_segment_cuts_there(tiny_model, prompt, reference, tmp_path, blank,
                                                              monkeypatch):
    """Block 3 (second record of the second segment): blocks 0-2 are SSD hits, 3.. recomputed.
    Also with restore buffers allocated without a fill (as for large KV): what the cut chain
    left unwritten is never read."""
    if blank:
        monkeypatch.setattr(kvbuffers, "BLANK_MIN_TENSOR_BYTES", 0)
    pop = _populate(tiny_model, prompt, tmp_path)
    _flip_record(pop, DAMAGED + 1)
    eng, res, stats, index = _serve_after_damage(tiny_model, prompt, tmp_path)
    assert res.token_ids == reference
    assert res.ssd_hit_tokens == (DAMAGED + 1) * BS
    assert stats["ssd_load_corrupt"] == 1 and not contains(index, pop.hashes[DAMAGED + 1])
    assert contains(index, pop.hashes[DAMAGED]) and contains(index, pop.hashes[DAMAGED + 2])
    eng.close()


def test_index_row_whose_segment_is_gone(tiny_model, prompt, reference, tmp_path):
    pop = _populate(tiny_model, prompt, tmp_path)
    # (a) gone while a server runs: the lookup finds the rows, not the file
    eng = Engine(tiny_model, _config(tmp_path, ssd_policy="evict_only"))
    pop.path(DAMAGED).unlink()
    res = eng.generate(prompt, max_tokens=MAX_TOKENS)
    assert res.token_ids == reference and res.ssd_hit_tokens == DAMAGED * BS
    stats = eng.stats()
    assert stats["ssd_load_missing"] == 1 and stats["ssd_stale_index_cleaned"] == 4  # 3 blocks + tail
    assert not any(contains(eng.tiered.ssd.index, h) for h in pop.hashes[DAMAGED:])
    eng.close()
    # (b) gone before a restart: the startup reconcile drops the rows
    again = _populate(tiny_model, prompt, tmp_path)  # write_through: blocks 2.. stored again
    assert again.index[pop.hashes[DAMAGED]] != pop.index[pop.hashes[DAMAGED]]  # in a new segment
    again.path(DAMAGED).unlink()
    eng = Engine(tiny_model, _config(tmp_path, ssd_policy="evict_only"))
    assert eng.tiered.ssd.reconcile_report.missing_rows_dropped == 4
    res = eng.generate(prompt, max_tokens=MAX_TOKENS)
    assert res.token_ids == reference and res.ssd_hit_tokens == DAMAGED * BS
    eng.close()


def test_segment_of_another_namespace_is_rejected(tiny_model, prompt, reference, tmp_path):
    pop = _populate(tiny_model, prompt, tmp_path)
    # Same model and tokens, other block size: another layout key, so another namespace.
    other = Engine(tiny_model, KVToolConfig(ssd_cache_dir=tmp_path / "kv", block_size=2 * BS, ssd_async_writes=False))
    other.generate(prompt, max_tokens=1)
    other_hash = chain_hashes(np.asarray(prompt), 2 * BS, other.layout_key)[1]
    foreign = other.namespace_dir / segment_relpath(_segment_of(other.namespace_dir, other_hash))
    assert other.namespace_dir != pop.ns
    other.close()
    shutil.copyfile(foreign, pop.path(DAMAGED))
    eng, res, stats, index = _serve_after_damage(tiny_model, prompt, tmp_path)
    assert res.token_ids == reference
    assert res.ssd_hit_tokens == DAMAGED * BS
    assert stats["ssd_load_corrupt"] == 1
    assert not contains(index, pop.hashes[DAMAGED])
    eng.close()


def test_tail_entry_damage_costs_the_tail_only(tiny_model, prompt, reference, tmp_path):
    """Exact replay of a stored prompt is a full hit through its tail entry; a damaged tail record
    is a miss of the tail only (every full block still comes from SSD)."""
    pop = _populate(tiny_model, prompt, tmp_path)
    eng, res, stats, _ = _serve_after_damage(tiny_model, prompt, tmp_path)
    assert res.token_ids == reference and res.prefill_tokens == 1  # full hit: last token re-forwarded
    eng.close()
    path = pop.path(DAMAGED)
    tail = read_segment_header(path).slots[-1]
    assert tail.n_tokens == len(prompt) % BS
    data = bytearray(path.read_bytes())
    data[tail.offset + tail.nbytes - 1] ^= 0x10
    path.write_bytes(bytes(data))
    eng, res, stats, index = _serve_after_damage(tiny_model, prompt, tmp_path)
    assert res.token_ids == reference
    assert res.ssd_hit_tokens == 5 * BS and res.prefill_tokens == len(prompt) - 5 * BS
    assert stats["ssd_load_corrupt"] == 1 and not contains(index, tail.block_hash)
    assert all(contains(index, h) for h in pop.hashes)
    eng.close()


def test_forced_hash_collision_is_never_served(tiny_model, prompt, reference, tmp_path):
    """Two different prompts whose blocks collide by an injected hash: the stored block's token
    ids differ from the request's, so it is never used and the hash is isolated."""

    def weak_hash(parent: bytes, ids: np.ndarray) -> str:
        return "%032x" % (len(ids) + parent[0])  # depends on nothing but the position

    cfg = _config(tmp_path)
    eng = Engine(tiny_model, cfg, hash_fn=weak_hash)
    other = [t + 1 for t in prompt]
    eng.generate(other, max_tokens=1)
    eng.close()
    eng = Engine(tiny_model, cfg, hash_fn=weak_hash)
    res = eng.generate(prompt, max_tokens=MAX_TOKENS)
    assert res.token_ids == reference and res.cached_tokens == 0
    assert eng.stats()["ssd_hash_collision_detected"] >= 1
    eng.close()


def test_no_temp_or_stray_files_after_damage_runs(tiny_model, prompt, tmp_path):
    pop = _populate(tiny_model, prompt, tmp_path)
    _truncate(pop, DAMAGED)
    eng, _, _, _ = _serve_after_damage(tiny_model, prompt, tmp_path)
    eng.close()
    left = [f for _, _, files in os.walk(pop.ns) for f in files if f.endswith(".tmp")]
    assert left == []


def _swap_records_resealed(pop: Populated, k: int):
    """Records k and k+1 swapped in the file with their checksums moved along in the header, and
    the header checksum recomputed: every checksum matches; only the slot hash / token ids do not."""
    path = pop.path(k)
    (a, n), (b, m) = record_span(path, pop.hashes[k]), record_span(path, pop.hashes[k + 1])
    assert n == m
    data = bytearray(path.read_bytes())
    data[a : a + n], data[b : b + n] = data[b : b + n], data[a : a + n]
    (hn,) = struct.unpack_from("<Q", data)
    head = bytes(data[8 : 8 + hn])
    slots = {s.block_hash: s for s in read_segment_header(path).slots}
    ck, cl = slots[pop.hashes[k]].checksum, slots[pop.hashes[k + 1]].checksum
    head = head.replace(ck.encode(), b"#" * 32).replace(cl.encode(), ck.encode()).replace(b"#" * 32, cl.encode())
    key = b'"header_checksum":"'
    at = head.find(key) + len(key)
    data[8 : 8 + hn] = head[:at] + header_digest(head).encode() + head[at + 32 :]
    path.write_bytes(bytes(data))
    assert read_segment_header(path).slots  # still a well-formed, sealed header


def test_a_record_swap_with_resealed_checksums_costs_only_a_recompute(tiny_model, prompt, reference, tmp_path):
    """Hostile round 3, finding 11: a record swap whose checksums were moved and re-sealed is a damaged
    record (its row names the prompt's tokens, the record holds others), not a hash collision: its
    row goes, its segment is suspect, so the recomputed blocks replace the swapped rows and
    `validate` then keeps every block; a new process serves the whole prompt from SSD again."""
    pop = _populate(tiny_model, prompt, tmp_path)
    eng = Engine(tiny_model, _config(tmp_path, ssd_policy="evict_only"))
    whole = eng.generate(prompt, max_tokens=MAX_TOKENS).ssd_hit_tokens  # undamaged: every block a hit
    eng.close()
    _swap_records_resealed(pop, DAMAGED)
    eng = Engine(tiny_model, _config(tmp_path))  # write-through: recomputed blocks are written
    res = eng.generate(prompt, max_tokens=MAX_TOKENS)
    stats = eng.stats()
    assert eng.close().shutdown_clean
    assert res.token_ids == reference and res.ssd_hit_tokens == DAMAGED * BS
    assert stats["ssd_hash_collision_detected"] == 0 and stats["ssd_load_corrupt"] >= 1
    rep = validate(tmp_path / "kv", deep=True).namespaces[0]
    assert rep.corrupt_removed == rep.broken_chain_removed == rep.missing_rows_dropped == 0, rep.details
    assert validate(tmp_path / "kv", deep=True).problems == 0
    eng = Engine(tiny_model, _config(tmp_path, ssd_policy="evict_only"))
    res = eng.generate(prompt, max_tokens=MAX_TOKENS)
    eng.close()
    assert res.token_ids == reference and res.ssd_hit_tokens == whole


def test_validate_never_rewrites_a_row_from_a_swapped_resealed_record(tiny_model, prompt, reference, tmp_path):
    """Hostile round 3, finding 11: `validate` run on the swap itself: the records pass their checksums
    but hold token ids that do not hash to their slots' blocks, so no row is rewritten from them
    (a row claiming the wrong tokens would make every later request see a hash collision and
    refuse the recomputed block); the blocks before the swap stay; a request then stores the
    prompt again and a new process serves all of it from SSD."""
    pop = _populate(tiny_model, prompt, tmp_path)
    eng = Engine(tiny_model, _config(tmp_path, ssd_policy="evict_only"))
    whole = eng.generate(prompt, max_tokens=MAX_TOKENS).ssd_hit_tokens
    eng.close()
    _swap_records_resealed(pop, DAMAGED)
    rep = validate(tmp_path / "kv", deep=True).namespaces[0]
    assert rep.rows_repaired == 0 and rep.corrupt_removed == 2, rep.details
    for _ in range(2):  # the first stores the recomputed blocks, the second is served from SSD
        eng = Engine(tiny_model, _config(tmp_path))
        res = eng.generate(prompt, max_tokens=MAX_TOKENS)
        stats = eng.stats()
        eng.close()
        assert res.token_ids == reference and stats["ssd_hash_collision_detected"] == 0
    assert res.ssd_hit_tokens == whole
    assert validate(tmp_path / "kv", deep=True).problems == 0
