"""Benchmark metrics: the documented columns of `requests.csv` / `cells.csv` and the per-cell
aggregation (pandas).

A *cell run* is one (workload, cell, repeat); a row of `cells.csv` aggregates the repeats of one
(workload, cell). Latency and hit-rate columns are computed over the workload's *measured* requests
(e.g. the queries of `long-doc-qa`, the replay of `restart`, see
`kvtool.bench.workloads.MEASURED_PHASES`); work columns (prefill saved, writes) over all requests.

Repeats: every per-request statistic (TTFT p50/p95/p99/mean, prefill, decode, write path, SSD
load) is computed per cell run first; the `cells.csv` value is the **median over the repeats** and,
for the metrics in `SPREAD_METRICS`, `<metric>_min` / `<metric>_max` give the range over the
repeats and `<metric>_lo` / `<metric>_hi` the 95 % percentile-bootstrap interval of that median
(`kvtool.bench.loadstats.bootstrap_ci`; the interval the report's winner rule uses). Hit rates and
token counts are pooled over the repeats (the workload is identical in every repeat).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import pandas as pd

from kvtool.bench.loadstats import bootstrap_ci, percentile

ID_COLUMNS: list[tuple[str, str]] = [
    ("workload", "workload name (shared-prefix, multi-turn, long-doc-qa, restart, ram-pressure)"),
    ("cell", "cell name: `<ssd_policy>/<writer>/<ssd_durability>[/bs<block_size>][/ram<ram_bytes>][/remote-<remote_policy>]` or a baseline"),
    ("kind", "`kvtool`, `no-cache` or `mlx-lm-prompt-cache`"),
    ("ssd_policy", "evict_only | write_through (empty for baselines)"),
    ("writer", "sync | async (empty for baselines)"),
    ("ssd_durability", "best_effort | persistent | durable (empty for baselines)"),
    ("block_size", "tokens per block"),
    ("ram_bytes", "RAM tier budget (bytes; 0 for baselines)"),
    ("remote_policy", "off | write_through | on_evict: the remote tier (empty for baselines)"),
]

REQUEST_COLUMNS: list[tuple[str, str]] = ID_COLUMNS + [
    ("repeat", "repeat index (0-based); every repeat starts from an empty cache directory"),
    ("request", "request index within the workload (0-based)"),
    ("phase", "warmup | populate | query | turn | replay"),
    ("group", "document / conversation / prompt the request belongs to"),
    ("measured", "True if the request counts for the cell's latency and hit-rate columns"),
    ("prompt_tokens", "prompt length (tokens)"),
    ("cached_tokens", "prompt tokens reused from the cache (tokens)"),
    ("ram_hit_tokens", "cached tokens found in the RAM tier (tokens)"),
    ("ssd_hit_tokens", "cached tokens loaded from SSD (tokens; prompt-cache file for the mlx-lm baseline)"),
    ("remote_hit_tokens", "cached tokens read from the remote tier (tokens)"),
    ("prefill_tokens", "prompt tokens computed by prefill (tokens)"),
    ("generated_tokens", "decoded tokens (tokens)"),
    ("ttft_ms", "time to first token, from the request start (ms)"),
    ("prefill_ms", "time spent in prefill (ms)"),
    ("decode_tokens_per_s", "decode speed after the first token (tokens/s)"),
    ("ssd_load_ms", "time loading blocks (or the prompt-cache file) from SSD (ms)"),
    ("ssd_bytes_read", "bytes read from SSD (bytes)"),
    ("write_path_ms", "time the request thread spent on cache writes (ms)"),
    ("blocks_written", "new blocks (and tail entry) of the request that reached the SSD; with the async writer, those it accepted (blocks)"),
    ("writer_queue_depth", "async writer queue depth at the end of the request (blocks)"),
    ("backpressure_events", "times the request met a full writer queue (events)"),
]

# Per-cell-run statistics whose range over the repeats is reported as `<name>_min` / `<name>_max`,
# and the 95 % bootstrap interval of their median as `<name>_lo` / `<name>_hi`.
SPREAD_METRICS: tuple[str, ...] = (
    "ttft_p50_ms", "ttft_p95_ms", "prefill_ms_mean", "decode_tokens_per_s", "hit_rate", "ssd_load_ms_total",
    "write_path_ms_mean",
)
_REP = "per repeat, median over the repeats"


def _with_spread(columns: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Insert `<name>_min` / `<name>_max` after every column named in `SPREAD_METRICS`."""
    out = []
    for name, doc in columns:
        out.append((name, doc))
        if name in SPREAD_METRICS:
            unit = next((f" {u}" for u in ("(ms)", "(tokens/s)") if doc.endswith(u)), "")
            out.append((f"{name}_min", f"smallest per-repeat `{name}` over the repeats{unit}"))
            out.append((f"{name}_max", f"largest per-repeat `{name}` over the repeats{unit}"))
            out.append((f"{name}_lo", f"95 % bootstrap interval of the median `{name}`, lower bound{unit}"))
            out.append((f"{name}_hi", f"95 % bootstrap interval of the median `{name}`, upper bound{unit}"))
    return out


