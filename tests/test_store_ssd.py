"""Tests of kvtool.disk.namespace.SSDStore on segment files (real files, real SQLite; faults injected
through FileOps, tampered index rows written with raw sqlite3)."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import sqlite3
import threading

import numpy as np
import pytest

from kvtool.disk import index as index_mod
from kvtool.disk.index import BlockIndex
from kvtool.disk.namespace import COUNTERS, NONCACHEABLE_TTL_S, SSDStore
from kvtool.disk.rowtable import IndexRow, SegmentRow
from kvtool.hashing import chain_hashes, root_parent, tail_hash
from tests.store_helpers import (
    ERRNOS,
    FaultFS,
    assert_same_block,
    block_path,
    contains,
    encode_segment,
    flip_record_byte,
    index_rows,
    kv_layout,
    make_block,
    make_chain,
    make_layout,
    make_meta,
    open_store,
    segment_files,
    segment_name,
)

TOKENS = np.array([1, 2, 3, 4], dtype=np.int32)


class Clock:
    def __init__(self, t: float = 1_000_000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def store(tmp_path):
    s = open_store(tmp_path)
    yield s
    s.close()


def one_block(store, tokens=TOKENS, seed=0, dtype="bfloat16"):
    return make_chain(store.layout_key, tokens, dtype, seed)[0]


def no_temp_files(store) -> bool:
    return not [p for p in store.namespace_dir.rglob("*.tmp")]


def hashes_of(blocks) -> list[str]:
    return [b.block_hash for b in blocks]


def raw(store):
    """A raw sqlite3 connection to the store's index (as a tamperer or another process has)."""
    return sqlite3.connect(store.namespace_dir / "index.sqlite", isolation_level=None)


def load_all(store, blocks) -> list:
    return [store.load_block(b.block_hash, b.token_ids, b.parent_hash) for b in blocks]


# ------------------------------------------------------------------ round trip, segments, dedup
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_save_then_load_is_bit_exact(tmp_path, dtype):
    store = open_store(tmp_path, dtype)
    chain = make_chain(store.layout_key, np.arange(18), dtype, seed=4, tail=True)  # 4 blocks + 2-token tail
    assert store.save_blocks(chain) == ["saved"] * 5
    for b, out in zip(chain, load_all(store, chain)):
        assert out is not None
        assert_same_block(out, b)
    stats = store.stats()
    assert stats["ssd_save_success"] == 5 and stats["ssd_load_hits"] == 5 and stats["ssd_segments_written"] == 1
    (path,) = segment_files(store)
    assert stats["ssd_bytes_written"] == path.stat().st_size == store.totals()[1]
    assert stats["ssd_bytes_read"] == sum(kv_layout(dtype).record_nbytes(b.num_tokens) for b in chain)
    assert set(stats) >= set(COUNTERS) and all(k.startswith("ssd_") for k in stats)
    store.close()
    again = open_store(tmp_path, dtype)  # a new process serves them too
    for b, out in zip(chain, load_all(again, chain)):
        assert_same_block(out, b)
    again.close()


def test_a_save_of_n_blocks_writes_one_segment_file(store):
    chain = make_chain(store.layout_key, np.arange(40))
    assert store.save_blocks(chain) == ["saved"] * 10
    files = segment_files(store)
    assert len(files) == 1 and {block_path(store, h) for h in hashes_of(chain)} == set(files)
    rows = store.lookup(hashes_of(chain))
    assert [r.slot for r in rows] == list(range(10)) and len({r.segment for r in rows}) == 1
    assert store.index.segment_rows(rows[0].segment) == rows
    assert store.totals() == (10, files[0].stat().st_size)


def test_segment_max_bytes_splits_a_batch(tmp_path):
    record = kv_layout().record_nbytes(4)
    store = open_store(tmp_path, segment_max_bytes=3 * record)
    chain = make_chain(store.layout_key, np.arange(40))
    assert store.save_blocks(chain) == ["saved"] * 10
    files = segment_files(store)
    assert len(files) == 4 and store.stats()["ssd_segments_written"] == 4  # 3 + 3 + 3 + 1
    sizes = sorted(len(store.index.segment_rows(segment_name(store, h))) for h in hashes_of(chain)[::3])
    assert sizes == [1, 3, 3, 3]
    assert all(x is not None for x in load_all(store, chain))
    store.close()


def test_dedup_touches_and_writes_once(tmp_path):
    clock = Clock()
    store = open_store(tmp_path, clock=clock)
    chain = make_chain(store.layout_key, np.arange(12))
    assert store.save_blocks(chain[:2]) == ["saved", "saved"]
    clock.t += 50
    assert store.save_blocks(chain) == ["dedup", "dedup", "saved"]
    assert store.save_blocks([chain[2], chain[2]]) == ["dedup", "dedup"]
    store.flush()
    assert store.index.get(chain[0].block_hash).last_access == clock.t
    assert store.stats()["ssd_save_dedup_skip"] == 4 and store.stats()["ssd_save_success"] == 3
    assert len(segment_files(store)) == 2
    store.close()


def test_duplicates_inside_one_batch_are_written_once(store):
    chain = make_chain(store.layout_key, np.arange(8))
    assert store.save_blocks([chain[0], chain[1], chain[0]]) == ["saved", "saved", "dedup"]
    (path,) = segment_files(store)
    assert store.totals() == (2, path.stat().st_size)


