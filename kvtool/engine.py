"""The kvtool engine: an mlx-lm model served through the tiered prefix cache.

Per request: hash the prompt's full blocks, take the longest cached chain (RAM, pending writes,
SSD), rebuild an mlx-lm `KVCache` from it, prefill only the rest, decode with mlx-lm's
`generate_step`, and hand the prompt's new full blocks to the tiered cache right after the first
token. Only prompt KV is stored, never the KV of generated tokens.

Exactness: KV of a prefix computed alone equals the same prefix inside a longer prompt, so the
logits (and greedy tokens) with a cached prefix equal an uncached prefill bit for bit (tested).
On a full hit the cache is trimmed by one token and the last prompt token is re-forwarded to get
the first logits without duplicating its KV (seed 002, A3).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_sampler

from kvtool.blocks import (
    HashFn,
    blake2b_chain,
    chain_hashes,
    dtype_name,
    layout_key,
    rebuild_cache,
    slice_blocks,
    unsupported_cache_reason,
)
from kvtool.config import KVToolConfig
from kvtool.models.loader import LoadedModel, load_model
from kvtool.store.tiered import LookupResult, ShutdownStatus, TieredCache

log = logging.getLogger("kvtool")

DEFAULT_PREFILL_STEP = 2048  # tokens per prefill chunk, as mlx-lm's generate_step
DEFAULT_MAX_TOKENS = 256


@dataclass
class RequestResult:
    """What one request did. Token counts in tokens, times in ms.

    Invariants: `prompt_tokens == cached_tokens + prefill_tokens` and
    `cached_tokens == ram_hit_tokens + ssd_hit_tokens`. On a full hit the last prompt token is
    re-forwarded, so `cached_tokens = prompt_tokens - 1` and `prefill_tokens = 1`.
    """

    prompt_tokens: int = 0
    cached_tokens: int = 0
    ram_hit_tokens: int = 0
    ssd_hit_tokens: int = 0
    prefill_tokens: int = 0
    generated_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = "length"
    ttft_ms: float = 0.0
    prefill_ms: float = 0.0
    decode_tokens_per_s: float = 0.0
    ssd_load_ms: float = 0.0
    ssd_bytes_read: int = 0
    write_path_ms: float = 0.0
    blocks_written: int = 0
    writer_queue_depth: int = 0
    backpressure_events: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class KVGeometry:
    """KV layout of a model: layers, KV heads, head dim (elements), dtype name."""

    n_layers: int
    n_kv_heads: int
    head_dim: int
    dtype: str


def probe_geometry(model) -> tuple[KVGeometry | None, str | None]:
    """Find the KV layout by one forward pass of one token.

    Returns:
        `(geometry, None)` if every cache layer is a plain `KVCache`, else `(None, reason)`.
    """
    cache = make_prompt_cache(model)
    reason = unsupported_cache_reason(cache)
    if reason is not None:
        return None, reason
    model(mx.array([[0]]), cache=cache)
    keys = cache[0].keys
    mx.eval(keys)
    _, n_kv_heads, _, head_dim = keys.shape
    return KVGeometry(len(cache), int(n_kv_heads), int(head_dim), dtype_name(keys.dtype)), None


class Engine:
    """A resident model plus its tiered KV cache.

    Args:
        loaded: model, tokenizer and identity from `kvtool.models.loader.load_model`.
        config: cache settings.
        hash_fn: chain-hash function (injectable to force collisions in tests).
        max_kv_size: if set, mlx-lm would use a rotating cache: the engine then runs uncached.
        fs: optional `FileOps` of the SSD tier (fault injection in tests).
    """

    def __init__(
        self,
        loaded: LoadedModel,
        config: KVToolConfig,
        *,
        hash_fn: HashFn = blake2b_chain,
        max_kv_size: int | None = None,
        fs=None,
    ):
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.hash_fn = hash_fn
        self.max_kv_size = max_kv_size
        self._fs = fs
        self._lock = threading.Lock()  # one request or reconfiguration at a time (quiesce)
        self.uncached_reason: str | None = None
        geometry, reason = probe_geometry(self.model)
        if max_kv_size is not None:
            geometry, reason = None, f"max_kv_size={max_kv_size} makes mlx-lm use a RotatingKVCache"
        self.geometry = geometry
        if reason is not None:
            self.uncached_reason = reason
            log.warning("kvtool: running uncached: %s (a block cache of this model would give wrong KV)", reason)
        self.config = config
        self.tiered: TieredCache | None = None
        self.layout_key: str | None = None
        self._attach(config)

    @classmethod
    def from_spec(cls, model_spec: str, config: KVToolConfig, **kwargs) -> "Engine":
        """Load a model (preset, local dir or HF id) and build an engine on it.

        Raises:
            kvtool.models.loader.ModelLoadError: the model could not be loaded.
        """
        return cls(load_model(model_spec), config, **kwargs)

    # ------------------------------------------------------------ tier wiring
    def layout_key_for(self, block_size: int) -> str | None:
        """The layout key (namespace) this model's blocks of `block_size` tokens live under, or
        None when the model cannot be cached block-wise. Pure: opens nothing."""
        if self.geometry is None:
            return None
        g = self.geometry
        return layout_key(self.loaded.model_id, g.n_layers, g.n_kv_heads, g.head_dim, g.dtype, block_size)

    def _attach(self, config: KVToolConfig) -> None:
        self.config = config
        self.tiered = None
        self.layout_key = None
        if self.geometry is None or (not config.ssd_enabled and config.ram_bytes == 0):
            return
        g = self.geometry
        self.layout_key = self.layout_key_for(config.block_size)
        meta = {
            "model_id": self.loaded.model_id,
            "model_name": self.loaded.name,
            "block_size": str(config.block_size),
            "kv_dtype": g.dtype,
            "n_layers": str(g.n_layers),
            "n_kv_heads": str(g.n_kv_heads),
            "head_dim": str(g.head_dim),
        }
        self.tiered = TieredCache(config, self.layout_key, meta, fs=self._fs)

    @property
    def namespace_dir(self):
        """Directory of this engine's SSD namespace, or None without an SSD tier."""
        if self.tiered is None or self.tiered.ssd is None:
            return None
        return self.tiered.ssd.namespace_dir

    def reconfigure(self, config: KVToolConfig) -> ShutdownStatus:
        """Live reconfiguration on the resident model (seed 003): quiesce (wait for the request
        in flight), drain the writer, flush the index, detach, drop RAM blocks, reattach."""
        with self._lock:
            status = self.tiered.close() if self.tiered is not None else ShutdownStatus()
            self._attach(config)
            return status

    def flush(self) -> bool:
        """Wait until every accepted SSD write was attempted; flush the index."""
        with self._lock:
            return self.tiered.flush() if self.tiered is not None else True

    def close(self) -> ShutdownStatus:
        """Drain the writer, flush and close the index. Idempotent."""
        with self._lock:
            status = self.tiered.close() if self.tiered is not None else ShutdownStatus()
            self.tiered = None
            return status

    def stats(self) -> dict:
        return self.tiered.stats() if self.tiered is not None else {}

    # ---------------------------------------------------------------- prompts
    def encode(self, prompt: str | None = None, messages: list[dict] | None = None) -> list[int]:
        """Token ids of a plain prompt or of chat messages.

        Chat messages go through the tokenizer's chat template with `tokenize=True`, so no BOS is
        added a second time (seed 002, A1). A plain prompt gets special tokens as mlx-lm's
        `stream_generate` would add them.

        Raises:
            ValueError: neither or both of `prompt` and `messages` given, or no chat template.
        """
        if (prompt is None) == (messages is None):
            raise ValueError("give exactly one of prompt or messages")
        tok = self.tokenizer
        if messages is not None:
            if not getattr(tok, "chat_template", None):
                raise ValueError("this tokenizer has no chat template; use a plain prompt")
            ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            return [int(t) for t in ids]
        bos = getattr(tok, "bos_token", None)
        add_special = bos is None or not prompt.startswith(bos)
        return list(tok.encode(prompt, add_special_tokens=add_special))

    # --------------------------------------------------------------- requests
    def generate(
        self,
        prompt_ids: Sequence[int],
        *,
        max_tokens: int = DEFAULT_MAX_TOKENS,
        temp: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: Sequence[str] = (),
    ) -> RequestResult:
        """Serve one request through the tiered cache.

        Args:
            prompt_ids: prompt token ids (at least one).
            max_tokens: maximum generated tokens (> 0).
            temp, top_p: mlx-lm sampler settings; temp 0 is greedy.
            seed: seeds `mx.random` before sampling.
            stop: stop strings; the text is cut before the first one found.

        Returns:
            A `RequestResult`; `token_ids` are the generated ids (EOS excluded).

        Raises:
            ValueError: empty prompt or `max_tokens < 1`.
        """
        if max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        with self._lock:
            return self._generate(np.asarray(prompt_ids, dtype=np.int32), max_tokens, temp, top_p, seed, tuple(stop))

    def prefill(self, prompt_ids: Sequence[int]) -> RequestResult:
        """Prefill only (no decode) and write the prompt's full blocks to SSD whatever the policy
        (used by `kvtool warm`). A prompt whose full blocks are all on SSD already is skipped by
        hashing alone: no block is loaded and the model does not run (`prefill_tokens == 0`).

        Raises:
            ValueError: empty prompt.
        """
        with self._lock:
            ids = np.asarray(prompt_ids, dtype=np.int32)
            if len(ids) == 0:
                raise ValueError("empty prompt")
            hashes = self._hashes(ids)
            if self._all_on_ssd(hashes):
                n_cached = len(hashes) * self.config.block_size
                return RequestResult(prompt_tokens=len(ids), cached_tokens=n_cached, ssd_hit_tokens=n_cached,
                                     prefill_tokens=len(ids) - n_cached, finish_reason="skipped")
            res, cache, found, hashes, start = self._prepare(ids, hashes)
            try:
                if self.tiered is not None:
                    self.tiered.persist(found.blocks)  # RAM-only blocks (evict_only) reach SSD too
                t0 = time.perf_counter()
                self._prefill(cache, ids[start:])
                res.prefill_ms = (time.perf_counter() - t0) * 1e3
                res.cached_tokens, res.prefill_tokens = start, len(ids) - start
                res.finish_reason = "prefill"
                self._store(res, cache, ids, hashes, len(found.blocks), persist=True)
                return res
            finally:
                self._release(found)

    def _hashes(self, ids: np.ndarray) -> list[str]:
        """Chain hashes of the prompt's full blocks ([] without a tier)."""
        if self.tiered is None:
            return []
        return chain_hashes(ids, self.config.block_size, self.layout_key, self.hash_fn)

    def _all_on_ssd(self, hashes: list[str]) -> bool:
        if self.tiered is None or self.tiered.ssd is None:
            return False
        return self.tiered.ssd.count_prefix(hashes) == len(hashes)

    def _prepare(self, ids: np.ndarray, hashes: list[str] | None = None):
        if len(ids) == 0:
            raise ValueError("empty prompt")
        res = RequestResult(prompt_tokens=int(len(ids)))
        found = LookupResult()
        if hashes is None:
            hashes = self._hashes(ids)
        if self.tiered is not None:
            found = self.tiered.lookup(hashes, ids)
        if found.blocks:
            cache = rebuild_cache(found.blocks, self.geometry.n_layers)
        else:
            cache = make_prompt_cache(self.model, max_kv_size=self.max_kv_size)
        bs = self.config.block_size
        res.ram_hit_tokens = found.ram_blocks * bs
        res.ssd_hit_tokens = found.ssd_blocks * bs
        res.ssd_load_ms = found.ssd_load_ms
        res.ssd_bytes_read = found.ssd_bytes_read
        return res, cache, found, hashes, len(found.blocks) * bs

    def _generate(self, ids, max_tokens, temp, top_p, seed, stop) -> RequestResult:
        t_start = time.perf_counter()
        res, cache, found, hashes, start = self._prepare(ids)
        try:
            if start == len(ids):  # full hit: re-forward the last prompt token (seed 002 A3)
                for c in cache:
                    c.trim(1)
                start -= 1
                if found.from_ssd[-1]:  # the re-forwarded token leaves the tier of the last block
                    res.ssd_hit_tokens -= 1
                else:
                    res.ram_hit_tokens -= 1
            res.cached_tokens = start
            res.prefill_tokens = len(ids) - start
            t0 = time.perf_counter()
            self._prefill(cache, ids[start:-1])
            res.prefill_ms = (time.perf_counter() - t0) * 1e3
            self._decode(res, cache, ids, hashes, len(found.blocks), t_start, max_tokens, temp, top_p, seed, stop)
            return res
        finally:
            self._release(found)

    def _prefill(self, cache: list, tokens: np.ndarray) -> None:
        """Run the model over `tokens` in chunks, filling `cache` (as mlx-lm's generate_step)."""
        for i in range(0, len(tokens), DEFAULT_PREFILL_STEP):
            chunk = mx.array(tokens[i : i + DEFAULT_PREFILL_STEP])[None]
            self.model(chunk, cache=cache)
            mx.eval([c.state for c in cache])

    def _decode(self, res, cache, ids, hashes, n_found, t_start, max_tokens, temp, top_p, seed, stop) -> None:
        if seed is not None:
            mx.random.seed(seed)
        sampler = make_sampler(temp=temp, top_p=top_p)
        eos = set(getattr(self.tokenizer, "eos_token_ids", None) or [])
        detok = self.tokenizer.detokenizer
        detok.reset()
        gen = generate_step(
            mx.array(ids[-1:]), self.model, max_tokens=max_tokens, sampler=sampler, prompt_cache=cache
        )
        t_first = None
        res.finish_reason = "length"
        cut = False
        for n, (token, _) in enumerate(gen):
            if n == 0:
                t_first = time.perf_counter()
                res.ttft_ms = (t_first - t_start) * 1e3
                self._store(res, cache, ids, hashes, n_found, persist=False)
            if token in eos:
                res.finish_reason = "stop"
                break
            res.token_ids.append(int(token))
            detok.add_token(token)
            if stop and self._cut_at_stop(res, detok.text, stop):
                cut = True
                break
        detok.finalize()
        if not cut:
            res.text = detok.text
        res.generated_tokens = len(res.token_ids)
        if t_first is not None and res.generated_tokens > 1:
            res.decode_tokens_per_s = (res.generated_tokens - 1) / max(time.perf_counter() - t_first, 1e-9)

    @staticmethod
    def _cut_at_stop(res: RequestResult, text: str, stop: Sequence[str]) -> bool:
        hits = [i for i in (text.find(s) for s in stop) if i != -1]
        if not hits:
            return False
        res.text = text[: min(hits)]
        res.finish_reason = "stop"
        return True

    def _store(self, res, cache: list, ids, hashes, n_found: int, persist: bool) -> None:
        """Hand the prompt's new full blocks to the tiered cache (prompt KV only).

        `write_path_ms` is all request-thread time of storing: slicing the blocks, RAM insert and,
        with an SSD writer, host copies plus enqueue (async) or the file writes (sync).
        """
        if self.tiered is None:
            return
        n_full = len(ids) // self.config.block_size
        if n_full <= n_found:
            return
        t0 = time.perf_counter()
        fallbacks_before = self._sync_fallbacks()
        blocks = slice_blocks(cache, ids, hashes, self.layout_key, n_found, n_full, self.config.block_size)
        if persist:
            self.tiered.persist(blocks)
        else:
            self.tiered.insert(blocks)
        res.blocks_written = len(blocks)
        res.write_path_ms = (time.perf_counter() - t0) * 1e3
        res.writer_queue_depth = self.tiered.queue_depth()
        res.backpressure_events = self._sync_fallbacks() - fallbacks_before

    def _sync_fallbacks(self) -> int:
        """Writer queue-full events so far (only the writer's counters, not the merged stats)."""
        writer = self.tiered.writer
        return writer.get_stats().get("writer_queue_full_sync_fallback", 0) if writer is not None else 0

    def _release(self, found: LookupResult) -> None:
        if self.tiered is not None:
            self.tiered.release(found)
