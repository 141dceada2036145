"""Tests of the async writer's full-queue contract on a real SSDStore.

`best_effort` and `persistent` shed a batch that finds the queue full: the enqueue returns at
once (no wait for room, no save on the caller's thread), the blocks are counted as shed and never
reach the disk, and every block accepted before is still written. `durable` (or a call with
`must_write=True`) waits for room and then saves the batch on the caller's thread.

The store's file writes are held on a `threading.Event` (a gated `FileOps`), so the worker sits
inside a save while the queue fills; no sleeps. "Returns at once" is checked by running the
enqueue in a thread and joining it with a generous timeout, while the writer is configured to
wait far longer than that timeout if it ever waited.
"""

from __future__ import annotations

import logging
import threading

import numpy as np
import pytest

from kvtool.disk.fsops import FileOps
from kvtool.disk.hostblock import HostBlock
from kvtool.disk.namespace import SSDStore
from kvtool.tiers.writer import AsyncWriter
from kvtool.tiers.writer_batch import ShedLog
from tests.store_helpers import make_chain, make_layout, open_store, wait_counters

WAIT = 5.0  # seconds: upper bound of every wait in these tests
NEVER = 600.0  # seconds: an enqueue wait no test could sit through (the shedding modes never wait)


class GatedFS(FileOps):
    """FileOps whose `write_all` holds until `gate` is set; records which threads wrote.

    Attributes:
        gate: closed at first; set() lets every held and later write go through.
        entered: set once a write has started (a save is under way and held).
        writers: thread ident of every `write_all` call, in call order.
    """

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.writers: list[int] = []
        self._lock = threading.Lock()

    def write_all(self, fd, data) -> None:
        with self._lock:
            self.writers.append(threading.get_ident())
        self.entered.set()
        if not self.gate.wait(WAIT * 4):
            raise RuntimeError("test gate never opened")
        super().write_all(fd, data)


class FakeClock:
    """A monotonic clock the test moves by hand (seconds)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def in_thread(fn, *args, **kwargs) -> tuple[threading.Thread, list]:
    """Run `fn(*args, **kwargs)` in a new thread; its return value lands in the returned list."""
    out: list = []
    th = threading.Thread(target=lambda: out.append(fn(*args, **kwargs)))
    th.start()
    return th, out


@pytest.fixture
def gated(tmp_path):
    """(store factory, fs): a real SSDStore per durability over one gated FileOps; at teardown
    the gate opens and the store closes."""
    fs = GatedFS()
    opened: list[SSDStore] = []

    def factory(durability: str) -> SSDStore:
        store = open_store(tmp_path, durability=durability, fs=fs)
        assert store.enabled
        opened.append(store)
        return store

    yield factory, fs
    fs.gate.set()
    for store in opened:
        store.close()


def nbytes(blocks: list[HostBlock]) -> int:
    return sum(b.nbytes for b in blocks)


def fill_queue(w: AsyncWriter, fs: GatedFS, chain: list[HostBlock]) -> None:
    """chain[0] held inside the worker's save, chain[1:3] queued: the queue (2 blocks) is full."""
    assert w.enqueue_many(chain[:1]) == 1
    assert fs.entered.wait(WAIT)  # the worker is inside save_blocks, held on the gate
    assert w.enqueue_many(chain[1:3]) == 2
    assert w.queue_depth() == 2


def test_when_full_shed_drops_at_once_whatever_the_durability(gated):
    """`when_full="shed"` (the remote tier's policy) sheds under `durable` too, tells `on_drop`,
    and its daemon worker still writes what it accepted."""
    factory, fs = gated
    store = factory("durable")
    chain = make_chain(make_layout(), np.arange(4 * 8), block_size=4)
    dropped: list[int] = []
    w = AsyncWriter(store, queue_size=2, durability="durable", enqueue_wait_s=NEVER, when_full="shed", daemon=True,
                    name="remote", on_drop=dropped.append)
    fill_queue(w, fs, chain)
    producer, returned = in_thread(w.enqueue_many, chain[3:5])
    producer.join(WAIT)
    assert not producer.is_alive() and returned == [0] and dropped == [2]
    assert w._thread.daemon and fs.writers == [w._thread.ident]
    fs.gate.set()
    assert w.stop(WAIT) and store.saved_count(b.block_hash for b in chain[:3]) == 3
    assert w.enqueue_many(chain[5:6]) == 0 and dropped == [2, 1]  # stopped: refused, told


