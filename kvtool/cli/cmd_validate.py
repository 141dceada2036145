"""`kvtool validate`: check the SSD cache, repair what is wrong, report per namespace."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Annotated

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvtool.cli import common
from kvtool.units import format_bytes
from kvtool.config import default_cache_dir

HELP = """Check every namespace of the SSD cache and repair it, without losing a block that verifies.

Removes leftover temp files and malformed index rows, clamps access times in the future, rewrites a row that disagrees with its segment record from the record, re-adopts the verified records of orphan segment files, drops rows whose segment file is gone or damaged (with --deep every record's checksum is verified), and removes blocks whose parent chain is broken. An unreadable index is rebuilt from the segment files with --rebuild-index. Outdated (older format) and foreign (meta contradicting the namespace name) namespaces and symlinks are left untouched and reported. Safe to run while another kvtool process serves from the same cache (--rebuild-index: only while none uses that namespace).

Examples:

  kvtool validate

  kvtool validate --deep --dry-run --json

  kvtool validate --rebuild-index --namespace 3fa2

Exit codes: 0 clean; 1 problems found (repaired unless --dry-run); 2 could not run.
"""

DeepOpt = Annotated[bool, typer.Option("--deep", help="Read every record and verify its checksum (slow).")]
RebuildOpt = Annotated[
    bool, typer.Option("--rebuild-index", help="Rebuild unreadable indexes from their segment files.")
]

_COLUMNS = (
    ("temp files", "temp_removed"),
    ("bad rows", "bad_rows_dropped"),
    ("clamped", "access_clamped"),
    ("rows repaired", "rows_repaired"),
    ("missing", "missing_rows_dropped"),
    ("corrupt", "corrupt_removed"),
    ("segment rows", "segment_rows_fixed"),
    ("adopted", "orphans_adopted"),
    ("orphans removed", "orphans_removed"),
    ("broken chain", "broken_chain_removed"),
    ("recovered", "blocks_recovered"),
    ("unlink failed", "unlink_failed"),
)


def validate_cmd(
    cache_dir: common.CacheDirOpt = None,
    namespace: common.NamespaceOpt = None,
    deep: DeepOpt = False,
    dry_run: common.DryRunOpt = False,
    json_out: common.JsonOpt = False,
    rebuild_index: RebuildOpt = False,
) -> None:
    with common.cli_errors():
        from kvtool.ops.validate import validate

        root = cache_dir if cache_dir is not None else default_cache_dir()
        with _progress(enabled=not json_out) as progress:
            report = validate(root, namespace=namespace, deep=deep, dry_run=dry_run, progress=progress,
                              rebuild_index=rebuild_index)  # fmt: skip
        if json_out:
            common.print_json(report.to_dict())
        else:
            _print_human(report)
        if report.problems:
            raise typer.Exit(common.EXIT_PROBLEMS)


class _RichProgress:
    """Adapter from validate's `progress(namespace, done, total)` to one rich bar per namespace."""

    def __init__(self) -> None:
        self._bar = Progress(
            TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            console=common.err_console, transient=True,
        )  # fmt: skip
        self._tasks: dict[str, int] = {}

    def __enter__(self) -> "_RichProgress":
        self._bar.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._bar.__exit__(*exc)

    def __call__(self, namespace: str, done: int, total: int) -> None:
        if namespace not in self._tasks:
            self._tasks[namespace] = self._bar.add_task(f"validate {namespace[:12]}", total=total)
        self._bar.update(self._tasks[namespace], completed=done, total=total)


def _progress(enabled: bool):
    return _RichProgress() if enabled else nullcontext(None)


def _print_human(report) -> None:
    mode = " (dry run: nothing changed)" if report.dry_run else ""
    if not report.namespaces:
        common.console.print(f"no namespaces under {report.cache_dir}{mode}")
        return
    table = Table(title=f"kvtool validate {report.cache_dir}{' --deep' if report.deep else ''}{mode}")
    for name in ("namespace", "status", "outcome", "rows", "files", "problems", "freed"):
        table.add_column(name, justify="left" if name in ("namespace", "status", "outcome", "problems") else "right")
    for ns in report.namespaces:
        style = {"clean": "green", "repaired": "yellow", "problems": "yellow", "skipped": "yellow"}.get(ns.outcome, "red")
        found = [f"{label} {getattr(ns, attr)}" for label, attr in _COLUMNS if getattr(ns, attr)]
        found += [f"symlinks {len(ns.symlinks)}"] if ns.symlinks else []
        found += ["index rebuilt"] if ns.index_rebuilt else []
        table.add_row(
            ns.namespace[:12], ns.status, f"[{style}]{ns.outcome}[/]", str(ns.rows), str(ns.files),
            ", ".join(found) or "-", format_bytes(ns.bytes_freed),
        )  # fmt: skip
    common.console.print(table)
    for ns in report.namespaces:
        if ns.message:
            common.console.print(f"[red]{ns.namespace}[/]: {ns.message}", highlight=False, soft_wrap=True)
    for link in report.symlinks:
        common.console.print(f"[red]{report.cache_dir}/{link}[/]: a symlink in the cache directory (never followed)",
                             highlight=False, soft_wrap=True)  # fmt: skip
    summary = "clean" if not report.problems else f"{report.problems} problem(s) found"
    common.console.print(summary + mode)


def register(app: typer.Typer) -> None:
    """Add `kvtool validate` to the app."""
    app.command("validate", help=HELP)(validate_cmd)
