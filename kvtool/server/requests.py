"""What `KVToolPromptCache` keeps per request: its record (what the cache did, `GET /kvtool/stats`
and the log line), the fetch a kvtool-side prefill needs, the hit waiting for its inserts."""

from __future__ import annotations

import dataclasses
import hashlib
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtool.cache.hit import CacheHit, HitTokens
from kvtool.kv.blocks import unsupported_cache_reason
from kvtool.units import format_bytes, format_hits


@dataclass(kw_only=True)
class RequestRecord(HitTokens):
    """What the cache did for one request (one `fetch_nearest_cache`). Tokens in tokens, times in ms;
    where the prompt's tokens came from: `HitTokens`'s fields."""

    request: int
    ssd_load_ms: float = 0.0
    ssd_bytes_read: int = 0
    fetch_ms: float = 0.0
    uncached_reason: str | None = None
    blocks_stored: int = 0  # chain entries handed to the tiers (segment ends + the request's end)
    store_ms: float = 0.0  # generation-thread time spent storing them (slicing, RAM insert, SSD hand-over)
    prefill_ms: float = 0.0  # generation-thread time of kvtool's own prefill (windowed / state-layer models)
    generated_tokens: int | None = None  # known once the request finished
    finished: bool = False

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (`GET /kvtool/stats`' `requests`): the request number first, then the fields in order."""
        return {"request": self.request, **dataclasses.asdict(self)}

    def log_line(self) -> str:
        hits = format_hits(self.ram_hit_tokens, self.ssd_hit_tokens, self.remote_hit_tokens)
        line = (f"request {self.request}: prompt {self.prompt_tokens} tok | cached {self.cached_tokens} ({hits}) | "
                f"prefilled {self.prefill_tokens}")
        if self.ssd_hit_tokens:
            line += f" | SSD load {self.ssd_load_ms:.1f} ms, {format_bytes(self.ssd_bytes_read)}"
        if self.uncached_reason:
            line += f" | uncached: {self.uncached_reason}"
        return line


def prompt_digest(ids: np.ndarray) -> bytes:
    """16-byte BLAKE2b digest of int32 token ids (a key that does not keep the prompt alive)."""
    return hashlib.blake2b(np.ascontiguousarray(ids, dtype=np.int32).tobytes(), digest_size=16).digest()


@dataclass
class Prefill:
    """A fetch of a model kvtool prefills itself: what the prefill, outside the lock, needs."""

    ids: np.ndarray
    hit: CacheHit
    record: RequestRecord
    epoch: int  # the adapter's tiers generation at fetch (a reconfiguration changes it)


@dataclass
class Waiting:
    """A fetched request's hit, waiting for the request's inserts (keyed by its prompt)."""

    record: RequestRecord
    prompt: np.ndarray
    hit: CacheHit
    since: float
    stored: int  # leading chain entries of the prompt already in the tiers (found, or stored at a segment end)
    prefilled: bool = False  # kvtool prefilled and stored the prompt at fetch (its inserts store nothing)


def uncacheable_reason(prefix_cache, cache: list) -> str | None:
    """Why a cache mlx-lm's server returned cannot be sliced into `prefix_cache`'s blocks (draft
    layers, a quantization other than the prefix cache's...), or None. With `--kv-bits`, mlx-lm's
    `QuantizedKVCache` layers of the prefix cache's bits and group size are sliced as its own."""
    quant = prefix_cache.quant
    if quant is not None:
        from mlx_lm.models.cache import QuantizedKVCache

        plain = [c for c in cache if not (type(c) is QuantizedKVCache
                                          and (c.bits, c.group_size) == (quant.bits, quant.group_size))]
        reason = unsupported_cache_reason(plain) if plain else None
    else:
        reason = unsupported_cache_reason(cache)
    if reason is None and prefix_cache.kv is not None and len(cache) != prefix_cache.kv.n_layers:
        reason = f"{len(cache)} cache layers, the model has {prefix_cache.kv.n_layers}"
    return reason


class ReportedCounts:
    """The true cached counts of prompts kvtool prefilled at fetch, waiting for their responses
    (`KVToolPromptCache.reported_cached`): prompt digest -> counts in fetch order, the
    `max_prompts` most recent prompts kept. Not thread-safe (the adapter's lock guards it)."""

    def __init__(self, max_prompts: int):
        self.max_prompts = max_prompts
        self._counts: OrderedDict[bytes, deque[int]] = OrderedDict()

    def add(self, ids: np.ndarray, cached: int) -> None:
        """Record a prefilled prompt's (int32 ids) true cached token count."""
        key = prompt_digest(ids)
        self._counts.setdefault(key, deque()).append(cached)
        self._counts.move_to_end(key)
        while len(self._counts) > self.max_prompts:
            self._counts.popitem(last=False)

    def pop(self, prompt: Sequence[int], reported: int) -> int:
        """The oldest recorded count of `prompt` (then forgotten), or `reported` if none."""
        if not self._counts:  # no prompt kvtool prefilled is waiting for its answer (plain models)
            return reported
        key = prompt_digest(np.asarray(prompt, dtype=np.int32))
        counts = self._counts.get(key)
        if not counts:
            return reported
        true = counts.popleft()
        if not counts:
            del self._counts[key]
        return true
