"""One clean line per known error: `error: message; hint` on stderr and the error's exit code.

A known error (a `KVToolError`, or one of the few types in `ERROR_MESSAGES`) becomes one line,
whether a command catches it (`cli_command`) or it escapes to the root group (`KVToolGroup`), which
also turns Click/Typer usage errors (unknown option, missing argument, bad value) into one line
with exit 2. Anything else keeps its traceback.
"""

from __future__ import annotations

import functools
import re
import sys
from collections.abc import Callable
from typing import Any

import typer
from rich.markup import escape
from typer.core import TyperGroup

from kvtool.cli.output import err_console
from kvtool.cli.signals import Interrupted
from kvtool.errors import EXIT_USAGE, KVToolError

EXIT_OK = 0
EXIT_ABORTED = 1  # a confirmation prompt was aborted (end of input), as Typer does


class CLIError(KVToolError):
    """A known, user-facing error raised by the CLI layer: printed as one line, exit `code`."""

    def __init__(self, message: str, code: int = EXIT_USAGE, hint: str | None = None):
        """Create the error; `code` is the exit status (2: bad input)."""
        super().__init__(message, exit_code=code, hint=hint)


# ---------------------------------------------------------------- known errors
def _os_error(verb: str) -> Callable[[OSError], str]:
    return lambda exc: f"{verb} {exc.filename}: {exc.strerror}"


# Known error types -> one-line message (first match wins). A `KVToolError` carries its own exit
# code and hint; the others exit 2. Anything not listed is a bug and keeps its traceback.
ERROR_MESSAGES: tuple[tuple[type[BaseException], Callable[[Any], str]], ...] = (
    (KVToolError, str),
    (FileNotFoundError, lambda exc: f"file not found: {exc.filename or exc}"),
    (IsADirectoryError, _os_error("cannot read")),
    (PermissionError, _os_error("cannot read")),
    (UnicodeDecodeError, lambda exc: f"not a UTF-8 text file (byte {exc.start}: {exc.reason})"),  # a binary file given as text
)


MLX_LM_OPEN_FILES = 4096  # mlx_lm/utils.py, at import: resource.setrlimit(RLIMIT_NOFILE, (2048, 4096))


def open_files_limit_error(exc: BaseException) -> tuple[str, int, str | None] | None:
    """`(message, exit_code, hint)` when `exc` is mlx-lm's import failing under a hard open-files
    limit below 4096 (mlx-lm sets the limits to (2048, 4096) when imported: a ValueError raised
    from `mlx_lm/utils.py`); None for anything else."""
    import resource

    if not isinstance(exc, ValueError):
        return None
    tb, from_mlx_lm = exc.__traceback__, False
    while tb is not None:
        filename = tb.tb_frame.f_code.co_filename.replace("\\", "/")
        from_mlx_lm = from_mlx_lm or filename.endswith("mlx_lm/utils.py")
        tb = tb.tb_next
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if not from_mlx_lm or hard == resource.RLIM_INFINITY or hard >= MLX_LM_OPEN_FILES:
        return None
    return (f"the hard limit on open files is {hard} (ulimit -Hn): mlx-lm raises the limit to {MLX_LM_OPEN_FILES} "
            "when it loads, so a command that loads a model needs a hard limit of at least "
            f"{MLX_LM_OPEN_FILES}", EXIT_USAGE, f"raise it (ulimit -Hn {MLX_LM_OPEN_FILES} as root, or "
            "/etc/security/limits.conf, or LimitNOFILE= in a systemd unit) and run again")


def describe_error(exc: BaseException) -> tuple[str, int, str | None] | None:
    """`(message, exit_code, hint)` for a known error (`ERROR_MESSAGES`, or mlx-lm refusing a low
    open-files limit: `open_files_limit_error`), None for anything else."""
    described = open_files_limit_error(exc)
    if described is not None:
        return described
    for kind, render in ERROR_MESSAGES:
        if isinstance(exc, kind):
            return render(exc), getattr(exc, "exit_code", EXIT_USAGE), getattr(exc, "hint", None)
    return None


def report_known(exc: BaseException) -> int | None:
    """Print a known error (`describe_error`) as one `error:` line and return its exit code; None,
    and nothing printed, for anything else."""
    known = describe_error(exc)
    if known is None:
        return None
    print_error(known[0], known[2])
    return known[1]


def cli_command(fn: Callable[..., int | None]) -> Callable[..., None]:
    """Decorate a command's body: known errors become one `error:` line (`report_known`), a SIGINT /
    SIGTERM the body let through as `Interrupted` (under its own `signals_raise`, before any work
    to drain) exits 128 + n, and the int the body returns is the exit code (None: 0)."""

    @functools.wraps(fn)
    def command(*args: Any, **kwargs: Any) -> None:
        try:
            code = fn(*args, **kwargs)
        except Interrupted as exc:
            code = 128 + exc.signum
        except Exception as exc:
            code = report_known(exc)
            if code is None:
                raise
        raise typer.Exit(code or EXIT_OK)

    return command


def print_error(message: str, hint: str | None = None) -> None:
    """Print `error: message; hint` to stderr as exactly one line."""
    line = f"[bold red]error:[/] {escape(_one_line(message))}"
    if hint:
        line += f"; {escape(_one_line(hint))}"
    err_console.print(line, highlight=False, soft_wrap=True)


def _one_line(text: str) -> str:
    return re.sub(r"\s*\n\s*", " ", str(text).strip())


class KVToolGroup(TyperGroup):
    """The root command group. In standalone mode (the console script, `CliRunner`) it reports
    Click/Typer usage errors and escaped known errors as one `error:` line and exits 2 (or the
    error's code); unknown exceptions propagate with their traceback."""

    def main(
        self,
        args: Any = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        windows_expand_args: bool = True,
        **extra: Any,
    ) -> Any:
        def run() -> Any:
            return super(KVToolGroup, self).main(
                args, prog_name, complete_var, standalone_mode=False, windows_expand_args=windows_expand_args, **extra
            )

        if not standalone_mode:
            return run()
        sys.exit(_run_reporting_errors(run))


def _run_reporting_errors(run: Callable[[], Any]) -> int:
    """Run a non-standalone Typer/Click `main` and return the process exit code."""
    try:
        rv = run()
    except typer.Abort:
        err_console.print("Aborted.", highlight=False)
        return EXIT_ABORTED
    except typer.TyperException as exc:  # Typer's (vendored Click's) usage and parameter errors
        if type(exc).__name__ == "NoArgsIsHelpError":  # the help text was printed already
            return EXIT_USAGE
        ctx = getattr(exc, "ctx", None)
        message = exc.format_message().rstrip(".")
        print_error(message[:1].lower() + message[1:], f"see '{ctx.command_path} --help'" if ctx is not None else None)
        return EXIT_USAGE
    except Exception as exc:
        code = report_known(exc)
        if code is None:
            raise
        return code
    # Non-standalone Click returns the code of a `typer.Exit`, or the command's return value.
    return rv if isinstance(rv, int) and not isinstance(rv, bool) else EXIT_OK
