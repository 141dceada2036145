"""Pooled parity over repeats: kvtool against the geometric mean of the mlx-lm servers.

Why: the parity table's per-cell verdict (`kvtool.bench.loadparity`) compares kvtool's mean TTFT
p50 with the *better* of two mlx-lm servers (`mlx-lm`, `mlx-lm-1000`). Where both do identical
work their figures still differ from repeat to repeat on a shared machine: the minimum of two
noisy samples sits below either server's typical figure, so that verdict is biased against kvtool
and flips with the noise. Here every figure is paired *within a repeat* and pooled over the repeats:

- per repeat r of a (workload, clients, phase): `ratio_r` = kvtool's figure / the geometric mean
  of the mlx-lm servers' figures (NaN when kvtool or one of them has no figure in r), for TTFT
  p50 and requests/s; the noise reference `noise_r` = `mlx-lm`'s figure / `mlx-lm-1000`'s: two
  servers doing the same work, so its spread is what the machine alone produces;
- pooled (`pooled_ratio`): the geometric mean of the finite, positive `ratio_r`, exp(m), with the
  interval exp(m -+ 2 SE), m the mean of log(ratio_r) and SE = their sample standard deviation
  (ddof 1) / sqrt(n); NaN interval with one repeat. Logs make ratios symmetric (1.1x and 1/1.1x
  weigh the same). +-2 SE is about a 95 % interval only for many repeats: with 3 the log ratios'
  mean over its SE follows Student's t with 2 degrees of freedom, and +-2 SE covers about 82 % of
  it. Sources: P. J. Fleming and J. J. Wallace, "How not to lie with statistics: the correct way
  to summarize benchmark results", CACM 29(3), 1986 (the geometric mean of normalized ratios);
  J. M. Bland and D. G. Altman, "Transformations, means, and confidence intervals", BMJ
  312:1079, 1996 (an interval of the mean log, transformed back: a geometric mean's interval).

The pooled verdict (`pooled_verdict`, `parity` rows only) of a ratio against the parity factor
(`loadparity.TOLERANCE`; TTFT: ratio <= it; requests/s: ratio >= 1 / it) is `met` when the whole
interval is on the good side, `not met` when it is wholly on the bad side, and `within noise`
when it straddles the target (more repeats are needed to tell); with one repeat the point alone
decides. A row is `not met` when either figure is, else `within noise` when either is, else `met`.
Three-way because with 3 repeats the interval is often wider than the tolerance itself: a point
verdict would flip from run to run. The cached targets (<= 0.1x) lie far outside this spread and
keep their per-cell verdict (pooled verdict `-`).

`pooled_groups` pools the per-repeat ratios of the `parity` rows of one workload and phase group
(`warm` and `rewarm` are the `warm turns`; every other phase its own group) over clients and
repeats: each (clients, phase, repeat) is one sample.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import pandas as pd

from kvtool.bench.loadserver import KVTOOL, MLXLM, MLXLM_1000
from kvtool.bench.loadworkloads import REWARM_PHASE

POOL_SE = 2.0  # the interval: the mean log ratio -+ 2 standard errors
POOLED_FIGS = ("ttft_p50_ms", "requests_per_s")
SERIES = ("ratio_geo", "noise")  # kvtool / geometric mean of the mlx-lm servers; mlx-lm / mlx-lm-1000
PHASE_GROUPS = {"warm": "warm turns", REWARM_PHASE: "warm turns"}  # phase -> its group (else its label)
CELL_KEYS = ["workload", "clients", "phase"]


def pooled_ratio(ratios: Iterable[float]) -> tuple[float, float, float, int]:
    """The geometric mean of per-repeat ratios with its interval (see the module docstring).

    Args:
        ratios: per-repeat ratios (dimensionless); NaN, infinite and non-positive ones are left out.

    Returns:
        (point, lo, hi, n): exp(mean log), exp(mean log -+ `POOL_SE` x SE), the number of ratios
        used; all NaN (n 0) without any, lo and hi NaN with one.
    """
    logs = np.log([r for r in ratios if isinstance(r, (int, float)) and math.isfinite(r) and r > 0])
    n = int(logs.size)
    if n == 0:
        return math.nan, math.nan, math.nan, 0
    mean = float(logs.mean())
    if n == 1:
        return math.exp(mean), math.nan, math.nan, 1
    half = POOL_SE * float(logs.std(ddof=1)) / math.sqrt(n)
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half), n


def repeat_ratios(figs: pd.DataFrame, baselines: Sequence[str]) -> pd.DataFrame:
    """Per (workload, clients, phase, repeat): `<fig>_ratio_geo` (kvtool / the geometric mean of
    `baselines`) and `<fig>_noise` (mlx-lm / mlx-lm-1000) for each of `POOLED_FIGS`; NaN where a
    server has no finite, positive figure in that repeat.

    Args:
        figs: `loadparity.phase_figures` (one row per workload, server, clients, repeat, phase).
        baselines: the mlx-lm servers that ran (`mlx-lm`, `mlx-lm-1000`).
    """
    keys = [*CELL_KEYS, "repeat"]
    out = figs[keys].drop_duplicates().reset_index(drop=True)
    for fig in POOLED_FIGS:
        wide = figs.set_index([*keys, "server"])[fig].astype(float).unstack("server")
        wide = wide.where(wide > 0).reindex(columns=[KVTOOL, MLXLM, MLXLM_1000]).reset_index()
        logs = np.log(wide[list(baselines)].to_numpy(dtype=float)) if baselines else np.empty((len(wide), 0))
        geo = np.exp(logs.mean(axis=1)) if baselines else np.full(len(wide), math.nan)
        wide[f"{fig}_ratio_geo"] = wide[KVTOOL].to_numpy(dtype=float) / geo
        wide[f"{fig}_noise"] = wide[MLXLM] / wide[MLXLM_1000]
        out = out.merge(wide[[*keys, f"{fig}_ratio_geo", f"{fig}_noise"]], on=keys, how="left")
    return out


def pooled_row(cell: pd.DataFrame) -> dict[str, Any]:
    """The pooled columns of one parity row from its rows of `repeat_ratios`: per repeat k
    `<fig>_<series>_r<k>`, and `<fig>_<series>` with `_lo`, `_hi`, `_n` (see `pooled_ratio`)."""
    row: dict[str, Any] = {}
    for fig in POOLED_FIGS:
        for series in SERIES:
            col = f"{fig}_{series}"
            for rep, value in zip(cell["repeat"], cell[col], strict=True):
                row[f"{col}_r{int(rep)}"] = float(value)
            row.update(_pooled_cols(col, cell[col]))
    return row


def _pooled_cols(col: str, ratios: Iterable[float]) -> dict[str, Any]:
    point, lo, hi, n = pooled_ratio(ratios)
    return {col: point, f"{col}_lo": lo, f"{col}_hi": hi, f"{col}_n": n}


def pooled_verdict(row: dict[str, Any], tolerance: float) -> str:
    """`met`, `not met` or `within noise` of a row's pooled ratios (see the module docstring);
    `-` without a pooled TTFT p50 ratio.

    Args:
        row: holds `ttft_p50_ms_ratio_geo` with `_lo` / `_hi`, and `requests_per_s_ratio_geo`
            with `_lo` / `_hi` when requests/s was measured.
        tolerance: the parity factor (TTFT ratio <= it, requests/s ratio >= 1 / it).
    """
    ttft = _one_verdict(row, "ttft_p50_ms_ratio_geo", lambda r: r <= tolerance)
    if ttft == "-":
        return "-"
    rps = _one_verdict(row, "requests_per_s_ratio_geo", lambda r: r * tolerance >= 1.0)
    verdicts = {ttft, rps} - {"-"}
    return "not met" if "not met" in verdicts else "within noise" if "within noise" in verdicts else "met"


def _one_verdict(row: dict[str, Any], col: str, good: Callable[[float], bool]) -> str:
    point, lo, hi = (_num(row.get(c)) for c in (col, f"{col}_lo", f"{col}_hi"))
    if not math.isfinite(point):
        return "-"
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return "met" if good(point) else "not met"
    if good(lo) and good(hi):
        return "met"
    return "not met" if not good(lo) and not good(hi) else "within noise"


def _num(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def fmt(value: Any, digits: int = 1) -> str:
    """A figure with thousands separators and `digits` decimals; `-` when missing or not finite."""
    v = _num(value)
    return f"{v:,.{digits}f}" if math.isfinite(v) else "-"


def pooled_groups(frame: pd.DataFrame, tolerance: float) -> pd.DataFrame:
    """Per (workload, phase group) of the `parity` rows of the parity table: `cells` (the rows),
    and the pooled columns over every per-repeat ratio of those rows (`<fig>_<series>`, `_lo`,
    `_hi`, `_n`; each (clients, phase, repeat) one sample) with the verdict `pooled_met`; empty
    without such rows or without per-repeat columns.

    Args:
        frame: `parity.csv` as `loadparity.parity_frame` builds it.
        tolerance: the parity factor (`loadparity.TOLERANCE`).
    """
    if frame.empty or "target" not in frame or "phase_label" not in frame:
        return pd.DataFrame()
    rows = []
    parity = frame[frame["target"] == "parity"]
    groups = [PHASE_GROUPS.get(p, lab) for p, lab in zip(parity["phase"], parity["phase_label"], strict=True)]
    for (workload, group), sel in parity.groupby([parity["workload"], pd.Series(groups, index=parity.index)],
                                                 sort=False):
        row: dict[str, Any] = {"workload": workload, "group": group, "cells": len(sel),
                               "clients": " / ".join(str(c) for c in dict.fromkeys(sel["clients"]))}
        for fig in POOLED_FIGS:
            for series in SERIES:
                col = f"{fig}_{series}"
                per_repeat = [c for c in sel.columns if re.fullmatch(rf"{re.escape(col)}_r\d+", c)]
                row.update(_pooled_cols(col, sel[per_repeat].to_numpy(dtype=float).ravel()))
        row["pooled_met"] = pooled_verdict(row, tolerance)
        rows.append(row)
    return pd.DataFrame(rows)


def fmt_pooled(row: dict[str, Any], col: str, digits: int = 2) -> str:
    """`point [lo-hi]`, `point` without an interval, `-` without a point."""
    point, lo, hi = (_num(row.get(c)) for c in (col, f"{col}_lo", f"{col}_hi"))
    if not math.isfinite(point):
        return "-"
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return f"{point:.{digits}f}"
    return f"{point:.{digits}f} [{lo:.{digits}f}-{hi:.{digits}f}]"


def repeat_values(row: dict[str, Any], col: str, digits: int = 2) -> str:
    """The per-repeat values `<col>_r<k>` of a row in repeat order, comma-separated (`-` for NaN)."""
    keys = sorted((k for k in row if re.fullmatch(rf"{re.escape(col)}_r\d+", k)), key=lambda k: int(k.rsplit("r", 1)[1]))
    vals = [_num(row[k]) for k in keys]
    return ", ".join(f"{v:.{digits}f}" if math.isfinite(v) else "-" for v in vals) or "-"


def pooled_group_markdown(groups: pd.DataFrame, tolerance: float) -> list[str]:
    """The report's pooled summary (markdown lines; none for an empty frame)."""
    if groups.empty:
        return []
    lines = ["", "### Pooled over clients and repeats: kvtool against the mlx-lm servers", "",
             "Per workload and phase group of the `parity` rows (warm turns: before and after the restart), every "
             "(clients, phase, repeat) one sample: kvtool / the geometric mean of the mlx-lm servers in that repeat, "
             f"geometric mean over the samples [-+ {POOL_SE:g} standard errors of the mean log ratio]; noise "
             "reference: mlx-lm / mlx-lm-1000 on the same samples (the same work on both). Pooled verdict against "
             f"{tolerance}x: met / not met when the whole interval is on one side, within noise when it straddles "
             "(`kvtool/bench/loadpooled.py`).", "",
             "| workload | phase | clients | n | TTFT p50: kvtool / mlx-lm servers | mlx-lm / mlx-lm-1000 (noise) | "
             "req/s: kvtool / mlx-lm servers | mlx-lm / mlx-lm-1000 (noise) | pooled |",
             "|---|---|---|---:|---|---|---|---|---|"]
    for r in groups.to_dict(orient="records"):
        figs = " | ".join(fmt_pooled(r, f"{fig}_{s}") for fig in POOLED_FIGS for s in SERIES)
        lines.append(f"| {r['workload']} | {r['group']} | {r['clients']} | {r['ttft_p50_ms_ratio_geo_n']} | {figs} | "
                     f"{r['pooled_met']} |")
    return lines


__all__ = ["POOLED_FIGS", "POOL_SE", "fmt", "fmt_pooled", "pooled_group_markdown", "pooled_groups",
           "pooled_ratio", "pooled_row", "pooled_verdict", "repeat_ratios", "repeat_values"]
