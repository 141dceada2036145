"""`PrefixCache`: the tiered (RAM over SSD) prefix cache of one model, usable from any server.

    with PrefixCache.for_model(model, config, model_id=...) as pc:
        hit = pc.fetch(prompt_ids)             # per-layer mlx-lm caches + the tokens left to prefill
        ...prefill hit.remaining[:-1], decode from hit.remaining[-1:] with hit.cache...
        pc.store(prompt_ids, hit.cache, hit)   # new full blocks + the prompt's tail entry
        pc.release(hit)

A fetch takes the longest chain the tiers hold and builds the cache: RAM only, one concatenation
per layer (with decode room); else per-layer buffers allocated once, into which every tier places
and verifies its blocks, taken over by the caches (docs/design.md#restore-path-kvtoolcacheprefix--kvtooldiskrestore).
A block that fails verification cuts the chain there; the rest is recomputed, output stays exact.
On a full hit the cache is trimmed by one token and `remaining` is the last prompt token,
re-forwarded for the first logits (docs/design.md#full-hits-and-prompt-encoding). Lower tiers'
blocks enter the tiers above at `release` as views of the request's cache (no second copy).

Quantized KV (mlx-lm's `kv_bits`): the KV after mlx-lm's switch to a quantized cache depends on
where the switch happened, so a block is stored only where its content is canonical and a hit is
used only where mlx-lm's own cache is in exactly that state (`KVQuantization`); otherwise the
request misses and runs as mlx-lm would.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from mlx_lm.models.cache import KVCache, make_prompt_cache

from kvtool.cache import selfcheck
from kvtool.cache.extend import chain_entries, extend, quant_usable
from kvtool.cache.hit import CacheHit, CacheStats
from kvtool.config import KVToolConfig
from kvtool.disk.fsops import FileOps
from kvtool.disk.hostblock import HostBlock
from kvtool.disk.segment import FORMAT_VERSION, KVLayout
from kvtool.hashing import layout_key_of_meta
from kvtool.kv.blocks import (
    Block,
    HashFn,
    blake2b_chain,
    cache_capacity,
    chain_hashes,
    rebuild_cache,
    tail_hash,
)
from kvtool.kv.buffers import KVBuffers
from kvtool.kv.cut import patch_last_token, promote_slices, slice_blocks
from kvtool.kv.model_kv import KVGeometry, KVQuantization, library_versions, probe_layout  # noqa: F401  (re-exported)
from kvtool.kv.tree import kv_offset, leaves, sliding_windows, trim_kv
from kvtool.kv.windows import as_rotating, with_windows
from kvtool.tiers.base import ChainEntry
from kvtool.tiers.stack import ShutdownStatus, TierStack

log = logging.getLogger("kvtool")


class PrefixCache:
    """Tiered prefix cache of one model (layout), thread-compatible (one request at a time).

    Args:
        config: cache settings.
        layout: the model's per-layer KV layout (or `geometry`); None runs uncached.
        geometry: a uniform `KVGeometry` instead of `layout`.
        model_id: digest of the model's weights (see `kvtool.models.loader`).
        model_name: shown by `kvtool inspect`.
        model_class: the model's class name (part of the layout key).
        hash_fn: chain-hash function (injectable to force collisions in tests).
        fs: optional `FileOps` of the SSD tier (fault injection in tests).
        uncached_reason: why this model cannot be cached (then every fetch misses).
        quant: mlx-lm KV quantisation the caches follow (`layout` must be quantized alike).
        windows: per cache leaf (`kvtool.kv.blocks.leaves`) the sliding window of a
            `RotatingKVCache` leaf (None: other leaves); restored as `WindowedKVCache` full views.
        check_model: the mlx-lm model whose exactness `kvtool.cache.selfcheck` measures before a
            layout with sliding windows, state layers or cache lists is used (`for_model` passes
            it; None: the caller vouches for the layout).
    """

    def __init__(
        self,
        config: KVToolConfig,
        *,
        layout: KVLayout | None = None,
        geometry: KVGeometry | None = None,
        model_id: str,
        model_name: str = "",
        model_class: str = "",
        hash_fn: HashFn = blake2b_chain,
        fs: FileOps | None = None,
        uncached_reason: str | None = None,
        quant: KVQuantization | None = None,
        windows: Sequence[int | None] | None = None,
        check_model: Any = None,
    ):
        self.quant = quant
        self.windows = tuple(windows) if windows and any(w is not None for w in windows) else ()
        self.kv = layout if layout is not None else (geometry.layout() if geometry is not None else None)
        self.model_id = model_id
        self.model_name = model_name or model_id[:12]
        self.model_class = model_class
        self.hash_fn = hash_fn
        self.uncached_reason = uncached_reason if self.kv is None else None
        if self.kv is None and self.uncached_reason is None:
            self.uncached_reason = "no KV layout given"
        if self.kv is not None and (self.kv.bits, self.kv.group_size) != ((quant.bits, quant.group_size) if quant else (0, 0)):
            raise ValueError(f"KV layout {self.kv.spec} does not match the quantisation {quant}")
        self._fs = fs
        self._final_stats: dict[str, int] = {}
        self.config = config
        self.tiered: TierStack | None = None
        self.layout_key: str | None = None
        self._check_model = check_model
        self._probed = (self.kv, self.windows)  # a self-check refusal is per namespace: kept for reattach
        self.alone_exact = True  # a prompt's last token forwarded alone gets its prefill KV (measured: selfcheck)
        self._attach(config)

    @classmethod
    def for_model(cls, model, config: KVToolConfig, *, model_id: str, model_name: str = "",
                  max_kv_size: int | None = None, quant: KVQuantization | None = None,
                  **kwargs: Any) -> PrefixCache:
        """Probe `model`'s KV layout and build its prefix cache (uncached if not cacheable, or if
        the self-check of a layout that needs one fails: `kvtool.cache.selfcheck`)."""
        kv, reason = probe_layout(model, max_kv_size, quant)
        if reason is not None:
            log.warning("kvtool: running uncached: %s (a block cache of this model would give wrong KV)", reason)
        windows = sliding_windows(make_prompt_cache(model)) if kv is not None else None
        return cls(config, layout=kv, model_id=model_id, model_name=model_name,
                   model_class=type(model).__module__ + "." + type(model).__name__, uncached_reason=reason,
                   quant=quant if kv is not None else None, windows=windows, check_model=model, **kwargs)

    # ------------------------------------------------------------ lifecycle
    def layout_key_for(self, block_size: int) -> str | None:
        """The namespace blocks of `block_size` tokens live under (None if uncacheable). Pure."""
        if self.kv is None:
            return None
        return layout_key_of_meta(self._namespace_meta(block_size), FORMAT_VERSION)

    def _namespace_meta(self, block_size: int) -> dict[str, str]:
        """The namespace meta; the layout key is its digest (`kvtool.hashing.layout_key_of_meta`)."""
        kv = self._layout
        meta = {
            "model_id": self.model_id, "model_name": self.model_name, "model_class": self.model_class,
            "block_size": str(block_size), "kv_dtype": kv.dtype, "kv_layers": kv.spec,
            "libraries": library_versions(),
        }  # fmt: skip
        if self.quant is not None:
            meta["kv_quantization"] = self.quant.key_extra()
        if self.windows:
            meta["kv_windows"] = ",".join("-" if w is None else str(w) for w in self.windows)
        if str(self.config.ssd_codec) != "none":
            meta["kv_codec"] = str(self.config.ssd_codec)
        return meta

    # Typed views of the optional state, for the paths that run only with a layout (`kv`) or
    # only while the tiers are attached (`tiered` and `layout_key` are set together).
    @property
    def _layout(self) -> KVLayout:
        assert self.kv is not None, "no KV layout: uncached"
        return self.kv

    @property
    def _tier(self) -> TierStack:
        assert self.tiered is not None, "tiers not attached (uncached or closed)"
        return self.tiered

    @property
    def _key(self) -> str:
        assert self.layout_key is not None, "tiers not attached (uncached or closed)"
        return self.layout_key

    def _attach(self, config: KVToolConfig) -> None:
        self.config = config
        self.tiered = None
        self.layout_key = None
        if self.kv is None and self._probed[0] is not None:  # refused by an earlier namespace's self-check
            (self.kv, self.windows), self.uncached_reason = self._probed, None
        if self.kv is None or (not config.ssd_enabled and config.ram_bytes == 0 and not config.remote_enabled):
            return
        meta = self._namespace_meta(config.block_size)
        self.layout_key = layout_key_of_meta(meta, FORMAT_VERSION)
        self.tiered = TierStack(config, self.layout_key, meta, fs=self._fs)
        if self._check_model is not None:  # measured inexact: detached, uncached (`kvtool.cache.selfcheck.attach`)
            selfcheck.attach(self, self._check_model)

    def reconfigure(self, config: KVToolConfig) -> ShutdownStatus:
        """Drain and detach the tiers, then reattach under `config` (docs/design.md#live-reconfiguration)."""
        status = self.tiered.close() if self.tiered is not None else ShutdownStatus()
        self._attach(config)
        return status

    def flush(self) -> bool:
        """Wait until every accepted SSD write was attempted; flush the index."""
        return self.tiered.flush() if self.tiered is not None else True

    def close(self) -> ShutdownStatus:
        """Drain the writer, flush and close the index. Idempotent.

        `stats()` afterwards returns the counters as they were after the drain.
        """
        if self.tiered is None:
            return ShutdownStatus()
        status = self.tiered.close()
        self._final_stats = self.tiered.stats()
        self.tiered = None
        return status

    def __enter__(self) -> PrefixCache:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def stats(self) -> CacheStats:
        """Counters of every tier (a snapshot)."""
        return CacheStats(self.tiered.stats() if self.tiered is not None else dict(self._final_stats))

    @property
    def ssd(self):
        """The SSD store, or None (read-only use: `namespace_dir`, `disabled_reason`)."""
        return self.tiered.ssd if self.tiered is not None else None

    @property
    def namespace_dir(self):
        return self.ssd.namespace_dir if self.ssd is not None else None

    @property
    def ssd_disabled_reason(self) -> str | None:
        """Why the SSD tier is off, disabled or read-only (None if it is fully usable)."""
        if self.tiered is None:
            return self.uncached_reason
        if not self.config.ssd_enabled:
            return "ssd_enabled = false"
        ssd = self.tiered.ssd
        return ssd.disabled_reason if ssd is not None else None

    # --------------------------------------------------------------- hashing
    def hashes(self, tokens: Sequence[int] | np.ndarray) -> tuple[list[str], str | None]:
        """Chain hashes of the prompt's full blocks and its tail entry's key ([] / None uncached)."""
        if self.tiered is None:
            return [], None
        ids = np.asarray(tokens, dtype=np.int32)
        bs = self.config.block_size
        full = chain_hashes(ids, bs, self._key, self.hash_fn)
        return full, tail_hash(ids, bs, self._key, full, self.hash_fn)

    def probe(self, tokens: Sequence[int] | np.ndarray) -> int:
        """Leading prompt tokens the SSD tier holds, as `fetch` would take them from SSD (its
        blocks, its tail entry, an earlier prompt's tail entry or a sibling's common prefix):
        hashing and index queries; siblings are read and verified, nothing else is read."""
        full, tail = self.hashes(tokens)
        ssd = self.tiered.backing if self.tiered is not None else None
        if ssd is None:
            return 0
        ids = np.asarray(tokens, dtype=np.int32)
        chain = self._chain(ids, full, tail)
        rows = ssd.longest_prefix(chain, ids)
        cached = sum(r.num_tokens for r in rows)
        if len(rows) < len(chain):  # as fetch: an earlier prompt's tail entry, or a sibling's prefix
            ext = extend([ssd], chain[len(rows)], ids, hash_fn=self.hash_fn, block_size=self.config.block_size,
                         quant=self.quant, has_states=self.has_states, count=False)  # fmt: skip
            k = ext.entry.stop - ext.entry.start if ext is not None else 0
            cached += k - 1 if self.has_states and k else k  # states: the one before the tail's last token
        return cached

    # ---------------------------------------------------------------- fetch
    def fetch(self, tokens: Sequence[int] | np.ndarray, *, full_views: bool = False) -> CacheHit:
        """The longest cached prefix of a prompt as ready-to-use mlx-lm caches.

        Args:
            tokens: prompt token ids (at least one).
            full_views: sliding-window leaves as `WindowedKVCache` full views, for a caller that
                prefills the rest with kvtool's prefill and stores its blocks (`Engine`); by
                default they are mlx-lm's own `RotatingKVCache` state at the hit's end, for a
                caller that hands the cache to mlx-lm (its server, `stream_generate`).

        Returns:
            A `CacheHit`; call `release(hit)` when the request is done.

        Raises:
            ValueError: empty prompt.
        """
        ids = np.asarray(tokens, dtype=np.int32)
        if ids.size == 0:
            raise ValueError("empty prompt")
        hit = CacheHit(cache=[], prompt_tokens=int(ids.size))
        hit.hashes, hit.tail = self.hashes(ids)
        if self.tiered is None:  # the engine makes mlx-lm's own cache (or full views: `kvtool.kv.prefill.new_cache`)
            hit.remaining = ids
            return hit
        chain = self._chain(ids, hit.hashes, hit.tail)
        found = self._tier.collect(chain, ids)
        hit.held += found
        own = len(found)  # entries of this prompt's own chain
        if own < len(chain):
            chain = self._partial(ids, chain, found, hit)
        if self.has_states and found and chain[len(found) - 1][3] == ids.size and chain[len(found) - 1][0] != hit.tail:
            found = found[:-1]  # a full hit needs the state before the last token: only a tail entry has it
        if found and not quant_usable(self.quant, chain[len(found) - 1][3], ids.size):
            found = self._drop(hit, chain[len(found) - 1][3])
        self._build(ids, chain, found, hit)
        placed = hit.entries_found
        hit.entries_found = min(placed, own)  # an earlier prompt's tail is no entry of this chain
        if hit.cached_tokens and not quant_usable(self.quant, hit.cached_tokens, ids.size):
            self._drop(hit, hit.cached_tokens)  # a cut chain left a hit mlx-lm's quantized trajectory never has
        if self.windows and hit.cache:
            hit.cache = with_windows(hit.cache, self.windows)
        # A full hit re-forwards the last token (docs/design.md#full-hits-and-prompt-encoding); so does a hit ending in an earlier
        # prompt's tail entry on a model with state layers: the tail's state is the one before its
        # last token.
        if hit.cached_tokens and (hit.cached_tokens == ids.size or (self.has_states and placed > own)):
            trim_kv(hit.cache, 1)
            hit.cached_tokens -= 1
            hit.tier_tokens[found[placed - 1][0].name] -= 1
        # the entry holding a re-forwarded last token: mlx-lm's decode writes that token's KV again
        # (through rotating layers; alone, where that rounds otherwise: `alone_exact`), so the
        # cache no longer holds what was read: keep the SSD copy, promote the rest
        reforward_differs = bool(self.windows) or not self.alone_exact
        if reforward_differs and hit.promote and hit.cached_tokens < hit.promote[-1][3] + len(hit.promote[-1][2]):
            hit.promote.pop()
        if self.windows and hit.cache and not full_views:  # (the views stay for promotion at release)
            hit.views, hit.cache = hit.cache, as_rotating(hit.cache, hit.cached_tokens)
        hit.remaining = ids[hit.cached_tokens :]
        return hit

    @property
    def has_states(self) -> bool:
        """The model has state layers (`ArraysCache`): blocks carry state checkpoints."""
        return self.kv is not None and self.kv.has_states

    @staticmethod
    def state_offset(entry: tuple, tail: str | None) -> int:
        """Token offset of the state a chain entry's record holds: its end, or for a tail entry
        the token before its end (a tail is only used on a full hit, whose last token is
        re-forwarded)."""
        return entry[3] - 1 if entry[0] == tail else entry[3]

    def _drop(self, hit: CacheHit, cached: int = 0) -> list:
        """Forget what a fetch found (release its tier handles): the request runs as a miss;
        `cached` (tokens found) names why in `hit.uncached_reason` (KV quantisation)."""
        if cached and self.quant is not None:
            hit.uncached_reason = self.quant.miss_reason(cached - 1 if cached == hit.prompt_tokens else cached,
                                                         hit.prompt_tokens)
        self._tier.release(hit.held)
        hit.held, hit.promote, hit.cache, hit.tier_tokens = [], [], [], {}
        hit.entries_found = hit.cached_tokens = 0
        return []

    def _chain(self, ids: np.ndarray, full: list[str], tail: str | None) -> list[ChainEntry]:
        return chain_entries(self._key, self.config.block_size, int(ids.size), full, tail)

    def _partial(self, ids: np.ndarray, chain: list[ChainEntry], found: list, hit: CacheHit) -> list[ChainEntry]:
        """Extend a partial hit where the chain walk stopped (entry `m = len(found)`; see
        `kvtool.cache.extend`). Returns `chain` cut after entry `m`, which is replaced by what was
        found (appended to `found`), or `chain` unchanged."""
        t = self._tier
        ext = extend(t.tiers, chain[len(found)], ids, hash_fn=self.hash_fn, block_size=self.config.block_size,
                     quant=self.quant, has_states=self.has_states)  # fmt: skip
        if ext is None:
            return chain
        if ext.sibling:
            hit.tier_bytes[ext.tier.name] = hit.tier_bytes.get(ext.tier.name, 0) + ext.nbytes_read
            t.count_partial_block()
        else:
            hit.held.append((ext.tier, ext.handle))
            t.count_tail_prefix()
        found.append((ext.tier, ext.handle))
        return [*chain[: len(found) - 1], ext.entry]

    def _build(self, ids: np.ndarray, chain: list[ChainEntry], found: list, hit: CacheHit) -> None:
        kv = self._layout
        if all(tier.caps.in_memory for tier, _ in found):  # MLX blocks only: one concatenation per layer
            blocks = [b for _, b in found]
            hit.cache = rebuild_cache(blocks, kv.n_layers, cache_capacity(int(ids.size)), kv=kv) if blocks else []
            hit.entries_found = len(blocks)
            hit.cached_tokens = chain[len(blocks) - 1].stop if blocks else 0
            if blocks and all(t.name == found[0][0].name for t, _ in found):  # one tier (RAM): no per-block count
                hit.tier_tokens[found[0][0].name] = hit.cached_tokens
            else:
                for (tier, _), e in zip(found, chain):
                    hit.tier_tokens[tier.name] = hit.tier_tokens.get(tier.name, 0) + e.stop - e.start
            return
        t0 = time.perf_counter()
        buffers = KVBuffers.allocate(kv, cache_capacity(int(ids.size)), wait=False)  # overlaps header reads
        n_ok = self._tier.fill(chain, found, ids, buffers, hit, lambda lo: self._scratch(buffers, lo))
        hit.entries_found = n_ok
        hit.cached_tokens = chain[n_ok - 1].stop if n_ok else 0
        hit.cache = buffers.caches(hit.cached_tokens, state_at=chain[n_ok - 1].start if n_ok else None) if n_ok else []
        hit.ssd_load_ms = (time.perf_counter() - t0) * 1e3

    def _scratch(self, buffers: KVBuffers, lo: int) -> list:
        """[the state arrays of the entry restored at `lo`] with state layers, else []."""
        if not self.has_states:
            return []
        return [[np.array(a, copy=True) for a in buffers.state_scratch[lo]]]

    # ---------------------------------------------------------------- store
    def store(self, tokens: Sequence[int] | np.ndarray, cache: list, hit: CacheHit | None = None,
              *, persist: bool = False, states: dict[int, list] | None = None, last_kv: Sequence | None = None) -> int:
        """Hand the prompt's new full blocks and its tail entry to the tiers (prompt KV only).

        Args:
            tokens: the prompt token ids.
            cache: per-layer caches holding at least the prompt's KV (generated tokens after it
                are never stored).
            hit: the prompt's `fetch` result (its hashes are reused; entries it found are skipped).
            persist: write to SSD whatever the policy (`kvtool warm`).
            states: with state layers (`ArraysCache`), token offset -> the state arrays of every
                state layer after that many tokens (`kvtool.kv.blocks.state_arrays` snapshots taken
                while prefilling); an entry is stored only with its state (`state_offset`).
            last_kv: the prompt's last token's prefilled KV where the cache now holds mlx-lm's
                decode re-forward of it (`kvtool.kv.prefill.last_token_kv`); the entry ending there
                stores these.

        Returns:
            Entries handed over.
        """
        if self.tiered is None:
            return 0
        if self.windows and any(w is not None and not isinstance(c, KVCache) for c, w in zip(leaves(cache), self.windows)):
            log.warning("kvtool: not storing: sliding-window layers must be prefilled into full views "
                        "(kvtool.kv.prefill.new_cache(model, windows), as Engine does), not mlx-lm's RotatingKVCache")
            return 0
        ids = np.asarray(tokens, dtype=np.int32)
        full, tail = (hit.hashes, hit.tail) if hit is not None else self.hashes(ids)
        chain = self._chain(ids, full, tail)
        start = hit.entries_found if hit is not None else 0
        held = kv_offset(cache)
        if held is not None and held < ids.size:
            chain = [e for e in chain if e[3] <= held]
        new = chain[start:]
        if self.quant is not None:  # only canonical content (see KVQuantization)
            limit = self.quant.storable_until(int(ids.size))
            new = [e for e in new if e[3] <= limit or e[0] == tail]
        span_states = None
        if self.has_states:
            states = states or {}
            keep = []
            for e in new:
                if self.state_offset(e, tail) not in states:
                    break
                keep.append(e)
            new = keep
            span_states = [states[self.state_offset(e, tail)] for e in new]
        if not new:
            return 0
        blocks = slice_blocks(cache, ids, new, self.kv, span_states)
        if last_kv:
            patch_last_token(blocks, new, int(ids.size), last_kv)
        elif not self.alone_exact:  # its last token's KV is mlx-lm's decode re-forward: not what a prefill gives
            blocks = [b for b, e in zip(blocks, new) if e[3] != ids.size]
        (self.tiered.persist if persist else self.tiered.insert)(blocks)
        return len(blocks)

    def persist_found(self, hit: CacheHit) -> None:
        """Make sure the RAM blocks a hit used are on SSD too (`kvtool warm` under evict_only)."""
        blocks = [b for _, b in hit.held if isinstance(b, Block)]
        if self.tiered is not None and blocks:
            self.tiered.persist(blocks)

    def release(self, hit: CacheHit) -> None:
        """Release the hit's tier handles (RAM unpins); its blocks from lower tiers enter the
        tiers above them that take promotions (`TierStack.promote`: RAM as views of the cache,
        SSD from those views with `remote_promote`)."""
        if self.tiered is None:
            return
        if hit.promote and (hit.views or hit.cache):
            try:
                blocks = promote_slices(hit.views or hit.cache, hit.promote, self.kv)
                self.tiered.promote(blocks, [hit.sources[b.block_hash] for b in blocks])
            except Exception:  # promotion is an optimisation: never fail the request
                log.exception("promotion of %d block(s) failed", len(hit.promote))
        hit.promote, hit.views, hit.sources = [], [], {}
        self.tiered.release(hit.held)
        hit.held = []


__all__ = ["PrefixCache", "CacheHit", "CacheStats", "KVGeometry", "KVLayout", "KVQuantization", "probe_layout",
           "library_versions",
           "HostBlock", "Block", "KVCache"]