CELL_COLUMNS: list[tuple[str, str]] = ID_COLUMNS + _with_spread([
    ("repeats", "cell runs aggregated in this row"),
    ("requests", "measured requests over all repeats"),
    ("ttft_p50_ms", f"median TTFT of the measured requests, {_REP} (ms)"),
    ("ttft_p95_ms", f"95th percentile TTFT, {_REP} (ms)"),
    ("ttft_p99_ms", f"99th percentile TTFT, {_REP} (ms)"),
    ("ttft_mean_ms", f"mean TTFT, {_REP} (ms)"),
    ("prefill_ms_mean", f"mean prefill time of the measured requests, {_REP} (ms)"),
    ("decode_tokens_per_s", f"mean decode speed, {_REP} (tokens/s)"),
    ("ram_hit_rate", "RAM hit tokens / prompt tokens of the measured requests (all repeats pooled)"),
    ("ssd_hit_rate", "SSD hit tokens / prompt tokens of the measured requests (all repeats pooled)"),
    ("remote_hit_rate", "remote hit tokens / prompt tokens of the measured requests (all repeats pooled)"),
    ("hit_rate", "cached tokens / prompt tokens of the measured requests (all repeats pooled)"),
    ("prefill_saved_pct", "100 x (1 - prefill tokens / prompt tokens) over all requests (%)"),
    ("ssd_load_ms_total", "SSD load time summed over all requests of a repeat, median over the repeats (ms)"),
    ("ssd_bytes_read", "bytes read from SSD over all requests, mean per repeat (bytes)"),
    ("write_path_ms_mean", f"mean request-thread write time per request, all requests, {_REP} (ms)"),
    ("write_path_ms_p95", f"95th percentile request-thread write time, {_REP} (ms)"),
    ("blocks_written", "new blocks written to the SSD (async writer: accepted), mean per repeat (blocks)"),
    ("writer_queue_depth_max", "largest writer queue depth seen at a request end (blocks)"),
    ("backpressure_events", "writer backpressure events, mean per repeat (events)"),
    ("bytes_written", "bytes on disk in the cell's cache directory after it ran, mean per repeat (bytes)"),
    ("tokens_stored", "tokens held by the stored blocks / prompt-cache files, mean per repeat (tokens)"),
    ("bytes_per_cached_token", "bytes_written / tokens_stored (bytes/token); prompt-cache files repeat shared prefixes"),
    ("write_amplification", "bytes_per_cached_token / raw KV bytes per token (1.0 = no overhead)"),
    ("ttft_gain", "long-doc-qa only: mean warm-up TTFT / mean query TTFT (all repeats pooled)"),
    ("ttft_vs_no_cache", "no-cache ttft_p50_ms / this cell's ttft_p50_ms (speed-up, > 1 is faster)"),
    ("ttft_vs_mlxlm", "mlx-lm-prompt-cache ttft_p50_ms / this cell's ttft_p50_ms (speed-up)"),
    ("shutdown_clean", "every tier shutdown of the cell (restarts, end of cell) was clean"),
    ("drain_verified", "after the end-of-cell drain, every indexed block had its file and vice versa"),
    ("page_cache_dropped", "page cache of the block files dropped before cold reads (empty: not needed)"),
    ("wall_s", "wall time per repeat (s)"),
])

