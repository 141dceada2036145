"""Reading a chain's values from the remote tier (`ValueRead`, made by `RemoteStore.read`):
pipelined batches of GETRANGE, each value verified (`remote_value.decode_value`: exactly the
checks of an SSD hit, with the request's own chain hashes, parents and token ids) and handed to
the request thread batch by batch. Only verified blocks leave `blocks`; a bad value is a miss,
deleted and counted.

The server copies values into the socket on another core while the client verifies and places, if
the client has asked for them ahead (measurements: docs/benchmarks.md):
- one node (the default): the batches' requests go out on one pooled connection `window`
  batches ahead of the batch being verified (`_Wire`): no thread, no lock;
- a cluster (values on several nodes, so no one connection): `ahead` batches fetched and
  verified on the store's reader threads, where cores are to spare (`DEFAULT_READ_AHEAD`); with
  `ahead` 0 each batch is one `pipeline().execute()` on the thread that takes it.

Every batch is one `RemoteStore` call (the store's deadline on each socket operation, its
circuit breaker; a failed batch is a miss for it and the rest of the chain). `cancel()` stops
what has not started; replies still on the wire are dropped with their connection. MLX-free.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import CancelledError, Future
from typing import Any, NamedTuple, Protocol, TypeVar

import numpy as np

from kvtool.disk.hostblock import HostBlock
from kvtool.disk.kvlayout import KVLayout
from kvtool.tiers import remote_cas
from kvtool.tiers import remote_value as rv

__all__ = ["DEFAULT_READ_AHEAD", "DEFAULT_READ_BATCH_BYTES", "DEFAULT_WIRE_WINDOW", "Got", "ValueRead", "ValueSource",
           "empty_strings", "fetch_values", "raise_connection_errors"]

T = TypeVar("T")

DEFAULT_READ_BATCH_BYTES = 512 << 10  # bytes of values per pipelined batch (expected sizes): smaller came back faster
# One node: batches whose requests are on the wire ahead of the one being verified (`_Wire`):
# at most this many batches of replies wait in the socket and the server's output buffer.
DEFAULT_WIRE_WINDOW = 4
# A cluster: batches read and verified ahead on reader threads, only where cores are to spare (on
# 2 cores reader threads cost more CPU than they hid, at equal TTFT)
DEFAULT_READ_AHEAD = 2 if (os.cpu_count() or 1) >= 4 else 0


class ValueSource(Protocol):
    """What a read needs of the remote store (`kvtool.tiers.remote_store.RemoteStore`): its
    namespace, its guarded calls (deadline, circuit breaker: a failure is `default`), its counters,
    key names and value bounds, its reader threads, and the removal of bad values."""

    layout_key: str
    kv: KVLayout
    codec: str

    @property
    def cluster(self) -> bool: ...

    def call(self, op: Callable[[Any], T], default: T, *, trip: bool = False) -> T: ...

    def count(self, name: str, n: int = 1) -> None: ...

    def key_of(self, chain_hash: str) -> str | None: ...

    def expected_bytes(self, n_tokens: int) -> int: ...

    def submit_read(self, fn: Callable[[Any], T], arg: Any) -> Future[T]: ...

    def corrupt(self, key: str, exc: rv.RemoteValueError) -> None: ...

    def unlink(self, client: Any, keys: list[tuple[str, rv.Manifest | None, bytes]]) -> None: ...


def raise_connection_errors(results: Sequence[Any]) -> None:
    """Per-command results of a pipeline: a connection-level error fails the whole call."""
    from redis.exceptions import ConnectionError as RConnectionError
    from redis.exceptions import TimeoutError as RTimeoutError

    for r in results:
        if isinstance(r, (RConnectionError, RTimeoutError, OSError)):
            raise r


def pipelined(client: Any, items: Iterable[Any], add: Callable[[Any, Any], object]) -> list[Any]:
    """`add(pipe, item)` for each of `items` in one pipeline (no transaction): the replies, in
    order (a key's own error as an exception); a connection-level error raises."""
    pipe = client.pipeline(transaction=False)
    for item in items:
        add(pipe, item)
    results = pipe.execute(raise_on_error=False)
    raise_connection_errors(results)
    return results


class Got(NamedTuple):
    """What a reader thread fetched for one key.

    Attributes:
        data: the value's bytes (a split value's parts joined), or None (absent, evicted, a
            server error for that key, or refused: see `error`).
        manifest: the split value's manifest, if it was one (its parts go with a bad value).
        error: why the value is bad before any parse (not a string, a malformed manifest, parts
            of the wrong size), or None.
        guard: what deleting it compares (`remote_cas.guard`): the manifest read, else b"".
    """

    data: bytes | None
    manifest: rv.Manifest | None = None
    error: rv.RemoteValueError | None = None
    guard: bytes = b""


_ABSENT = Got(None)


def fetch_values(store: ValueSource, client: Any, keys: Sequence[str], bounds: Sequence[int]) -> list[Got]:
    """One `Got` per key of `keys`: one pipelined GETRANGE per key on `client` (a byte more than
    `bounds[i]`, the largest value it may have in bytes, so an oversized value shows), then one
    pipeline for the parts of split values. Runs on a reader thread; counts `remote_bytes_read` and
    per-key server errors in `store`.

    Raises:
        redis.exceptions.ConnectionError, TimeoutError, OSError: the call failed (a miss for the
            whole batch, counted by the store's `call`).
    """
    results = pipelined(client, zip(keys, bounds), lambda pipe, kb: pipe.getrange(kb[0], 0, kb[1]))
    return _gots(store, client, keys, bounds, results)


def _gots(store: ValueSource, client: Any, keys: Sequence[str], bounds: Sequence[int], results: Sequence[Any]) -> list[Got]:
    """`Got`s of a batch's GETRANGE replies (bytes, None, or the server's error for one key);
    split values' parts fetched in one more pipeline. Raises as `fetch_values`."""
    raise_connection_errors(results)
    out: list[Got] = []
    split: list[tuple[int, rv.Manifest]] = []
    nbytes = 0
    empty = _empty_values(client, keys, results)
    for i, data in enumerate(results):
        if i in empty:  # an empty string: SET NX would never replace it, so it must go
            out.append(Got(None, None, rv.RemoteValueError("truncated", "an empty value")))
        elif isinstance(data, bytes) and data:
            nbytes += len(data)
            if rv.is_manifest(data):
                try:
                    split.append((i, rv.parse_manifest(data, bounds[i])))
                except rv.RemoteValueError as exc:
                    out.append(Got(None, None, exc, remote_cas.guard(data)))
                    continue
            out.append(Got(data))
        elif isinstance(data, Exception):
            if "WRONGTYPE" in str(data):  # another type of key under our name: ours to replace
                out.append(Got(None, None, rv.RemoteValueError("header", "not a string value")))
                continue
            store.count("remote_errors")  # e.g. an ACL refusal: not the value's fault
            out.append(_ABSENT)
        else:
            out.append(_ABSENT)
    store.count("remote_bytes_read", nbytes)
    if split:
        _fetch_parts(store, client, keys, split, out)
    return out


def _empty_values(client: Any, keys: Sequence[str], results: Sequence[Any]) -> set[int]:
    """Indices of the keys whose GETRANGE reply was empty and that hold an empty string (a key
    that does not exist answers empty too: evicted or expired since the lookup, a plain miss).
    Raises as `fetch_values`."""
    at = [i for i, data in enumerate(results) if isinstance(data, bytes) and not data]
    if not at:
        return set()
    empty = set(empty_strings(client, [keys[i] for i in at]))
    return {i for i in at if keys[i] in empty}


def empty_strings(client: Any, keys: Sequence[str]) -> list[str]:
    """The `keys` that exist and hold an empty string, each asked in a transaction of its own
    (EXISTS and STRLEN at one instant: a key deleted and written again meanwhile is not taken for
    an empty one; one round trip per key, for keys whose value read back empty only).

    Raises:
        redis.exceptions.ConnectionError, TimeoutError, OSError: the call failed.
    """
    out = []
    for key in keys:
        pipe = client.pipeline(transaction=True)
        pipe.exists(key)
        pipe.strlen(key)
        found = pipe.execute(raise_on_error=False)
        raise_connection_errors(found)
        if found == [1, 0]:
            out.append(key)
    return out


def _fetch_parts(store: ValueSource, client: Any, keys: Sequence[str], split: list[tuple[int, rv.Manifest]],
                 out: list[Got]) -> None:  # fmt: skip
    wanted = [(part, m.part_bytes) for i, m in split for part in m.part_keys(keys[i])]
    results = pipelined(client, wanted, lambda pipe, pb: pipe.getrange(pb[0], 0, pb[1]))
    at = 0
    for i, m in split:
        parts = [r if isinstance(r, bytes) and r else None for r in results[at : at + m.n_parts]]
        at += m.n_parts
        store.count("remote_bytes_read", sum(len(p) for p in parts if p))
        try:
            out[i] = Got(rv.join_parts(m, parts), m, None, m.encode())
        except rv.RemoteValueError as exc:
            # an evicted or expired part: a miss, its remains deleted but not counted as corrupt
            out[i] = Got(None, m, None if any(p is None for p in parts) else exc, m.encode())


class _Wire:
    """One pooled connection of a single-node client (`redis.Redis`) carrying a read's batches in
    order: requests sent ahead (`send`), replies taken batch by batch (`recv`), with redis-py's own
    command packing and reply parsing, as its pipelines do. Raises as `fetch_values` on connecting."""

    def __init__(self, client: Any):
        self.pool = client.connection_pool
        self.conn: Any = self.pool.get_connection()
        self.pending: deque[int] = deque()  # replies of each batch sent and not taken yet
        self.sent = 0  # batches sent

    def send(self, keys: Sequence[str], bounds: Sequence[int]) -> None:
        """Send one batch's GETRANGEs (a byte more than each bound, as `fetch_values`)."""
        self.conn.send_packed_command(self.conn.pack_commands([("GETRANGE", k, 0, b) for k, b in zip(keys, bounds)]))
        self.pending.append(len(keys))
        self.sent += 1

    def recv(self) -> list[Any]:
        """The replies of the oldest batch sent: bytes, None, or the server's error for one key."""
        from redis.exceptions import ResponseError

        n = self.pending.popleft()
        out: list[Any] = []
        for _ in range(n):
            try:
                out.append(self.conn.read_response())
            except ResponseError as exc:  # one key's error (WRONGTYPE, an ACL refusal): the reply was read
                out.append(exc)
        return out

    def close(self, broken: bool = False) -> None:
        """Give the connection back; dropped instead when replies are left on it or it failed
        (idempotent)."""
        conn, self.conn = self.conn, None
        if conn is None:
            return
        if broken or self.pending:
            conn.disconnect()
        self.pool.release(conn)


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
        window: with `ahead` 0 on one node, batches whose requests are sent ahead on one
            connection (`_Wire`; the first ones at once); 0: one `pipeline().execute()` a batch.

    Raises:
        ValueError: the three sequences differ in length.
    """

    def __init__(self, store: ValueSource, hashes: Sequence[str], parents: Sequence[str],
                 token_ids: Sequence[np.ndarray | Sequence[int]], *, batch_bytes: int = DEFAULT_READ_BATCH_BYTES,
                 ahead: int = DEFAULT_READ_AHEAD, window: int = DEFAULT_WIRE_WINDOW):  # fmt: skip
        if not len(hashes) == len(parents) == len(token_ids):
            raise ValueError("hashes, parents and token_ids must have the same length")
        keys: list[str] = []
        for h in hashes:
            key = store.key_of(h)
            if key is None:
                break
            keys.append(key)
        n = len(keys)
        self.store, self.keys = store, keys
        self.hashes, self.parents, self.token_ids = list(hashes[:n]), list(parents[:n]), list(token_ids[:n])
        self.bounds = [store.expected_bytes(len(t)) for t in self.token_ids]
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
        self.window = max(0, window) if not self.ahead and not store.cluster else 0
        self._wire: _Wire | None = None
        self._submit_upto(self.ahead)
        if self.window and self.batches:
            self._stopped = not store.call(lambda client: self._send_upto(client, self.window), False)

    def _submit_upto(self, n: int) -> None:
        if not self.ahead:
            return
        with self._lock:
            while not self._stopped and len(self._futures) < min(n, len(self.batches)):
                batch = self.batches[len(self._futures)]
                self._futures.append(self.store.submit_read(self._fetch, batch))

    def _send_upto(self, client: Any, n: int) -> bool:
        """Send the requests of the batches before `n` that are not on the wire yet (the
        store's call: failures close the connection and propagate)."""
        try:
            wire = self._wire
            if wire is None:
                wire = self._wire = _Wire(client)
            while wire.sent < min(n, len(self.batches)):
                batch = self.batches[wire.sent]
                wire.send(self.keys[batch.start : batch.stop], self.bounds[batch.start : batch.stop])
        except BaseException:
            self._close_wire(broken=True)
            raise
        return True

    def _fetch_wire(self, b: int) -> list[HostBlock | None] | None:
        """Batch `b` (the next one) from the wire, the following ones sent first; verified."""
        batch = self.batches[b]
        keys, bounds = self.keys[batch.start : batch.stop], self.bounds[batch.start : batch.stop]

        def op(client: Any) -> list[Got]:
            self._send_upto(client, b + self.window)
            wire = self._wire
            assert wire is not None and wire.sent - len(wire.pending) == b  # batches are taken in order
            try:
                results = wire.recv()
            except BaseException:
                self._close_wire(broken=True)
                raise
            if b + 1 == len(self.batches):
                self._close_wire()
            return _gots(self.store, client, keys, bounds, results)

        if self._stopped:
            return None
        got = self.store.call(op, None)
        if got is None:
            self._close_wire(broken=True)
            return None
        return self._verify(batch, got)

    def _close_wire(self, broken: bool = False) -> None:
        wire, self._wire = self._wire, None
        if wire is not None:
            wire.close(broken)

    def _fetch(self, batch: range) -> list[HostBlock | None] | None:
        """A reader thread: one batch fetched and verified, or None (stopped, or the call failed)."""
        if self._stopped:
            return None
        keys, bounds = self.keys[batch.start : batch.stop], self.bounds[batch.start : batch.stop]
        got = self.store.call(lambda client: fetch_values(self.store, client, keys, bounds), None)
        return None if got is None else self._verify(batch, got)

    def cancel(self) -> None:
        """Stop reading ahead (idempotent; batches on the wire end within their deadline)."""
        with self._lock:
            self._stopped = True
            for fut in self._futures:
                fut.cancel()
        self._close_wire()

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
                store.count("remote_lookups")
                counted = True
            out = out[: n - batch.start]
            store.count("remote_hit_blocks", sum(x is not None for x in out))
            yield from zip(batch, out)
            if stop_at_miss and any(x is None for x in out):
                self.cancel()
                return

    def _result(self, b: int) -> list[HostBlock | None] | None:
        if self.window:
            return self._fetch_wire(b)
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
        bad: list[tuple[str, rv.Manifest | None, bytes]] = []
        for k, g in zip(batch, got):
            key = self.keys[k]
            block = None
            if g.error is not None:
                store.corrupt(key, g.error)
            elif g.data is not None:
                try:
                    block = rv.decode_value(g.data, store.layout_key, store.kv, store.codec, self.hashes[k],
                                            self.parents[k], expected_tokens=self.token_ids[k], max_bytes=len(g.data))  # fmt: skip
                except rv.RemoteValueError as exc:
                    store.corrupt(key, exc)
            if block is None and (g.error is not None or g.data is not None or g.manifest is not None):
                bad.append((key, g.manifest, g.guard))  # bad, or a part evicted: the rest of the value goes
            out.append(block)
        if bad:
            store.call(lambda client: store.unlink(client, bad), None)
        return out
