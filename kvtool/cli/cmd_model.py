"""`kvtool model`: the embedded model presets (`path`, `list`)."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from kvtool.cli.common import CLIError, JsonOpt, cli_command, console
from kvtool.cli.output import Output, print_table
from kvtool.models import embedded
from kvtool.units import format_size

model_app = typer.Typer(
    name="model",
    help=(
        "Embedded model presets (Qwen2 architecture, deterministic random weights, built on demand).\n\n"
        "Example:\n\n"
        "  kvtool model list\n\n"
        "  kvtool model path small"
    ),
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode="rich",
)

NameArg = Annotated[
    str, typer.Argument(help=f"Preset name: {', '.join(embedded.PRESETS)}.", show_default=True)
]


def register(app: typer.Typer) -> None:
    """Add the `model` sub-app to the root `app`."""
    app.add_typer(model_app, name="model")


@model_app.command("path")
@cli_command
def path_cmd(name: NameArg = embedded.DEFAULT_PRESET) -> None:
    """Print the model directory of a preset, building it first if missing.

    The directory is an ordinary mlx-lm model ([bold]mlx_lm.load(path)[/] works). Location:
    $KVTOOL_MODELS_DIR or ~/.cache/kvtool-models.

    Example:

      kvtool model path tiny
    """
    _check_preset(name)
    typer.echo(str(embedded.model_dir(name)))


@model_app.command("list")
@cli_command
def list_cmd(json_out: JsonOpt = False) -> None:
    """List the presets with their shape and whether they are built.

    --json: one object with schema_version and models (a list, one object per preset).

    Example:

      kvtool model list --json
    """
    rows = preset_rows()
    Output.from_flags(json_out).emit({"models": rows}, lambda: print_table(console, _table(rows)))


def preset_rows() -> list[dict]:
    """One dict per preset: shape, parameter count, KV bytes per token (float32), built, path."""
    rows = []
    for preset in embedded.PRESETS.values():
        vocab_size = embedded.vocab_size(preset)
        rows.append({
            "name": preset.name, "layers": preset.num_hidden_layers, "hidden": preset.hidden_size,
            "heads": preset.num_attention_heads, "kv_heads": preset.num_key_value_heads, "head_dim": preset.head_dim,
            "intermediate": preset.intermediate_size, "vocab": vocab_size, "params": preset.num_params(vocab_size),
            "kv_bytes_per_token": preset.kv_bytes_per_token(2 if preset.dtype == "bfloat16" else 4),
            "dtype": preset.dtype, "built": embedded.is_built(preset.name),
            "path": str(embedded.model_dir(preset.name, build=False)), "description": preset.description,
        })
    return rows


def _table(rows: list[dict]) -> Table:
    """Render `preset_rows()` as a rich table (fits 80 columns; descriptions only in --json)."""
    table = Table(title=f"models dir: {escape(str(embedded.models_root()))}", title_justify="left")
    table.add_column("name")
    for col in ("layers", "hidden", "heads", "kv", "ffn", "params", "KV/token", "built"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["name"], *(str(r[k]) for k in ("layers", "hidden", "heads", "kv_heads", "intermediate")),
                      f"{r['params'] / 1e6:.1f}M", format_size(r["kv_bytes_per_token"]), "yes" if r["built"] else "no")
    return table


def _check_preset(name: str) -> None:
    """Raise CLIError (exit 2) for an unknown preset name."""
    if not embedded.is_preset(name):
        raise CLIError(f"unknown model preset {name!r} (choose from: {', '.join(embedded.PRESETS)})")
