"""Batch plumbing of the block writers (`kvtool.tiers.writer` re-exports what callers use):
counters, the per-batch retry policy, the byte-bounded queue. A *batch* is a list of `HostBlock`s
handed to the sink's `save_blocks` in one call. MLX-free; logs go to the `kvtool.tiers.writer` logger.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvtool.config import DURABILITY_MODES

if TYPE_CHECKING:
    from kvtool.disk.hostblock import HostBlock

logger = logging.getLogger("kvtool.tiers.writer")

DEFAULT_MAX_RETRIES = 3
DEFAULT_RETRY_BACKOFF_S = 0.05
RETRY_MODES = ("persistent", "durable")
# durability modes whose async writer sheds a batch that finds the queue full instead of making
# the caller wait for room or save it (`durable` waits, then saves on the caller's thread)
SHED_MODES = ("best_effort", "persistent")
SHED_LOG_INTERVAL_S = 60.0  # at most one shed WARNING line per this many seconds

# what `save_blocks` answers per block; 'refused': the SSD byte budget had no room for its
# segment (not stored, not a failure: never retried, counted apart from the failures)
SAVE_OUTCOMES = ("saved", "dedup", "collision", "refused", "error")
OUTCOME_COUNTER = {
    "saved": "writer_save_success",
    "dedup": "writer_dedup",
    "collision": "writer_collision",
    "refused": "writer_budget_refused",
    "error": "writer_save_fail",
}
COUNTER_NAMES = (
    "writer_enqueue_total",
    "writer_enqueue_dedup_skip",
    "writer_enqueue_rejected",
    "writer_save_success",
    "writer_dedup",
    "writer_collision",
    "writer_budget_refused",
    "writer_save_fail",
    "writer_queue_full_sync_fallback",
    "writer_backpressure_waits",
    "writer_shed_blocks",
    "writer_shed_bytes",
    "writer_retry_attempts",
    "writer_retry_final_fail",
    "writer_cpu_us",
)


class Counters:
    """The `writer_*` counters, shared by producers and the worker (one lock)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats = dict.fromkeys(COUNTER_NAMES, 0)

    def inc(self, key: str, n: int = 1) -> None:
        """Add `n` to counter `key`."""
        with self._lock:
            self._stats[key] += n

    def add(self, deltas: dict[str, int]) -> None:
        """Add several counters at once (one snapshot never sees half of them); may be negative."""
        with self._lock:
            for key, n in deltas.items():
                self._stats[key] += n

    def snapshot(self) -> dict[str, int]:
        """A copy of every counter."""
        with self._lock:
            return dict(self._stats)


class ShedLog:
    """Rate-limited WARNING about shed blocks: at most one line per `interval_s`, each line giving
    the blocks and bytes shed since the previous line (the first shed is logged at once).

    Args:
        interval_s: minimum time between two lines (seconds).
        clock: monotonic time source in seconds (injectable for tests).
    """

    def __init__(self, interval_s: float = SHED_LOG_INTERVAL_S, clock: Callable[[], float] = time.monotonic,
                 sink: str = "SSD") -> None:  # fmt: skip
        self.interval_s = interval_s
        self.sink = sink  # names the writer and where the blocks are not written
        self._clock = clock
        self._lock = threading.Lock()
        self._blocks = 0
        self._bytes = 0
        self._last: float | None = None

    def add(self, blocks: int, nbytes: int) -> bool:
        """Count one shed batch (`blocks` blocks, `nbytes` bytes); log if no line was written in
        the last `interval_s`. Returns True if a line was written."""
        with self._lock:
            self._blocks += blocks
            self._bytes += nbytes
            now = self._clock()
            if self._last is not None and now - self._last < self.interval_s:
                return False
            self._last = now
            counts = self._take()
        return self._log(self.sink, *counts)

    def flush(self) -> bool:
        """Log the counts not reported yet, whatever the interval (at writer stop). Returns True
        if a line was written (False: nothing shed since the last line)."""
        with self._lock:
            counts = self._take()
        return self._log(self.sink, *counts)

    def _take(self) -> tuple[int, int]:
        counts = (self._blocks, self._bytes)
        self._blocks = self._bytes = 0
        return counts

    @staticmethod
    def _log(sink: str, blocks: int, nbytes: int) -> bool:
        # outside the lock: a slow log handler must not hold up another shedding thread
        if not blocks:
            return False
        logger.warning(
            "%s writer queue full: shed %d block(s) (%d bytes) since the last report; "
            "they stay in RAM only, not written to %s", sink, blocks, nbytes, sink,
        )
        return True