@pytest.mark.parametrize("durability", ["best_effort", "persistent"])
def test_full_queue_sheds_at_once_and_accepted_blocks_are_written(gated, caplog, durability):
    factory, fs = gated
    store = factory(durability)
    chain = make_chain(make_layout(), np.arange(4 * 8), block_size=4)
    w = AsyncWriter(store, queue_size=2, durability=durability, enqueue_wait_s=NEVER)
    clock = FakeClock()
    w._shed_log = ShedLog(clock=clock)
    try:
        fill_queue(w, fs, chain)
        assert w.queue_peak_bytes() == nbytes(chain[:3])  # one being written + two queued

        with caplog.at_level(logging.WARNING, logger="kvtool.tiers.writer"):
            producer, returned = in_thread(w.enqueue_many, chain[3:5])
            producer.join(WAIT)  # would take NEVER seconds if the writer waited for room
            assert not producer.is_alive(), "enqueue blocked on a full queue"
            assert returned == [0]  # shed: nothing accepted
            assert fs.writers == [w._thread.ident]  # nothing was written on the caller's thread
            assert all(w.get_pending(b.block_hash) is None for b in chain[3:5])

            stats = w.get_stats()
            assert stats["writer_shed_blocks"] == 2 and stats["writer_shed_bytes"] == nbytes(chain[3:5])
            assert stats["writer_queue_full_sync_fallback"] == stats["writer_backpressure_waits"] == 0
            assert stats["writer_enqueue_total"] == 3 and stats["writer_pending"] == 3
            shed_lines = [r for r in caplog.records if "shed" in r.getMessage()]
            assert len(shed_lines) == 1 and shed_lines[0].levelno == logging.WARNING
            assert "shed 2 block(s)" in shed_lines[0].getMessage()

            # a second shed within the minute: counted, not logged yet
            clock.now += 30.0
            assert w.enqueue(chain[5]) is False
            assert w.get_stats()["writer_shed_blocks"] == 3
            assert len([r for r in caplog.records if "shed" in r.getMessage()]) == 1

            fs.gate.set()
            assert w.flush(WAIT)
            assert w.stop(WAIT) is True
            # stop() reports what was shed since the last line
            shed_lines = [r.getMessage() for r in caplog.records if "shed" in r.getMessage()]
            assert len(shed_lines) == 2 and "shed 1 block(s)" in shed_lines[1]
    finally:
        fs.gate.set()
        assert w.stop(WAIT)

    stats = w.get_stats()
    assert stats["writer_save_success"] == 3 == store.stats()["ssd_save_success"]
    assert stats["writer_pending"] == 0 and stats["writer_queue_depth"] == 0
    assert set(fs.writers) == {w._thread.ident}
    for b in chain[:3]:  # accepted: all written once the gate opened
        assert store.load_block(b.block_hash, b.token_ids) is not None
    for b in chain[3:6]:  # shed: never written
        assert store.load_block(b.block_hash, b.token_ids) is None


@pytest.mark.parametrize("durability,must_write", [("durable", False), ("best_effort", True), ("persistent", True)])
def test_durable_or_must_write_waits_then_saves_on_caller_thread(gated, durability, must_write):
    factory, fs = gated
    store = factory(durability)
    chain = make_chain(make_layout(), np.arange(4 * 8), block_size=4)
    w = AsyncWriter(store, queue_size=2, durability=durability, enqueue_wait_s=0.01)
    try:
        fill_queue(w, fs, chain)
        producer, returned = in_thread(w.enqueue_many, chain[3:5], must_write=must_write)
        # it waited for room, found none, and is now saving on its own thread (held on the gate)
        assert wait_counters(w._counters, lambda s: s["writer_queue_full_sync_fallback"] == 2, WAIT)
        assert w.get_stats()["writer_backpressure_waits"] == 1
        assert not returned  # still held: a durable enqueue does not return before its save
        assert w.get_pending(chain[3].block_hash) is chain[3]  # still a hit meanwhile
        fs.gate.set()
        producer.join(WAIT)
        assert returned == [2]
        assert producer.ident in fs.writers  # the batch was written by the caller's thread
        assert w.flush(WAIT)
    finally:
        fs.gate.set()
        assert w.stop(WAIT) is True
    stats = w.get_stats()
    assert stats["writer_shed_blocks"] == stats["writer_shed_bytes"] == 0
    assert stats["writer_enqueue_total"] == stats["writer_save_success"] == 5
    for b in chain[:5]:
        assert store.load_block(b.block_hash, b.token_ids) is not None


def test_room_again_after_the_worker_catches_up(gated):
    """Shedding is per batch: once the worker has drained, the next batch is queued again."""
    factory, fs = gated
    store = factory("best_effort")
    chain = make_chain(make_layout(), np.arange(4 * 8), block_size=4)
    w = AsyncWriter(store, queue_size=2, enqueue_wait_s=NEVER)
    try:
        fill_queue(w, fs, chain)
        assert w.enqueue_many(chain[3:5]) == 0
        fs.gate.set()
        assert w.flush(WAIT)
        assert w.enqueue_many(chain[3:5]) == 2  # the same blocks, now accepted
        assert w.flush(WAIT)
    finally:
        fs.gate.set()
        assert w.stop(WAIT) is True
    stats = w.get_stats()
    assert stats["writer_shed_blocks"] == 2 and stats["writer_save_success"] == 5
    for b in chain[:5]:
        assert store.load_block(b.block_hash, b.token_ids) is not None


def test_shed_log_rate_limit_and_counts_since_last_line(caplog):
    clock = FakeClock()
    log = ShedLog(interval_s=60.0, clock=clock)
    with caplog.at_level(logging.WARNING, logger="kvtool.tiers.writer"):
        assert log.flush() is False  # nothing shed: no line
        assert log.add(1, 10) is True  # the first shed is logged at once
        clock.now += 59.0
        assert log.add(2, 20) is False
        clock.now += 0.5
        assert log.add(3, 30) is False
        clock.now += 0.5  # 60 s after the first line
        assert log.add(4, 40) is True
        assert log.flush() is False
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert "shed 1 block(s) (10 bytes)" in lines[0]
    assert "shed 9 block(s) (90 bytes)" in lines[1]  # everything since the previous line
