"""Shared CLI pieces: option aliases, clean one-line errors, JSON/human output."""

from __future__ import annotations

import importlib
import json
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, Iterator, Optional

import typer
from rich.console import Console

from kvtool.config import ConfigError

console = Console()
err_console = Console(stderr=True)

# Exit codes shared by all commands.
EXIT_OK = 0
EXIT_PROBLEMS = 1  # the command ran and found/reported problems (validate), or a request failed
EXIT_USAGE = 2  # bad input: missing file, invalid value, unknown model, could not run

JsonOpt = Annotated[bool, typer.Option("--json", help="Print exactly one JSON document on stdout.")]
CacheDirOpt = Annotated[
    Optional[Path],
    typer.Option("--cache-dir", help="SSD tier root (default: $KVTOOL_CACHE_DIR or ~/.cache/kvtool).", show_default=False),
]
ConfigOpt = Annotated[
    Optional[Path], typer.Option("--config", help="TOML file with kvtool config fields.", show_default=False)
]
ModelOpt = Annotated[
    str,
    typer.Option(
        "--model",
        "-m",
        help="Embedded preset (tiny, small, base, qwen0.5b), a local mlx-lm model directory, or a Hugging Face id.",
    ),
]
NamespaceOpt = Annotated[
    Optional[str], typer.Option("--namespace", help="Only this namespace (layout key, or a unique prefix of it).")
]
DryRunOpt = Annotated[bool, typer.Option("--dry-run", help="Show what would be done; change nothing.")]
YesOpt = Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")]


class CLIError(Exception):
    """A known, user-facing error: printed as one line, exit `code`."""

    def __init__(self, message: str, code: int = EXIT_USAGE):
        super().__init__(message)
        self.code = code


@contextmanager
def cli_errors() -> Iterator[None]:
    """Turn known exceptions into one clean `error: ...` line and a non-zero exit (no traceback)."""
    try:
        yield
    except CLIError as exc:
        fail(str(exc), exc.code)
    except ConfigError as exc:
        fail(str(exc), EXIT_USAGE)
    except FileNotFoundError as exc:
        fail(f"file not found: {exc.filename or exc}", EXIT_USAGE)
    except (IsADirectoryError, PermissionError) as exc:
        fail(f"cannot read {exc.filename}: {exc.strerror}", EXIT_USAGE)


def fail(message: str, code: int = EXIT_USAGE) -> None:
    """Print `error: message` to stderr and exit with `code`."""
    err_console.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def print_json(doc: Any) -> None:
    """Write one JSON document to stdout (no rich markup)."""
    sys.stdout.write(json.dumps(doc, indent=2, default=str) + "\n")
    sys.stdout.flush()


def register_optional(app: typer.Typer, module_name: str) -> None:
    """Register `kvtool.cli.<module_name>` if it exists (commands land issue by issue)."""
    try:
        module = importlib.import_module(f"kvtool.cli.{module_name}")
    except ModuleNotFoundError as exc:
        if exc.name == f"kvtool.cli.{module_name}":
            return
        raise
    module.register(app)


# ---------------------------------------------------------------- cache options
PolicyOpt = Annotated[
    Optional[str], typer.Option("--policy", help="SSD policy: write_through | evict_only.", show_default=False)
]
DurabilityOpt = Annotated[
    Optional[str],
    typer.Option("--durability", help="SSD durability: best_effort | persistent | durable.", show_default=False),
]
AsyncOpt = Annotated[
    Optional[bool],
    typer.Option("--async/--sync", help="Write SSD blocks from a background writer (default) or inline.", show_default=False),
]
BlockSizeOpt = Annotated[Optional[int], typer.Option("--block-size", help="Tokens per cached block.", show_default=False)]
RamBytesOpt = Annotated[
    Optional[str], typer.Option("--ram-bytes", help="RAM tier budget, e.g. 512MiB, 2GB.", show_default=False)
]
NoSSDOpt = Annotated[bool, typer.Option("--no-ssd", help="RAM tier only.")]


def build_config(
    config_path: Optional[Path] = None,
    cache_dir: Optional[Path] = None,
    policy: Optional[str] = None,
    durability: Optional[str] = None,
    async_writes: Optional[bool] = None,
    block_size: Optional[int] = None,
    ram_bytes: Optional[str] = None,
    no_ssd: bool = False,
):
    """A validated `KVToolConfig` from `--config` plus flags (flags win).

    Raises:
        CLIError: missing config file or bad size string. ConfigError: invalid field value.
    """
    from kvtool.config import load_config
    from kvtool.units import parse_size

    if config_path is not None and not config_path.is_file():
        raise CLIError(f"config file not found: {config_path}")
    try:
        ram = parse_size(ram_bytes) if ram_bytes is not None else None
    except ValueError as exc:
        raise CLIError(f"--ram-bytes: {exc}") from None
    return load_config(
        config_path,
        ssd_cache_dir=cache_dir,
        ssd_policy=policy,
        ssd_durability=durability,
        ssd_async_writes=async_writes,
        block_size=block_size,
        ram_bytes=ram,
        ssd_enabled=False if no_ssd else None,
    )


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


def load_engine(model: str, config):
    """Load a model and build an `Engine`, mapping load failures to `CLIError`."""
    from kvtool.engine import Engine
    from kvtool.models.loader import ModelLoadError

    try:
        return Engine.from_spec(model, config)
    except ModelLoadError as exc:
        raise CLIError(str(exc)) from None


# ---------------------------------------------------------------- signals
class Interrupted(BaseException):
    """SIGINT/SIGTERM turned into an exception (a BaseException, like KeyboardInterrupt, so no
    `except Exception` on the request path swallows it). `signum` gives the exit code 128+n."""

    def __init__(self, signum: int):
        import signal

        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_interrupted(signum, _frame):
    import signal

    # One signal is enough: further ones are ignored while the writer drains.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise Interrupted(signum)


@contextmanager
def signals_raise() -> Iterator[None]:
    """While active, SIGINT and SIGTERM raise `Interrupted`; previous handlers restored after."""
    import signal

    old = {s: signal.signal(s, _raise_interrupted) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def ignore_signals() -> None:
    """Ignore SIGINT/SIGTERM (for the clean-shutdown path; `signals_raise` restores them)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
