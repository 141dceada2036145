"""Tests of kvtool.tiers.writer: the writer protocol (docs/design.md#writer-protocol) with batches as the unit of work,
byte-bounded backpressure, coalescing of queued batches, and per-block retries.

Interleavings are forced with `threading.Event` / `threading.Barrier` (and the writer's counter
condition), never with sleeps; every wait has a timeout so a bug fails the test instead of
hanging it.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtool.config import KVToolConfig
from kvtool.kv.blocks import HostBlock
from kvtool.tiers.writer import (
    COUNTER_NAMES,
    DEFAULT_BATCH_MAX_BYTES,
    DEFAULT_MAX_QUEUE_BYTES,
    AsyncWriter,
    SyncWriter,
    make_writer,
)
from tests.store_helpers import FaultFS, assert_same_block, make_chain, make_layout, open_store, wait_counters

WAIT = 2.0  # seconds: upper bound of every wait in these tests
MiB = 1 << 20


def make_block(i: int | str, n_layers: int = 2, block_size: int = 4) -> HostBlock:
    """A tiny float32 host block whose hash is derived from `i` (all have the same nbytes)."""
    rng = np.random.default_rng(abs(hash(str(i))) % (1 << 32))
    shape = (1, 2, block_size, 8)
    return HostBlock(
        block_hash=hashlib.blake2b(str(i).encode(), digest_size=16).hexdigest(),
        parent_hash="0" * 32,
        token_ids=np.arange(block_size, dtype=np.int32),
        keys=[rng.standard_normal(shape, dtype=np.float32) for _ in range(n_layers)],
        values=[rng.standard_normal(shape, dtype=np.float32) for _ in range(n_layers)],
        dtype="float32",
    )


NB = make_block(0).nbytes  # bytes of one `make_block` block


def hashes_of(*names) -> list[str]:
    return [make_block(n).block_hash for n in names]


class Sink:
    """A fake SSDStore: records every save_blocks call, can hold saves on Events, scripted answers.

    Args:
        outcomes: answers to return in call order; when exhausted, `default` is returned. A str
            answers every block of the call, a list answers per block, an Exception instance is
            raised instead.
        default: answer (for every block) once `outcomes` is exhausted.
    """

    def __init__(self, outcomes=(), default="saved"):
        self.enabled = True
        self.outcomes = list(outcomes)
        self.default = default
        self.gate = threading.Event()  # every save waits on it (open by default)
        self.gate.set()
        self.holds: dict[str, threading.Event] = {}  # per-hash gates overriding `gate`
        self.calls: list[tuple[tuple[str, ...], int]] = []  # (hashes of the batch, thread ident)
        self.on_call = None  # called (no arguments) at the start of every save_blocks call
        self._cond = threading.Condition()

    def hold(self, block_hash: str) -> threading.Event:
        """A closed gate for every call whose batch holds this hash; set() it to let it finish."""
        ev = threading.Event()
        self.holds[block_hash] = ev
        return ev

    def save_blocks(self, blocks):
        hashes = tuple(b.block_hash for b in blocks)
        if self.on_call is not None:
            self.on_call()
        with self._cond:
            self.calls.append((hashes, threading.get_ident()))
            answer = self.outcomes.pop(0) if self.outcomes else self.default
            self._cond.notify_all()
        gate = next((self.holds[h] for h in hashes if h in self.holds), self.gate)
        if not gate.wait(WAIT * 2):
            raise RuntimeError("test gate never opened")
        if isinstance(answer, Exception):
            raise answer
        return [answer] * len(blocks) if isinstance(answer, str) else list(answer)

    def save_block(self, block):
        return self.save_blocks([block])[0]

    def stats(self):
        return {"sink_calls": len(self.calls)}

    def wait_calls(self, n: int, timeout: float = WAIT) -> bool:
        """Wait until at least `n` save_blocks calls have started."""
        with self._cond:
            return self._cond.wait_for(lambda: len(self.calls) >= n, timeout)

    @property
    def hashes(self) -> list[str]:
        """Every hash handed to the store, in call order."""
        return [h for hs, _ in self.calls for h in hs]

    @property
    def batches(self) -> list[list[str]]:
        return [list(hs) for hs, _ in self.calls]


@pytest.fixture
def writers():
    """Creates writers and, at teardown, opens their sinks and checks their threads end."""
    made: list[tuple[AsyncWriter | SyncWriter, Sink]] = []

    def factory(sink: Sink, kind: str = "async", **kw):
        w = AsyncWriter(sink, **kw) if kind == "async" else SyncWriter(sink, **kw)
        made.append((w, sink))
        return w

    yield factory
    for w, sink in made:
        sink.gate.set()
        for ev in sink.holds.values():
            ev.set()
        assert w.stop(WAIT), "writer thread did not end at teardown"


def no_sleep(_seconds: float) -> None:
    pass


def wait_counter(w: AsyncWriter, key: str, n: int) -> bool:
    """Wait until the writer's counter `key` reaches `n`."""
    return wait_counters(w._counters, lambda s: s[key] >= n, WAIT)


def in_thread(fn, *args) -> tuple[threading.Thread, list]:
    """Run `fn(*args)` in a new thread; its return value lands in the returned list."""
    out: list = []
    th = threading.Thread(target=lambda: out.append(fn(*args)))
    th.start()
    return th, out


