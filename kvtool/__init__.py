"""kvtool: a persistent, tiered (RAM over SSD) KV cache for MLX language models.

    from kvtool import PrefixCache, Engine, KVToolConfig, __version__

Importing the package is cheap: the MLX-backed names are loaded on first use, so the MLX-free
operator commands (`validate`, `prune`, `inspect`) never import MLX.
"""

from __future__ import annotations

from importlib import metadata as _metadata
from typing import TYPE_CHECKING, Any

try:
    __version__ = _metadata.version("kvtool")
except _metadata.PackageNotFoundError:  # running from a source tree without installing
    __version__ = "0.0.0+source"

if TYPE_CHECKING:
    from kvtool.cache.prefix import CacheHit, CacheStats, PrefixCache
    from kvtool.config import KVToolConfig
    from kvtool.engine import Engine

_LAZY = {
    "PrefixCache": "kvtool.cache.prefix",
    "CacheHit": "kvtool.cache.prefix",
    "CacheStats": "kvtool.cache.prefix",
    "Engine": "kvtool.engine",
    "KVToolConfig": "kvtool.config",
}

__all__ = ["PrefixCache", "CacheHit", "CacheStats", "Engine", "KVToolConfig", "__version__"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvtool' has no attribute {name!r}")
