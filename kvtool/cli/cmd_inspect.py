"""`kvtool inspect`: describe the SSD cache per namespace, or tell whether a prompt would hit."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Annotated, Optional

import typer

from kvtool.cli import common
from kvtool.units import format_bytes

HELP = """Describe the SSD cache, per namespace: status, model, KV layout, block size, blocks, segment files and bytes, chains, oldest and newest access, an age histogram, format version, whether the last shutdown was clean, and index health (rows vs files, malformed rows, symlinks). Read-only.

With --prompt / --prompt-file / --messages, tell instead how many leading tokens of that prompt are on SSD (would it hit?), by hashing only: the model is loaded for its tokenizer and identity, the cache is opened read-only, no block is read and the prompt is not run.

Examples:

  kvtool inspect

  kvtool inspect --json --namespace 3fa2

  kvtool inspect --model tiny --prompt-file doc.txt --json

Exit codes: 0 ok; 1 a namespace is unreadable or foreign, or its index and files disagree; 2 bad input (cache dir, namespace, model, prompt).
"""


def inspect_cmd(
    cache_dir: common.CacheDirOpt = None,
    namespace: common.NamespaceOpt = None,
    json_out: common.JsonOpt = False,
    model: Annotated[
        Optional[str], typer.Option("--model", "-m", help="Model for --prompt (default: tiny, as serve-once).", show_default=False)
    ] = None,
    prompt: Annotated[Optional[str], typer.Option("--prompt", "-p", help="Prompt text to check ('-': stdin).")] = None,
    prompt_file: Annotated[Optional[Path], typer.Option("--prompt-file", "-f", help="File holding the prompt to check.")] = None,
    messages: Annotated[Optional[Path], typer.Option("--messages", help="Chat JSON file to check.")] = None,
    ignore_chat_template: common.IgnoreChatTemplateOpt = False,
    system_prompt: common.SystemPromptOpt = None,
    adapter_path: common.AdapterPathOpt = None,
    kv_bits: common.KVBitsOpt = None,
    kv_group_size: common.KVGroupSizeOpt = 64,
    prefill_step_size: common.PrefillStepOpt = None,
    block_size: common.BlockSizeOpt = None,
    config: common.ConfigOpt = None,
) -> None:
    with common.cli_errors():
        from kvtool.ops.inspect_cache import inspect_cache

        cfg = common.build_config(config, cache_dir, block_size=block_size)
        model_opts = {"adapter_path": adapter_path, "kv_bits": kv_bits, "prefill_step_size": prefill_step_size}
        if any(x is not None for x in (prompt, prompt_file, messages)):
            if namespace is not None:
                raise common.CLIError("--namespace does not apply to a prompt check (the model picks it)")
            encode = {"chat_template": not ignore_chat_template, "system_prompt": system_prompt}
            code = _probe(cfg, model or "tiny", prompt, prompt_file, messages, json_out, encode,
                          {**model_opts, "kv_group_size": kv_group_size})  # fmt: skip
            raise typer.Exit(code)
        if model is not None or block_size is not None or any(v is not None for v in model_opts.values()):
            raise common.CLIError("--model, --block-size and the model options only apply with --prompt, --prompt-file or --messages")
        report = inspect_cache(cfg.ssd_cache_dir, namespace)
        if json_out:
            common.print_json(report.to_dict())
        else:
            _print_report(report)
        bad = any(ns.problem for ns in report.namespaces) or bool(report.symlinks)
    raise typer.Exit(common.EXIT_PROBLEMS if bad else common.EXIT_OK)


def _probe(cfg, model: str, prompt, prompt_file, messages, json_out: bool, encode: dict, model_opts: dict) -> int:
    from kvtool.ops.inspect_cache import PromptProbe
    from kvtool.ops.scan import ScanError
    from kvtool.prompts import RequestFileError, load_messages
    from kvtool.store.fsops import is_namespace_dir

    if sum(x is not None for x in (prompt, prompt_file, messages)) != 1:
        raise common.CLIError("give exactly one of --prompt, --prompt-file, --messages")
    if prompt is not None and not prompt:
        raise common.CLIError("--prompt is empty")
    if not cfg.ssd_cache_dir.is_dir():
        raise ScanError(f"cache directory {cfg.ssd_cache_dir} does not exist or is not a directory")
    text = common.read_prompt_arg(prompt, prompt_file)  # as serve-once reads it
    try:
        msgs = load_messages(messages) if messages is not None else None
    except RequestFileError as exc:
        raise common.CLIError(str(exc)) from None
    engine = _read_only_engine(model, cfg, model_opts)
    try:
        layout = engine.cache.layout_key
        if layout is None:
            raise common.CLIError(f"this model cannot be cached: {engine.cache.uncached_reason}")
        try:
            ids = engine.encode(prompt=text if msgs is None else None, messages=msgs, **encode)
        except ValueError as exc:
            raise common.CLIError(str(exc)) from None
        cached = engine.cache.probe(ids)  # hashing + one read-only index query
    finally:
        engine.close()
    exists = is_namespace_dir(cfg.ssd_cache_dir / layout)
    probe = PromptProbe.of(layout, exists, cfg.block_size, len(ids), cached)
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


def _read_only_engine(model: str, cfg, model_opts: dict):
    """The model's engine (as serve-once builds it, so the same namespace) with its SSD tier
    opened read-only (`ReadOnlyFileOps`): no RAM tier, no writer thread, nothing created or
    changed in the cache."""
    import logging

    from kvtool.engine import DEFAULT_PREFILL_STEP, Engine
    from kvtool.models.loader import ModelLoadError
    from kvtool.ops.inspect_cache import ReadOnlyFileOps

    store_log = logging.getLogger("kvtool.store.ssd")  # "read-only"/"disabled" is the point here
    level = store_log.level
    store_log.setLevel(logging.ERROR)
    adapter = model_opts.get("adapter_path")
    try:
        return Engine.from_spec(
            model, cfg.replace(ssd_enabled=True, ram_bytes=0, ssd_async_writes=False), fs=ReadOnlyFileOps(),
            adapter_path=str(adapter) if adapter else None, kv_bits=model_opts.get("kv_bits"),
            kv_group_size=model_opts.get("kv_group_size", 64),
            prefill_step_size=model_opts.get("prefill_step_size") or DEFAULT_PREFILL_STEP,
        )  # fmt: skip
    except ModelLoadError as exc:
        raise common.CLIError(str(exc)) from None
    finally:
        store_log.setLevel(level)


def _when(t: float | None) -> str:
    return "-" if t is None else datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S")


def _print_report(report) -> None:
    out = common.console
    if not report.namespaces:
        out.print(f"no namespaces under {report.cache_dir}")
        return
    for ns in report.namespaces:
        style = {"ok": "bold green", "empty": "green", "outdated": "bold yellow", "uninitialized": "yellow"}.get(ns.status, "bold red")
        out.print(f"[{style}]{ns.namespace}[/] ({ns.status}) {ns.model_name or ''}", highlight=False)
        if ns.message:
            out.print(f"  {ns.message}", highlight=False, soft_wrap=True)
        if ns.status in ("unreadable", "uninitialized", "foreign"):
            continue
        h = ns.health
        clean = {True: "yes", False: "no (in use now, or the last process did not shut down cleanly)", None: "-"}
        hist = "  ".join(f"{k} {v}" for k, v in ns.age_histogram.items())
        shape = f"{ns.n_layers} layers x {ns.n_kv_heads} kv heads x {ns.head_dim}" if ns.n_kv_heads else f"layers {ns.kv_layers}"
        lines = [
            f"model       {ns.model_name} (id {ns.model_id})",
            f"layout      {ns.layout_key} | block {ns.block_size} tok | {ns.kv_dtype} | {shape} | format v{ns.format_version}",
            f"blocks      {ns.blocks} ({ns.tail_entries} tail entries) in {ns.segments} segment files, {format_bytes(ns.bytes)}"
            f" | {ns.chains} chains, max depth {ns.max_depth}",
            f"access      oldest {_when(ns.oldest_access)} | newest {_when(ns.newest_access)}",
            f"ages        {hist}",
            f"shutdown    clean: {clean[ns.shutdown_clean]}",
            f"health      {'[green]ok[/]' if h.ok else '[red]mismatch[/]'}: {h.rows} rows, {h.files} files, "
            f"{h.missing_files} missing files, {h.orphan_files} orphan files, {h.temp_files} temp files, "
            f"{h.bad_rows} bad rows, {h.symlinks} symlinks",
        ]
        if ns.status == "outdated":
            lines = [f"files       {format_bytes(ns.bytes)}"]
        for line in lines:
            out.print("  " + line, highlight=False, soft_wrap=True)
    for link in report.symlinks:
        out.print(f"[red]{report.cache_dir}/{link}[/]: a symlink in the cache directory (never followed)", highlight=False)
    total = sum(ns.bytes for ns in report.namespaces)
    out.print(f"{len(report.namespaces)} namespace(s), {format_bytes(total)} in {report.cache_dir}", highlight=False)


def register(app: typer.Typer) -> None:
    """Add `kvtool inspect` to the app."""
    app.command("inspect", help=HELP)(inspect_cmd)
