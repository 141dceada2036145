"""`kvtool config show`: the effective settings and where each value came from.

The values are those every command would use with the same flags and environment
(`common.CacheFlags.settings`: flag > `KVTOOL_<FIELD>` variable > config file > default). `--json`
shows each as a config file would hold it (sizes in bytes, durations with their unit,
`ssd_dir_mode` in octal), `remote_url` with its password masked (`kvtool.config.remote_url.mask_url`);
the table shows sizes in human units (`2 GiB`) and the TTL `kvtool prune` uses when none is set.
"""

from __future__ import annotations

from datetime import timedelta
from enum import Enum
from pathlib import Path
from typing import Any

import typer
from rich.markup import escape
from rich.table import Table

from kvtool.cli import common
from kvtool.cli.output import Output
from kvtool.units import format_duration, format_size

config_app = typer.Typer(
    name="config",
    help=(
        "kvtool's settings: flag > environment (KVTOOL_<FIELD>) > config file > default.\n\n"
        "Example:\n\n"
        "  kvtool config show\n\n"
        "  KVTOOL_BLOCK_SIZE=128 kvtool config show --json"
    ),
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode="rich",
)

def register(app: typer.Typer) -> None:
    """Add the `config` sub-app to the root `app`."""
    app.add_typer(config_app, name="config")


@config_app.command("show")
@common.cache_options("config", "cache_dir", "policy", "durability", "async_writes", "block_size", "ram_bytes", "no_ssd",
                      "codec")
@common.cli_command
def show_cmd(cache: common.CacheFlags = common.CACHE, json_out: common.JsonOpt = False) -> None:
    """Print the effective settings and where each value came from: a flag, an environment
    variable (KVTOOL_<FIELD>, e.g. KVTOOL_BLOCK_SIZE; KVTOOL_CACHE_DIR for ssd_cache_dir), the
    config file (--config, else $KVTOOL_CONFIG, else $XDG_CONFIG_HOME/kvtool/config.toml, by
    default ~/.config/kvtool/config.toml, when it exists) or the default. The cache options are
    those of serve-once and warm. A password in remote_url is shown as ***.

    --json: one object with schema_version, config_file (path and how it was found, or null)
    and settings: per field its value, source (flag, env, file, default), from (the flag, the
    variable or the file; null for a default) and env (the variables that set it).

    Example:

      kvtool config show

      KVTOOL_SSD_POLICY=evict_only kvtool config show --block-size 128 --json

    Exit codes: 0 shown; 2 a bad value in any source (one error line naming the flag, variable
    or file), a missing --config or $KVTOOL_CONFIG file.
    """
    common.setup_logging()  # a deprecated field's warning goes to stderr as every command's
    out = Output.from_flags(json_out)
    settings = cache.settings()
    doc = settings_document(settings)
    out.emit(doc, lambda: _print_human(out, settings, doc))


def settings_document(settings: Any) -> dict[str, Any]:
    """The `--json` document (without `schema_version`) of a `kvtool.config.settings.Settings`."""
    from kvtool.config.settings import env_names

    cfg = settings.config
    file = None if settings.config_file is None else {"path": str(settings.config_file),
                                                      "found_by": settings.config_file_origin}
    rows = {
        name: {"value": shown_value(name, getattr(cfg, name)), "source": origin.kind, "from": origin.name,
               "env": list(env_names(name))}
        for name, origin in settings.origins.items()
    }
    return {"config_file": file, "settings": rows}


def shown_value(field: str, value: Any) -> Any:
    """`value` of `field` as a config file would hold it, JSON-ready: None, a bool, a number or
    a string (paths; durations with their unit; `ssd_dir_mode` in octal; `remote_url` masked)."""
    from kvtool.config.remote_url import mask_url

    if field == "ssd_dir_mode":
        return oct(value)
    if value is None or isinstance(value, (bool, int, float)):
        return value
    if field == "remote_url":
        return mask_url(value)
    if isinstance(value, timedelta):
        return format_duration(value.total_seconds())
    if isinstance(value, Enum):
        return value.value
    return str(value) if isinstance(value, Path) else value


def _print_human(out: Output, settings: Any, doc: dict[str, Any]) -> None:
    """The settings as a table: field, value (`-` for none; sizes in human units; `ssd_ttl` the TTL
    in effect), source (`kvtool.config.settings.Origin`)."""
    file = doc["config_file"]
    out.print(f"config file: {escape(str(file['path']))} ({escape(str(file['found_by']))})" if file else "config file: none",
              highlight=False)
    table = Table()
    for column in ("field", "value", "source"):
        table.add_column(column, overflow="fold")
    for name, row in doc["settings"].items():
        table.add_row(name, escape(str(_human_value(name, row["value"], settings.config))), escape(str(settings.origins[name])))
    out.table(table)


def _human_value(field: str, value: Any, cfg: Any) -> str:
    """`value` (as `shown_value` gives it) for the table: a byte size in human units (exact in
    `--json`), `ssd_ttl` as the TTL in effect when unset (`KVToolConfig.ttl_s`: 7d by default)."""
    if field == "ssd_ttl" and value is None:
        return f"{format_duration(cfg.ttl_s)} (default)"
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value).lower()
    if field.endswith("_bytes") and isinstance(value, int):
        return format_size(value)
    return str(value)