def test_concurrent_saves_of_one_chain_write_it_once(store):
    chain = make_chain(store.layout_key, np.arange(16))
    barrier = threading.Barrier(4)
    results = []

    def go():
        barrier.wait(timeout=5)
        results.append(tuple(store.save_blocks(chain)))

    threads = [threading.Thread(target=go) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert sorted(results) == [("dedup",) * 4] * 3 + [("saved",) * 4]
    assert len(segment_files(store)) == 1


def test_load_unknown_hash_is_a_miss(store):
    assert store.load_block("ef" * 16, TOKENS) is None
    assert store.stats()["ssd_load_miss"] == 1


def test_lookup_returns_the_leading_run_with_one_query(store, monkeypatch):
    chain = make_chain(store.layout_key, np.arange(24))
    store.save_blocks(chain[:3])
    store.save_blocks(chain[4:])
    calls = []
    real = store.index.get_many
    monkeypatch.setattr(store.index, "get_many", lambda hs: calls.append(len(hs)) or real(hs))
    rows = store.lookup(hashes_of(chain))
    assert [r.hash for r in rows] == hashes_of(chain[:3]) and calls == [6]  # one query, stops at the gap
    assert store.count_prefix(hashes_of(chain)) == 3 and contains(store, chain[5].block_hash)
    assert store.lookup(["../../etc/passwd", *hashes_of(chain)]) == []  # malformed hash: stops there
    assert store.lookup([]) == []


def test_remove_keeps_a_segment_until_its_last_block_goes(store):
    chain = make_chain(store.layout_key, np.arange(12))
    store.save_blocks(chain)
    (path,) = segment_files(store)
    size = path.stat().st_size
    hashes = hashes_of(chain)
    assert store.remove([hashes[1]]) == 1
    assert path.exists() and store.count_prefix(hashes) == 1 and not contains(store, hashes[1])
    assert store.totals() == (2, size)  # bytes are segment files: it is still on disk
    assert store.load_block(hashes[2], chain[2].token_ids) is not None  # its neighbours still load
    assert store.remove([hashes[0], hashes[2], "../x", "ff" * 16]) == 2
    assert not path.exists() and store.totals() == (0, 0)
    assert store.index.segments() == []


@pytest.mark.parametrize("bad", ["geometry", "too_long", "dtype", "hash"])
def test_save_of_a_block_that_does_not_fit_the_namespace_is_error(store, bad):
    good = one_block(store)
    block = {
        "geometry": make_block(good.block_hash, good.parent_hash, TOKENS, "bfloat16", n_layers=3),
        "too_long": make_block(good.block_hash, good.parent_hash, np.arange(5), "bfloat16"),
        "dtype": make_block(good.block_hash, good.parent_hash, TOKENS, "float16"),
        "hash": make_block("../" + good.block_hash[3:], good.parent_hash, TOKENS),
    }[bad]
    assert store.save_block(block) == "error"
    assert store.stats()["ssd_save_fail"] == (0 if bad == "hash" else 1)
    assert list(index_rows(store.index)) == [] and segment_files(store) == [] and no_temp_files(store)


def test_one_bad_block_in_a_batch_does_not_stop_the_others_being_deduped(store):
    chain = make_chain(store.layout_key, np.arange(8))
    store.save_blocks(chain[:1])
    bad = make_block("0" * 31 + "g", chain[1].parent_hash, TOKENS)
    assert store.save_blocks([chain[0], bad, chain[1]]) == ["dedup", "error", "saved"]


# ------------------------------------------------------------------ tail entries
def test_tail_entry_exact_replay_hits_changed_last_token_misses_the_tail_only(store):
    ids = np.arange(100, 118)  # 4 full blocks + a 2-token tail
    chain = make_chain(store.layout_key, ids, tail=True)
    store.save_blocks(chain)
    full = chain_hashes(ids, 4, store.layout_key)
    tail = tail_hash(ids, 4, store.layout_key, full)
    assert tail == chain[-1].block_hash
    rows = store.lookup(full + [tail])
    assert len(rows) == 5 and rows[-1].num_tokens == 2 and sum(r.num_tokens for r in rows) == 18
    changed = ids.copy()
    changed[-1] += 1
    tail2 = tail_hash(changed, 4, store.layout_key, chain_hashes(changed, 4, store.layout_key))
    assert tail2 != tail and len(store.lookup(full + [tail2])) == 4
    assert store.load_block(tail, ids[16:], full[-1]) is not None
    assert store.load_block(tail, changed[16:], full[-1]) is None  # same key, other tokens: never served


# ------------------------------------------------------------------ damage on load
def test_corrupt_record_is_a_miss_and_only_that_row_is_dropped(store):
    chain = make_chain(store.layout_key, np.arange(16))
    store.save_blocks(chain)
    path = flip_record_byte(store, chain[1].block_hash)
    assert store.load_block(chain[1].block_hash, chain[1].token_ids) is None
    stats = store.stats()
    assert stats["ssd_load_corrupt"] == 1 and stats["ssd_load_hits"] == 0
    assert store.index.get(chain[1].block_hash) is None
    assert path.exists()  # the segment still holds three good blocks
    for b in (chain[0], chain[2], chain[3]):
        assert_same_block(store.load_block(b.block_hash, b.token_ids, b.parent_hash), b)
    assert store.save_block(chain[1]) == "saved"  # not isolated: stored again, in a new segment
    assert store.load_block(chain[1].block_hash, chain[1].token_ids) is not None
    assert len(segment_files(store)) == 2


def test_corrupt_last_live_record_removes_the_segment(store):
    chain = make_chain(store.layout_key, np.arange(8))
    store.save_blocks(chain)
    store.remove([chain[0].block_hash])
    path = flip_record_byte(store, chain[1].block_hash, where=1.0)
    assert store.load_block(chain[1].block_hash, chain[1].token_ids) is None
    assert not path.exists() and store.totals() == (0, 0)


@pytest.mark.parametrize("damage", ["truncate", "header_flip", "grow"])
def test_damaged_segment_header_or_size_drops_all_its_rows(store, damage):
    chain = make_chain(store.layout_key, np.arange(12))
    other = make_chain(store.layout_key, np.arange(50, 54), seed=9)
    store.save_blocks(chain)
    store.save_blocks(other)
    path = block_path(store, chain[0].block_hash)
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "header_flip":
        data[20] ^= 0x01
    else:
        data += b"\0" * 8
    path.write_bytes(bytes(data))
    assert store.load_block(chain[2].block_hash, chain[2].token_ids) is None
    assert store.stats()["ssd_load_corrupt"] == 1
    assert store.lookup(hashes_of(chain)) == [] and not path.exists()
    assert store.load_block(other[0].block_hash, other[0].token_ids) is not None  # another segment


def test_segment_of_another_namespace_copied_in_is_rejected(tmp_path):
    mine = open_store(tmp_path)
    other = SSDStore(tmp_path, make_layout(model_id="other"), make_meta(model_id="other"))
    block = one_block(mine)
    foreign = make_block(block.block_hash, block.parent_hash, TOKENS, seed=99)
    assert mine.save_block(block) == "saved" and other.save_block(foreign) == "saved"
    shutil.copyfile(block_path(other, block.block_hash), block_path(mine, block.block_hash))
    # same slot, hash, parent and tokens, valid checksums: only the layout key tells them apart
    assert mine.load_block(block.block_hash, TOKENS) is None
    assert mine.stats()["ssd_load_corrupt"] == 1 and mine.index.get(block.block_hash) is None
    assert other.load_block(block.block_hash, TOKENS) is not None
    mine.close()
    other.close()


def test_slot_that_holds_another_block_is_dropped(store):
    chain = make_chain(store.layout_key, np.arange(8))
    store.save_blocks(chain)
    with raw(store) as con:  # tampered row: block 0 points at block 1's record
        con.execute("UPDATE blocks SET slot=1 WHERE hash=?", (chain[0].block_hash,))
    assert store.load_block(chain[0].block_hash, chain[0].token_ids) is None
    assert store.index.get(chain[0].block_hash) is None and contains(store, chain[1].block_hash)


def test_wrong_parent_is_not_served(store):
    chain = make_chain(store.layout_key, np.arange(8))
    store.save_blocks(chain)
    assert store.load_block(chain[1].block_hash, chain[1].token_ids, parent="0" * 32) is None
    assert store.load_block(chain[0].block_hash, chain[0].token_ids, root_parent(store.layout_key)) is not None


def test_missing_segment_drops_all_its_rows(store):
    chain = make_chain(store.layout_key, np.arange(16))
    store.save_blocks(chain[:2])
    store.save_blocks(chain[2:])
    block_path(store, chain[2].block_hash).unlink()
    assert store.load_block(chain[3].block_hash, chain[3].token_ids) is None
    stats = store.stats()
    assert stats["ssd_load_missing"] == 1 and stats["ssd_stale_index_cleaned"] == 2
    assert store.lookup(hashes_of(chain)) == store.lookup(hashes_of(chain[:2])) and len(store.lookup(hashes_of(chain))) == 2
    assert len(store.index.segments()) == 1


def test_segment_removed_by_another_process_mid_load_is_a_plain_miss(tmp_path):
    class RemovedUnderUs(FaultFS):
        def open_read(self, path):  # another process: rows first, then the file, just before our open
            other = BlockIndex(path.parents[1] / "index.sqlite")
            other.delete_segments([path.name.split(".")[0]])
            other.close()
            os.unlink(path)
            return super().open_read(path)

    store = open_store(tmp_path, fs=RemovedUnderUs())
    block = one_block(store)
    store.save_block(block)
    assert store.load_block(block.block_hash, TOKENS) is None
    stats = store.stats()
    assert stats["ssd_load_miss"] == 1 and stats["ssd_load_missing"] == 0 and stats["ssd_load_fail"] == 0
    store.close()


def test_save_after_an_external_unlink_is_dedup_until_a_load_finds_it_gone(store):
    """The save path trusts the index (no stat per block): a block whose file someone deleted is
    'dedup' until a load (or the startup reconcile) drops its rows; then it is written again."""
    block = one_block(store)
    store.save_block(block)
    block_path(store, block.block_hash).unlink()
    assert store.save_block(block) == "dedup"
    assert store.load_block(block.block_hash, TOKENS) is None
    assert store.stats()["ssd_stale_index_cleaned"] == 1
    assert store.save_block(block) == "saved"
    assert store.load_block(block.block_hash, TOKENS) is not None


# ------------------------------------------------------------------ collisions
def test_save_collision_isolates_hash_for_an_hour(tmp_path):
    clock = Clock()
    store = open_store(tmp_path, clock=clock)
    block = one_block(store)
    twin = make_block(block.block_hash, block.parent_hash, [9, 9, 9, 9], seed=5)  # same hash, other tokens
    assert store.save_block(block) == "saved"
    assert store.save_block(twin) == "collision"
    assert store.stats()["ssd_hash_collision_detected"] == 1
    assert store.save_block(block) == "collision"  # isolated, whatever the tokens
    assert store.load_block(block.block_hash, TOKENS) is None and store.count_prefix([block.block_hash]) == 0
    assert store.stats()["ssd_load_noncacheable"] == 1
    clock.t += NONCACHEABLE_TTL_S + 1
    assert store.load_block(block.block_hash, TOKENS) is not None  # original block intact
    store.close()


def test_load_collision_never_serves_and_isolates(tmp_path):
    clock = Clock()
    store = open_store(tmp_path, clock=clock)
    chain = make_chain(store.layout_key, np.arange(8))
    store.save_blocks(chain)
    other_tokens = np.array([4, 3, 2, 1], dtype=np.int32)
    assert store.load_block(chain[0].block_hash, other_tokens) is None
    assert store.stats()["ssd_hash_collision_detected"] == 1
    assert store.save_block(chain[0]) == "collision" and store.lookup(hashes_of(chain)) == []
    assert store.load_block(chain[1].block_hash, chain[1].token_ids) is not None  # its segment neighbour
    clock.t += NONCACHEABLE_TTL_S + 1
    assert store.load_block(chain[0].block_hash, chain[0].token_ids) is not None  # intact, never removed
    store.close()


def test_wrong_length_expected_tokens_is_a_miss_without_damage(store):
    block = one_block(store)
    store.save_block(block)
    assert store.load_block(block.block_hash, TOKENS[:3]) is None
    assert store.load_block(block.block_hash, TOKENS) is not None


# ------------------------------------------------------------------ durability & faults
@pytest.mark.parametrize("durability", ["durable", "best_effort", "persistent"])
def test_durable_mode_fsyncs_once_per_segment(tmp_path, durability):
    record = kv_layout().record_nbytes(4)
    fs = FaultFS()
    store = open_store(tmp_path, fs=fs, durability=durability, segment_max_bytes=4 * record)
    for batch in range(3):
        before = {k: list(v) for k, v in fs.paths.items()}
        calls = dict(fs.calls)
        chain = make_chain(store.layout_key, np.arange(batch * 100, batch * 100 + 32), seed=batch)  # 8 blocks
        assert store.save_blocks(chain) == ["saved"] * 8
        names = {segment_name(store, h) for h in hashes_of(chain)}
        assert len(names) == 2  # 8 blocks, 4 per segment
        fsyncs = fs.calls.get("fsync", 0) - calls.get("fsync", 0)
        dir_syncs = fs.paths.get("fsync_dir", [])[len(before.get("fsync_dir", [])) :]
        if durability == "durable":
            assert fsyncs == 2  # one per segment file, not one per block
            subs = {store.namespace_dir / n[:2] for n in names}
            # one fsync of each segment's directory, plus the namespace directory once per new
            # fan-out subdirectory (the mkdir must be durable before a file in it)
            assert sorted(p for p in dir_syncs if p != store.namespace_dir) == sorted(
                store.namespace_dir / n[:2] for n in names
            )
            assert set(dir_syncs) <= subs | {store.namespace_dir}
        else:
            assert fsyncs == 0 and dir_syncs == []
    store.close()


@pytest.mark.parametrize("op", ["open_new", "write_all", "fsync", "close", "replace"])
@pytest.mark.parametrize("code", ["ENOSPC", "EIO", "EACCES"])
def test_write_faults_return_error_and_leave_nothing(tmp_path, op, code):
    fs = FaultFS()
    store = open_store(tmp_path, fs=fs, durability="durable")
    chain = make_chain(store.layout_key, np.arange(12))
    fs.fail[op] = ERRNOS[code]
    assert store.save_blocks(chain) == ["error"] * 3
    assert store.stats()["ssd_save_fail"] == 3 and store.stats()["ssd_save_success"] == 0
    assert store.lookup(hashes_of(chain)) == [] and store.totals() == (0, 0)
    assert no_temp_files(store) and segment_files(store) == []
    fs.fail.clear()  # the disk recovers: the next attempt works
    assert store.save_blocks(chain) == ["saved"] * 3
    store.close()


class FailDirSyncOfSegments(FaultFS):
    """fsync_dir fails for fan-out subdirectories only: the rename already happened."""

    def __init__(self, store_dir_name: str):
        super().__init__()
        self.ns = store_dir_name
        self.armed = False

    def fsync_dir(self, path):
        if self.armed and path.name != self.ns:
            self._hit("fsync_dir_fail")
            raise OSError(errno.EIO, "injected EIO in fsync_dir", str(path))
        return super().fsync_dir(path)


def test_directory_fsync_failure_after_the_rename_leaves_no_orphan(tmp_path):
    """durable: the segment is renamed into place, then its directory fsync fails. The save is an
    'error' (no row); the file must not stay behind as an orphan no row accounts for."""
    fs = FailDirSyncOfSegments(make_layout())
    store = open_store(tmp_path, fs=fs, durability="durable")
    chain = make_chain(store.layout_key, np.arange(12))
    fs.armed = True
    assert store.save_blocks(chain) == ["error"] * 3
    assert fs.calls.get("fsync_dir_fail") == 1
    assert store.lookup(hashes_of(chain)) == []
    # Regression (found in review, fixed): kvtool/disk/namespace_save.py, SegmentSaver._write_file (was SSDStore._write_file).
    assert segment_files(store) == [] and no_temp_files(store)
    store.close()


@pytest.mark.parametrize("how", ["trigger", "exception"])
def test_failed_index_insert_after_the_rename_unlinks_the_segment(tmp_path, monkeypatch, how):
    """ENOSPC (or any error) committing the rows: the renamed file goes too, no orphan."""
    fs = FaultFS()
    store = open_store(tmp_path, fs=fs, durability="durable")
    chain = make_chain(store.layout_key, np.arange(12))
    if how == "trigger":  # a real SQLite failure inside the insert transaction
        with raw(store) as con:
            con.execute("CREATE TRIGGER full BEFORE INSERT ON blocks BEGIN SELECT RAISE(ABORT, 'database or disk is full'); END")
    else:
        def boom(*a, **k):
            raise sqlite3.OperationalError("database or disk is full")

        monkeypatch.setattr(store.index, "insert_segment", boom)
    assert store.save_blocks(chain) == ["error"] * 3
    assert fs.calls["replace"] == 1  # it got as far as the rename
    assert segment_files(store) == [] and no_temp_files(store)
    assert list(index_rows(store.index)) == [] and store.index.segments() == []
    assert store.stats()["ssd_save_fail"] == 3
    if how == "trigger":
        with raw(store) as con:
            con.execute("DROP TRIGGER full")
    else:
        monkeypatch.undo()
    assert store.save_blocks(chain) == ["saved"] * 3
    store.close()


@pytest.mark.parametrize("code", ["EIO", "EACCES"])
def test_open_faults_are_misses_that_keep_the_rows(tmp_path, code):
    fs = FaultFS()
    store = open_store(tmp_path, fs=fs)
    block = one_block(store)
    store.save_block(block)
    fs.fail["open_read"] = ERRNOS[code]
    assert store.load_block(block.block_hash, TOKENS) is None
    assert store.stats()["ssd_load_fail"] == 1 and store.stats()["ssd_load_hits"] == 0
    fs.fail.clear()
    assert store.load_block(block.block_hash, TOKENS) is not None  # a transient error lost nothing
    store.close()


@pytest.mark.parametrize("where", ["record", "header"])
def test_read_error_is_a_miss_that_keeps_the_rows(store, monkeypatch, where):
    """EIO from a read (a bad sector, a flaky network disk) is not evidence that the block is
    corrupt: the request misses, the rows and the file stay (as the restore path does for a
    record read error, and as a failing open does)."""
    from kvtool.disk import segment as seg

    chain = make_chain(store.layout_key, np.arange(8))
    store.save_blocks(chain)
    path = block_path(store, chain[0].block_hash)

    def eio(*a, **k):
        raise OSError(errno.EIO, f"injected EIO reading the {where}")

    monkeypatch.setattr(seg.os, "preadv" if where == "record" else "pread", eio)
    assert store.load_block(chain[0].block_hash, chain[0].token_ids) is None
    monkeypatch.undo()
    # Regression (found in review, fixed): kvtool/disk/namespace.py.
    assert path.exists() and len(store.lookup(hashes_of(chain))) == 2
    assert store.stats()["ssd_load_fail"] == 1 and store.stats()["ssd_load_corrupt"] == 0
    assert store.load_block(chain[0].block_hash, chain[0].token_ids) is not None


@pytest.mark.parametrize("op,code", [("makedirs", "EROFS"), ("makedirs", "EACCES"), ("open_new", "EROFS")])
def test_unwritable_new_cache_dir_disables_store(tmp_path, op, code):
    store = open_store(tmp_path, fs=FaultFS({op: ERRNOS[code]}))
    assert not store.enabled and store.disabled_reason
    block = one_block(store)
    assert store.save_block(block) == "error"
    assert store.load_block(block.block_hash, TOKENS) is None
    assert store.count_prefix([block.block_hash]) == 0 and not contains(store, block.block_hash)
    assert store.stats()["ssd_save_disabled"] == 1
    store.flush()
    store.close()


@pytest.mark.parametrize("code", ["EROFS", "EACCES", "EPERM"])
def test_read_only_cache_dir_serves_loads_and_refuses_saves(tmp_path, code):
    """A directory the process cannot write (simulated: the startup probe's open_new fails) opens
    read-only: every stored block is served, nothing is written, touched or removed."""
    clock = Clock()
    writer = open_store(tmp_path, clock=clock)
    chain = make_chain(writer.layout_key, np.arange(16), tail=False)
    writer.save_blocks(chain[:2])
    writer.save_blocks(chain[2:])
    writer.close()
    before = {p: p.read_bytes() for p in segment_files(writer)}
    with raw(writer) as con:
        rows_before = con.execute("SELECT * FROM blocks ORDER BY hash").fetchall()

    clock.t += 1000
    fs = FaultFS({"open_new": getattr(errno, code)})
    ro = open_store(tmp_path, fs=fs, clock=clock)
    assert ro.enabled and ro.read_only and "read-only" in ro.disabled_reason
    for b, out in zip(chain, load_all(ro, chain)):
        assert_same_block(out, b)
    assert ro.stats()["ssd_load_hits"] == 4
    more = make_chain(ro.layout_key, np.arange(100, 104), seed=7)
    assert ro.save_blocks(more) == ["error"] and ro.save_blocks(chain[:1]) == ["error"]
    assert ro.stats()["ssd_save_disabled"] == 2
    assert ro.remove(hashes_of(chain)) == 0
    flip = next(iter(before))  # damage seen read-only: a miss, but nothing is deleted
    data = bytearray(before[flip])
    data[-1] ^= 1
    flip.write_bytes(bytes(data))
    damaged = [b for b in chain if block_path(ro, b.block_hash) == flip][-1]
    assert ro.load_block(damaged.block_hash, damaged.token_ids) is None
    ro.touch_many([chain[0].block_hash])
    ro.flush()
    ro.close()
    flip.write_bytes(before[flip])
    assert {p: p.read_bytes() for p in segment_files(writer)} == before
    with raw(writer) as con:
        assert con.execute("SELECT * FROM blocks ORDER BY hash").fetchall() == rows_before  # no touch, no delete
    assert fs.calls.get("unlink", 0) == 0 and fs.calls.get("replace", 0) == 0
    assert fs.calls["open_new"] == 1  # the probe only


def test_read_only_cache_dir_without_an_index_is_disabled(tmp_path):
    (tmp_path / make_layout()).mkdir(parents=True)
    store = open_store(tmp_path, fs=FaultFS({"open_new": errno.EROFS}))
    assert not store.enabled and store.disabled_reason
    assert store.load_block("ab" * 16, TOKENS) is None and store.save_block(one_block(store)) == "error"
    assert not (tmp_path / make_layout() / "index.sqlite").exists()


def test_unknown_format_version_namespace_is_refused(tmp_path):
    store = open_store(tmp_path)
    store.close()
    idx = BlockIndex(store.namespace_dir / "index.sqlite")
    idx.set_meta({"format_version": "1"})
    idx.close()
    again = open_store(tmp_path)
    assert not again.enabled and again.stats()["ssd_namespace_refused"] == 1
    assert "format_version" in again.disabled_reason
    idx = BlockIndex(store.namespace_dir / "index.sqlite", create=False)
    assert idx.get_meta()["format_version"] == "1"  # untouched
    idx.close()


@pytest.mark.parametrize("key,value", [("kv_layers", "2x8x8"), ("block_size", "8"), ("kv_dtype", "float16"), ("model_id", "x")])
def test_namespace_whose_meta_differs_is_refused_and_untouched(tmp_path, key, value):
    store = open_store(tmp_path)
    store.save_block(one_block(store))
    store.close()
    with raw(store) as con:
        con.execute("UPDATE meta SET value=? WHERE key=?", (value, key))
    again = open_store(tmp_path)
    assert not again.enabled and key in again.disabled_reason
    assert len(segment_files(store)) == 1
    with raw(store) as con:
        assert con.execute("SELECT COUNT(*) FROM blocks").fetchone()[0] == 1


# ------------------------------------------------------------------ tampered index rows
def _loosen_schema(con) -> None:
    """Recreate the tables without NOT NULL (a tamperer can write any database)."""
    con.executescript(
        """
        BEGIN;
        ALTER TABLE blocks RENAME TO blocks_old;
        CREATE TABLE blocks (hash TEXT PRIMARY KEY, parent TEXT, segment TEXT, slot INTEGER,
            num_tokens INTEGER, nbytes INTEGER, tokens_digest TEXT, created REAL, last_access REAL);
        INSERT INTO blocks SELECT * FROM blocks_old;
        DROP TABLE blocks_old;
        ALTER TABLE segments RENAME TO segments_old;
        CREATE TABLE segments (name TEXT PRIMARY KEY, nbytes INTEGER, n_blocks INTEGER, created REAL);
        INSERT INTO segments SELECT * FROM segments_old;
        DROP TABLE segments_old;
        COMMIT;
        """
    )


BAD_VALUES = {
    "null_segment": ("segment", None),
    "text_slot": ("slot", "one"),
    "negative_slot": ("slot", -1),
    "null_num_tokens": ("num_tokens", None),
    "zero_nbytes": ("nbytes", 0),
    "text_nbytes": ("nbytes", "big"),
    "blob_digest": ("tokens_digest", b"\x00" * 16),
    "null_last_access": ("last_access", None),
    "nan_created": ("created", float("nan")),
    "traversal_segment": ("segment", "../../../../etc/passwd"),
    "absolute_segment": ("segment", "//etc/passwd"),
    "null_parent": ("parent", None),
    "real_slot": ("slot", 0.5),
}


@pytest.mark.parametrize("bad", sorted(BAD_VALUES))
def test_typed_wrong_row_is_skipped_by_lookup_not_a_type_error(tmp_path, bad, caplog):
    store = open_store(tmp_path)
    chain = make_chain(store.layout_key, np.arange(16))
    store.save_blocks(chain)
    store.close()
    col, value = BAD_VALUES[bad]
    with raw(store) as con:
        _loosen_schema(con)
        con.execute(f"UPDATE blocks SET {col}=? WHERE hash=?", (value, chain[2].block_hash))
    caplog.set_level(logging.WARNING)
    again = open_store(tmp_path)  # startup reconcile must not trip over it
    assert again.enabled
    assert [r.hash for r in again.lookup(hashes_of(chain))] == hashes_of(chain[:2])
    assert again.load_block(chain[2].block_hash, chain[2].token_ids) is None
    assert again.load_block(chain[3].block_hash, chain[3].token_ids) is not None
    assert again.stats()["ssd_load_fail"] == 0
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]
    again.totals()
    again.remove([chain[3].block_hash])
    assert again.save_block(chain[2]) == "saved"  # replaces the bad row
    assert again.load_block(chain[2].block_hash, chain[2].token_ids) is not None
    again.close()
    assert (tmp_path / "etc").exists() is False


