"""`RemoteWriter`: the remote tier's asynchronous writer (one thread, a queue bounded in bytes)."""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvtool.disk.hostblock import HostBlock

if TYPE_CHECKING:
    from kvtool.tiers.remote_store import RemoteStore

logger = logging.getLogger(__name__)

DEFAULT_WRITER_QUEUE_BYTES = 64 << 20
DEFAULT_WRITER_BATCH_BYTES = 8 << 20


class RemoteWriter:
    """Writes blocks to a `RemoteStore` from one background thread.

    The queue is bounded in bytes (`HostBlock.nbytes` of the blocks queued and being written): a
    block that does not fit is dropped at once (counted `remote_dropped_writes` in the store's
    stats), so the request thread never waits on the network. A hash already queued is skipped.
    The thread is a daemon: a remote store never keeps a process alive; `stop()` drains it.

    Args:
        store: the remote store.
        max_queue_bytes: the queue's bound (bytes).
        batch_max_bytes: blocks per `put_blocks` call (bytes).
    """

    def __init__(self, store: RemoteStore, *, max_queue_bytes: int = DEFAULT_WRITER_QUEUE_BYTES,
                 batch_max_bytes: int = DEFAULT_WRITER_BATCH_BYTES) -> None:  # fmt: skip
        if max_queue_bytes <= 0 or batch_max_bytes <= 0:
            raise ValueError("max_queue_bytes and batch_max_bytes must be > 0")
        self.store = store
        self.max_queue_bytes = max_queue_bytes
        self.batch_max_bytes = batch_max_bytes
        self._queue: collections.deque[HostBlock] = collections.deque()
        self._hashes: set[str] = set()
        self._bytes = 0  # queued + being written
        self._busy = False
        self._closing = False
        self._written = 0
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="kvtool-remote-writer", daemon=True)
        self._thread.start()

    def enqueue(self, blocks: Sequence[HostBlock]) -> int:
        """Queue `blocks` (in order) as far as they fit; never blocks.

        Returns:
            How many were queued; the others (no room, writer stopped) are dropped and counted.
            Blocks whose hash is queued already are skipped (neither queued nor dropped).
        """
        queued = dropped = 0
        with self._cond:
            for b in blocks:
                if b.block_hash in self._hashes:
                    continue
                size = b.nbytes
                if self._closing or self._bytes + size > self.max_queue_bytes:
                    dropped += 1
                    continue
                self._queue.append(b)
                self._hashes.add(b.block_hash)
                self._bytes += size
                queued += 1
            if queued:
                self._cond.notify_all()
        self.store.count_dropped(dropped)
        return queued

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                if not self._queue:
                    return
                batch: list[HostBlock] = []
                size = 0
                while self._queue and (not batch or size + self._queue[0].nbytes <= self.batch_max_bytes):
                    b = self._queue.popleft()
                    batch.append(b)
                    size += b.nbytes
                self._busy = True
            try:
                self._written += self.store.put_blocks(batch)
            except Exception:  # noqa: BLE001 - the writer thread must live on; put_blocks counts failures
                logger.exception("remote writer: unexpected error")
            finally:
                with self._cond:
                    self._busy = False
                    self._bytes -= size
                    for b in batch:
                        self._hashes.discard(b.block_hash)
                    self._cond.notify_all()

    def queued_bytes(self) -> int:
        """Bytes queued and being written."""
        with self._cond:
            return self._bytes

    def flush(self, timeout_s: float | None = 30.0) -> bool:
        """Wait until every queued block was attempted; False on timeout (seconds)."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._busy, timeout_s)

    def stop(self, timeout_s: float | None = 30.0) -> bool:
        """Refuse new blocks, write the queued ones, end the thread; False if that took longer
        than `timeout_s` seconds (the thread, a daemon, then ends with the process). Idempotent."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def stats(self) -> dict[str, int]:
        """`remote_writer_queue_bytes`, `remote_writer_queue_blocks` (gauges) and
        `remote_writer_stored` (blocks this writer stored)."""
        with self._cond:
            return {"remote_writer_queue_bytes": self._bytes, "remote_writer_queue_blocks": len(self._queue),
                    "remote_writer_stored": self._written}  # fmt: skip
