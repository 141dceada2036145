"""`CacheHit` (what `PrefixCache.fetch` found for one prompt) and `CacheStats` (its counters).

This module never imports MLX.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class CacheStats:
    """Counters of a prefix cache (all ints; see docs/design.md#counters for each one).

    Attributes:
        counters: name -> value; prefixes `kv_` (RAM tier and lookup), `ssd_` (SSD store) and
            `writer_` (SSD writer) never collide.
    """

    counters: dict[str, int] = field(default_factory=dict)

    def __getitem__(self, key: str) -> int:
        return self.counters[key]

    def get(self, key: str, default: int = 0) -> int:
        return self.counters.get(key, default)

    def to_dict(self) -> dict[str, int]:
        return dict(self.counters)


@dataclass
class CacheHit:
    """The cached part of a prompt, ready for generation.

    Attributes:
        cache: per-layer mlx-lm caches holding `cached_tokens` tokens (plus decode room).
        prompt_tokens: tokens in the prompt.
        cached_tokens: leading prompt tokens whose KV is in `cache`.
        tier_tokens: tier name ('ram', 'ssd' incl. the writer's pending buffer, 'remote') -> how
            many of them came from it; they sum to `cached_tokens`. Read as `ram_tokens`,
            `ssd_tokens`, `remote_tokens` (the JSON's `<name>_hit_tokens`).
        tier_bytes: tier name -> record bytes read from it (`ssd_bytes_read`, `remote_bytes_read`).
        remaining: int32 prompt tokens still to run through the model (never empty).
        ssd_load_ms: wall time of the restore into buffers (ms).
        uncached_reason: why a cached prefix of this prompt was found but not used (e.g. KV
            quantisation: it ends where mlx-lm's cache is not quantized alike); None otherwise.
    """

    cache: list
    prompt_tokens: int
    cached_tokens: int = 0
    tier_tokens: dict[str, int] = field(default_factory=dict)
    tier_bytes: dict[str, int] = field(default_factory=dict)
    remaining: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    ssd_load_ms: float = 0.0
    hashes: list[str] = field(default_factory=list, repr=False)
    tail: str | None = field(default=None, repr=False)
    entries_found: int = field(default=0, repr=False)  # chain entries (blocks + tail) in `cache`
    held: list[tuple[Any, Any]] = field(default_factory=list, repr=False)  # (tier, handle) to release
    promote: list[tuple[Any, ...]] = field(default_factory=list, repr=False)  # (hash, parent, ids, offset[, states])
    sources: dict[str, Any] = field(default_factory=dict, repr=False)  # promoted hash -> the tier it came from
    uncached_reason: str | None = None
    views: list = field(default_factory=list, repr=False)  # full views behind `cache`'s rotating leaves (promotion)

    @property
    def ram_tokens(self) -> int:
        return self.tier_tokens.get("ram", 0)

    @property
    def ssd_tokens(self) -> int:
        return self.tier_tokens.get("ssd", 0)

    @property
    def remote_tokens(self) -> int:
        return self.tier_tokens.get("remote", 0)

    @property
    def ssd_bytes_read(self) -> int:
        return self.tier_bytes.get("ssd", 0)

    @property
    def remote_bytes_read(self) -> int:
        return self.tier_bytes.get("remote", 0)


@dataclass
class HitTokens:
    """Where a request's prompt tokens came from (tokens): what `kvtool serve` records per
    request (`kvtool.server.requests.RequestRecord`) and `Engine` returns
    (`kvtool.engine.results.RequestResult`) begin with these fields.

    `prompt_tokens == cached_tokens + prefill_tokens`,
    `cached_tokens == ram_hit_tokens + ssd_hit_tokens + remote_hit_tokens`.
    """

    prompt_tokens: int = 0
    cached_tokens: int = 0
    ram_hit_tokens: int = 0
    ssd_hit_tokens: int = 0
    remote_hit_tokens: int = 0
    prefill_tokens: int = 0

    def count_hit(self, hit: CacheHit) -> None:
        """Set every count from what `PrefixCache.fetch` found for the prompt (`hit`);
        `prefill_tokens` is the tokens it left to run through the model."""
        self.prompt_tokens, self.cached_tokens = hit.prompt_tokens, hit.cached_tokens
        self.ram_hit_tokens, self.ssd_hit_tokens, self.remote_hit_tokens = hit.ram_tokens, hit.ssd_tokens, hit.remote_tokens
        self.prefill_tokens = int(hit.remaining.size)


__all__ = ["CacheHit", "CacheStats", "HitTokens"]
