"""Summary and report of a restore benchmark run: `summary.csv` and `report.md`.

Every ratio is computed here from the medians of the measured rows (never typed in):

- `kvtool/mlx-lm` = median kvtool time / median mlx-lm time (below 1: kvtool is faster);
- `kvtool/raw` = median raw-read time / median kvtool time = kvtool's throughput as a share of
  a one-file read of the same bytes (1.0: at the disk ceiling).

The restore targets (docs/benchmarks.md#restore-targets) are marked met / not met / not measured from the same medians.
"""

from __future__ import annotations

import csv
import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

KEY = ("section", "shape", "dtype", "prompt_tokens", "method", "cache_state")
SUMMARY_COLUMNS = [
    *KEY, "kv_bytes", "n", "median_ms", "min_ms", "max_ms", "median_gbps", "median_peak_rss_ratio",
    "median_ssd_load_ms", "median_first_append_ms", "max_resident_before", "kv_ok", "kvtool_api",
]
TTFT_TARGET = 1.1  # SSD-hit TTFT <= 1.1x mlx-lm's load_prompt_cache TTFT
TTFT_MIN_TOKENS = 4096
RAW_TARGET = 0.8  # cold restore throughput >= 80% of a raw read
RSS_TARGET = 1.25  # peak RSS of a restore <= 1.25x the KV bytes
WRITER_TARGET = 0.5  # writer >= 50% of dd
APPEND_FACTOR, APPEND_SLACK_MS = 1.5, 1.0  # "first decode step no dearer": <= 1.5x reference + 1 ms
LEGACY_NOTE = " (the tiered cache of a tree before the PrefixCache rewrite, through the legacy adapter)"


def _num(v: Any) -> float | None:
    if v is None or v == "":
        return None
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def _median(values: Iterable[Any]) -> float | None:
    nums = [x for x in (_num(v) for v in values) if x is not None]
    return statistics.median(nums) if nums else None


