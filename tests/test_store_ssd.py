"""Tests of kvtool.store.ssd.SSDStore (real files, real SQLite; faults injected through FileOps)."""

from __future__ import annotations

import errno
import os
import shutil
import threading

import numpy as np
import pytest
from tests.store_helpers import (
    ERRNOS,
    FaultFS,
    assert_same_block,
    block_path,
    make_block,
    make_chain,
    make_layout,
    make_meta,
    open_store,
)

from kvtool.store import blockfile
from kvtool.store.index import BlockIndex
from kvtool.store.ssd import COUNTERS, NONCACHEABLE_TTL_S, SSDStore

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


# ------------------------------------------------------------------ round trip, dedup
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_save_then_load_is_bit_exact(tmp_path, dtype):
    store = open_store(tmp_path, dtype)
    block = one_block(store, dtype=dtype)
    assert store.save_block(block) == "saved"
    out = store.load_block(block.block_hash, TOKENS)
    assert out is not None
    assert_same_block(out, block)
    stats = store.stats()
    assert stats["ssd_save_success"] == 1 and stats["ssd_load_hits"] == 1
    assert stats["ssd_bytes_written"] == stats["ssd_bytes_read"] == block_path(store, block.block_hash).stat().st_size
    assert set(stats) == set(COUNTERS) and all(k.startswith("ssd_") for k in stats)
    store.close()
    # a new process (store) serves it too
    again = open_store(tmp_path, dtype)
    assert_same_block(again.load_block(block.block_hash, TOKENS), block)
    again.close()


def test_dedup_touches_and_writes_once(tmp_path):
    clock = Clock()
    store = open_store(tmp_path, clock=clock)
    block = one_block(store)
    assert store.save_block(block) == "saved"
    clock.t += 50
    assert store.save_block(block) == "dedup"
    store.flush()
    assert store.index.get(block.block_hash).last_access == clock.t
    assert store.stats()["ssd_save_dedup_skip"] == 1 and store.stats()["ssd_save_success"] == 1
    assert len(list(store.namespace_dir.rglob("*.safetensors"))) == 1
    store.close()


