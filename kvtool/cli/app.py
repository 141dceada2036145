"""The `kvtool` command line: wiring only. Each command lives in its own module and registers itself.

The root group (`common.KVToolGroup`) turns every bad input, usage errors included, into one
`error:` line and exit 2; `-h` is an alias of `--help` on every command; `--version` prints
`kvtool <version>` (pyproject.toml's `version`, read from the installed metadata);
`--install-completion` / `--show-completion` set up shell completion (Typer's).
"""

from __future__ import annotations

import importlib.metadata
from typing import Annotated, Any

import typer
import typer.core

from kvtool.cli import common

_TYPER_DISPLAY_TYPE_RICH = typer.core.TyperOption.display_type_rich  # Typer's own, replaced below


def _display_type_rich(self: Any, ctx: Any) -> str | None:
    """Typer's rich help shows a type tag on every option, `<bool>` on a switch (`--dry-run`,
    `--async/--sync`, `-h`) too, although a switch takes no value: show none there, else Typer's
    own tag. (Help rendering only.)"""
    return None if (self.is_flag or self.count) and self.metavar is None else _TYPER_DISPLAY_TYPE_RICH(self, ctx)


typer.core.TyperOption.display_type_rich = _display_type_rich  # type: ignore[method-assign]  # a patch of Typer's class


app = typer.Typer(
    name="kvtool",
    cls=common.KVToolGroup,
    help=(
        "Persistent, tiered (RAM over SSD) KV cache for MLX language models.\n\n"
        "Example:\n\n"
        "  kvtool serve-once --prompt-file doc.txt --max-tokens 32   # second run hits the SSD tier\n\n"
        "  kvtool inspect --json"
    ),
    context_settings={"help_option_names": ["-h", "--help"]},  # inherited by every sub-command
    no_args_is_help=True,
    add_completion=True,  # --install-completion / --show-completion (bash, zsh, fish, PowerShell)
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)


def version() -> str:
    """kvtool's version: the installed distribution's, else `kvtool.__version__`, else `unknown`."""
    try:
        return importlib.metadata.version("kvtool")
    except importlib.metadata.PackageNotFoundError:
        import kvtool

        return str(getattr(kvtool, "__version__", "unknown"))


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"kvtool {version()}")
        raise typer.Exit(common.EXIT_OK)


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_print_version, is_eager=True, help="Print 'kvtool <version>' and exit."),
    ] = False,
) -> None:
    # Only hosts the root options; the help text is the Typer's.
    pass


COMMAND_MODULES = ("cmd_serve", "cmd_serve_http", "cmd_warm", "cmd_model", "cmd_validate", "cmd_prune", "cmd_rm",
                   "cmd_inspect", "cmd_interop", "cmd_bench", "cmd_bench_plan", "cmd_remote", "cmd_config")


def _register() -> None:
    # Imported here so that `kvtool --help` stays fast and each module only wires its command.
    # Every command module must import: a missing one is an error, never a silently absent command.
    import importlib

    for name in COMMAND_MODULES:
        importlib.import_module(f"kvtool.cli.{name}").register(app)


def main() -> None:
    """Console-script entry point."""
    _register()
    app(prog_name="kvtool")


if __name__ == "__main__":  # pragma: no cover
    main()
