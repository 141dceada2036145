"""`kvtool inspect`: the SSD cache as a table, one row per namespace, or whether a prompt would hit."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from kvtool.cli import common
from kvtool.cli.cmd_remote import inspect_remote
from kvtool.cli.output import Output
from kvtool.cli.target import TARGET, Target, target_options
from kvtool.units import format_bytes

HELP = """List the SSD cache, one row per namespace: key prefix, model name and class (from the namespace's index), status, size, blocks, segment files, and when it was last used. Problems (unreadable or foreign namespaces, index and files that disagree, symlinks) are listed under the table. With --namespace, the namespace's details follow: KV layout, block size, chains, oldest and newest access, an age histogram, format version, last shutdown, index health. Read-only.

--sort size|blocks|last-used list the largest / most recently used first; --sort name (the default) sorts by model name. --filter keeps namespaces whose model name or key contains the text; --limit keeps the first N. The JSON shows the same selection.

With --remote (or --remote-url URL), list the remote tier's server instead (Redis / Valkey, as `kvtool remote inspect`): per namespace its blocks, split values and memory; per server its version, memory, maxmemory policy, evicted and expired keys. --namespace keeps one namespace; --json prints one document.

With --prompt / --prompt-file / --messages, tell instead how many leading tokens of that prompt are on SSD (would it hit?), by hashing only: the model is loaded for its tokenizer and identity, the cache is opened read-only, no block is read and the prompt is not run.

Examples:

  kvtool inspect

  kvtool inspect --sort size --limit 5

  kvtool inspect --filter qwen --json

  kvtool inspect --namespace 3fa2

  kvtool inspect --model tiny --prompt-file doc.txt --json

  kvtool inspect --remote-url redis://cache-host:6379/0

Exit codes: 0 ok; 1 a namespace shown is unreadable or foreign, or its index and files disagree; 2 bad input (cache dir, namespace, model, prompt), or with --remote: bad URL, unreachable server, wrong password, TLS failure, unknown namespace.
"""

SORT_METAVAR = "[size|last-used|name|blocks]"  # kvtool.ops.inspect_cache.InspectSort (imported lazily: startup time)


def _check_sort(value: str | None) -> str | None:
    if value is None:
        return None
    from kvtool.ops.inspect_cache import InspectSort

    try:
        return InspectSort(value.lower()).value
    except ValueError:
        raise typer.BadParameter(f"{value!r} is not one of {', '.join(InspectSort)}") from None


SortOpt = Annotated[
    str | None,
    typer.Option("--sort", metavar=SORT_METAVAR, callback=_check_sort, show_default=False,
                 help="Order of the rows: size, blocks, last-used (largest / newest first) or name (the default)."),
]  # fmt: skip
FilterOpt = Annotated[
    str | None, typer.Option("--filter", help="Only namespaces whose model name or key contains TEXT (case-insensitive).",
                         metavar="TEXT", show_default=False),
]  # fmt: skip
LimitOpt = Annotated[int | None, typer.Option("--limit", min=0, help="Show at most N namespaces.", metavar="N", show_default=False)]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="Print nothing but problems (on stderr); the exit code tells.")]


@dataclass(frozen=True)
class PromptSource:
    """A prompt given on the command line, its model and how to encode it (as serve-once does):
    the options of `kvtool inspect` and `kvtool rm` (`prompt_options`; field order = their order in --help).

    Attributes:
        model: model spec (preset, directory or Hub id; None: tiny, see `spec`).
        prompt, prompt_file, messages: exactly one is given.
        ignore_chat_template: do not wrap --prompt/--prompt-file in the chat template.
        system_prompt: system message (chat template only).
        adapter_path, kv_bits, kv_group_size, prefill_step_size: the engine's (they pick the namespace).
    """

    model: common.PromptModelOpt = None
    prompt: common.PromptOpt = None
    prompt_file: common.PromptFileOpt = None
    messages: common.MessagesOpt = None
    ignore_chat_template: common.IgnoreChatTemplateOpt = False
    system_prompt: common.SystemPromptOpt = None
    adapter_path: common.AdapterPathOpt = None
    kv_bits: common.KVBitsOpt = None
    kv_group_size: common.KVGroupSizeOpt = 64
    prefill_step_size: common.OptionalPrefillStepOpt = None

    @property
    def spec(self) -> str:
        """The model spec (tiny when no --model is given)."""
        return self.model or "tiny"

    @property
    def given(self) -> bool:
        """A prompt is given (--prompt, --prompt-file or --messages)."""
        return any(x is not None for x in (self.prompt, self.prompt_file, self.messages))

    @property
    def model_given(self) -> bool:
        """--model or a model option that picks the namespace is given (they only apply with a prompt)."""
        return any(x is not None for x in (self.model, self.adapter_path, self.kv_bits, self.prefill_step_size))

    def flags(self) -> dict[str, Any]:
        """Flag -> value of the prompt and its model (`common.refuse_options` with --remote)."""
        return {"--model": self.model, "--prompt": self.prompt, "--prompt-file": self.prompt_file,
                "--messages": self.messages, "--adapter-path": self.adapter_path, "--kv-bits": self.kv_bits}

    def check(self) -> None:
        """Raises `CLIError` unless exactly one non-empty prompt source is given."""
        if sum(x is not None for x in (self.prompt, self.prompt_file, self.messages)) != 1:
            raise common.CLIError("give exactly one of --prompt, --prompt-file, --messages")
        if self.prompt is not None and not self.prompt:
            raise common.CLIError("--prompt is empty")


PROMPT = PromptSource()  # the default of a command's `source` parameter (`prompt_options` always passes one)


def prompt_options(*names: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorate a command whose parameter `source: PromptSource` stands for the prompt options
    `names` (fields of `PromptSource`, shown in field order; none named: all of them)."""
    return common.flag_options("source", PromptSource, names)


@target_options
@prompt_options()
@common.cli_command
def inspect_cmd(
    cache_dir: common.CacheDirOpt = None,
    namespace: common.NamespaceOpt = None,
    sort: SortOpt = None,
    filter_text: FilterOpt = None,
    limit: LimitOpt = None,
    json_out: common.JsonOpt = False,
    quiet: QuietOpt = False,
    source: PromptSource = PROMPT,
    block_size: common.BlockSizeOpt = None,
    target: Target = TARGET,
) -> int:
    from kvtool.ops.inspect_cache import InspectSort, inspect_cache

    out = Output.from_flags(json_out, quiet)
    if target.server is not None:
        common.refuse_options({"--cache-dir": cache_dir, "--sort": sort, "--filter": filter_text, "--limit": limit,
                               **source.flags(), "--block-size": block_size,
                               "--prefill-step-size": source.prefill_step_size}, "with --remote")  # fmt: skip
        return inspect_remote(out, target.server, namespace)
    cfg = target.cache_config(cache_dir, block_size=block_size)
    if source.given:
        if namespace is not None:
            raise common.CLIError("--namespace does not apply to a prompt check (the model picks it)")
        if sort is not None or filter_text is not None or limit is not None:
            raise common.CLIError("--sort, --filter and --limit only apply to the cache listing, not to a prompt check")
        return _probe(cfg, source, out)
    if block_size is not None or source.model_given:
        raise common.CLIError("--model, --block-size and the model options only apply with --prompt, --prompt-file or --messages")
    report = inspect_cache(cfg.ssd_cache_dir, namespace).select(sort or InspectSort.NAME, filter_text, limit)
    out.emit(report.to_dict, lambda: _print_report(report, out, details=namespace is not None))
    if out.quiet:
        _print_problems(report, out)
    return common.EXIT_PROBLEMS if report.problems else common.EXIT_OK


@contextmanager
def prompt_engine(cfg, source: PromptSource) -> Iterator[tuple[Any, Any]]:
    """Read the prompt, load its model read-only and encode it: yields `(engine, token ids)`;
    the engine is closed on exit (its `engine.cache` stays usable for hashing).

    Raises:
        CLIError: bad prompt source, unreadable prompt or messages, a model that does not load
            or cannot be cached, a prompt the tokenizer rejects.
    """
    from kvtool.prompts import RequestFileError, load_messages

    source.check()
    text = common.read_prompt_arg(source.prompt, source.prompt_file)  # as serve-once reads it
    try:
        msgs = load_messages(source.messages) if source.messages is not None else None
    except RequestFileError as exc:
        raise common.CLIError(str(exc)) from None
    engine = read_only_engine(source.spec, cfg, {"adapter_path": source.adapter_path, "kv_bits": source.kv_bits,
                              "kv_group_size": source.kv_group_size, "prefill_step_size": source.prefill_step_size})
    try:
        if engine.cache.layout_key is None:
            raise common.CLIError(f"this model cannot be cached: {engine.cache.uncached_reason}")
        try:
            ids = engine.encode(prompt=text if msgs is None else None, messages=msgs, chat_template=not source.ignore_chat_template,
                                system_prompt=source.system_prompt)  # fmt: skip
        except ValueError as exc:
            raise common.CLIError(str(exc)) from None
        yield engine, ids
    finally:
        engine.close()


def _probe(cfg, source: PromptSource, out: Output) -> int:
    from kvtool.disk.fsops import is_namespace_dir
    from kvtool.ops.inspect_cache import PromptProbe
    from kvtool.ops.scan import ScanError

    source.check()
    if cfg.ssd_cache_dir.exists() and not cfg.ssd_cache_dir.is_dir():  # one that does not exist yet: empty
        raise ScanError(f"cache directory {cfg.ssd_cache_dir} is not a directory")
    with prompt_engine(cfg, source) as (engine, ids):
        layout = engine.cache.layout_key
        cached = _probe_ssd(engine, ids)
    exists = is_namespace_dir(cfg.ssd_cache_dir / layout)
    probe = PromptProbe.of(layout, exists, cfg.block_size, len(ids), cached)
    verdict = "[green]would hit[/]" if probe.would_hit else "[yellow]would miss[/]"
    where = "" if probe.namespace_exists else " (namespace not in this cache)"
    out.emit(
        lambda: {"cache_dir": str(cfg.ssd_cache_dir), "model": source.spec, **probe.to_dict()},
        lambda: out.print(
            f"{verdict}: {probe.cached_tokens} of {probe.prompt_tokens} prompt tokens cached on SSD "
            f"({probe.cached_blocks}/{probe.full_blocks} full blocks of {probe.block_size}) | "
            f"namespace {probe.namespace}{where}"
        ),
    )  # fmt: skip
    return common.EXIT_OK


def _probe_ssd(engine, ids) -> int:
    """`engine.cache.probe(ids)` (hashing + read-only index queries), in tokens; once more where a
    writer opened or changed the quietly read index meanwhile (`SSDStore.reopen_if_changed`).

    Raises:
        sqlite3.Error: the index cannot be opened again.
    """
    cached = engine.cache.probe(ids)
    store = engine.cache.ssd
    if store is not None and store.reopen_if_changed():
        cached = engine.cache.probe(ids)
    return cached


def read_only_engine(model: str, cfg, model_opts: dict):
    """The model's engine (as serve-once builds it, so the same namespace) with its SSD tier
    opened read-only (`ReadOnlyFileOps`): no RAM tier, no writer thread, nothing created or
    changed in the cache.

    Raises:
        CLIError: the model does not load.
    """
    import logging

    from kvtool.ops.inspect_cache import ReadOnlyFileOps

    store_log = logging.getLogger("kvtool.disk.namespace")  # "read-only"/"disabled" is the point here
    level = store_log.level
    store_log.setLevel(logging.ERROR)
    try:
        return common.load_engine(model, cfg.replace(ssd_enabled=True, ram_bytes=0, ssd_async_writes=False),
                                  fs=ReadOnlyFileOps(), **model_opts)
    finally:
        store_log.setLevel(level)


def _when(t: float | None) -> str:
    return "-" if t is None else datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S")


def ago(t: float | None, now: float) -> str:
    """`t` relative to `now`: '45s ago', '12m ago', '3h ago', '2d ago', '5mo ago', '2y ago'; '-' if None."""
    if t is None:
        return "-"
    s = max(0.0, now - t)
    for unit, size, below in (("s", 1, 60), ("m", 60, 3600), ("h", 3600, 86400), ("d", 86400, 60 * 86400),
                              ("mo", 30 * 86400, 365 * 86400)):  # fmt: skip
        if s < below:
            return f"{int(s // size)}{unit} ago"
    return f"{int(s // (365 * 86400))}y ago"


def short_keys(names: Iterable[str], min_len: int = 8) -> dict[str, str]:
    """name -> its shortest prefix (at least `min_len` characters) that no other name shares,
    so a prefix from the table can be given to --namespace and `kvtool rm`."""
    names = sorted(set(names))
    out = {}
    for i, name in enumerate(names):
        n = min_len
        for other in (names[i - 1] if i else None, names[i + 1] if i + 1 < len(names) else None):
            if other is not None:
                common_len = next((k for k, (a, b) in enumerate(zip(name, other)) if a != b), min(len(name), len(other)))
                n = max(n, common_len + 1)
        out[name] = name[: min(n, len(name))]
    return out


def model_class_short(model_class: str | None) -> str:
    """`mlx_lm.models.llama.Model` -> `llama.Model` ('-' if unknown)."""
    if not model_class:
        return "-"
    return model_class.removeprefix("mlx_lm.models.")


_STATUS_STYLE = {"ok": "green", "empty": "green", "outdated": "yellow", "uninitialized": "yellow"}


def _print_report(report, out: Output, details: bool = False) -> None:
    if not report.namespaces:
        where = escape(str(report.cache_dir))
        out.print(f"no namespaces under {where}" if not report.scanned else
                  f"none of the {report.scanned} namespace(s) under {where} selected")  # fmt: skip
        _print_notes(report, out.print)
        return
    keys = short_keys(ns.namespace for ns in report.namespaces)
    table = Table(collapse_padding=True)
    for name in ("namespace", "model", "class", "status", "size", "blocks", "segments", "last used"):
        right = name in ("size", "blocks", "segments", "last used")
        table.add_column(name, justify="right" if right else "left", no_wrap=name in ("namespace", "status", "size"),
                         overflow="fold")  # fmt: skip
    for ns in report.namespaces:
        style = _STATUS_STYLE.get(ns.status, "red")
        status = ns.status if ns.health.ok else f"{ns.status}, mismatch"
        unknown = ns.status in ("unreadable", "uninitialized", "foreign")
        table.add_row(
            keys[ns.namespace], escape(ns.model_name or "-"), escape(model_class_short(ns.model_class)),
            f"[{style if ns.health.ok else 'red'}]{status}[/]", format_bytes(ns.bytes),
            "-" if unknown and not ns.blocks else str(ns.blocks), "-" if unknown and not ns.segments else str(ns.segments),
            ago(ns.last_used, report.now),
        )  # fmt: skip
    out.table(table)
    _print_notes(report, out.print, keys)
    if details:
        for ns in report.namespaces:
            _print_details(ns, out)
    total = sum(ns.bytes for ns in report.namespaces)
    shown = len(report.namespaces)
    of = f" (of {report.scanned})" if shown != report.scanned else ""
    out.print(f"{shown} namespace(s){of}, {format_bytes(total)} in {escape(str(report.cache_dir))}")


def _health_text(h) -> str:
    return (f"{h.rows} rows, {h.files} files, {h.missing_files} missing files, {h.orphan_files} orphan files, "
            f"{h.temp_files} temp files, {h.bad_rows} bad rows, {h.symlinks} symlinks"
            + (f", {h.irregular} entries that are not regular files" if h.irregular else ""))  # fmt: skip


def _print_notes(report, emit, keys: dict[str, str] | None = None) -> None:
    """One line per namespace with a message or a health problem, and one per root symlink."""
    for ns in report.namespaces:
        key = (keys or {}).get(ns.namespace, ns.namespace)
        style = "red" if ns.problem else "yellow"
        if ns.message:
            emit(f"[{style}]{key}[/] ({ns.status}): {escape(ns.message)}")
        if not ns.health.ok and ns.status not in ("unreadable", "foreign"):
            emit(f"[red]{key}[/]: index and files disagree: {_health_text(ns.health)}; run `kvtool validate`")
    for link in report.symlinks:
        emit(f"[red]{escape(str(report.cache_dir))}/{escape(link)}[/]: a symlink in the cache directory (never followed)")


def _print_problems(report, out: Output) -> None:
    """--quiet: the problem lines only, on stderr."""
    problem = [ns for ns in report.namespaces if ns.problem]
    shown = type(report)(report.cache_dir, report.now, problem, report.symlinks)
    _print_notes(shown, out.problem)


def _print_details(ns, out: Output) -> None:
    """The namespace in full (--namespace): layout, blocks, chains, access times, ages, health."""
    style = {"ok": "bold green", "empty": "green", "outdated": "bold yellow", "uninitialized": "yellow"}.get(ns.status, "bold red")
    out.print(f"[{style}]{ns.namespace}[/] ({ns.status}) {escape(ns.model_name or '')}")
    if ns.status in ("unreadable", "uninitialized", "foreign"):
        return
    h = ns.health
    clean = {True: "yes", False: "no (in use now, or the last process did not shut down cleanly)", None: "-"}
    hist = "  ".join(f"{k} {v}" for k, v in ns.age_histogram.items())
    shape = f"{ns.n_layers} layers x {ns.n_kv_heads} kv heads x {ns.head_dim}" if ns.n_kv_heads else f"layers {ns.kv_layers}"
    lines = [
        f"model       {escape(str(ns.model_name))} (id {ns.model_id}) | class {escape(ns.model_class or '-')}",
        f"layout      {ns.layout_key} | block {ns.block_size} tok | {ns.kv_dtype} | {shape} | format v{ns.format_version}",
        (f"blocks      {ns.blocks} ({ns.tail_entries} tail entries) in {ns.segments} segment files, {format_bytes(ns.bytes)}"
         f" | {ns.chains} chains, max depth {ns.max_depth}"),
        f"access      oldest {_when(ns.oldest_access)} | newest {_when(ns.newest_access)} | last used {_when(ns.last_used)}",
        f"ages        {hist}",
        f"shutdown    clean: {clean[ns.shutdown_clean]}",
        *([f"self-check  {escape(ns.selfcheck)}"] if ns.selfcheck else []),
        *([f"reply KV    {escape(ns.reply_check)}"] if ns.reply_check else []),
        f"health      {'[green]ok[/]' if h.ok else '[red]mismatch[/]'}: {_health_text(h)}",
    ]
    if ns.status == "outdated":
        lines = [f"files       {format_bytes(ns.bytes)}"]
    for line in lines:
        out.print("  " + line)


def register(app: typer.Typer) -> None:
    """Add `kvtool inspect` to the app."""
    app.command("inspect", help=HELP)(inspect_cmd)