# ---- shutdown protocol ----------------------------------------------------------------------


def test_stop_drains_full_queue(writers):
    sink = Sink()
    sink.gate.clear()
    w = writers(sink, queue_size=8)
    blocks = [make_block(i) for i in range(9)]
    assert w.enqueue(blocks[0])
    assert sink.wait_calls(1)  # the worker holds block 0; the next 8 fill the queue
    assert all(w.enqueue(b) for b in blocks[1:])
    assert w.queue_depth() == 8

    stopper, result = in_thread(w.stop, WAIT)
    assert not result  # stop cannot have finished: the sink is closed
    sink.gate.set()
    stopper.join(WAIT)
    assert result == [True]
    assert sink.hashes == [b.block_hash for b in blocks]  # all written, in order
    assert sink.batches[1:] == [[b.block_hash for b in blocks[1:]]]  # the queued 8 coalesced
    assert w.queue_depth() == 0
    stats = w.get_stats()
    assert stats["writer_enqueue_total"] == stats["writer_save_success"] == 9
    assert not w.enqueue(make_block("late"))
    assert w.enqueue_many([make_block("late"), make_block("later")]) == 0
    assert w.get_stats()["writer_enqueue_rejected"] == 3  # per block


def test_stop_is_idempotent(writers):
    sink = Sink()
    w = writers(sink)
    assert w.enqueue(make_block(1))
    assert w.stop(WAIT) is True
    assert w.stop(WAIT) is True
    assert sink.hashes == [make_block(1).block_hash]


def test_stop_times_out_when_sink_blocked_then_finishes(writers):
    sink = Sink()
    sink.gate.clear()
    w = writers(sink, queue_size=1)
    assert w.enqueue(make_block(1))
    assert sink.wait_calls(1)
    assert w.enqueue(make_block(2))  # queue full (the sentinel still goes in: it holds no bytes)
    assert w.stop(0.1) is False  # worker stuck in save_blocks
    assert not w.enqueue(make_block(3))  # closing: refused
    sink.gate.set()
    assert w.stop(WAIT) is True  # the thread drains what was accepted and ends
    assert sink.hashes == hashes_of(1, 2)


def test_stop_timeout_with_enqueue_in_flight_still_ends_thread(writers):
    """stop() gives up while an enqueue is inside its synchronous fallback (durable): the last
    enqueue to leave places the sentinel, so the non-daemon thread still ends once the sink frees."""
    sink = Sink()
    sink.gate.clear()
    w = writers(sink, queue_size=1, durability="durable", enqueue_wait_s=0.0)
    assert w.enqueue(make_block("a"))
    assert sink.wait_calls(1)  # worker holds a
    assert w.enqueue(make_block("b"))  # fills the queue
    producer, returned = in_thread(w.enqueue_many, [make_block("c"), make_block("d")])
    assert sink.wait_calls(2)  # [c, d] is being saved on the producer's thread
    assert w.stop(0.1) is False
    sink.gate.set()
    producer.join(WAIT)
    assert returned == [2]
    assert w.stop(WAIT) is True
    assert sorted(sink.hashes) == sorted(hashes_of(*"abcd"))


def _race_stop_with_producers(n_threads: int, per_thread: int, queue_size: int, queue_blocks_bytes: int,
                              stop_after: int, durability: str) -> None:
    sink = Sink()
    w = AsyncWriter(sink, queue_size=queue_size, max_queue_bytes=queue_blocks_bytes * NB, batch_max_bytes=4 * NB,
                    durability=durability, enqueue_wait_s=0.0)
    start = threading.Barrier(n_threads + 1, timeout=WAIT)
    go_stop = threading.Event()
    count_lock = threading.Lock()
    attempted = [0]
    accepted: list[str] = []
    offered = [0]

    def produce(t: int) -> None:
        start.wait()
        for i in range(per_thread):
            batch = [make_block(f"{t}-{i}-{j}") for j in range(1 + (t + i) % 3)]
            n = w.enqueue_many(batch)
            assert n in (0, len(batch))  # unique hashes: all accepted, or all refused (closing) or shed
            with count_lock:
                offered[0] += len(batch)
                if n:
                    accepted.extend(b.block_hash for b in batch)
                attempted[0] += 1
                if attempted[0] >= stop_after:
                    go_stop.set()

    threads = [threading.Thread(target=produce, args=(t,)) for t in range(n_threads)]
    for th in threads:
        th.start()
    start.wait()
    if stop_after == 0:
        go_stop.set()
    assert go_stop.wait(WAIT)
    try:
        assert w.stop(WAIT) is True
    finally:
        for th in threads:
            th.join(WAIT)
        assert not any(th.is_alive() for th in threads), "a producer hung"
    saved = sink.hashes
    assert sorted(saved) == sorted(accepted)  # nothing accepted was lost, nothing else written
    stats = w.get_stats()
    assert stats["writer_enqueue_total"] == len(accepted) == stats["writer_save_success"]
    # what was not accepted was refused (closing) or shed (queue full; never under durable)
    assert stats["writer_enqueue_rejected"] + stats["writer_shed_blocks"] == offered[0] - len(accepted)
    assert stats["writer_shed_bytes"] == stats["writer_shed_blocks"] * NB
    if durability == "durable":
        assert stats["writer_shed_blocks"] == 0
    else:
        assert stats["writer_queue_full_sync_fallback"] == 0  # nothing saved on a producer's thread
        assert all(ident == w._thread.ident for _, ident in sink.calls)
    assert stats["writer_queue_depth"] == 0 and stats["writer_pending"] == 0
    assert stats["writer_pending_bytes"] == 0 and w.queue_bytes() == 0


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n_threads=st.integers(1, 4),
    per_thread=st.integers(0, 20),
    queue_size=st.integers(1, 8),
    queue_blocks_bytes=st.integers(1, 8),
    stop_frac=st.floats(0.0, 1.0),
    durability=st.sampled_from(["best_effort", "persistent", "durable"]),
)
def test_stop_racing_enqueue_never_loses_accepted_blocks(n_threads, per_thread, queue_size, queue_blocks_bytes,
                                                         stop_frac, durability):
    total = n_threads * per_thread
    _race_stop_with_producers(n_threads, per_thread, queue_size, queue_blocks_bytes, int(stop_frac * total),
                              durability)


