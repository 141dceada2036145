"""The `kvtool` command line: wiring only. Each command lives in its own module and registers itself."""

from __future__ import annotations

import typer

from kvtool.cli import common

app = typer.Typer(
    name="kvtool",
    help=(
        "Persistent, tiered (RAM over SSD) KV cache for MLX language models.\n\n"
        "Example:\n\n"
        "  kvtool serve-once --prompt-file doc.txt --max-tokens 32   # second run hits the SSD tier\n\n"
        "  kvtool inspect --json"
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)


def _register() -> None:
    # Imported here so that `kvtool --help` stays fast and each module only wires its command.
    from kvtool.cli import cmd_serve

    cmd_serve.register(app)
    for name in ("cmd_model", "cmd_validate", "cmd_warm", "cmd_prune", "cmd_inspect", "cmd_bench"):
        common.register_optional(app, name)


def main() -> None:
    """Console-script entry point."""
    _register()
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
