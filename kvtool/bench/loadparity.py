"""The parity table of a `[serve_load]` run: kvtool against every plain `mlx_lm.server`, per phase.

"Never slower than mlx_lm.server": each (workload, clients, phase) of the measured requests gets,
for every server that ran (`kvtool`, `mlx-lm` with its defaults, `mlx-lm-1000` with
`--prompt-cache-size 1000`), TTFT p50, mean and p99 (ms, `numpy.percentile` linear, over the
successful requests of the phase) and requests/s (successful requests / the phase's wall time: first send to
last answer, s), each the mean over the repeats; then kvtool's ratio to each mlx-lm server and to
the better of them (the lower TTFT, the higher requests/s; TTFT mean too), the target of the row
and whether it is met (`parity_target`):

- `parity` (the default, every cell whose data fits every server's cache, cold bursts and first
  turns included): TTFT p50 <= `TOLERANCE` x the better mlx-lm server's and requests/s >= the
  better one's / `TOLERANCE`;
- `cached-default`: the `warm` and `rewarm` turns of a `multi-turn` workload of more conversations than
  mlx_lm.server's default prompt cache holds (`DEFAULT_CACHE_ENTRIES`): TTFT p50 <=
  `CACHED_FACTOR` x the default server's (which evicts each conversation before its next turn);
- `cached-all`: the phase after a restart (`after`; for `multi-turn` its first turn after the
  restart, the later ones are `rewarm`): TTFT p50 <= `CACHED_FACTOR` x every mlx-lm server's
  (their caches were in memory; kvtool's is on disk).

Every row also gets the figures pooled over the repeats and their verdict `pooled_met`
(`kvtool.bench.loadpooled`, where the rule and its reasons are given; `-` for the cached targets),
and the markdown section ends with them pooled per workload and phase group.

Outputs: every server's greedy output is compared with the `mlx-lm` server's for the same request
(`output_mismatches_<server>`: requests that differ or that only one answered); the 1-minute load
average at the start of the cell's first batch and at the end of its last (`load_avg_start`,
`load_avg_end`); per server, the listen-queue overflows during the cell's measured phases, summed
over its repeats (`<server>_listen_overflows`, from `batches.csv`; None where not counted).

Why the mean and the overflows: `mlx_lm.server` listens with socketserver's backlog of 5, so when
more clients connect at once the kernel drops the extra connections and their clients send the SYN
again ~1 s later (`kvtool.bench.machine.listen_overflows`). Those requests wait outside the server,
and the fewer requests inside are served sooner: the TTFT p50 of a 16-client cell can drop below
what a server that accepts every connection (`kvtool serve`, backlog 128) reaches with the same
throughput, while its mean and p99 rise; they say when the p50 is that effect.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pandas as pd

from kvtool.bench.loadpooled import (
    fmt,
    fmt_pooled,
    pooled_group_markdown,
    pooled_groups,
    pooled_row,
    pooled_verdict,
    repeat_ratios,
    repeat_values,
)
from kvtool.bench.loadserver import KVTOOL, MLXLM, MLXLM_FLAGS
from kvtool.bench.loadstats import percentile
from kvtool.bench.loadworkloads import RESTART_PHASE, REWARM_PHASE, workload_kind

TOLERANCE = 1.05  # parity: within 5 % of the better mlx-lm server
CACHED_FACTOR = 0.1  # a cached turn against a server that has to prefill it again
DEFAULT_CACHE_ENTRIES = 10  # mlx_lm.server's --prompt-cache-size default (mlx_lm/server.py)
PHASE_LABELS = {RESTART_PHASE: "after restart", REWARM_PHASE: "warm after restart"}
ROW_KEYS = ["workload", "clients", "phase"]
FIGS = ("ttft_p50_ms", "ttft_mean_ms", "ttft_p99_ms", "requests_per_s")
RATIO_FIGS = ("ttft_p50_ms", "ttft_mean_ms", "requests_per_s")
TARGETS = {
    "parity": f"TTFT p50 <= {TOLERANCE}x and req/s >= 1/{TOLERANCE}x the better mlx-lm",
    "cached-default": f"TTFT p50 <= {CACHED_FACTOR}x mlx-lm (default cache)",
    "cached-all": f"TTFT p50 <= {CACHED_FACTOR}x every mlx-lm",
}


def phase_figures(requests: pd.DataFrame) -> pd.DataFrame:
    """Per (workload, server, clients, repeat, phase) of the measured requests: `ttft_p50_ms`,
    `ttft_mean_ms`, `ttft_p99_ms` (ms), `requests_per_s` (successful requests / (last answer - first send), s)
    `requests` (successful ones) and `failed`; an empty frame without measured rows.

    Args:
        requests: the rows of `requests.jsonl` (`measured`, `phase`, `ttft_ms`, `latency_ms`,
            `sent_s`, `error`, ...).
    """
    cols = ["workload", "server", "clients", "repeat", "phase", *FIGS, "requests", "failed"]
    if requests.empty or "measured" not in requests:
        return pd.DataFrame(columns=cols)
    rows = []
    measured = requests[requests["measured"].astype(bool)]
    for key, grp in measured.groupby(["workload", "server", "clients", "repeat", "phase"], sort=False):
        ok = grp[grp["error"].isna()] if "error" in grp else grp
        ttft = ok["ttft_ms"].to_numpy(dtype=float)
        ends = ok["sent_s"].to_numpy(dtype=float) + ok["latency_ms"].to_numpy(dtype=float) / 1e3
        wall = float(ends.max() - grp["sent_s"].min()) if len(ok) else float("nan")
        mean = float(ttft.mean()) if len(ttft) else math.nan
        rows.append(dict(zip(cols, (*key, percentile(ttft, 50), mean, percentile(ttft, 99),
                                    len(ok) / wall if wall > 0 else math.nan,
                                    len(ok), len(grp) - len(ok)), strict=True)))
    return pd.DataFrame(rows, columns=cols)


def parity_target(kind: str, params: dict[str, Any], phase: str) -> str:
    """The target of a row (a `TARGETS` key; see the module docstring).

    Args:
        kind: the workload (`workload_kind` of its config name).
        params: its parameters as built (`run.json`'s `workloads.<name>.params`).
        phase: the phase of the row.
    """
    if phase == RESTART_PHASE:
        return "cached-all"
    if kind == "multi-turn" and phase in ("warm", REWARM_PHASE) \
            and int(params.get("conversations", 0)) > DEFAULT_CACHE_ENTRIES:
        return "cached-default"
    return "parity"


def target_met(target: str, row: dict[str, Any], baselines: list[str]) -> str:
    """`met`, `not met`, or `-` when kvtool or the baseline the target needs did not run."""
    kv_ttft, kv_rps = row.get(f"{KVTOOL}_ttft_p50_ms", math.nan), row.get(f"{KVTOOL}_requests_per_s", math.nan)
    need = [MLXLM] if target == "cached-default" else baselines
    refs = [row.get(f"{b}_ttft_p50_ms", math.nan) for b in need]
    if not need or not all(_finite(v) for v in (kv_ttft, *refs)):
        return "-"
    if target == "parity":
        best_rps = max(row.get(f"{b}_requests_per_s", math.nan) for b in baselines)
        ok = kv_ttft <= TOLERANCE * min(refs) and (not _finite(best_rps) or kv_rps * TOLERANCE >= best_rps)
    else:
        ok = all(kv_ttft <= CACHED_FACTOR * r for r in refs)
    return "met" if ok else "not met"


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def parity_frame(requests: pd.DataFrame, batches: pd.DataFrame, doc: dict[str, Any]) -> pd.DataFrame:
    """`parity.csv`: one row per (workload, clients, phase) (see the module docstring); empty
    when no measured request ran.

    Args:
        requests: the rows of `requests.jsonl`.
        batches: the rows of `batches.csv` (in run order; `load_avg_start` / `load_avg_end`).
        doc: `run.json` (the workloads' kinds and parameters).
    """
    figs = phase_figures(requests)
    if figs.empty:
        return pd.DataFrame(columns=[*ROW_KEYS, "target", "met"])
    servers = [s for s in (KVTOOL, *MLXLM_FLAGS) if s in set(figs["server"])]
    baselines = [s for s in MLXLM_FLAGS if s in servers]
    mismatches = output_mismatches(requests)
    workloads = doc.get("workloads") or {}
    per_repeat = {key: grp for key, grp in repeat_ratios(figs, baselines).groupby(ROW_KEYS, sort=False)}
    rows = []
    for (workload, clients, phase), grp in figs.groupby(ROW_KEYS, sort=False):
        row: dict[str, Any] = {"workload": workload, "clients": int(clients), "phase": phase,
                               "phase_label": PHASE_LABELS.get(phase, phase)}
        for server in servers:
            sel = grp[grp["server"] == server]
            for fig in FIGS:
                row[f"{server}_{fig}"] = float(sel[fig].mean()) if len(sel) else math.nan
            row[f"{server}_failed"] = int(sel["failed"].sum())
            row[f"{server}_listen_overflows"] = _overflows(batches, workload, int(clients), server)
        _ratios(row, baselines)
        info = workloads.get(workload) or {}
        row["target"] = parity_target(info.get("kind", workload_kind(workload)), info.get("params") or {}, phase)
        row["met"] = target_met(row["target"], row, baselines) if KVTOOL in servers else "-"
        row.update(pooled_row(per_repeat[(workload, clients, phase)]))
        row["pooled_met"] = pooled_verdict(row, TOLERANCE) if row["target"] == "parity" else "-"
        for server in servers:
            if server != MLXLM:
                row[f"output_mismatches_{server}"] = mismatches.get((workload, int(clients), phase, server))
        row.update(_load_avg(batches, workload, int(clients)))
        rows.append(row)
    return pd.DataFrame(rows)


def _ratios(row: dict[str, Any], baselines: list[str]) -> None:
    """kvtool / each baseline and / the better one, for TTFT p50, TTFT mean and requests/s (NaN when
    absent)."""
    def ratio(a: float, b: float) -> float:
        return a / b if _finite(a) and _finite(b) and b > 0 else math.nan

    for fig in RATIO_FIGS:
        kv = row.get(f"{KVTOOL}_{fig}", math.nan)
        refs = [row.get(f"{b}_{fig}", math.nan) for b in baselines]
        for b, ref in zip(baselines, refs, strict=True):
            row[f"{fig}_ratio_{b}"] = ratio(kv, ref)
        finite = [r for r in refs if _finite(r)]
        best = (min(finite) if fig.startswith("ttft") else max(finite)) if finite else math.nan
        row[f"{fig}_ratio_best"] = ratio(kv, best)


def output_mismatches(requests: pd.DataFrame) -> dict[tuple[str, int, str, str], int]:
    """Per (workload, clients, phase, server other than `mlx-lm`): requests whose output (text and
    completion tokens) differs from the `mlx-lm` server's for the same (repeat, key), or that only
    one of the two answered; empty when `mlx-lm` did not run."""
    if requests.empty or MLXLM not in set(requests["server"]):
        return {}
    keys = ["workload", "clients", "repeat", "key"]
    rows = requests[requests["measured"].astype(bool)] if "measured" in requests else requests
    cols = [*keys, "phase", "text", "completion_tokens", "error"]
    base = rows[rows["server"] == MLXLM][cols]
    out: dict[tuple[str, int, str, str], int] = {}
    for server in sorted(set(rows["server"]) - {MLXLM}):
        both = rows[rows["server"] == server][cols].merge(base, on=keys, how="outer", suffixes=("_o", "_b"))
        for r in both.to_dict(orient="records"):
            phase = r["phase_o"] if isinstance(r["phase_o"], str) else r["phase_b"]
            cell = (r["workload"], int(r["clients"]), phase, server)
            same = answered(r, "_o") and answered(r, "_b") and r["text_o"] == r["text_b"] \
                and r["completion_tokens_o"] == r["completion_tokens_b"]
            out[cell] = out.get(cell, 0) + (0 if same else 1)
    return out


def answered(r: dict[str, Any], suffix: str) -> bool:
    """True if the merged request row `r` has an answer (a text, no error) on the side `suffix`."""
    return isinstance(r[f"text{suffix}"], str) and not isinstance(r[f"error{suffix}"], str)


def _cell_batches(batches: pd.DataFrame, workload: str, clients: int) -> pd.DataFrame:
    """The rows of `batches.csv` of one (workload, clients) cell, every server and repeat."""
    return batches[(batches["workload"] == workload) & (batches["clients"] == clients)]


def _overflows(batches: pd.DataFrame, workload: str, clients: int, server: str) -> int | None:
    """The listen-queue overflows of a server's batches of one cell, summed; None when not counted."""
    if "listen_overflows" not in batches:
        return None
    sel = _cell_batches(batches, workload, clients)
    sel = sel[sel["server"] == server]
    counts = pd.to_numeric(sel["listen_overflows"], errors="coerce")
    return int(counts.sum()) if len(counts) and counts.notna().all() else None


def _load_avg(batches: pd.DataFrame, workload: str, clients: int) -> dict[str, Any]:
    if "load_avg_start" not in batches:
        return {"load_avg_start": None, "load_avg_end": None}
    sel = _cell_batches(batches, workload, clients)
    return {"load_avg_start": sel["load_avg_start"].iloc[0] if len(sel) else None,
            "load_avg_end": sel["load_avg_end"].iloc[-1] if len(sel) else None}


def parity_markdown(frame: pd.DataFrame) -> list[str]:
    """The report's "Parity" section (markdown lines; none for an empty frame): the table, then the
    figures pooled per workload and phase group (`loadpooled.pooled_group_markdown`)."""
    if frame.empty or "target" not in frame:
        return []
    servers = [s for s in (KVTOOL, *MLXLM_FLAGS) if f"{s}_ttft_p50_ms" in frame]
    baselines = [s for s in servers if s != KVTOOL]
    ratio_cols = [*baselines, "best"] if len(baselines) > 1 else baselines
    names = " / ".join(servers)
    lines = ["", "## Parity: kvtool against every mlx_lm.server, per phase", "",
             f"Means over the repeats of each phase's TTFT p50 / mean / p99 (ms) and requests/s, per server ({names}); "
             f"ratios kvtool / {', '.join(ratio_cols)} (best: the better mlx-lm server); targets: "
             + "; ".join(f"`{k}`: {v}" for k, v in TARGETS.items()) + " (`kvtool/bench/loadparity.py`). Pooled: per "
             "repeat kvtool's TTFT p50 / the geometric mean of the mlx-lm servers' in that repeat, their geometric "
             "mean over the repeats [-+2 standard errors of the mean log ratio], the same for requests/s and for the "
             "noise reference mlx-lm / mlx-lm-1000 (the same work on both); pooled verdict (`parity` rows) against "
             f"{TOLERANCE}x: met / not met when the whole interval is on one side, within noise when it straddles "
             "(`kvtool/bench/loadpooled.py`). Outputs: requests whose output differs from mlx-lm's; failed: requests "
             "without an answer per server (not in the figures). Listen drops: connections the server's full accept "
             "queue dropped during the measured phases, per server (each adds ~1 s to a request's TTFT and lowers the "
             "p50 of the others: then compare the mean and p99). Load: 1-minute load average at the cell's start "
             "-> end.",
             "", f"| workload | clients | phase | TTFT p50 ms ({names}) | TTFT mean ms | TTFT p99 ms | req/s | TTFT p50 "
             f"ratio ({' / '.join(ratio_cols)}) | TTFT mean ratio | req/s ratio | target | met | TTFT p50 kvtool / "
             "mlx-lm servers per repeat | pooled | noise: mlx-lm / mlx-lm-1000 | req/s pooled | pooled met | outputs "
             "differing | failed | listen drops | load |",
             "|---|---:|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    lines += [_markdown_row(row, servers, ratio_cols) for row in frame.to_dict(orient="records")]
    return lines + pooled_group_markdown(pooled_groups(frame, TOLERANCE), TOLERANCE)


def _markdown_row(row: dict[str, Any], servers: list[str], ratio_cols: list[str]) -> str:
    cells = [" / ".join(fmt(row.get(f"{s}_{fig}"), 2 if fig == "requests_per_s" else 1) for s in servers)
             for fig in FIGS]
    ratios = [" / ".join(fmt(row.get(f"{fig}_ratio_{b}"), 2) for b in ratio_cols) for fig in RATIO_FIGS]
    pooled = [repeat_values(row, "ttft_p50_ms_ratio_geo"), fmt_pooled(row, "ttft_p50_ms_ratio_geo"),
              fmt_pooled(row, "ttft_p50_ms_noise"), fmt_pooled(row, "requests_per_s_ratio_geo"),
              str(row.get("pooled_met", "-"))]
    diff = ", ".join(f"{s} {fmt(row.get(f'output_mismatches_{s}'), 0)}" for s in servers if s != MLXLM)
    failed = " / ".join(fmt(row.get(f"{s}_failed"), 0) for s in servers)
    drops = " / ".join(fmt(row.get(f"{s}_listen_overflows"), 0) for s in servers)
    return (f"| {row['workload']} | {row['clients']} | {row['phase_label']} | {' | '.join(cells)} | "
            f"{' | '.join(ratios)} | {row['target']} | {row['met']} | {' | '.join(pooled)} | {diff or '-'} | "
            f"{failed} | {drops} | {fmt(row.get('load_avg_start'), 2)} -> {fmt(row.get('load_avg_end'), 2)} |")


def drop_note(row: dict[str, Any]) -> str:
    """`; listen drops ...: compare the mean` when a server's full accept queue dropped connections
    during a row's measured phases (its TTFT p50 then leaves those clients out for ~1 s; see the
    module docstring), else ``."""
    counted = {}
    for server in (KVTOOL, *MLXLM_FLAGS):
        v = row.get(f"{server}_listen_overflows")
        if isinstance(v, (int, float)) and math.isfinite(v) and v > 0:
            counted[server] = int(v)
    if not counted:
        return ""
    return "; listen drops " + ", ".join(f"{s} {n}" for s, n in counted.items()) + ": compare the mean"


def parity_summary(frame: pd.DataFrame) -> list[str]:
    """One console line per row of the parity table: kvtool / the better mlx-lm server (TTFT p50 and
    mean, requests/s), the target and whether it is met, and the pooled TTFT p50 ratio with its
    verdict (and `drop_note`);
    then one line per pooled workload and phase group (`loadpooled.pooled_groups`)."""
    if frame.empty or "target" not in frame:
        return []
    rows = [f"parity {r['workload']} {r['clients']} client(s) {r['phase_label']}: kvtool / better mlx-lm TTFT p50 "
            f"{fmt(r.get('ttft_p50_ms_ratio_best'), 2)} (mean {fmt(r.get('ttft_mean_ms_ratio_best'), 2)}), req/s "
            f"{fmt(r.get('requests_per_s_ratio_best'), 2)}; "
            f"{r['target']} -> {r['met']}; pooled kvtool / mlx-lm servers TTFT p50 "
            f"{fmt_pooled(r, 'ttft_p50_ms_ratio_geo')} -> {r.get('pooled_met', '-')}{drop_note(r)}"
            for r in frame.to_dict(orient="records")]
    groups = pooled_groups(frame, TOLERANCE)
    return rows + [f"parity pooled {g['workload']} {g['group']} (n {g['ttft_p50_ms_ratio_geo_n']}): kvtool / mlx-lm "
                   f"servers TTFT p50 {fmt_pooled(g, 'ttft_p50_ms_ratio_geo')} (noise mlx-lm / mlx-lm-1000 "
                   f"{fmt_pooled(g, 'ttft_p50_ms_noise')}) -> {g['pooled_met']}"
                   for g in groups.to_dict(orient="records")]


def write_parity(run_dir: Path, requests: pd.DataFrame, batches: pd.DataFrame,
                 doc: dict[str, Any]) -> tuple[pd.DataFrame, list[str]]:
    """Write `parity.csv` into `run_dir`; return the frame and the report's markdown section."""
    frame = parity_frame(requests, batches, doc)
    frame.to_csv(Path(run_dir) / "parity.csv", index=False)
    return frame, parity_markdown(frame)


__all__ = ["CACHED_FACTOR", "DEFAULT_CACHE_ENTRIES", "TARGETS", "TOLERANCE", "answered", "drop_note",
           "output_mismatches", "parity_frame", "parity_markdown", "parity_summary", "parity_target", "phase_figures",
           "target_met", "write_parity"]
