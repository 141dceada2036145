"""Restore benchmark (docs/benchmarks.md#restore-path): raw read vs mlx-lm's prompt cache vs kvtool's SSD restore.

For prompt lengths and KV shapes (the `tiny` preset's real KV, `qwen0.5b`-shaped synthetic KV in
float32 and bfloat16), each cold (page cache dropped) and warm, every measurement in a fresh
process: a raw one-file read of the same bytes, mlx-lm `load_prompt_cache`, kvtool `fetch`
(bytes, peak RSS); TTFT of the real `tiny` model (SSD hit vs recompute vs mlx-lm load + last
token); kvtool's writer MB/s against dd. Logic: kvtool/bench/restore.py.

Examples:

    .venv/bin/python bench_configs/restore.py                                   # full run
    .venv/bin/python bench_configs/restore.py --lengths 1024,4096 --repeats 3
    .venv/bin/python bench_configs/restore.py --repeats 5 --recompute-repeats 2  # the README's run
    .venv/bin/python bench_configs/restore.py --shapes tiny --parts load --lengths 256 --repeats 1
    .venv/bin/python bench_configs/restore.py --report results/restore/20260101-120000   # re-render

Output: results/restore/<timestamp>/ with measurements.csv, summary.csv, run.json, report.md.
Cold runs evict the files with posix_fadvise (falling back to drop_caches, which needs root).
Measure a tree nobody edits during the run (e.g. a copy of the working tree, run from there):
every restore is checked (crc of the KV, token ids, first token), and a row whose check failed
is named at the top of report.md. The load average at start and end is recorded there too.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from dataclasses import fields
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from kvtool.bench import restore, restore_report  # noqa: E402
from kvtool.bench.restore_pagecache import DROP_METHODS  # noqa: E402
from kvtool.bench.restore_worker import API_CHOICES  # noqa: E402


def _csv(kind):
    def parse(text: str) -> tuple:
        try:
            return tuple(kind(x.strip()) for x in text.split(",") if x.strip())
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return parse


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=_csv(int), default=restore.DEFAULT_LENGTHS,
                    help="prompt lengths in tokens, comma-separated (default: 1024,4096,16384,32768)")
    ap.add_argument("--shapes", type=_csv(str), default=restore.DEFAULT_SHAPES,
                    help=f"load-path KV shapes (default: {','.join(restore.SHAPES)})")
    ap.add_argument("--states", type=_csv(str), default=restore.STATES, help="cold,warm (default: both)")
    ap.add_argument("--repeats", type=int, default=restore.DEFAULT_REPEATS, help="measurements per cell (default: 3)")
    ap.add_argument("--recompute-repeats", type=int, default=None,
                    help="TTFT recompute measurements per length (default: --repeats)")
    ap.add_argument("--parts", type=_csv(str), default=restore.PARTS, help="load,ttft,writer (default: all)")
    ap.add_argument("--methods", type=_csv(str), default=("raw-read", "mlx-lm", "kvtool"),
                    help="load-path methods (default: raw-read,mlx-lm,kvtool)")
    ap.add_argument("--out", type=Path, default=None, help="run directory (default: results/restore/<timestamp>)")
    ap.add_argument("--work-dir", type=Path, default=None, help="data files (default: <out>/data, removed after)")
    ap.add_argument("--keep-data", action="store_true", help="keep the data files")
    ap.add_argument("--drop", choices=DROP_METHODS, default="fadvise",
                    help="how to drop the page cache (default: fadvise)")
    ap.add_argument("--kvtool-api", choices=API_CHOICES, default="auto",
                    help="kvtool's restore API: kvtool.cache.prefix (auto = prefix)")
    ap.add_argument("--block-size", type=int, default=None, help="kvtool block size (default: kvtool's)")
    ap.add_argument("--ttft-model", default="tiny", help="embedded preset for the TTFT part (default: tiny)")
    ap.add_argument("--ttft-kv", choices=("prefill", "synthetic"), default="prefill",
                    help="TTFT caches hold the prompt's prefilled KV, or the same synthetic KV without a "
                         "prefill (for presets whose prefill takes hours here, e.g. qwen0.5b)")
    ap.add_argument("--writer-mb", type=float, default=restore.DEFAULT_WRITER_MB, help="MB per writer measurement")
    ap.add_argument("--writer-shape", default="qwen0.5b-f32", help="KV shape written by the writer part")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--note", default="", help="free text shown at the top of report.md")
    ap.add_argument("--report", type=Path, default=None, metavar="RUN_DIR",
                    help="only re-render summary.csv and report.md of an existing run")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.report is not None:
        doc = json.loads((args.report / "run.json").read_text())
        restore_report.write_outputs(args.report, restore_report.load_rows(args.report), doc)
        print(args.report / "report.md")
        return 0
    spec = restore.RestoreSpec(**{f.name: getattr(args, f.name) for f in fields(restore.RestoreSpec)
                                  if hasattr(args, f.name)})  # every option but --report is a spec field
    try:
        spec.validate()
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    command = " ".join(["python bench_configs/restore.py", *map(shlex.quote, sys.argv[1:] if argv is None else argv)])
    out = restore.run(spec, command=command)
    print(out / "report.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
