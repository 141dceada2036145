"""Multi-turn chat TTFT: `kvtool serve` vs plain `mlx_lm.server` (in-memory prompt cache), restart included.

Both servers answer the same greedy conversation (long system prompt, then user turns that carry
the history) over streamed `/v1/chat/completions`; both are restarted after `--restart-after`
turns (mlx-lm's prompt cache is lost, kvtool's SSD tier survives). TTFT per turn = time to the
first content chunk, median over `--repeats` conversations. Logic: kvtool/bench/serve_chat.py.

Examples:

    .venv/bin/python bench_configs/serve_chat.py                          # tiny model, 6 turns, 3 repeats
    .venv/bin/python bench_configs/serve_chat.py --model small --turns 8 --restart-after 4 --repeats 5
    .venv/bin/python bench_configs/serve_chat.py --model ~/models/Qwen2.5-0.5B-Instruct --system-chars 20000

Output: results/serve_chat/<timestamp>/ (or --out) with turns.csv, summary.csv, run.json and
report.md (the markdown table, also printed).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from kvtool.bench.serve_chat import SERVERS, ServeChatConfig, run  # noqa: E402


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    d = ServeChatConfig()
    ap.add_argument("--model", default=d.model, help=f"kvtool preset or model directory (default: {d.model})")
    ap.add_argument("--turns", type=int, default=d.turns, help=f"user turns (default: {d.turns})")
    ap.add_argument("--restart-after", type=int, default=d.restart_after,
                    help=f"restart both servers after this turn, 0: never (default: {d.restart_after})")
    ap.add_argument("--repeats", type=int, default=d.repeats, help=f"conversations per server (default: {d.repeats})")
    ap.add_argument("--max-tokens", type=int, default=d.max_tokens, help=f"tokens per reply (default: {d.max_tokens})")
    ap.add_argument("--system-chars", type=int, default=d.system_chars,
                    help=f"system prompt length in characters (default: {d.system_chars})")
    ap.add_argument("--block-size", type=int, default=None, help="kvtool block size (default: kvtool's)")
    ap.add_argument("--ram-bytes", default=None, help="kvtool RAM tier budget, e.g. 512MiB (default: kvtool's)")
    ap.add_argument("--servers", default=",".join(SERVERS), help="comma-separated subset of mlx-lm,kvtool")
    ap.add_argument("--no-warmup", action="store_true", help="no warm-up request after each (re)start")
    ap.add_argument("--out", type=Path, default=None, help="run directory (default: results/serve_chat/<timestamp>)")
    ap.add_argument("--work-dir", type=Path, default=None, help="kvtool cache directories (default: temp, removed)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    servers = tuple(s.strip() for s in args.servers.split(",") if s.strip())
    if not servers or any(s not in SERVERS for s in servers):
        print(f"error: --servers: choose from {', '.join(SERVERS)}", file=sys.stderr)
        return 2
    cfg = ServeChatConfig(model=args.model, turns=args.turns, restart_after=args.restart_after, repeats=args.repeats,
                          max_tokens=args.max_tokens, system_chars=args.system_chars, block_size=args.block_size,
                          ram_bytes=args.ram_bytes, warmup=not args.no_warmup, out=args.out, work_dir=args.work_dir,
                          servers=servers)
    try:
        run_dir = run(cfg)
    except (ValueError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print((run_dir / "report.md").read_text())
    print(f"written: {run_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
