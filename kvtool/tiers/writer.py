"""Block writers: `AsyncWriter` (one background thread) and `SyncWriter` (caller's thread).

The one writer of every tier that wants one: the SSD tier (`SSDStore.save_blocks`) and the remote
tier (`RemoteStore.save_blocks`, a daemon thread: it never keeps a process alive). Both writers
take batches of `HostBlock`s (numpy, materialised on the request thread: this module never
imports MLX) and hand each batch to the sink's `save_blocks` in one call: one segment file per
batch (per 64 MiB of it). They share one interface (`enqueue_many`, `enqueue`, `get_pending`,
`queue_depth`, `flush`, `stop`, `get_stats`). The batch plumbing (counters, retry policy, queue)
is in `writer_batch`, the shared base and `SyncWriter` in `writer_sync`.

`AsyncWriter` follows docs/design.md#writer-protocol: a queue bounded in bytes and in blocks,
queued batches coalesced into one save up to `batch_max_bytes`, the pending buffer (`_pending`:
de-duplication and `get_pending` hits until the save attempt has finished), and a shutdown by a
sentinel put last (by `stop()`, or by the last in-flight `enqueue_many` if `stop()` gave up). A
batch that finds the queue full follows `when_full`: `"shed"` drops it at once (counted; the
request thread never waits), `"wait"` waits up to `enqueue_wait_s` for room, then saves it on the
caller's thread; by default `durable` waits and the other modes shed; `must_write` always waits.
Retries: docs/design.md#durability-modes; once a `stop()` has timed out no new retry round starts
(a backoff wait is cut short), so a dead disk cannot keep the non-daemon thread alive.

Counters (`writer_` prefix, docs/design.md#counters); every one counts BLOCKS unless it says otherwise:
    writer_enqueue_total             blocks accepted by `enqueue_many`
    writer_enqueue_dedup_skip        blocks skipped: hash already pending (or twice in one batch)
    writer_enqueue_rejected          blocks offered after `stop()` or while the store is disabled
    writer_save_success              blocks the store answered 'saved'
    writer_dedup                     blocks the store answered 'dedup' (already on SSD)
    writer_collision                 blocks the store answered 'collision'
    writer_budget_refused            blocks the store answered 'refused': the SSD byte budget had no
                                     room for their segment (not stored, not a failure, not retried)
    writer_save_fail                 blocks whose last attempt failed ('error' or exception)
    writer_queue_full_sync_fallback  queue full, durable / must_write: blocks saved on the caller's
                                     thread (always 0 otherwise)
    writer_backpressure_waits        queue full, durable / must_write: enqueue calls (batches) that
                                     waited for room
    writer_shed_blocks               queue full, best_effort / persistent: blocks shed (not written)
    writer_shed_bytes                their bytes (sum of `HostBlock.nbytes`)
    writer_retry_attempts            block retries made (not counting first attempts)
    writer_retry_final_fail          blocks given up after all retries (persistent / durable)
    writer_cpu_us                    CPU microseconds the saves took, on the thread that ran them (the
                                     writer's; the caller's for a sync save or a queue-full fallback)
`writer_enqueue_total` counts blocks accepted (queued or saved by their caller), never shed ones.
`get_stats()` adds four gauges: `writer_queue_depth` (blocks queued), `writer_pending` (blocks
accepted, not yet attempted), `writer_pending_bytes` (their `nbytes`) and `writer_queue_peak_bytes`
(the highest bytes queued plus being written by the worker since the writer started).
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvtool.tiers.writer_batch import (
    COUNTER_NAMES,
    DEFAULT_MAX_RETRIES,
    DEFAULT_RETRY_BACKOFF_S,
    RETRY_MODES,
    SAVE_OUTCOMES,
    SHED_LOG_INTERVAL_S,
    SHED_MODES,
    Batch,
    BatchQueue,
    RetryPolicy,
    ShedLog,
    batch_nbytes,
    describe,
)
from kvtool.tiers.writer_sync import (
    DEFAULT_DRAIN_TIMEOUT_S,
    DEFAULT_FLUSH_TIMEOUT_S,
    BlockSink,
    SyncWriter,
    WriterBase,
    unique_blocks,
)

if TYPE_CHECKING:
    from kvtool.config import KVToolConfig
    from kvtool.disk.hostblock import HostBlock

__all__ = [
    "COUNTER_NAMES", "DEFAULT_BATCH_MAX_BYTES", "DEFAULT_DRAIN_TIMEOUT_S", "DEFAULT_FLUSH_TIMEOUT_S", "DEFAULT_MAX_QUEUE_BYTES", "DEFAULT_MAX_RETRIES",
    "DEFAULT_QUEUE_SIZE", "DEFAULT_RETRY_BACKOFF_S", "ENQUEUE_WAIT_S", "RETRY_MODES", "SAVE_OUTCOMES", "WRITE_BEHIND_S",
    "SHED_LOG_INTERVAL_S", "SHED_MODES", "AsyncWriter", "BlockSink", "RetryPolicy", "SyncWriter", "Writer", "make_writer",
]

logger = logging.getLogger(__name__)

DEFAULT_QUEUE_SIZE = 512  # blocks queued (`ssd_writer_queue_size`)
DEFAULT_MAX_QUEUE_BYTES = 256 << 20  # bytes queued and being written (sum of HostBlock.nbytes)
DEFAULT_BATCH_MAX_BYTES = 64 << 20  # bytes: the worker coalesces queued batches up to this size
ENQUEUE_WAIT_S = 0.05  # durable / must_write: how long `enqueue_many` waits for room (seconds)
# the least age of a batch the worker writes (seconds; `BatchQueue`): a client's next request,
# which arrives ~1 ms after an answer, is tokenized and (when short) prefilled before the writer
# competes for the GIL, and the batches of consecutive requests coalesce into one save (a save
# has ~1 ms of fixed work: a segment file, an index transaction). None under durable: its writes
# are not held back. docs/benchmarks.md, "Write-behind".
WRITE_BEHIND_S = 0.1


@dataclass
class _Pending:
    block: HostBlock
    ticket: int  # acceptance order (per batch), for flush()


_LIVE_WRITERS: weakref.WeakSet[AsyncWriter] = weakref.WeakSet()
EXIT_DRAIN_TIMEOUT_S = 30.0


_exit_watch_lock = threading.Lock()
_exit_watch: threading.Thread | None = None


def _drain_at_exit() -> None:
    """Interpreter exit: stop (drain) the writers their owner never stopped. The main thread counts
    as finished before the interpreter joins non-daemon threads (docs/design.md#writer-protocol)."""
    threading.main_thread().join()
    for writer in list(_LIVE_WRITERS):
        writer.stop(EXIT_DRAIN_TIMEOUT_S)


def _watch_exit() -> None:
    """Start the exit watcher once (daemon: it never keeps the process alive)."""
    global _exit_watch
    with _exit_watch_lock:
        if _exit_watch is None:
            _exit_watch = threading.Thread(target=_drain_at_exit, name="kvtool-writer-exit", daemon=True)
            _exit_watch.start()


def _positive_int(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be an integer > 0, got {value!r}")
    return value


class AsyncWriter(WriterBase):
    """Writes batches from one background (non-daemon) thread; see the module docstring.

    Args:
        store: the SSD store (`save_blocks`, `enabled`, `stats`).
        queue_size: bound of the blocks waiting in the queue (blocks; `ssd_writer_queue_size`).
        durability: 'best_effort' | 'persistent' | 'durable'.
        max_retries: retry rounds of a batch's failed blocks under persistent / durable.
        retry_backoff_s: delay before the first retry round (seconds, doubling after).
        max_queue_bytes: bound of the bytes queued and being written (sum of `HostBlock.nbytes`);
            a batch larger than it is accepted when the queue holds nothing.
        batch_max_bytes: the worker merges queued batches into one `save_blocks` call up to
            this many bytes (a single larger batch is saved whole).
        enqueue_wait_s: how long `enqueue_many` waits for room before saving on the caller's
            thread (seconds), under `durable` or with `must_write`; the shedding modes never wait.
        sleep: wait between retries (injectable for tests); by default a wait that a timed-out
            `stop()` interrupts.
        when_full: `"shed"` | `"wait"`: what a batch that finds the queue full does (`must_write`
            always waits); None: `"shed"` under best_effort / persistent, `"wait"` under durable.
        daemon: the worker is a daemon thread (it never keeps the process alive; not drained at
            exit), and blocks given up are the sink's to report (logged at DEBUG only): for a sink
            that promises nothing and counts its own failures (the remote tier).
        name: the sink's name in the thread name and log lines ('SSD', 'remote').
        on_drop: called with the number of blocks shed or refused (closing, store disabled).
        write_behind_s: the least age of a batch the worker writes (seconds; `BatchQueue`;
            `flush` and `stop` write at once); 0 under durable whatever is given.
    """

    def __init__(
        self,
        store: BlockSink,
        queue_size: int = DEFAULT_QUEUE_SIZE,
        durability: str = "best_effort",
        max_retries: int = DEFAULT_MAX_RETRIES,
        retry_backoff_s: float = DEFAULT_RETRY_BACKOFF_S,
        *,
        max_queue_bytes: int = DEFAULT_MAX_QUEUE_BYTES,
        batch_max_bytes: int = DEFAULT_BATCH_MAX_BYTES,
        enqueue_wait_s: float = ENQUEUE_WAIT_S,
        sleep: Callable[[float], None] | None = None,
        when_full: str | None = None,
        daemon: bool = False,
        name: str = "SSD",
        on_drop: Callable[[int], None] | None = None,
        write_behind_s: float = WRITE_BEHIND_S,
    ) -> None:
        _positive_int("queue_size", queue_size)
        _positive_int("max_queue_bytes", max_queue_bytes)
        _positive_int("batch_max_bytes", batch_max_bytes)
        if not enqueue_wait_s >= 0:
            raise ValueError(f"enqueue_wait_s must be >= 0, got {enqueue_wait_s!r}")
        if when_full not in (None, "shed", "wait"):
            raise ValueError(f"when_full must be 'shed' or 'wait', got {when_full!r}")
        # set when stop() times out: no new retries, so a dead disk cannot keep the
        # non-daemon thread (and the process) alive for the whole queue x the backoff series
        self._give_up = threading.Event()
        super().__init__(store, RetryPolicy(durability, max_retries, retry_backoff_s, sleep or self._give_up.wait,
                                            report=not daemon, sink=name))
        self._queue = BatchQueue(queue_size, max_queue_bytes, 0.0 if durability == "durable" else write_behind_s)
        self._batch_max_bytes = batch_max_bytes
        self._enqueue_wait_s = enqueue_wait_s
        self._sentinel = object()
        self._sheds = self._policy.durability in SHED_MODES if when_full is None else when_full == "shed"
        self._shed_log = ShedLog(sink=name)
        self._name = name
        self._on_drop = on_drop

        self._pending: dict[str, _Pending] = {}
        self._pending_lock = threading.Lock()
        self._settled = threading.Condition(self._pending_lock)  # a pending entry has left
        self._next_ticket = 0

        self._life_lock = threading.Lock()
        self._no_inflight = threading.Condition(self._life_lock)
        self._closing = False
        self._sealed = False  # closing, no enqueue in flight: the sentinel is queued
        self._inflight_enqueues = 0

        self._thread = threading.Thread(target=self._run, name=f"kvtool-{name.lower()}-writer", daemon=daemon)
        self._thread.start()
        if not daemon:
            _LIVE_WRITERS.add(self)
            _watch_exit()

    @property
    def max_queue_bytes(self) -> int:
        """Bound of the bytes queued and being written."""
        return self._queue.max_bytes

    # ---- producer side -------------------------------------------------------------------

    def enqueue_many(self, blocks: Sequence[HostBlock], *, must_write: bool = False) -> int:
        """Queue `blocks` as one batch; if the queue is full, shed them or wait up to
        `enqueue_wait_s` seconds and save them here (see the module docstring).

        Args:
            blocks: the batch, in write order. Blocks whose hash is already pending (or
                repeated in the batch) are skipped and counted as `writer_enqueue_dedup_skip`.
            must_write: the caller promised these blocks reach SSD (`kvtool warm`, import):
                never shed them, whatever the durability.

        Returns:
            How many blocks were accepted (each will be attempted before `stop()` returns
            True); 0 if the writer is closing, the store is disabled, or the batch was shed.
            Never raises for store failures.
        """
        blocks = list(blocks)
        if not blocks:
            return 0
        if not self._store_enabled() or not self._enter():
            self._counters.inc("writer_enqueue_rejected", len(blocks))
            self._dropped(len(blocks))
            return 0
        try:
            return self._accept(blocks, shed=self._sheds and not must_write)
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

    def _accept(self, blocks: list[HostBlock], shed: bool) -> int:
        with self._pending_lock:
            batch = unique_blocks(blocks, self._pending.__contains__)
            for b in batch:
                self._pending[b.block_hash] = _Pending(b, self._next_ticket)
            self._next_ticket += 1
        if len(batch) < len(blocks):
            self._counters.inc("writer_enqueue_dedup_skip", len(blocks) - len(batch))
        if not batch:
            return 0
        self._counters.inc("writer_enqueue_total", len(batch))
        item = Batch(batch, batch_nbytes(batch))
        try:
            if self._queue.put(item):
                return len(batch)
            if shed:
                self._settle(batch)
                self._counters.add({
                    "writer_enqueue_total": -len(batch),  # not accepted after all
                    "writer_shed_blocks": len(batch),
                    "writer_shed_bytes": item.nbytes,
                })
                self._shed_log.add(len(batch), item.nbytes)
                self._dropped(len(batch))
                return 0
            self._counters.inc("writer_backpressure_waits")
            if self._queue.put(item, timeout=self._enqueue_wait_s):
                return len(batch)
            self._counters.inc("writer_queue_full_sync_fallback", len(batch))
        except BaseException:
            self._settle(batch)
            raise
        self._save_and_settle(batch)
        return len(batch)

    def _dropped(self, n: int) -> None:
        if self._on_drop is not None and n:
            self._on_drop(n)

    def _seal_locked(self) -> None:
        """Under `_life_lock`, closing and no enqueue in flight: put the sentinel, last."""
        if not self._sealed:
            self._sealed = True
            self._queue.put_final(self._sentinel)

    # ---- worker side ---------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            item = self._queue.get(self._batch_max_bytes)
            if item is self._sentinel:
                break
            try:
                self._save_and_settle(item.blocks)
            except Exception:  # never let the worker die: the queue would never drain
                logger.exception("%s writer: unexpected error on %s", self._name, describe(item.blocks))
            finally:
                self._queue.release(item)  # after settling: pending bytes never exceed the bound
        logger.debug("%s writer thread exiting", self._name)

    def _save_and_settle(self, blocks: list[HostBlock]) -> None:
        try:
            self._save(blocks, self._give_up)
        finally:
            self._settle(blocks)

    def _settle(self, blocks: list[HostBlock]) -> None:
        with self._settled:
            for b in blocks:
                self._pending.pop(b.block_hash, None)
            self._settled.notify_all()

    # ---- queries -------------------------------------------------------------------------

    def get_pending(self, block_hash: str) -> HostBlock | None:
        """The block with this hash if accepted but its save attempt has not finished."""
        with self._pending_lock:
            entry = self._pending.get(block_hash)
            return entry.block if entry is not None else None

    def pending_children(self, parent_hash: str, limit: int) -> list[HostBlock]:
        """Up to `limit` pending blocks whose parent is `parent_hash`, newest first (a scan of
        the pending buffer, which the queue bounds): siblings for a partial-block prefix hit."""
        out: list[HostBlock] = []
        with self._pending_lock:
            for entry in reversed(self._pending.values()):
                if entry.block.parent_hash == parent_hash:
                    out.append(entry.block)
                    if len(out) >= limit:
                        break
        return out

    def queue_depth(self) -> int:
        """Blocks waiting in the queue (not counting the batch being written)."""
        return self._queue.queued_blocks

    def queue_bytes(self) -> int:
        """Bytes queued plus bytes being written by the worker (the bounded quantity)."""
        return self._queue.held_bytes

    def queue_peak_bytes(self) -> int:
        """Highest `queue_bytes()` since the writer started (bytes)."""
        return self._queue.peak_bytes

    def _pending_count(self) -> int:
        with self._pending_lock:
            return len(self._pending)

    def pending_bytes(self) -> int:
        """Bytes of the blocks accepted and not yet attempted: queued, being written by the
        worker, or being saved on a caller's thread (durable / must_write, queue full)."""
        with self._pending_lock:
            return sum(p.block.nbytes for p in self._pending.values())

    # ---- flush / stop --------------------------------------------------------------------

    def flush(self, timeout: float | None = DEFAULT_FLUSH_TIMEOUT_S) -> bool:
        """Wait until every block accepted before this call has been attempted (retries included).

        Blocks accepted while waiting are not waited for, so steady producers cannot starve
        it. Must not be called from the writer thread (e.g. from inside `save_blocks`).

        Returns:
            False if `timeout` (seconds; None = no limit) passed first.
        """
        self._queue.hurry(True)
        try:
            with self._settled:
                target = self._next_ticket
                return self._settled.wait_for(
                    lambda: all(p.ticket >= target for p in self._pending.values()), timeout
                )
        finally:
            self._queue.hurry(False)

    def stop(self, drain_timeout: float = DEFAULT_DRAIN_TIMEOUT_S) -> bool:
        """Refuse new blocks, write every accepted one, end the thread. Idempotent.

        Returns:
            True if the thread has ended (all accepted blocks attempted) within
            `drain_timeout` seconds; False otherwise — the caller reports
            `shutdown_clean=false`. After a False the thread still makes one attempt per
            remaining batch, without retries, then ends.
        """
        deadline = time.monotonic() + drain_timeout
        self._queue.hurry(True)  # (never undone: the writer is closing)
        with self._life_lock:
            self._closing = True
            if not self._no_inflight.wait_for(lambda: self._inflight_enqueues == 0, timeout=drain_timeout):
                logger.error("SSD writer stop: enqueue calls still in flight after %.1fs", drain_timeout)
                self._give_up.set()
                return False  # the last enqueue to leave seals the queue
            self._seal_locked()
        self._shed_log.flush()  # no enqueue in flight any more: report sheds not logged yet
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
    """The writer the config asks for (`ssd_async_writes`, queue size, durability, retries; the
    byte bound is `DEFAULT_MAX_QUEUE_BYTES`). With `ssd_max_bytes` set, the store evicts least
    recently used segments before each write that would not fit (`SSDStore.set_max_bytes`,
    `kvtool.disk.budget`): the writer's saves keep the namespace within that many bytes.
    """
    set_max_bytes = getattr(store, "set_max_bytes", None)
    if config.ssd_max_bytes is not None and set_max_bytes is not None:
        set_max_bytes(int(config.ssd_max_bytes))
    if config.ssd_async_writes:
        return AsyncWriter(store, queue_size=config.ssd_writer_queue_size, durability=config.ssd_durability,
                           max_retries=config.ssd_persistent_max_retries)
    return SyncWriter(store, durability=config.ssd_durability, max_retries=config.ssd_persistent_max_retries)
