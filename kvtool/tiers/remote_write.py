"""Writing values to the remote tier: one pipelined batch of `SET NX` (`RemoteStore.save_blocks`),
a value over the store's `max_value_bytes` as parts and a manifest in one MULTI transaction.
Runs inside the store's guarded `call` (a connection error fails the whole batch). MLX-free.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

from kvtool.config.remote_url import RemoteURL, describe_error
from kvtool.tiers import remote_value as rv
from kvtool.tiers.remote_read import raise_connection_errors

logger = logging.getLogger("kvtool.tiers.remote_store")


class ValueSink(Protocol):
    """What a write needs of the remote store: its value size cap (bytes), expiry (`EX`
    seconds or None), URL (for messages) and counters."""

    max_value_bytes: int
    ttl_ex: int | None
    remote: RemoteURL

    def count(self, name: str, n: int = 1) -> None: ...


def put_batch(store: ValueSink, client: Any, batch: list[tuple[str, bytes]]) -> list[str]:
    """Store `(key, value)`s not stored yet. Returns per value 'saved' | 'dedup' | 'error' (see
    `RemoteStore.save_blocks`); counts `remote_bytes_written`, `remote_put_exists`,
    `remote_errors`. Raises redis-py's connection errors (the caller's `call` makes them a miss)."""
    out = ["error"] * len(batch)
    whole = [i for i, (_, v) in enumerate(batch) if len(v) <= store.max_value_bytes]
    if whole:
        pipe = client.pipeline(transaction=False)
        for i in whole:
            pipe.set(batch[i][0], batch[i][1], nx=True, ex=store.ttl_ex)
        results = pipe.execute(raise_on_error=False)
        raise_connection_errors(results)
        for i, r in zip(whole, results):
            out[i] = _outcome(store, r, len(batch[i][1]))
    for i, (key, value) in enumerate(batch):
        if len(value) > store.max_value_bytes:
            out[i] = _put_split(store, client, key, value)
    return out


def _outcome(store: ValueSink, result: Any, nbytes: int) -> str:
    if isinstance(result, Exception):  # e.g. OOM under maxmemory with noeviction
        store.count("remote_errors")
        logger.debug("remote SET refused: %s", describe_error(result, store.remote))
        return "error"
    if result:
        store.count("remote_bytes_written", nbytes)
        return "saved"
    store.count("remote_put_exists")
    return "dedup"


def _put_split(store: ValueSink, client: Any, key: str, value: bytes) -> str:
    """Parts, then the manifest with NX, in one transaction (one slot: the hash tag); if the
    manifest was there already, this writer's parts are removed again."""
    split = rv.split_value(value, store.max_value_bytes)
    assert split is not None
    manifest, parts = split
    part_keys = manifest.part_keys(key)
    pipe = client.pipeline(transaction=True)
    for part, data in zip(part_keys, parts):
        pipe.set(part, data, ex=store.ttl_ex)
    pipe.set(key, manifest.encode(), nx=True, ex=store.ttl_ex)
    results = pipe.execute(raise_on_error=False)
    raise_connection_errors(results)
    outcome = _outcome(store, results[-1], len(value))
    if outcome != "saved" or any(isinstance(r, Exception) for r in results[:-1]):
        cleanup = client.pipeline(transaction=False)
        for part in part_keys:
            cleanup.unlink(part)
        if outcome == "saved":  # a part failed: the manifest must not stay
            cleanup.unlink(key)
            outcome = "error"
        cleanup.execute(raise_on_error=False)
    return outcome


__all__ = ["ValueSink", "put_batch"]
