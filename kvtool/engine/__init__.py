"""The kvtool engine: an mlx-lm model served through a `PrefixCache`.

Per request: `PrefixCache.fetch` gives the longest cached prefix as mlx-lm caches, the engine
prefills only the rest (`kvtool.kv.prefill`), decodes with mlx-lm's `generate_step` (its first
token handed out as soon as it is sampled: `kvtool.kv.decode`), and hands the prompt's new blocks
and tail entry to the cache right after the first token. Only prompt KV is stored.

Exactness: KV of a prefix computed alone equals the same prefix inside a longer prompt, so the
logits (and greedy tokens) with a cached prefix equal an uncached prefill bit for bit (tested).
Quantized KV (`kv_bits`, as `mlx_lm.generate --kv-bits`): the cache is quantized at the offset
where mlx-lm's `generate_step` would (`KVQuantization.switch_point`) and decoding uses the same
settings, so the output equals mlx-lm's with the same quantisation and `prefill_step_size`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_sampler

from kvtool.cache.prefix import CacheHit, CacheStats, PrefixCache
from kvtool.config import KVToolConfig
from kvtool.engine.results import KVBitsUnsupported, RequestResult, StreamResponse
from kvtool.kv import decode
from kvtool.kv import prefill as prefill_mod
from kvtool.kv.blocks import HashFn, blake2b_chain
from kvtool.kv.model_kv import (
    DEFAULT_KV_GROUP_SIZE,
    DEFAULT_QUANTIZED_KV_START,
    KVQuantization,
    library_versions,
    quantized_kv_failure,
)
from kvtool.models.loader import LoadedModel, load_model
from kvtool.tiers.stack import ShutdownStatus, WriteTally
from kvtool.tiers.writer import AsyncWriter

log = logging.getLogger("kvtool")

DEFAULT_PREFILL_STEP = 2048  # tokens per prefill chunk, as mlx-lm's generate_step
DEFAULT_MAX_TOKENS = 256
UNSETTLED_MAX = 4096  # requests whose `blocks_written` waits for a drain (older ones keep the accepted count)


class Engine:
    """A resident model plus its `PrefixCache`.

    Args:
        loaded: model, tokenizer and identity from `kvtool.models.loader.load_model`.
        config: cache settings.
        hash_fn: chain-hash function (injectable to force collisions in tests).
        max_kv_size: if set, mlx-lm would use a rotating cache: the engine then runs uncached.
        fs: optional `FileOps` of the SSD tier (fault injection in tests).
        prefill_step_size: tokens per prefill chunk (as `mlx_lm.generate --prefill-step-size`).
        kv_bits: quantize the KV cache to this many bits (4 or 8 as `mlx_lm.generate --kv-bits`;
            None: plain KV). Blocks then hold the quantized KV (see `KVQuantization`).
        kv_group_size: quantisation group size (`--kv-group-size`, default 64).
        quantized_kv_start: cache offset from which the KV is quantized (`--quantized-kv-start`,
            mlx-lm's default 5000).

    Raises:
        KVBitsUnsupported: `kv_bits` for a model whose mlx-lm code cannot run a quantized KV
            cache (measured by `kvtool.kv.model_kv.quantized_kv_failure`; mlx-lm would fail mid-request).
        ValueError: `prefill_step_size < 1` or bad quantisation settings.
    """

    def __init__(
        self,
        loaded: LoadedModel,
        config: KVToolConfig,
        *,
        hash_fn: HashFn = blake2b_chain,
        max_kv_size: int | None = None,
        fs=None,
        prefill_step_size: int = DEFAULT_PREFILL_STEP,
        kv_bits: int | None = None,
        kv_group_size: int = DEFAULT_KV_GROUP_SIZE,
        quantized_kv_start: int = DEFAULT_QUANTIZED_KV_START,
    ):
        if prefill_step_size < 1:
            raise ValueError("prefill_step_size must be >= 1")
        self.prefill_step_size = prefill_step_size
        self.quant = (KVQuantization(kv_bits, kv_group_size, quantized_kv_start, prefill_step_size)
                      if kv_bits is not None else None)
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.hash_fn = hash_fn
        self.max_kv_size = max_kv_size
        self._lock = threading.Lock()  # one request or reconfiguration at a time (quiesce)
        self._unsettled: deque[tuple[RequestResult, WriteTally, Any]] = deque(maxlen=UNSETTLED_MAX)
        if self.quant is not None:
            failure = quantized_kv_failure(self.model, self.quant)
            if failure is not None:
                raise KVBitsUnsupported(
                    f"kv_bits={kv_bits}: mlx-lm {library_versions().split('mlx_lm=')[-1]} cannot run this model "
                    f"({type(self.model).__module__}) with a quantized KV cache: {failure}",
                    hint="drop --kv-bits (mlx_lm.generate --kv-bits fails the same way once a prompt reaches "
                         "--quantized-kv-start)")
        self.cache = PrefixCache.for_model(
            self.model, config, model_id=loaded.model_id, model_name=loaded.name, max_kv_size=max_kv_size,
            hash_fn=hash_fn, fs=fs, quant=self.quant,
        )

    @classmethod
    def from_spec(cls, model_spec: str, config: KVToolConfig, *, adapter_path: str | None = None, **kwargs) -> Engine:
        """Load a model (preset, local dir or HF id, optional LoRA adapter) and build an engine on it.

        Raises:
            kvtool.models.loader.ModelLoadError: the model could not be loaded.
        """
        return cls(load_model(model_spec, adapter_path=adapter_path), config, **kwargs)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------ tier wiring
    @property
    def config(self) -> KVToolConfig:
        return self.cache.config

    @property
    def uncached_reason(self) -> str | None:
        return self.cache.uncached_reason

    @property
    def layout_key(self) -> str | None:
        return self.cache.layout_key

    @property
    def tiered(self):
        return self.cache.tiered

    @property
    def namespace_dir(self):
        """Directory of this engine's SSD namespace, or None without an SSD tier."""
        return self.cache.namespace_dir

    def reconfigure(self, config: KVToolConfig) -> ShutdownStatus:
        """Live reconfiguration on the resident model (docs/design.md#live-reconfiguration): quiesce (wait for the request
        in flight), drain the writer, flush the index, detach, drop RAM blocks, reattach."""
        with self._lock:
            status = self.cache.reconfigure(config)
            self._settle()
            return status

    def flush(self) -> bool:
        """Wait until every accepted SSD write was attempted; flush the index. Settles the
        `blocks_written` of earlier requests (`_settle`)."""
        with self._lock:
            ok = self.cache.flush()
            self._settle()
            return ok

    def close(self) -> ShutdownStatus:
        """Drain the writer, flush and close the index. Idempotent. Settles `blocks_written`."""
        with self._lock:
            status = self.cache.close()
            self._settle()
            return status

    def _settle(self) -> None:
        """Set each unsettled request's `blocks_written` to its blocks that reached the SSD (the
        writer has drained: every accepted write was attempted)."""
        while self._unsettled:
            res, tally, ssd = self._unsettled.popleft()
            res.blocks_written = ssd.saved_count(tally.hashes) if ssd is not None else 0

    def stats(self) -> dict[str, int]:
        """Counters of the prefix cache (see `CacheStats`)."""
        return self.cache.stats().to_dict()

    def warmup(self) -> float:
        """One tiny forward pass outside any timing (kernel compilation); returns its ms."""
        t0 = time.perf_counter()
        cache = make_prompt_cache(self.model)
        mx.eval(self.model(mx.array([[0, 1]]), cache=cache))
        return (time.perf_counter() - t0) * 1e3

    # ---------------------------------------------------------------- prompts
    def encode(
        self,
        prompt: str | None = None,
        messages: list[dict] | None = None,
        *,
        chat_template: bool = False,
        system_prompt: str | None = None,
    ) -> list[int]:
        """Token ids of a plain prompt or of chat messages.

        Chat messages go through the tokenizer's chat template with `tokenize=True`, so no BOS is
        added a second time. A plain prompt gets special tokens as mlx-lm's
        `stream_generate` would add them; with `chat_template=True` (and a tokenizer that has
        one) it becomes one user message, as `mlx_lm.generate --prompt` does: templated as text
        with the generation prompt, then encoded without special tokens.

        Args:
            prompt: plain prompt text.
            messages: chat messages `[{role, content}, ...]`.
            chat_template: apply the chat template to `prompt` (the CLI's default).
            system_prompt: a system message put first (chat template only).

        Raises:
            ValueError: neither or both of `prompt` and `messages` given, or no chat template.
        """
        if (prompt is None) == (messages is None):
            raise ValueError("give exactly one of prompt or messages")
        tok = self.tokenizer
        has_template = bool(getattr(tok, "chat_template", None))
        system = [{"role": "system", "content": system_prompt}] if system_prompt is not None else []
        if prompt is not None and chat_template and has_template:
            text = tok.apply_chat_template([*system, {"role": "user", "content": prompt}], tokenize=False,
                                           add_generation_prompt=True)
            return [int(t) for t in tok.encode(text, add_special_tokens=False)]
        if messages is not None:
            messages = [*system, *messages]
            if not getattr(tok, "chat_template", None):
                raise ValueError("this tokenizer has no chat template; use a plain prompt")
            ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            return [int(t) for t in ids]
        assert prompt is not None  # exactly one of prompt and messages (checked above)
        bos = getattr(tok, "bos_token", None)
        add_special = bos is None or not prompt.startswith(bos)
        return list(tok.encode(prompt, add_special_tokens=add_special))

    # --------------------------------------------------------------- requests
    def generate(self, prompt_ids: Sequence[int], **options: Any) -> RequestResult:
        """Serve one request through the prefix cache: `stream` (same `options`) run to its end.

        Returns:
            A `RequestResult`; `token_ids` are the generated ids (EOS excluded).

        Raises:
            ValueError: empty prompt or `max_tokens < 1`.
        """
        result = RequestResult()
        for step in self.stream(prompt_ids, **options):
            result = step.result
        return result

    def stream(
        self,
        prompt_ids: Sequence[int],
        *,
        max_tokens: int = DEFAULT_MAX_TOKENS,
        temp: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: Sequence[str] = (),
    ) -> Iterator[StreamResponse]:
        """Serve one request through the prefix cache, one `StreamResponse` per generated token
        (`mlx_lm.stream_generate` style). The engine stays locked until the generator is
        exhausted or closed.

        Args:
            prompt_ids: prompt token ids (at least one).
            max_tokens: maximum generated tokens (> 0).
            temp, top_p: mlx-lm sampler settings; temp 0 is greedy.
            seed: seeds `mx.random` before sampling.
            stop: stop strings; the text is cut before the first one found.

        Raises:
            ValueError: empty prompt or `max_tokens < 1`.
        """
        if max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        ids = np.asarray(prompt_ids, dtype=np.int32)
        if ids.size == 0:
            raise ValueError("empty prompt")
        with self._lock:
            yield from self._stream(ids, max_tokens, temp, top_p, seed, tuple(stop))

    def prefill(self, prompt_ids: Sequence[int]) -> RequestResult:
        """Prefill only (no decode) and write the prompt's blocks to SSD whatever the policy
        (used by `kvtool warm`). A prompt whose entries are all on SSD already is skipped by
        hashing alone: no block is loaded and the model does not run (`prefill_tokens == 0`).

        Raises:
            ValueError: empty prompt.
        """
        with self._lock:
            ids = np.asarray(prompt_ids, dtype=np.int32)
            if len(ids) == 0:
                raise ValueError("empty prompt")
            pc = self.cache
            if pc.ssd is not None and pc.probe(ids) == len(ids):
                return RequestResult(prompt_tokens=len(ids), cached_tokens=len(ids), ssd_hit_tokens=len(ids),
                                     prefill_tokens=0, finish_reason="skipped")
            hit = pc.fetch(ids, full_views=True)
            try:
                res = self._result(hit)
                pc.persist_found(hit)  # RAM-only blocks (evict_only) reach SSD too
                cache = hit.cache or self.new_cache()
                t0 = time.perf_counter()
                states: dict | None = {} if self._blockwise and self.cache.has_states else None
                self.prefill_into(cache, hit.remaining, len(ids), hit.cached_tokens, states)
                res.prefill_ms = (time.perf_counter() - t0) * 1e3
                res.finish_reason = "prefill"
                self._store(res, ids, cache, hit, persist=True, states=states)
                return res
            finally:
                pc.release(hit)

    def _result(self, hit: CacheHit) -> RequestResult:
        res = RequestResult(ssd_load_ms=hit.ssd_load_ms, ssd_bytes_read=hit.ssd_bytes_read,
                            uncached_reason=hit.uncached_reason or self.cache.uncached_reason)
        res.count_hit(hit)
        return res

    def _stream(self, ids, max_tokens, temp, top_p, seed, stop) -> Iterator[StreamResponse]:
        t_start = time.perf_counter()
        hit = self.cache.fetch(ids, full_views=True)
        try:
            res = self._result(hit)
            cache = hit.cache or self.new_cache()
            t0 = time.perf_counter()
            # sliding-window layers: the whole prompt into full views (every token's KV, for the
            # blocks), then mlx-lm's own rotating state at the last prompt token; state layers:
            # checkpoints at block ends (and before the last token) on the way; the last token's
            # prefilled KV is what its block / tail entry stores (`kvtool.kv.prefill.for_generation`)
            states: dict | None = {} if self._blockwise and self.cache.has_states else None
            # every entry of the prompt's chain found: nothing to store, so no prefilled KV of the
            # last token is needed and mlx-lm forwards it once, as after its own prompt cache
            complete = hit.entries_found == len(hit.hashes) + (hit.tail is not None)
            gen_cache, last_kv, _ = prefill_mod.for_generation(
                self.model, cache, ids, hit.cached_tokens, step=self.prefill_step_size,
                windows=self.cache.windows if self._blockwise else (), states=states, quant=self.quant,
                block_size=self.cache.config.block_size, stored=self.cache.tiered is not None and not complete)
            res.prefill_ms = (time.perf_counter() - t0) * 1e3
            yield from self._decode(res, gen_cache, ids, hit, t_start, max_tokens, temp, top_p, seed, stop,
                                    store_cache=cache, states=states, last_kv=last_kv)
        finally:
            self.cache.release(hit)

    def new_cache(self) -> list:
        """An empty cache for a prefill: mlx-lm's own, with full views for sliding-window leaves
        (`kvtool.kv.prefill.new_cache`) when they are cached."""
        return prefill_mod.new_cache(self.model, self.cache.windows if self._blockwise else (), self.max_kv_size)

    @property
    def _blockwise(self) -> bool:
        """kvtool's own prefill (full views of sliding windows, state snapshots) runs only while
        such a model's blocks are cached (its self-check passed, tiers attached); otherwise the
        model runs exactly mlx-lm's way."""
        pc = self.cache
        return pc.tiered is not None and bool(pc.windows or pc.has_states)

    def prefill_into(self, cache: list, tokens: np.ndarray, n_prompt: int, start: int,
                 states: dict | None = None) -> None:
        """Run the model over `tokens` (the prompt's tokens after the `start` ones `cache` holds)
        in chunks as mlx-lm's generate_step, with kvtool's quantisation switch and state
        checkpoints (`kvtool.kv.prefill.prefill`)."""
        prefill_mod.prefill(self.model, cache, tokens, n_prompt, start, step=self.prefill_step_size,
                            quant=self.quant, states=states, block_size=self.cache.config.block_size)

    def _decode(self, res, cache, ids, hit, t_start, max_tokens, temp, top_p, seed, stop,
                store_cache=None, states=None, last_kv=None) -> Iterator[StreamResponse]:
        if seed is not None:
            mx.random.seed(seed)
        sampler = make_sampler(temp=temp, top_p=top_p)
        eos = set(getattr(self.tokenizer, "eos_token_ids", None) or [])
        detok = self.tokenizer.detokenizer
        detok.reset()
        quant: dict[str, Any] = {}
        if self.quant is not None:
            quant = dict(kv_bits=self.quant.bits, kv_group_size=self.quant.group_size,
                         quantized_kv_start=self.quant.start)
        gen = decode.tokens(self.model, cache, int(ids[-1]), max_tokens=max_tokens, sampler=sampler,
                            prefill_step_size=self.prefill_step_size, quant=quant)
        t_first = None
        res.finish_reason = "length"
        cut = False
        for n, token in enumerate(gen):
            if n == 0:
                t_first = time.perf_counter()
                res.ttft_ms = (t_first - t_start) * 1e3
                self._store(res, ids, store_cache if store_cache is not None else cache, hit, persist=False,
                            states=states, last_kv=last_kv)
            if token in eos:
                res.finish_reason = "stop"
                break
            res.token_ids.append(int(token))
            before = len(detok.text)
            detok.add_token(token)
            if stop and self._cut_at_stop(res, detok.text, stop):
                cut = True
                break
            res.generated_tokens = len(res.token_ids)
            yield StreamResponse(detok.text[before:], int(token), res)
        shown = len(detok.text)
        detok.finalize()
        rest = "" if cut else detok.text[shown:]
        if not cut:
            res.text = detok.text
        res.generated_tokens = len(res.token_ids)
        if t_first is not None and res.generated_tokens > 1:
            res.decode_tokens_per_s = (res.generated_tokens - 1) / max(time.perf_counter() - t_first, 1e-9)
        yield StreamResponse(rest, res.token_ids[-1] if res.token_ids else -1, res, res.finish_reason)

    @staticmethod
    def _cut_at_stop(res: RequestResult, text: str, stop: Sequence[str]) -> bool:
        hits = [i for i in (text.find(s) for s in stop) if i != -1]
        if not hits:
            return False
        res.text = text[: min(hits)]
        res.finish_reason = "stop"
        return True

    def _store(self, res: RequestResult, ids, cache: list, hit: CacheHit, persist: bool, states=None,
               last_kv=None) -> None:
        """Hand the prompt's new blocks to the prefix cache (prompt KV only).

        `write_path_ms` is all request-thread time of storing: slicing the blocks, RAM insert and,
        with an SSD writer, host copies plus enqueue (async) or the file writes (sync).
        """
        tiered = self.cache.tiered
        if tiered is None:
            return
        t0 = time.perf_counter()
        fallbacks_before = self._sync_fallbacks()
        tiered.tally = tally = WriteTally()
        try:
            self.cache.store(ids, cache, hit, persist=persist, states=states, last_kv=last_kv)
        finally:
            tiered.tally = None
        # blocks that reached the SSD: known now with an inline writer; with a background one,
        # those it accepted until `flush` / `close` settles the count (`_settle`)
        res.blocks_written = tally.accepted
        self._unsettled.append((res, tally, tiered.ssd))
        if not isinstance(tiered.writer, AsyncWriter):
            self._settle()
        res.write_path_ms = (time.perf_counter() - t0) * 1e3
        res.writer_queue_depth = tiered.queue_depth()
        res.backpressure_events = self._sync_fallbacks() - fallbacks_before

    def _sync_fallbacks(self) -> int:
        """Writer queue-full events so far (blocks saved on the caller's thread plus blocks shed;
        only the writer's counters, not the merged stats)."""
        tiered = self.cache.tiered
        writer = tiered.writer if tiered is not None else None
        if writer is None:
            return 0
        stats = writer.get_stats()
        return stats.get("writer_queue_full_sync_fallback", 0) + stats.get("writer_shed_blocks", 0)


__all__ = ["Engine", "KVBitsUnsupported", "RequestResult", "StreamResponse", "CacheStats", "DEFAULT_MAX_TOKENS"]
