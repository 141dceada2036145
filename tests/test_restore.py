"""Tests of kvtool.disk.restore.restore_chain: batched, verified restore of SSD chains straight
into per-layer buffers (docs/design.md#restore-path-kvtoolprefix--kvtoolstorerestore).

- a batched restore (reader threads, several segments, several reader tasks) places exactly the
  bytes a per-block `SSDStore.load_block` returns, bit for bit;
- a corrupt, missing or swapped block in the middle of a chain cuts the chain exactly there,
  with the right clean-up (row dropped / segment dropped / hash isolated / nothing on I/O error);
- a segment deleted after the lookup but before the open is a clean miss;
- restoring while another thread removes (and re-saves) blocks never raises and never places
  wrong bytes.
"""

from __future__ import annotations

import errno
import os
import random
import sqlite3
import threading
import time

import numpy as np
import pytest

from kvtool.bench.machine import disk_info
from kvtool.disk import restore
from kvtool.disk import segment as seg
from kvtool.disk.namespace import SSDStore
from kvtool.disk.segment import STORAGE_DTYPES
from kvtool.hashing import root_parent
from tests.store_helpers import (
    FaultFS,
    block_path,
    flip_record_byte,
    kv_layout,
    make_block,
    make_chain,
    make_layout,
    make_meta,
    open_store,
    record_span,
    segment_files,
)

BS = 4


# ----------------------------------------------------------------------------- helpers
class Buffers:
    """Per-layer destination buffers `[1, H, cap, D]` (keys and values), like a restore's cache."""

    def __init__(self, kv, cap: int, fill: int = 0xA5):
        self.kv = kv
        self.threads: set[str] = set()  # names of the threads that asked for destinations
        storage = STORAGE_DTYPES[kv.dtype]
        self.arrays = []
        for h, dk, dv in kv.layers:
            for d in (dk, dv):
                a = np.empty((1, h, cap, d), storage)
                a.view(np.uint8)[...] = fill
                self.arrays.append(a)

        self.pieces = seg.HeadPieces(self.arrays)

    def dest(self, offset: int, n: int):
        self.threads.add(threading.current_thread().name)
        return self.pieces(offset, n)

    def place(self, offset: int, n: int, records) -> bool:
        """`restore_chain`'s `place`: staged records copied in one go (`HeadPieces.place`)."""
        self.threads.add(threading.current_thread().name)
        self.pieces.place(offset, n, records)
        return True

    def tokens_bytes(self, stop: int) -> list[bytes]:
        return [a[:, :, :stop, :].tobytes() for a in self.arrays]


def expected_bytes(blocks, stop_blocks: int) -> list[bytes]:
    """Per tensor (K0, V0, ...) the bytes of the first `stop_blocks` blocks, concatenated on T."""
    out = []
    for layer in range(len(blocks[0].keys)):
        for part in ("keys", "values"):
            arrs = [getattr(b, part)[layer] for b in blocks[:stop_blocks]]
            out.append(np.concatenate(arrs, axis=2).tobytes() if arrs else b"")
    return out


def offsets(rows) -> list[int]:
    out, pos = [], 0
    for r in rows:
        out.append(pos)
        pos += r.num_tokens
    return out


def run_restore(store, blocks, ids, parallel=True, cap=None, rows=None, place=False):
    """Restore `blocks`' rows into fresh `Buffers`; `place`: staged records placed through
    `Buffers.place` (else copied into `dest`'s pieces)."""
    rows = store.lookup([b.block_hash for b in blocks]) if rows is None else rows
    bufs = Buffers(store.expected.kv, cap or len(ids) + 8)
    res = restore.restore_chain(store, rows, root_parent(store.layout_key), np.asarray(ids, np.int32), offsets(rows),
                                bufs.dest, parallel, place=bufs.place if place else None)  # fmt: skip
    return res, bufs, rows


def placed_ok(bufs, blocks, n_ok) -> bool:
    stop = sum(b.num_tokens for b in blocks[:n_ok])
    return bufs.tokens_bytes(stop) == expected_bytes(blocks, n_ok)


@pytest.fixture
def small_tasks(monkeypatch):
    """Reader tasks of ~2 records, and the pool used whatever the chain's size: a chain becomes
    many tasks on the reader threads."""
    monkeypatch.setattr(restore, "TASK_BYTES", 2 * kv_layout().record_nbytes(BS))
    monkeypatch.setattr(restore, "PARALLEL_MIN_BYTES", 0, raising=False)


