"""`kvtool warm`: prefill prompts into the SSD tier (no decode), with a progress bar on a terminal
and a progress line at most every 10 s without one (`kvtool.progress`)."""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kvtool.cli import common
from kvtool.cli.output import Output
from kvtool.progress import progress
from kvtool.units import format_bytes

if TYPE_CHECKING:
    from kvtool.engine import Engine  # (MLX: for annotations only)

HELP = """Prefill prompts into the SSD tier ahead of time (no decode), so later requests start from cached KV.

SOURCE is a text file (one prompt per non-blank line, or the whole file with --whole), a .jsonl file of {"prompt": ...} or {"messages": [...]} lines, or a directory whose .txt/.md files are one prompt each; all sources together hold at most --max-prompt-bytes (default 64MiB). Plain prompts are wrapped in the model's chat template like serve-once does (--ignore-chat-template: raw text), so a warmed prompt hits. A prompt whose blocks are all on SSD already is skipped without running the model, so a second identical run writes 0 blocks. Every block reaches SSD before the command exits (whatever the policy), under the --async/--sync and --durability settings; with --ssd-max-bytes, the budget evicts least recently used segments and stores no more than fits: the summary says what was written and what is still resident, and one note line what the budget evicted or had no room for. Ctrl-C stops after draining the writer; what was written stays valid.

Examples:

  kvtool warm --model tiny prompts.txt

  kvtool warm --model ~/models/Qwen2.5-0.5B-Instruct-4bit --whole doc1.txt doc2.txt --json

  kvtool warm --model tiny --durability durable docs/ requests.jsonl

  kvtool warm --model tiny prompts.txt 2>> warm.log    (no terminal: a progress line every 10 s, KVTOOL_PROGRESS_INTERVAL_S)

Exit codes: 0 warmed and shut down cleanly; 1 some blocks could not be written (a write failure; not what the --ssd-max-bytes budget had no room for) or the writer did not drain; 2 bad input (source, model, options); 130/143 interrupted by SIGINT/SIGTERM (after draining the writer).
"""

WholeOpt = Annotated[
    bool, typer.Option("--whole", help="Each text file is one prompt (default: one prompt per line).")
]


@common.cache_options(*(name for name in common.CACHE_OPTIONS if name != "no_ssd"))
@common.model_options(*common.MODEL_OPTIONS)
@common.cli_command
def warm_cmd(
    sources: Annotated[list[Path], typer.Argument(help="Text files, .jsonl files or directories.", show_default=False)],
    model: common.ModelOpt = "tiny",
    whole: WholeOpt = False,
    max_prompt_bytes: Annotated[
        str, typer.Option("--max-prompt-bytes", help="Most bytes read from all sources together, e.g. 64MiB.")
    ] = "64MiB",
    max_prompt_tokens: common.MaxPromptTokensOpt = None,
    model_flags: common.ModelFlags = common.MODEL,
    cache: common.CacheFlags = common.CACHE,
    json_out: common.JsonOpt = False,
    verbose: common.VerboseOpt = False,
    to_remote: Annotated[bool, typer.Option(
        "--to-remote", help="Then push the namespace's SSD blocks to the remote tier (remote_url; SET NX), so "
        "other hosts start warm. One summary line on stderr.", rich_help_panel="Cache")] = False,
) -> int:
    common.setup_logging(verbose)
    from kvtool.cli.cmd_serve import parse_max_prompt_bytes, token_limits
    from kvtool.jobs.warm import WarmError, check_engine, load_sources

    try:
        prompts = load_sources(sources, whole=whole, max_bytes=parse_max_prompt_bytes(max_prompt_bytes))
    except WarmError as exc:
        raise common.CLIError(str(exc)) from None
    cfg = cache.build()
    with common.nothing_left_empty(Path(cfg.ssd_cache_dir)) as opened:  # e.g. its only prompt refused
        engine = model_flags.load(model, cfg)
        namespace_dir = engine.namespace_dir
        if namespace_dir is not None:
            opened.append(namespace_dir)
        try:
            check_engine(engine)
        except WarmError as exc:
            engine.close()
            raise common.CLIError(str(exc)) from None
        if to_remote and cfg.remote_url is None:
            engine.close()
            raise common.CLIError("--to-remote: no remote server: set remote_url (config, $KVTOOL_REMOTE_URL)")
        code = _run(engine, prompts, json_out, not model_flags.ignore_chat_template, model_flags.system_prompt,
                    token_limits(engine, max_prompt_tokens))
    if to_remote and code == common.EXIT_OK and namespace_dir is not None:
        code = _push(namespace_dir, cfg)
    return code


def _push(namespace_dir: Path, cfg) -> int:
    """`--to-remote`: the namespace's verified SSD blocks to the remote tier; one stderr line."""
    import sys

    from kvtool.jobs.remote_push import open_store_for, push_namespace

    store = open_store_for(namespace_dir, cfg.remote_url, timeout_s=cfg.remote_timeout_s,
                           cluster=True if cfg.remote_cluster else None)
    try:
        if not store.available:
            raise common.CLIError(f"--to-remote: the remote server {store.url} does not answer")
        r = push_namespace(namespace_dir, store)
    finally:
        store.close()
    why = f" ({r.error})" if r.error else ""
    print(f"pushed to {store.url}: {r.blocks_read} block(s) read, {r.blocks_stored} stored (new on the server), "
          f"{r.blocks_failed} not stored{why}, {r.bad_records} bad record(s), {len(r.unreadable_segments)} "
          "unreadable segment(s)", file=sys.stderr)  # fmt: skip
    return common.EXIT_OK if not r.problems else 1  # (PushReport.problems: as `kvtool remote push` counts)


