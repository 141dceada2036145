"""Tests of kvtool.store.writer: the seed 000 §2 writer protocol, backpressure and retries.

Interleavings are forced with `threading.Event` / `threading.Barrier`, never with sleeps; every
wait has a timeout so a bug fails the test instead of hanging it.
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

from kvtool.blocks import HostBlock
from kvtool.config import KVToolConfig
from kvtool.store.writer import COUNTER_NAMES, AsyncWriter, SyncWriter, make_writer
from tests.store_helpers import FaultFS, assert_same_block, make_chain, make_layout, open_store

WAIT = 2.0  # seconds: upper bound of every wait in these tests


def make_block(i: int | str, n_layers: int = 2, block_size: int = 4) -> HostBlock:
    """A tiny float32 host block whose hash is derived from `i`."""
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


class Sink:
    """A fake SSDStore: records every save_block call, can hold saves on Events, scripted answers.

    Args:
        outcomes: answers to return in call order; when exhausted, `default` is returned. An
            Exception instance in the list is raised instead.
        default: answer once `outcomes` is exhausted.
    """

    def __init__(self, outcomes=(), default="saved"):
        self.enabled = True
        self.outcomes = list(outcomes)
        self.default = default
        self.gate = threading.Event()  # every save waits on it (open by default)
        self.gate.set()
        self.holds: dict[str, threading.Event] = {}  # per-hash gates overriding `gate`
        self.calls: list[tuple[str, int]] = []  # (hash, thread ident)
        self._cond = threading.Condition()

    def hold(self, block_hash: str) -> threading.Event:
        """A closed gate for one hash; set() it to let that save finish."""
        ev = threading.Event()
        self.holds[block_hash] = ev
        return ev

    def save_block(self, block):
        with self._cond:
            self.calls.append((block.block_hash, threading.get_ident()))
            answer = self.outcomes.pop(0) if self.outcomes else self.default
            self._cond.notify_all()
        if not self.holds.get(block.block_hash, self.gate).wait(WAIT * 2):
            raise RuntimeError("test gate never opened")
        if isinstance(answer, Exception):
            raise answer
        return answer

    def stats(self):
        return {"sink_calls": len(self.calls)}

    def wait_calls(self, n: int, timeout: float = WAIT) -> bool:
        """Wait until at least `n` save_block calls have started."""
        with self._cond:
            return self._cond.wait_for(lambda: len(self.calls) >= n, timeout)

    @property
    def hashes(self) -> list[str]:
        return [h for h, _ in self.calls]


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

    result: list[bool] = []
    stopper = threading.Thread(target=lambda: result.append(w.stop(WAIT)))
    stopper.start()
    assert not result  # stop cannot have finished: the sink is closed
    sink.gate.set()
    stopper.join(WAIT)
    assert result == [True]
    assert sink.hashes == [b.block_hash for b in blocks]  # all written, in order
    assert w.queue_depth() == 0
    stats = w.get_stats()
    assert stats["writer_enqueue_total"] == stats["writer_save_success"] == 9
    assert not w.enqueue(make_block("late"))
    assert w.get_stats()["writer_enqueue_rejected"] == 1


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
    assert w.enqueue(make_block(2))  # queue full: the sentinel cannot be queued behind it
    assert w.stop(0.1) is False  # worker stuck in save_block
    assert not w.enqueue(make_block(3))  # closing: refused
    sink.gate.set()
    assert w.stop(WAIT) is True  # the thread drains what was accepted and ends
    assert sink.hashes == [make_block(1).block_hash, make_block(2).block_hash]


def test_stop_timeout_with_enqueue_in_flight_still_ends_thread(writers):
    """stop() gives up while an enqueue is inside its synchronous fallback: the last enqueue
    to leave places the sentinel, so the non-daemon thread still ends once the sink frees."""
    sink = Sink()
    sink.gate.clear()
    w = writers(sink, queue_size=1)
    assert w.enqueue(make_block("a"))
    assert sink.wait_calls(1)  # worker holds a
    assert w.enqueue(make_block("b"))  # fills the queue
    returned: list[bool] = []
    producer = threading.Thread(target=lambda: returned.append(w.enqueue(make_block("c"))))
    producer.start()
    assert sink.wait_calls(2)  # c is being saved on the producer's thread
    assert w.stop(0.1) is False
    sink.gate.set()
    producer.join(WAIT)
    assert returned == [True]
    assert w.stop(WAIT) is True
    assert sorted(sink.hashes) == sorted(make_block(x).block_hash for x in "abc")


def _race_stop_with_producers(n_threads: int, per_thread: int, queue_size: int, stop_after: int) -> None:
    sink = Sink()
    w = AsyncWriter(sink, queue_size=queue_size)
    start = threading.Barrier(n_threads + 1, timeout=WAIT)
    go_stop = threading.Event()
    count_lock = threading.Lock()
    attempted = [0]
    accepted: list[str] = []

    def produce(t: int) -> None:
        start.wait()
        for i in range(per_thread):
            b = make_block(f"{t}-{i}")
            ok = w.enqueue(b)
            with count_lock:
                if ok:
                    accepted.append(b.block_hash)
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
    assert stats["writer_enqueue_rejected"] == n_threads * per_thread - len(accepted)
    assert stats["writer_queue_depth"] == 0 and stats["writer_pending"] == 0


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n_threads=st.integers(1, 4),
    per_thread=st.integers(0, 20),
    queue_size=st.integers(1, 8),
    stop_frac=st.floats(0.0, 1.0),
)
def test_stop_racing_enqueue_never_loses_accepted_blocks(n_threads, per_thread, queue_size, stop_frac):
    total = n_threads * per_thread
    _race_stop_with_producers(n_threads, per_thread, queue_size, int(stop_frac * total))


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
    a, b = make_block("a"), make_block("b")
    release_a = sink.hold(a.block_hash)
    w = writers(sink)
    assert w.enqueue(a) and w.enqueue(b)
    assert sink.wait_calls(1)
    assert w.get_pending(a.block_hash) is a  # being written
    assert w.get_pending(b.block_hash) is b  # still queued
    assert w.get_pending(make_block("zz").block_hash) is None
    assert w.get_stats()["writer_pending"] == 2
    release_a.set()
    assert w.flush(WAIT)
    assert w.get_pending(a.block_hash) is None and w.get_pending(b.block_hash) is None


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


# ---- backpressure ---------------------------------------------------------------------------


def test_full_queue_falls_back_to_synchronous_save(writers):
    sink = Sink()
    sink.gate.clear()
    w = writers(sink, queue_size=1)
    a, b, c = make_block("a"), make_block("b"), make_block("c")
    assert w.enqueue(a)
    assert sink.wait_calls(1)  # worker holds a
    assert w.enqueue(b)  # queue now full
    returned: list[bool] = []
    producer = threading.Thread(target=lambda: returned.append(w.enqueue(c)))
    producer.start()
    assert sink.wait_calls(2)
    assert sink.calls[1] == (c.block_hash, producer.ident)  # saved on the caller's thread
    assert w.get_pending(c.block_hash) is c  # still a hit while its sync save runs
    stats = w.get_stats()
    assert stats["writer_backpressure_waits"] == 1
    assert stats["writer_queue_full_sync_fallback"] == 1
    sink.gate.set()
    producer.join(WAIT)
    assert returned == [True]
    assert w.stop(WAIT)
    assert sorted(sink.hashes) == sorted([a.block_hash, b.block_hash, c.block_hash])
    assert w.get_stats()["writer_save_success"] == 3


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
    with caplog.at_level(logging.WARNING, logger="kvtool.store.writer"):
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
@pytest.mark.parametrize("failure", ["error", RuntimeError("boom"), "nonsense"])
def test_best_effort_makes_one_attempt(writers, kind, failure):
    sink = Sink(outcomes=[failure])
    w = writers(sink, kind, durability="best_effort", max_retries=3, sleep=no_sleep)
    assert w.enqueue(make_block("f"))
    assert w.enqueue(make_block("g"))  # the writer keeps working after a failure
    assert w.flush(WAIT)
    assert sink.hashes == [make_block("f").block_hash, make_block("g").block_hash]
    stats = w.get_stats()
    assert stats["writer_save_fail"] == 1 and stats["writer_save_success"] == 1
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
    assert w.enqueue(make_block("b"))
    assert sink.wait_calls(1)  # first attempt failed; the worker now waits 30 s to retry
    assert w.stop(0.05) is False
    assert w.stop(WAIT) is True  # the wait was interrupted, not served
    assert len(sink.calls) == 1 and w.get_stats()["writer_retry_final_fail"] == 1


@pytest.mark.parametrize("answer,counter", [("dedup", "writer_dedup"), ("collision", "writer_collision")])
def test_dedup_and_collision_are_final_not_retried(writers, answer, counter):
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
    assert w.enqueue(make_block(1)) and w.enqueue(make_block(2))
    assert w.flush(0.05) is False
    result: list[bool] = []
    flusher = threading.Thread(target=lambda: result.append(w.flush(WAIT)))
    flusher.start()
    assert not result
    sink.gate.set()
    flusher.join(WAIT)
    assert result == [True]
    assert len(sink.calls) == 2
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
    assert sink.calls == [(block.block_hash, threading.get_ident())]
    assert w.get_pending(block.block_hash) is None
    assert w.queue_depth() == 0 and w.flush(0.0) is True
    assert w.stop(0.0) is True and w.stop(0.0) is True
    assert not w.enqueue(make_block("t"))
    stats = w.get_stats()
    assert set(COUNTER_NAMES) <= set(stats)
    assert stats["writer_enqueue_total"] == 1 and stats["writer_enqueue_rejected"] == 1


@pytest.mark.parametrize("kind", ["async", "sync"])
def test_disabled_store_refuses_blocks(writers, kind):
    sink = Sink()
    sink.enabled = False
    w = writers(sink, kind)
    assert not w.enqueue(make_block(1))
    assert w.flush(WAIT)
    assert sink.calls == []
    assert w.get_stats()["writer_enqueue_rejected"] == 1


def test_both_writers_expose_the_same_stats_keys(writers):
    assert set(writers(Sink()).get_stats()) == set(writers(Sink(), "sync").get_stats())


def test_invalid_arguments_raise():
    with pytest.raises(ValueError, match="durability"):
        SyncWriter(Sink(), durability="forever")
    with pytest.raises(ValueError, match="max_retries"):
        SyncWriter(Sink(), durability="persistent", max_retries=-1)
    with pytest.raises(ValueError, match="queue_size"):
        AsyncWriter(Sink(), queue_size=0)


def test_make_writer_follows_config(writers, tmp_path):
    cfg = KVToolConfig(ssd_cache_dir=tmp_path, ssd_writer_queue_size=7, ssd_durability="persistent",
                       ssd_persistent_max_retries=2)
    w = make_writer(Sink(), cfg)
    try:
        assert isinstance(w, AsyncWriter)
        assert w._queue.maxsize == 7
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
    store = open_store(tmp_path, durability=durability)
    assert store.enabled
    chain = make_chain(make_layout(), np.arange(24), block_size=4)
    w = AsyncWriter(store, queue_size=2, durability=durability)
    try:
        accepted = [w.enqueue(b) for b in chain]
    finally:
        assert w.stop(WAIT) is True
    assert all(accepted)
    assert w.get_stats()["writer_save_success"] == len(chain) == store.stats()["ssd_save_success"]
    store.close(shutdown_clean=True)

    reopened = open_store(tmp_path, durability=durability)
    try:
        assert reopened.previous_shutdown_clean is True
        for b in chain:
            loaded = reopened.load_block(b.block_hash, b.token_ids)
            assert loaded is not None
            assert_same_block(loaded, b)
    finally:
        reopened.close()


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
