"""`kvtool remote inspect|validate|rm|prune|push`: the remote tier's store (Redis / Valkey) for operators.

The server comes from `--remote-url` (`--url` is a hidden alias), else the config's `remote_url`,
else `$KVTOOL_REMOTE_URL` (`Server.resolve`); its URL is shown with the password masked. The work
is `kvtool.ops.remote_ops`.

The same operations back `kvtool inspect|validate|prune|rm --remote` (`kvtool.cli.target.Server`, `inspect_remote`,
`validate_remote`, `rm_remote`, `prune_remote`): one connection, confirmation and output path for both.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from kvtool.cli import common
from kvtool.cli.output import Output
from kvtool.cli.removal import ABORTED, REMOVAL, Removal, removal_options
from kvtool.cli.target import SERVER, Server, UrlOpt, existing_cache_dir, server_options
from kvtool.units import format_bytes

remote_app = typer.Typer(
    name="remote",
    help=(
        "The remote tier's store: kvtool blocks shared between hosts on Redis (>= 6.2) or Valkey, one node or a "
        "Redis Cluster. SCAN only (never KEYS); safe beside live servers and kvtool processes. "
        "`kvtool inspect|validate|prune|rm --remote` run the same operations.\n\n"
        "The server: --remote-url, else remote_url in --config, else $KVTOOL_REMOTE_URL. Put the password in "
        "$KVTOOL_REMOTE_PASSWORD rather than in --remote-url (a command line is visible to other users).\n\n"
        "Example:\n\n"
        "  kvtool remote inspect --remote-url redis://cache-host:6379/0\n\n"
        "  KVTOOL_REMOTE_URL=redis+cluster://node1:7000 kvtool remote prune --idle 7d --yes"
    ),
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode="rich",
)

def _remove(server: Server, removal: Removal, what: str, plan_fn: Callable[[Any, bool], Any]) -> int:
    """Refuse without a way to confirm (`what`: the verb), connect, plan (`plan_fn(conn, True)`),
    show it and ask unless --yes / --dry-run, then remove (`plan_fn(conn, False)`) and report.
    Returns the exit code: 0, or 1 when declined at the prompt (`ABORTED` on stderr)."""
    removal.refuse_without_terminal(what)
    with server.connect() as conn:
        out, plan = removal.out, plan_fn(conn, True)
        if not removal.dry_run and plan.keys:
            if not removal.yes:
                _print_removal(plan, out.interaction.print if not out.json else out.note)
                if not out.confirm(f"Remove {plan.values} block(s), {plan.keys} key(s), {format_bytes(plan.bytes)}?"):
                    out.err_console.print(ABORTED)
                    return common.EXIT_PROBLEMS
            plan = plan_fn(conn, False)
        out.emit(plan.to_dict, lambda: _print_removal(plan, out.print))
    return common.EXIT_OK


# ----------------------------------------------------------------------------- operations
def inspect_remote(out: Output, server: Server, namespace: str | None = None) -> int:
    """`inspect` on the server, printed (or one JSON document). Returns the exit code (0).

    Raises:
        CLIError, ConfigError, RemoteURLError, RemoteConnectError, RemoteOpsError: one line each.
    """
    from kvtool.ops.remote_ops import inspect

    with server.connect() as conn:
        report = inspect(conn, namespace, server.max_keys)
    out.emit(report.to_dict, lambda: _print_inspect(report, out))
    return common.EXIT_OK


def validate_remote(out: Output, server: Server, namespace: str | None = None, *, dry_run: bool = False) -> int:
    """`validate` on the server (delete what fails unless `dry_run`), printed. Returns the exit
    code: 0 every value verified, 1 problems found. With `out.quiet`, only problems (stderr).

    Raises:
        CLIError, ConfigError, RemoteURLError, RemoteConnectError, RemoteOpsError: one line each.
    """
    from kvtool.ops.remote_ops import validate

    with server.connect() as conn:
        report = validate(conn, namespace, dry_run=dry_run, max_keys=server.max_keys)
    bad = bool(report.problems or report.orphan_parts)
    out.emit(report.to_dict, lambda: _print_validate(report, out.print))
    if out.quiet and bad:
        _print_validate(report, out.problem)
    return common.EXIT_PROBLEMS if bad else common.EXIT_OK


def rm_remote(server: Server, removal: Removal, namespace: str, hashes: Sequence[str] | None = None) -> int:
    """Remove a namespace (`hashes` None: every key of it) or its blocks `hashes` (32 hex
    characters each, with their parts; an empty list removes nothing) from the server: plan,
    confirm (as `removal` says: --dry-run, --yes), remove, report. Returns the exit code: 0, or 1
    when declined at the prompt.

    Raises:
        CLIError: no terminal and neither --yes nor --dry-run; and as `inspect_remote`.
    """
    from kvtool.ops.remote_ops import RemovalReport, rm

    def plan(conn: Any, dry: bool) -> Any:
        if hashes is not None and not hashes:
            return RemovalReport(conn.remote.masked, namespace, dry)
        return rm(conn, namespace, hashes or (), dry_run=dry, max_keys=server.max_keys)

    return _remove(server, removal, "remove", plan)


def prune_remote(server: Server, removal: Removal, *, idle_s: float | None = None,
                 max_bytes: int | None = None, namespace: str | None = None) -> int:
    """Remove values idle for `idle_s` seconds, then each namespace's least recently used values
    beyond `max_bytes` (bytes of server memory): plan, confirm (as `removal` says: --dry-run,
    --yes), remove, report. Returns the exit code: 0, or 1 when declined at the prompt.

    Raises:
        CLIError: no terminal and neither --yes nor --dry-run; and as `inspect_remote`.
        RemoteOpsError: neither rule given, or `idle_s` under an LFU policy.
    """
    from kvtool.ops.remote_ops import prune

    return _remove(server, removal, "prune", lambda conn, dry: prune(
        conn, idle_s=idle_s, max_bytes=max_bytes, namespace=namespace, dry_run=dry, max_keys=server.max_keys))


# ----------------------------------------------------------------------------- inspect
@remote_app.command("inspect")
@server_options()
@common.cli_command
def inspect_cmd(remote_url: UrlOpt = None, namespace: common.NamespaceOpt = None, json_out: common.JsonOpt = False,
                server: Server = SERVER) -> int:
    """What kvtool holds on the server: per namespace (layout key) its blocks, split values,
    parts and memory (MEMORY USAGE); per server its version, memory, maxmemory policy, evicted
    and expired keys (INFO). Read-only; leaves the keys' LRU clocks alone.

    Example:

      kvtool remote inspect --remote-url redis://cache-host:6379/0

      kvtool remote inspect --namespace 3fa2 --json

    Exit codes: 0 ok; 2 bad URL, unreachable server, wrong password, TLS failure, unknown namespace.
    """
    return inspect_remote(Output.from_flags(json_out), server.at(remote_url), namespace)


def _print_inspect(report: Any, out: Output) -> None:
    out.print(f"{escape(report.url)}{' (cluster)' if report.cluster else ''}")
    for s in report.servers:
        version = s.get("valkey_version") and f"valkey {s['valkey_version']}" or f"redis {s.get('redis_version', '?')}"
        limit = format_bytes(s["maxmemory"]) if s.get("maxmemory") else "no limit"
        out.print(f"  {escape(str(s['node']))}: {version} | memory {format_bytes(s.get('used_memory', 0))} of {limit} "
                  f"({s.get('maxmemory_policy', '?')}) | evicted keys {s.get('evicted_keys', 0)} | expired keys "
                  f"{s.get('expired_keys', 0)}")  # fmt: skip
    if not report.namespaces:
        out.print("no kvtool keys")
    else:
        table = Table()
        for name in ("namespace", "format", "blocks", "split", "parts", "memory"):
            table.add_column(name, justify="left" if name in ("namespace", "format") else "right")
        for ns in report.namespaces:
            fmt = f"{ns.format} (outdated)" if ns.outdated else ns.format
            table.add_row(ns.namespace, fmt, str(ns.blocks), str(ns.split_values), str(ns.parts), format_bytes(ns.bytes))
        out.table(table)
    more = " (listing truncated at --max-keys)" if report.truncated else ""
    other = f", {report.other_keys} other kvtool:* key(s)" if report.other_keys else ""
    out.print(f"{report.keys_scanned} key(s) scanned{other}{more}")


# ----------------------------------------------------------------------------- push
@remote_app.command("push")
@server_options("url", "cluster", "timeout", "config")
@common.cli_command
def push_cmd(cache_dir: common.CacheDirOpt = None, namespace: common.NamespaceOpt = None, remote_url: UrlOpt = None,
             json_out: common.JsonOpt = False, server: Server = SERVER) -> int:
    """Push an SSD cache to the server, so that other hosts start warm: every segment of each
    namespace (or of --namespace) read once, each record verified before it is stored with SET NX
    (blocks the server holds already are not rewritten). The SSD cache is not changed; records
    that fail verification are skipped and counted (run `kvtool validate` to repair them).

    Example:

      kvtool remote push --cache-dir ~/.cache/kvtool --remote-url redis://cache-host:6379/0

      kvtool remote push --namespace 3fa2 --json

    Exit codes: 0 ok; 1 a record failed verification, a segment or an index was unreadable, or
    the server refused blocks (e.g. out of memory); 2 bad URL, unreachable server, wrong password,
    unknown namespace, a --cache-dir that does not exist, or the server failed during the push
    (which stops there; what was done is printed first).
    """
    from kvtool.disk.fsops import list_namespaces

    out = Output.from_flags(json_out)
    root = existing_cache_dir(common.CacheFlags(server.config, cache_dir).settings(), create=None)
    server = server.at(remote_url)
    with server.connect():  # checks the URL and that the server answers
        pass
    url_used, cluster_used, timeout_s = server.resolve()
    names = [p.name for p in list_namespaces(root)] if root.is_dir() else []
    if namespace is not None:
        names = [n for n in names if n.startswith(namespace)]
        if len(names) != 1:
            raise common.CLIError(f"--namespace {namespace}: {len(names)} namespaces match under {root}")
    reports, stopped = _push_all(root, names, url_used, cluster_used, timeout_s)
    bad = sum(r.problems for r in reports)
    out.emit(lambda: {"cache_dir": str(root), "namespaces": [r.to_dict() for r in reports], "problems": bad},
             lambda: _print_push(root, reports, out))
    if stopped is not None:
        raise stopped  # one error line, exit 2, after the report
    return common.EXIT_OK if bad == 0 else common.EXIT_PROBLEMS


def _push_all(root: Any, names: list[str], url: str, cluster: bool | None, timeout_s: float) -> tuple[list, Any]:
    """Push each namespace `names` under `root`: `(reports, PushStopped or None)`. A namespace
    whose index cannot be read is a report with its `error`; the server failing stops the push.
    The store's warnings about serving without the tier are held back: the report says it."""
    import logging

    from kvtool.jobs.remote_push import PushReport, PushStopped, open_store_for, push_namespace

    reports: list[PushReport] = []
    quiet = logging.getLogger("kvtool.tiers.remote_store")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        for name in names:
            try:
                store = open_store_for(root / name, url, timeout_s=timeout_s, cluster=cluster)
            except ValueError as exc:
                reports.append(PushReport(name, error=str(exc)))
                continue
            try:
                reports.append(push_namespace(root / name, store))
            except ValueError as exc:  # the index became unreadable meanwhile
                reports.append(PushReport(name, error=str(exc)))
            except PushStopped as exc:
                reports.append(exc.report)
                return reports, exc
            finally:
                store.close()
    finally:
        quiet.setLevel(level)
    return reports, None