def _run(engine: Engine, prompts, json_out: bool, chat_template: bool = True, system_prompt=None, limits=None) -> int:
    from kvtool.jobs.warm import WarmError, WarmReport, update_counts, warm

    report = WarmReport(engine.layout_key, str(engine.namespace_dir), len(prompts))
    namespace_dir = engine.namespace_dir  # None once the engine is closed
    base, status = engine.stats(), None
    with common.signals_raise():
        try:
            with _progress(len(prompts), enabled=not json_out) as on_report:
                try:
                    report = warm(engine, prompts, progress=on_report, interrupts=(common.Interrupted,),
                                  chat_template=chat_template, system_prompt=system_prompt, limits=limits)
                finally:
                    common.ignore_signals()
                    status = engine.close()  # drains the writer, flushes and closes the index
                update_counts(report, base, engine.stats())  # once drained: what reached the disk
                if on_report is not None:  # the closing progress line shows these, not the last prompt's
                    on_report(report, closing=True)
        except common.Interrupted as exc:  # a signal outside the prompt loop
            report.interrupted = exc.args[0]
            update_counts(report, base, engine.stats())
        except WarmError as exc:
            raise common.CLIError(str(exc)) from None
        finally:
            common.ignore_signals()
            if status is None:  # interrupted before the prompts began
                status = engine.close()
    report.blocks_resident, report.bytes_resident = _resident(namespace_dir)
    if (report.blocks_evicted or report.blocks_over_budget) and not json_out:
        common.err_console.print(f"note: {_budget_note(report)}", highlight=False, soft_wrap=True)
    out = Output.from_flags(json_out)
    out.emit(lambda: {**report.to_dict(), "shutdown_clean": status.shutdown_clean,
                      "shutdown_partial_flush": status.shutdown_partial_flush},
             lambda: _print_summary(report, status, out))
    if report.interrupted:
        return 128 + getattr(signal.Signals, report.interrupted, signal.SIGINT).value
    ok = status.shutdown_clean and report.flushed and report.blocks_failed == 0
    return common.EXIT_OK if ok else common.EXIT_PROBLEMS


@contextmanager
def _progress(total: int, enabled: bool) -> Iterator[Callable[..., None] | None]:
    """Warm's `progress(report, closing=False)`: one rich bar (prompts, tokens, blocks, bytes) on a
    terminal when `enabled` (not --json), progress lines (`kvtool.progress.LineProgress`) whenever
    stderr is not a terminal; None when nothing is shown. `closing`: the counts once the writer
    drained, shown by the closing line (`done: ...`) rather than by one more line."""
    columns = (TextColumn("warm"), BarColumn(), MofNCompleteColumn(), TextColumn("prompts"),
               TextColumn("{task.fields[tokens]} tok | {task.fields[blocks]} blocks | {task.fields[bytes]}"),
               TimeElapsedColumn())  # fmt: skip
    with progress("kvtool warm", *columns, console=common.err_console, bar=enabled) as bar:
        if bar is None:
            yield None
            return
        task = bar.add_task("warm", total=total, tokens=0, blocks=0, bytes=format_bytes(0))

        def on_report(report, closing: bool = False) -> None:
            update = Progress.update if closing else type(bar).update  # Progress.update: no line printed
            update(bar, task, completed=report.prompts_done, tokens=report.tokens, blocks=report.blocks_written,
                   bytes=format_bytes(report.bytes_written))

        yield on_report


def _print_summary(report, status, out: Output) -> None:
    head = "[yellow]interrupted[/]: " if report.interrupted else ""
    out.print(
        f"{head}warmed {report.prompts_done}/{report.prompts_total} prompt(s): "
        f"{report.prompts_prefilled} prefilled, {report.prompts_skipped} already cached (skipped), "
        f"{report.prompts_too_short} single-token | "
        f"{report.tokens} tokens, {report.tokens_prefilled} run through the model",
    )  # fmt: skip
    resident = ("?" if report.blocks_resident is None else
                f"{report.blocks_resident} block(s) ({format_bytes(report.bytes_resident or 0)})")  # fmt: skip
    out.print(
        f"SSD: {report.blocks_written} block(s) written ({format_bytes(report.bytes_written)}), "
        f"{report.blocks_dedup} already stored, {report.blocks_failed} failed | now resident: {resident} | "
        f"namespace {report.layout_key} | {report.elapsed_s:.1f} s | shutdown_clean={status.shutdown_clean}",
    )  # fmt: skip


def _budget_note(report) -> str:
    """The one line that sums up the SSD byte budget's work: what it evicted and what it had no
    room for (the store answers 'refused' for those, which the writer counts without a warning)."""
    return (f"the SSD byte budget evicted {report.blocks_evicted} block(s) ({format_bytes(report.bytes_evicted)}) "
            f"and had no room for {report.blocks_over_budget} more (not stored)")


def _resident(namespace_dir: Path | None) -> tuple[int | None, int | None]:
    """`(blocks, bytes)` the namespace holds on SSD now (`kvtool.ops.inspect_cache`: its index
    rows and segment bytes); `(None, None)` when there is none or it cannot be read."""
    from kvtool.ops.inspect_cache import inspect_cache
    from kvtool.ops.scan import ScanError

    if namespace_dir is None:
        return None, None
    try:
        found = inspect_cache(Path(namespace_dir).parent, Path(namespace_dir).name).namespaces
    except (ScanError, OSError):
        return None, None
    return (found[0].blocks, found[0].bytes) if found else (None, None)


def register(app: typer.Typer) -> None:
    """Add `kvtool warm` to the app."""
    app.command("warm", help=HELP)(warm_cmd)