def test_null_hash_rows_do_not_break_open_lookup_or_save(tmp_path, caplog):
    store = open_store(tmp_path)
    chain = make_chain(store.layout_key, np.arange(8))
    store.save_blocks(chain)
    store.close()
    with raw(store) as con:
        _loosen_schema(con)
        row = con.execute("SELECT * FROM blocks WHERE hash=?", (chain[0].block_hash,)).fetchone()
        con.execute("INSERT INTO blocks VALUES (NULL,?,?,?,?,?,?,?,?)", row[1:])
        con.execute("INSERT INTO blocks VALUES (?,?,?,?,?,?,?,?,?)", (42, *row[1:]))
        con.execute("INSERT INTO blocks VALUES (?,?,?,?,?,?,?,?,?)", (chain[0].block_hash.upper(), *row[1:]))
        con.execute("UPDATE segments SET nbytes='ten', created='now'")  # typed-wrong segment row
    caplog.set_level(logging.WARNING)
    again = open_store(tmp_path)
    assert again.enabled and again.reconcile_report.rows == 5
    assert len(again.lookup(hashes_of(chain))) == 2
    assert all(x is not None for x in load_all(again, chain))
    assert again.totals() == (5, 0)  # the typed-wrong segment size is not counted
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    again.close()


def test_reconcile_drops_missing_segments_despite_malformed_segment_rows(tmp_path):
    """A tampered `segments` row (NULL or traversal name) must not stop the startup reconcile from
    dropping the rows of a segment whose file is really gone."""
    store = open_store(tmp_path)
    chain = make_chain(store.layout_key, np.arange(16))
    store.save_blocks(chain[:2])
    store.save_blocks(chain[2:])
    store.close()
    block_path(store, chain[2].block_hash).unlink()
    with raw(store) as con:
        _loosen_schema(con)
        con.execute("INSERT INTO segments VALUES (NULL, 10, 1, 1.0)")
        con.execute("INSERT INTO segments VALUES ('../../etc', 10, 1, 1.0)")
    again = open_store(tmp_path)
    # Regression (found in review, fixed): kvtool/disk/namespace.py, SSDStore._reconcile.
    assert again.reconcile_report.missing_rows_dropped == 2
    assert len(again.lookup(hashes_of(chain))) == 2
    again.close()