REQUEST_COLUMN_NAMES = [name for name, _ in REQUEST_COLUMNS]
CELL_COLUMN_NAMES = [name for name, _ in CELL_COLUMNS]
ID_COLUMN_NAMES = [name for name, _ in ID_COLUMNS]

_RESULT_FIELDS = [name for name in REQUEST_COLUMN_NAMES[REQUEST_COLUMN_NAMES.index("prompt_tokens"):]]


def request_row(ids: dict[str, Any], result: Any) -> dict[str, Any]:
    """One `requests.csv` row from the identifying columns and a `RequestResult`-like object.

    Args:
        ids: the ID columns plus repeat, request, phase, group, measured.
        result: anything with the `RequestResult` field names (missing fields become NaN).
    """
    row = dict(ids)
    for name in _RESULT_FIELDS:
        row[name] = getattr(result, name, np.nan)
    return row


def requests_frame(rows: Iterable[dict[str, Any]]) -> pd.DataFrame:
    """`requests.csv` as a DataFrame with the documented columns in order."""
    return pd.DataFrame(list(rows), columns=REQUEST_COLUMN_NAMES)


def _ratio(num: pd.Series, den: pd.Series) -> pd.Series:
    return num.astype(float) / den.astype(float).replace(0, np.nan)


def aggregate_cells(requests: pd.DataFrame, runs: pd.DataFrame, kv_bytes_per_token: int) -> pd.DataFrame:
    """Aggregate per-request rows and per-cell-run facts into `cells.csv` rows.

    Args:
        requests: `requests.csv` rows.
        runs: one row per cell run: ID columns, `repeat`, `bytes_written`, `tokens_stored`,
            `shutdown_clean`, `drain_verified`, `page_cache_dropped`, `wall_s`.
        kv_bytes_per_token: raw KV bytes of one token, all layers (for `write_amplification`).

    Returns:
        One row per (workload, cell) with `CELL_COLUMNS`, in the order the cells ran.
    """
    keys = ["workload", "cell"]
    rkeys = keys + ["repeat"]
    order = requests[keys].drop_duplicates()
    ids = requests.groupby(keys, sort=False)[ID_COLUMN_NAMES[2:]].first()
    measured = requests[requests["measured"].astype(bool)]
    mg = measured.groupby(keys, sort=False)
    ag = requests.groupby(keys, sort=False)
    per_repeat = requests.groupby(rkeys, sort=False).sum(numeric_only=True).groupby(keys, sort=False)
    out = ids.copy()
    out["repeats"] = requests.groupby(keys, sort=False)["repeat"].nunique()
    out["requests"] = mg.size()
    stats = repeat_stats(requests)
    across = stats.groupby(keys, sort=False)
    for name in _REPEAT_STATS:
        out[name] = across[name].median()
    for name in SPREAD_METRICS:
        out[f"{name}_min"] = across[name].min()
        out[f"{name}_max"] = across[name].max()
        interval = across[name].agg(lambda s: bootstrap_ci(s, median=True))
        out[f"{name}_lo"] = interval.map(lambda iv: iv.lo)
        out[f"{name}_hi"] = interval.map(lambda iv: iv.hi)
    msum = mg[["prompt_tokens", "cached_tokens", "ram_hit_tokens", "ssd_hit_tokens", "remote_hit_tokens"]].sum()
    out["ram_hit_rate"] = _ratio(msum["ram_hit_tokens"], msum["prompt_tokens"])
    out["ssd_hit_rate"] = _ratio(msum["ssd_hit_tokens"], msum["prompt_tokens"])
    out["remote_hit_rate"] = _ratio(msum["remote_hit_tokens"], msum["prompt_tokens"])
    out["hit_rate"] = _ratio(msum["cached_tokens"], msum["prompt_tokens"])
    asum = ag[["prompt_tokens", "prefill_tokens"]].sum()
    out["prefill_saved_pct"] = 100.0 * (1.0 - _ratio(asum["prefill_tokens"], asum["prompt_tokens"]))
    for name in ("ssd_bytes_read", "blocks_written", "backpressure_events"):
        out[name] = per_repeat[name].mean()
    out["writer_queue_depth_max"] = ag["writer_queue_depth"].max()
    out = out.join(_run_facts(runs, keys))
    out["bytes_per_cached_token"] = _ratio(out["bytes_written"], out["tokens_stored"])
    out["write_amplification"] = out["bytes_per_cached_token"] / kv_bytes_per_token if kv_bytes_per_token else np.nan
    out["ttft_gain"] = _ttft_gain(requests, keys)
    out = out.reset_index()
    out = _baseline_ratios(out)
    out = order.merge(out, on=keys, how="left")
    return out.reindex(columns=CELL_COLUMN_NAMES)


