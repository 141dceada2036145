"""`kvtool inspect`: describe the SSD cache per namespace, or tell whether a prompt would hit."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Annotated, Optional

import typer

from kvtool.cli import common
from kvtool.units import format_bytes

HELP = """Describe the SSD cache, per namespace: model, layout, block size, KV dtype, blocks and bytes, oldest and newest access, an age histogram, format version, whether the last shutdown was clean, and index health (rows vs files). Read-only.

With --prompt / --prompt-file / --messages, tell instead how many leading tokens of that prompt are on SSD (would it hit?), by hashing only: the model is loaded for its tokenizer and identity, no block is read and the prompt is not run.

Examples:

  kvtool inspect

  kvtool inspect --json --namespace 3fa2

  kvtool inspect --model tiny --prompt-file doc.txt --json

Exit codes: 0 ok; 1 a namespace is unreadable or its index and files disagree; 2 bad input (cache dir, namespace, model, prompt).
"""


def inspect_cmd(
    cache_dir: common.CacheDirOpt = None,
    namespace: common.NamespaceOpt = None,
    json_out: common.JsonOpt = False,
    model: Annotated[
        Optional[str], typer.Option("--model", "-m", help="Model for --prompt (default: tiny, as serve-once).", show_default=False)
    ] = None,
    prompt: Annotated[Optional[str], typer.Option("--prompt", "-p", help="Prompt text to check.")] = None,
    prompt_file: Annotated[Optional[Path], typer.Option("--prompt-file", "-f", help="File holding the prompt to check.")] = None,
    messages: Annotated[Optional[Path], typer.Option("--messages", help="Chat JSON file to check.")] = None,
    block_size: common.BlockSizeOpt = None,
    config: common.ConfigOpt = None,
) -> None:
    with common.cli_errors():
        from kvtool.ops.inspect_cache import InspectError, inspect_cache

        cfg = common.build_config(config, cache_dir, block_size=block_size)
        try:
            if any(x is not None for x in (prompt, prompt_file, messages)):
                if namespace is not None:
                    raise common.CLIError("--namespace does not apply to a prompt check (the model picks it)")
                code = _probe(cfg, model or "tiny", prompt, prompt_file, messages, json_out)
                raise typer.Exit(code)
            if model is not None or block_size is not None:
                raise common.CLIError("--model and --block-size only apply with --prompt, --prompt-file or --messages")
            report = inspect_cache(cfg.ssd_cache_dir, namespace)
        except InspectError as exc:
            raise common.CLIError(str(exc)) from None
        if json_out:
            common.print_json(report.to_dict())
        else:
            _print_report(report)
        bad = any(ns.status == "unreadable" or not ns.health.ok for ns in report.namespaces)
    raise typer.Exit(common.EXIT_PROBLEMS if bad else common.EXIT_OK)


def _probe(cfg, model: str, prompt, prompt_file, messages, json_out: bool) -> int:
    from kvtool.blocks import chain_hashes
    from kvtool.ops.inspect_cache import InspectError, probe_prompt
    from kvtool.prompts import RequestFileError, load_messages, read_text

    if sum(x is not None for x in (prompt, prompt_file, messages)) != 1:
        raise common.CLIError("give exactly one of --prompt, --prompt-file, --messages")
    if prompt is not None and not prompt:
        raise common.CLIError("--prompt is empty")
    if not cfg.ssd_cache_dir.is_dir():
        raise InspectError(f"cache directory {cfg.ssd_cache_dir} does not exist or is not a directory")
    try:
        text = read_text(prompt_file) if prompt_file is not None else prompt
        msgs = load_messages(messages) if messages is not None else None
    except RequestFileError as exc:
        raise common.CLIError(str(exc)) from None
    # No tier at all: the engine only computes the layout key; it never opens (or creates) the
    # namespace. The index is then read directly, read-only.
    engine = common.load_engine(model, cfg.replace(ssd_enabled=False, ram_bytes=0))
    try:
        layout = engine.layout_key_for(cfg.block_size)
        if layout is None:
            raise common.CLIError(f"this model cannot be cached: {engine.uncached_reason}")
        try:
            ids = engine.encode(prompt=text if msgs is None else None, messages=msgs)
        except ValueError as exc:
            raise common.CLIError(str(exc)) from None
        hashes = chain_hashes(ids, cfg.block_size, layout, engine.hash_fn)
        probe = probe_prompt(cfg.ssd_cache_dir, layout, cfg.block_size, hashes, len(ids))
    finally:
        engine.close()
    if json_out:
        common.print_json({"cache_dir": str(cfg.ssd_cache_dir), "model": model, **probe.to_dict()})
    else:
        verdict = "[green]would hit[/]" if probe.would_hit else "[yellow]would miss[/]"
        where = "" if probe.namespace_exists else " (namespace not in this cache)"
        common.console.print(
            f"{verdict}: {probe.cached_tokens} of {probe.prompt_tokens} prompt tokens cached on SSD "
            f"({probe.cached_blocks}/{probe.full_blocks} full blocks of {probe.block_size}) | "
            f"namespace {probe.namespace}{where}",
            highlight=False, soft_wrap=True,
        )  # fmt: skip
    return common.EXIT_OK


def _when(t: float | None) -> str:
    return "-" if t is None else datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S")


def _print_report(report) -> None:
    out = common.console
    if not report.namespaces:
        out.print(f"no namespaces under {report.cache_dir}")
        return
    for ns in report.namespaces:
        style = {"ok": "bold green", "unknown_format": "bold yellow", "uninitialized": "yellow"}.get(ns.status, "bold red")
        out.print(f"[{style}]{ns.namespace}[/] ({ns.status})", highlight=False)
        if ns.message:
            out.print(f"  {ns.message}", highlight=False)
        if ns.status in ("unreadable", "uninitialized"):
            continue
        h = ns.health
        clean = {True: "yes", False: "no (in use now, or the last process did not shut down cleanly)", None: "-"}
        hist = "  ".join(f"{k} {v}" for k, v in ns.age_histogram.items())
        lines = [
            f"model       {ns.model_name} (id {ns.model_id})",
            f"layout      {ns.layout_key} | block {ns.block_size} tok | {ns.kv_dtype} | {ns.n_layers} layers x "
            f"{ns.n_kv_heads} kv heads x {ns.head_dim} | format v{ns.format_version}",
            f"blocks      {ns.blocks} ({format_bytes(ns.bytes)})",
            f"access      oldest {_when(ns.oldest_access)} | newest {_when(ns.newest_access)}",
            f"ages        {hist}",
            f"shutdown    clean: {clean[ns.shutdown_clean]}",
            f"health      {'[green]ok[/]' if h.ok else '[red]mismatch[/]'}: {h.rows} rows, {h.files} files, "
            f"{h.missing_files} missing files, {h.orphan_files} orphan files, {h.temp_files} temp files",
        ]
        for line in lines:
            out.print("  " + line, highlight=False, soft_wrap=True)
    total = sum(ns.bytes for ns in report.namespaces)
    out.print(f"{len(report.namespaces)} namespace(s), {format_bytes(total)} in {report.cache_dir}", highlight=False)


def register(app: typer.Typer) -> None:
    """Add `kvtool inspect` to the app."""
    app.command("inspect", help=HELP)(inspect_cmd)
