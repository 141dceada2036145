"""Statistics of the load benchmark: per-batch figures, bootstrap intervals over repeats, verdicts.

A *batch* is one run of one workload on one server at one client count (one repeat); a *cell*
is (workload, server, clients) over its repeats.

Per batch (`batch_figures`, over the measured requests that succeeded): TTFT and latency
percentiles (`numpy.percentile`, default `method="linear"`: Hyndman & Fan's definition 7, linear
interpolation between the closest ranks; ms); requests/s and prompt tokens/s over the wall time of
the measured phases; `hit_rate` = summed `cached_tokens` / summed `prompt_tokens` as the server
reported them (`cached_tokens_per_request`: their mean, tokens); `hit_rate_ram` / `hit_rate_ssd`:
kvtool's RAM / SSD hit tokens (`GET /kvtool/stats`) over its prompt tokens.

Per cell (`bootstrap_ci`): the point estimate of a figure is the **mean over the repeats** of
the per-batch values, with a 95 % **percentile bootstrap** confidence interval: resample the
repeats with replacement `N_RESAMPLES` times with `numpy.random.default_rng(BOOTSTRAP_SEED)`,
take the mean of each resample, and report the 2.5th and 97.5th percentiles of those means.
Method: B. Efron and R. J. Tibshirani, *An Introduction to the Bootstrap* (Chapman & Hall,
1993), ch. 13, "Confidence intervals based on bootstrap percentiles". With few repeats the
interval is narrow and under-covers (3 repeats have only 10 distinct resamples; it always lies
within the repeats' min-max); one repeat gives a zero-width interval, as does constant data.

Ratios (`ratio_ci`, kvtool / mlx-lm): the same bootstrap on the ratio of the two means; when both
sides have the same number of repeats the resampled repeat indices are shared (paired: repeat r of
both servers ran back to back), otherwise the two sides are resampled independently.

Verdicts (`compare`): **win** / **loss** only when the two intervals do not overlap (touching
counts as overlap), by which side is better; otherwise **tie**, as always below
`MIN_VERDICT_REPEATS` repeats (one repeat has no spread to judge by).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

BOOTSTRAP_SEED = 20261124
N_RESAMPLES = 10_000
CONFIDENCE = 0.95
WIN, LOSS, TIE = "win", "loss", "tie"
MIN_VERDICT_REPEATS = 2  # fewer repeats on either side: always a tie

_SHARE = "fraction of prompt tokens"
# Figure -> (True if lower is better, unit). Order = column order of the outputs.
FIGURES: dict[str, tuple[bool, str]] = {
    "ttft_p50_ms": (True, "ms"), "ttft_p90_ms": (True, "ms"), "ttft_p99_ms": (True, "ms"),
    "latency_p50_ms": (True, "ms"), "latency_p99_ms": (True, "ms"),
    "requests_per_s": (False, "requests/s"), "prompt_tokens_per_s": (False, "tokens/s"),
    "hit_rate": (False, _SHARE), "hit_rate_ram": (False, _SHARE), "hit_rate_ssd": (False, _SHARE),
    "cached_tokens_per_request": (False, "tokens"),
}  # fmt: skip


@dataclass(frozen=True)
class Interval:
    """A point estimate with its confidence interval (same unit as the figure).

    Attributes:
        point: mean over the repeats (or the ratio of means).
        lo, hi: the interval's bounds (`lo <= hi`); NaN when there is no data.
        n: number of repeats it rests on.
    """

    point: float
    lo: float
    hi: float
    n: int

    @property
    def valid(self) -> bool:
        return self.n > 0 and all(np.isfinite([self.point, self.lo, self.hi]))

    def overlaps(self, other: Interval) -> bool:
        """True if the intervals share at least one point (touching counts)."""
        return self.lo <= other.hi and other.lo <= self.hi


NAN_INTERVAL = Interval(float("nan"), float("nan"), float("nan"), 0)


def percentile(values: Sequence[float] | np.ndarray, q: float) -> float:
    """The `q`-th percentile (0..100) with numpy's linear method; NaN for no values."""
    arr = np.asarray(values, dtype=float)
    return float(np.percentile(arr, q, method="linear")) if arr.size else float("nan")


