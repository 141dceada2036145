"""Prometheus metrics of kvtool's cache: one place for every metric name, type and help text.

Nothing is counted twice: at scrape time a custom collector (`CacheCollector`) builds the metrics
from the counters kvtool keeps anyway (`PrefixCache.stats()`: the `kv_*`, `ssd_*`, `writer_*` and
`remote_*` keys, and the cumulative request totals of `KVToolPromptCache` or of a run's records).
Only distributions, which no counter holds, are accumulated here in `Histogram`s: the restore
latency, each request's prompt and cached tokens, and for `kvtool serve` its time to first token
and duration. Each server or run has its own `CollectorRegistry` (`CacheMetrics`), never the global one.

    metrics = CacheMetrics(lambda: (prefix_cache.stats().to_dict(), totals))
    metrics.observe(record)              # per request: restore time, prompt and cached tokens
    metrics.observe_timing(ttft_s, total_s)  # per served request: TTFT and duration (seconds)
    metrics.text()                       # the text exposition format (GET /metrics)
    metrics.write("/var/lib/node_exporter/kvtool.prom")   # atomic: temp file + rename

A `kvtool serve` SIGHUP reattaches the tiers with fresh counters: the tier metrics then restart
from 0 (a counter reset, which `rate()` and `increase()` handle); the request totals go on.

Names follow Prometheus conventions (`_total`, `_bytes`, `_seconds`); the tier is a label
(`tier="ram" | "pending" | "ssd" | "remote"`). `remote_*` stats keys no metric reads (a newer
remote tier) are exported as untyped `kvtool_remote_<rest>`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, generate_latest, write_to_textfile
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric, UnknownMetricFamily
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

PREFIX = "kvtool"
# SSD / remote restore of one request: from well under a millisecond (a few blocks in the page
# cache) to seconds (tens of thousands of tokens from a cold disk).
RESTORE_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# Time to first token: a RAM hit on a small model (milliseconds) to a long cold prefill (a minute).
TTFT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
# Whole request, arrival to last token: adds the decode of up to thousands of tokens.
DURATION_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)
# Prompt and cached tokens of one request: powers of two, 16 tokens (one block) to 256k.
TOKEN_BUCKETS = tuple(float(2**k) for k in range(4, 19))

# Cumulative request totals (tokens, requests), summed over the per-request records.
REQUEST_TOTAL_KEYS = ("requests", "prompt_tokens", "cached_tokens", "ram_hit_tokens", "ssd_hit_tokens",
                      "remote_hit_tokens", "prefill_tokens")  # fmt: skip

SnapshotFn = Callable[[], tuple[Mapping[str, Any], Mapping[str, Any]]]


@dataclass(frozen=True)
class Spec:
    """One metric family: its name (without the `kvtool_` prefix and, for counters, without
    `_total`), type, help text, label names and where each labelled sample comes from.

    Attributes:
        sources: label values (one per label name) -> the stats key holding the value. A
            missing key is no sample (so a tier that is not configured has no series).
    """

    name: str
    kind: str  # "counter" | "gauge"
    help: str
    labels: tuple[str, ...] = ()
    sources: tuple[tuple[tuple[str, ...], str], ...] = ()


def _spec(kind: str, name: str, help_: str, labels: tuple[str, ...] = (), key: str | None = None,
          **sources: str) -> Spec:
    """A metric read from `key` (no labels), or from `sources`: label values joined by '__' -> stats key."""
    pairs = (((), key),) if key is not None else tuple((tuple(k.split("__")), v) for k, v in sources.items())
    return Spec(name, kind, help_, labels, pairs)


_c, _g = partial(_spec, "counter"), partial(_spec, "gauge")


T = ("tier",)
# Request totals (tokens) from the per-request records.
REQUEST_METRICS: tuple[Spec, ...] = (
    _c("requests", "Requests looked up in the cache.", key="requests"),
    _c("prompt_tokens", "Prompt tokens of those requests (tokens).", key="prompt_tokens"),
    _c("hit_tokens", "Prompt tokens whose KV came from this tier instead of a prefill (tokens).", T,
       ram="ram_hit_tokens", ssd="ssd_hit_tokens", remote="remote_hit_tokens"),
    _c("prefill_tokens", "Prompt tokens computed by prefill (tokens).", key="prefill_tokens"),
)
# Tier counters and gauges from `PrefixCache.stats()`.
STATS_METRICS: tuple[Spec, ...] = (
    _c("lookup_hit_entries", "Chain entries (blocks, tail entries) found by cache lookups, all tiers.",
       key="kv_lookup_hits"),
    _c("lookup_misses", "Cache lookups that found nothing in any tier.", key="kv_lookup_miss"),
    _c("tier_lookups", "Lookups that reached this tier (remote: calls that reached the server).", T,
       remote="remote_lookups"),
    _c("hit_blocks", "Blocks read from this tier (pending: the SSD writer's queue).", T,
       pending="kv_pending_hits", ssd="ssd_load_hits", remote="remote_hit_blocks"),
    _c("tier_misses", "Blocks looked up in this tier and not found.", T, ssd="ssd_load_miss"),
    _c("tail_prefix_hits", "Lookups extended with an earlier prompt's tail entry.", key="kv_tail_prefix_hits"),
    _c("partial_block_hits", "Lookups extended with a sibling block's common token prefix.",
       key="kv_partial_block_hits"),
    _c("promotions", "Blocks restored from SSD or the remote tier and put into RAM.", key="kv_promote_hits"),
    _c("read_bytes", "Bytes read from this tier (bytes).", T, ssd="ssd_bytes_read", remote="remote_bytes_read"),
    _c("written_bytes", "Bytes written to this tier (segment files; remote: values stored) (bytes).", T,
       ssd="ssd_bytes_written", remote="remote_bytes_written"),
    _c("stored_blocks", "Blocks stored in this tier.", T, ram="kv_ram_inserts", ssd="ssd_save_success",
       remote="remote_writer_stored"),
    _c("segments_written", "SSD segment files written.", key="ssd_segments_written"),
    _c("write_dedup", "Writes skipped because the block was stored already.", T, ssd="writer_dedup",
       remote="remote_put_exists"),
    _c("enqueued_blocks", "Blocks the SSD writer accepted.", key="writer_enqueue_total"),
    _c("dropped_writes", "Blocks that never reached the tier, by reason (shed: a full writer queue; rejected: "
       "refused by the writer; failed: the write failed after its retries; over_budget: the SSD byte budget had "
       "no room for their segment, not retried; remote: breaker, failed call, full or stopped writer).",
       ("tier", "reason"),
       ssd__shed="writer_shed_blocks", ssd__rejected="writer_enqueue_rejected", ssd__failed="writer_save_fail",
       ssd__over_budget="writer_budget_refused", remote__dropped="remote_dropped_writes"),
    _c("shed_bytes", "Bytes of the blocks shed by a full SSD writer queue (bytes).", T, ssd="writer_shed_bytes"),
    _c("write_retries", "Write attempts retried by the SSD writer.", key="writer_retry_attempts"),
    _c("backpressure_waits", "Times a request waited for room in the SSD writer queue.",
       key="writer_backpressure_waits"),
    _c("evictions", "Blocks evicted from this tier (ssd: by the byte budget, ssd_max_bytes).", T,
       ram="kv_ram_evictions", ssd="ssd_budget_evicted_blocks"),
    _c("evicted_bytes", "Bytes of the blocks evicted from this tier (ssd: segment files) (bytes).", T,
       ram="kv_ram_evicted_bytes", ssd="ssd_budget_evicted_bytes"),
    _c("evicted_segments", "SSD segment files evicted by the byte budget (ssd_max_bytes).",
       key="ssd_budget_evictions"),
    _c("ssd_budget_refused_blocks", "Blocks of SSD segment writes refused because they did not fit under the byte "
       "budget even after evicting every unprotected segment (not stored, never retried; not a failed write).",
       key="ssd_budget_refused"),
    _c("evict_to_ssd", "RAM evictions written to SSD first (policy evict_only).", key="kv_evict_to_ssd"),
    _c("corrupt_records", "Records that failed verification (checksum, token ids, layout): a miss, removed.", T,
       ssd="ssd_load_corrupt", remote="remote_corrupt"),
    _c("hash_collisions", "Chain-hash collisions detected (a stored block's token ids differ): a miss.",
       ("tier", "op"), ssd__load="ssd_hash_collision_detected", ssd__save="writer_collision"),
    _c("ram_token_mismatches", "RAM blocks whose token ids differed from the prompt's (a miss).",
       key="kv_ram_token_mismatch"),
    _c("load_failures", "Block reads that failed, by reason (missing: file gone; fail: I/O or index error).",
       ("tier", "reason"), ssd__missing="ssd_load_missing", ssd__fail="ssd_load_fail"),
    _c("errors", "Failed calls of this tier (SSD: index errors; remote: server errors).", T,
       ssd="ssd_index_errors", remote="remote_errors"),
    _c("breaker_trips", "Times the remote tier's circuit breaker opened.", key="remote_breaker_trips"),
    _g("writer_queue_bytes", "Bytes queued in this tier's writer, not yet written (bytes).", T,
       ssd="writer_pending_bytes", remote="remote_writer_queue_bytes"),
    _g("writer_queue_blocks", "Blocks queued in this tier's writer.", T, ssd="writer_queue_depth",
       remote="remote_writer_queue_blocks"),
    _g("writer_queue_peak_bytes", "Highest bytes queued plus being written in the SSD writer (bytes).",
       key="writer_queue_peak_bytes"),
    _g("ram_blocks", "Blocks held in the RAM tier.", key="kv_ram_blocks"),
    _g("ram_bytes", "Bytes held in the RAM tier (bytes).", key="kv_ram_bytes"),
    _g("remote_breaker_open", "1 while the remote tier's circuit breaker is open.", key="remote_breaker_open"),
)
RESTORE_HELP = "Wall time restoring one request's cached KV from this tier (seconds)."
# The per-request histograms: name (with the prefix), help, buckets.
HISTOGRAMS: dict[str, tuple[str, str, tuple[float, ...]]] = {
    "ttft": (f"{PREFIX}_time_to_first_token_seconds",
             "Time from a completion request's arrival to its first generated token (seconds).", TTFT_BUCKETS_S),
    "duration": (f"{PREFIX}_request_duration_seconds",
                 "Time from a completion request's arrival to its last generated token (seconds).",
                 DURATION_BUCKETS_S),
    "prompt": (f"{PREFIX}_request_prompt_tokens", "Prompt tokens of one request (tokens).", TOKEN_BUCKETS),
    "cached": (f"{PREFIX}_request_cached_tokens",
               "Prompt tokens of one request whose KV came from the cache, any tier (tokens).", TOKEN_BUCKETS),
}


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _family(spec: Spec, values: Mapping[str, Any]) -> Metric | None:
    name = f"{PREFIX}_{spec.name}"
    fam: Any = (CounterMetricFamily(name, spec.help, labels=spec.labels) if spec.kind == "counter"
                else GaugeMetricFamily(name, spec.help, labels=spec.labels))  # fmt: skip
    for label_values, key in spec.sources:
        value = _number(values.get(key))
        if value is not None:
            fam.add_metric(list(label_values), value)
    return fam if fam.samples else None


def build_families(stats: Mapping[str, Any], totals: Mapping[str, Any]) -> list[Metric]:
    """The metric families of one snapshot.

    Args:
        stats: `PrefixCache.stats().to_dict()` (flat `kv_*`, `ssd_*`, `writer_*`, `remote_*` keys).
        totals: cumulative request totals (`REQUEST_TOTAL_KEYS`; see `request_totals`).
    """
    if not any(key.startswith("remote_") for key in stats):  # no remote tier: no remote series
        totals = {k: v for k, v in totals.items() if not k.startswith("remote_")}
    out = [f for f in (_family(s, totals) for s in REQUEST_METRICS) if f is not None]
    out += [f for f in (_family(s, stats) for s in STATS_METRICS) if f is not None]
    known = {key for spec in STATS_METRICS for _, key in spec.sources}
    for key in sorted(stats):
        value = _number(stats[key])
        if key.startswith("remote_") and key not in known and value is not None:
            fam = UnknownMetricFamily(f"{PREFIX}_{key}", f"The remote tier's {key!r} counter, as kvtool reports it.")
            fam.add_metric([], value)
            out.append(fam)
    return out


def request_totals(records: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """`REQUEST_TOTAL_KEYS` summed over per-request records (`RequestResult.to_dict()`,
    `RequestRecord.to_dict()`, bench rows): `requests` counts them, `prompt_tokens` is
    `cached_tokens + prefill_tokens` where a record lacks it; missing keys count 0."""
    out = dict.fromkeys(REQUEST_TOTAL_KEYS, 0)
    for rec in records:
        out["requests"] += 1
        for key in REQUEST_TOTAL_KEYS[1:]:
            value = _number(rec.get(key))
            if value is None and key == "prompt_tokens":
                value = (_number(rec.get("cached_tokens")) or 0) + (_number(rec.get("prefill_tokens")) or 0)
            out[key] += int(value or 0)
    return out


class CacheCollector(Collector):
    """prometheus_client collector: at each scrape, `snapshot()` -> `(stats, totals)` -> families.

    A snapshot that raises is logged by the caller's scrape as an error response; kvtool's own
    snapshots (`KVToolPromptCache.stats`, a finished run's dicts) do not raise.
    """

    def __init__(self, snapshot: SnapshotFn):
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        stats, totals = self._snapshot()
        yield from build_families(stats, totals)


class CacheMetrics:
    """The metrics of one server or run: a private registry with a `CacheCollector`, the
    restore-latency histogram and the per-request histograms (`HISTOGRAMS`).

    Args:
        snapshot: returns `(stats, totals)` for `build_families`, called at every scrape/write.
    """

    def __init__(self, snapshot: SnapshotFn):
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(CacheCollector(snapshot))
        self.restore = Histogram(f"{PREFIX}_restore_seconds", RESTORE_HELP, ("tier",), registry=self.registry,
                                 buckets=RESTORE_BUCKETS_S)  # fmt: skip
        self.restore.labels(tier="ssd")  # a series from the start, so rate() has a zero to begin with
        self.per_request = {key: Histogram(name, help_, registry=self.registry, buckets=buckets)
                            for key, (name, help_, buckets) in HISTOGRAMS.items()}  # fmt: skip
        self._lock = threading.Lock()

    def observe(self, record: Mapping[str, Any] | Any) -> None:
        """Add one request's record (`RequestRecord`, or its dict) to the histograms: its
        `prompt_tokens` and `cached_tokens` (tokens; a missing key is not observed), and its
        restore times (ms in the record): `ssd_load_ms` when it loaded from SSD
        (`ssd_hit_tokens > 0`), `remote_load_ms` when it has one and loaded from the remote tier."""
        get = record.get if isinstance(record, Mapping) else (lambda k, d=None: getattr(record, k, d))
        for key, field in (("prompt", "prompt_tokens"), ("cached", "cached_tokens")):
            tokens = _number(get(field))
            if tokens is not None:
                self.per_request[key].observe(tokens)
        for tier in ("ssd", "remote"):
            tokens, ms = _number(get(f"{tier}_hit_tokens")), _number(get(f"{tier}_load_ms"))
            if tokens and ms is not None:
                self.restore.labels(tier=tier).observe(ms / 1e3)

    def observe_timing(self, ttft_s: float | None, duration_s: float | None) -> None:
        """Add one served request's time to first token and end-to-end duration (seconds, from
        its arrival; None: not known, e.g. no token was generated) to their histograms."""
        for key, seconds in (("ttft", ttft_s), ("duration", duration_s)):
            if seconds is not None:
                self.per_request[key].observe(max(0.0, float(seconds)))

    def text(self) -> bytes:
        """The text exposition format (0.0.4) of every metric (UTF-8)."""
        with self._lock:
            return generate_latest(self.registry)

    def encode(self, accept: str | None) -> tuple[bytes, str]:
        """(body, Content-Type) for an HTTP scrape with this `Accept` header: the text format, or
        OpenMetrics when the scraper asks for it (prometheus_client's negotiation)."""
        encoder, content_type = choose_encoder(accept or "")
        with self._lock:
            return encoder(self.registry), content_type

    def write(self, path: str | Path) -> None:
        """Write the text format to `path` atomically (a temp file beside it, then a rename).

        Raises:
            OSError: the directory is missing or not writable.
        """
        with self._lock:
            write_to_textfile(str(path), self.registry)


def metrics_of_run(stats: Mapping[str, Any], records: Iterable[Mapping[str, Any]]) -> CacheMetrics:
    """The metrics of a finished run (`serve-once`, `bench`): final `stats` and its per-request
    `records` (totals, the restore histogram, the prompt and cached tokens histograms, and the
    time to first token of records with a `ttft_ms` > 0; no request duration)."""
    records = list(records)
    totals = request_totals(records)
    metrics = CacheMetrics(lambda: (stats, totals))
    for rec in records:
        metrics.observe(rec)
        ttft_ms = _number(rec.get("ttft_ms"))
        if ttft_ms:
            metrics.observe_timing(ttft_ms / 1e3, None)
    return metrics


__all__ = ["CacheCollector", "CacheMetrics", "HISTOGRAMS", "REQUEST_METRICS", "REQUEST_TOTAL_KEYS", "STATS_METRICS",
           "Spec", "build_families", "metrics_of_run", "request_totals"]