def _print_push(root: Any, reports: list, out: Output) -> None:
    if not reports:
        out.print(f"no namespaces under {escape(str(root))}")
    for r in reports:
        out.print(f"{r.namespace}: {r.blocks_read} block(s) read from {r.segments} segment(s), {r.blocks_stored} "
                  f"stored (new on the server), {r.blocks_existing} there already, {r.blocks_failed} not stored, "
                  f"{r.bad_records} bad record(s), {len(r.unreadable_segments)} unreadable segment(s)")
        if r.error is not None:
            out.problem(f"  {escape(r.error)}")


# ----------------------------------------------------------------------------- validate
@remote_app.command("validate")
@server_options()
@common.cli_command
def validate_cmd(remote_url: UrlOpt = None, namespace: common.NamespaceOpt = None, dry_run: common.DryRunOpt = False,
                 json_out: common.JsonOpt = False, server: Server = SERVER) -> int:
    """Read and verify every value (header, namespace, slot hash, checksums, codec, the chain
    hash of its parent and token ids); delete the ones that fail, and parts no manifest names
    (--dry-run: only report). Reading a value counts as a use for the server's LRU.

    Example:

      kvtool remote validate --remote-url redis://cache-host:6379/0 --dry-run

      kvtool remote validate --namespace 3fa2 --json

    Exit codes: 0 every value verified; 1 problems found (deleted unless --dry-run); 2 bad URL,
    unreachable server, wrong password, TLS failure, unknown namespace.
    """
    return validate_remote(Output.from_flags(json_out), server.at(remote_url), namespace, dry_run=dry_run)


