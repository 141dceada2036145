"""`kvtool prune`: plan, show, confirm (or --yes / --dry-run), execute. Cron-safe."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from kvtool.cli import common
from kvtool.cli.cmd_remote import prune_remote
from kvtool.cli.output import print_table
from kvtool.cli.removal import REMOVAL, Removal, confirm_and_execute, print_freed, removal_options
from kvtool.cli.target import TARGET, Target, target_options
from kvtool.progress import progress
from kvtool.units import format_bytes, format_duration, parse_duration, parse_size

EXIT_LOCKED = 3  # another prune holds <cache_dir>/.prune.lock (kvtool.disk.lock.EXIT_LOCKED)
NO_TTL = ("none", "off", "never")

HELP = """Remove old and least recently used segment files from the SSD tier.

Plan first, per segment file (the unit that frees space): segments whose blocks were last used before --ttl (default: the config's ssd_ttl, 7d; --ttl none disables it); then the least recently used segments until each namespace (or, with --all, the whole cache) fits --max-bytes. Descendants of a removed block go too (no prefix lookup can reach them). Namespaces of an older format are removed whole once unused for the TTL. On a full disk, prune still runs (files first, rows after). The plan is shown, then executed after confirmation (--yes skips it; without a terminal --yes is required). Safe while serve-once or warm use the same cache; two prunes never run at once.

Examples:

  kvtool prune --ttl 7d --dry-run

  kvtool prune --max-bytes 50GB --yes

  kvtool prune --all --max-bytes 200GiB --ttl 30d --yes --quiet      # cron

  17 3 * * *  kvtool prune --ttl 7d --max-bytes 50GB --yes --quiet   # crontab line

  kvtool prune --remote --ttl 14d --max-bytes 20GB --yes              # the remote tier's server

With --remote (or --remote-url URL), prune the remote tier's server instead (as `kvtool remote prune`): values unused for --ttl (OBJECT IDLETIME; default: the config's ssd_ttl), then the least recently used values of each namespace until it fits --max-bytes (server memory, MEMORY USAGE); parts no manifest names always go.

Durations carry their unit: 7d, 12h, 30m, 45s, or combined: 1d12h. A bare number (--ttl 7) and M (minutes or months?) are refused: they would be ambiguous.