def describe(blocks: Sequence[HostBlock], limit: int = 3) -> str:
    """A short description of a batch for log lines: its first hashes and its size."""
    head = ", ".join(b.block_hash for b in blocks[:limit])
    more = f" +{len(blocks) - limit} more" if len(blocks) > limit else ""
    return f"{len(blocks)} block(s) [{head}{more}]"


def batch_nbytes(blocks: Sequence[HostBlock]) -> int:
    """Sum of `HostBlock.nbytes` (bytes of KV tensors plus token ids)."""
    return sum(b.nbytes for b in blocks)


def attempt_many(store: Any, blocks: Sequence[HostBlock]) -> list[str]:
    """One `store.save_blocks` call; per block, in order, one of `SAVE_OUTCOMES` ('saved' |
    'dedup' | 'collision' | 'refused' | 'error').

    An exception, or an answer that is not one outcome per block, makes every block 'error';
    an unknown outcome makes that block 'error'. Never raises for store failures.
    """
    try:
        answers = store.save_blocks(blocks)
    except Exception:
        logger.warning("SSD save of %s raised", describe(blocks), exc_info=True)
        return ["error"] * len(blocks)
    if not isinstance(answers, (list, tuple)) or len(answers) != len(blocks):
        logger.warning("SSD save of %s returned %r; treated as 'error'", describe(blocks), answers)
        return ["error"] * len(blocks)
    out = [a if isinstance(a, str) and a in SAVE_OUTCOMES else "error" for a in answers]
    bad = [a for a, o in zip(answers, out) if o == "error" and a != "error"]
    if bad:
        logger.warning("SSD save of %s returned unknown outcome(s) %r; treated as 'error'", describe(blocks), bad[:3])
    return out