def saved_chain(store, n_tokens=46, batches=(3, 7), dtype="bfloat16", seed=0):
    """A chain (full blocks + tail entry) saved in several write batches (several segments)."""
    ids = np.arange(1000, 1000 + n_tokens, dtype=np.int32)
    chain = make_chain(store.layout_key, ids, dtype, seed=seed, tail=True)
    cuts = [0, *batches, len(chain)]
    for lo, hi in zip(cuts, cuts[1:]):
        assert set(store.save_blocks(chain[lo:hi])) == {"saved"}
    return chain, ids


# ----------------------------------------------------------------------------- bit for bit
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("parallel", [True, False], ids=["pool", "inline"])
@pytest.mark.parametrize("place", [True, False], ids=["place", "pieces"])
def test_batched_restore_equals_per_block_load_bit_for_bit(tmp_path, small_tasks, dtype, parallel, place):
    store = open_store(tmp_path, dtype)
    chain, ids = saved_chain(store, dtype=dtype)
    assert len(chain) == 12 and chain[-1].num_tokens == 2 and len(segment_files(store)) == 3
    res, bufs, rows = run_restore(store, chain, ids, parallel, place=place)
    assert (res.n_ok, res.failure) == (12, None)
    on_pool = any(name.startswith("kvtool-reader") for name in bufs.threads)
    assert on_pool == parallel, bufs.threads
    assert res.bytes_read == sum(r.nbytes for r in rows)
    per_block = [store.load_block(b.block_hash, b.token_ids, b.parent_hash) for b in chain]
    assert all(b is not None for b in per_block)
    assert bufs.tokens_bytes(len(ids)) == expected_bytes(per_block, 12)  # same bytes as load_block
    assert bufs.tokens_bytes(len(ids)) == expected_bytes(chain, 12)  # ... which are what was saved
    for a in bufs.arrays:  # decode room after the prompt is not written
        assert (a[:, :, len(ids) :, :].view(np.uint8) == 0xA5).all()
    st = store.stats()
    assert st["ssd_load_hits"] == 24 and st["ssd_load_corrupt"] == 0 and st["ssd_load_fail"] == 0
    store.close()


def test_restore_at_a_token_offset_and_partial_rows(tmp_path):
    """A restore may start mid-prompt (after RAM blocks) and cover part of the chain."""
    store = open_store(tmp_path)
    chain, ids = saved_chain(store)
    rows = store.lookup([b.block_hash for b in chain])[3:8]
    bufs = Buffers(store.expected.kv, len(ids))
    res = restore.restore_chain(store, rows, chain[2].block_hash, ids, [r * BS for r in range(3, 8)], bufs.dest)
    assert res.n_ok == 5 and res.failure is None
    for a, e in zip(bufs.arrays, expected_bytes(chain[3:8], 5)):
        assert a[:, :, 12:32, :].tobytes() == e
        assert (a[:, :, :12, :].view(np.uint8) == 0xA5).all() and (a[:, :, 32:, :].view(np.uint8) == 0xA5).all()


def test_restore_of_no_rows(tmp_path):
    store = open_store(tmp_path)
    res = restore.restore_chain(store, [], root_parent(store.layout_key), np.zeros(0, np.int32), [], lambda o, n: [])
    assert (res.n_ok, res.bytes_read, res.failure) == (0, 0, None)


def test_read_only_store_restores(tmp_path, small_tasks):
    writer = open_store(tmp_path)
    chain, ids = saved_chain(writer)
    writer.close()
    ro = open_store(tmp_path, fs=FaultFS({"open_new": errno.EROFS}))
    assert ro.read_only
    res, bufs, _ = run_restore(ro, chain, ids)
    assert res.n_ok == 12 and placed_ok(bufs, chain, 12)


# ----------------------------------------------------------------------------- chain cuts
K = 5  # the damaged block: the middle of segment 2 (blocks 3..6), with good blocks on both sides


def _corrupt(store, chain):
    flip_record_byte(store, chain[K].block_hash)


def _corrupt_tokens_only(store, chain):
    flip_record_byte(store, chain[K].block_hash, where=0.0, bit=0x01)


