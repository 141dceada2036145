"""One way to print: every command talks to the user through one `Output` (human / --json / --quiet).

The pattern of `huggingface_hub`'s `hf` CLI `Output`: the mode is decided once, from the flags,
and each call does the right thing for it, so a command never asks "am I in --json mode?":

| call | human | `--json` | `--quiet` |
|---|---|---|---|
| `print`, `lines`, `table` | stdout (rich) | nothing | nothing |
| `document(doc)` | nothing | exactly one JSON document on stdout, `schema_version` first | nothing |
| `emit(doc, human)` | `human()` | `document(doc)` | nothing |
| `problem(text)` | stderr | stderr | stderr |
| `note(text)` | stderr | stderr | nothing |
| `show_progress` | True on a terminal (`kvtool.progress` draws the bar) | False | False |
| `interaction` | the console a confirmation shows its plan on: stdout for humans, else stderr | | |

`--json` with `--quiet`: the JSON document still goes to stdout (`--json` is the script
interface: a script that asks for the document gets it), and `--quiet` silences everything else
(notes, progress lines); problems still go to stderr. The same in every command. Errors that
end a command are not printed here: they are raised (`KVToolError`) and printed once, as one
`error:` line, by `kvtool.cli.common`.

Every JSON document a command prints carries `"schema_version": SCHEMA_VERSION` at top level;
the number changes only when a key is removed or changes meaning (adding keys does not).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterable, Mapping
from enum import StrEnum
from typing import Any

from rich.console import Console

SCHEMA_VERSION = 1
console = Console()  # stdout: every command prints through these two (`kvtool.cli.common` re-exports them)
err_console = Console(stderr=True)


class OutputMode(StrEnum):
    """How a command prints (see the module docstring)."""

    HUMAN = "human"
    JSON = "json"
    QUIET = "quiet"


def versioned(doc: Mapping[str, Any]) -> dict[str, Any]:
    """`doc` with `"schema_version"` as its first key (a `schema_version` already in `doc` is replaced)."""
    return {"schema_version": SCHEMA_VERSION, **{k: v for k, v in doc.items() if k != "schema_version"}}


def print_json(doc: Mapping[str, Any]) -> None:
    """Write one JSON document to stdout (no rich markup), `schema_version` first (`versioned`):
    every JSON document the CLI prints carries it."""
    sys.stdout.write(json.dumps(versioned(doc), indent=2, default=str) + "\n")
    sys.stdout.flush()


def print_table(console: Console, table: Any) -> None:
    """Print a rich `Table` in the one table style of every command (a rule under the header,
    no outer box), at the terminal's width on a terminal; anywhere else (a file, a pipe) as wide
    as its content and title need, so that nothing in a file is cut or wrapped at 80 columns."""
    from rich import box
    from rich.cells import cell_len
    from rich.measure import Measurement

    table.box, table.show_edge, table.pad_edge = box.SIMPLE_HEAD, False, False
    if console.is_terminal:
        console.print(table)
        return
    natural = Measurement.get(console, console.options.update_width(1 << 16), table).maximum
    title = cell_len(str(table.title)) if table.title is not None else 0
    if title > natural:  # the title is laid out in the table's width: widen the table, not wrap the title
        table.min_width = title
    wide = Console(file=console.file, width=max(natural, title, 1), color_system=None, highlight=False)
    wide.print(table)


class Output:
    """The output sink of one command run (see the module docstring).

    Args:
        mode: human, json or quiet (`Output.from_flags` maps `--json` / `--quiet`).
        console, err_console: stdout and stderr consoles (default: this module's).
    """

    def __init__(self, mode: OutputMode = OutputMode.HUMAN, *, console: Console | None = None,
                 err_console: Console | None = None):  # fmt: skip
        console = console or globals()["console"]  # the module's consoles (the parameters shadow their names)
        err_console = err_console or globals()["err_console"]
        self.mode = OutputMode(mode)
        self.human = self.mode == OutputMode.HUMAN
        self.json = self.mode == OutputMode.JSON
        self.quiet = self.mode == OutputMode.QUIET
        self.console = console
        self.err_console = err_console
        self._documents = 0

    @classmethod
    def from_flags(cls, json_out: bool = False, quiet: bool = False, **consoles: Console) -> Output:
        """The output for `--json` / `--quiet`. With both, the JSON document is still printed
        (json mode) and `quiet` is True: no notes, no progress lines; problems on stderr."""
        mode = OutputMode.JSON if json_out else OutputMode.QUIET if quiet else OutputMode.HUMAN
        out = cls(mode, **consoles)
        out.quiet = quiet
        return out

    # ------------------------------------------------------------------ mode
    @property
    def interaction(self) -> Console:
        """Where a confirmation shows what it asks about: stdout for a person, stderr otherwise
        (stdout then holds the JSON document, or nothing)."""
        return self.console if self.human else self.err_console

    @property
    def show_progress(self) -> bool:
        """Progress bars are drawn for a person on a terminal only."""
        return self.human and self.err_console.is_terminal

    # ------------------------------------------------------------------ stdout
    def print(self, *objects: Any, **kw: Any) -> None:
        """Print text or a rich renderable on stdout (human mode only). Markup is interpreted;
        no automatic highlighting; long lines are not wrapped unless `soft_wrap=False`."""
        if self.human:
            self.console.print(*objects, **{"highlight": False, "soft_wrap": True, **kw})

    def lines(self, lines: Iterable[str]) -> None:
        """Print plain `lines` on stdout (human mode only): no markup, not wrapped."""
        for line in lines:
            self.print(line, markup=False)

    def table(self, table: Any) -> None:
        """Print a rich `Table` on stdout (human mode only), as `print_table` does."""
        if self.human:
            print_table(self.console, table)

    def document(self, doc: Mapping[str, Any]) -> None:
        """Print `doc` as the command's one JSON document (json mode only), `schema_version` first.

        Raises:
            RuntimeError: a document was printed already (a command prints exactly one).
        """
        if not self.json:
            return
        if self._documents:
            raise RuntimeError("a command prints exactly one JSON document")
        self._documents += 1
        print_json(doc)

    def emit(self, doc: Mapping[str, Any] | Callable[[], Mapping[str, Any]], human: Callable[[], None]) -> None:
        """The command's result: `document(doc)` in json mode, `human()` in human mode, nothing
        when quiet. `doc` may be a callable (built only in json mode)."""
        if self.json:
            self.document(doc() if callable(doc) else doc)
        elif self.human:
            human()

    # ------------------------------------------------------------------ stderr
    def problem(self, text: str, **kw: Any) -> None:
        """A problem found (not a failure of the command): stderr, in every mode, `--quiet` included."""
        self.err_console.print(text, **{"highlight": False, "soft_wrap": True, **kw})

    def note(self, text: str, **kw: Any) -> None:
        """A side remark (what was skipped, a hint): stderr, except under `--quiet`."""
        if not self.quiet:
            self.problem(text, **kw)

    def confirm(self, question: str) -> bool:
        """Ask `question [y/N]` on stderr (rich markup in `question` is rendered) and read the
        answer from stdin; True on y/yes, False on n/no, an empty answer, end of input or Ctrl-C.
        Nothing goes to stdout: `click.confirm` writes a space there (its readline workaround),
        which under `--json` would be all that stdout holds after a "no"."""
        while True:
            self.err_console.print(f"{question} \\[y/N]: ", end="", highlight=False, soft_wrap=True)
            try:
                line = sys.stdin.readline()
            except KeyboardInterrupt:
                line = ""
            answer = line.strip().lower()
            if not line or answer in ("", "n", "no"):
                if not line.endswith("\n"):
                    self.err_console.print()  # end the question's line
                return False
            if answer in ("y", "yes"):
                return True
            self.err_console.print("answer y or n", highlight=False)


__all__ = ["Output", "OutputMode", "SCHEMA_VERSION", "print_json", "print_table", "versioned"]