@dataclass(frozen=True)
class RetryPolicy:
    """How a writer saves one batch under a durability mode (shared by both writers).

    Attributes:
        durability: 'best_effort' (one attempt) | 'persistent' | 'durable' (retries).
        max_retries: retry rounds after the first attempt (retry modes only). A round retries
            only the blocks whose last outcome was 'error' ('refused', the byte budget's answer,
            is final like 'dedup' and 'collision').
        backoff_s: delay before the first retry round (seconds); doubles for each further round.
        sleep: how to wait between rounds (injectable for tests).
        report: log blocks given up as a WARNING (False: the sink counts and reports its own
            failures, as the remote store does; logged at DEBUG).
    """

    durability: str = "best_effort"
    max_retries: int = DEFAULT_MAX_RETRIES
    backoff_s: float = DEFAULT_RETRY_BACKOFF_S
    sleep: Callable[[float], object] = field(default=time.sleep, compare=False)  # the result is ignored
    report: bool = True
    sink: str = "SSD"  # names the sink in log lines

    def __post_init__(self) -> None:
        if self.durability not in DURABILITY_MODES:
            raise ValueError(f"durability must be one of {', '.join(DURABILITY_MODES)}, got {self.durability!r}")
        if not isinstance(self.max_retries, int) or self.max_retries < 0:
            raise ValueError(f"max_retries must be an integer >= 0, got {self.max_retries!r}")
        if self.backoff_s < 0:
            raise ValueError(f"retry backoff must be >= 0, got {self.backoff_s!r}")

    @property
    def retries(self) -> int:
        """Retry rounds allowed after a failed first attempt (0 under best_effort)."""
        return self.max_retries if self.durability in RETRY_MODES else 0

    def save_batch(
        self,
        store: Any,
        blocks: Sequence[HostBlock],
        counters: Counters,
        abort: threading.Event | None = None,
    ) -> list[str]:
        """Save `blocks` with one `save_blocks` call, retry the failed ones; count per block.

        A retry round hands the store only the blocks whose last outcome was 'error' (every
        block after an exception), in their original order. A 'refused' block is counted
        (`writer_budget_refused`) and logged at DEBUG only, never as a failure.

        Args:
            store: has `save_blocks(blocks) -> list[str]`.
            blocks: the batch (non-empty), in write order.
            counters: the writer's counters (`writer_retry_attempts` counts blocks retried).
            abort: once set, no further retry round starts (a `stop()` that timed out).

        Returns:
            Per block, in order, the final outcome. Never raises for store failures.
        """
        aborted = abort.is_set if abort is not None else lambda: False
        outcomes = attempt_many(store, blocks)
        todo = [i for i, o in enumerate(outcomes) if o == "error"]
        done = 0
        while todo and done < self.retries and not aborted():
            self.sleep(self.backoff_s * (2**done))
            if aborted():
                break
            done += 1
            counters.inc("writer_retry_attempts", len(todo))
            for i, o in zip(todo, attempt_many(store, [blocks[i] for i in todo])):
                outcomes[i] = o
            todo = [i for i in todo if outcomes[i] == "error"]
        for outcome, key in OUTCOME_COUNTER.items():
            n = outcomes.count(outcome)
            if n:
                counters.inc(key, n)
        if todo:
            self._report_failure([blocks[i] for i in todo], counters, done)
        collided = [b for b, o in zip(blocks, outcomes) if o == "collision"]
        if collided:
            logger.warning("SSD refused %s: hash collision (kept in RAM only)", describe(collided))
        refused = [b for b, o in zip(blocks, outcomes) if o == "refused"]
        if refused:
            logger.debug("%s byte budget had no room for %s: not stored there", self.sink, describe(refused))
        return outcomes

    def _report_failure(self, failed: list[HostBlock], counters: Counters, retries_done: int) -> None:
        if self.durability in RETRY_MODES:
            counters.inc("writer_retry_final_fail", len(failed))
            logger.warning(
                "SSD write of %s failed after %d retries (%s%s); kept in RAM only",
                describe(failed), retries_done, self.durability,
                "" if retries_done == self.retries else ", retries cut short by shutdown",
            )
        else:
            (logger.warning if self.report else logger.debug)("%s write of %s failed (best_effort); kept in RAM only",
                                                              self.sink, describe(failed))


@dataclass
class Batch:
    """One queue item: blocks accepted together (or coalesced by the worker), in write order,
    their `batch_nbytes` (bytes), and when it was queued (`time.monotonic()`, seconds)."""

    blocks: list[HostBlock]
    nbytes: int
    at: float = field(default_factory=time.monotonic)


