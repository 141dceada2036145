"""The root of kvtool's known errors.

A `KVToolError` is a failure the user can act on: bad input, a missing file, a cache in a state
kvtool refuses to touch. The CLI prints it as one `error: ...` line and exits with its
`exit_code`; any other exception is a bug and keeps its traceback. This module imports nothing
heavy (no MLX, no pydantic) so every layer, the store included, can raise its errors.
"""

from __future__ import annotations

EXIT_USAGE = 2  # bad input: missing file, invalid value, unknown model, could not run


class KVToolError(Exception):
    """A known, user-facing kvtool error.

    Subclasses set class-level defaults; an instance may override them.

    Attributes:
        exit_code: process exit status when the CLI reports this error (default 2, bad input).
        hint: optional advice shown after the message (e.g. "did you mean 'block_size'?").
    """

    exit_code: int = EXIT_USAGE
    hint: str | None = None

    def __init__(self, message: str = "", *, exit_code: int | None = None, hint: str | None = None):
        """`message`: one line saying what is wrong; `exit_code` and `hint` override the class defaults."""
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code
        if hint is not None:
            self.hint = hint

    @property
    def message(self) -> str:
        """The message without the hint."""
        return str(self.args[0]) if self.args else ""