Exit codes: 0 pruned, nothing to prune, or --dry-run; 1 declined at the prompt, or a namespace index could not be read or a file could not be removed; 2 bad input (size, duration, namespace, cache dir; with --remote: bad URL, unreachable server, wrong password, TLS failure), or no terminal and no --yes; 3 another prune, rm or validate is running on this cache; 130/143 interrupted (deferred until the current deletion finished).
"""

TtlOpt = Annotated[
    str | None,
    typer.Option("--ttl", help="Remove blocks not accessed for this long: 7d, 12h, 30m, 45s, 1d12h (a unit is required); 'none' = no TTL.", show_default=False),
]
MaxBytesOpt = Annotated[
    str | None,
    typer.Option("--max-bytes", help="Byte budget per namespace (whole cache with --all): 50GB, 512MiB.", show_default=False),
]
AllOpt = Annotated[bool, typer.Option("--all", help="One budget and one LRU order over the whole cache.")]


@target_options
@removal_options()
@common.cli_command
def prune_cmd(
    ttl: TtlOpt = None,
    max_bytes: MaxBytesOpt = None,
    namespace: common.NamespaceOpt = None,
    all_namespaces: AllOpt = False,
    removal: Removal = REMOVAL,
    cache_dir: common.CacheDirOpt = None,
    target: Target = TARGET,
) -> int:
    from kvtool.ops.prune import check_limits, execute_prune, plan_prune
    from kvtool.ops.scan import scan_cache

    ttl_s, budget = _parse_limits(ttl, max_bytes)
    if target.server is not None:
        return _prune_remote(target, cache_dir, ttl, ttl_s, budget, namespace, all_namespaces, removal)
    cfg = target.cache_config(cache_dir)
    if ttl is None:
        ttl_s = cfg.ttl_s
    check_limits(ttl_s, budget, namespace, all_namespaces)
    root = cfg.ssd_cache_dir
    removal.preflight(root, "prune", "add --yes (e.g. in cron)")
    # a dry run only reads; without a terminal a progress line at most every 10 s (kvtool.progress)
    with removal.maintenance_lock(root), progress("kvtool prune", bar=False, lines=not removal.out.quiet) as bar:
        task = bar.add_task("scanning the cache", total=None) if bar is not None else None
        plan = plan_prune(scan_cache(root, namespace, full=False), ttl_s, budget, all_namespaces)

        def execute(plan):  # named in the progress line first
            if bar is not None and task is not None:
                bar.update(task, description=f"removing {plan.total('prune_segments')} segment file(s)")
            return execute_prune(plan)

        return confirm_and_execute(
            plan, removal, execute=execute, print_plan=_print_plan, print_result=_print_result, nothing="nothing to prune",
            question=lambda: (f"Remove {plan.total('prune_blocks')} block(s) in {plan.total('prune_segments')} "
                              f"segment file(s), {format_bytes(plan.total('prune_bytes'))}?"),
        )  # fmt: skip


def _prune_remote(target: Target, cache_dir, ttl: str | None, ttl_s: float | None,
                  budget: int | None, namespace: str | None, all_namespaces: bool, removal: Removal) -> int:  # fmt: skip
    """`prune --remote`: --ttl is the idle time (default: the config's ssd_ttl), --max-bytes the
    budget of each namespace on the server."""
    common.refuse_options({"--cache-dir": cache_dir, "--all": all_namespaces}, "with --remote")
    if ttl is None:
        ttl_s = common.build_config(target.config).ttl_s
    if ttl_s is None and budget is None:
        raise common.CLIError("give --ttl, --max-bytes or both (--ttl none and no --max-bytes prunes nothing)")
    assert target.server is not None
    return prune_remote(target.server, removal, idle_s=ttl_s, max_bytes=budget, namespace=namespace)


def _parse_limits(ttl: str | None, max_bytes: str | None) -> tuple[float | None, int | None]:
    """(TTL in seconds, budget in bytes) from `--ttl` (a duration with its unit, or `none`) and
    `--max-bytes`; None where not given. Raises CLIError naming the flag (a bare `--ttl 7` too)."""
    no_ttl = ttl is not None and ttl.strip().lower() in NO_TTL
    return (common.parse_flag(None if no_ttl else ttl, parse_duration, "--ttl"),
            common.parse_flag(max_bytes, parse_size, "--max-bytes"))


def _print_plan(plan, out) -> None:
    budget = "none" if plan.max_bytes is None else format_bytes(plan.max_bytes)
    scope = "whole cache" if plan.scope == "all" else "per namespace"
    table = Table(
        title=f"kvtool prune {escape(str(plan.cache_dir))}: ttl {'none' if plan.ttl_s is None else format_duration(plan.ttl_s)}, budget {budget} ({scope})",
    )  # fmt: skip
    for name in ("namespace", "model", "stored", "prune", "ttl/lru/desc", "left"):
        table.add_column(name, justify="left" if name in ("namespace", "model") else "right", no_wrap=name != "model")
    for ns in plan.namespaces:
        stored = f"{format_bytes(ns.bytes)} ({ns.segments})"
        model = escape(ns.model_name or "-")
        if ns.remove_namespace:
            table.add_row(ns.namespace[:12], model, stored, f"[yellow]all ({ns.status})[/]", "-", "0 B")
            continue
        if ns.status not in ("ok", "empty") and not ns.by_file_age:
            table.add_row(ns.namespace[:12], model, stored, f"[red]{ns.status}[/]", "-", stored)
            continue
        table.add_row(
            ns.namespace[:12], model, stored, f"{format_bytes(ns.prune_bytes)} ({ns.prune_segments})",
            f"{ns.ttl_segments}/{ns.lru_segments}/{ns.descendant_segments}",
            f"{format_bytes(ns.bytes_after)} ({ns.segments_after})",
        )  # fmt: skip
    print_table(out, table)
    out.print("(n): segment files; ttl/lru/desc: segment files removed by each rule", highlight=False)
    for ns in plan.namespaces:
        if ns.message:
            out.print(f"[yellow]{ns.namespace}[/]: {escape(ns.message)}", highlight=False, soft_wrap=True)


def _print_result(plan, out) -> None:
    print_freed(out, plan, "pruned ", "file(s)")


def register(app: typer.Typer) -> None:
    """Add `kvtool prune` to the app."""
    app.command("prune", help=HELP)(prune_cmd)