class BatchQueue:
    """FIFO of `Batch`es bounded in queued blocks and in held bytes (queued, plus taken by the
    worker and not yet `release`d); the worker takes runs of them. A batch fits if it keeps both
    bounds, or if the queue holds nothing at all (so the bytes held never exceed
    `max(max_bytes, largest batch)`).

    Write-behind: `get` hands a batch out no sooner than `write_behind_s` after it was queued,
    unless the queue is half full, a non-batch item (the sentinel) is queued, or a caller
    `hurry`s it (a flush, a stop). The writer then works after the moments that follow an answer,
    when a client's next request arrives and is tokenized (docs/benchmarks.md, "Write-behind").

    Args:
        max_blocks: bound of the blocks waiting in the queue (the batch being written not
            counted; `ssd_writer_queue_size`).
        max_bytes: bound of the held bytes (sum of `HostBlock.nbytes`).
        write_behind_s: the least age of a batch handed out (seconds; 0: at once).
    """

    def __init__(self, max_blocks: int, max_bytes: int, write_behind_s: float = 0.0) -> None:
        self.max_blocks = max_blocks
        self.max_bytes = max_bytes
        self.write_behind_s = write_behind_s
        self._hurried = 0  # callers waiting for everything queued to be written (`hurry`)
        self._lock = threading.Lock()
        self._room = threading.Condition(self._lock)  # blocks were taken or bytes released
        self._ready = threading.Condition(self._lock)  # an item was appended
        self._items: deque[Any] = deque()
        self._queued_blocks = 0
        self._held_blocks = 0
        self._held_bytes = 0
        self._peak_bytes = 0

    def _fits(self, batch: Batch) -> bool:
        if self._held_blocks == 0:
            return True  # an empty queue takes any batch, however large
        return (
            self._queued_blocks + len(batch.blocks) <= self.max_blocks
            and self._held_bytes + batch.nbytes <= self.max_bytes
        )

    def put(self, batch: Batch, timeout: float = 0.0) -> bool:
        """Append `batch` if it fits, waiting up to `timeout` seconds for room; False if it never did."""
        with self._lock:
            if not self._fits(batch):
                if timeout <= 0 or not self._room.wait_for(lambda: self._fits(batch), timeout):
                    return False
            self._items.append(batch)
            self._queued_blocks += len(batch.blocks)
            self._held_blocks += len(batch.blocks)
            self._held_bytes += batch.nbytes
            self._peak_bytes = max(self._peak_bytes, self._held_bytes)
            self._ready.notify()
            return True

    def put_final(self, item: object) -> None:
        """Append a non-batch item (the sentinel) regardless of the bounds: it holds no bytes."""
        with self._lock:
            self._items.append(item)
            self._ready.notify()

    def get(self, max_bytes: int) -> Any:
        """Wait for an item. A batch comes merged with the batches queued right behind it.

        Args:
            max_bytes: coalescing cap (bytes): further batches are taken while the total stays
                within it; the first batch is always taken whole.

        Returns:
            A `Batch` (blocks in queue order; `release` its size once written), or the non-batch
            item put by `put_final`, which is never merged.
        """
        with self._lock:
            self._ready.wait_for(lambda: bool(self._items))
            while (left := self._behind()) > 0:
                self._ready.wait(left)
            first = self._items.popleft()
            if not isinstance(first, Batch):
                return first
            blocks, size = list(first.blocks), first.nbytes
            while self._items and isinstance(self._items[0], Batch) and size + self._items[0].nbytes <= max_bytes:
                nxt = self._items.popleft()
                blocks.extend(nxt.blocks)
                size += nxt.nbytes
            self._queued_blocks -= len(blocks)
            self._room.notify_all()
            return Batch(blocks, size)

    def _behind(self) -> float:
        """Seconds the first batch is still held back (<= 0: hand it out). Under the lock."""
        first = self._items[0]
        if (self._hurried or not isinstance(first, Batch) or not isinstance(self._items[-1], Batch)
                or 2 * self._queued_blocks >= self.max_blocks):  # fmt: skip
            return 0.0
        return first.at + self.write_behind_s - time.monotonic()

    def hurry(self, on: bool) -> None:
        """Start (`on`) or end one caller's need for every queued batch now: while any caller
        has it on, `get` holds nothing back."""
        with self._lock:
            self._hurried += 1 if on else -1
            self._ready.notify_all()

    def release(self, batch: Batch) -> None:
        """The worker is done with `batch` (taken by `get`): its blocks and bytes leave the bound."""
        with self._lock:
            self._held_blocks -= len(batch.blocks)
            self._held_bytes -= batch.nbytes
            self._room.notify_all()

    @property
    def queued_blocks(self) -> int:
        """Blocks waiting in the queue (not the batch being written)."""
        with self._lock:
            return self._queued_blocks

    @property
    def held_bytes(self) -> int:
        """Bytes queued plus bytes being written by the worker."""
        with self._lock:
            return self._held_bytes

    @property
    def peak_bytes(self) -> int:
        """Highest `held_bytes` since the queue was made (bytes)."""
        with self._lock:
            return self._peak_bytes
