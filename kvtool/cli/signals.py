"""SIGINT / SIGTERM for the commands that drain a writer: raised as `Interrupted` while work runs
(`signals_raise`), ignored on the clean-shutdown path (`ignore_signals`); the exit code is 128 + n."""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any


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
def signals_handled(handler: Callable[[int, Any], Any]) -> Iterator[None]:
    """While active, `handler(signum, frame)` handles SIGINT and SIGTERM; previous handlers
    restored after."""
    old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def signals_raise() -> AbstractContextManager[None]:
    """While active, SIGINT and SIGTERM raise `Interrupted`; previous handlers restored after."""
    return signals_handled(_raise_interrupted)


def ignore_signals() -> None:
    """Ignore SIGINT/SIGTERM (for the clean-shutdown path; `signals_raise` restores them)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
