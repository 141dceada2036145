"""`kvtool serve-once`: load a model, answer one request (or a file of them) through the tiered
cache, shut down cleanly, print what the cache did."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from kvtool.cli import common
from kvtool.cli.output import Output
from kvtool.models.limits import MAX_SEED
from kvtool.prompts import (
    MAX_PROMPT_BYTES,
    Request,
    RequestFileError,
    load_messages,
    load_requests_jsonl,
    read_stdin,
    read_text,
)
from kvtool.units import format_hits

if TYPE_CHECKING:
    from kvtool.engine import Engine  # (MLX: for annotations only)

HELP = """Serve one request (or a JSONL file of requests) through the tiered KV cache, then exit.

Examples:

  kvtool serve-once --prompt-file doc.txt --max-tokens 32

  kvtool serve-once --json -f doc.txt -n 16    (run twice: the 2nd run hits SSD)

  echo "Why is the sky blue?" | kvtool serve-once --prompt - --system-prompt "Be brief."

  kvtool serve-once --messages chat.json --model ~/models/Qwen2.5-0.5B

  kvtool serve-once --requests reqs.jsonl --policy evict_only --ram-bytes 256MiB

  kvtool serve-once -f doc.txt --metrics-file /var/lib/node_exporter/textfile/kvtool.prom

As mlx_lm.generate: --prompt/--prompt-file are wrapped in the model's chat template unless --ignore-chat-template; '-' reads stdin. Unlike mlx_lm.generate, -m is --model (in every kvtool command); -n is --max-tokens.

A prompt file, stdin, --messages or --requests file larger than --max-prompt-bytes (default 64MiB) is refused with one error line (exit 2).

