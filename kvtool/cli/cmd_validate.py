"""`kvtool validate`: check the SSD cache, repair what is wrong, report per namespace."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from kvtool.cli import common
from kvtool.cli.cmd_remote import validate_remote
from kvtool.cli.output import Output
from kvtool.cli.target import TARGET, Target, target_options
from kvtool.progress import progress
from kvtool.units import format_bytes

HELP = """Check every namespace of the SSD cache and repair it, without losing a block that verifies.

Removes leftover temp files and malformed index rows, clamps access times in the future, rewrites a row that disagrees with its segment record from the record, re-adopts the verified records of orphan segment files, drops rows whose segment file is gone or damaged (with --deep every record's checksum is verified), and removes blocks whose parent chain is broken. An unreadable index is rebuilt from the segment files with --rebuild-index. Outdated (older format) and foreign (meta contradicting the namespace name) namespaces and symlinks are left untouched and reported. Safe to run while another kvtool process serves from the same cache (--rebuild-index: only while none uses that namespace). A repairing run holds the cache's maintenance lock, so it never runs at the same time as a prune, an rm or another validate (--dry-run takes no lock).

With --remote (or --remote-url URL), validate the remote tier's server instead (as `kvtool remote validate`): every value is read and verified (header, namespace, checksums, codec, the chain hash of its parent and token ids); the ones that fail and parts no manifest names are deleted (--dry-run: only reported). Safe beside live kvtool processes.

Examples:

  kvtool validate

  kvtool validate --deep --dry-run --json

  kvtool validate --rebuild-index --namespace 3fa2

  kvtool validate --remote --dry-run --json      # the server of remote_url / $KVTOOL_REMOTE_URL

  17 4 * * *  kvtool validate --quiet      # crontab line: silent unless something was found

Exit codes: 0 clean; 1 problems found (repaired unless --dry-run); 2 could not run (with --remote: bad URL, unreachable server, wrong password, TLS failure, unknown namespace); 3 a prune, rm or validate is running on this cache (try again, or use --dry-run).
"""

DeepOpt = Annotated[bool, typer.Option("--deep", help="Read every record and verify its checksum (slow).")]
RebuildOpt = Annotated[
    bool, typer.Option("--rebuild-index", help="Rebuild unreadable indexes from their segment files.")
]
QuietOpt = Annotated[
    bool, typer.Option("--quiet", "-q", help="Print nothing when clean; otherwise only the problems, on stderr.")
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
    ("not regular files", "irregular_removed"),
    ("removals finished", "removals_finished"),
    ("recovered", "blocks_recovered"),
    ("unlink failed", "unlink_failed"),
)


@target_options
@common.cli_command
def validate_cmd(
    cache_dir: common.CacheDirOpt = None,
    namespace: common.NamespaceOpt = None,
    deep: DeepOpt = False,
    dry_run: common.DryRunOpt = False,
    json_out: common.JsonOpt = False,
    quiet: QuietOpt = False,
    rebuild_index: RebuildOpt = False,
    target: Target = TARGET,
) -> int:
    from kvtool.ops.validate import validate

    out = Output.from_flags(json_out, quiet)
    if target.server is not None:
        common.refuse_options({"--cache-dir": cache_dir, "--deep": deep, "--rebuild-index": rebuild_index}, "with --remote")
        return validate_remote(out, target.server, namespace, dry_run=dry_run)
    root = target.cache_config(cache_dir).ssd_cache_dir
    with progress("kvtool validate", console=out.err_console, bar=out.show_progress, lines=not out.quiet) as bar:
        report = validate(root, namespace=namespace, deep=deep, dry_run=dry_run, rebuild_index=rebuild_index,
                          progress=_BarProgress(bar) if bar is not None else None)  # fmt: skip
    out.emit(report.to_dict, lambda: _print_human(report, out))
    if out.quiet and report.problems:
        _print_problems(report, out)
    return common.EXIT_PROBLEMS if report.problems else common.EXIT_OK


class _BarProgress:
    """Adapter from validate's `progress(namespace, done, total)` to one rich task per namespace."""

    def __init__(self, bar) -> None:
        self._bar = bar
        self._tasks: dict[str, int] = {}

    def __call__(self, namespace: str, done: int, total: int) -> None:
        if namespace not in self._tasks:
            self._tasks[namespace] = self._bar.add_task(f"validate {namespace[:12]}", total=total)
        self._bar.update(self._tasks[namespace], completed=done, total=total)


def _found(ns) -> list[str]:
    found = [f"{label} {getattr(ns, attr)}" for label, attr in _COLUMNS if getattr(ns, attr)]
    found += [f"symlinks {len(ns.symlinks)}"] if ns.symlinks else []
    kept = len(ns.irregular) - ns.irregular_removed
    found += [f"directories under file names {kept}"] if kept else []
    found += ["index rebuilt"] if ns.index_rebuilt else []
    return found


def _print_problems(report, out: Output) -> None:
    """--quiet with problems: one line per namespace that was not clean, then the summary (stderr)."""
    for ns in report.namespaces:
        if ns.problems:
            detail = "; ".join(x for x in (", ".join(_found(ns)), ns.message) if x) or ns.status
            out.problem(f"{ns.namespace}: {ns.outcome}: {escape(detail)}")
    for link in report.symlinks:
        out.problem(f"{escape(str(report.cache_dir))}/{escape(link)}: a symlink in the cache directory (never followed)")
    fixed = " (dry run: nothing changed)" if report.dry_run else ""
    out.problem(f"kvtool validate {escape(str(report.cache_dir))}: {report.problems} problem(s) found{fixed}")


def _print_human(report, out: Output) -> None:
    mode = " (dry run: nothing changed)" if report.dry_run else ""
    if not report.namespaces:
        out.print(f"no namespaces under {escape(str(report.cache_dir))}{mode}")
        return
    table = Table(title=escape(f"kvtool validate {report.cache_dir}{' --deep' if report.deep else ''}{mode}"))
    for name in ("namespace", "status", "outcome", "rows", "files", "problems", "freed"):
        table.add_column(name, justify="left" if name in ("namespace", "status", "outcome", "problems") else "right")
    for ns in report.namespaces:
        style = {"clean": "green", "repaired": "yellow", "problems": "yellow", "skipped": "yellow"}.get(ns.outcome, "red")
        table.add_row(
            ns.namespace[:12], ns.status, f"[{style}]{ns.outcome}[/]", str(ns.rows), str(ns.files),
            ", ".join(_found(ns)) or "-", format_bytes(ns.bytes_freed),
        )  # fmt: skip
    out.table(table)
    for ns in report.namespaces:
        if ns.message:
            out.print(f"[red]{ns.namespace}[/]: {escape(ns.message)}")
    for link in report.symlinks:
        out.print(f"[red]{escape(str(report.cache_dir))}/{escape(link)}[/]: a symlink in the cache directory (never followed)")
    summary = "clean" if not report.problems else f"{report.problems} problem(s) found"
    out.print(summary + mode)


def register(app: typer.Typer) -> None:
    """Add `kvtool validate` to the app."""
    app.command("validate", help=HELP)(validate_cmd)