def _swapped_slots(store, chain):
    with sqlite3.connect(store.namespace_dir / "index.sqlite") as con:
        a = con.execute("SELECT slot FROM blocks WHERE hash=?", (chain[K].block_hash,)).fetchone()[0]
        b = con.execute("SELECT slot FROM blocks WHERE hash=?", (chain[K + 1].block_hash,)).fetchone()[0]
        con.execute("UPDATE blocks SET slot=? WHERE hash=?", (b, chain[K].block_hash))
        con.execute("UPDATE blocks SET slot=? WHERE hash=?", (a, chain[K + 1].block_hash))


def _swapped_records(store, chain):
    """The bytes of records K and K+1 swapped inside the file (equal sizes, header untouched)."""
    path = block_path(store, chain[K].block_hash)
    (a, n), (b, m) = record_span(path, chain[K].block_hash), record_span(path, chain[K + 1].block_hash)
    assert n == m
    data = bytearray(path.read_bytes())
    data[a : a + n], data[b : b + n] = data[b : b + n], data[a : a + n]
    path.write_bytes(bytes(data))


def _foreign_tokens(store, chain):
    """An intact record under block K's hash and parent, holding other token ids (a collision)."""
    store.remove([chain[K].block_hash])
    twin = make_block(chain[K].block_hash, chain[K].parent_hash, chain[K].token_ids + 1, seed=77)
    assert store.save_block(twin) == "saved"


CUTS = {
    "corrupt_record": (_corrupt, "checksum"),
    "corrupt_token_ids": (_corrupt_tokens_only, "checksum"),
    "swapped_slots": (_swapped_slots, "slot"),
    "swapped_records": (_swapped_records, "checksum"),
    "collision": (_foreign_tokens, "tokens"),
}


@pytest.mark.parametrize("parallel", [True, False], ids=["pool", "inline"])
@pytest.mark.parametrize("place", [True, False], ids=["place", "pieces"])
@pytest.mark.parametrize("case", sorted(CUTS))
def test_bad_block_in_the_middle_cuts_the_chain_exactly_there(tmp_path, small_tasks, case, parallel, place):
    store = open_store(tmp_path)
    chain, ids = saved_chain(store)
    damage, kind = CUTS[case]
    damage(store, chain)
    res, bufs, rows = run_restore(store, chain, ids, parallel, place=place)
    assert len(rows) == 12
    assert res.n_ok == K, res.failure
    assert res.failure is not None and (kind in res.failure)
    assert placed_ok(bufs, chain, K)
    assert res.bytes_read == sum(r.nbytes for r in rows[:K])
    st = store.stats()
    assert st["ssd_load_hits"] == K
    after = [r.hash for r in store.lookup([b.block_hash for b in chain])]
    if kind == "tokens":  # intact block of other tokens: kept on disk, its hash isolated
        assert st["ssd_hash_collision_detected"] == 1 and len(after) == K
        assert store.index.get(chain[K].block_hash) is not None
    else:  # damaged: its row goes, every other block stays
        assert st["ssd_load_corrupt"] >= 1 and store.index.get(chain[K].block_hash) is None
        assert after == [b.block_hash for b in chain[:K]]
        survivors = [b for b in chain if b is not chain[K] and not (case.startswith("swapped") and b is chain[K + 1])]
        assert all(store.index.get(b.block_hash) is not None for b in survivors)
    # a second restore serves the same prefix, then misses (the caller recomputes the rest)
    res2, bufs2, _ = run_restore(store, chain, ids, parallel, place=place)
    assert res2.n_ok == K and placed_ok(bufs2, chain, K)


def test_missing_segment_in_the_middle_cuts_the_chain_there(tmp_path, small_tasks):
    store = open_store(tmp_path)
    chain, ids = saved_chain(store)  # segments: blocks 0-2, 3-6, 7-11
    rows = store.lookup([b.block_hash for b in chain])
    block_path(store, chain[3].block_hash).unlink()  # after the lookup: the row is stale
    res, bufs, _ = run_restore(store, chain, ids, rows=rows)
    assert res.n_ok == 3 and "unusable" in res.failure and placed_ok(bufs, chain, 3)
    st = store.stats()
    assert st["ssd_load_missing"] == 1 and st["ssd_stale_index_cleaned"] == 4
    assert len(store.lookup([b.block_hash for b in chain])) == 3
    assert all(store.index.get(b.block_hash) is not None for b in chain[7:])


