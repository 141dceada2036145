"""Reading a chain's values from the remote tier: batches fetched and verified ahead on reader
threads (`ValueRead`, made by `RemoteStore.read`), handed to the request thread as they are ready.

A remote hit is bound by the socket: the client's CPU is idle for much of a pipelined GET, while
verifying a value (header, checksum, token ids) and placing it into the request's buffers is
CPU work. So the values are read in pipelined batches of `batch_bytes` (by their expected sizes)
and, where cores are to spare (`DEFAULT_READ_AHEAD`), on the store's reader threads, at most
`ahead` batches in flight, each verified on its reader thread as soon as it arrives (`remote_value.decode_value`: exactly the checks of an SSD hit, with
the request's own chain hashes, parents and token ids), while the request thread places the
previous batch (numpy copies, which release the GIL, as redis-py does while it waits on the
socket). With `ahead` 0 each batch is fetched and verified on the thread that takes it. Only
verified blocks leave `blocks`; a bad value is a miss, deleted and counted.

Every batch is one `RemoteStore` call (the store's deadline on each socket operation, its
circuit breaker; a failed batch is a miss for it and the rest of the chain). `cancel()` stops
what has not started (a batch already on the wire ends within its deadline; its bytes are
dropped).

MLX-free.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import CancelledError, Future
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from kvtool.hostblock import HostBlock
from kvtool.store import remote_value as rv

if TYPE_CHECKING:
    from kvtool.store.remote import RemoteStore

__all__ = ["DEFAULT_READ_AHEAD", "DEFAULT_READ_BATCH_BYTES", "Got", "ValueRead", "fetch_values"]

DEFAULT_READ_BATCH_BYTES = 2 << 20  # bytes of values per pipelined read (expected sizes)
# Batches read and verified ahead on reader threads: only where cores are to spare. On 2 shared
# cores (redis-server, the request thread and other work on them) reader threads cost more CPU
# than they hide: a 16k-token `tiny` hit (17 MB, 256 values) in a fresh process took ~87 ms of
# CPU read on the request thread vs ~100-125 ms with 1-2 reader threads, at equal TTFT within
# noise (load average 4-5); with idle cores the ~20 ms of verifying and placing overlap the
# socket reads instead.
DEFAULT_READ_AHEAD = 2 if (os.cpu_count() or 1) >= 4 else 0


class Got(NamedTuple):
    """What a reader thread fetched for one key.

    Attributes:
        data: the value's bytes (a split value's parts joined), or None (absent, evicted, a
            server error for that key, or refused: see `error`).
        manifest: the split value's manifest, if it was one (its parts go with a bad value).
        error: why the value is bad before any parse (not a string, a malformed manifest, parts
            of the wrong size), or None.
    """

    data: bytes | None
    manifest: rv.Manifest | None = None
    error: rv.RemoteValueError | None = None


_ABSENT = Got(None)


def fetch_values(store: RemoteStore, client: Any, keys: Sequence[str], bounds: Sequence[int]) -> list[Got]:
    """One pipelined GETRANGE per key (a byte more than `bounds[i]`, so an oversized value shows),
    then one pipeline for the parts of split values. Runs on a reader thread; counts
    `remote_bytes_read` and per-key server errors.

    Args:
        store: the store (its counters).
        client: a redis-py client (node or cluster).
        keys: value keys.
        bounds: the largest value each may have (bytes).

    Returns:
        One `Got` per key.

    Raises:
        redis.exceptions.ConnectionError, TimeoutError, OSError: the call failed (a miss for the
            whole batch, counted by the store's `_call`).
    """
    pipe = client.pipeline(transaction=False)
    for key, bound in zip(keys, bounds):
        pipe.getrange(key, 0, bound)
    results = pipe.execute(raise_on_error=False)
    store._raise_connection_errors(results)
    out: list[Got] = []
    split: list[tuple[int, rv.Manifest]] = []
    nbytes = 0
    for i, data in enumerate(results):
        if isinstance(data, bytes) and data:
            nbytes += len(data)
            if rv.is_manifest(data):
                try:
                    split.append((i, rv.parse_manifest(data, bounds[i])))
                except rv.RemoteValueError as exc:
                    out.append(Got(None, None, exc))
                    continue
            out.append(Got(data))
        elif isinstance(data, Exception):
            if "WRONGTYPE" in str(data):  # another type of key under our name: ours to replace
                out.append(Got(None, None, rv.RemoteValueError("header", "not a string value")))
                continue
            store._count("remote_errors")  # e.g. an ACL refusal: not the value's fault
            out.append(_ABSENT)
        else:
            out.append(_ABSENT)
    store._count("remote_bytes_read", nbytes)
    if split:
        _fetch_parts(store, client, keys, split, out)
    return out


def _fetch_parts(store: RemoteStore, client: Any, keys: Sequence[str], split: list[tuple[int, rv.Manifest]],
                 out: list[Got]) -> None:  # fmt: skip
    pipe = client.pipeline(transaction=False)
    for i, m in split:
        for part in m.part_keys(keys[i]):
            pipe.getrange(part, 0, m.part_bytes)
    results = pipe.execute(raise_on_error=False)
    store._raise_connection_errors(results)
    at = 0
    for i, m in split:
        parts = [r if isinstance(r, bytes) and r else None for r in results[at : at + m.n_parts]]
        at += m.n_parts
        store._count("remote_bytes_read", sum(len(p) for p in parts if p))
        try:
            out[i] = Got(rv.join_parts(m, parts), m)
        except rv.RemoteValueError as exc:
            # an evicted or expired part: a miss, its remains deleted but not counted as corrupt
            out[i] = Got(None, m, None if any(p is None for p in parts) else exc)


class ValueRead:
    """The values of a run of chain entries being read ahead and verified on reader threads
    (see the module docstring).

    Args:
        store: the namespace's store.
        hashes: chain hashes, in chain order (cut before the first that is not a chain hash).
        parents: each entry's expected parent hash.
        token_ids: each entry's exact token ids (int32 `[n]`; `n` also bounds its value size).
        batch_bytes: values per pipelined read, by expected size (bytes).
        ahead: batches in flight ahead of the consumer on the store's reader threads; 0: none,
            each batch is fetched and verified on the consumer's thread when it is taken.

    Raises:
        ValueError: the three sequences differ in length.
    """

    def __init__(self, store: RemoteStore, hashes: Sequence[str], parents: Sequence[str],
                 token_ids: Sequence[np.ndarray | Sequence[int]], *, batch_bytes: int = DEFAULT_READ_BATCH_BYTES,
                 ahead: int = DEFAULT_READ_AHEAD):  # fmt: skip
        if not len(hashes) == len(parents) == len(token_ids):
            raise ValueError("hashes, parents and token_ids must have the same length")
        keys: list[str] = []
        for h in hashes:
            key = store._key(h)
            if key is None:
                break
            keys.append(key)
        n = len(keys)
        self.store, self.keys = store, keys
        self.hashes, self.parents, self.token_ids = list(hashes[:n]), list(parents[:n]), list(token_ids[:n])
        self.bounds = [store._expected_bytes(len(t)) for t in self.token_ids]
        self.batches: list[range] = []
        i = 0
        while i < n:
            j, size = i + 1, self.bounds[i]
            while j < n and size + self.bounds[j] <= batch_bytes:
                size += self.bounds[j]
                j += 1
            self.batches.append(range(i, j))
            i = j
        self.ahead = max(0, ahead)
        self._futures: list[Future] = []
        self._lock = threading.Lock()
        self._stopped = False
        self._submit_upto(self.ahead)

    def __len__(self) -> int:
        return len(self.keys)

    def _submit_upto(self, n: int) -> None:
        if not self.ahead:
            return
        with self._lock:
            while not self._stopped and len(self._futures) < min(n, len(self.batches)):
                batch = self.batches[len(self._futures)]
                self._futures.append(self.store._submit_read(self._fetch, batch))

    def _fetch(self, batch: range) -> list[HostBlock | None] | None:
        """A reader thread: one batch fetched and verified, or None (stopped, or the call failed)."""
        if self._stopped:
            return None
        keys, bounds = self.keys[batch.start : batch.stop], self.bounds[batch.start : batch.stop]
        got = self.store._call(lambda client: fetch_values(self.store, client, keys, bounds), None)
        return None if got is None else self._verify(batch, got)

    def cancel(self) -> None:
        """Stop reading ahead (idempotent; batches on the wire end within their deadline)."""
        with self._lock:
            self._stopped = True
            for fut in self._futures:
                fut.cancel()

    def blocks(self, n: int | None = None, *, stop_at_miss: bool = True) -> Iterator[tuple[int, HostBlock | None]]:
        """Verified blocks in chain order, a batch at a time as they arrive.

        Args:
            n: yield at most the first `n` entries (None: all).
            stop_at_miss: end after the first batch with a miss (a chain is cut there; the rest
                is cancelled); else every entry is yielded.

        Yields:
            `(index, block or None)`: None is absent, evicted, or bad (deleted and counted
            `remote_corrupt`). Stops at the first batch whose call failed.
        """
        store, counted = self.store, False
        n = len(self.keys) if n is None else min(n, len(self.keys))
        for b, batch in enumerate(self.batches):
            if batch.start >= n:
                break
            self._submit_upto(b + 1 + self.ahead)
            out = self._result(b)
            if out is None:
                self.cancel()
                return
            if not counted:
                store._count("remote_lookups")
                counted = True
            out = out[: n - batch.start]
            store._count("remote_hit_blocks", sum(x is not None for x in out))
            yield from zip(batch, out)
            if stop_at_miss and any(x is None for x in out):
                self.cancel()
                return

    def _result(self, b: int) -> list[HostBlock | None] | None:
        if not self.ahead:
            return self._fetch(self.batches[b])
        with self._lock:
            fut = self._futures[b] if b < len(self._futures) else None
        if fut is None:
            return None
        try:
            return fut.result()
        except CancelledError:
            return None

    def _verify(self, batch: range, got: list[Got]) -> list[HostBlock | None]:
        """Decode and verify a batch (`remote_value.decode_value`); bad values are counted and
        deleted."""
        store = self.store
        out: list[HostBlock | None] = []
        bad: list[tuple[str, rv.Manifest | None]] = []
        for k, g in zip(batch, got):
            key = self.keys[k]
            block = None
            if g.error is not None:
                store._corrupt(key, g.error, bad, g.manifest)
            elif g.data is not None:
                try:
                    block = rv.decode_value(g.data, store.layout_key, store.kv, store.codec, self.hashes[k],
                                            self.parents[k], expected_tokens=self.token_ids[k], max_bytes=len(g.data))  # fmt: skip
                except rv.RemoteValueError as exc:
                    store._corrupt(key, exc, bad, g.manifest)
            elif g.manifest is not None:  # an evicted part: drop the rest of the value
                bad.append((key, g.manifest))
            out.append(block)
        if bad:
            store._call(lambda client: store._unlink(client, bad), None)
        return out
