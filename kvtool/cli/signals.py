"""SIGINT / SIGTERM for the commands that drain a writer: raised as `Interrupted` while work runs
(`signals_raise`), ignored on the clean-shutdown path (`ignore_signals`); the exit code is 128 + n."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager


class Interrupted(BaseException):
    """SIGINT/SIGTERM turned into an exception (a BaseException, like KeyboardInterrupt, so no
    `except Exception` on the request path swallows it). `signum` gives the exit code 128+n."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_interrupted(signum, _frame):
    ignore_signals()  # one signal is enough: further ones are ignored while the writer drains
    raise Interrupted(signum)


@contextmanager
def signals_raise() -> Iterator[None]:
    """While active, SIGINT and SIGTERM raise `Interrupted`; previous handlers restored after."""
    old = {s: signal.signal(s, _raise_interrupted) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def ignore_signals() -> None:
    """Ignore SIGINT/SIGTERM (for the clean-shutdown path; `signals_raise` restores them)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