def test_segment_replaced_by_another_valid_segment_cuts_the_chain(tmp_path, small_tasks):
    """A segment file swapped for another segment of the same namespace: header fine, slots hold
    other blocks -> cut at the first block of that segment."""
    store = open_store(tmp_path)
    chain, ids = saved_chain(store)
    other = make_chain(store.layout_key, np.arange(5000, 5016), seed=3)
    store.save_blocks(other)
    os.replace(block_path(store, other[0].block_hash), block_path(store, chain[3].block_hash))
    res, bufs, _ = run_restore(store, chain, ids)
    assert res.n_ok == 3 and placed_ok(bufs, chain, 3)
    assert store.index.get(chain[3].block_hash) is None


def test_segment_of_another_namespace_cuts_the_chain(tmp_path, small_tasks):
    store = open_store(tmp_path)
    chain, ids = saved_chain(store)
    other = SSDStore(tmp_path, make_layout(model_id="other"), make_meta(model_id="other"))
    foreign = [make_block(b.block_hash, b.parent_hash, b.token_ids, seed=50 + i) for i, b in enumerate(chain[3:7])]
    assert other.save_blocks(foreign) == ["saved"] * 4
    os.replace(block_path(other, foreign[0].block_hash), block_path(store, chain[3].block_hash))
    res, bufs, _ = run_restore(store, chain, ids)
    assert res.n_ok == 3 and placed_ok(bufs, chain, 3)
    assert store.stats()["ssd_load_corrupt"] == 1
    assert [store.index.get(b.block_hash) for b in chain[3:7]] == [None] * 4
    other.close()


def test_wrong_first_parent_cuts_at_zero(tmp_path):
    store = open_store(tmp_path)
    chain, ids = saved_chain(store)
    rows = store.lookup([b.block_hash for b in chain])
    bufs = Buffers(store.expected.kv, len(ids))
    res = restore.restore_chain(store, rows, "0" * 32, ids, offsets(rows), bufs.dest)
    assert res.n_ok == 0 and res.bytes_read == 0 and res.failure


def test_prompt_tokens_that_differ_in_the_middle_cut_there(tmp_path):
    """The rows were looked up for this prompt, but the caller's token ids differ at block K."""
    store = open_store(tmp_path)
    chain, ids = saved_chain(store)
    other = ids.copy()
    other[K * BS + 1] += 1
    res, bufs, _ = run_restore(store, chain, other)
    assert res.n_ok == K and "tokens" in res.failure


@pytest.mark.parametrize("token_block, corrupt_block, want", [(K, K + 2, "tokens"), (K + 2, K, "checksum"),
                                                               (K, K, "checksum")])
def test_first_failure_of_a_run_wins_whichever_check(tmp_path, token_block, corrupt_block, want):
    """One run, two bad records (other prompt token ids in one, a flipped byte in the other): the
    chain is cut at the earlier; on the same record the checksum is named."""
    store = open_store(tmp_path)
    chain, ids = saved_chain(store, batches=())  # one segment: the whole chain is one run
    other = ids.copy()
    other[token_block * BS] += 1
    flip_record_byte(store, chain[corrupt_block].block_hash)
    res, bufs, _ = run_restore(store, chain, other)
    assert res.n_ok == min(token_block, corrupt_block) and want in res.failure
    assert placed_ok(bufs, chain, res.n_ok)


def record_readahead(monkeypatch) -> list[tuple[int, int, int, int]]:
    calls = []
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, off, n, advice: calls.append((os.fstat(fd).st_ino, off, n, advice)))
    return calls


def test_readahead_covers_each_segments_planned_records(tmp_path, monkeypatch):
    """Records not in the page cache: one WILLNEED per segment, over exactly the bytes of its
    records in the chain."""
    store = open_store(tmp_path)
    chain, ids = saved_chain(store)  # segments: blocks 0-2, 3-6, 7-11
    monkeypatch.setattr(restore, "_looks_cached", lambda fd, start, end: False)
    calls = record_readahead(monkeypatch)
    res, _, rows = run_restore(store, chain, ids, parallel=False)
    assert res.n_ok == 12
    assert [c[3] for c in calls] == [os.POSIX_FADV_WILLNEED] * 3
    for (ino, off, n, _), (lo, hi) in zip(calls, [(0, 3), (3, 7), (7, 12)]):
        path = block_path(store, chain[lo].block_hash)
        assert ino == path.stat().st_ino
        spans = [record_span(path, b.block_hash) for b in chain[lo:hi]]
        assert (off, off + n) == (spans[0][0], spans[-1][0] + spans[-1][1])