# ------------------------------------------------------------------ open / reconcile / close
def test_shutdown_clean_is_recorded_across_runs(tmp_path):
    first = open_store(tmp_path)
    assert first.previous_shutdown_clean is None
    first.close(shutdown_clean=True, partial_flush=False)
    second = open_store(tmp_path)
    assert second.previous_shutdown_clean is True
    # no close: like a killed process; the next run sees '0'
    third = open_store(tmp_path)
    assert third.previous_shutdown_clean is False
    third.close(shutdown_clean=False, partial_flush=True)
    meta = BlockIndex(third.namespace_dir / "index.sqlite").get_meta()
    assert meta["shutdown_clean"] == "0" and meta["shutdown_partial_flush"] == "1" and "last_close" in meta
    assert meta["format_version"] == "2" and meta["kv_layers"] == kv_layout().spec
    second.close()


def test_startup_reconcile_removes_leftovers_and_missing_segments(tmp_path):
    store = open_store(tmp_path)
    chain = make_chain(store.layout_key, np.arange(16))
    store.save_blocks(chain[:2])
    store.save_blocks(chain[2:])
    store.close()
    keep, gone = block_path(store, chain[0].block_hash), block_path(store, chain[2].block_hash)
    sub = keep.parent
    name = keep.name.split(".")[0]
    dead = sub / f".{name}.4194305.abcd0123.tmp"  # pid above any pid_max: dead
    live = sub / f".{name}.{os.getpid()}.beef0123.tmp"  # a write in progress: kept
    foreign = sub / "notes.tmp"  # not kvtool's temp-name pattern: never touched
    for p in (dead, live, foreign):
        p.write_bytes(b"partial")
    gone.unlink()
    orphan_block = make_block("ee" * 16, "ff" * 16, TOKENS)
    orphan_path = store.namespace_dir / "ee" / f"{'ee' * 16}.safetensors"
    orphan_path.parent.mkdir(exist_ok=True)
    orphan_path.write_bytes(encode_segment([orphan_block], store.layout_key))

    again = open_store(tmp_path)
    rep = again.reconcile_report
    assert (rep.temp_removed, rep.missing_rows_dropped, rep.orphan_files, rep.rows) == (1, 2, 1, 2)
    assert not dead.exists() and live.exists() and foreign.exists() and orphan_path.exists()
    assert again.lookup(hashes_of(chain)) == again.lookup(hashes_of(chain[:2]))
    assert again.stats()["ssd_stale_index_cleaned"] == 2
    assert again.stats()["ssd_reconcile_orphan_files"] == 1
    assert again.load_block(chain[0].block_hash, chain[0].token_ids) is not None
    again.close()


