"""Who wins a workload in a bench run, and how its numbers are written (`kvtool report`,
`kvtool bench`'s summary).

Every latency is the median over the repeats of a per-repeat statistic, with the 95 % bootstrap
interval of that median (`cells.csv` columns `<metric>_lo` / `<metric>_hi`, see `spread`); the
rule: `WIN_RULE` (kvtool.bench.report). No figure is a best-of-cells: a workload whose cells tie
is reported as the span of the tied cells, never as its luckiest cell.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

KIND_KVTOOL, NO_CACHE, MLXLM = "kvtool", "no-cache", "mlx-lm-prompt-cache"


def spread(cells: pd.DataFrame, metric: str) -> tuple[pd.Series, pd.Series, pd.Series]:
    """(median, lo, hi) of `metric` per row: the 95 % bootstrap interval of the median over the
    repeats (`<metric>_lo/_hi`); a run written before those columns gets the min-max over the
    repeats (`<metric>_min/_max`: the same interval for 2 or 3 repeats, wider for more), and one
    without either gets lo = hi = median."""
    center = pd.to_numeric(cells[metric], errors="coerce") if metric in cells else pd.Series(np.nan, cells.index)
    lo_col, hi_col = (f"{metric}_lo", f"{metric}_hi") if f"{metric}_lo" in cells else (f"{metric}_min", f"{metric}_max")
    lo = pd.to_numeric(cells[lo_col], errors="coerce") if lo_col in cells else center
    hi = pd.to_numeric(cells[hi_col], errors="coerce") if hi_col in cells else center
    return center, lo.fillna(center), hi.fillna(center)


def repeat_count(cells: pd.DataFrame) -> int:
    """The fewest repeats of any row (1 for a cells.csv without the column)."""
    if "repeats" not in cells:
        return 1
    values = pd.to_numeric(cells["repeats"], errors="coerce").dropna()
    return int(values.min()) if len(values) else 1


NO_SPREAD = "no spread"


def has_spread(cells: pd.DataFrame, metric: str = "ttft_p50_ms") -> bool:
    """True if the rows carry an interval (or a min-max range) over at least 2 repeats."""
    return any(f"{metric}{a}" in cells and f"{metric}{b}" in cells for a, b in (("_lo", "_hi"), ("_min", "_max"))) \
        and repeat_count(cells) >= 2


WINNER_COLUMNS = [
    "workload", "verdict", "cell", "ttft_p50_ms", "ttft_p50_ms_lo", "ttft_p50_ms_hi", "runner_up",
    "runner_up_ttft_p50_ms", "runner_up_ttft_p50_ms_lo", "runner_up_ttft_p50_ms_hi", "tied_cells",
    "candidates", "repeats", "ttft_vs_no_cache", "ttft_vs_mlxlm", "vs_mlxlm", "ttft_gain",
    "tie_median_min", "tie_median_max", "tie_lo", "tie_hi", "tie_vs_no_cache_min", "tie_vs_no_cache_max",
    "tie_vs_mlxlm_min", "tie_vs_mlxlm_max",
]


def winners(cells: pd.DataFrame, metric: str = "ttft_p50_ms") -> pd.DataFrame:
    """Per workload, the kvtool cell with the lowest median `metric` and the verdict (`WIN_RULE`).

    Returns:
        One row per workload with `WINNER_COLUMNS`: `verdict` is `winner` (its interval's top <
        every other kvtool cell's interval bottom), `tie` (`tied_cells` lists, `; `-separated, the
        best cell and every cell whose interval overlaps it), `only cell`, or `no spread` (one
        repeat, or a cells.csv without ranges: no winner can be called; `cell` is merely the
        lowest); `runner_up` is the cell with the second-lowest median; `candidates` counts the
        kvtool cells compared; `vs_mlxlm` compares the best cell's interval with the mlx-lm
        baseline's (`faster`, `slower` or `overlap`; empty without the baseline or a spread).
        `tie_*` describe the tied cells together (NaN unless a tie): the span of their medians
        (ms), of their intervals (ms), and of their speed-ups over each baseline.
    """
    rows = []
    for workload, g in cells.groupby("workload", sort=False):
        center, lo, hi = spread(g, metric)
        kv = g.assign(_c=center, _lo=lo, _hi=hi)
        kv = kv[(kv["kind"] == KIND_KVTOOL) & kv["_c"].notna()].sort_values(["_c", "_hi"], kind="stable")
        if kv.empty:
            continue
        best, others = kv.iloc[0], kv.iloc[1:]
        tied = others[others["_lo"] <= best["_hi"]]
        verdict = "only cell" if others.empty else ("winner" if tied.empty else "tie")
        if verdict == "winner" and not has_spread(kv):
            verdict = NO_SPREAD
        runner = others.iloc[0] if len(others) else pd.Series({"cell": None, "_c": np.nan, "_lo": np.nan, "_hi": np.nan})
        base = g[g["kind"] == MLXLM]
        vs = ""
        if len(base) and has_spread(kv):
            _, b_lo, b_hi = (s.iloc[0] for s in spread(base, metric))
            vs = "faster" if best["_hi"] < b_lo else "slower" if best["_lo"] > b_hi else "overlap"
        rows.append({
            "workload": workload, "verdict": verdict, "cell": best["cell"],
            "ttft_p50_ms": best["_c"], "ttft_p50_ms_lo": best["_lo"], "ttft_p50_ms_hi": best["_hi"],
            "runner_up": runner["cell"], "runner_up_ttft_p50_ms": runner["_c"],
            "runner_up_ttft_p50_ms_lo": runner["_lo"], "runner_up_ttft_p50_ms_hi": runner["_hi"],
            "tied_cells": "; ".join([best["cell"], *tied["cell"]]) if len(tied) else "",
            "candidates": len(kv),
            "repeats": repeat_count(kv),
            "ttft_vs_no_cache": best.get("ttft_vs_no_cache", np.nan),
            "ttft_vs_mlxlm": best.get("ttft_vs_mlxlm", np.nan),
            "vs_mlxlm": vs,
            "ttft_gain": best.get("ttft_gain", np.nan),
            **_tie_span(kv.iloc[[0]] if tied.empty else pd.concat([kv.iloc[[0]], tied]), tie=not tied.empty),
        })
    return pd.DataFrame(rows, columns=WINNER_COLUMNS)


def _tie_span(group: pd.DataFrame, tie: bool) -> dict[str, float]:
    """The `tie_*` columns of `winners` for the tied cells `group` (with `_c`, `_lo`, `_hi`); NaN
    when `tie` is False."""
    out: dict[str, float] = {}
    for name, column in (("tie_median", "_c"), ("tie_vs_no_cache", "ttft_vs_no_cache"), ("tie_vs_mlxlm", "ttft_vs_mlxlm")):
        values = pd.to_numeric(group[column], errors="coerce") if tie and column in group else pd.Series(dtype=float)
        out[f"{name}_min"], out[f"{name}_max"] = (values.min(), values.max()) if values.notna().any() else (np.nan, np.nan)
    out["tie_lo"] = float(group["_lo"].min()) if tie else np.nan
    out["tie_hi"] = float(group["_hi"].max()) if tie else np.nan
    return out


def num(value: float) -> str:
    """A latency for a label: 3 significant digits, thousands separators, no exponent."""
    if value is None or not np.isfinite(value):
        return "n/a"
    a = abs(value)
    if a >= 100:
        return f"{value:,.0f}"
    if a >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def value_range(center: float, lo: float, hi: float) -> str:
    """`center [lo–hi]` (latencies as `num` writes them), `center` alone when there is no range,
    "" for a missing value."""
    if center is None or not np.isfinite(center):
        return ""
    if not (np.isfinite(lo) and np.isfinite(hi)) or lo == hi:
        return num(center)
    return f"{num(center)} [{num(lo)}–{num(hi)}]"


NO_DIFFERENCE = "no policy differs beyond the noise on this machine"


def verdict_phrase(v: Any) -> str:
    """A `winners` row in words: `winner X`, `no policy differs ... (k of n cells tie)`,
    `X (the only kvtool cell)`, `lowest X; no spread...`."""
    if v is None:
        return "no kvtool cell"
    if v.verdict == "tie":
        return f"{NO_DIFFERENCE} ({len(v.tied_cells.split('; '))} of {v.candidates} kvtool cells tie)"
    if v.verdict == "only cell":
        return f"{v.cell} (the only kvtool cell)"
    if v.verdict == NO_SPREAD:
        return f"lowest {v.cell}; no spread, no winner called"
    return f"winner {v.cell}"


def tie_span(v: Any) -> str:
    """The tied cells of a `winners` row together: `medians 8.78–275 ms, intervals 8.32–476 ms`."""
    return (f"tied medians {num(v.tie_median_min)}–{num(v.tie_median_max)} ms, "
            f"their intervals {num(v.tie_lo)}–{num(v.tie_hi)} ms")


def baseline_phrase(v: Any) -> str:
    """The speed-ups over the baselines of a `winners` row: the winner's (or the only/lowest cell's),
    or for a tie the span over the tied cells (never the luckiest cell's alone)."""
    if v.verdict == "tie":
        return (f"{speedup_span(v.tie_vs_no_cache_min, v.tie_vs_no_cache_max)} vs no-cache, "
                f"{speedup_span(v.tie_vs_mlxlm_min, v.tie_vs_mlxlm_max)} vs mlx-lm prompt cache across the tied cells")
    words = {"faster": "faster beyond the interval", "slower": "slower beyond the interval", "overlap": "within the interval"}
    vs = f" ({words[v.vs_mlxlm]})" if v.vs_mlxlm in words else ""
    return f"{speedup(v.ttft_vs_no_cache)} vs no-cache, {speedup(v.ttft_vs_mlxlm)} vs mlx-lm prompt cache{vs}"


def summary_lines(cells: pd.DataFrame) -> list[str]:
    """The verdicts of a run in words (`kvtool bench`, `kvtool report` on a terminal): per workload
    the winner with its interval, or for a tie `NO_DIFFERENCE` with the span of the tied cells; the
    speed-ups over the baselines (`baseline_phrase`)."""
    best = winners(cells)
    repeats = int(best["repeats"].min()) if len(best) else 0
    out = [f"TTFT p50 per workload in ms: median over {repeats} repeat(s) [95% bootstrap interval of the median]:"]
    for row in best.itertuples(index=False):
        out.append(f"{row.workload}: {verdict_phrase(row)}")
        if row.verdict == "tie":
            out.append(f"  {tie_span(row)}")
        else:
            width = max(len(row.cell), len(row.runner_up or ""))
            out.append(f"  lowest  {row.cell:<{width}}  {value_range(row.ttft_p50_ms, row.ttft_p50_ms_lo, row.ttft_p50_ms_hi)}")
            if row.runner_up:
                out.append(f"  next    {row.runner_up:<{width}}  "
                           f"{value_range(row.runner_up_ttft_p50_ms, row.runner_up_ttft_p50_ms_lo, row.runner_up_ttft_p50_ms_hi)}")
        out.append(f"  {baseline_phrase(row)}")
    if best.empty:
        out.append("no kvtool cell in this run")
    out.append("A cell wins only when its whole interval lies below every other kvtool cell's interval; "
               "otherwise it is a tie (report.md lists the tied cells).")
    return out


def speedup_span(lo: float, hi: float) -> str:
    """Speed-ups from `lo` to `hi` as `0.50x–39.73x` (one value when equal, `n/a` when missing)."""
    return speedup(lo) if not (pd.notna(lo) and pd.notna(hi)) or lo == hi else f"{lo:.2f}x–{hi:.2f}x"


def speedup(value: float) -> str:
    """A speed-up ratio as `1.23x`; `n/a` for NaN or None (the baseline did not run)."""
    return f"{value:.2f}x" if pd.notna(value) else "n/a"