@pytest.mark.skipif(not hasattr(os, "RWF_NOWAIT"), reason="needs preadv(RWF_NOWAIT) to tell cached pages")
def test_readahead_is_skipped_for_cached_records(tmp_path, monkeypatch):
    """Segments just read (in the page cache) get no WILLNEED."""
    store = open_store(tmp_path)
    chain, ids = saved_chain(store)
    run_restore(store, chain, ids, parallel=False)
    calls = record_readahead(monkeypatch)
    res, bufs, _ = run_restore(store, chain, ids, parallel=False)
    assert (res.n_ok, calls) == (12, []) and placed_ok(bufs, chain, 12)


@pytest.mark.skipif(not hasattr(os, "RWF_NOWAIT"), reason="needs preadv(RWF_NOWAIT) to tell cached pages (Linux)")
def test_looks_cached_tells_evicted_pages_from_cached_ones(tmp_path):
    fs = disk_info(tmp_path).get("filesystem")
    if fs in ("tmpfs", "ramfs", "overlay"):
        pytest.skip(f"{fs}: its pages stay in memory under POSIX_FADV_DONTNEED, so none can be made uncached")
    path = tmp_path / "records"
    path.write_bytes(os.urandom(4 << 20))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        assert not restore._looks_cached(fd, 1 << 20, 4 << 20)
        os.pread(fd, 4 << 20, 0)
        assert restore._looks_cached(fd, 1 << 20, 4 << 20)
        os.posix_fadvise(fd, 3 << 20, 1 << 20, os.POSIX_FADV_DONTNEED)  # the last MiB evicted: not all cached
        assert not restore._looks_cached(fd, 1 << 20, 4 << 20)
    finally:
        os.close(fd)


def test_readahead_that_fails_changes_nothing(tmp_path, monkeypatch):
    store = open_store(tmp_path)
    chain, ids = saved_chain(store)

    def refuse(*_):
        raise OSError(errno.ESPIPE, "no readahead here")

    monkeypatch.setattr(os, "posix_fadvise", refuse)
    res, bufs, _ = run_restore(store, chain, ids)
    assert (res.n_ok, res.failure) == (12, None) and placed_ok(bufs, chain, 12)


def test_read_error_cuts_the_chain_and_keeps_the_rows(tmp_path, monkeypatch):
    store = open_store(tmp_path)
    chain, ids = saved_chain(store)
    real = os.preadv
    target = {}

    def flaky(fd, bufs, offset, *flags):  # EIO whenever a read of K's file covers record K (batched or alone)
        covers = offset <= target["offset"] < offset + sum(memoryview(b).nbytes for b in bufs)
        if covers and os.fstat(fd).st_ino == target["inode"]:
            raise OSError(errno.EIO, "injected EIO")
        return real(fd, bufs, offset, *flags)

    path = block_path(store, chain[K].block_hash)
    target["offset"] = record_span(path, chain[K].block_hash)[0]
    target["inode"] = path.stat().st_ino
    monkeypatch.setattr(seg.os, "preadv", flaky)
    res, bufs, _ = run_restore(store, chain, ids, parallel=False)
    monkeypatch.undo()
    assert res.n_ok == K and res.failure.startswith("io")
    assert store.stats()["ssd_load_fail"] == 1 and store.stats()["ssd_load_corrupt"] == 0
    assert len(store.lookup([b.block_hash for b in chain])) == 12  # nothing was dropped


# ----------------------------------------------------------------------------- concurrent removal
def test_segment_deleted_after_lookup_before_open_is_a_clean_miss(tmp_path):
    """Another process (its own index handle) removes the chain between our lookup and our open."""
    store = open_store(tmp_path)
    chain, ids = saved_chain(store)
    rows = store.lookup([b.block_hash for b in chain])
    other = open_store(tmp_path)
    assert other.remove([b.block_hash for b in chain]) == 12
    assert segment_files(store) == []
    res, bufs, _ = run_restore(store, chain, ids, rows=rows)
    assert res.n_ok == 0 and res.failure
    st = store.stats()
    assert st["ssd_load_miss"] == 1 and st["ssd_load_missing"] == 0
    assert st["ssd_load_fail"] == 0 and st["ssd_load_corrupt"] == 0
    other.close()


