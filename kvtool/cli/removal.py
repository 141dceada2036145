"""What `kvtool prune` and `kvtool rm` share: show the plan, confirm, execute with signals held, report."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from rich.markup import escape

from kvtool.cli import common
from kvtool.cli.output import Output
from kvtool.cli.signals import signals_handled
from kvtool.units import format_bytes

ABORTED = "aborted: nothing changed"  # a declined confirmation, on stderr (local and remote removals)


def interactive() -> bool:
    """True if a human can answer a confirmation prompt (tests patch this)."""
    return sys.stdin.isatty()


@dataclass(frozen=True)
class Removal:
    """How a removal is confirmed and printed: the options of `kvtool prune`, `kvtool rm` and
    `kvtool remote prune|rm` (`--dry-run`, `--yes`, `--json`, `--quiet`), and what they decide
    before the plan is made (a way to confirm it, the maintenance lock)."""

    dry_run: common.DryRunOpt = False
    yes: common.YesOpt = False
    json_out: common.JsonOpt = False
    quiet: common.QuietOpt = False

    @cached_property
    def out(self) -> Output:
        """The command's one `Output` (`--json`, `--quiet`)."""
        return Output.from_flags(self.json_out, self.quiet)

    def refuse_without_terminal(self, what: str, how: str = "add --yes") -> None:
        """Raises CLIError (`refusing to <what> without confirmation: ...; <how> or use --dry-run`)
        unless --yes, --dry-run or a terminal to ask on."""
        if not (self.yes or self.dry_run or interactive()):
            raise common.CLIError(f"refusing to {what} without confirmation: no terminal to ask on; {how} or use --dry-run")

    def preflight(self, root: Path, what: str, how: str = "add --yes") -> None:
        """Checks before a removal plan is made: a way to confirm it (`refuse_without_terminal`), and
        the cache directory.

        Raises:
            CLIError: no `--yes`, no `--dry-run` and no terminal to ask on, or `root` exists and is
                not a directory (one that does not exist yet is an empty cache).
        """
        self.refuse_without_terminal(what, how)
        if os.path.lexists(root) and not os.path.isdir(root):
            raise common.CLIError(f"cache directory {root} is not a directory")

    def maintenance_lock(self, root: Path) -> AbstractContextManager:
        """The cache's maintenance lock for prune / rm (`kvtool.disk.lock.cache_lock`); none for a
        dry run (it only reads) or a cache directory that does not exist yet (nothing to protect).

        Raises:
            PruneLocked, PruneError: when entered, as `cache_lock`.
        """
        from kvtool.disk.lock import cache_lock

        return nullcontext() if self.dry_run or not os.path.isdir(root) else cache_lock(root)


REMOVAL = Removal()  # the default of a command's `removal` parameter (`removal_options` always passes one)


def removal_options(*names: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorate a command whose parameter `removal: Removal` stands for the options `names` (fields
    of `Removal`, shown in that order; none named: all of them)."""
    return common.flag_options("removal", Removal, names)


@contextmanager
def deferred_signals() -> Iterator[list[int]]:
    """Hold SIGINT/SIGTERM until the deletion is done (rows and files stay consistent)."""
    received: list[int] = []
    with signals_handled(lambda signum, _frame: received.append(signum)):
        yield received


def confirm_and_execute(
    plan: Any,
    removal: Removal,
    *,
    question: Callable[[], str],
    execute: Callable[[Any], object],
    print_plan: Callable[[Any, Any], None],
    print_result: Callable[[Any, Any], None],
    nothing: str,
    print_problems: Callable[[Any, Output], None] | None = None,
) -> int:
    """Show `plan`, ask (unless --yes), execute it with SIGINT/SIGTERM held, report; the exit code.

    Args:
        plan: a prune or removal plan (`dry_run`: set from `removal`, `problems`, `to_dict`;
            `removes_anything()`: else it is only shown, as a dry run is).
        removal: --dry-run, --yes (do not ask), `out` (--json: the plan document; --quiet: problems only, on stderr).
        question: the confirmation question (asked only when needed).
        execute: runs the plan.
        print_plan, print_result: `(plan, console)` printers.
        nothing: the line after a plan that removes nothing ("nothing to prune").
        print_problems: under --quiet, what to print of the problems before the result line.

    Returns:
        0; 1 declined or problems; 128 + the signal received during the execution.
    """
    out, yes = removal.out, removal.yes
    plan.dry_run = removal.dry_run

    def emit(human: Callable[[], None]) -> None:
        out.emit(plan.to_dict, human)
        if out.quiet and plan.problems:
            if print_problems is not None:
                print_problems(plan, out)
            print_result(plan, out.err_console)

    def unchanged() -> None:
        print_plan(plan, out.console)
        out.print("dry run: nothing changed" if plan.dry_run else nothing)

    def executed() -> None:
        if yes:  # else the plan was shown with the question
            print_plan(plan, out.console)
        print_result(plan, out.console)

    if plan.dry_run or not plan.removes_anything():
        emit(unchanged)
        return _exit_code(plan)
    if not yes:  # the question needs the plan, even under --quiet / --json (then on stderr)
        print_plan(plan, out.interaction)
        if not out.confirm(question()):
            out.err_console.print(ABORTED)
            return common.EXIT_PROBLEMS
    with deferred_signals() as received:
        execute(plan)
    emit(executed)
    if received:
        return 128 + received[0]
    return _exit_code(plan)


def print_freed(console: Any, plan: Any, head: str, files: str) -> None:
    """The result line: `head` N block(s), M `files`, what was freed, and the problems if any,
    each named (the line `--quiet` prints is the only one: it must say what went wrong)."""
    problems = "; ".join(_problem_text(ns) for ns in plan.namespaces if ns.problems)
    console.print(
        f"{head}{plan.total('rows_deleted')} block(s), {plan.total('files_deleted')} {files}, "
        f"{format_bytes(plan.total('bytes_freed'))} freed"
        + (f"; [red]{plan.problems} problem(s)[/]: {escape(problems)} (run kvtool validate)" if plan.problems else ""),
        highlight=False, soft_wrap=True,
    )  # fmt: skip


def _problem_text(ns: Any) -> str:
    """`<key>: 2 file(s) not removed, index not updated, left alone (unreadable)`."""
    parts = [f"{ns.unlink_failed} file(s) not removed"] if ns.unlink_failed else []
    parts += ["index not updated"] if ns.index_failed else []
    if ns.problems > ns.unlink_failed + int(ns.index_failed):
        parts.append(f"left alone ({ns.status})")
    return f"{ns.namespace[:8]}: {', '.join(parts)}"


def _exit_code(plan: Any) -> int:
    """1 if the plan has problems, else 0."""
    return common.EXIT_PROBLEMS if plan.problems else common.EXIT_OK


__all__ = ["REMOVAL", "Removal", "confirm_and_execute", "deferred_signals", "print_freed", "removal_options"]
