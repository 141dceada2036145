"""SSD block writers: `AsyncWriter` (one background thread) and `SyncWriter` (caller's thread).

Both take `HostBlock`s (numpy, already materialised on the request thread) and hand them to
`SSDStore.save_block`, so this module never imports MLX. They share one interface, so the tiered
cache treats them alike: `enqueue`, `get_pending`, `queue_depth`, `flush`, `stop`, `get_stats`.

`AsyncWriter` follows seed 000 §2 ("SSDWriterThread"):
- a bounded `queue.Queue` fed by `enqueue`, drained by one non-daemon worker thread;
- `_pending` (hash -> block) de-duplicates a hash already queued and serves `get_pending`, so a
  block queued but not yet written is still a cache hit; an entry leaves only after its save
  attempt (retries included) has finished;
- 3-level backpressure (seed levels 0, 1, 2): `put_nowait` -> `put` with a 50 ms timeout ->
  synchronous save on the caller's thread;
- deterministic shutdown: `stop()` sets `_closing` under `_life_lock`, waits for the in-flight
  `enqueue` calls to leave, then puts the sentinel, which is therefore always last in the queue.

One deviation from the seed, to keep the non-daemon thread from outliving a timed-out `stop()`:
the sentinel is placed by whoever sees "closing and no enqueue in flight" first — `stop()`, or the
last in-flight `enqueue` if `stop()` already gave up — with `put_nowait`; if the queue is full at
that moment the worker exits on its own once it has drained the queue (nothing can be queued
after closing, so an empty queue is final).

Durability (issue 3 §2): `best_effort` makes one attempt per block; `persistent` and `durable`
retry a failed write (`'error'` or an exception) up to `max_retries` more times with exponential
backoff from `retry_backoff_s`, inline on the thread doing the save, then log a WARNING and count
`writer_retry_final_fail`. A `'collision'` or `'dedup'` answer is final, never retried. The RAM
copy is never rolled back. Fsync under `durable` is the store's job. Once a `stop()` has timed
out, no new retry starts (and a backoff wait is cut short), so a dead disk cannot keep the
non-daemon thread alive for `queue_size` times the backoff series.

Counters (`writer_` prefix, seed 000 §5):
    writer_enqueue_total             blocks accepted by `enqueue` (it returned True)
    writer_enqueue_dedup_skip        enqueue of a hash already pending (returned False)
    writer_enqueue_rejected          enqueue after `stop()` or while the store is disabled
    writer_save_success              blocks the store answered 'saved'
    writer_dedup                     blocks the store answered 'dedup' (already on SSD)
    writer_collision                 blocks the store answered 'collision'
    writer_save_fail                 blocks whose last attempt failed ('error' or exception)
    writer_queue_full_sync_fallback  level-2 backpressure: saved on the caller's thread
    writer_backpressure_waits        level-1 backpressure: `put_nowait` failed, waited up to 50 ms
    writer_retry_attempts            retries made (not counting first attempts)
    writer_retry_final_fail          blocks given up after all retries (persistent / durable)
`get_stats()` adds two gauges: `writer_queue_depth` and `writer_pending`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Protocol

from kvtool.config import DURABILITY_MODES

if TYPE_CHECKING:
    from kvtool.hostblock import HostBlock
    from kvtool.config import KVToolConfig

logger = logging.getLogger(__name__)

DEFAULT_QUEUE_SIZE = 512
DEFAULT_MAX_RETRIES = 3
DEFAULT_RETRY_BACKOFF_S = 0.05
DEFAULT_DRAIN_TIMEOUT_S = 5.0
DEFAULT_FLUSH_TIMEOUT_S = 60.0
ENQUEUE_WAIT_S = 0.05  # level-1 backpressure: how long `enqueue` waits for room in the queue
RETRY_MODES = ("persistent", "durable")

SAVE_OUTCOMES = ("saved", "dedup", "collision", "error")
_OUTCOME_COUNTER = {
    "saved": "writer_save_success",
    "dedup": "writer_dedup",
    "collision": "writer_collision",
    "error": "writer_save_fail",
}
COUNTER_NAMES = (
    "writer_enqueue_total",
    "writer_enqueue_dedup_skip",
    "writer_enqueue_rejected",
    "writer_save_success",
    "writer_dedup",
    "writer_collision",
    "writer_save_fail",
    "writer_queue_full_sync_fallback",
    "writer_backpressure_waits",
    "writer_retry_attempts",
    "writer_retry_final_fail",
)


class BlockSink(Protocol):
    """What a writer needs from `SSDStore`."""

    enabled: bool

    def save_block(self, block: HostBlock) -> str: ...

    def stats(self) -> dict: ...


class _Counters:
    """The `writer_*` counters, shared by producers and the worker (`_stats_lock`)."""

    def __init__(self) -> None:
        self._stats_lock = threading.Lock()
        self._stats = dict.fromkeys(COUNTER_NAMES, 0)

    def inc(self, key: str, n: int = 1) -> None:
        with self._stats_lock:
            self._stats[key] += n

    def snapshot(self) -> dict[str, int]:
        with self._stats_lock:
            return dict(self._stats)


def _attempt(store: BlockSink, block: HostBlock) -> str:
    """One `save_block` call; an exception or an unknown answer counts as 'error'."""
    try:
        outcome = store.save_block(block)
    except Exception:
        logger.warning("SSD save of block %s raised", block.block_hash, exc_info=True)
        return "error"
    if outcome not in SAVE_OUTCOMES:
        logger.warning("SSD save of block %s returned %r; treated as 'error'", block.block_hash, outcome)
        return "error"
    return outcome


@dataclass(frozen=True)
class RetryPolicy:
    """How a writer saves one block under a durability mode (shared by both writers).

    Attributes:
        durability: 'best_effort' (one attempt) | 'persistent' | 'durable' (retries).
        max_retries: retries after the first failed attempt (retry modes only).
        backoff_s: delay before the first retry; doubles for each further retry.
        sleep: how to wait between attempts (injectable for tests).
    """

    durability: str = "best_effort"
    max_retries: int = DEFAULT_MAX_RETRIES
    backoff_s: float = DEFAULT_RETRY_BACKOFF_S
    sleep: Callable[[float], None] = field(default=time.sleep, compare=False)

    def __post_init__(self) -> None:
        if self.durability not in DURABILITY_MODES:
            raise ValueError(f"durability must be one of {', '.join(DURABILITY_MODES)}, got {self.durability!r}")
        if not isinstance(self.max_retries, int) or self.max_retries < 0:
            raise ValueError(f"max_retries must be an integer >= 0, got {self.max_retries!r}")
        if self.backoff_s < 0:
            raise ValueError(f"retry backoff must be >= 0, got {self.backoff_s!r}")

    @property
    def retries(self) -> int:
        """Retries allowed after a failed first attempt (0 under best_effort)."""
        return self.max_retries if self.durability in RETRY_MODES else 0

    def save(
        self, store: BlockSink, block: HostBlock, counters: _Counters, abort: threading.Event | None = None
    ) -> str:
        """Save `block`, retrying failures as the durability mode says; count the outcome.

        Args:
            store, block: what to save where.
            counters: the writer's counters.
            abort: once set, no further retry is started (a `stop()` that timed out).

        Returns:
            The final outcome: 'saved' | 'dedup' | 'collision' | 'error'. Never raises for
            store failures.
        """
        aborted = abort.is_set if abort is not None else lambda: False
        outcome = _attempt(store, block)
        done = 0
        while outcome == "error" and done < self.retries and not aborted():
            self.sleep(self.backoff_s * (2**done))
            if aborted():
                break
            done += 1
            counters.inc("writer_retry_attempts")
            outcome = _attempt(store, block)
        counters.inc(_OUTCOME_COUNTER[outcome])
        if outcome == "error":
            self._report_failure(block, counters, done)
        elif outcome == "collision":
            logger.warning("SSD refused block %s: hash collision (kept in RAM only)", block.block_hash)
        return outcome

    def _report_failure(self, block: HostBlock, counters: _Counters, retries_done: int) -> None:
        if self.durability in RETRY_MODES:
            counters.inc("writer_retry_final_fail")
            logger.warning(
                "SSD write of block %s failed after %d retries (%s%s); kept in RAM only",
                block.block_hash, retries_done, self.durability,
                "" if retries_done == self.retries else ", retries cut short by shutdown",
            )
        else:
            logger.warning("SSD write of block %s failed (best_effort); kept in RAM only", block.block_hash)


class _WriterBase:
    """State and stats common to both writers."""

    def __init__(self, store: BlockSink, policy: RetryPolicy) -> None:
        self._store = store
        self._policy = policy
        self._counters = _Counters()

    @property
    def durability(self) -> str:
        return self._policy.durability

    def _store_enabled(self) -> bool:
        return bool(getattr(self._store, "enabled", True))

    def _save(self, block: HostBlock, abort: threading.Event | None = None) -> str:
        return self._policy.save(self._store, block, self._counters, abort)

    def get_stats(self) -> dict[str, int]:
        """Snapshot of the `writer_*` counters plus the `writer_queue_depth` / `writer_pending` gauges."""
        stats: dict[str, Any] = self._counters.snapshot()
        stats["writer_queue_depth"] = self.queue_depth()
        stats["writer_pending"] = self._pending_count()
        return stats

    def queue_depth(self) -> int:  # pragma: no cover - overridden
        raise NotImplementedError

    def _pending_count(self) -> int:  # pragma: no cover - overridden
        raise NotImplementedError


class SyncWriter(_WriterBase):
    """Writes each block on the caller's thread, with the same retry policy as `AsyncWriter`."""

    def __init__(
        self,
        store: BlockSink,
        durability: str = "best_effort",
        max_retries: int = DEFAULT_MAX_RETRIES,
        retry_backoff_s: float = DEFAULT_RETRY_BACKOFF_S,
        *,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        super().__init__(store, RetryPolicy(durability, max_retries, retry_backoff_s, sleep))
        self._closed = False

    def enqueue(self, block: HostBlock) -> bool:
        """Save `block` now (retries included). False if stopped or the store is disabled."""
        if self._closed or not self._store_enabled():
            self._counters.inc("writer_enqueue_rejected")
            return False
        self._counters.inc("writer_enqueue_total")
        self._save(block)
        return True

    def get_pending(self, block_hash: str) -> HostBlock | None:
        """Nothing is ever pending: always None."""
        return None

    def queue_depth(self) -> int:
        return 0

    def _pending_count(self) -> int:
        return 0

    def flush(self, timeout: float | None = DEFAULT_FLUSH_TIMEOUT_S) -> bool:
        """Every accepted block has been attempted already: True."""
        return True

    def stop(self, drain_timeout: float = DEFAULT_DRAIN_TIMEOUT_S) -> bool:
        """Refuse further blocks; True (nothing to drain). Idempotent."""
        self._closed = True
        return True


@dataclass
class _Pending:
    block: HostBlock
    ticket: int  # acceptance order, for flush()


_LIVE_WRITERS: "weakref.WeakSet[AsyncWriter]" = weakref.WeakSet()
EXIT_DRAIN_TIMEOUT_S = 30.0


def _drain_at_exit() -> None:
    """Interpreter exit: drain writers their owner never stopped.

    The writer thread is non-daemon (seed 000), so a program that forgets `stop()` would hang
    at exit. `threading._register_atexit` hooks run *before* non-daemon threads are joined (the
    hook `concurrent.futures` uses), so accepted blocks are still written, then the thread ends.
    """
    for writer in list(_LIVE_WRITERS):
        writer.stop(EXIT_DRAIN_TIMEOUT_S)


if hasattr(threading, "_register_atexit"):  # CPython >= 3.9
    threading._register_atexit(_drain_at_exit)


class AsyncWriter(_WriterBase):
    """Writes blocks from one background (non-daemon) thread; see the module docstring.

    Args:
        store: the SSD store (`save_block`, `enabled`, `stats`).
        queue_size: bound of the queue (blocks).
        durability: 'best_effort' | 'persistent' | 'durable'.
        max_retries: retries of a failed write under persistent / durable.
        retry_backoff_s: delay before the first retry (doubling after).
        sleep: wait between retries (injectable for tests); by default a wait that a timed-out
            `stop()` interrupts.
    """

    def __init__(
        self,
        store: BlockSink,
        queue_size: int = DEFAULT_QUEUE_SIZE,
        durability: str = "best_effort",
        max_retries: int = DEFAULT_MAX_RETRIES,
        retry_backoff_s: float = DEFAULT_RETRY_BACKOFF_S,
        *,
        sleep: Callable[[float], None] | None = None,
    ) -> None:
        if not isinstance(queue_size, int) or queue_size <= 0:
            raise ValueError(f"queue_size must be an integer > 0, got {queue_size!r}")
        # set when stop() times out: no new retries, so a dead disk cannot keep the
        # non-daemon thread (and the process) alive for queue_size x the backoff series
        self._give_up = threading.Event()
        super().__init__(store, RetryPolicy(durability, max_retries, retry_backoff_s, sleep or self._give_up.wait))
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._sentinel = object()

        self._pending: dict[str, _Pending] = {}
        self._pending_lock = threading.Lock()
        self._settled = threading.Condition(self._pending_lock)  # a pending entry has left
        self._next_ticket = 0

        self._life_lock = threading.Lock()
        self._no_inflight = threading.Condition(self._life_lock)
        self._closing = False
        self._sealed = False  # closing, no enqueue in flight: nothing more can be queued
        self._sentinel_queued = False
        self._inflight_enqueues = 0

        self._thread = threading.Thread(target=self._run, name="kvtool-ssd-writer", daemon=False)
        self._thread.start()
        _LIVE_WRITERS.add(self)

    # ---- producer side -------------------------------------------------------------------

    def enqueue(self, block: HostBlock) -> bool:
        """Queue `block` for writing (or save it now if the queue stays full).

        Returns:
            True if accepted (it will be attempted before `stop()` returns True); False if the
            writer is closing, the store is disabled, or the hash is already pending.
        """
        if not self._store_enabled() or not self._enter():
            self._counters.inc("writer_enqueue_rejected")
            return False
        try:
            return self._accept(block)
        finally:
            self._leave()

    def _enter(self) -> bool:
        with self._life_lock:
            if self._closing:
                return False
            self._inflight_enqueues += 1
            return True

    def _leave(self) -> None:
        with self._life_lock:
            self._inflight_enqueues -= 1
            if self._closing and self._inflight_enqueues == 0:
                self._seal_locked()
                self._no_inflight.notify_all()

    def _accept(self, block: HostBlock) -> bool:
        with self._pending_lock:
            if block.block_hash in self._pending:
                self._counters.inc("writer_enqueue_dedup_skip")
                return False
            self._pending[block.block_hash] = _Pending(block, self._next_ticket)
            self._next_ticket += 1
        self._counters.inc("writer_enqueue_total")
        try:
            if self._put(block):
                return True
            self._counters.inc("writer_queue_full_sync_fallback")
        except BaseException:
            self._settle(block.block_hash)
            raise
        self._save_and_settle(block)
        return True

    def _put(self, block: HostBlock) -> bool:
        """Backpressure levels 0 and 1; False means level 2: the caller saves synchronously."""
        try:
            self._queue.put_nowait(block)
            return True
        except queue.Full:
            pass
        self._counters.inc("writer_backpressure_waits")
        try:
            self._queue.put(block, timeout=ENQUEUE_WAIT_S)
            return True
        except queue.Full:
            return False

    def _seal_locked(self) -> None:
        """Under `_life_lock`, closing and no enqueue in flight: put the sentinel, last."""
        if self._sealed:
            return
        self._sealed = True
        try:
            self._queue.put_nowait(self._sentinel)
            self._sentinel_queued = True
        except queue.Full:
            pass  # the worker exits by itself once the queue is empty (see _drained)

    # ---- worker side ---------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is self._sentinel:
                break
            try:
                self._save_and_settle(item)
            except Exception:  # never let the worker die: the queue would never drain
                logger.exception("SSD writer: unexpected error on block %s", getattr(item, "block_hash", "?"))
            if self._drained():
                break
        logger.debug("SSD writer thread exiting")

    def _drained(self) -> bool:
        """Sealed without a sentinel in the queue, and the queue is empty: nothing will come."""
        with self._life_lock:
            return self._sealed and not self._sentinel_queued and self._queue.empty()

    def _save_and_settle(self, block: HostBlock) -> None:
        try:
            self._save(block, self._give_up)
        finally:
            self._settle(block.block_hash)

    def _settle(self, block_hash: str) -> None:
        with self._settled:
            self._pending.pop(block_hash, None)
            self._settled.notify_all()

    # ---- queries -------------------------------------------------------------------------

    def get_pending(self, block_hash: str) -> HostBlock | None:
        """The block with this hash if accepted but its save attempt has not finished."""
        with self._pending_lock:
            entry = self._pending.get(block_hash)
            return entry.block if entry is not None else None

    def queue_depth(self) -> int:
        """Blocks waiting in the queue (not counting the one being written)."""
        with self._life_lock:
            sentinel = 1 if self._sentinel_queued and self._thread.is_alive() else 0
        return max(0, self._queue.qsize() - sentinel)

    def _pending_count(self) -> int:
        with self._pending_lock:
            return len(self._pending)

    # ---- flush / stop --------------------------------------------------------------------

    def flush(self, timeout: float | None = DEFAULT_FLUSH_TIMEOUT_S) -> bool:
        """Wait until every block accepted before this call has been attempted (retries included).

        Blocks accepted while waiting are not waited for, so steady producers cannot starve
        it. Must not be called from the writer thread (e.g. from inside `save_block`).

        Returns:
            False if `timeout` (seconds; None = no limit) passed first.
        """
        with self._settled:
            target = self._next_ticket
            return self._settled.wait_for(
                lambda: all(p.ticket >= target for p in self._pending.values()), timeout
            )

    def stop(self, drain_timeout: float = DEFAULT_DRAIN_TIMEOUT_S) -> bool:
        """Refuse new blocks, write every accepted one, end the thread. Idempotent.

        Returns:
            True if the thread has ended (all accepted blocks attempted) within
            `drain_timeout` seconds; False otherwise — the caller reports
            `shutdown_clean=false`. After a False the thread still makes one attempt per
            remaining block, without retries, then ends.
        """
        deadline = time.monotonic() + drain_timeout
        with self._life_lock:
            self._closing = True
            if not self._no_inflight.wait_for(lambda: self._inflight_enqueues == 0, timeout=drain_timeout):
                logger.error("SSD writer stop: enqueue calls still in flight after %.1fs", drain_timeout)
                self._give_up.set()
                return False  # the last enqueue to leave seals the queue
            self._seal_locked()
        self._thread.join(timeout=max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive():
            logger.error(
                "SSD writer did not drain within %.1fs; %d blocks not yet written",
                drain_timeout, self._pending_count(),
            )
            self._give_up.set()
            return False
        return True


Writer = AsyncWriter | SyncWriter


def make_writer(store: BlockSink, config: KVToolConfig) -> Writer:
    """The writer the config asks for (`ssd_async_writes`, queue size, durability, retries)."""
    if config.ssd_async_writes:
        return AsyncWriter(
            store,
            queue_size=config.ssd_writer_queue_size,
            durability=config.ssd_durability,
            max_retries=config.ssd_persistent_max_retries,
        )
    return SyncWriter(store, durability=config.ssd_durability, max_retries=config.ssd_persistent_max_retries)