Exit codes: 0 served and shut down cleanly; 1 served but the shutdown was not clean (the writer did not drain); 2 bad input; 130/143 interrupted by SIGINT/SIGTERM (after a clean drain).
"""


MaxPromptBytesOpt = Annotated[
    str, typer.Option("--max-prompt-bytes", help="Largest prompt file, stdin, --messages or --requests file, e.g. 64MiB.",
                      rich_help_panel="Prompt")
]


MetricsFileOpt = Annotated[
    Path | None,
    typer.Option("--metrics-file", show_default=False, rich_help_panel="Output",
                 help="At the end, write this run's Prometheus metrics (text format, the names of kvtool serve's "
                      "GET /metrics) to this file, atomically (a temp file beside it, then a rename); e.g. for "
                      "node_exporter's textfile collector (name it *.prom)."),
]


def check_metrics_file(path: Path | None) -> None:
    """Refuse a `--metrics-file` whose directory does not exist, before any work (shared with `kvtool bench`).

    Raises:
        CLIError: the parent is missing, not a directory or cannot be written in (a read-only
            file system, permissions), or the path is a directory.
    """
    if path is None:
        return
    parent = path.expanduser().parent
    if not parent.is_dir():
        raise common.CLIError(f"--metrics-file {path}: directory {parent} does not exist")
    if path.expanduser().is_dir():
        raise common.CLIError(f"--metrics-file {path}: is a directory")
    if not os.access(parent, os.W_OK | os.X_OK):  # else the run's result would be lost at its end
        raise common.CLIError(f"--metrics-file {path}: cannot write in {parent}")


def make_out_dir(path: Path, flag: str = "--out") -> Path:
    """Create the output directory `path` (and its parents) before any work, so that a path that
    is a file or cannot be created is one `error:` line instead of a traceback after the run
    (shared with `kvtool bench` and `kvtool bench-plan`).

    Raises:
        CLIError: `path` is not a directory and cannot be made one.
    """
    try:
        path.expanduser().mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise common.CLIError(f"{flag} {path}: not a directory") from None
    except OSError as exc:
        raise common.CLIError(f"{flag} {path}: cannot create it: {exc.strerror or exc}") from None
    return path


def write_metrics_file(path: Path | None, stats, records) -> None:
    """Write the metrics of a finished run (final tier `stats`, per-request `records` as dicts).

    Raises:
        CLIError: the file could not be written (one line).
    """
    if path is None:
        return
    from kvtool.prom import metrics_of_run

    try:
        metrics_of_run(stats, records).write(path.expanduser())
    except OSError as exc:
        raise common.CLIError(f"--metrics-file {path}: {exc.strerror or exc}") from None


def parse_max_prompt_bytes(value: str) -> int:
    """`--max-prompt-bytes` in bytes (shared with `kvtool warm`).

    Raises:
        CLIError: not a size, or zero.
    """
    from kvtool.units import parse_size

    n = common.parse_flag(value, parse_size, "--max-prompt-bytes")
    if n < 1:
        raise common.CLIError("--max-prompt-bytes must be at least 1 byte")
    return n


def _read_prompt(prompt: str | None, prompt_file: Path | None, max_bytes: int) -> str | None:
    """`--prompt` / `--prompt-file` as `common.read_prompt_arg` reads them, with stdin and files
    read at most `max_bytes` bytes."""
    import sys

    if prompt == "-" or (prompt is None and prompt_file is not None and str(prompt_file) == "-"):
        name = "--prompt -" if prompt == "-" else "--prompt-file -"
        if sys.stdin is None:
            raise common.CLIError(f"{name}: no stdin")
        return read_stdin(max_bytes, name=f"{name} (stdin)")
    if prompt is None and prompt_file is not None:
        return read_text(prompt_file, max_bytes)
    return common.read_prompt_arg(prompt, None)


def _collect_requests(prompt, prompt_file, messages, requests_file, max_bytes: int = MAX_PROMPT_BYTES) -> list[Request]:
    given = [x is not None for x in (prompt, prompt_file, messages, requests_file)]
    if sum(given) != 1:
        raise common.CLIError("give exactly one of --prompt, --prompt-file, --messages, --requests")
    try:
        text = _read_prompt(prompt, prompt_file, max_bytes)
        if text is not None:
            return [Request(prompt=text)]
        if messages is not None:
            return [Request(messages=load_messages(messages, max_bytes))]
        return load_requests_jsonl(requests_file, max_bytes)
    except RequestFileError as exc:
        raise common.CLIError(str(exc)) from None


def _human_line(i: int, r) -> str:
    return (
        f"[bold]request {i}[/]: prompt {r.prompt_tokens} tok | cached {r.cached_tokens} "
        f"({format_hits(r.ram_hit_tokens, r.ssd_hit_tokens, r.remote_hit_tokens)}) | prefilled {r.prefill_tokens} | "
        f"TTFT {r.ttft_ms:.1f} ms | decode {r.decode_tokens_per_s:.1f} tok/s | {r.finish_reason}"
    )


def tier_summary(stats: dict[str, int]) -> str:
    """What the tiers did in a run, from their final counters (serve-once's last line, serve's stop line)."""
    return (f"{stats.get('ssd_save_success', 0)} block(s) written to SSD, {stats.get('ssd_save_dedup_skip', 0)} dedup, "
            f"{stats.get('ssd_load_hits', 0)} loaded from SSD, {stats.get('kv_ram_evictions', 0)} RAM evictions, "
            f"{stats.get('ssd_load_corrupt', 0)} corrupt")


@common.cache_options(*common.CACHE_OPTIONS)
@common.model_options(*common.MODEL_OPTIONS)
@common.cli_command
def serve_once(
    model: common.ModelOpt = "tiny",
    prompt: Annotated[str | None, typer.Option("--prompt", "-p", help="Prompt text ('-' reads stdin).", rich_help_panel="Prompt")] = None,
    prompt_file: Annotated[Path | None, typer.Option("--prompt-file", "-f", help="File holding the prompt ('-' reads stdin).", rich_help_panel="Prompt")] = None,
    messages: Annotated[
        Path | None, typer.Option("--messages", help="Chat JSON file: a list of {role, content}.", rich_help_panel="Prompt")
    ] = None,
    requests: Annotated[
        Path | None,
        typer.Option("--requests", help="JSONL: one {\"prompt\": ...} or {\"messages\": [...]} per line, optional max_tokens.", rich_help_panel="Prompt"),
    ] = None,
    max_prompt_bytes: MaxPromptBytesOpt = "64MiB",
    max_prompt_tokens: common.MaxPromptTokensOpt = None,
    max_tokens: common.MaxTokensOpt = 64,
    model_flags: common.ModelFlags = common.MODEL,
    temp: Annotated[float, typer.Option("--temp", min=0.0, callback=common.finite_number, help="Sampling temperature; 0 = greedy.", rich_help_panel="Generation")] = 0.0,
    top_p: Annotated[float, typer.Option("--top-p", min=0.0, max=1.0, callback=common.finite_number, help="Nucleus sampling mass.", rich_help_panel="Generation")] = 1.0,
    seed: Annotated[int | None, typer.Option("--seed", min=0, max=MAX_SEED, help="Random seed for sampling (0 to 2^64-1, as mx.random.seed).",
                                             rich_help_panel="Generation")] = None,
    stop: Annotated[list[str] | None, typer.Option("--stop", help="Stop string (repeatable).", rich_help_panel="Generation")] = None,
    cache: common.CacheFlags = common.CACHE,
    json_out: common.JsonOpt = False,
    metrics_file: MetricsFileOpt = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log cache activity.", rich_help_panel="Output")] = False,
) -> int:
    common.setup_logging(verbose)
    with common.signals_raise():  # an Interrupted before serving started: nothing to drain
        check_metrics_file(metrics_file)
        reqs = _collect_requests(prompt, prompt_file, messages, requests, parse_max_prompt_bytes(max_prompt_bytes))
        cfg = cache.build()
        engine = model_flags.load(model, cfg)
        try:
            prompts = _encode_within_limits(engine, reqs, model_flags, max_tokens, max_prompt_tokens)
        except BaseException:
            engine.close()
            raise
        return _serve(engine, reqs, prompts, max_tokens, temp, top_p, seed, stop or [], json_out, metrics_file)


def token_limits(engine: Any, max_prompt_tokens: int | None) -> Any:
    """The token limits of `engine`'s model (`kvtool.models.limits.token_limits`: the rule
    `kvtool serve` answers 413 / 400 by), for serve-once and warm."""
    import logging

    from kvtool.models.limits import token_limits as limits_of

    # the prompt's length is kvtool's to judge (one error line): not the tokenizer's warning about it
    logging.getLogger("transformers.tokenization_utils_base").setLevel(logging.ERROR)
    return limits_of(engine.loaded.path, max_prompt_tokens)


def check_tokens(limits: Any, what: str = "the prompt", *, prompt_tokens: int | None = None,
                 max_tokens: int | None = None, max_tokens_name: str = "--max-tokens") -> None:
    """Refuse, before any prefill, a `max_tokens` past the model's context length or a prompt of
    more than `limits.max_prompt_tokens` tokens (`kvtool.models.limits.TokenLimits`: the rule
    `kvtool serve` answers 400 / 413 by). `what` names the prompt (`request 0`, a source line),
    `max_tokens_name` the option or field.

    Raises:
        CLIError: over a limit (exit 2); the message names the limit and the option that sets it.
    """
    from kvtool.models.limits import TokenLimitError

    try:
        if max_tokens is not None:
            limits.check_max_tokens(max_tokens, max_tokens_name)
        if prompt_tokens is not None:
            limits.check_prompt(prompt_tokens, what)
    except TokenLimitError as exc:
        hint = ("shorten the prompt, or raise --max-prompt-tokens (at most the model's context length)"
                if prompt_tokens is not None and prompt_tokens > limits.max_prompt_tokens
                else f"ask for at most {limits.max_tokens_cap} tokens")
        raise common.CLIError(str(exc), hint=hint) from None


def _encode_within_limits(engine: Engine, reqs, flags: common.ModelFlags, max_tokens: int,
                          max_prompt_tokens: int | None) -> list:
    """Every request's token ids (the chat template unless `flags.ignore_chat_template`, with
    `flags.system_prompt`), each checked by `check_tokens` (the flag's and the request's own
    `max_tokens`, the prompt's length) before any prefill.

    Raises:
        CLIError: a request cannot be encoded, or is over a limit.
    """
    limits = token_limits(engine, max_prompt_tokens)
    check_tokens(limits, max_tokens=max_tokens)
    out = []
    for i, req in enumerate(reqs):
        try:
            ids = engine.encode(prompt=req.prompt, messages=req.messages, chat_template=not flags.ignore_chat_template,
                                system_prompt=flags.system_prompt)
        except ValueError as exc:
            raise common.CLIError(f"request {i}: {exc}") from None
        what = "the prompt" if len(reqs) == 1 else f"request {i}"
        check_tokens(limits, what, prompt_tokens=len(ids), max_tokens=req.max_tokens,
                            max_tokens_name=f"{what}: max_tokens")
        out.append(ids)
    return out


def _serve(engine: Engine, reqs, prompts, max_tokens, temp, top_p, seed, stop, json_out, metrics_file=None) -> int:
    results, interrupted, out = [], None, Output.from_flags(json_out)
    warmup_ms = engine.warmup()  # kernel compilation stays out of every TTFT
    try:
        for i, (req, ids) in enumerate(zip(reqs, prompts, strict=True)):
            res = engine.generate(
                ids, max_tokens=req.max_tokens or max_tokens, temp=temp, top_p=top_p, seed=seed, stop=stop
            )
            results.append(res)
            out.print(res.text, markup=False, soft_wrap=False)
            out.print(_human_line(i, res))
    except common.Interrupted as exc:
        interrupted = exc
    finally:
        common.ignore_signals()  # the clean path also on SIGINT/SIGTERM: drain, flush, then exit
        ssd_reason = engine.cache.ssd_disabled_reason
        status = engine.close()
        stats = engine.stats()  # after the drain: every accepted write is counted
    write_metrics_file(metrics_file, stats, [r.to_dict() for r in results])
    out.emit(lambda: {
        "requests": [r.to_dict() for r in results],
        "stats": stats,
        "shutdown_clean": status.shutdown_clean,
        "shutdown_partial_flush": status.shutdown_partial_flush,
        "layout_key": engine.layout_key,
        "uncached_reason": engine.uncached_reason,
        "ssd_disabled_reason": ssd_reason if engine.uncached_reason is None else None,
        "warmup_ms": round(warmup_ms, 3),
        **({"interrupted": interrupted.args[0]} if interrupted is not None else {}),
    }, lambda: out.print((f"[yellow]interrupted ({interrupted.args[0]})[/]: " if interrupted is not None else "")
                         + f"[dim]cache: {tier_summary(stats)}, shutdown_clean={status.shutdown_clean}[/]"))
    if interrupted is not None:
        return 128 + interrupted.signum
    return common.EXIT_OK if status.shutdown_clean else common.EXIT_PROBLEMS


def register(app: typer.Typer) -> None:
    app.command("serve-once", help=HELP, no_args_is_help=False)(serve_once)
