"""Who wins a workload in a bench run, and how its numbers are written (`kvtool report`,
`kvtool bench`'s summary).

Every latency is the median over the repeats of a per-repeat statistic, with its min-max range
over the repeats (`cells.csv` columns `<metric>_min` / `<metric>_max`); the rule: `WIN_RULE`
(kvtool.bench.report).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

KIND_KVTOOL, NO_CACHE, MLXLM = "kvtool", "no-cache", "mlx-lm-prompt-cache"


def spread(cells: pd.DataFrame, metric: str) -> tuple[pd.Series, pd.Series, pd.Series]:
    """(median, min, max) of `metric` per row; a run without `<metric>_min/_max` columns
    (written before repeats carried ranges) gets min = max = median."""
    center = pd.to_numeric(cells[metric], errors="coerce") if metric in cells else pd.Series(np.nan, cells.index)
    lo = pd.to_numeric(cells[f"{metric}_min"], errors="coerce") if f"{metric}_min" in cells else center
    hi = pd.to_numeric(cells[f"{metric}_max"], errors="coerce") if f"{metric}_max" in cells else center
    return center, lo.fillna(center), hi.fillna(center)


def repeat_count(cells: pd.DataFrame) -> int:
    """The fewest repeats of any row (1 for a cells.csv without the column)."""
    if "repeats" not in cells:
        return 1
    values = pd.to_numeric(cells["repeats"], errors="coerce").dropna()
    return int(values.min()) if len(values) else 1


NO_SPREAD = "no spread"


def has_spread(cells: pd.DataFrame, metric: str = "ttft_p50_ms") -> bool:
    """True if the rows carry a min-max range over at least 2 repeats."""
    return f"{metric}_min" in cells and f"{metric}_max" in cells and repeat_count(cells) >= 2


WINNER_COLUMNS = [
    "workload", "verdict", "cell", "ttft_p50_ms", "ttft_p50_ms_min", "ttft_p50_ms_max", "runner_up",
    "runner_up_ttft_p50_ms", "runner_up_ttft_p50_ms_min", "runner_up_ttft_p50_ms_max", "tied_cells",
    "candidates", "repeats", "ttft_vs_no_cache", "ttft_vs_mlxlm", "vs_mlxlm", "ttft_gain",
]


def winners(cells: pd.DataFrame, metric: str = "ttft_p50_ms") -> pd.DataFrame:
    """Per workload, the kvtool cell with the lowest median `metric` and the verdict (`WIN_RULE`).

    Returns:
        One row per workload with `WINNER_COLUMNS`: `verdict` is `winner` (its max < every other
        kvtool cell's min), `tie` (`tied_cells` lists, `; `-separated, the best cell and every cell
        whose range overlaps it), `only cell`, or `no spread` (one repeat, or a cells.csv without
        ranges: no winner can be called; `cell` is merely the lowest); `runner_up` is the cell with the second-lowest
        median; `candidates` counts the kvtool cells compared; `vs_mlxlm` compares the best cell's range with the mlx-lm baseline's
        (`faster`, `slower` or `overlap`; empty without the baseline or without a spread).
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
        runner = others.iloc[0] if len(others) else None
        base = g[g["kind"] == MLXLM]
        vs = ""
        if len(base) and has_spread(kv):
            _, b_lo, b_hi = (s.iloc[0] for s in spread(base, metric))
            vs = "faster" if best["_hi"] < b_lo else "slower" if best["_lo"] > b_hi else "overlap"
        rows.append({
            "workload": workload, "verdict": verdict, "cell": best["cell"],
            "ttft_p50_ms": best["_c"], "ttft_p50_ms_min": best["_lo"], "ttft_p50_ms_max": best["_hi"],
            "runner_up": runner["cell"] if runner is not None else None,
            "runner_up_ttft_p50_ms": runner["_c"] if runner is not None else np.nan,
            "runner_up_ttft_p50_ms_min": runner["_lo"] if runner is not None else np.nan,
            "runner_up_ttft_p50_ms_max": runner["_hi"] if runner is not None else np.nan,
            "tied_cells": "; ".join([best["cell"], *tied["cell"]]) if len(tied) else "",
            "candidates": len(kv),
            "repeats": repeat_count(kv),
            "ttft_vs_no_cache": best.get("ttft_vs_no_cache", np.nan),
            "ttft_vs_mlxlm": best.get("ttft_vs_mlxlm", np.nan),
            "vs_mlxlm": vs,
            "ttft_gain": best.get("ttft_gain", np.nan),
        })
    return pd.DataFrame(rows, columns=WINNER_COLUMNS)


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
    """`center [lo–hi]` (latencies as `_num` writes them), `center` alone when there is no range,
    "" for a missing value."""
    if center is None or not np.isfinite(center):
        return ""
    if not (np.isfinite(lo) and np.isfinite(hi)) or lo == hi:
        return num(center)
    return f"{num(center)} [{num(lo)}–{num(hi)}]"


def verdict_phrase(v: Any) -> str:
    """A `winners` row in words: `winner X`, `tie, ...`, `X (the only kvtool cell)`, `lowest X; no spread...`."""
    if v is None:
        return "no kvtool cell"
    if v.verdict == "tie":
        return f"tie, {len(v.tied_cells.split('; '))} of {v.candidates} kvtool cells within the spread"
    if v.verdict == "only cell":
        return f"{v.cell} (the only kvtool cell)"
    if v.verdict == NO_SPREAD:
        return f"lowest {v.cell}; no spread, no winner called"
    return f"winner {v.cell}"


def summary_lines(cells: pd.DataFrame) -> list[str]:
    """The winners of a run in words (`kvtool bench`, `kvtool report` on a terminal): per workload
    the verdict, the lowest and next cells with their ranges, the ratios to the baselines."""
    best = winners(cells)
    repeats = int(best["repeats"].min()) if len(best) else 0
    out = [f"TTFT p50 per workload in ms, median [min–max] over {repeats} repeat(s) of each cell:"]
    vs_words = {"faster": "faster beyond the spread", "slower": "slower beyond the spread",
                "overlap": "within the spread"}
    for row in best.itertuples(index=False):
        width = max(len(row.cell), len(row.runner_up or ""))
        out.append(f"{row.workload}: {verdict_phrase(row)}")
        out.append(f"  lowest  {row.cell:<{width}}  {value_range(row.ttft_p50_ms, row.ttft_p50_ms_min, row.ttft_p50_ms_max)}")
        if row.runner_up:
            out.append(f"  next    {row.runner_up:<{width}}  "
                       f"{value_range(row.runner_up_ttft_p50_ms, row.runner_up_ttft_p50_ms_min, row.runner_up_ttft_p50_ms_max)}")
        vs = f" ({vs_words[row.vs_mlxlm]})" if row.vs_mlxlm in vs_words else ""
        out.append(f"  {speedup(row.ttft_vs_no_cache)} vs no-cache, {speedup(row.ttft_vs_mlxlm)} vs mlx-lm prompt cache{vs}")
    if best.empty:
        out.append("no kvtool cell in this run")
    out.append("A cell wins only when its slowest repeat beats every other kvtool cell's fastest repeat; "
               "otherwise it is a tie (report.md lists the tied cells).")
    return out


def speedup(value: float) -> str:
    """A speed-up ratio as `1.23x`; `n/a` for NaN or None (the baseline did not run)."""
    return f"{value:.2f}x" if pd.notna(value) else "n/a"