def batch_figures(records: Iterable[dict[str, Any]], wall_s: float, tier_hits: dict[str, int] | None = None
                  ) -> dict[str, float]:
    """The figures of one batch.

    Args:
        records: the measured requests (dicts with `ttft_ms`, `latency_ms`, `prompt_tokens`,
            `cached_tokens`, `error`); failed ones (`error` set) are left out of everything.
        wall_s: wall time of the measured phases (s).
        tier_hits: kvtool's `ram_hit_tokens`, `ssd_hit_tokens` and `prompt_tokens` (the server's
            counts over the measured phases); None for mlx-lm.

    Returns:
        `FIGURES` keys -> value (NaN where not applicable), plus `requests` and `failed`.
    """
    rows = list(records)
    ok = [r for r in rows if not r.get("error")]
    ttft = [float(r["ttft_ms"]) for r in ok]
    lat = [float(r["latency_ms"]) for r in ok]
    prompt = sum(int(r["prompt_tokens"] or 0) for r in ok)
    cached_known = [r for r in ok if r.get("cached_tokens") is not None and r["cached_tokens"] == r["cached_tokens"]]
    cached = sum(int(r["cached_tokens"]) for r in cached_known)
    cached_prompt = sum(int(r["prompt_tokens"] or 0) for r in cached_known)
    out = {
        "ttft_p50_ms": percentile(ttft, 50), "ttft_p90_ms": percentile(ttft, 90), "ttft_p99_ms": percentile(ttft, 99),
        "latency_p50_ms": percentile(lat, 50), "latency_p99_ms": percentile(lat, 99),
        "requests_per_s": len(ok) / wall_s if wall_s > 0 and ok else float("nan"),
        "prompt_tokens_per_s": prompt / wall_s if wall_s > 0 and ok else float("nan"),
        "hit_rate": cached / cached_prompt if cached_prompt else float("nan"),
        "hit_rate_ram": float("nan"), "hit_rate_ssd": float("nan"),
        "cached_tokens_per_request": cached / len(cached_known) if cached_known else float("nan"),
        "requests": float(len(rows)), "failed": float(len(rows) - len(ok)),
    }  # fmt: skip
    if tier_hits and tier_hits.get("prompt_tokens"):
        out["hit_rate_ram"] = tier_hits.get("ram_hit_tokens", 0) / tier_hits["prompt_tokens"]
        out["hit_rate_ssd"] = tier_hits.get("ssd_hit_tokens", 0) / tier_hits["prompt_tokens"]
    return out


def _clean(values: Sequence[float] | np.ndarray) -> np.ndarray:
    arr = np.asarray(values, dtype=float)
    return arr[np.isfinite(arr)]


def _bounds(stats: np.ndarray, confidence: float) -> tuple[float, float]:
    tail = (1.0 - confidence) / 2.0 * 100.0
    lo, hi = np.percentile(stats, [tail, 100.0 - tail], method="linear")
    return float(lo), float(hi)


def bootstrap_ci(values: Sequence[float] | np.ndarray, *, seed: int = BOOTSTRAP_SEED, n_resamples: int = N_RESAMPLES,
                 confidence: float = CONFIDENCE, median: bool = False) -> Interval:
    """Mean (or with `median`, the median) over the repeats and its percentile-bootstrap interval
    (see the module docstring).

    Exactly: `idx = default_rng(seed).integers(0, n, size=(n_resamples, n))`, statistics =
    `values[idx].mean(axis=1)` (`numpy.median(values[idx], axis=1)` with `median`), bounds =
    `percentile(statistics, [2.5, 97.5])` for 95 %. Non-finite values are dropped first; no values
    give `NAN_INTERVAL`. The median's interval of 2 or 3 values is their min-max.
    """
    arr = _clean(values)
    if arr.size == 0:
        return NAN_INTERVAL
    point = float(np.median(arr) if median else arr.mean())
    if arr.size == 1 or np.all(arr == arr[0]):
        return Interval(point, point, point, int(arr.size))
    idx = np.random.default_rng(seed).integers(0, arr.size, size=(n_resamples, arr.size))
    lo, hi = _bounds(np.median(arr[idx], axis=1) if median else arr[idx].mean(axis=1), confidence)
    return Interval(point, lo, hi, int(arr.size))