def summarize(rows: list[dict]) -> list[dict]:
    """One summary row per (section, shape, dtype, prompt_tokens, method, cache_state)."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        groups[tuple(str(r[k]) for k in KEY)].append(r)
    out = []
    for key, rs in groups.items():
        ms = [x for x in (_num(r["ms"]) for r in rs) if x is not None]
        resident = [x for x in (_num(r.get("resident_before")) for r in rs) if x is not None]
        oks = {str(r.get("kv_ok")) for r in rs} - {""}
        out.append({
            **dict(zip(KEY, key)), "kv_bytes": rs[0]["kv_bytes"], "n": len(ms),
            "median_ms": statistics.median(ms) if ms else None, "min_ms": min(ms, default=None),
            "max_ms": max(ms, default=None), "median_gbps": _median(r.get("gbps") for r in rs),
            "median_peak_rss_ratio": _median(r.get("peak_rss_ratio") for r in rs),
            "median_ssd_load_ms": _median(r.get("ssd_load_ms") for r in rs),
            "median_first_append_ms": _median(r.get("first_append_ms") for r in rs),
            "max_resident_before": max(resident) if resident else None,
            "kv_ok": None if not oks else oks == {"True"},
            "kvtool_api": next((r["kvtool_api"] for r in rs if r.get("kvtool_api")), ""),
        })
    return out


class Summary:
    """Lookup of summary rows by key."""

    def __init__(self, rows: list[dict]):
        self.rows = rows
        self._by = {tuple(str(r[k]) for k in KEY): r for r in rows}

    def get(self, section, shape, dtype, n, method, state) -> dict | None:
        return self._by.get((section, shape, dtype, str(n), method, state))

    def med(self, *key, field: str = "median_ms") -> float | None:
        r = self.get(*key)
        return _num(r[field]) if r else None

    def ratio(self, section, shape, dtype, n, state, num: str, den: str) -> float | None:
        """Median time of method `num` / median time of method `den` in one cell."""
        return _ratio(self.med(section, shape, dtype, n, num, state), self.med(section, shape, dtype, n, den, state))

    def groups(self, section: str) -> list[tuple[str, str]]:
        return list(dict.fromkeys((r["shape"], r["dtype"]) for r in self.rows if r["section"] == section))


def _ms(r: dict | None) -> str:
    if not r or r["median_ms"] is None:
        return "–"
    med, lo, hi = (float(r[k]) for k in ("median_ms", "min_ms", "max_ms"))
    return f"{med:,.1f} ({lo:,.1f}–{hi:,.1f})"


def _x(v: float | None, digits: int = 2) -> str:
    return "–" if v is None else f"{v:.{digits}f}×"


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _tables(s: Summary, section: str, title: str, header: list[str], row: Callable[..., str]) -> list[str]:
    """One markdown table per (shape, dtype) of `section`: `title` (formatted with them), `header`
    (column and alignment lines), then `row(s, shape, dtype, n, state)` for every cell."""
    out = []
    for shape, dtype in s.groups(section):
        out += [title.format(shape=shape, dtype=dtype), "", *header]
        out += [row(s, *cell) for cell in _cells(s, section) if cell[:2] == (shape, dtype)]
        out.append("")
    return out


def _load_row(s: Summary, shape: str, dtype: str, n: int, st: str) -> str:
    ref = s.med("load", shape, dtype, n, "append-after-prefill", "n/a")
    raw, mlx, kv = (s.get("load", shape, dtype, n, m, st) for m in ("raw-read", "mlx-lm", "kvtool"))
    kv_ms, mlx_ms, raw_ms = (_num(r["median_ms"]) if r else None for r in (kv, mlx, raw))
    any_row = kv or mlx or raw
    mb = int(any_row["kv_bytes"]) / 1e6 if any_row else 0
    return (f"| {n:,} | {mb:,.1f} | {st} | {_ms(raw)} | {_ms(mlx)} | {_ms(kv)} | "
            f"{_f(kv and kv['median_gbps'], 3)} | {_x(_ratio(kv_ms, mlx_ms))} | {_x(_ratio(raw_ms, kv_ms))} | "
            f"{_x(_num(kv['median_peak_rss_ratio']) if kv else None)} | "
            f"{_x(_num(mlx['median_peak_rss_ratio']) if mlx else None)} | "
            f"{_f(kv and kv['median_first_append_ms'])} | {_f(mlx and mlx['median_first_append_ms'])} "
            f"| {_f(ref)} |")


def load_tables(s: Summary) -> list[str]:
    """Per shape: restore times, ratios, peak RSS and first-append cost."""
    return _tables(s, "load", "### Load path: `{shape}` KV, {dtype}", [
        "| tokens | KV MB | state | raw read ms | mlx-lm ms | kvtool ms | kvtool GB/s "
        "| kvtool/mlx-lm (time) | kvtool/raw (throughput) | peak RSS / KV: kvtool | mlx-lm "
        "| first append ms: kvtool | mlx-lm | after prefill |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"], _load_row)


def _f(v: Any, digits: int = 1) -> str:
    v = _num(v) if v not in (None, False) else None
    return "–" if v is None else f"{v:,.{digits}f}"


def _ttft_row(s: Summary, shape: str, dtype: str, n: int, st: str) -> str:
    rec = s.get("ttft", shape, dtype, n, "recompute", "n/a")
    kv = s.get("ttft", shape, dtype, n, "kvtool-ssd-hit", st)
    mlx = s.get("ttft", shape, dtype, n, "mlx-lm-load+last", st)
    kv_ms, mlx_ms, rec_ms = (_num(r["median_ms"]) if r else None for r in (kv, mlx, rec))
    same = "yes" if kv and mlx and kv["kv_ok"] and mlx["kv_ok"] else "no"
    return (f"| {n:,} | {st} | {_ms(rec)} | {_ms(kv)} | {_f(kv and kv['median_ssd_load_ms'])} | "
            f"{_ms(mlx)} | {_f(mlx and mlx['median_ssd_load_ms'])} | {_x(_ratio(kv_ms, mlx_ms))} | "
            f"{_x(_ratio(kv_ms, rec_ms))} | {same} |")


def ttft_tables(s: Summary) -> list[str]:
    """TTFT of the real model: recompute, kvtool SSD hit, mlx-lm load + first token of `generate_step`."""
    return _tables(s, "ttft", "### TTFT, real `{shape}` model ({dtype}), fresh process per request", [
        "| tokens | state | recompute ms | kvtool SSD hit ms | its ssd_load_ms | mlx-lm load+last ms "
        "| its load ms | kvtool/mlx-lm | kvtool/recompute | first token equal |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---|"], _ttft_row)


WRITER_METHODS = ("kvtool-writer", "kvtool-writer+sync", "kvtool-writer-first", "dd-fdatasync", "python-write", "python-write+fdatasync")


def writer_table(s: Summary) -> list[str]:
    """Writer MB/s against dd and a Python write loop."""
    rows = {r["method"]: r for r in s.rows if r["section"] == "writer"}
    if not rows:
        return []
    dd = _num(rows.get("dd-fdatasync", {}).get("median_gbps"))
    out = ["### Writer bandwidth (best_effort, async writer)", "",
           "| method | MB | median ms (min–max) | MB/s | vs dd-fdatasync | peak RSS / bytes |",
           "|---|---:|---:|---:|---:|---:|"]
    for m in WRITER_METHODS:
        r = rows.get(m)
        if r:
            g = _num(r["median_gbps"])
            out.append(f"| {m} | {int(r['kv_bytes']) / 1e6:,.0f} | {_ms(r)} | {_f(g and g * 1e3, 0)} | "
                       f"{_x(_ratio(g, dd))} | {_x(_num(r['median_peak_rss_ratio']))} |")
    return out + [""]


# ------------------------------------------------------------------ targets
def _verdict(checks: list[tuple[str, float, bool]], fmt: str = "{:.2f}×") -> tuple[str, str]:
    if not checks:
        return "not measured in this run", "not measured"
    failed = [c for c in checks if not c[2]]
    worst = failed[0] if failed else checks[0]
    shown = "; ".join(f"{label}: {fmt.format(v)}" for label, v, _ in checks)
    return shown, "**met**" if not failed else f"**not met** ({len(failed)}/{len(checks)}; e.g. {worst[0]})"


def _cells(s: Summary, section: str) -> Iterator[tuple[str, str, int, str]]:
    """(shape, dtype, prompt tokens, cache state) of every measured cell of `section`, in table order."""
    for shape, dtype in s.groups(section):
        mine = [r for r in s.rows if (r["section"], r["shape"], r["dtype"]) == (section, shape, dtype)]
        states = [st for st in ("cold", "warm") if st in {r["cache_state"] for r in mine}]
        for n in sorted({int(r["prompt_tokens"]) for r in mine}):
            yield from ((shape, dtype, n, st) for st in states)


def target_rows(s: Summary) -> list[tuple[str, str, str]]:
    """(target, measured, status) for each restore target (docs/benchmarks.md#restore-targets)."""
    rows = []
    ttft, proxy, raw, rss, append = [], [], [], [], []
    for shape, dtype, n, st in _cells(s, "ttft"):
        r = s.ratio("ttft", shape, dtype, n, st, "kvtool-ssd-hit", "mlx-lm-load+last")
        if n >= TTFT_MIN_TOKENS and r is not None:
            ttft.append((f"{shape} model {n} {st}", r, r <= TTFT_TARGET))
    for shape, dtype, n, st in _cells(s, "load"):
        label = f"{shape} {dtype} {n} {st}"
        r = s.ratio("load", shape, dtype, n, st, "kvtool", "mlx-lm")
        if shape != "tiny" and n >= TTFT_MIN_TOKENS and r is not None:
            proxy.append((label, r, r <= TTFT_TARGET))
        r = s.ratio("load", shape, dtype, n, st, "raw-read", "kvtool") if st == "cold" else None
        if r is not None:
            raw.append((f"{shape} {dtype} {n}", r, r >= RAW_TARGET))
        v = s.med("load", shape, dtype, n, "kvtool", st, field="median_peak_rss_ratio")
        if v is not None:
            rss.append((label, v, v <= RSS_TARGET))
        a = s.med("load", shape, dtype, n, "kvtool", st, field="median_first_append_ms")
        ref = s.med("load", shape, dtype, n, "append-after-prefill", "n/a")
        if a is not None and ref is not None:
            append.append((label, a, a <= ref * APPEND_FACTOR + APPEND_SLACK_MS))
    rows.append(("SSD-hit TTFT ≤ 1.1× mlx-lm load_prompt_cache TTFT, cold and warm, ≥ 4k tokens, default model",
                 *_verdict(ttft)))
    rows.append(("… and on qwen0.5b-shaped KV (proxy: restore time vs `load_prompt_cache`, no model forward)",
                 *_verdict(proxy)))
    rows.append(("Cold restore throughput ≥ 80% of a raw one-file read", *_verdict(raw, "{:.0%}")))
    rows.append(("Bench restart workload: kvtool ≥ 1.0× mlx-lm's prompt cache",
                 "not part of this benchmark (`kvtool bench`, restart workload)", "not measured"))
    rows.append(("Peak RSS of a restore ≤ 1.25× the KV bytes restored", *_verdict(rss)))
    rows.append((f"First decode step after a restore no dearer than after a prefill (first append ≤ "
                 f"{APPEND_FACTOR}× the after-prefill append + {APPEND_SLACK_MS:g} ms)",
                 *_verdict(append, "{:.1f} ms")))
    w = {r["method"]: _num(r["median_gbps"]) for r in s.rows if r["section"] == "writer"}
    r = _ratio(w.get("kvtool-writer"), w.get("dd-fdatasync"))
    writer = [("kvtool-writer / dd-fdatasync", r, r >= WRITER_TARGET)] if r is not None else []
    rows.append(("Writer ≥ 50% of dd write bandwidth (best_effort)", *_verdict(writer, "{:.0%}")))
    rows.append(("SSD-hit TTFT ≤ 0.5× cold TTFT on an NVIDIA GPU (MLX CUDA)", "CPU run", "not measured"))
    return rows


def targets_table(s: Summary) -> list[str]:
    out = ["## Restore targets", "", "| target | measured (median ratios) | status |", "|---|---|---|"]
    out += [f"| {t} | {m} | {st} |" for t, m, st in target_rows(s)]
    return out + [""]


# ------------------------------------------------------------------ files
def write_csv(path: Path, rows: list[dict], columns: Sequence[str]) -> None:
    """`rows` as a CSV file under the header `columns` (a key missing from a row: empty cell)."""
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(columns))
        w.writeheader()
        w.writerows(rows)