def _print_validate(report: Any, emit: Callable[[str], Any]) -> None:
    verb = "would delete" if report.dry_run else "deleted"
    for p in report.problems[:50]:
        emit(f"[red]{escape(p.key)}[/]: {p.kind}: {escape(p.message)}")
    if len(report.problems) > 50:
        emit(f"... and {len(report.problems) - 50} more")
    emit(f"{report.checked} value(s) checked ({format_bytes(report.bytes_checked)}): {report.ok} ok, "
         f"{len(report.problems)} failed, {report.orphan_parts} orphan part(s); {verb} "
         f"{report.removed_keys if not report.dry_run else len(report.problems) + report.orphan_parts} key(s)"
         + (f"; {report.vanished} vanished meanwhile (evicted, expired or removed)" if report.vanished else "")
         + (f"; {report.incomplete} split value(s) missing a part ({verb})" if report.incomplete else "")
         + (" (listing truncated at --max-keys)" if report.truncated else ""))  # fmt: skip


# ----------------------------------------------------------------------------- rm
@remote_app.command("rm")
@server_options()
@removal_options("dry_run", "yes", "json_out")
@common.cli_command
def rm_cmd(
    namespace: Annotated[str, typer.Option("--namespace", help="The namespace (layout key, or a unique prefix of it).")],
    hashes: Annotated[list[str] | None, typer.Option("--hash", help="Only these chain hashes (repeat the option).",
                                                      show_default=False)] = None,  # fmt: skip
    remote_url: UrlOpt = None,
    removal: Removal = REMOVAL,
    server: Server = SERVER,
) -> int:
    """Remove a namespace from the server (every key of it), or given blocks of it (--hash, with
    their parts). Asks first on a terminal; without one, --yes is required. A kvtool process
    reading a removed value gets a miss.

    Example:

      kvtool remote rm --namespace 3fa2 --dry-run

      kvtool remote rm --namespace 3fa2b1c4d5e6f708192a3b4c5d6e7f80 --hash 0123456789abcdef0123456789abcdef --yes

    Exit codes: 0 removed (or --dry-run); 1 declined at the prompt; 2 bad input, unreachable server,
    wrong password, TLS failure, unknown namespace, or no terminal and no --yes.
    """
    return rm_remote(server.at(remote_url), removal, namespace, hashes or None)