def ratio_ci(numerator: Sequence[float] | np.ndarray, denominator: Sequence[float] | np.ndarray, *,
             seed: int = BOOTSTRAP_SEED, n_resamples: int = N_RESAMPLES, confidence: float = CONFIDENCE) -> Interval:
    """Ratio of the means (numerator / denominator) with its percentile-bootstrap interval; paired
    resampling when both have the same length (see the module docstring). NaN when a side has no
    finite value or a mean is 0."""
    a, b = np.asarray(numerator, dtype=float), np.asarray(denominator, dtype=float)
    if a.size == b.size:
        keep = np.isfinite(a) & np.isfinite(b)
        a, b = a[keep], b[keep]
        paired = True
    else:
        a, b = _clean(a), _clean(b)
        paired = False
    if a.size == 0 or b.size == 0 or b.mean() == 0:
        return NAN_INTERVAL
    point = float(a.mean() / b.mean())
    rng = np.random.default_rng(seed)
    ia = rng.integers(0, a.size, size=(n_resamples, a.size))
    ib = ia if paired else rng.integers(0, b.size, size=(n_resamples, b.size))
    with np.errstate(divide="ignore", invalid="ignore"):
        ratios = a[ia].mean(axis=1) / b[ib].mean(axis=1)
    ratios = ratios[np.isfinite(ratios)]
    if ratios.size == 0:
        return NAN_INTERVAL
    lo, hi = _bounds(ratios, confidence)
    return Interval(point, min(lo, hi), max(lo, hi), int(min(a.size, b.size)))


def compare(a: Interval, b: Interval, lower_is_better: bool = True) -> str:
    """`win` if `a` is better than `b` with non-overlapping intervals, `loss` if worse with
    non-overlapping intervals, else `tie` (also when either interval is invalid or rests on fewer
    than `MIN_VERDICT_REPEATS` repeats: one repeat gives a zero-width interval, not certainty)."""
    if not (a.valid and b.valid) or min(a.n, b.n) < MIN_VERDICT_REPEATS or a.overlaps(b):
        return TIE
    a_better = a.hi < b.lo if lower_is_better else a.lo > b.hi
    return WIN if a_better else LOSS


def cell_summary(batches: Sequence[dict[str, Any]], *, seed: int = BOOTSTRAP_SEED) -> dict[str, Any]:
    """One cell's figures over its batches: `<figure>`, `<figure>_lo`, `<figure>_hi` for every
    figure in `FIGURES` (mean over repeats and 95 % interval), `repeats`, and sums of `requests`
    and `failed`."""
    out: dict[str, Any] = {"repeats": len(batches)}
    for fig in FIGURES:
        iv = bootstrap_ci([b.get(fig, float("nan")) for b in batches], seed=seed)
        out[fig], out[f"{fig}_lo"], out[f"{fig}_hi"] = iv.point, iv.lo, iv.hi
    out["requests"] = int(sum(b.get("requests", 0) for b in batches))
    out["failed"] = int(sum(b.get("failed", 0) for b in batches))
    return out


__all__ = ["BOOTSTRAP_SEED", "CONFIDENCE", "FIGURES", "Interval", "LOSS", "MIN_VERDICT_REPEATS",
           "NAN_INTERVAL", "N_RESAMPLES", "TIE", "WIN", "batch_figures", "bootstrap_ci", "cell_summary", "compare",
           "percentile", "ratio_ci"]