def test_concurrent_saves_of_one_block_write_it_once(store):
    block = one_block(store)
    barrier = threading.Barrier(4)
    results = []

    def go():
        barrier.wait(timeout=5)
        results.append(store.save_block(block))

    threads = [threading.Thread(target=go) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert sorted(results) == ["dedup"] * 3 + ["saved"]


def test_load_unknown_hash_is_a_miss(store):
    assert store.load_block("ef" * 16, TOKENS) is None
    assert store.stats()["ssd_load_miss"] == 1


def test_count_prefix_and_remove(store):
    chain = make_chain(store.layout_key, np.arange(12), "bfloat16")
    for b in chain:
        assert store.save_block(b) == "saved"
    hashes = [b.block_hash for b in chain]
    assert store.count_prefix(hashes) == 3 and store.contains(hashes[2])
    assert store.remove([hashes[1]]) == 1
    assert store.count_prefix(hashes) == 1 and not store.contains(hashes[1])
    assert not block_path(store, hashes[1]).exists()
    assert store.totals() == (2, sum(block_path(store, h).stat().st_size for h in (hashes[0], hashes[2])))


def test_save_with_wrong_geometry_is_error(store):
    block = make_block("ab" * 16, "cd" * 16, TOKENS, "bfloat16", n_layers=3)
    assert store.save_block(block) == "error"
    assert store.stats()["ssd_save_fail"] == 1 and store.index.get(block.block_hash) is None


# ------------------------------------------------------------------ damage on load
def damage_truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def damage_flip(path):
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x40
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", [damage_truncate, damage_flip], ids=["truncated", "flipped"])
def test_corrupt_file_is_a_miss_and_removed(store, damage):
    block = one_block(store)
    store.save_block(block)
    path = block_path(store, block.block_hash)
    damage(path)
    assert store.load_block(block.block_hash, TOKENS) is None
    assert store.stats()["ssd_load_corrupt"] == 1 and store.stats()["ssd_load_hits"] == 0
    assert store.index.get(block.block_hash) is None and not path.exists()
    assert store.save_block(block) == "saved"  # not isolated: it can be stored again
    assert store.load_block(block.block_hash, TOKENS) is not None


def test_block_of_another_namespace_copied_in_is_rejected(tmp_path):
    mine = open_store(tmp_path)
    other = SSDStore(tmp_path, make_layout(model_id="other"), make_meta(model_id="other"))
    block = one_block(mine)
    foreign = make_block(block.block_hash, block.parent_hash, TOKENS, seed=99)
    assert mine.save_block(block) == "saved" and other.save_block(foreign) == "saved"
    shutil.copyfile(block_path(other, block.block_hash), block_path(mine, block.block_hash))
    # same size, same tokens, valid checksum: only the layout key tells them apart
    assert mine.load_block(block.block_hash, TOKENS) is None
    assert mine.stats()["ssd_load_corrupt"] == 1 and not block_path(mine, block.block_hash).exists()
    assert other.load_block(block.block_hash, TOKENS) is not None
    mine.close()
    other.close()


def test_row_whose_file_is_gone_is_dropped(store):
    block = one_block(store)
    store.save_block(block)
    block_path(store, block.block_hash).unlink()
    assert store.load_block(block.block_hash, TOKENS) is None
    stats = store.stats()
    assert stats["ssd_load_missing"] == 1 and stats["ssd_stale_index_cleaned"] == 1
    assert store.index.get(block.block_hash) is None


def test_file_removed_by_another_process_mid_load_is_a_plain_miss(tmp_path):
    class RemovedUnderUs(FaultFS):
        def read_bytes(self, path):  # another process: row first, then file, just before our read
            other = BlockIndex(path.parents[1] / "index.sqlite")
            other.delete([path.stem])
            other.close()
            os.unlink(path)
            return super().read_bytes(path)

    fs = RemovedUnderUs()
    store = open_store(tmp_path, fs=fs)
    block = one_block(store)
    store.save_block(block)
    assert store.load_block(block.block_hash, TOKENS) is None
    stats = store.stats()
    assert stats["ssd_load_miss"] == 1 and stats["ssd_load_missing"] == 0 and stats["ssd_load_fail"] == 0
    store.close()


def test_stale_row_on_save_is_cleaned_and_saved_again(store):
    block = one_block(store)
    store.save_block(block)
    block_path(store, block.block_hash).unlink()
    assert store.save_block(block) == "saved"
    assert store.stats()["ssd_stale_index_cleaned"] == 1
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


def test_load_collision_never_serves_and_isolates(store):
    block = one_block(store)
    store.save_block(block)
    other_tokens = np.array([4, 3, 2, 1], dtype=np.int32)
    assert store.load_block(block.block_hash, other_tokens) is None
    assert store.stats()["ssd_hash_collision_detected"] == 1
    assert store.index.get(block.block_hash) is None and not block_path(store, block.block_hash).exists()
    assert store.save_block(block) == "collision"


def test_wrong_length_expected_tokens_is_a_miss_without_damage(store):
    block = one_block(store)
    store.save_block(block)
    assert store.load_block(block.block_hash, TOKENS[:3]) is None
    assert store.load_block(block.block_hash, TOKENS) is not None


# ------------------------------------------------------------------ durability & faults
@pytest.mark.parametrize("durability,fsyncs", [("durable", 1), ("best_effort", 0), ("persistent", 0)])
def test_durable_mode_fsyncs_file_and_directory(tmp_path, durability, fsyncs):
    fs = FaultFS()
    store = open_store(tmp_path, fs=fs, durability=durability)
    before = dict(fs.calls)
    store.save_block(one_block(store))
    assert fs.calls.get("fsync", 0) - before.get("fsync", 0) == fsyncs
    dir_syncs = fs.calls.get("fsync_dir", 0) - before.get("fsync_dir", 0)
    assert (dir_syncs >= 1) if fsyncs else dir_syncs == 0
    store.close()


@pytest.mark.parametrize("op", ["open_new", "write_all", "fsync", "replace"])
@pytest.mark.parametrize("code", ["ENOSPC", "EIO", "EACCES"])
def test_write_faults_return_error_and_leave_nothing(tmp_path, op, code):
    fs = FaultFS()
    store = open_store(tmp_path, fs=fs, durability="durable")
    block = one_block(store)
    fs.fail[op] = ERRNOS[code]
    assert store.save_block(block) == "error"
    assert store.stats()["ssd_save_fail"] == 1 and store.stats()["ssd_save_success"] == 0
    assert store.index.get(block.block_hash) is None
    assert no_temp_files(store) and not block_path(store, block.block_hash).exists()
    fs.fail.clear()  # the disk recovers: the next attempt works
    assert store.save_block(block) == "saved"
    store.close()


@pytest.mark.parametrize("code", ["EIO", "EACCES"])
def test_read_faults_are_misses(tmp_path, code):
    fs = FaultFS()
    store = open_store(tmp_path, fs=fs)
    block = one_block(store)
    store.save_block(block)
    fs.fail["read_bytes"] = ERRNOS[code]
    assert store.load_block(block.block_hash, TOKENS) is None
    assert store.stats()["ssd_load_fail"] == 1 and store.stats()["ssd_load_hits"] == 0
    store.close()


@pytest.mark.parametrize("op,code", [("makedirs", "EROFS"), ("makedirs", "EACCES"), ("open_new", "EROFS")])
def test_unwritable_cache_dir_disables_store(tmp_path, op, code):
    store = open_store(tmp_path, fs=FaultFS({op: ERRNOS[code]}))
    assert not store.enabled and store.disabled_reason
    block = one_block(store)
    assert store.save_block(block) == "error"
    assert store.load_block(block.block_hash, TOKENS) is None
    assert store.count_prefix([block.block_hash]) == 0 and not store.contains(block.block_hash)
    assert store.stats()["ssd_save_disabled"] == 1
    store.flush()
    store.close()


def test_unknown_format_version_namespace_is_refused(tmp_path):
    store = open_store(tmp_path)
    store.close()
    idx = BlockIndex(store.namespace_dir / "index.sqlite")
    idx.set_meta({"format_version": "2"})
    idx.close()
    again = open_store(tmp_path)
    assert not again.enabled and again.stats()["ssd_namespace_refused"] == 1
    assert "format_version" in again.disabled_reason
    idx = BlockIndex(store.namespace_dir / "index.sqlite", create=False)
    assert idx.get_meta()["format_version"] == "2"  # untouched
    idx.close()


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
    second.close()


def test_startup_reconcile_removes_leftovers_and_missing_rows(tmp_path):
    store = open_store(tmp_path)
    chain = make_chain(store.layout_key, np.arange(8), "bfloat16")
    for b in chain:
        store.save_block(b)
    store.close()
    sub = block_path(store, chain[0].block_hash).parent
    dead = sub / f".{chain[0].block_hash}.4194305.abcd.tmp"  # pid above any pid_max: dead
    live = sub / f".{chain[0].block_hash}.{os.getpid()}.beef.tmp"  # a write in progress: kept
    dead.write_bytes(b"partial")
    live.write_bytes(b"partial")
    block_path(store, chain[1].block_hash).unlink()
    orphan = make_block("ee" * 16, "ff" * 16, TOKENS)
    orphan_path = store.namespace_dir / "ee" / f"{'ee' * 16}.safetensors"
    orphan_path.parent.mkdir()
    orphan_path.write_bytes(blockfile.encode(orphan, store.layout_key, 0.0))

    again = open_store(tmp_path)
    rep = again.reconcile_report
    assert (rep.temp_removed, rep.missing_rows_dropped, rep.orphan_files, rep.rows) == (1, 1, 1, 1)
    assert not dead.exists() and live.exists() and orphan_path.exists()
    assert again.index.get(chain[1].block_hash) is None
    assert again.stats()["ssd_stale_index_cleaned"] == 1
    assert again.load_block(chain[0].block_hash, chain[0].token_ids) is not None
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


def test_errno_table_is_real():
    assert ERRNOS["ENOSPC"] == errno.ENOSPC


# ------------------------------------------------------------------ index
@pytest.mark.parametrize("durable,level", [(True, 2), (False, 1)])
def test_index_pragmas(tmp_path, durable, level):
    idx = BlockIndex(tmp_path / "index.sqlite", durable)
    assert idx._conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert idx._conn.execute("PRAGMA synchronous").fetchone()[0] == level
    idx.close()


def test_index_delete_is_one_transaction_and_count_prefix(tmp_path):
    from kvtool.store.index import IndexRow

    idx = BlockIndex(tmp_path / "index.sqlite")
    hashes = [f"{i:032x}" for i in range(1200)]  # more than one statement's worth of parameters
    for h in hashes:
        idx.insert(IndexRow(h, "0" * 32, f"{h[:2]}/{h}.safetensors", 4, 10, "d", 1.0, 1.0))
    assert idx.count_prefix(hashes) == 1200 and idx.totals() == (1200, 12000)
    assert idx.delete(hashes[600:] + ["f" * 32]) == 600
    assert idx.count_prefix(hashes) == 600 and idx.count_prefix(["f" * 32, *hashes]) == 0
    idx.close()


def test_two_stores_on_one_namespace_save_concurrently(tmp_path):
    """Two handles (as two processes would have) writing at once: no lock errors, nothing lost."""
    a, b = open_store(tmp_path), open_store(tmp_path)
    chains = [make_chain(a.layout_key, np.arange(i * 1000, i * 1000 + 40), "bfloat16", seed=i) for i in range(2)]
    barrier = threading.Barrier(2)
    results: list[str] = []

    def run(store, chain):
        barrier.wait(timeout=5)
        results.extend(store.save_block(blk) for blk in chain)

    threads = [threading.Thread(target=run, args=(s, c)) for s, c in zip((a, b), chains)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert results.count("saved") == 20 and a.stats()["ssd_index_errors"] == b.stats()["ssd_index_errors"] == 0
    assert a.count_prefix([blk.block_hash for blk in chains[1]]) == 10
    a.close()
    b.close()