def _print_removal(report: Any, emit: Any) -> None:
    verb = "would remove" if report.dry_run else "removed"
    where = f" of {report.namespace}" if report.namespace else ""
    emit(f"{escape(report.url)}: {verb} {report.values} block(s){where}, {report.keys} key(s), "
         f"{format_bytes(report.bytes)}" + (f" ({report.removed_keys} key(s) existed)" if not report.dry_run else "")
         + (f", {report.kept_values} kept" if report.kept_values else ""))  # fmt: skip
    for ns, stat in sorted(report.per_namespace.items()):
        emit(f"  {ns}: {stat['values']} block(s), {format_bytes(stat['bytes'])}")
    for note in report.notes:
        emit(f"  {escape(note)}")
    if report.truncated:
        emit("  (listing truncated at --max-keys)")


# ----------------------------------------------------------------------------- prune
@remote_app.command("prune")
@server_options()
@removal_options()
@common.cli_command
def prune_cmd(
    idle: Annotated[str | None, typer.Option("--idle", help="Remove values unused for this long: 7d, 12h, 30m.",
                                             show_default=False)] = None,  # fmt: skip
    max_bytes: Annotated[str | None, typer.Option("--max-bytes", help="Server memory budget per namespace: 2GB, 512MiB.",
                                                  show_default=False)] = None,  # fmt: skip
    namespace: common.NamespaceOpt = None,
    remote_url: UrlOpt = None,
    removal: Removal = REMOVAL,
    server: Server = SERVER,
) -> int:
    """Remove values unused for --idle (OBJECT IDLETIME), then the least recently used values of
    each namespace until it fits --max-bytes (MEMORY USAGE, parts included); parts no manifest
    names always go. Values with a TTL (remote_ttl) also expire on their own; a server with a
    maxmemory policy evicts by itself too. Asks first on a terminal; without one, --yes is
    required.

    Example:

      kvtool remote prune --idle 7d --dry-run

      kvtool remote prune --idle 14d --max-bytes 20GB --yes --quiet      # cron

    Exit codes: 0 pruned, nothing to prune, or --dry-run; 1 declined at the prompt; 2 bad input,
    unreachable server, wrong password, TLS failure, or no terminal and no --yes.
    """
    from kvtool.units import parse_duration, parse_size

    idle_s = common.parse_flag(idle, parse_duration, "--idle")
    budget = common.parse_flag(max_bytes, parse_size, "--max-bytes")
    if idle_s is None and budget is None:
        raise common.CLIError("give --idle, --max-bytes or both")
    return prune_remote(server.at(remote_url), removal, idle_s=idle_s, max_bytes=budget, namespace=namespace)


def register(app: typer.Typer) -> None:
    """Add the `remote` sub-app to the root `app`."""
    app.add_typer(remote_app, name="remote")
