"""`KVToolPromptCache`: mlx-lm's server prompt-cache protocol on a kvtool `PrefixCache`.

`mlx_lm.server.ResponseGenerator(model_provider, prompt_cache)` (mlx-lm 0.32.2) makes these
calls, all from its one generation thread:

- `fetch_nearest_cache(model_key, prompt) -> (cache | None, rest)`: before a request. `cache` is
  the request's own per-layer cache (the server prefills `rest` into it, or merges it into its
  batch cache); `len(prompt) - len(rest)` is reported as `usage.prompt_tokens_details.cached_tokens`.
- `insert_cache(model_key, tokens, cache, *, cache_type)`: at the end of a chat request's system
  and user segments (`cache_type` "system" / "user", `tokens` = the prompt tokens processed so
  far) and when a request finishes ("assistant", `tokens` = prompt + generated tokens). The
  server gives up the cache: the callee may keep it.
- `trim_to(n_sequences=, n_bytes=)`: with `--prompt-cache-bytes`, after each batch insert.
- `len(cache)`, `cache.nbytes`, `cache.stats_by_type()`: logged before every request.

Here (docs/design.md#kvtool-serve-kvtoolserver): a fetch is `PrefixCache.fetch(prompt)`, a fresh
cache the server owns, `rest` = `hit.remaining` (never empty); the hit (hashes, RAM pins) waits,
keyed by the prompt, for the request's inserts. A segment insert (a proper prefix of a waiting
prompt) stores the full blocks it completes, unless they are at most `SEGMENT_DEFER_BLOCKS` new
ones, so that requests sharing it find them while this one runs. The final insert stores the
prompt's new blocks and tail entry, sliced by token position; then, where reply KV reuse is on
(`kvtool.cache.reply`), those of `tokens` beyond the prompt, up to where the cache holds KV; then
`PrefixCache.release(hit)` (SSD blocks promoted into RAM as views of that cache). `nbytes`, `len`
and `trim_to` are the RAM tier's (least recently used blocks evicted first).

Models with sliding-window or state layers that passed the self-check (`kvtool.cache.selfcheck`):
mlx-lm's cache after its own prefill cannot be cut into blocks, so fetch prefills the rest of the
prompt itself (`kvtool.kv.prefill`, as `kvtool serve-once`), stores its new blocks and tail entry,
and hands the server mlx-lm's own cache state after `len(prompt) - 1` tokens, so that it forwards
only the last prompt token. This runs on the generation thread in one go (no other request decodes
meanwhile); the tokens it prefilled are in the request's record, `reported_cached` gives the true
cached count for the response's usage, and the request's later inserts store nothing.

A request whose final insert never comes (a client gone mid-generation) has its hit released
after `PENDING_TTL_S` or beyond `max_pending`, unstored. A key that is not `model_key` (another
model, adapter or draft model) is served uncached: `(None, prompt)`. No failure of the cache ever
fails a request: it is logged and the request runs uncached.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvtool.cache import reply
from kvtool.cache.prefix import CacheHit, PrefixCache
from kvtool.kv import prefill
from kvtool.kv.windows import DEFAULT_STEP
from kvtool.server.requests import Prefill, ReportedCounts, RequestRecord, Waiting, uncacheable_reason
from kvtool.tiers.stack import ShutdownStatus

log = logging.getLogger("kvtool.server")

MAX_PENDING = 256  # requests fetched whose final insert has not come (yet)
PENDING_TTL_S = 900.0  # a waiting hit older than this is released (its request is presumed gone)
RECENT_REQUESTS = 100  # records kept for `stats()`
MAX_REPORTED = 1024  # true cached counts kept for `reported_cached` (prompts kvtool prefilled at fetch)
SEGMENT_DEFER_BLOCKS = 1  # a segment insert adding this many new full blocks or fewer stores nothing
RECORD_COUNTS = ("prompt_tokens", "cached_tokens", "ram_hit_tokens", "ssd_hit_tokens", "remote_hit_tokens",
                 "prefill_tokens")  # the adapter's counters that sum the requests' records


class KVToolPromptCache:
    """mlx-lm 0.32.2's server prompt cache (`LRUPromptCache`'s protocol) backed by a `PrefixCache`.

    Args:
        prefix_cache: the model's tiered prefix cache; this object closes it in `close()`.
        model_key: the `ModelProvider.model_key` the prefix cache belongs to
            (`(model_path, adapter_path, draft_model_path)`); other keys are served uncached.
            None accepts every key (one model only!).
        max_pending: waiting hits kept at most (oldest released first).
        on_record: called with each request's `RequestRecord` after its fetch (outside the
            lock; e.g. `kvtool.prom.CacheMetrics.observe`); its exceptions are logged.
        model: the mlx-lm model (`ModelProvider.model`), for kvtool's own prefill of models with
            sliding-window or state layers (see the module docstring); None: such models are
            served uncached.
        prefill_step: tokens per prefill chunk, mlx-lm's server's `--prefill-step-size` (the
            rotating layout mlx-lm's prefill leaves depends on it).

    `reply_reuse` says whether final inserts store the generated tokens' KV too, and why
    (`kvtool.cache.reply.decide`: measured at construction; after a reconfiguration only a verdict
    already stored or known is used; the probe needs `model`). A subclass whose decoding the
    probe does not measure sets `reply_off_reason`.

    Thread-safe: one lock around every call (the server calls from its generation thread; the
    stats route, signal handlers and shutdown from others), except the model's forward passes of
    kvtool's own prefill at fetch, which touch only that request's cache.
    """

    reply_off_reason: str | None = None

    def __init__(self, prefix_cache: PrefixCache, model_key: Any = None, *, max_pending: int = MAX_PENDING,
                 on_record: Callable[[RequestRecord], None] | None = None,
                 model: Any = None, prefill_step: int = DEFAULT_STEP):
        self.prefix_cache = prefix_cache
        self.model = model
        self.prefill_step = max(1, int(prefill_step))
        self._reported = ReportedCounts(MAX_REPORTED)  # prompt digest -> true cached counts
        self.model_key = model_key
        self.max_pending = max_pending
        self.on_record = on_record
        self._lock = threading.RLock()
        self._waiting: OrderedDict[int, Waiting] = OrderedDict()
        self._recent: deque[RequestRecord] = deque(maxlen=RECENT_REQUESTS)
        self._closed = False
        self._epoch = 0  # tiers generation: +1 at every reconfiguration and at close
        self._counts = dict.fromkeys(("requests", "requests_cached", *RECORD_COUNTS, "inserts", "inserts_segment",
                                      "inserts_segment_deferred", "inserts_final", "inserts_unmatched",
                                      "inserts_uncacheable", "requests_prefilled", "blocks_stored", "waiting_expired",
                                      "errors", "reply_blocks_stored"), 0)  # fmt: skip
        self.reply_reuse = self._decide_reply()

    # ------------------------------------------------------------------ protocol
    def fetch_nearest_cache(self, model: Any, tokens: Sequence[int]) -> tuple[list | None, Sequence[int]]:
        """The longest cached prefix of `tokens` as a fresh cache, and the tokens left to prefill.

        Returns:
            `(cache, rest)`: `cache` is None when nothing is cached (the server then makes its
            own); `rest` is the uncached tail of `tokens` (at least one token).
        """
        t0 = time.perf_counter()
        with self._lock:
            self._counts["requests"] += 1
            rec = RequestRecord(request=self._counts["requests"], prompt_tokens=len(tokens),
                                prefill_tokens=len(tokens))
            try:
                out = self._fetch(model, tokens, rec)
            except Exception as exc:  # the cache never fails a request: serve it uncached
                rec, out = self._failed(rec, tokens, exc), (None, tokens)
        if isinstance(out, Prefill):  # kvtool's prefill runs outside the lock: stats and metrics stay answerable
            rec, out = self._prefill_and_store(out, tokens)
        cache, rest = out
        with self._lock:
            rec.fetch_ms = (time.perf_counter() - t0) * 1e3
            self._recent.append(rec)
            for key in RECORD_COUNTS:
                self._counts[key] += getattr(rec, key)
            self._counts["requests_cached"] += rec.cached_tokens > 0
        if self.on_record is not None:
            try:
                self.on_record(rec)
            except Exception:  # noqa: BLE001 - metrics never fail a request
                log.exception("the per-request observer failed")
        log.info("%s", rec.log_line())
        return cache, rest

    def insert_cache(self, model: Any, tokens: Sequence[int], prompt_cache: list, *,
                     cache_type: str = "assistant") -> None:
        """Store the prompt part of a returned cache, and at a final insert the reply's full blocks
        and tail entry where reply reuse is on (see the module docstring); never raises."""
        with self._lock:
            self._counts["inserts"] += 1
            try:
                self._insert(model, tokens, prompt_cache)
            except Exception:  # noqa: BLE001 - storing is an optimisation: never fail the server
                self._counts["errors"] += 1
                log.exception("storing the blocks of a %s insert failed", cache_type)

    def trim_to(self, *, n_sequences: int | None = None, n_bytes: int | None = None) -> None:
        """Evict least recently used (unpinned) RAM blocks until at most `n_sequences` blocks and
        `n_bytes` bytes are held (`LRUPromptCache.trim_to`; a sequence is a block here)."""
        with self._lock:
            ram = self._ram()
            if ram is None:
                return
            ram.trim(None if n_bytes is None else max(0, int(n_bytes)),
                     None if n_sequences is None else max(0, int(n_sequences)))

    def __len__(self) -> int:
        """Blocks held in the RAM tier."""
        ram = self._ram()
        return len(ram) if ram is not None else 0

    @property
    def nbytes(self) -> int:
        """Bytes held in the RAM tier (sum of block nbytes)."""
        ram = self._ram()
        return ram.nbytes if ram is not None else 0

    def stats_by_type(self) -> dict[str, dict[str, int]]:
        """For the server's per-request log: RAM blocks, and requests waiting for their insert."""
        with self._lock:
            return {
                "kvtool RAM blocks": {"n_sequences": len(self), "n_bytes": self.nbytes},
                "kvtool requests in flight": {"n_sequences": len(self._waiting), "n_bytes": 0},
            }

    # ------------------------------------------------------------ kvtool extras
    def stats(self) -> dict[str, Any]:
        """Counters of the adapter and of every tier, the layout, the last requests (JSON-able)."""
        with self._lock:
            pc = self.prefix_cache
            return {
                "adapter": dict(self._counts, waiting=len(self._waiting), closed=self._closed),
                "cache": pc.stats().to_dict(),
                "layout_key": pc.layout_key,
                "namespace_dir": str(pc.namespace_dir) if pc.namespace_dir is not None else None,
                "block_size": pc.config.block_size,
                "ssd_disabled_reason": pc.ssd_disabled_reason,
                "uncached_reason": pc.uncached_reason,
                "reply_kv_reuse": self.reply_reuse.to_dict(),
                "requests": [r.to_dict() for r in self._recent],
            }

    def reconfigure(self, config) -> ShutdownStatus:
        """Live reconfiguration (docs/design.md#live-reconfiguration) between two cache calls: waiting hits are released
        (their requests finish but are not stored: their hashes belong to the old layout), then
        the prefix cache drains the writer, flushes and detaches, drops RAM and reattaches."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the cache is closed")
            self._release_waiting(list(self._waiting))
            self._epoch += 1
            status = self.prefix_cache.reconfigure(config)
            self.reply_reuse = self._decide_reply(measure=False)  # (no model forwards while requests decode)
            return status

    def close(self) -> ShutdownStatus:
        """Release waiting hits, drain the writer, flush and close the index. Idempotent; later
        fetches run uncached and inserts are ignored."""
        with self._lock:
            if self._closed:
                return ShutdownStatus()
            self._release_waiting(list(self._waiting))
            self._closed = True
            self._epoch += 1
            return self.prefix_cache.close()

    # ----------------------------------------------------------------- internals
    def _decide_reply(self, measure: bool = True) -> reply.ReplyReuse:
        """Reply KV reuse for the attached namespace (never raises: a failure turns it off), logged."""
        try:
            out = reply.decide(self.prefix_cache, self.model, off_reason=self.reply_off_reason, measure=measure)
        except Exception as exc:  # noqa: BLE001 - an optimisation: never fail the server
            log.exception("deciding reply KV reuse failed")
            out = reply.ReplyReuse(False, f"the decision raised {type(exc).__name__}: {exc}")
        log.info("kvtool: reply KV reuse %s: %s", "on" if out.enabled else "off", out.reason)
        return out

    def _ram(self):
        tiered = self.prefix_cache.tiered
        return tiered.ram if tiered is not None and not self._closed else None

    def _uncached_reason(self, model: Any) -> str | None:
        if self._closed:
            return "cache closed"
        if self.model_key is not None and model != self.model_key:
            return f"model {model!r} is not the cached model"
        if self.prefix_cache.tiered is None:
            return self.prefix_cache.uncached_reason or "cache disabled (no SSD tier, ram_bytes 0)"
        return None

    def _failed(self, rec: RequestRecord, tokens: Sequence[int], exc: Exception) -> RequestRecord:
        """The record of a request whose fetch raised (it runs uncached). Under the lock."""
        log.exception("fetch failed; request %d runs uncached", rec.request)
        self._counts["errors"] += 1
        return RequestRecord(request=rec.request, prompt_tokens=len(tokens), prefill_tokens=len(tokens),
                             uncached_reason=f"fetch failed: {exc}")

    def _fetch(self, model: Any, tokens: Sequence[int],
               rec: RequestRecord) -> tuple[list | None, Sequence[int]] | Prefill:
        reason = self._uncached_reason(model) or (None if len(tokens) else "empty prompt")
        if reason is not None:
            rec.uncached_reason = reason
            return None, tokens
        ids = np.asarray(tokens, dtype=np.int32)
        self._expire()
        blockwise = self._blockwise
        hit = self.prefix_cache.fetch(ids, full_views=blockwise)
        rec.count_hit(hit)
        rec.ssd_load_ms, rec.ssd_bytes_read = hit.ssd_load_ms, hit.ssd_bytes_read
        if blockwise:
            return Prefill(ids, hit, rec, self._epoch)
        cache = hit.cache if hit.cached_tokens > 0 and hit.cache else None
        hit.cache = []  # the server owns the cache now (no reference kept: in-place decode stays possible)
        self._waiting[rec.request] = Waiting(rec, ids, hit, time.monotonic(), hit.entries_found)
        return cache, tokens[hit.cached_tokens :]

    @property
    def _blockwise(self) -> bool:
        """kvtool prefills at fetch: the model has sliding-window or state layers, it passed the
        self-check (the tiers are attached) and the model is known."""
        pc = self.prefix_cache
        return self.model is not None and pc.tiered is not None and bool(pc.windows or pc.has_states)

    def _prefill_and_store(self, job: Prefill,
                           tokens: Sequence[int]) -> tuple[RequestRecord, tuple[list | None, Sequence[int]]]:
        """kvtool's prefill of the prompt after the hit (see the module docstring), outside the
        lock (only this request's cache is touched); a reconfiguration or close meanwhile: nothing
        is stored.

        Returns:
            (the request's record, (cache, rest)); on a failure the request runs uncached."""
        pc, ids, hit, rec = self.prefix_cache, job.ids, job.hit, job.record
        n = int(ids.size)
        try:
            cache = hit.cache or prefill.new_cache(self.model, pc.windows)
            states: dict | None = {} if pc.has_states else None
            t0 = time.perf_counter()
            prefill.prefill(self.model, cache, ids[hit.cached_tokens :], n, hit.cached_tokens, step=self.prefill_step,
                            quant=pc.quant, states=states, block_size=pc.config.block_size)
            rec.prefill_ms = (time.perf_counter() - t0) * 1e3
            with self._lock:
                self._store_prefilled(job, cache, states)
            gen = prefill.generation_cache(cache, n - 1, pc.windows, self.prefill_step, states)
        except Exception as exc:  # the cache never fails a request: serve it uncached
            with self._lock:
                self._release_quietly(hit)
                return self._failed(rec, tokens, exc), (None, tokens)
        return rec, (gen, tokens[n - 1 :])

    def _store_prefilled(self, job: Prefill, cache: list, states: dict | None) -> None:
        """Store a prefilled prompt's new entries and release its hit. Under the lock."""
        pc, ids, hit, rec = self.prefix_cache, job.ids, job.hit, job.record
        if job.epoch != self._epoch or self._closed:  # the tiers changed during the prefill
            self._release_quietly(hit)
            return
        try:
            self._store(rec, ids, cache, hit, states=states)
            hit.cache = cache  # SSD blocks enter RAM as views of the prompt positions
            pc.release(hit)
        finally:
            hit.cache = []
            self._release_quietly(hit)  # (a no-op after release)
        self._counts["requests_prefilled"] += 1
        self._waiting[rec.request] = Waiting(rec, ids, hit, time.monotonic(), len(hit.hashes), prefilled=True)
        self._reported.add(ids, rec.cached_tokens)

    def _release_quietly(self, hit: CacheHit) -> None:
        hit.cache = []
        try:
            self.prefix_cache.release(hit)
        except Exception:  # noqa: BLE001 - releasing is bookkeeping: never fail the request
            log.exception("releasing a prefilled request's hit failed")

    def reported_cached(self, prompt: Sequence[int], reported: int) -> int:
        """The prompt tokens a request really took from the cache, for the `cached_tokens` of its
        response: mlx-lm reports `len(prompt) - len(rest)`, which for a prompt kvtool prefilled at
        fetch counts the tokens kvtool prefilled. `reported` is returned for other prompts.
        Identical prompts in flight together are answered in fetch order."""
        with self._lock:
            return self._reported.pop(prompt, reported)

    def _insert(self, model: Any, tokens: Sequence[int], cache: list) -> None:
        if self._closed or (self.model_key is not None and model != self.model_key):
            return
        ids = np.asarray(tokens, dtype=np.int32)
        key = self._match_final(ids)
        if key is not None:
            self._counts["inserts_final"] += 1
            self._finish(self._waiting.pop(key), ids, cache)
            return
        waiting = self._match_segment(ids)
        if waiting is None:
            self._counts["inserts_unmatched"] += 1
            return
        self._counts["inserts_segment"] += 1
        self._store_segment(waiting, ids, cache)

    def _match_final(self, ids: np.ndarray) -> int | None:
        """The waiting request whose prompt `ids` starts with (the longest; the oldest on ties)."""
        best, best_len = None, -1
        for key, w in self._waiting.items():
            n = w.prompt.size
            if best_len < n <= ids.size and np.array_equal(ids[:n], w.prompt):
                best, best_len = key, n
        return best

    def _match_segment(self, ids: np.ndarray) -> Waiting | None:
        """The newest waiting request whose prompt `ids` is a proper prefix of."""
        for w in reversed(self._waiting.values()):
            if ids.size < w.prompt.size and np.array_equal(w.prompt[: ids.size], ids):
                return w
        return None

    def _store_segment(self, w: Waiting, ids: np.ndarray, cache: list) -> None:
        n_full = ids.size // self.prefix_cache.config.block_size
        if n_full <= w.stored or self.prefix_cache.tiered is None or w.prefilled:
            return
        if n_full - w.stored <= SEGMENT_DEFER_BLOCKS:  # left to the next segment's or the final insert
            self._counts["inserts_segment_deferred"] += 1
            return
        if uncacheable_reason(self.prefix_cache, cache) is not None:
            self._counts["inserts_uncacheable"] += 1
            return
        n_tok = n_full * self.prefix_cache.config.block_size
        sub = CacheHit(cache=[], prompt_tokens=n_tok, hashes=w.hit.hashes[:n_full], tail=None, entries_found=w.stored)
        self._store(w.record, w.prompt[:n_tok], cache, sub)
        w.stored = n_full

    def _store(self, rec: RequestRecord, prompt: np.ndarray, cache: list, hit: CacheHit, **kw: Any) -> None:
        """`PrefixCache.store`, timed and counted into the request's record. Under the lock."""
        t0 = time.perf_counter()
        n = self.prefix_cache.store(prompt, cache, hit, **kw)
        rec.store_ms += (time.perf_counter() - t0) * 1e3
        rec.blocks_stored += n
        self._counts["blocks_stored"] += n

    def _finish(self, w: Waiting, ids: np.ndarray, cache: list) -> None:
        w.record.generated_tokens = int(ids.size - w.prompt.size)
        w.record.finished = True
        if w.prefilled:  # stored at fetch; the hit is released
            return
        storable = self.prefix_cache.tiered is not None and uncacheable_reason(self.prefix_cache, cache) is None
        try:
            if storable:
                self._store(w.record, w.prompt, cache,
                            dataclasses.replace(w.hit, entries_found=max(w.hit.entries_found, w.stored)))
                span = reply.reply_span(self.prefix_cache, w.prompt, ids, cache) if self.reply_reuse.enabled else None
                if span is not None:  # the generated tokens' blocks and tail entry (kvtool.cache.reply)
                    before = w.record.blocks_stored
                    self._store(w.record, span[0], cache, span[1])
                    self._counts["reply_blocks_stored"] += w.record.blocks_stored - before
            else:
                self._counts["inserts_uncacheable"] += 1
        finally:
            if storable:
                w.hit.cache = cache  # SSD blocks enter RAM as views of the prompt positions
            self.prefix_cache.release(w.hit)
            w.hit.cache = []

    def _expire(self) -> None:
        now = time.monotonic()
        old = [k for k, w in self._waiting.items() if now - w.since > PENDING_TTL_S]
        excess = len(self._waiting) - len(old) - (self.max_pending - 1)
        if excess > 0:
            old += [k for k in self._waiting if k not in old][:excess]
        if old:
            self._counts["waiting_expired"] += len(old)
            self._release_waiting(old)

    def _release_waiting(self, keys: list[int]) -> None:
        for key in keys:
            w = self._waiting.pop(key, None)
            if w is None or w.prefilled:  # (a prefilled request's hit was released at fetch)
                continue
            w.hit.cache = []  # no promotion: the request's cache is not ours
            try:
                self.prefix_cache.release(w.hit)
            except Exception:  # noqa: BLE001
                log.exception("releasing request %d failed", w.record.request)


__all__ = ["KVToolPromptCache", "RequestRecord", "MAX_PENDING", "PENDING_TTL_S"]