def test_file_unlinked_between_lookup_and_open_by_fs_hook(tmp_path):
    """The window made deterministic: the unlink happens inside our open of the second segment."""

    class UnlinkOnOpen(FaultFS):
        victim = None

        def open_read(self, path):
            if self.victim is not None and path == self.victim:
                os.unlink(path)
            return super().open_read(path)

    fs = UnlinkOnOpen()
    store = open_store(tmp_path, fs=fs)
    chain, ids = saved_chain(store)
    fs.victim = block_path(store, chain[3].block_hash)
    res, bufs, _ = run_restore(store, chain, ids)
    assert res.n_ok == 3 and placed_ok(bufs, chain, 3)
    assert store.stats()["ssd_load_missing"] == 1


@pytest.mark.parametrize("remover", ["same_store", "other_handle"])
@pytest.mark.slow
def test_restore_while_another_thread_removes_segments(tmp_path, small_tasks, remover):
    """Reader: lookup + restore in a loop. Remover: remove random blocks (segments unlinked once
    empty) and save them again (new segments). Every restore must return without raising and place
    exactly the saved bytes for the blocks it reports."""
    store = open_store(tmp_path)
    chain, ids = saved_chain(store, n_tokens=62, batches=(2, 5, 9, 12))
    victim = store if remover == "same_store" else open_store(tmp_path)
    stop = threading.Event()
    errors: list[BaseException] = []
    stats = {"restores": 0, "full": 0, "partial": 0, "removed": 0}
    deadline = time.monotonic() + 2.0

    def reader():
        try:
            while not stop.is_set():
                res, bufs, rows = run_restore(store, chain, ids)
                assert placed_ok(bufs, chain, res.n_ok), f"wrong bytes placed ({res})"
                assert res.n_ok <= len(rows)
                stats["restores"] += 1
                stats["full" if res.n_ok == len(chain) else "partial"] += 1
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)
            stop.set()

    def churn():
        rng = random.Random(7)
        try:
            while not stop.is_set() and time.monotonic() < deadline:
                k = rng.randrange(len(chain))
                stats["removed"] += victim.remove([b.block_hash for b in chain[k : k + rng.randrange(1, 5)]])
                time.sleep(rng.uniform(0, 0.004))
                lo = rng.randrange(len(chain))
                results = victim.save_blocks(chain[lo:])
                assert "error" not in results and "collision" not in results, results
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
        finally:
            stop.set()

    threads = [threading.Thread(target=reader), threading.Thread(target=reader), threading.Thread(target=churn)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads)
    assert errors == [], errors
    print(f"\n{remover}: {stats}")
    assert stats["restores"] >= 10 and stats["removed"] > 0 and stats["partial"] > 0, stats
    st = store.stats()
    assert st["ssd_load_fail"] == 0 and st["ssd_hash_collision_detected"] == 0, st
    # afterwards: everything saved once more is served whole
    victim.save_blocks(chain)
    res, bufs, _ = run_restore(store, chain, ids)
    assert res.n_ok == len(chain) and placed_ok(bufs, chain, len(chain))
    if victim is not store:
        victim.close()
    store.close()


def test_gc_is_paused_during_the_read_phase_and_restored_after(tmp_path, monkeypatch):
    """The collector is off while records are read (many short-lived iovec pieces) and back on
    after, also when it nests; a collector the caller had disabled stays disabled."""
    import gc

    store = open_store(tmp_path, "float32")
    chain, ids = saved_chain(store, dtype="float32")
    seen = []
    real = restore._read_task
    monkeypatch.setattr(restore, "_read_task", lambda *a: (seen.append(gc.isenabled()), real(*a))[1])
    assert gc.isenabled()
    with restore.gc_paused():
        res, _, _ = run_restore(store, chain, ids, parallel=False)
        assert not gc.isenabled()
    assert res.n_ok == len(chain) and seen and not any(seen) and gc.isenabled()
    gc.disable()
    try:
        run_restore(store, chain, ids, parallel=False)
        assert not gc.isenabled()
    finally:
        gc.enable()
    store.close()
