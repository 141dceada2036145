"""Redraw the chart (plan.png) of a `kvtool bench-plan --out DIR` run from its plan.json, without
replaying the trace: the points are read back as they were recorded.

    .venv/bin/python scripts/replot_plan.py DIR [DIR ...] [--commit C] [--note TEXT]

A plan.json written before bench-plan recorded its machine and commit has neither: `--commit`
names the commit of the run for the footer, and the machine is this one (marked as such, with no
load average: the load during the run is not known); `--note` adds a last footer line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    from kvtool.bench.machine import cpu_model, total_ram_bytes
    from kvtool.bench.plan_chart import write_plan_chart
    from kvtool.bench.trace_plan import PlanPoint

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dirs", nargs="+", type=Path, help="directories holding a plan.json")
    ap.add_argument("--commit", help="the run's commit, where plan.json does not record it")
    ap.add_argument("--note", default="", help="a last footer line")
    args = ap.parse_args(argv)
    for d in args.dirs:
        doc = json.loads((d / "plan.json").read_text(encoding="utf-8"))
        notes = [args.note] if args.note else []
        if "machine" not in doc:
            doc["machine"] = {"cpu_model": f"{cpu_model()} (the machine of the redraw)", "cpu_cores": os.cpu_count(),
                              "ram_bytes": total_ram_bytes()}  # fmt: skip
        if "git_commit" not in doc and args.commit:
            doc["git_commit"] = args.commit
        points = [PlanPoint(**p) for p in doc["points"]]
        path = write_plan_chart(d / "plan.png", doc, points, " | ".join(notes))
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