def render(summary: list[dict], doc: dict) -> str:
    """The report.md text."""
    s = Summary(summary)
    m = doc.get("machine", {})
    disk = m.get("cache_disk", {})
    spec = doc.get("spec", {})
    bad = [r for r in summary if r["kv_ok"] is False]
    head = [
        "# Restore benchmark", "",
        f"Run {doc.get('started', '?')}, commit `{(doc.get('git_commit') or '?')[:12]}`, "
        f"{m.get('cpu_model')} ({m.get('cpu_cores')} cores), data on {disk.get('filesystem', '?')} "
        f"({disk.get('device', '?')}{', ' + disk['disk_model'] if disk.get('disk_model') else ''}).",
        f"Command: `{doc.get('command') or '?'}`",
        f"Load average (1/5/15 min) at start {doc.get('load_average_start')}, at end {doc.get('load_average_end')} "
        f"on {m.get('cpu_cores')} cores; duration {doc.get('duration_s')} s.", "",
        *([spec["note"], ""] if spec.get("note") else []),
        f"Repeats: {spec.get('repeats')}, each in a fresh process; medians with (min–max). "
        f"Cold: {doc.get('drop_method')}; warm: files read through first. "
        "`kvtool/mlx-lm` is a time ratio (below 1: kvtool faster); `kvtool/raw` is kvtool's throughput as a "
        "share of a one-file `preadv` of the same bytes. Peak RSS / KV: growth of VmHWM over the restore divided "
        "by the KV bytes. First append: one token appended to every layer right after the restore (a cache "
        "without room is copied whole); after prefill: a decode step's append after a chunked prefill of the "
        "same KV.",
        f"kvtool restore API: **{doc.get('kvtool_api')}**" + LEGACY_NOTE * (doc.get("kvtool_api") == "legacy"),
        "",
    ]
    if bad:
        cells = (" ".join(str(r[k]) for k in KEY[1:]) for r in bad)
        head += ["**Warning:** some rows failed their check (KV crc, token ids or first token): "
                 + ", ".join(cells), ""]
    return "\n".join(head + targets_table(s) + ["## Results", ""] + load_tables(s) + ttft_tables(s) + writer_table(s))


def write_outputs(out: Path, rows: list[dict], doc: dict) -> list[dict]:
    """Write summary.csv and report.md for the rows of a run; returns the summary rows."""
    summary = summarize(rows)
    write_csv(out / "summary.csv", summary, SUMMARY_COLUMNS)
    (out / "report.md").write_text(render(summary, doc))
    return summary


def load_rows(run_dir: Path) -> list[dict]:
    """The rows of a run's measurements.csv (strings)."""
    with open(Path(run_dir) / "measurements.csv", newline="") as fh:
        return list(csv.DictReader(fh))