def test_startup_reconcile_does_not_load_every_row(tmp_path, monkeypatch):
    """Reconcile reads the segments table and one directory listing, no block row."""
    store = open_store(tmp_path, segment_max_bytes=10 * kv_layout().record_nbytes(4))
    chain = make_chain(store.layout_key, np.arange(4 * 200))
    assert store.save_blocks(chain) == ["saved"] * 200
    store.close()
    block_path(store, chain[-1].block_hash).unlink()  # some work to do: 10 rows to drop
    parsed = []
    real = IndexRow.from_db.__func__

    def counting(cls, values):
        parsed.append(values[0])
        return real(cls, values)

    monkeypatch.setattr(index_mod.IndexRow, "from_db", classmethod(counting))
    for name in ("get_many", "get", "segment_rows"):
        monkeypatch.setattr(BlockIndex, name, lambda *a, _n=name, **k: pytest.fail(f"reconcile called {_n}"))
    again = open_store(tmp_path)
    assert again.enabled
    assert again.reconcile_report.missing_rows_dropped == 10 and again.reconcile_report.rows == 190
    assert parsed == []
    monkeypatch.undo()
    again.close()


def test_access_times_are_batched_until_flush(tmp_path):
    clock = Clock()
    store = open_store(tmp_path, clock=clock, flush_interval_s=10)
    block = one_block(store)
    store.save_block(block)
    created = store.index.get(block.block_hash).last_access
    clock.t += 5
    store.load_block(block.block_hash, TOKENS)
    reader = BlockIndex(store.namespace_dir / "index.sqlite", create=False)
    assert reader.get(block.block_hash).last_access == created  # buffered
    clock.t += 4
    store.load_block(block.block_hash, TOKENS)
    assert reader.get(block.block_hash).last_access == created  # oldest touch 4 s old < 10 s
    clock.t += 7
    store.load_block(block.block_hash, TOKENS)  # the oldest buffered touch is overdue: commits
    assert reader.get(block.block_hash).last_access == clock.t
    reader.close()
    store.close()


