"""Multi-turn chat through `kvtool serve` against plain `mlx_lm.server`, with a server restart.

Both servers run side by side as subprocesses on the same model and answer the same conversation
over HTTP with streaming chat requests (greedy): a long system prompt, then `turns` user
messages, each turn carrying the previous turns and that server's own replies; every turn goes
to both servers, in an order that alternates (paired measurements on a shared machine). After turn `restart_after` each
server is stopped (SIGTERM) and started again: mlx-lm's in-memory prompt cache is gone, kvtool's
RAM tier too, but its SSD tier (same `--cache-dir`) survives. Every repeat starts from an empty
kvtool cache directory.

Per turn: TTFT = request sent to the first SSE chunk whose delta has content (a streamed
`/v1/chat/completions` with `stream_options.include_usage`), the total time, the prompt and
cached tokens the server reports (`usage.prompt_tokens_details.cached_tokens`) and, for kvtool,
the RAM/SSD split (`GET /kvtool/stats`). After each (re)start one short unrelated request warms
the kernels up (not recorded), so TTFT measures the prompt cache, not MLX's first-call costs.

    from kvtool.bench.serve_chat import ServeChatConfig, run
    run_dir = run(ServeChatConfig(model="tiny", repeats=3))   # turns.csv, summary.csv, report.md, run.json

Script: bench_configs/serve_chat.py.
"""

from __future__ import annotations

import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from kvtool.bench.loadcell import WARMUP_MESSAGES
from kvtool.bench.loadgen import LoadRequest, LoadSpec, RequestRecord, run_load
from kvtool.bench.loadserver import KVTOOL, MLXLM, REPO, ManagedServer, ServerOptions
from kvtool.bench.restore_report import write_csv

SERVERS = (MLXLM, KVTOOL)
START_TIMEOUT_S = 120.0
REQUEST_TIMEOUT_S = 600.0
USER_MESSAGES = (
    "What does the text above say about modules and packages? Answer briefly.",
    "Which functions does it mention, and what do they return?",
    "Now compare that with what it says about classes and instances.",
    "Is there anything about exceptions? Quote the relevant sentence.",
    "Summarise the whole discussion so far in three bullet points.",
    "Finally, what would you read next in the documentation, and why?",
    "One more question: which parts were unclear to you?",
    "Thank you. Give the single most important takeaway.",
)


@dataclass
class ServeChatConfig:
    """Settings of one run.

    Attributes:
        model: kvtool preset, local model directory (mlx_lm.server gets the resolved path).
        turns: user turns of the conversation (<= len(USER_MESSAGES)).
        restart_after: restart both servers after this turn (0: never).
        repeats: whole conversations per server (medians are reported).
        max_tokens: tokens generated per turn.
        system_chars: characters of the system prompt (from kvtool/assets/demo_prompt.txt, repeated).
        block_size, ram_bytes: kvtool cache settings (None: kvtool's defaults).
        warmup: one short unrelated request after each (re)start, not recorded.
        out: run directory (default results/serve_chat/<timestamp>).
        work_dir: where kvtool's cache directories go (default: a temp dir, removed after).
    """

    model: str = "tiny"
    turns: int = 6
    restart_after: int = 3
    repeats: int = 3
    max_tokens: int = 16
    system_chars: int = 8000
    block_size: int | None = None
    ram_bytes: str | None = None
    warmup: bool = True
    out: Path | None = None
    work_dir: Path | None = None
    servers: tuple[str, ...] = field(default=SERVERS)


@dataclass
class TurnResult:
    """One turn of one conversation on one server. Times in ms."""

    server: str
    repeat: int
    turn: int
    after_restart: bool
    prompt_tokens: int
    cached_tokens: int
    ram_hit_tokens: int | None
    ssd_hit_tokens: int | None
    fetch_ms: float | None  # kvtool: the cache lookup + SSD restore inside TTFT
    ttft_ms: float
    total_ms: float
    text: str


# --------------------------------------------------------------------------- servers
def start_server(kind: str, cfg: ServeChatConfig, model_path: str, log: Path, cache_dir: Path) -> ManagedServer:
    """`kvtool serve` (on `cache_dir`, with the run's block size and RAM budget) or `mlx_lm.server`,
    ready (`kvtool.bench.loadserver.ManagedServer`; stderr to `log`)."""
    args = [*(["--block-size", str(cfg.block_size)] if cfg.block_size else []),
            *(["--ram-bytes", cfg.ram_bytes] if cfg.ram_bytes else [])]
    options = ServerOptions(kind, cfg.model, model_path, cache_dir if kind == KVTOOL else None, tuple(args),
                            start_timeout_s=START_TIMEOUT_S)
    return ManagedServer(options, log)


