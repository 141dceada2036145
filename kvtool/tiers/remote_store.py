"""The remote tier's store: blocks shared between hosts through Redis OSS >= 6.2 or Valkey, one
node or a Redis Cluster, over RESP with redis-py (docs/design.md, "Remote tier store": values,
keys, split values, compare-and-delete, reads, writes, failure isolation, trust).

Values are the verified bytes of a one-record segment (`kvtool.tiers.remote_value`); a value that
fails verification is a miss, is deleted, and counts `remote_corrupt`. The remote tier can only
make requests miss, never fail or hang them: every socket operation has the deadline `timeout_s`,
every call a whole-call deadline (`kvtool.tiers.call_deadline`), a circuit breaker (`Breaker`)
stops calling a failing server for a doubling back-off, and no method raises for a server problem
(the call returns a miss: `None`, 0, False, and counts `remote_errors`); only programming errors
raise (`ValueError` on arguments of different lengths; `RemoteURLError` at construction). The
request path never lists keys: EXISTS, GETRANGE, SET NX, UNLINK and EVAL on named keys, pipelined.
Reads: `read` (`kvtool.tiers.remote_read`). Writes: `save_blocks`, first writer wins (`SET NX`),
the sink of the remote tier's writer (`AsyncWriter`, `when_full="shed"`).

Counters (`stats()`): `remote_lookups` (longest_prefix calls and reads, `read`, that reached the
server), `remote_hit_blocks`, `remote_bytes_read`, `remote_bytes_written` (bytes of values
stored), `remote_errors` (failed calls, and per-key server errors), `remote_corrupt` (values
that failed verification, deleted), `remote_dropped_writes` (blocks that never reached the
server: breaker open, failed call, full writer queue, writer stopped), `remote_breaker_open`
(gauge, 0/1), `remote_breaker_trips` (times it opened), `remote_put_exists` (blocks another
writer had stored first).

MLX-free; redis-py is imported when a store is built.
"""

from __future__ import annotations

import collections
import functools
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import suppress
from typing import Any, TypeVar

import numpy as np

from kvtool.config.remote_url import RemoteURL, describe_error, make_client, mask_url, parse_remote_url
from kvtool.disk.hostblock import HostBlock
from kvtool.disk.kvlayout import KVLayout
from kvtool.tiers import remote_cas
from kvtool.tiers import remote_value as rv
from kvtool.tiers.breaker import Breaker
from kvtool.tiers.call_deadline import WATCHDOG, Expiry, call_deadline_s, close_connections, failure_text
from kvtool.tiers.remote_read import (
    DEFAULT_READ_AHEAD,
    DEFAULT_READ_BATCH_BYTES,
    ValueRead,
    pipelined,
    raise_connection_errors,
)

__all__ = ["COUNTER_NAMES", "RemoteStore", "mask_url"]

logger = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_TIMEOUT_S = 0.25
DEFAULT_BATCH_BYTES = 8 << 20  # bytes of values per pipelined write
COUNTER_NAMES = ("remote_lookups", "remote_hit_blocks", "remote_bytes_read", "remote_bytes_written", "remote_errors",
                 "remote_corrupt", "remote_dropped_writes", "remote_breaker_open", "remote_breaker_trips",
                 "remote_put_exists")  # fmt: skip