def test_future_last_access_is_clamped_on_touch(tmp_path):
    clock = Clock()
    store = open_store(tmp_path, clock=clock)
    block = one_block(store)
    store.save_block(block)
    with raw(store) as con:
        con.execute("UPDATE blocks SET last_access=? WHERE hash=?", (clock.t + 10 * 365 * 86400, block.block_hash))
    store.touch_many([block.block_hash])
    store.flush()
    assert store.index.get(block.block_hash).last_access == clock.t
    store.close()


def test_errno_table_is_real():
    assert ERRNOS["ENOSPC"] == errno.ENOSPC


# ------------------------------------------------------------------ index
@pytest.mark.parametrize("durable,level", [(True, 2), (False, 1)])
def test_index_pragmas(tmp_path, durable, level):
    idx = BlockIndex(tmp_path / "index.sqlite", durable)
    assert idx._conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert idx._conn.execute("PRAGMA synchronous").fetchone()[0] == level
    idx.close()


def test_index_delete_is_one_transaction_and_drops_emptied_segments(tmp_path):
    idx = BlockIndex(tmp_path / "index.sqlite")
    hashes = [f"{i:032x}" for i in range(1200)]  # more than one statement's worth of parameters
    segs = [f"{s:032x}" for s in range(3)]
    for s, name in enumerate(segs):
        rows = [
            IndexRow(h, "0" * 32, name, i, 4, 10, "d" * 32, 1.0, 1.0) for i, h in enumerate(hashes[s * 400 : (s + 1) * 400])
        ]
        idx.insert_segment(SegmentRow(name, 4000, 400, 1.0), rows)
    assert idx.present(hashes) == set(hashes) and idx.totals() == (1200, 12000)
    n, emptied = idx.delete(hashes[600:] + ["f" * 32])
    assert n == 600 and emptied == [segs[2]]  # segment 1 keeps 200 rows
    assert idx.present(hashes) == set(hashes[:600]) and not contains(idx, "f" * 32)
    assert idx.totals() == (600, 8000)
    assert idx.delete_segments([segs[0]]) == 400 and idx.totals() == (200, 4000)
    idx.close()


def test_two_stores_on_one_namespace_save_concurrently(tmp_path):
    """Two handles (as two processes would have) writing at once: no lock errors, nothing lost."""
    a, b = open_store(tmp_path), open_store(tmp_path)
    chains = [make_chain(a.layout_key, np.arange(i * 1000, i * 1000 + 40), "bfloat16", seed=i) for i in range(2)]
    barrier = threading.Barrier(2)
    results: list[str] = []

    def run(store, chain):
        barrier.wait(timeout=5)
        for k in range(0, 10, 2):
            results.extend(store.save_blocks(chain[k : k + 2]))

    threads = [threading.Thread(target=run, args=(s, c)) for s, c in zip((a, b), chains)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert results.count("saved") == 20 and a.stats()["ssd_index_errors"] == b.stats()["ssd_index_errors"] == 0
    assert a.count_prefix(hashes_of(chains[1])) == 10 and len(segment_files(a)) == 10
    a.close()
    b.close()