# Statistics computed per cell run (workload, cell, repeat); cells.csv holds their median.
_REPEAT_STATS = (
    "ttft_p50_ms", "ttft_p95_ms", "ttft_p99_ms", "ttft_mean_ms", "prefill_ms_mean", "decode_tokens_per_s",
    "hit_rate", "ssd_load_ms_total", "write_path_ms_mean", "write_path_ms_p95",
)


def repeat_stats(requests: pd.DataFrame) -> pd.DataFrame:
    """One row per cell run (workload, cell, repeat) with the per-repeat statistics.

    Latency and hit-rate statistics use the measured requests, SSD load and write statistics all
    requests (as in `cells.csv`). A cell run without measured requests has NaN latencies.
    """
    rkeys = ["workload", "cell", "repeat"]
    out = pd.DataFrame(index=pd.MultiIndex.from_frame(requests[rkeys].drop_duplicates()))
    mg = requests[requests["measured"].astype(bool)].groupby(rkeys, sort=False)
    ag = requests.groupby(rkeys, sort=False)
    out["ttft_p50_ms"] = mg["ttft_ms"].median()
    out["ttft_p95_ms"] = mg["ttft_ms"].agg(lambda s: percentile(s, 95))
    out["ttft_p99_ms"] = mg["ttft_ms"].agg(lambda s: percentile(s, 99))
    out["ttft_mean_ms"] = mg["ttft_ms"].mean()
    out["prefill_ms_mean"] = mg["prefill_ms"].mean()
    out["decode_tokens_per_s"] = mg["decode_tokens_per_s"].mean()
    msum = mg[["prompt_tokens", "cached_tokens"]].sum()
    out["hit_rate"] = _ratio(msum["cached_tokens"], msum["prompt_tokens"])
    out["ssd_load_ms_total"] = ag["ssd_load_ms"].sum()
    out["write_path_ms_mean"] = ag["write_path_ms"].mean()
    out["write_path_ms_p95"] = ag["write_path_ms"].agg(lambda s: percentile(s, 95))
    return out.reset_index()


def _run_facts(runs: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    g = runs.groupby(keys, sort=False)
    facts = pd.DataFrame(index=g.size().index)
    for name in ("bytes_written", "tokens_stored", "wall_s"):
        facts[name] = g[name].mean()
    for name in ("shutdown_clean", "drain_verified", "page_cache_dropped"):
        # all() over the repeats; a cell where the fact does not apply keeps None
        facts[name] = g[name].agg(lambda s: None if s.isna().all() else bool(s.dropna().astype(bool).all()))
    return facts


def _ttft_gain(requests: pd.DataFrame, keys: list[str]) -> pd.Series:
    docqa = requests[requests["workload"] == "long-doc-qa"]
    if docqa.empty:
        return pd.Series(dtype=float)
    by_phase = docqa.groupby(keys + ["phase"], sort=False)["ttft_ms"].mean().unstack("phase")
    if "warmup" not in by_phase or "query" not in by_phase:
        return pd.Series(dtype=float)
    return _ratio(by_phase["warmup"], by_phase["query"])


def _baseline_ratios(cells: pd.DataFrame) -> pd.DataFrame:
    for column, kind in (("ttft_vs_no_cache", "no-cache"), ("ttft_vs_mlxlm", "mlx-lm-prompt-cache")):
        base = cells[cells["kind"] == kind].set_index("workload")["ttft_p50_ms"]
        cells[column] = _ratio(cells["workload"].map(base), cells["ttft_p50_ms"])
    return cells