class RemoteStore:
    """One namespace (layout key) of the remote tier on a Redis / Valkey server or cluster.

    Args:
        url: `redis://`, `rediss://`, `unix://`, `redis+cluster://` (see `kvtool.config.remote_url`);
            the password may come from `$KVTOOL_REMOTE_PASSWORD`.
        layout_key: the namespace (32 hex characters).
        kv: the namespace's KV layout.
        codec: the namespace's record codec ('none', 'zstd', 'lz4').
        timeout_s: deadline of every socket operation, connect included (seconds).
        ttl_s: expiry of stored values (seconds, rounded up; `EX`); None: no expiry (the server's
            eviction policy, or `kvtool remote prune`, removes them).
        cluster: True: a Redis Cluster; None: the URL's scheme decides (`redis+cluster://`).
        max_value_bytes: largest string stored (bytes); larger values are split into parts.
        batch_bytes: values per pipelined write, by size (bytes).
        read_batch_bytes: values per pipelined read, by expected size (bytes).
        read_ahead: read batches fetched and verified on reader threads ahead of the thread that
            takes them (0: each batch on the taking thread, when taken; on one node its requests
            sent ahead on one connection, `kvtool.tiers.remote_read`); None: 0 on one node,
            `DEFAULT_READ_AHEAD` on a cluster.
        read_threads: reader threads (each batch in flight uses a connection).
        breaker_failures: consecutive failed calls that open the breaker.
        breaker_backoff_s, breaker_max_backoff_s: its first and longest back-off (seconds).
        clock: monotonic clock (tests).

    Raises:
        RemoteURLError: a malformed URL (never a server problem: a server down at start leaves
            the store unavailable, and it reconnects later).
        ValueError: a bad layout key, timeout, TTL or size.
    """

    def __init__(
        self,
        url: str,
        layout_key: str,
        kv: KVLayout,
        codec: str = "none",
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        ttl_s: float | None = None,
        cluster: bool | None = None,
        max_value_bytes: int = rv.DEFAULT_MAX_VALUE_BYTES,
        batch_bytes: int = DEFAULT_BATCH_BYTES,
        read_batch_bytes: int = DEFAULT_READ_BATCH_BYTES,
        read_ahead: int | None = None,
        read_threads: int = 2,
        breaker_failures: int = 3,
        breaker_backoff_s: float = 1.0,
        breaker_max_backoff_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.remote: RemoteURL = parse_remote_url(url, cluster=cluster)
        if not rv.is_hex32(layout_key):
            raise ValueError("layout_key must be 32 lower-case hex characters")
        if not (isinstance(timeout_s, (int, float)) and 0 < timeout_s <= 3600):
            raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s!r}")
        if ttl_s is not None and not (isinstance(ttl_s, (int, float)) and 0 < ttl_s < 2**31):
            raise ValueError(f"ttl_s must be None or > 0 seconds, got {ttl_s!r}")
        if not isinstance(max_value_bytes, int) or max_value_bytes < rv.MIN_MAX_VALUE_BYTES:
            raise ValueError(f"max_value_bytes must be an integer >= {rv.MIN_MAX_VALUE_BYTES}")
        if codec not in ("none", "zstd", "lz4"):
            raise ValueError(f"unknown codec {codec!r}")
        self.layout_key, self.kv, self.codec = layout_key, kv, codec
        self.timeout_s = float(timeout_s)
        self.ttl_ex = None if ttl_s is None else max(1, math.ceil(ttl_s))
        self.max_value_bytes = max_value_bytes
        self.batch_bytes = max(1, batch_bytes)
        self.read_batch_bytes = max(1, read_batch_bytes)
        self.read_ahead = (DEFAULT_READ_AHEAD if self.remote.cluster else 0) if read_ahead is None else max(0, read_ahead)
        self.read_threads = max(1, read_threads)
        self._readers: ThreadPoolExecutor | None = None
        self._breaker = Breaker(max(1, breaker_failures), breaker_backoff_s, breaker_max_backoff_s, clock)
        self._client: Any = None
        self._client_lock = threading.Lock()
        self._known_nodes: list[tuple[str, int]] = []
        self._counts: collections.Counter[str] = collections.Counter()
        self._count_lock = threading.Lock()
        self._closed = False
        self.last_error: str | None = None  # the last server failure or refusal, one line (URL masked)
        if not self.call(lambda c: bool(c.ping()), False, trip=True):
            logger.debug("remote tier %s not reachable at start", self.remote.masked)

    # ------------------------------------------------------------------ plumbing
    @property
    def url(self) -> str:
        """The server's URL, password masked."""
        return self.remote.masked

    @property
    def available(self) -> bool:
        """False while the breaker is open (the server failed recently; calls are misses)."""
        return not self._breaker.is_open and not self._closed

    @property
    def cluster(self) -> bool:
        """The server is a Redis Cluster (values on several nodes)."""
        return self.remote.cluster

    def count(self, name: str, n: int = 1) -> None:
        """Add `n` to counter `name` (see the module docstring)."""
        if n:
            with self._count_lock:
                self._counts[name] += n

    def _get_client(self) -> Any:
        with self._client_lock:
            if self._client is None:
                if self.remote.cluster and self._known_nodes:
                    from redis.cluster import ClusterNode, RedisCluster

                    kw = self.remote.client_kwargs(self.timeout_s)
                    kw.pop("host", None), kw.pop("port", None)
                    self._client = RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in self._known_nodes],
                                                require_full_coverage=False, **kw)  # fmt: skip
                else:
                    self._client = make_client(self.remote, self.timeout_s)
                if self.remote.cluster:
                    self._known_nodes = [(n.host, n.port) for n in self._client.get_nodes()]
            return self._client

    def _drop_client(self) -> None:
        """Close the client (the next call makes a new one)."""
        with self._client_lock:
            client, self._client = self._client, None
        if client is not None:
            with suppress(Exception):  # closing a broken client: nothing to do about it
                client.close()

    def call(self, op: Callable[[Any], T], default: T, *, trip: bool = False) -> T:
        """`op(client)`, or `default` if the breaker is open or it fails (counted, logged)."""
        if self._closed or not self._breaker.allow():
            return default
        expiry = Expiry()
        try:
            client = self._get_client()
            with WATCHDOG.deadline(call_deadline_s(self.timeout_s), lambda: close_connections(client)) as expiry:
                result = op(client)
        except Exception as exc:  # noqa: BLE001 - any failure of the remote tier is a miss
            self.count("remote_errors")
            self.last_error = why = failure_text(exc, expiry, self.remote, self.timeout_s)
            if self.remote.cluster:  # rebuilt after a failure: its slot map may be stale, a node gone
                self._drop_client()
            if self._breaker.failure(trip=trip):
                self.count("remote_breaker_trips")
                logger.warning("remote tier unavailable, requests go on without it (retrying in the background): %s", why)
            else:
                logger.debug("remote tier call failed: %s", why)
            return default
        if self._breaker.success():
            logger.info("remote tier %s reachable again", self.remote.masked)
        return result

    def key_of(self, chain_hash: str) -> str | None:
        """The value key of a chain hash in this namespace; None if it is no chain hash."""
        return rv.value_key(self.layout_key, chain_hash) if rv.is_hex32(chain_hash) else None

    # ------------------------------------------------------------------ reads
    def longest_prefix(self, hashes: Sequence[str]) -> int:
        """How many leading entries of a chain the server holds: one multi-key EXISTS, which
        answers a whole hit (or a whole miss) with one count; a count in between, one pipelined
        round trip of EXISTS per key. A value whose parts were evicted still counts
        (a `read` of it then misses).

        Args:
            hashes: chain hashes, in chain order.

        Returns:
            The number of leading hashes whose key exists; 0 on any failure.
        """
        keys = [self.key_of(h) for h in hashes]
        keys = keys[: keys.index(None)] if None in keys else keys  # up to the first that is no chain hash
        if not keys:
            return 0

        def op(client: Any) -> int:
            self.count("remote_lookups")
            have = client.exists(*keys)
            if have in (0, len(keys)):
                return have
            results = pipelined(client, keys, lambda pipe, key: pipe.exists(key))
            return next((i for i, r in enumerate(results) if not (isinstance(r, int) and r > 0)), len(results))

        return self.call(op, 0)

    def read(self, hashes: Sequence[str], parents: Sequence[str],
             token_ids_per_block: Sequence[np.ndarray | Sequence[int]]) -> ValueRead:  # fmt: skip
        """Start reading and verifying the values of a run of chain entries ahead, on the store's
        reader threads (`kvtool.tiers.remote_read`); take them with `ValueRead.blocks`, and
        `cancel()` what is not used.

        Args:
            hashes: chain hashes, in chain order.
            parents: each block's expected parent hash.
            token_ids_per_block: each block's exact token ids.

        Raises:
            ValueError: the three sequences differ in length.
        """
        return ValueRead(self, hashes, parents, token_ids_per_block, batch_bytes=self.read_batch_bytes,
                         ahead=self.read_ahead)  # fmt: skip

    def expected_bytes(self, n_tokens: int) -> int:
        """The largest value a block of `n_tokens` tokens may have in this namespace (bytes)."""
        return rv.value_bound(self.kv, n_tokens, self.codec)

    def submit_read(self, fn: Callable[[Any], T], arg: Any) -> Future[T]:
        """Run `fn(arg)` on a reader thread (created on first use); after `close()`, a future
        already holding None (a miss)."""
        with self._client_lock:
            if self._closed:
                done: Future[Any] = Future()
                done.set_result(None)
                return done
            if self._readers is None:
                self._readers = ThreadPoolExecutor(self.read_threads, thread_name_prefix="kvtool-remote-read")
            return self._readers.submit(fn, arg)

    def corrupt(self, key: str, exc: rv.RemoteValueError) -> None:
        """A value failed verification: count and log it (the caller deletes it: `unlink`)."""
        self.count("remote_corrupt")
        logger.warning("remote value %s failed verification (%s: %s); deleted, a miss", key, exc.kind,
                       str(exc).partition(": ")[2][:200])  # fmt: skip

    def unlink(self, client: Any, keys: list[tuple[str, rv.Manifest | None, bytes]]) -> None:
        """Delete values `(key, manifest read or None, guard)`, each only if it still holds what
        was read (`remote_cas`: a value rewritten meanwhile stays whole), and the parts of the
        manifests read, in one pipeline (inside a `call`). Raises as `pipelined`."""
        ops = [op for key, m, guard in keys for op in ((key, guard), *(m.part_keys(key) if m else ()))]
        remote_cas.unlink_all(functools.partial(pipelined, client), ops)

    # ------------------------------------------------------------------ writes
    enabled = True  # as a writer's sink: a server problem is a miss per call, never a refusal

    def save_blocks(self, blocks: Sequence[HostBlock]) -> list[str]:
        """Store blocks not stored yet (`SET NX`, `EX ttl_s` if set; pipelined batches of
        `batch_bytes`; a value over `max_value_bytes` as parts in one MULTI transaction). Also
        the remote writer's sink (`kvtool.tiers.writer.BlockSink`).

        Returns:
            Per block, in order: 'saved', 'dedup' (stored before; counted `remote_put_exists`) or
            'error' (not a chain hash or not of this layout, refused by the server: counted
            `remote_errors`; not sent because a call failed: `remote_dropped_writes`). Never
            raises for the server or for a block.
        """
        out = ["error"] * len(blocks)
        batch: list[tuple[int, str, bytes]] = []
        size = 0
        for n, b in enumerate(blocks):
            key = self.key_of(b.block_hash)
            try:
                if key is None or not rv.is_hex32(b.parent_hash):
                    raise ValueError(f"block hash {b.block_hash[:40]!r} / parent are not chain hashes")
                value = rv.encode_value(b, self.layout_key, self.kv, self.codec)
            except (ValueError, rv.BlockFileError) as exc:
                self.count("remote_errors")
                logger.debug("remote tier: block not stored: %s", exc)
                continue
            batch.append((n, key, value))
            size += len(value)
            if size >= self.batch_bytes:  # encoded and sent one batch at a time
                if not self._send(batch, len(blocks) - n - 1, out):
                    return out
                batch, size = [], 0
        if batch:
            self._send(batch, 0, out)
        return out

    def _send(self, batch: list[tuple[int, str, bytes]], not_sent: int, out: list[str]) -> bool:
        """One batch of `save_blocks`, its outcomes into `out`; False if the call failed (the batch
        and the `not_sent` blocks after it count as dropped writes)."""
        done = self.call(functools.partial(self._put_batch, batch=[(k, v) for _, k, v in batch]), None)
        if done is None:
            self.count("remote_dropped_writes", len(batch) + not_sent)
            return False
        for (i, _, _), outcome in zip(batch, done):
            out[i] = outcome
        return True

    def _put_batch(self, client: Any, batch: list[tuple[str, bytes]]) -> list[str]:
        """Store `(key, value)`s not stored yet: one pipeline of `SET NX`, a value over
        `max_value_bytes` as parts and a manifest (`_put_split`). Returns per value 'saved' |
        'dedup' | 'error' (counted as `save_blocks` says). Raises redis-py's connection errors
        (inside `call`: the whole batch is a miss)."""
        out = ["error"] * len(batch)
        whole = [i for i, (_, v) in enumerate(batch) if len(v) <= self.max_value_bytes]
        if whole:
            results = pipelined(client, whole, lambda pipe, i: pipe.set(batch[i][0], batch[i][1], nx=True, ex=self.ttl_ex))
            for i, r in zip(whole, results):
                out[i] = self._outcome(r, len(batch[i][1]))
        for i, (key, value) in enumerate(batch):
            if len(value) > self.max_value_bytes:
                out[i] = self._put_split(client, key, value)
        return out

    def _outcome(self, result: Any, nbytes: int) -> str:
        if isinstance(result, Exception):  # e.g. OOM under maxmemory with noeviction
            self.count("remote_errors")
            self.last_error = describe_error(result, self.remote)
            logger.debug("remote SET refused: %s", self.last_error)
            return "error"
        if result:
            self.count("remote_bytes_written", nbytes)
            return "saved"
        self.count("remote_put_exists")
        return "dedup"

    def _put_split(self, client: Any, key: str, value: bytes) -> str:
        """Parts, then the manifest with NX, in one MULTI transaction (one slot: the hash tag); if
        the manifest was there already, this writer's parts are removed again."""
        split = rv.split_value(value, self.max_value_bytes)
        assert split is not None
        manifest, parts = split
        part_keys = manifest.part_keys(key)
        pipe = client.pipeline(transaction=True)
        for part, data in zip(part_keys, parts):
            pipe.set(part, data, ex=self.ttl_ex)
        pipe.set(key, manifest.encode(), nx=True, ex=self.ttl_ex)
        results = pipe.execute(raise_on_error=False)
        raise_connection_errors(results)
        outcome = self._outcome(results[-1], len(value))
        if outcome != "saved" or any(isinstance(r, Exception) for r in results[:-1]):
            cleanup = client.pipeline(transaction=False)
            for part in part_keys:
                cleanup.unlink(part)
            if outcome == "saved":  # a part failed: the manifest must not stay (unless rewritten since)
                remote_cas.queue_unlink(cleanup, (key, manifest.encode()))
                outcome = "error"
            cleanup.execute(raise_on_error=False)
        return outcome

    def delete(self, hashes: Sequence[str]) -> int:
        """Delete the values of `hashes` (and their parts). A value rewritten between this call's
        read of it and its delete stays (`remote_cas`): the rewrite is newer than the delete.

        Returns:
            How many value keys were deleted; 0 on any failure.
        """
        keys = [k for k in (self.key_of(h) for h in hashes) if k is not None]
        if not keys:
            return 0

        def op(client: Any) -> int:
            heads = pipelined(client, keys, lambda pipe, key: pipe.getrange(key, 0, 127))  # a manifest names its parts
            ops: list[remote_cas.Item] = []
            mains = []
            for key, head in zip(keys, heads):
                mains.append(len(ops))
                ops += [(key, remote_cas.guard(head)), *rv.manifest_part_keys(key, head)]
            results = remote_cas.unlink_all(functools.partial(pipelined, client), ops)
            return sum(1 for i in mains if results[i] == 1)

        return self.call(op, 0)

    # ------------------------------------------------------------------ life
    def stats(self) -> dict[str, int]:
        """The `remote_*` counters (see the module docstring); `remote_breaker_open` is a gauge."""
        with self._count_lock:
            out = {name: int(self._counts[name]) for name in COUNTER_NAMES}
        out["remote_breaker_open"] = int(self._breaker.is_open)
        out["remote_breaker_trips"] = self._breaker.trips
        return out

    def close(self) -> None:
        """Close the connections; later calls are misses. Idempotent."""
        self._closed = True
        with self._client_lock:
            readers, self._readers = self._readers, None
        if readers is not None:
            readers.shutdown(wait=False, cancel_futures=True)
        self._drop_client()

    def __enter__(self) -> RemoteStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"RemoteStore({self.remote.masked!r}, {self.layout_key!r})"
