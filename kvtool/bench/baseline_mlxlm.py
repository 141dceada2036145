"""The `mlx-lm-prompt-cache` baseline: whole-prompt caches with mlx-lm's own API.

This is what a user would do without kvtool: after each request, save the request's prompt cache
with `mlx_lm.models.cache.save_prompt_cache`; before each request, find the saved file whose tokens
share the longest prefix with the request, `load_prompt_cache` it, trim it to the common prefix
(`can_trim_prompt_cache` / `trim_prompt_cache`) and prefill the rest with
`mlx_lm.generate.generate_step`. Files are whole prompts (no blocks, no index, no dedup): the
token ids of each file are kept in its safetensors metadata, so a new instance on the same
directory (a restart) finds them again.

Results carry the same field names as `kvtool.engine.RequestResult`; a reused prefix counts as
SSD hit tokens (it comes from a file), RAM hits are always 0.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import (
    can_trim_prompt_cache,
    load_prompt_cache,
    make_prompt_cache,
    save_prompt_cache,
    trim_prompt_cache,
)
from safetensors import safe_open

from kvtool.engine import RequestResult

TOKENS_METADATA_KEY = "kvtool_bench_tokens"
FILE_SUFFIX = ".safetensors"


@dataclass
class BaselineResult(RequestResult):
    """One request served by the baseline: `RequestResult`'s fields (times in ms) plus the bytes
    of the prompt-cache file it wrote."""

    bytes_written: int = 0


def common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two 1-D integer arrays (tokens)."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


class PromptCacheBaseline:
    """Prompt-cache files (`.safetensors`) in `cache_dir` (created if missing), reused by longest
    common token prefix on the resident mlx-lm `model`."""

    def __init__(self, model: Any, cache_dir: Path):
        self.model = model
        self.cache_dir = Path(cache_dir)
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        self._entries: dict[Path, np.ndarray] = self.scan(self.cache_dir)

    @staticmethod
    def scan(cache_dir: Path) -> dict[Path, np.ndarray]:
        """Prompt-cache files in `cache_dir` and their token ids (read from the file metadata)."""
        entries: dict[Path, np.ndarray] = {}
        for path in sorted(Path(cache_dir).glob(f"*{FILE_SUFFIX}")):
            with safe_open(str(path), framework="numpy") as fh:
                meta = fh.metadata() or {}
            # save_prompt_cache flattens [metadata, classes, scalars]: user keys get a "0." prefix
            tokens = meta.get(f"0.{TOKENS_METADATA_KEY}", meta.get(TOKENS_METADATA_KEY))
            if tokens is not None:
                entries[path] = np.asarray(json.loads(tokens), dtype=np.int64)
        return entries

    @property
    def files(self) -> list[Path]:
        """Saved prompt-cache files known to this instance."""
        return list(self._entries)

    def best_match(self, ids: np.ndarray) -> tuple[Path | None, int]:
        """The file sharing the longest prefix with `ids`, and that prefix length (tokens)."""
        best: tuple[Path | None, int] = (None, 0)
        for path, tokens in self._entries.items():
            n = common_prefix_len(tokens, ids)
            if n > best[1]:
                best = (path, n)
        return best

    def _load(self, path: Path, entry_len: int, reuse: int, res: BaselineResult) -> list[Any] | None:
        start = time.perf_counter()
        cache = load_prompt_cache(str(path))
        mx.eval([c.state for c in cache])
        res.ssd_load_ms = (time.perf_counter() - start) * 1e3
        res.ssd_bytes_read = path.stat().st_size
        if entry_len > reuse:
            if not can_trim_prompt_cache(cache):
                return None
            trim_prompt_cache(cache, entry_len - reuse)
        return cache

    def generate(self, ids: Sequence[int], max_tokens: int = 8) -> BaselineResult:
        """Serve one request greedily: reuse the best prompt cache, prefill, decode `max_tokens`
        (the first one included), save. `ttft_ms` includes finding and loading the cache file."""
        prompt = np.asarray(ids, dtype=np.int64)
        res = BaselineResult(prompt_tokens=len(prompt))
        start = time.perf_counter()
        path, reuse = self.best_match(prompt)
        reuse = min(reuse, len(prompt) - 1)  # at least one token must be prefilled for logits
        cache = self._load(path, len(self._entries[path]), reuse, res) if path is not None and reuse > 0 else None
        if cache is None:
            cache, reuse = make_prompt_cache(self.model), 0
        res.cached_tokens = res.ssd_hit_tokens = reuse
        res.prefill_tokens = len(prompt) - reuse
        prefill_start = time.perf_counter()
        tokens = []
        for n, (token, _) in enumerate(
            generate_step(mx.array(prompt[reuse:]), self.model, prompt_cache=cache, max_tokens=max_tokens)
        ):
            tokens.append(int(token))
            if n == 0:
                first = time.perf_counter()
                res.ttft_ms = (first - start) * 1e3
                res.prefill_ms = (first - prefill_start) * 1e3
        decode_s = time.perf_counter() - first
        res.generated_tokens, res.token_ids = len(tokens), tokens
        res.decode_tokens_per_s = (len(tokens) - 1) / decode_s if len(tokens) > 1 and decode_s > 0 else 0.0
        self._save(prompt, cache, res)
        return res

    def _save(self, prompt: np.ndarray, cache: list[Any], res: BaselineResult) -> None:
        """Trim the decoded tokens off the cache and save the prompt's cache (request thread)."""
        start = time.perf_counter()
        name = hashlib.blake2b(prompt.astype("<i4").tobytes(), digest_size=16).hexdigest()
        path = self.cache_dir / f"{name}{FILE_SUFFIX}"
        if path not in self._entries:
            trim_prompt_cache(cache, cache[0].offset - len(prompt))
            metadata = {TOKENS_METADATA_KEY: json.dumps(prompt.tolist())}
            save_prompt_cache(str(path), cache, metadata)
            self._entries[path] = prompt
            res.bytes_written = path.stat().st_size
        res.write_path_ms = (time.perf_counter() - start) * 1e3
