"""The restore benchmark's one door into kvtool's store/restore API.

`open_prefix_cache` is the only function of the benchmark that knows how kvtool stores and
restores a prompt's KV. It targets the public `kvtool.cache.prefix.PrefixCache` API (a full hit comes
back trimmed by one token, `cached_tokens = T - 1`, the last one being re-forwarded):

    pc = PrefixCache(config, geometry=KVGeometry(...), model_id=...)
    pc.store(token_ids, cache); pc.flush(); pc.close()
    hit = pc.fetch(token_ids)   # .cache .cached_tokens .ssd_tokens .ssd_load_ms .ssd_bytes_read
    pc.release(hit); pc.close()

`LegacyPrefixCache` offers the same methods over the tiered cache of the trees before the
PrefixCache rewrite (up to commit e058dc9: chain hashes, `TieredCache.lookup`, `rebuild_cache`),
for before/after runs: copy the benchmark files into an export of such a tree and pass
`--kvtool-api legacy`. `api="auto"` picks `prefix` whenever `kvtool.cache.prefix` exists. Rows
record which API ran.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

API_CHOICES = ("auto", "prefix", "legacy")


@dataclass(frozen=True)
class KVShape:
    """A KV layout to benchmark: `name` labels rows (`tiny`, `qwen0.5b`)."""

    name: str
    n_layers: int
    n_kv_heads: int
    head_dim: int
    dtype: str  # float32 | bfloat16 | float16

    @property
    def itemsize(self) -> int:
        return 4 if self.dtype == "float32" else 2

    def bytes_per_token(self) -> int:
        """KV bytes per token over all layers, keys + values."""
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * self.itemsize

    @property
    def model_id(self) -> str:
        return f"synthetic-{self.name}"


@dataclass
class Hit:
    """What a restore returned, whatever the API (fields as `kvtool.cache.prefix`'s hit)."""

    cache: list
    cached_tokens: int
    ssd_tokens: int
    ssd_load_ms: float
    ssd_bytes_read: int
    raw: Any = None  # the API's own hit object, handed back to `release`


def resolve_api(api: str = "auto") -> str:
    """`prefix` if `kvtool.cache.prefix` is importable (or asked for), else `legacy`.

    Raises:
        ValueError: unknown `api`.
    """
    if api not in API_CHOICES:
        raise ValueError(f"api must be one of {', '.join(API_CHOICES)}, got {api!r}")
    if api != "auto":
        return api
    return "prefix" if importlib.util.find_spec("kvtool.cache.prefix") is not None else "legacy"


def open_prefix_cache(
    cache_dir: Path,
    shape: KVShape,
    *,
    api: str = "auto",
    async_writes: bool = False,
    block_size: int | None = None,
) -> PrefixCacheLike:
    """Open kvtool's prefix cache on `cache_dir` for synthetic KV of `shape` (SSD only, no RAM tier).

    Args:
        cache_dir: SSD tier root.
        shape: KV layout; its `model_id` names the namespace.
        api: `prefix` (kvtool.cache.prefix.PrefixCache), `legacy` (today's tiered cache) or `auto`.
        async_writes: background writer (True) or inline writes (False).
        block_size: tokens per block; None keeps kvtool's default.

    Returns:
        An object with `store`, `flush`, `fetch` (returning a `Hit`), `release`, `close`, `api`.
    """
    from kvtool.config import KVToolConfig

    extra = {"block_size": block_size} if block_size else {}
    config = KVToolConfig(
        ssd_cache_dir=Path(cache_dir), ram_bytes=0, ssd_async_writes=async_writes,
        ssd_durability="best_effort", **extra,
    )
    if resolve_api(api) == "prefix":
        return _PrefixAdapter(config, shape)
    return LegacyPrefixCache(config, shape)


class _PrefixAdapter:
    """`kvtool.cache.prefix.PrefixCache`, with its hit wrapped in a `Hit`."""

    api = "prefix"

    def __init__(self, config, shape: KVShape):
        from kvtool.cache.prefix import KVGeometry, PrefixCache

        geometry = KVGeometry(shape.n_layers, shape.n_kv_heads, shape.head_dim, dtype=shape.dtype)
        self.pc = PrefixCache(config, geometry=geometry, model_id=shape.model_id)

    def store(self, token_ids: Sequence[int] | np.ndarray, cache: list) -> None:
        self.pc.store(token_ids, cache)

    def flush(self) -> None:
        self.pc.flush()

    def fetch(self, token_ids: Sequence[int] | np.ndarray) -> Hit:
        hit = self.pc.fetch(token_ids)
        return Hit(hit.cache, int(hit.cached_tokens), int(hit.ssd_tokens), float(hit.ssd_load_ms),
                   int(hit.ssd_bytes_read), raw=hit)

    def release(self, hit: Hit) -> None:
        self.pc.release(hit.raw)

    def close(self) -> None:
        self.pc.close()


class LegacyPrefixCache:
    """The `kvtool.cache.prefix` methods over today's `TieredCache` (as `Engine` drives it).

    It runs only in a pre-rewrite tree, against that tree's API; the `type: ignore`s below are
    where this tree's own signatures (which mypy checks against) differ.
    """

    api = "legacy"

    def __init__(self, config, shape: KVShape):
        try:
            from kvtool.kv.blocks import layout_key, rebuild_cache  # noqa: F401
            from kvtool.tiers.stack import LookupResult, TieredCache  # type: ignore[attr-defined]  # noqa: F401  (LookupResult: pre-rewrite trees only)
        except ImportError as exc:
            raise RuntimeError(f"--kvtool-api legacy needs a tree before the PrefixCache rewrite ({exc})") from None

        self.config = config
        self.shape = shape
        self.layout = layout_key(  # type: ignore[call-arg]  # the pre-rewrite signature (model id, geometry, dtype, block size)
            shape.model_id, shape.n_layers, shape.n_kv_heads, shape.head_dim, shape.dtype, config.block_size,  # type: ignore[arg-type]  # (same)
        )
        meta = {
            "model_id": shape.model_id, "model_name": shape.model_id, "block_size": str(config.block_size),
            "kv_dtype": shape.dtype, "n_layers": str(shape.n_layers), "n_kv_heads": str(shape.n_kv_heads),
            "head_dim": str(shape.head_dim),
        }
        self.tiered: Any = TieredCache(config, self.layout, meta)  # the pre-rewrite class (lookup, release)

    def _hashes(self, ids: np.ndarray) -> list[str]:
        from kvtool.kv.blocks import chain_hashes

        return chain_hashes(ids, self.config.block_size, self.layout)

    def store(self, token_ids: Sequence[int] | np.ndarray, cache: list) -> None:
        from kvtool.kv.blocks import slice_blocks

        ids = np.asarray(token_ids, dtype=np.int32)
        hashes = self._hashes(ids)
        bs = self.config.block_size
        for start in range(0, len(hashes), 64):  # bounded MLX memory: 64 blocks at a time
            stop = min(len(hashes), start + 64)
            self.tiered.persist(slice_blocks(cache, ids, hashes, self.layout, start, stop, bs))  # type: ignore[call-arg, arg-type]  # the pre-rewrite signature

    def flush(self) -> None:
        self.tiered.flush()

    def fetch(self, token_ids: Sequence[int] | np.ndarray) -> Hit:
        from kvtool.kv.blocks import rebuild_cache

        ids = np.asarray(token_ids, dtype=np.int32)
        found = self.tiered.lookup(self._hashes(ids), ids)
        cache = rebuild_cache(found.blocks, self.shape.n_layers)
        n = len(found.blocks) * self.config.block_size
        return Hit(cache, n, found.ssd_blocks * self.config.block_size, found.ssd_load_ms,
                   found.ssd_bytes_read, raw=found)

    def release(self, hit: Hit) -> None:
        self.tiered.release(hit.raw)

    def close(self) -> None:
        self.tiered.close()


PrefixCacheLike = _PrefixAdapter | LegacyPrefixCache