def chat_turn(server: ManagedServer, messages: Sequence[dict[str, str]], max_tokens: int) -> RequestRecord:
    """One streamed greedy chat request through the load generator (`kvtool.bench.loadgen`):
    its `ttft_ms` (first content chunk), `latency_ms` (whole stream), `text` and `usage` tokens.

    Raises:
        RuntimeError: the request failed (HTTP error, timeout after `REQUEST_TIMEOUT_S`).
    """
    spec = LoadSpec(clients=1, max_wall_s=REQUEST_TIMEOUT_S, request_timeout_s=REQUEST_TIMEOUT_S)
    result = run_load(server.base_url, [LoadRequest("turn", tuple(messages), max_tokens)], spec)
    if not result.records or result.records[0].error:
        raise RuntimeError(result.records[0].error if result.records else "the request was not sent")
    return result.records[0]


# --------------------------------------------------------------------------- conversation
def system_prompt(chars: int) -> str:
    text = (REPO / "kvtool" / "assets" / "demo_prompt.txt").read_text()
    return ("You answer questions about the following text.\n\n" + text * (chars // len(text) + 1))[:chars]


def run_repeat(cfg: ServeChatConfig, repeat: int, model_path: str, log_dir: Path,
               cache_dir: Path) -> list[TurnResult]:
    """One whole conversation per server kind, the servers side by side: each turn goes to every
    server in turn (the order alternates per turn and repeat, so that the load of a shared
    machine hits both alike), each with its own history; the restart stops and starts them all.
    Returns one row per server and turn."""
    system = system_prompt(cfg.system_chars)

    def start(kind: str) -> ManagedServer:
        server = start_server(kind, cfg, model_path, log_dir / f"{kind}-r{repeat}.log", cache_dir)
        if cfg.warmup:
            chat_turn(server, WARMUP_MESSAGES, 2)
        return server

    servers: dict[str, ManagedServer] = {}
    rows: list[TurnResult] = []
    history = {kind: [{"role": "system", "content": system}] for kind in cfg.servers}
    try:
        for kind in cfg.servers:
            servers[kind] = start(kind)
        for turn in range(1, cfg.turns + 1):
            after_restart = bool(cfg.restart_after) and turn == cfg.restart_after + 1
            if after_restart:
                for kind in cfg.servers:
                    servers.pop(kind).stop()
                for kind in cfg.servers:
                    servers[kind] = start(kind)
            order = cfg.servers if (turn + repeat) % 2 else tuple(reversed(cfg.servers))
            for kind in order:
                messages = history[kind]
                messages.append({"role": "user", "content": USER_MESSAGES[(turn - 1) % len(USER_MESSAGES)]})
                r = chat_turn(servers[kind], messages, cfg.max_tokens)
                ram = ssd = fetch = None
                if kind == "kvtool":
                    last = servers[kind].get_json("/kvtool/stats")["requests"][-1]
                    ram, ssd, fetch = last["ram_hit_tokens"], last["ssd_hit_tokens"], last["fetch_ms"]
                rows.append(TurnResult(kind, repeat, turn, after_restart, r.prompt_tokens, r.cached_tokens or 0, ram,
                                       ssd, fetch, r.ttft_ms, r.latency_ms, r.text))
                messages.append({"role": "assistant", "content": r.text})
    finally:
        for server in servers.values():
            server.stop()
    return rows


# --------------------------------------------------------------------------- output
def summarize(rows: list[TurnResult]) -> list[dict[str, Any]]:
    """Median per (server, turn) over repeats."""
    out = []
    keys = sorted({(r.server, r.turn) for r in rows}, key=lambda k: (k[1], SERVERS.index(k[0]) if k[0] in SERVERS else 9))
    for server, turn in keys:
        sel = [r for r in rows if r.server == server and r.turn == turn]
        med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
        out.append({
            "server": server, "turn": turn, "after_restart": sel[0].after_restart, "repeats": len(sel),
            "prompt_tokens": sel[0].prompt_tokens, "cached_tokens": med([r.cached_tokens for r in sel]),
            "ram_hit_tokens": med([r.ram_hit_tokens for r in sel if r.ram_hit_tokens is not None]),
            "ssd_hit_tokens": med([r.ssd_hit_tokens for r in sel if r.ssd_hit_tokens is not None]),
            "fetch_ms_median": med([r.fetch_ms for r in sel if r.fetch_ms is not None]),
            "ttft_ms_median": med([r.ttft_ms for r in sel]), "ttft_ms_min": min(r.ttft_ms for r in sel),
            "ttft_ms_max": max(r.ttft_ms for r in sel), "total_ms_median": med([r.total_ms for r in sel]),
        })  # fmt: skip
    return out


def markdown_table(summary: list[dict[str, Any]], rows: list[TurnResult]) -> str:
    """Per turn: prompt tokens, each server's cached tokens and median TTFT, the ratio, same output."""
    by = {(s["server"], s["turn"]): s for s in summary}
    turns = sorted({s["turn"] for s in summary})
    lines = ["| turn | prompt tok | mlx-lm cached tok | mlx-lm TTFT ms | kvtool cached tok (RAM / SSD) | kvtool TTFT ms "
             "| mlx-lm / kvtool | same output |", "|---|---|---|---|---|---|---|---|"]
    for t in turns:
        m, k = by.get(("mlx-lm", t)), by.get(("kvtool", t))
        first = m or k
        assert first is not None  # every turn has a row of one server at least
        label = f"{t} (after restart)" if first["after_restart"] else str(t)
        prompt = first["prompt_tokens"]
        m_cached = f"{m['cached_tokens']:.0f}" if m else "-"
        m_ttft = f"{m['ttft_ms_median']:.1f}" if m else "-"
        k_cached = f"{k['cached_tokens']:.0f} ({k['ram_hit_tokens']:.0f} / {k['ssd_hit_tokens']:.0f})" if k else "-"
        k_ttft = f"{k['ttft_ms_median']:.1f}" if k else "-"
        ratio = f"{m['ttft_ms_median'] / k['ttft_ms_median']:.2f}" if m and k and k["ttft_ms_median"] else "-"
        texts = {(r.server, r.repeat): r.text for r in rows if r.turn == t}
        reps = sorted({r.repeat for r in rows})
        same = all(texts.get(("mlx-lm", i)) == texts.get(("kvtool", i)) for i in reps) if m and k else None
        lines.append(f"| {label} | {prompt} | {m_cached} | {m_ttft} | {k_cached} | {k_ttft} | {ratio} | "
                     f"{'yes' if same else ('-' if same is None else 'NO')} |")
    return "\n".join(lines)


def write_report(run_dir: Path, cfg: ServeChatConfig, rows: list[TurnResult], meta: dict[str, Any]) -> str:
    summary = summarize(rows)
    write_csv(run_dir / "turns.csv", [asdict(r) for r in rows], [f.name for f in fields(TurnResult)])
    write_csv(run_dir / "summary.csv", summary, list(summary[0]))
    table = markdown_table(summary, rows)
    text = (
        f"# Multi-turn chat: `kvtool serve` vs `mlx_lm.server`\n\n"
        f"Model `{cfg.model}`, {cfg.turns} turns, restart of both servers after turn {cfg.restart_after}, "
        f"{cfg.repeats} repeat(s) (median TTFT), {cfg.max_tokens} tokens per reply, greedy, streamed; "
        f"system prompt {cfg.system_chars} characters. TTFT = request sent to the first content chunk. "
        f"mlx-lm: its in-memory prompt cache (`LRUPromptCache`, lost at the restart); kvtool: RAM tier + SSD "
        f"tier (kept across the restart). Ratio > 1: kvtool faster.\n\n{table}\n\n"
        f"Machine: {meta.get('machine', {}).get('cpu_model')}, git {meta.get('git_commit')}. "
        f"Raw rows: turns.csv; medians: summary.csv.\n"
    )
    (run_dir / "report.md").write_text(text)
    return table


def run(cfg: ServeChatConfig) -> Path:
    """Run the benchmark; returns the run directory (turns.csv, summary.csv, report.md, run.json)."""
    from kvtool.bench.machine import git_commit, machine_info
    from kvtool.models.loader import resolve_spec

    if not 1 <= cfg.turns <= len(USER_MESSAGES):
        raise ValueError(f"turns must be 1..{len(USER_MESSAGES)}")
    if not 0 <= cfg.restart_after < cfg.turns:
        raise ValueError("restart_after must be 0..turns-1")
    model_path = str(resolve_spec(cfg.model)[0])
    run_dir = cfg.out or REPO / "results" / "serve_chat" / time.strftime("%Y%m%d-%H%M%S")
    run_dir.mkdir(parents=True, exist_ok=True)
    work = Path(cfg.work_dir) if cfg.work_dir else Path(tempfile.mkdtemp(prefix="kvtool-serve-chat-"))
    rows: list[TurnResult] = []
    try:
        for repeat in range(cfg.repeats):
            cache_dir = work / f"cache-r{repeat}"  # every repeat starts from an empty kvtool cache
            shutil.rmtree(cache_dir, ignore_errors=True)
            rows += run_repeat(cfg, repeat, model_path, run_dir, cache_dir)
        meta = {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()},
                "model_path": model_path, "git_commit": git_commit(REPO), "machine": machine_info(work),
                "command": " ".join(sys.argv)}
    finally:
        if not cfg.work_dir:
            shutil.rmtree(work, ignore_errors=True)
    (run_dir / "run.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")
    write_report(run_dir, cfg, rows, meta)
    return run_dir


__all__ = ["ServeChatConfig", "TurnResult", "run", "run_repeat", "chat_turn", "summarize", "markdown_table",
           "write_report", "start_server"]
