"""Progress of long commands: a rich bar on a terminal, a plain line now and then without one.

Without a terminal (cron, CI, `2> file`, a pipe) a live bar is either nothing or noise, so there
`progress()` gives a `LineProgress`: the rich `Progress` API, drawing nothing, printing a line
about its tasks to stderr at most every `interval_s()` seconds (none for a shorter command).

    with progress("kvtool warm", lines=True) as bar:        # None when nothing is to be shown
        task = bar.add_task("warm", total=len(prompts), tokens=0) if bar else None
        ...
        if bar: bar.update(task, completed=i, tokens=n)

A line: `[kvtool warm 20 s] warm 3/10 | 7 left, ETA 47 s | tokens 1234 | blocks 7` (seconds since
the start, then `describe_tasks`).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, TextIO

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    Task,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

INTERVAL_ENV = "KVTOOL_PROGRESS_INTERVAL_S"
DEFAULT_INTERVAL_S = 10.0


def interval_s() -> float:
    """Seconds between two progress lines at least: `$KVTOOL_PROGRESS_INTERVAL_S` if it is a
    number >= 0 (0: a line at every update), else `DEFAULT_INTERVAL_S`."""
    try:
        value = float(os.environ.get(INTERVAL_ENV, "").strip() or DEFAULT_INTERVAL_S)
    except ValueError:
        return DEFAULT_INTERVAL_S
    return value if value >= 0 else DEFAULT_INTERVAL_S  # (False for NaN too)


def stderr_is_terminal(console: Console | None = None) -> bool:
    """Whether stderr (or `console`) is a terminal, as rich decides it (`FORCE_TERMINAL` etc.)."""
    return (console or Console(stderr=True)).is_terminal


def _number(value: float | None) -> str:
    return "?" if value is None else f"{value:g}"


MAX_LISTED_FINISHED = 3  # with more tasks than this, finished ones are counted, not listed


def format_eta(seconds: float) -> str:
    """A remaining time, rounded to the second: `42 s`, `3 min 05 s`, `2 h 07 min`."""
    whole = max(0, round(seconds))
    if whole < 60:
        return f"{whole} s"
    if whole < 3600:
        return f"{whole // 60} min {whole % 60:02d} s"
    return f"{whole // 3600} h {whole % 3600 // 60:02d} min"


def eta_text(task: Task) -> str | None:
    """`N left, ETA 1 min 05 s` for a started, unfinished task with a total and at least one
    item done (mean time per item done so far, times the items left); else None."""
    elapsed = task.elapsed
    if task.total is None or task.finished or not task.completed or not elapsed:
        return None
    left = task.total - task.completed
    return f"{_number(left)} left, ETA {format_eta(elapsed / task.completed * left)}"


def describe_tasks(tasks: Iterable[Task]) -> str:
    """One line about `tasks`: each as `description done/total`, its ETA (`eta_text`) and its
    fields (`name value`); with more than `MAX_LISTED_FINISHED` tasks, finished ones are only counted."""
    tasks = list(tasks)
    parts, finished = [], 0
    for task in tasks:
        if task.finished and task.total is not None and len(tasks) > MAX_LISTED_FINISHED:
            finished += 1
            continue
        head = task.description or "working"
        if task.total is not None or task.completed:
            head += f" {_number(task.completed)}/{_number(task.total)}"
        eta = eta_text(task)
        parts.append(" | ".join([head, *([eta] if eta else []), *(f"{k} {v}" for k, v in task.fields.items())]))
    if finished:
        parts.append(f"{finished} done")
    return " | ".join(parts) or "starting"


class LineProgress(Progress):
    """A rich `Progress` that draws nothing and prints a line about its tasks at most every
    `interval` seconds while started: at `update` / `advance` once due, or from a daemon thread
    (no update for an interval: a heartbeat); one closing line if it printed any.

    Args:
        label: the line's prefix, e.g. `kvtool warm`.
        interval: least seconds between lines (default `interval_s()`; 0: at every update, and
            no thread).
        stream: where lines go (default: `sys.stderr` at print time).
    """

    def __init__(self, label: str, *columns: ProgressColumn | str, interval: float | None = None,
                 stream: TextIO | None = None):
        super().__init__(*columns, disable=True)
        self.label = label
        self.interval = interval_s() if interval is None else max(0.0, interval)
        self._stream = stream
        self._t0 = self._last = time.monotonic()
        self._lines = 0
        self._print_lock = threading.Lock()
        self._stop_event = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        super().start()
        self._t0 = self._last = time.monotonic()
        if self._thread is None and self.interval > 0:
            self._thread = threading.Thread(target=self._loop, name="kvtool-progress", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop_event.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(5)
        if self._lines:
            self._print("done: ")
        super().stop()

    def update(self, task_id, **kwargs: Any) -> None:
        super().update(task_id, **kwargs)
        self._print_if_due()

    def advance(self, task_id, advance: float = 1) -> None:
        super().advance(task_id, advance)
        self._print_if_due()

    def line(self, prefix: str = "") -> str:
        """The progress line as it would be printed now."""
        return f"[{self.label} {time.monotonic() - self._t0:.1f} s] {prefix}{describe_tasks(self.tasks)}"

    def _print_if_due(self) -> None:
        if self._stop_event.is_set() or time.monotonic() - self._last < self.interval:
            return
        self._print()

    def _print(self, prefix: str = "") -> None:
        stream = self._stream or sys.stderr
        with self._print_lock:
            self._last = time.monotonic()
            if stream is None:
                return
            try:
                print(self.line(prefix), file=stream, flush=True)
                self._lines += 1
            except (OSError, ValueError):  # a closed or broken stderr: progress is not worth failing for
                pass

    def _loop(self) -> None:
        while not self._stop_event.wait(max(0.01, self.interval - (time.monotonic() - self._last))):
            self._print_if_due()


def make_progress(label: str, *columns: ProgressColumn | str, console: Console | None = None,
                  transient: bool = True) -> Progress:
    """A live rich bar on stderr when it is a terminal (`columns`, plus a remaining-time column
    if they have none), else a `LineProgress` (use it as a context manager, like any rich
    `Progress`)."""
    console = console or Console(stderr=True)
    if stderr_is_terminal(console):
        columns = columns or (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        if not any(isinstance(c, TimeRemainingColumn) for c in columns):
            columns = (*columns, TimeRemainingColumn())
        return Progress(*columns, console=console, transient=transient)
    return LineProgress(label, *columns)


def progress(label: str, *columns: ProgressColumn | str, console: Console | None = None, bar: bool = True,
             lines: bool = True, transient: bool = True) -> AbstractContextManager[Any]:
    """`make_progress`, or a context yielding None when nothing is to be shown: `bar` False on a
    terminal (e.g. `--json`), `lines` False without one (e.g. `--quiet`)."""
    terminal = stderr_is_terminal(console)
    if (terminal and not bar) or (not terminal and not lines):
        return nullcontext(None)
    return make_progress(label, *columns, console=console, transient=transient)


__all__ = ["DEFAULT_INTERVAL_S", "INTERVAL_ENV", "LineProgress", "describe_tasks", "eta_text", "format_eta",
           "interval_s", "make_progress", "progress", "stderr_is_terminal"]