# ---- batches and coalescing -------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["async", "sync"])
def test_enqueue_many_is_one_save_call_in_order(writers, kind):
    sink = Sink()
    w = writers(sink, kind)
    blocks = [make_block(c) for c in "abc"]
    assert w.enqueue_many(blocks) == 3
    assert w.enqueue_many([]) == 0
    assert w.flush(WAIT)
    assert sink.batches == [hashes_of(*"abc")]
    stats = w.get_stats()
    assert stats["writer_enqueue_total"] == stats["writer_save_success"] == 3


def test_enqueue_many_skips_pending_hashes(writers):
    sink = Sink()
    a, b = make_block("a"), make_block("b")
    release = sink.hold(a.block_hash)
    w = writers(sink)
    assert w.enqueue_many([a]) == 1
    assert sink.wait_calls(1)  # a is being written: still pending
    assert w.enqueue_many([a, b, b]) == 1  # a pending, b repeated
    assert w.get_stats()["writer_enqueue_dedup_skip"] == 2
    release.set()
    assert w.flush(WAIT)
    assert sink.batches == [hashes_of("a"), hashes_of("b")]
    assert w.get_stats()["writer_enqueue_total"] == 2


def test_sync_enqueue_many_saves_a_repeated_hash_once(writers):
    sink = Sink()
    w = writers(sink, "sync")
    a, b = make_block("a"), make_block("b")
    assert w.enqueue_many([a, b, a]) == 2
    assert sink.calls == [(tuple(hashes_of("a", "b")), threading.get_ident())]
    stats = w.get_stats()
    assert stats["writer_enqueue_dedup_skip"] == 1 and stats["writer_enqueue_total"] == 2


def test_worker_coalesces_queued_batches_into_one_save(writers):
    sink = Sink()
    release = sink.hold(make_block("x").block_hash)
    w = writers(sink)
    assert w.enqueue(make_block("x"))
    assert sink.wait_calls(1)  # the worker is busy: the next batches wait in the queue
    assert w.enqueue_many([make_block("b1"), make_block("b2")]) == 2
    assert w.enqueue_many([make_block("c1")]) == 1
    assert w.enqueue_many([make_block("d1"), make_block("d2")]) == 2
    assert w.queue_depth() == 5 and w.queue_bytes() == 6 * NB
    assert w.get_pending(make_block("c1").block_hash) is not None
    release.set()
    assert w.flush(WAIT)
    assert sink.batches == [hashes_of("x"), hashes_of("b1", "b2", "c1", "d1", "d2")]
    assert all(ident != threading.get_ident() for _, ident in sink.calls)
    assert w.get_stats()["writer_save_success"] == 6 and w.queue_bytes() == 0


