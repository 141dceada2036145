"""`mlx_lm.server`'s command-line options, read from mlx-lm's own argument parser.

`kvtool serve` takes every option of the pinned mlx-lm's `mlx_lm.server`; the list, the types,
the defaults and the value conversion all come from mlx-lm's parser, so the two cannot drift: an
option a later mlx-lm adds is offered and passed through without a change here.

mlx-lm 0.32.2 builds that parser inside `mlx_lm.server.main()` and parses `sys.argv` right away.
`server_parser()` runs `main()` with the module's `argparse` name bound to a copy of `argparse`
whose `ArgumentParser` stops at the first `parse_known_args` call (every `parse_args` goes
through it) and hands the finished parser back: nothing after parsing runs (no model load, no
socket). If mlx-lm stops importing `argparse` as a module, `main()` is not called at all and
`ServerOptionsError` says so (the test of the option sets fails on such an upgrade).

    parser = server_parser()
    defaults()                            # {'host': '127.0.0.1', 'port': 8080, 'allowed_origins': ['*'], ...}
    convert("chat_template_args", '{"enable_thinking": false}')   # {'enable_thinking': False}
"""

from __future__ import annotations

import argparse
import functools
import threading
import types
from typing import Any

_CAPTURE_LOCK = threading.Lock()


class ServerOptionsError(RuntimeError):
    """mlx-lm's server parser could not be captured (an mlx-lm whose `main()` changed shape)."""


class OptionValueError(ValueError):
    """A value mlx-lm's parser refuses (one-line message naming the option)."""


class _Captured(Exception):  # noqa: N818 - a control-flow signal, not an error
    def __init__(self, parser: argparse.ArgumentParser, options: list[argparse.Action]):
        super().__init__("parser captured")
        self.parser = parser
        self.options = options


class _CapturingParser(argparse.ArgumentParser):
    """An `ArgumentParser` that records the options added to it after its construction (the
    caller's: not argparse's own `--help`) and, at its first parse, becomes a plain one and is
    handed back with them (argparse has no public list of a parser's options)."""

    kvtool_options: list[argparse.Action] | None = None  # None while argparse's __init__ adds --help

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.kvtool_options = []

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        action = super().add_argument(*args, **kwargs)
        if self.kvtool_options is not None:
            self.kvtool_options.append(action)
        return action

    def parse_known_args(self, args=None, namespace=None):
        self.__class__ = argparse.ArgumentParser  # the captured parser parses normally from now on
        raise _Captured(self, self.kvtool_options or [])


def server_parser() -> argparse.ArgumentParser:
    """The `argparse.ArgumentParser` that `mlx_lm.server.main()` builds (cached per process).
    Its `exit_on_error` is False: a bad value raises `argparse.ArgumentError` instead of exiting.

    Raises:
        ServerOptionsError: `mlx_lm.server` has no module-level `argparse` or `main()` did not
            parse (then nothing of it ran past building the parser).
    """
    return _capture()[0]


@functools.cache
def _capture() -> tuple[argparse.ArgumentParser, tuple[argparse.Action, ...]]:
    """`server_parser()` and the options `main()` added to it, in order (once per process)."""
    import mlx_lm.server as server

    if getattr(server, "argparse", None) is not argparse or not callable(getattr(server, "main", None)):
        raise ServerOptionsError("mlx_lm.server does not build its parser with the argparse module in main(); "
                                 "kvtool cannot read its options")
    shim = types.ModuleType("argparse")
    shim.__dict__.update(vars(argparse))
    shim.ArgumentParser = _CapturingParser  # type: ignore[attr-defined]
    with _CAPTURE_LOCK:
        server.argparse = shim
        try:
            server.main()
        except _Captured as captured:
            parser, options = captured.parser, captured.options
        else:
            raise ServerOptionsError("mlx_lm.server.main() returned without parsing its arguments")
        finally:
            server.argparse = argparse
    parser.exit_on_error = False
    return parser, tuple(options)


def server_actions() -> list[argparse.Action]:
    """mlx-lm's server options (the help action left out), in the parser's order: those
    `main()` added with `add_argument`."""
    return [a for a in _capture()[1] if a.option_strings]


def defaults() -> dict[str, Any]:
    """`dest -> default` as `mlx_lm.server` sets them with no arguments (string defaults
    converted by the option's type, as argparse does: `--allowed-origins` -> `['*']`)."""
    return vars(server_parser().parse_args([]))


def action_for(dest: str) -> argparse.Action:
    """The option whose namespace attribute is `dest`.

    Raises:
        KeyError: no such option.
    """
    for action in server_actions():
        if action.dest == dest:
            return action
    raise KeyError(dest)


def is_flag(action: argparse.Action) -> bool:
    """An option that takes no value (`store_true`, `store_false`, `store_const`)."""
    return action.nargs == 0


def convert(dest: str, value: Any) -> Any:
    """The namespace value mlx-lm's parser makes of one command-line value of option `dest`
    (`str(value)` for values; for a flag, its constant when `value` is true, else its default).

    Raises:
        OptionValueError: the parser refuses it (type, choices); one line naming the option.
    """
    action = action_for(dest)
    option = max(action.option_strings, key=len)
    parser = server_parser()
    argv = ([option] if value else []) if is_flag(action) else [f"{option}={value}"]
    try:
        namespace = parser.parse_args(argv)
    except argparse.ArgumentError as exc:
        raise OptionValueError(f"{option}: {exc.message}") from None
    except Exception as exc:  # noqa: BLE001 - a converter raising what argparse does not catch (KeyError...)
        raise OptionValueError(f"{option}: invalid value {value!r} for mlx_lm.server "
                               f"({type(exc).__name__}: {' '.join(str(exc).split())[:200]})") from None
    return getattr(namespace, dest)


def help_text(action: argparse.Action) -> str:
    """The option's help as `mlx_lm.server --help` shows it (`%(default)s` expanded)."""
    text = " ".join((action.help or "").split())
    if "%" in text:
        try:
            text = text % {**vars(action), "prog": "mlx_lm.server"}
        except (KeyError, TypeError, ValueError):
            pass
    return text


__all__ = ["OptionValueError", "ServerOptionsError", "action_for", "convert", "defaults", "help_text", "is_flag",
           "server_actions", "server_parser"]
