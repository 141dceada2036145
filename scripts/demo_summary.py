"""One line saying what `make demo` showed, from the two `kvtool serve-once --json` documents.

    python scripts/demo_summary.py cold.json warm.json
    -> process 2: 2,037 of 2,038 prompt tokens from SSD; time to first token 15.6 ms vs 1,548 ms cold (99x); same output

Exit 1 if the second process did not hit the SSD tier or gave another output.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _ms(value: float) -> str:
    return f"{value:,.1f} ms" if value < 100 else f"{value:,.0f} ms"


def summary(cold: dict, warm: dict) -> tuple[str, bool]:
    """(the line, whether the demo showed what it should)."""
    c, w = cold["requests"][0], warm["requests"][0]
    same = c["token_ids"] == w["token_ids"]
    speedup = c["ttft_ms"] / w["ttft_ms"] if w["ttft_ms"] > 0 else float("inf")
    line = (
        f"process 2: {w['ssd_hit_tokens']:,} of {w['prompt_tokens']:,} prompt tokens from SSD; "
        f"time to first token {_ms(w['ttft_ms'])} vs {_ms(c['ttft_ms'])} cold ({speedup:,.0f}x); "
        f"{'same output' if same else 'DIFFERENT OUTPUT'}"
    )
    return line, same and w["ssd_hit_tokens"] > 0


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: demo_summary.py COLD.json WARM.json", file=sys.stderr)
        return 2
    cold, warm = (json.loads(Path(p).read_text(encoding="utf-8")) for p in argv)
    line, ok = summary(cold, warm)
    print(line)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