def test_concurrent_small_enqueues_coalesce(writers):
    sink = Sink()
    release = sink.hold(make_block("x").block_hash)
    w = writers(sink)
    assert w.enqueue(make_block("x"))
    assert sink.wait_calls(1)
    n = 6
    start = threading.Barrier(n, timeout=WAIT)
    batches = {t: [make_block(f"{t}-{j}") for j in range(2)] for t in range(n)}

    def go(t: int) -> None:
        start.wait()
        assert w.enqueue_many(batches[t]) == 2

    threads = [threading.Thread(target=go, args=(t,)) for t in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(WAIT)
    release.set()
    assert w.flush(WAIT)
    assert len(sink.calls) == 2  # x, then every producer's batch in one call (one segment)
    second = sink.batches[1]
    assert sorted(second) == sorted(b.block_hash for bs in batches.values() for b in bs)
    for bs in batches.values():  # each batch stays contiguous and in order
        i = second.index(bs[0].block_hash)
        assert second[i : i + 2] == [b.block_hash for b in bs]


def test_coalescing_stops_at_batch_max_bytes(writers):
    sink = Sink()
    release = sink.hold(make_block("x").block_hash)
    w = writers(sink, batch_max_bytes=3 * NB)
    assert w.enqueue(make_block("x"))
    assert sink.wait_calls(1)
    for group in (["b1", "b2"], ["c1"], ["d1", "d2"], ["e1", "e2", "e3", "e4"], ["f1"]):
        assert w.enqueue_many([make_block(n) for n in group]) == len(group)
    release.set()
    assert w.flush(WAIT)
    assert sink.batches == [
        hashes_of("x"),
        hashes_of("b1", "b2", "c1"),  # d1, d2 would pass 3 blocks' bytes
        hashes_of("d1", "d2"),
        hashes_of("e1", "e2", "e3", "e4"),  # a batch over the cap is saved whole, alone
        hashes_of("f1"),
    ]


def test_default_batch_and_queue_caps():
    assert DEFAULT_BATCH_MAX_BYTES == 64 * MiB and DEFAULT_MAX_QUEUE_BYTES == 256 * MiB
    w = AsyncWriter(Sink())
    try:
        assert w.max_queue_bytes == DEFAULT_MAX_QUEUE_BYTES and w._batch_max_bytes == DEFAULT_BATCH_MAX_BYTES
    finally:
        assert w.stop(WAIT)


# ---- de-duplication and pending lookups ----------------------------------------------------


def test_same_hash_from_many_threads_is_written_once(writers):
    sink = Sink()
    sink.gate.clear()
    w = writers(sink)
    block = make_block("same")
    n = 8
    start = threading.Barrier(n, timeout=WAIT)
    results: list[bool] = []
    lock = threading.Lock()

    def go() -> None:
        start.wait()
        ok = w.enqueue(block)
        with lock:
            results.append(ok)

    threads = [threading.Thread(target=go) for _ in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(WAIT)
    assert sorted(results) == [False] * (n - 1) + [True]
    sink.gate.set()
    assert w.flush(WAIT)
    assert sink.hashes == [block.block_hash]
    stats = w.get_stats()
    assert stats["writer_enqueue_total"] == 1 and stats["writer_enqueue_dedup_skip"] == n - 1
    # once written, the hash may be queued again (the store answers 'dedup')
    assert w.enqueue(block)


def test_get_pending_serves_queued_and_in_flight_blocks(writers):
    sink = Sink()
    a, b, c = make_block("a"), make_block("b"), make_block("c")
    release_a = sink.hold(a.block_hash)
    w = writers(sink)
    assert w.enqueue(a)
    assert sink.wait_calls(1)
    assert w.enqueue_many([b, c]) == 2
    assert w.get_pending(a.block_hash) is a  # being written
    assert w.get_pending(b.block_hash) is b and w.get_pending(c.block_hash) is c  # still queued
    assert w.get_pending(make_block("zz").block_hash) is None
    stats = w.get_stats()
    assert stats["writer_pending"] == 3 and stats["writer_pending_bytes"] == 3 * NB
    release_a.set()
    assert w.flush(WAIT)
    assert all(w.get_pending(x.block_hash) is None for x in (a, b, c))
    assert w.get_stats()["writer_pending_bytes"] == 0


def test_get_pending_keeps_block_until_final_failure(writers):
    sink = Sink(default="error")
    block = make_block("x")
    gate = sink.hold(block.block_hash)
    w = writers(sink, durability="persistent", max_retries=2, sleep=no_sleep)
    assert w.enqueue(block)
    assert sink.wait_calls(1)
    assert w.get_pending(block.block_hash) is block
    gate.set()
    assert w.flush(WAIT)
    assert w.get_pending(block.block_hash) is None
    assert len(sink.calls) == 3


# ---- backpressure, bounded in bytes -------------------------------------------------------------


def test_durable_full_queue_falls_back_to_synchronous_save(writers):
    sink = Sink()
    sink.gate.clear()
    w = writers(sink, queue_size=1, durability="durable")
    a, b, c = make_block("a"), make_block("b"), make_block("c")
    assert w.enqueue(a)
    assert sink.wait_calls(1)  # worker holds a
    assert w.enqueue(b)  # queue now full (blocks)
    producer, returned = in_thread(w.enqueue, c)
    assert sink.wait_calls(2)  # after the 50 ms wait for room
    assert sink.calls[1] == ((c.block_hash,), producer.ident)  # saved on the caller's thread
    assert w.get_pending(c.block_hash) is c  # still a hit while its sync save runs
    stats = w.get_stats()
    assert stats["writer_backpressure_waits"] == 1
    assert stats["writer_queue_full_sync_fallback"] == 1
    assert stats["writer_shed_blocks"] == stats["writer_shed_bytes"] == 0
    sink.gate.set()
    producer.join(WAIT)
    assert returned == [True]
    assert w.stop(WAIT)
    assert sorted(sink.hashes) == sorted([a.block_hash, b.block_hash, c.block_hash])
    assert w.get_stats()["writer_save_success"] == 3


def test_byte_bound_durable_waits_for_room(writers):
    """The queue is full by bytes long before it is full by blocks; durable waits for room."""
    sink = Sink()
    a = make_block("a")
    release_a = sink.hold(a.block_hash)
    w = writers(sink, queue_size=1000, max_queue_bytes=3 * NB, enqueue_wait_s=WAIT * 5, durability="durable")
    assert w.enqueue(a)
    assert sink.wait_calls(1)  # a is being written: its bytes still count
    assert w.enqueue_many([make_block("b"), make_block("c")]) == 2  # queued: 3 blocks' bytes held
    assert w.queue_bytes() == 3 * NB and w.get_stats()["writer_backpressure_waits"] == 0

    # no room for d; the producer waits until the worker has finished a
    producer, returned = in_thread(w.enqueue, make_block("d"))
    assert wait_counter(w, "writer_backpressure_waits", 1)
    assert not returned and w.queue_bytes() == 3 * NB
    release_a.set()
    producer.join(WAIT)
    assert returned == [True]
    assert w.flush(WAIT)
    assert sink.hashes == hashes_of(*"abcd")
    assert all(ident != producer.ident for _, ident in sink.calls)  # all on the worker
    assert w.get_stats()["writer_queue_full_sync_fallback"] == 0


def test_byte_bound_durable_saves_on_caller_thread_when_no_room(writers):
    sink = Sink()
    a = make_block("a")
    release_a = sink.hold(a.block_hash)
    w = writers(sink, queue_size=1000, max_queue_bytes=3 * NB, enqueue_wait_s=0.0, durability="durable")
    assert w.enqueue(a)
    assert sink.wait_calls(1)
    assert w.enqueue_many([make_block("b"), make_block("c")]) == 2
    assert w.enqueue_many([make_block("d"), make_block("e")]) == 2  # no room: saved here, now
    assert sink.calls[1] == (tuple(hashes_of("d", "e")), threading.get_ident())
    stats = w.get_stats()
    assert stats["writer_backpressure_waits"] == 1  # one wait per batch
    assert stats["writer_queue_full_sync_fallback"] == 2  # per block
    assert stats["writer_save_success"] == 2 and w.queue_bytes() == 3 * NB
    release_a.set()
    assert w.flush(WAIT)
    assert sink.batches[2:] == [hashes_of("b", "c")]


def test_oversize_batch_is_accepted_on_an_empty_queue(writers):
    """A batch over both bounds (bytes and blocks) is queued when the queue holds nothing —
    it could never be queued otherwise — and makes later batches find no room (shed here)."""
    sink = Sink()
    big = [make_block(f"big{i}") for i in range(5)]
    release = sink.hold(big[0].block_hash)
    w = writers(sink, queue_size=2, max_queue_bytes=NB, enqueue_wait_s=0.0)
    assert w.enqueue_many(big) == 5
    assert sink.wait_calls(1)
    assert sink.calls[0] == (tuple(b.block_hash for b in big), w._thread.ident)  # on the worker
    assert w.queue_bytes() == 5 * NB and w.queue_peak_bytes() == 5 * NB
    stats = w.get_stats()
    assert stats["writer_backpressure_waits"] == stats["writer_queue_full_sync_fallback"] == 0
    # not empty any more: the next batch finds no room and is shed (best_effort)
    assert not w.enqueue(make_block("x"))
    assert len(sink.calls) == 1
    stats = w.get_stats()
    assert stats["writer_shed_blocks"] == 1 and stats["writer_shed_bytes"] == NB
    assert stats["writer_queue_full_sync_fallback"] == 0
    release.set()
    assert w.flush(WAIT)
    assert w.queue_bytes() == 0
    assert w.enqueue_many(big[:3]) == 3  # empty again: oversize accepted on the queue again
    assert w.flush(WAIT)
    assert sink.calls[1][1] == w._thread.ident
    assert make_block("x").block_hash not in sink.hashes
    assert w.get_stats()["writer_queue_peak_bytes"] == 5 * NB


def test_memory_stays_bounded_with_8_mib_blocks(writers):
    """Many 8 MiB blocks against a 32 MiB cap, the store held on an Event (durable, so nothing is
    shed): the writer never holds more than the cap, and accepted-but-unwritten bytes never
    exceed cap + one batch (saved on the producer's thread)."""
    half = np.zeros(MiB, dtype=np.float32)  # 4 MiB, shared: the test itself stays small

    def big(i: int) -> HostBlock:
        h = hashlib.blake2b(f"big-{i}".encode(), digest_size=16).hexdigest()
        return HostBlock(h, "0" * 32, np.arange(4, dtype=np.int32), [half], [half], "float32")

    blocks = [big(i) for i in range(24)]
    nb = blocks[0].nbytes
    assert nb >= 8 * MiB
    cap = 4 * nb
    sink = Sink()
    sink.gate.clear()
    seen: list[tuple[int, int]] = []  # (pending bytes, queue bytes) at every save and enqueue
    w = writers(sink, queue_size=10_000, max_queue_bytes=cap, enqueue_wait_s=0.0, durability="durable")
    sink.on_call = lambda: seen.append((w.pending_bytes(), w.queue_bytes()))

    def produce() -> None:
        for b in blocks[1:]:
            assert w.enqueue(b)
            seen.append((w.pending_bytes(), w.queue_bytes()))

    assert w.enqueue(blocks[0])
    assert sink.wait_calls(1)  # the worker holds block 0
    producer, _ = in_thread(produce)
    assert sink.wait_calls(2)  # blocks 1-3 queued, block 4 saved on the producer's thread
    assert w.queue_depth() == 3 and w.queue_bytes() == cap
    assert w.pending_bytes() == cap + nb
    sink.gate.set()
    producer.join(WAIT * 2)
    assert not producer.is_alive()
    assert w.flush(WAIT)
    assert sorted(sink.hashes) == sorted(b.block_hash for b in blocks)
    assert max(p for p, _ in seen) <= cap + nb
    assert max(q for _, q in seen) <= cap
    assert w.get_stats()["writer_pending_bytes"] == 0 and w.queue_bytes() == 0
    assert w.queue_peak_bytes() == cap


# ---- durability and retries -------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["async", "sync"])
@pytest.mark.parametrize("durability", ["persistent", "durable"])
@pytest.mark.parametrize("max_retries", [0, 1, 3])
def test_retry_modes_retry_exactly_n_times_then_give_up(writers, caplog, kind, durability, max_retries):
    sink = Sink(default="error")
    delays: list[float] = []
    w = writers(sink, kind, durability=durability, max_retries=max_retries, retry_backoff_s=0.01,
                sleep=delays.append)
    block = make_block("r")
    with caplog.at_level(logging.WARNING, logger="kvtool.tiers.writer"):
        assert w.enqueue(block)
        assert w.flush(WAIT)
    assert sink.hashes == [block.block_hash] * (1 + max_retries)
    assert delays == pytest.approx([0.01 * 2**i for i in range(max_retries)])
    stats = w.get_stats()
    assert stats["writer_retry_attempts"] == max_retries
    assert stats["writer_retry_final_fail"] == 1
    assert stats["writer_save_fail"] == 1 and stats["writer_save_success"] == 0
    assert any("failed after" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


@pytest.mark.parametrize("kind", ["async", "sync"])
def test_persistent_retry_stops_at_first_success(writers, kind):
    sink = Sink(outcomes=["error", OSError("disk hiccup"), "saved"])
    w = writers(sink, kind, durability="persistent", max_retries=5, sleep=no_sleep)
    assert w.enqueue(make_block("s"))
    assert w.flush(WAIT)
    assert len(sink.calls) == 3
    stats = w.get_stats()
    assert stats["writer_retry_attempts"] == 2
    assert stats["writer_save_success"] == 1
    assert stats["writer_save_fail"] == stats["writer_retry_final_fail"] == 0


@pytest.mark.parametrize("kind", ["async", "sync"])
def test_partial_batch_retries_only_failed_blocks(writers, kind):
    sink = Sink(outcomes=[["saved", "error", "dedup", "error"], ["error", "saved"], ["saved"]])
    delays: list[float] = []
    w = writers(sink, kind, durability="persistent", max_retries=3, retry_backoff_s=0.01, sleep=delays.append)
    assert w.enqueue_many([make_block(c) for c in "abcd"]) == 4
    assert w.flush(WAIT)
    assert sink.batches == [hashes_of(*"abcd"), hashes_of("b", "d"), hashes_of("b")]
    assert delays == pytest.approx([0.01, 0.02])
    stats = w.get_stats()
    assert stats["writer_retry_attempts"] == 3  # blocks retried: b and d, then b
    assert stats["writer_save_success"] == 3 and stats["writer_dedup"] == 1
    assert stats["writer_save_fail"] == stats["writer_retry_final_fail"] == 0


@pytest.mark.parametrize("kind", ["async", "sync"])
def test_partial_batch_final_failure_counts_blocks(writers, kind, caplog):
    sink = Sink(outcomes=[["error", "saved", "collision"]], default="error")
    w = writers(sink, kind, durability="durable", max_retries=2, sleep=no_sleep)
    with caplog.at_level(logging.WARNING, logger="kvtool.tiers.writer"):
        assert w.enqueue_many([make_block(c) for c in "abc"]) == 3
        assert w.flush(WAIT)
    assert sink.batches == [hashes_of(*"abc"), hashes_of("a"), hashes_of("a")]
    stats = w.get_stats()
    assert stats["writer_save_success"] == stats["writer_collision"] == stats["writer_save_fail"] == 1
    assert stats["writer_retry_attempts"] == 2 and stats["writer_retry_final_fail"] == 1
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("failed after 2 retries" in m for m in messages)
    assert any("collision" in m for m in messages)


@pytest.mark.parametrize("kind", ["async", "sync"])
@pytest.mark.parametrize("bad", [OSError("gone"), ["saved"], "nonsense"])
def test_exception_or_bad_answer_retries_the_whole_batch(writers, kind, bad):
    sink = Sink(outcomes=[bad, ["saved", "error"], "saved"])
    w = writers(sink, kind, durability="persistent", max_retries=3, sleep=no_sleep)
    assert w.enqueue_many([make_block("a"), make_block("b")]) == 2
    assert w.flush(WAIT)
    assert sink.batches == [hashes_of("a", "b"), hashes_of("a", "b"), hashes_of("b")]
    stats = w.get_stats()
    assert stats["writer_retry_attempts"] == 3 and stats["writer_save_success"] == 2


@pytest.mark.parametrize("kind", ["async", "sync"])
@pytest.mark.parametrize("failure", ["error", RuntimeError("boom"), "nonsense"])
def test_best_effort_makes_one_attempt(writers, kind, failure):
    sink = Sink(outcomes=[failure])
    f = make_block("f")
    release_f = sink.hold(f.block_hash)
    if kind == "sync":
        release_f.set()
    w = writers(sink, kind, durability="best_effort", max_retries=3, sleep=no_sleep)
    assert w.enqueue(f)
    assert sink.wait_calls(1)
    assert w.enqueue(make_block("g"))  # the writer keeps working after a failure
    release_f.set()
    assert w.flush(WAIT)
    assert sink.batches == [hashes_of("f"), hashes_of("g")]
    stats = w.get_stats()
    assert stats["writer_save_fail"] == 1 and stats["writer_save_success"] == 1
    assert stats["writer_retry_attempts"] == stats["writer_retry_final_fail"] == 0


@pytest.mark.parametrize("kind", ["async", "sync"])
def test_best_effort_batch_is_one_call_whatever_fails(writers, kind):
    sink = Sink(outcomes=[["error", "saved", "error"]])
    w = writers(sink, kind, durability="best_effort", max_retries=3, sleep=no_sleep)
    assert w.enqueue_many([make_block(c) for c in "abc"]) == 3
    assert w.flush(WAIT)
    assert len(sink.calls) == 1
    stats = w.get_stats()
    assert stats["writer_save_fail"] == 2 and stats["writer_save_success"] == 1
    assert stats["writer_retry_attempts"] == stats["writer_retry_final_fail"] == 0


def test_timed_out_stop_cuts_retries_short(writers):
    """After stop() gives up, a failing block gets no further retries (the non-daemon thread
    must not keep the process alive through a long backoff series)."""
    sink = Sink(default="error")
    block = make_block("slow")
    gate = sink.hold(block.block_hash)
    w = writers(sink, durability="persistent", max_retries=3, retry_backoff_s=30.0)
    assert w.enqueue(block)
    assert sink.wait_calls(1)
    assert w.stop(0.05) is False
    gate.set()
    assert w.stop(WAIT) is True
    assert len(sink.calls) == 1
    stats = w.get_stats()
    assert stats["writer_retry_attempts"] == 0 and stats["writer_retry_final_fail"] == 1


def test_timed_out_stop_interrupts_backoff_wait(writers):
    sink = Sink(default="error")
    w = writers(sink, durability="durable", max_retries=3, retry_backoff_s=30.0)
    assert w.enqueue_many([make_block("b"), make_block("c")]) == 2
    assert sink.wait_calls(1)  # first attempt failed; the worker now waits 30 s to retry
    assert w.stop(0.05) is False
    assert w.stop(WAIT) is True  # the wait was interrupted, not served
    assert len(sink.calls) == 1 and w.get_stats()["writer_retry_final_fail"] == 2


@pytest.mark.parametrize("answer,counter", [("dedup", "writer_dedup"), ("collision", "writer_collision"),
                                            ("refused", "writer_budget_refused")])
def test_dedup_collision_and_refused_are_final_not_retried(writers, answer, counter):
    sink = Sink(default=answer)
    w = writers(sink, durability="persistent", max_retries=3, sleep=no_sleep)
    assert w.enqueue(make_block("d"))
    assert w.flush(WAIT)
    assert len(sink.calls) == 1
    stats = w.get_stats()
    assert stats[counter] == 1 and stats["writer_retry_attempts"] == 0 and stats["writer_save_fail"] == 0


# ---- flush ------------------------------------------------------------------------------------


def test_flush_waits_for_outstanding_blocks(writers):
    sink = Sink()
    sink.gate.clear()
    w = writers(sink)
    assert w.enqueue(make_block(1)) and w.enqueue_many([make_block(2), make_block(3)]) == 2
    assert w.flush(0.05) is False
    flusher, result = in_thread(w.flush, WAIT)
    assert not result
    sink.gate.set()
    flusher.join(WAIT)
    assert result == [True]
    assert sink.hashes == hashes_of(1, 2, 3)
    assert w.get_stats()["writer_pending"] == 0


def test_flush_on_idle_writer_returns_at_once(writers):
    w = writers(Sink())
    assert w.flush(0.0) is True


# ---- SyncWriter, store state, factory -------------------------------------------------------------


def test_sync_writer_saves_on_caller_thread(writers):
    sink = Sink()
    w = writers(sink, "sync")
    block = make_block("s")
    assert w.enqueue(block)
    assert sink.calls == [((block.block_hash,), threading.get_ident())]
    assert w.get_pending(block.block_hash) is None
    assert w.queue_depth() == 0 and w.flush(0.0) is True
    assert w.stop(0.0) is True and w.stop(0.0) is True
    assert not w.enqueue(make_block("t"))
    assert w.enqueue_many([make_block("u"), make_block("v")]) == 0
    stats = w.get_stats()
    assert set(COUNTER_NAMES) <= set(stats)
    assert stats["writer_enqueue_total"] == 1 and stats["writer_enqueue_rejected"] == 3


@pytest.mark.parametrize("kind", ["async", "sync"])
def test_disabled_store_refuses_blocks(writers, kind):
    sink = Sink()
    sink.enabled = False
    w = writers(sink, kind)
    assert not w.enqueue(make_block(1))
    assert w.enqueue_many([make_block(2), make_block(3)]) == 0
    assert w.flush(WAIT)
    assert sink.calls == []
    assert w.get_stats()["writer_enqueue_rejected"] == 3


def test_both_writers_expose_the_same_stats_keys(writers):
    assert set(writers(Sink()).get_stats()) == set(writers(Sink(), "sync").get_stats())


def test_invalid_arguments_raise():
    with pytest.raises(ValueError, match="durability"):
        SyncWriter(Sink(), durability="forever")
    with pytest.raises(ValueError, match="max_retries"):
        SyncWriter(Sink(), durability="persistent", max_retries=-1)
    with pytest.raises(ValueError, match="queue_size"):
        AsyncWriter(Sink(), queue_size=0)
    with pytest.raises(ValueError, match="max_queue_bytes"):
        AsyncWriter(Sink(), max_queue_bytes=0)
    with pytest.raises(ValueError, match="batch_max_bytes"):
        AsyncWriter(Sink(), batch_max_bytes=-1)
    with pytest.raises(ValueError, match="enqueue_wait_s"):
        AsyncWriter(Sink(), enqueue_wait_s=-1.0)


def test_make_writer_follows_config(writers, tmp_path):
    cfg = KVToolConfig(ssd_cache_dir=tmp_path, ssd_writer_queue_size=7, ssd_durability="persistent",
                       ssd_persistent_max_retries=2)
    w = make_writer(Sink(), cfg)
    try:
        assert isinstance(w, AsyncWriter)
        assert w._queue.max_blocks == 7 and w.max_queue_bytes == DEFAULT_MAX_QUEUE_BYTES
        assert w.durability == "persistent" and w._policy.retries == 2
    finally:
        assert w.stop(WAIT)
    s = make_writer(Sink(), cfg.replace(ssd_async_writes=False, ssd_durability="best_effort"))
    assert isinstance(s, SyncWriter) and s._policy.retries == 0


def test_worker_thread_is_not_daemon(writers):
    w = writers(Sink())
    assert w._thread.daemon is False and w._thread.is_alive()


# ---- with a real SSDStore -------------------------------------------------------------------------


@pytest.mark.parametrize("durability", ["best_effort", "durable"])
def test_real_store_blocks_readable_after_stop(tmp_path, durability):
    """queue_size=2 against a real store: durable writes every block (waiting, or saving on the
    caller's thread); best_effort writes every block it accepted and sheds the rest."""
    store = open_store(tmp_path, durability=durability)
    assert store.enabled
    chain = make_chain(make_layout(), np.arange(24), block_size=4)
    w = AsyncWriter(store, queue_size=2, durability=durability)
    try:
        accepted = [w.enqueue(b) for b in chain]
    finally:
        assert w.stop(WAIT) is True
    stats = w.get_stats()
    if durability == "durable":
        assert all(accepted) and stats["writer_shed_blocks"] == 0
    assert accepted[0]  # the first block always finds the queue empty
    written = [b for b, ok in zip(chain, accepted) if ok]
    assert stats["writer_shed_blocks"] == len(chain) - len(written)
    assert stats["writer_save_success"] == len(written) == store.stats()["ssd_save_success"]
    store.close(shutdown_clean=True)

    reopened = open_store(tmp_path, durability=durability)
    try:
        assert reopened.previous_shutdown_clean is True
        for b in written:
            loaded = reopened.load_block(b.block_hash, b.token_ids)
            assert loaded is not None
            assert_same_block(loaded, b)
        for b, ok in zip(chain, accepted):
            if not ok:  # shed: never reached the disk
                assert reopened.load_block(b.block_hash, b.token_ids) is None
    finally:
        reopened.close()


def test_real_store_one_batch_is_one_segment(tmp_path):
    store = open_store(tmp_path)
    chain = make_chain(make_layout(), np.arange(24), block_size=4)
    w = AsyncWriter(store)
    try:
        assert w.enqueue_many(chain) == len(chain)
        assert w.flush(WAIT)
        assert w.enqueue_many(chain) == len(chain)  # again: every block is a dedup
    finally:
        assert w.stop(WAIT) is True
    stats = w.get_stats()
    assert stats["writer_save_success"] == stats["writer_dedup"] == len(chain)
    assert store.stats()["ssd_segments_written"] == 1
    for b in chain:
        assert_same_block(store.load_block(b.block_hash, b.token_ids), b)
    store.close()


def test_real_store_failing_disk_is_retried_exactly_n_times(tmp_path):
    fs = FaultFS(fail={"replace": errno.EIO})
    store = open_store(tmp_path, durability="persistent", fs=fs)
    block = make_chain(make_layout(), np.arange(4), block_size=4)[0]
    w = AsyncWriter(store, durability="persistent", max_retries=2, retry_backoff_s=0.0)
    try:
        assert w.enqueue(block)
        assert w.flush(WAIT)
    finally:
        assert w.stop(WAIT)
    stats = w.get_stats()
    assert stats["writer_retry_attempts"] == 2 and stats["writer_retry_final_fail"] == 1
    assert fs.calls["replace"] == 3 and store.stats()["ssd_save_fail"] == 3
    fs.fail.clear()  # the disk recovers: the same block can be written later
    assert SyncWriter(store).enqueue(block)
    assert store.load_block(block.block_hash, block.token_ids) is not None
    store.close()
