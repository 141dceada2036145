"""kvtool.tiers.writer: write-behind. The worker writes a batch no sooner than `write_behind_s`
after it was queued (a client's next request is tokenized first), except that a flush or a stop
writes at once, a half-full queue is not held back, and durable writes never are. Held batches
are coalesced into one save."""

from __future__ import annotations

import pytest

from kvtool.tiers.writer import AsyncWriter
from tests.test_writer import WAIT, Sink, hashes_of, make_block

HELD = 60.0  # seconds: longer than any test runs, so a batch is written only when something says so


@pytest.fixture
def made():
    writers: list[AsyncWriter] = []
    yield writers
    for w in writers:
        assert w.stop(WAIT), "writer thread did not end at teardown"


def test_a_flush_writes_held_batches_at_once_as_one_save(made):
    sink = Sink()
    w = AsyncWriter(sink, write_behind_s=HELD)
    made.append(w)
    assert w.enqueue(make_block("a")) and w.enqueue(make_block("b"))
    assert not sink.wait_calls(1, timeout=0.2)  # held back: nothing written yet
    assert w.flush(WAIT)
    assert sink.batches == [hashes_of("a", "b")]  # both waited, then went together
    assert not sink.wait_calls(2, timeout=0.05)  # and nothing more
    assert w.enqueue(make_block("c"))  # after the flush, batches are held back again
    assert not sink.wait_calls(2, timeout=0.2)
    assert w.flush(WAIT) and sink.batches == [hashes_of("a", "b"), hashes_of("c")]


def test_a_stop_writes_held_batches_at_once(made):
    sink = Sink()
    w = AsyncWriter(sink, write_behind_s=HELD)
    assert w.enqueue_many([make_block("a"), make_block("b")]) == 2
    assert w.stop(WAIT)  # well before HELD
    assert sink.hashes == hashes_of("a", "b")


def test_a_half_full_queue_is_not_held_back(made):
    sink = Sink()
    w = AsyncWriter(sink, queue_size=4, write_behind_s=HELD)
    made.append(w)
    assert w.enqueue(make_block("a"))
    assert not sink.wait_calls(1, timeout=0.2)
    assert w.enqueue(make_block("b"))  # 2 of 4 blocks queued: written without a flush
    assert sink.wait_calls(1) and sink.batches == [hashes_of("a", "b")]


@pytest.mark.parametrize("durability", ["durable", "persistent"])
def test_durable_writes_are_never_held_back(made, durability):
    sink = Sink()
    w = AsyncWriter(sink, durability=durability, write_behind_s=HELD)
    made.append(w)
    assert w.enqueue(make_block("a"))
    assert sink.wait_calls(1, timeout=0.5) is (durability == "durable")
    assert w.flush(WAIT) and sink.hashes == hashes_of("a")

