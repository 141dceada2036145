"""Shared CLI pieces: the options every command takes (`Annotated` aliases, defined once; the
cache options as one `CacheFlags`), the config they build, the engine, prompts and signals.

Errors are one `error:` line each (`kvtool.cli.errors`, re-exported here: `common.CLIError`,
`common.cli_command`, ...).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import os
import time
import typing
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer

# the consoles live in kvtool.cli.output (which never imports this module): one import direction
from kvtool.cli.errors import (  # noqa: F401  (re-exported: every command uses them as common.*)
    EXIT_OK,
    CLIError,
    KVToolGroup,
    cli_command,
    describe_error,
    print_error,
)
from kvtool.cli.output import console, err_console, print_json  # noqa: F401  (re-exported)
from kvtool.cli.signals import Interrupted, ignore_signals, signals_raise  # noqa: F401  (re-exported)
from kvtool.config import Codec, Durability, RemotePolicy, SSDPolicy

# Exit codes shared by all commands.
EXIT_PROBLEMS = 1  # the command ran and found/reported problems (validate), or a request failed
# EXIT_USAGE (2, imported from kvtool.errors): bad input: missing file, invalid value, unknown model, could not run

JsonOpt = Annotated[bool, typer.Option("--json", help="Print exactly one JSON document on stdout.", rich_help_panel="Output")]


def _cache_dir_arg(value: str) -> Path:
    """`--cache-dir` as given: a path, never empty (`Path('')` would silently be the current
    directory), never holding a NUL."""
    if not value.strip():
        raise typer.BadParameter("must not be empty (use '.' for the current directory)")
    if "\0" in value:
        raise typer.BadParameter("must not contain a NUL character")
    return Path(value)


CacheDirOpt = Annotated[
    Path | None,
    typer.Option(
        "--cache-dir",
        help="SSD tier root (default: $KVTOOL_CACHE_DIR, else $XDG_CACHE_HOME/kvtool, else ~/.cache/kvtool).",
        show_default=False,
        rich_help_panel="Cache",
        parser=_cache_dir_arg,
    ),
]
ConfigOpt = Annotated[
    Path | None,
    typer.Option("--config", help="TOML file with kvtool config fields (default: $KVTOOL_CONFIG, else "
                 "$XDG_CONFIG_HOME/kvtool/config.toml if it exists). Flags and KVTOOL_<FIELD> variables win over it.",
                 show_default=False, rich_help_panel="Cache"),
]
ModelOpt = Annotated[
    str,
    typer.Option(
        "--model",
        "-m",
        help="Embedded preset (tiny, small, base, qwen0.5b), a local mlx-lm model directory, or a Hugging Face id.",
        rich_help_panel="Model",
    ),
]
# -m is --model in every command that takes a model; --max-tokens has -n.
MaxTokensOpt = Annotated[int, typer.Option("--max-tokens", "-n", min=1, help="Max tokens to generate.", rich_help_panel="Generation")]
MaxPromptTokensOpt = Annotated[
    int | None,
    typer.Option("--max-prompt-tokens", min=1, show_default=False,
                 help="Longest prompt, in tokens after the chat template (kvtool serve answers a longer one 413; "
                      "serve-once and warm refuse it, exit 2). \\[default: the model's context length, at most 32768]"),
]
IgnoreChatTemplateOpt = Annotated[
    bool,
    typer.Option("--ignore-chat-template", help="Use --prompt/--prompt-file as raw text (default: wrap it in the chat template, as mlx_lm.generate).", rich_help_panel="Prompt"),
]
SystemPromptOpt = Annotated[
    str | None, typer.Option("--system-prompt", help="System message put before the prompt (chat template only).", show_default=False, rich_help_panel="Prompt")
]
AdapterPathOpt = Annotated[
    Path | None, typer.Option("--adapter-path", help="LoRA adapter directory (part of the model identity).", show_default=False, rich_help_panel="Model")
]
def _refuse_max_kv_size(value: int | None) -> int | None:
    refuse_max_kv_size(value)  # when the flag is parsed: before any model or mlx-lm import
    return value


MaxKVSizeOpt = Annotated[
    int | None,
    typer.Option("--max-kv-size", min=1, callback=_refuse_max_kv_size, help="As mlx-lm: a rotating KV cache of this many tokens (not cacheable by kvtool yet: refused).", show_default=False, rich_help_panel="Model"),
]
_PREFILL_STEP = typer.Option("--prefill-step-size", min=1, help="Tokens per prefill chunk.", rich_help_panel="Model")
PrefillStepOpt = Annotated[int, _PREFILL_STEP]
OptionalPrefillStepOpt = Annotated[int | None, _PREFILL_STEP]  # None: the command's own default


def finite_number(value: float | None) -> float | None:
    """Typer callback: refuse NaN and infinities (a float option's `min`/`max` let them through).

    Raises:
        typer.BadParameter: `value` is not finite (one `error:` line, exit 2).
    """
    import math

    if value is not None and not math.isfinite(value):
        raise typer.BadParameter(f"{value} is not a finite number")
    return value


def _check_kv_bits(value: int | None) -> int | None:
    if value is not None and value not in (4, 8):
        raise typer.BadParameter(f"{value} is not one of 4, 8")
    return value


KVBitsOpt = Annotated[
    int | None,
    typer.Option("--kv-bits", callback=_check_kv_bits, show_default=False,
                 help="As mlx-lm: quantize the KV cache to 4 or 8 bits once it holds 5000 tokens (mlx-lm's "
                      "--quantized-kv-start); cached blocks then hold the quantized KV.", rich_help_panel="Model"),
]
KVGroupSizeOpt = Annotated[int, typer.Option("--kv-group-size", min=1, help="As mlx-lm: KV quantization group size.", rich_help_panel="Model")]
NamespaceOpt = Annotated[
    str | None, typer.Option("--namespace", help="Only this namespace (layout key, or a unique prefix of it).")
]
DryRunOpt = Annotated[bool, typer.Option("--dry-run", help="Show what would be done; change nothing.")]
YesOpt = Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="Print nothing on success (errors still go to stderr).")]
VerboseOpt = Annotated[bool, typer.Option("--verbose", "-v", help="Log cache activity.")]
# A prompt to look up (`kvtool inspect`, `kvtool rm`): read and encoded as serve-once does.
PromptModelOpt = Annotated[str | None, typer.Option("--model", "-m", help="Model of the prompt (default: tiny, as serve-once).",
                                                    show_default=False)]  # fmt: skip
PromptOpt = Annotated[str | None, typer.Option("--prompt", "-p", help="Prompt text ('-': stdin).", show_default=False)]
PromptFileOpt = Annotated[Path | None, typer.Option("--prompt-file", "-f", help="File holding the prompt.", show_default=False)]
MessagesOpt = Annotated[Path | None, typer.Option("--messages", help="Chat JSON file (the prompt as messages).", show_default=False)]

# The options `kvtool inspect|validate|prune|rm` take to act on the remote tier instead of the SSD tier.
REMOTE_PANEL = "Remote tier"
RemoteOpt = Annotated[bool, typer.Option(
    "--remote", help="Act on the remote tier's server (Redis / Valkey) instead of the SSD cache: --remote-url, else "
    "remote_url of the config, else $KVTOOL_REMOTE_URL (password: in the URL or $KVTOOL_REMOTE_PASSWORD).",
    rich_help_panel=REMOTE_PANEL)]  # fmt: skip
RemoteServerOpt = Annotated[str | None, typer.Option(
    "--remote-url", help="The remote server (implies --remote): redis://\\[user:password@]host\\[:port]\\[/db], rediss://, "
    "unix://, redis+cluster://.", show_default=False, rich_help_panel=REMOTE_PANEL)]  # fmt: skip


# ---------------------------------------------------------------- cache options
CACHE_PANEL = "Cache"
# Cache options default to None (the config file decides), so their help states the config's
# default as `\\[default: X]` (the backslash keeps rich markup from eating the brackets).


def _cache_option(*names: str, help: str, **kw: Any) -> Any:
    return typer.Option(*names, help=help, show_default=False, rich_help_panel=CACHE_PANEL, **kw)


PolicyOpt = Annotated[SSDPolicy | None, _cache_option("--policy", help="SSD policy. \\[default: write_through]",
                                                      metavar="<write_through|evict_only>")]  # the default first
DurabilityOpt = Annotated[Durability | None, _cache_option("--durability", help="SSD durability. \\[default: best_effort]")]
AsyncOpt = Annotated[bool | None, _cache_option(
    "--async/--sync", help="Write SSD blocks from a background writer or inline. \\[default: async]")]
BlockSizeOpt = Annotated[int | None, _cache_option("--block-size", min=1, help="Tokens per cached block. \\[default: 64]")]
RamBytesOpt = Annotated[str | None, _cache_option("--ram-bytes", help="RAM tier budget, e.g. 512MiB, 2GB. \\[default: 1GiB]")]
NoSSDOpt = Annotated[bool, typer.Option("--no-ssd", help="RAM tier only.", rich_help_panel=CACHE_PANEL)]
CodecOpt = Annotated[Codec | None, _cache_option(
    "--codec", help="Compress SSD block records losslessly (a separate namespace). \\[default: none]")]
RemoteUrlOpt = Annotated[str | None, _cache_option(
    "--remote-url", help="Shared remote tier: redis://host:port/db, rediss://, unix://, redis+cluster:// (password: "
    "$KVTOOL_REMOTE_PASSWORD). \\[default: $KVTOOL_REMOTE_URL]")]
RemotePolicyOpt = Annotated[RemotePolicy | None, _cache_option(
    "--remote-policy", help="When blocks reach the remote tier. \\[default: write_through]")]
SSDMaxBytesOpt = Annotated[str | None, _cache_option(
    "--ssd-max-bytes", help="Byte budget of the SSD tier (per namespace, as du counts it), kept while serving: least "
    "recently used segments are evicted first, e.g. 50GB, 512MiB. \\[default: none]")]

# The config field a cache option sets, where its name differs (`config` sets none).
CONFIG_FIELDS = {"cache_dir": "ssd_cache_dir", "policy": "ssd_policy", "durability": "ssd_durability",
                 "async_writes": "ssd_async_writes", "no_ssd": "ssd_enabled", "codec": "ssd_codec"}


@dataclass(frozen=True)
class CacheFlags:
    """The cache options of one command line, as given (None, False: not given). Field order =
    the order of the options in --help."""

    config: ConfigOpt = None
    cache_dir: CacheDirOpt = None
    policy: PolicyOpt = None
    durability: DurabilityOpt = None
    async_writes: AsyncOpt = None
    block_size: BlockSizeOpt = None
    ram_bytes: RamBytesOpt = None
    ssd_max_bytes: SSDMaxBytesOpt = None
    remote_url: RemoteUrlOpt = None
    remote_policy: RemotePolicyOpt = None
    no_ssd: NoSSDOpt = False
    codec: CodecOpt = None

    def settings(self) -> Any:
        """The effective settings (`kvtool.config.settings.Settings`: the config and where each value came
        from): flags > `KVTOOL_<FIELD>` environment variables > the config file (`--config`, else
        `$KVTOOL_CONFIG`, else `$XDG_CONFIG_HOME/kvtool/config.toml` if it exists) > defaults.

        Raises:
            CLIError: bad `--ram-bytes` size string. ConfigError: invalid value in any layer, a
                config file that is missing (`--config`, `$KVTOOL_CONFIG`) or unreadable.
        """
        from kvtool.config.settings import resolve_settings
        from kvtool.units import parse_size

        values = {**vars(self), "ram_bytes": parse_flag(self.ram_bytes, parse_size, "--ram-bytes"), "no_ssd": False if self.no_ssd else None}
        flags, names = {}, {}
        for name, (kind, _) in CACHE_OPTIONS.items():
            if name != "config":
                flags[CONFIG_FIELDS.get(name, name)] = values[name]
                names[CONFIG_FIELDS.get(name, name)] = flag_name(kind)
        names["ssd_async_writes"] = "--async" if self.async_writes else "--sync"
        settings = resolve_settings(flags, self.config, names)
        settings.config.ssd_cache_dir = cache_root(settings.config.ssd_cache_dir)
        return settings

    def build(self) -> Any:
        """The validated `KVToolConfig` of `settings()` (raises as `settings`)."""
        return self.settings().config


CACHE = CacheFlags()  # the default of a command's `cache` parameter (`cache_options` always passes one)


def build_config(config: Path | None = None, cache_dir: Path | None = None, **flags: Any) -> Any:
    """The validated `KVToolConfig` of these cache options (`CacheFlags` fields; flags > environment
    > config file > defaults).

    Raises:
        CLIError, ConfigError: as `CacheFlags.settings`.
    """
    return CacheFlags(config, cache_dir, **flags).build()


def option_group(param: str, table: Mapping[str, tuple[Any, ...]], make: Callable[..., Any],
                 names: Iterable[str]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorate a command whose parameter `param` stands for a group of options: Typer sees the
    options `names` (keys of `table`: name -> (Annotated type, default, ...)) in its place, in
    `table` order, and the command gets `make(**their values)` as `param`."""
    chosen = [n for n in table if n in set(names)]

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        params = []
        for p in inspect.signature(fn, eval_str=True).parameters.values():
            params += [inspect.Parameter(n, p.kind, default=table[n][1], annotation=table[n][0])
                       for n in chosen] if p.name == param else [p]  # fmt: skip

        @functools.wraps(fn)
        def command(**kwargs: Any) -> Any:
            return fn(**{param: make(**{n: kwargs.pop(n) for n in chosen})}, **kwargs)

        command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        command.__annotations__ = {p.name: p.annotation for p in params}
        return command

    return decorate


def options_of(flags: type) -> dict[str, tuple[Any, Any]]:
    """The option table of a dataclass of flags: each field whose type is an `Annotated` alias
    holding a Typer option -> (that type, the field's default), in field order (other fields are
    not options)."""
    hints = typing.get_type_hints(flags, include_extras=True)
    return {f.name: (hints[f.name], f.default) for f in dataclasses.fields(flags)
            if any(isinstance(m, typer.models.ParameterInfo) for m in getattr(hints[f.name], "__metadata__", ()))}


def flag_options(param: str, flags: type, names: Iterable[str] = ()) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """`option_group` for the dataclass `flags` (its table: `options_of(flags)`): the command's
    parameter `param` stands for the options `names` (none named: all of them)."""
    table = options_of(flags)
    return option_group(param, table, flags, names or table)


def flag_name(option: Any) -> str:
    """The first name of the Typer option an `Annotated` alias holds (`--cache-dir`: inside
    `Annotated`, Typer keeps an option's first name where its default would be)."""
    return str(next(m for m in option.__metadata__ if isinstance(m, typer.models.ParameterInfo)).default)


@dataclass(frozen=True)
class ModelFlags:
    """How to load the model and encode prompts (the model options, as mlx-lm's own flags; field
    order = the order of the options in --help)."""

    ignore_chat_template: IgnoreChatTemplateOpt = False
    system_prompt: SystemPromptOpt = None
    adapter_path: AdapterPathOpt = None
    max_kv_size: MaxKVSizeOpt = None
    prefill_step_size: PrefillStepOpt = 2048
    kv_bits: KVBitsOpt = None
    kv_group_size: KVGroupSizeOpt = 64

    def load(self, model: str, config: Any, **engine_options: Any) -> Any:
        """`load_engine` with these flags (`engine_options`: more `Engine` arguments)."""
        return load_engine(model, config, adapter_path=self.adapter_path, max_kv_size=self.max_kv_size,
                           prefill_step_size=self.prefill_step_size, kv_bits=self.kv_bits,
                           kv_group_size=self.kv_group_size, **engine_options)


MODEL = ModelFlags()  # the default of a command's `model_flags` parameter (`model_options` always passes one)
CACHE_OPTIONS = options_of(CacheFlags)  # name -> (Annotated type, default), in --help order
MODEL_OPTIONS = options_of(ModelFlags)


def model_options(*names: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorate a command whose parameter `model_flags: ModelFlags` stands for the model options
    `names` (fields of `ModelFlags`, shown in that order)."""
    return option_group("model_flags", MODEL_OPTIONS, ModelFlags, names)


def cache_options(*names: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorate a command whose parameter `cache: CacheFlags` stands for the cache options `names`
    (fields of `CacheFlags`, shown in that order)."""
    return option_group("cache", CACHE_OPTIONS, CacheFlags, names)


def refuse_options(given: dict[str, Any], why: str) -> None:
    """Raises CLIError naming the first option of `given` (flag -> value) that is set (not None,
    not False): it does not apply `why` (`with --remote`)."""
    for flag, value in given.items():
        if value is not None and value is not False:
            raise CLIError(f"{flag} does not apply {why}")


def parse_flag(value: str | None, parse: Callable[[str], Any], flag: str) -> Any:
    """`parse(value)` (None when the flag is not given), a `ValueError` turned into a `CLIError`
    naming the flag (`--ttl: ...`).

    Raises:
        CLIError: `parse` refused the value.
    """
    try:
        return None if value is None else parse(value)
    except ValueError as exc:
        raise CLIError(f"{flag}: {exc}") from None


def cache_root(path: Path) -> Path:
    """The cache directory every command uses and reports: a symlink on its path followed once,
    here (`kvtool.disk.fsops.resolve_cache_root`). A path that cannot be looked at for another
    reason (no permission, a component that is a file) is kept as given: the command reports it.

    Raises:
        CLIError: a name too long for the file system (the whole path, or one component).
    """
    import errno

    from kvtool.disk.fsops import resolve_cache_root, short_path

    try:
        return resolve_cache_root(path)
    except OSError as exc:
        if exc.errno == errno.ENAMETOOLONG:
            raise CLIError(f"cache directory {short_path(path)}: {exc.strerror}") from None
        return path



def setup_logging(verbose: bool = False) -> None:
    """Warnings (and with --verbose, info) from kvtool to stderr."""
    import logging

    from rich.logging import RichHandler

    logger = logging.getLogger("kvtool")
    if not logger.handlers:
        handler = RichHandler(console=err_console, show_time=False, show_path=False)
        logger.addHandler(handler)
    logger.setLevel(logging.INFO if verbose else logging.WARNING)
    logger.propagate = False


def load_engine(
    model: str,
    config,
    *,
    adapter_path: Path | None = None,
    max_kv_size: int | None = None,
    prefill_step_size: int | None = None,
    kv_bits: int | None = None,
    kv_group_size: int = 64,
    **engine_options: Any,
):
    """Load a model and build an `Engine` (`engine_options`: more `Engine.from_spec` arguments).

    Raises:
        CLIError: the model does not load, `kv_bits` / `kv_group_size` do not quantize the model's
            KV head dims (checked before the cache opens), or `max_kv_size` is given
            (`refuse_max_kv_size`).
    """
    from kvtool.engine import DEFAULT_PREFILL_STEP, Engine
    from kvtool.models.loader import ModelLoadError, kv_quantization_problem, load_model

    refuse_max_kv_size(max_kv_size)
    try:
        loaded = load_model(model, adapter_path=str(adapter_path) if adapter_path else None)
    except ModelLoadError as exc:
        raise CLIError(str(exc)) from None
    problem = kv_quantization_problem(loaded.model, kv_bits, kv_group_size)
    if problem is not None:  # refused before the cache opens and before any prefill
        raise CLIError(problem, hint="use a --kv-group-size that divides the head dim (e.g. 32), or drop --kv-bits")
    return Engine(loaded, config, prefill_step_size=prefill_step_size or DEFAULT_PREFILL_STEP, kv_bits=kv_bits,
                  kv_group_size=kv_group_size, **engine_options)


@contextlib.contextmanager
def nothing_left_empty(cache_dir: Path) -> Iterator[list[Path]]:
    """For a job that opens a namespace and may store nothing in it (a refused `warm` or
    `import`, any `export`): the caller appends the namespace directory its engine opened to the
    yielded list; on exit each one this job created (meta `created` since entry) and left without
    blocks goes again (`kvtool.ops.remove_tree.drop_unused`), and `cache_dir` too if the job
    created it and it is empty now. Never raises of its own."""
    from kvtool.ops.remove_tree import drop_unused

    started, existed = time.time(), os.path.lexists(cache_dir)
    opened: list[Path] = []
    try:
        yield opened
    finally:
        for ns_dir in opened:
            drop_unused(cache_dir, ns_dir.name, created_since=started)
        if not existed:
            with contextlib.suppress(OSError):
                cache_dir.rmdir()  # only if empty


def refuse_max_kv_size(max_kv_size: int | str | None) -> None:
    """Raises CLIError for a `--max-kv-size` (a rotating KV cache, which kvtool cannot store exactly
    yet: refused up front rather than run uncached)."""
    if max_kv_size is not None:
        raise CLIError(f"--max-kv-size {max_kv_size} makes mlx-lm use a RotatingKVCache, which kvtool cannot "
                       "cache yet; drop the option (kvtool keeps the whole prompt's KV)")


def read_prompt_arg(prompt: str | None, prompt_file: Path | None, *, unescape: bool = True) -> str | None:
    """`--prompt` / `--prompt-file` text as mlx-lm reads it: `-` is stdin; in `--prompt`, the
    two-character escapes `\\n` and `\\t` become a newline and a tab (`mlx_lm.generate`) unless
    not `unescape` (`mlx_lm.cache_prompt` takes the text literally).

    Raises:
        CLIError: empty prompt, or an unreadable / non-UTF-8 file.
    """
    import sys

    from kvtool.prompts import RequestFileError, read_text

    if prompt is not None:
        text = (sys.stdin.read() if prompt == "-" else
                prompt.replace("\\n", "\n").replace("\\t", "\t") if unescape else prompt)  # fmt: skip
        if not text.strip():
            raise CLIError("--prompt is empty")
        return text
    if prompt_file is not None:
        if str(prompt_file) == "-":
            text = sys.stdin.read()
            if not text.strip():
                raise CLIError("--prompt-file -: stdin is empty")
            return text
        try:
            return read_text(prompt_file)
        except RequestFileError as exc:
            raise CLIError(str(exc)) from None
    return None
