"""Every bad input, usage errors included, ends in exactly one `error:` line and exit 2 (docs/design.md#command-line-contract).

Driven in-process with `CliRunner` (no model is loaded: every input fails before one would be),
plus one subprocess run of the real entry point. Also `-h` and `--version`.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from kvtool.cli import app as app_module
from kvtool.cli import common
from kvtool.errors import KVToolError

REPO = Path(__file__).resolve().parent.parent
BIG = "1" * 400
if not app_module.app.registered_commands:
    app_module._register()
runner = CliRunner()

COMMANDS = ("serve-once", "serve", "warm", "prune", "rm", "validate", "inspect", "import", "export", "bench", "report", "model")


def _assert_one_error_line(result, code: int = 2) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.exit_code == code, (result.exit_code, result.stderr, result.exception)
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.output and "╭" not in result.stderr
    return lines[0]


@pytest.mark.parametrize(
    "args,needle",
    [
        # usage errors (Typer/Click): were a 5-line boxed panel
        (["serve-once", "--bogus"], "no such option: --bogus"),
        (["serve-once", "--max-tokens", "0", "-p", "x"], "--max-tokens"),
        (["serve-once", "--top-p", "nope", "-p", "x"], "--top-p"),
        (["warm"], "missing argument"),
        (["warm", "--bogus", "x.txt"], "no such option: --bogus"),
        (["prune", "--bogus"], "no such option: --bogus"),
        (["prune", "--ttl"], "--ttl"),
        (["validate", "--bogus"], "no such option: --bogus"),
        (["validate", "--deep=maybe"], "--deep"),
        (["inspect", "--bogus"], "no such option: --bogus"),
        (["inspect", "--block-size", "many"], "--block-size"),
        (["bench"], "missing argument"),
        (["bench", "--bogus", "x.toml"], "no such option: --bogus"),
        (["report"], "missing argument"),
        (["report", "x", "--bogus"], "no such option: --bogus"),
        (["model", "bogus"], "no such command"),
        (["model", "list", "--bogus"], "no such option: --bogus"),
        (["--bogus"], "no such option: --bogus"),
        (["no-such-command"], "no such command"),
        # values checked by kvtool before any model loads
        (["serve-once", "-p", "x", "--policy", "sometimes"], "--policy"),
        (["serve-once", "-p", "x", "--durability", "forever"], "--durability"),
        (["serve-once", "-p", "x", "--ram-bytes", BIG], "--ram-bytes: size too large"),
        (["serve-once", "-p", "x", "--block-size", BIG], "block_size"),
        (["warm", "/no/such/source.txt"], "not found"),
        (["report", "/no/such/run-dir"], "run directory not found"),
        (["model", "path", "nosuch"], "unknown model preset"),
        # hostile round 3, finding 9: accepted before (--temp inf sampled; --max-bytes 1.5 was a 1-byte budget)
        (["serve-once", "-p", "x", "--temp", "inf"], "--temp"),
        (["serve-once", "-p", "x", "--top-p", "nan"], "--top-p"),
        (["serve", "--temp", "inf", "--port", "99999"], "--temp"),  # (on main: a --port error, not a server)
        (["prune", "--max-bytes", "1.5", "--yes"], "not a whole number of bytes"),
        (["serve-once", "-p", "x", "--ram-bytes", "0.5"], "not a whole number of bytes"),
    ],
)
def test_bad_input_is_one_error_line_and_exit_2(args, needle, tmp_path):
    result = runner.invoke(app_module.app, args, env={"KVTOOL_CACHE_DIR": str(tmp_path)})
    line = _assert_one_error_line(result)
    assert needle in line
    assert result.stdout == ""


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_rejects_an_unknown_option_in_one_line(command):
    args = [command, "list", "--no-such-option"] if command == "model" else [command, "--no-such-option"]
    line = _assert_one_error_line(runner.invoke(app_module.app, args))
    assert "--no-such-option" in line and f"see 'kvtool {' '.join(args[:-1])} --help'" in line


@pytest.mark.parametrize(
    "lines",
    ["ssd_ttl_days = true", "kvtool = 5", "ram_bytes = " + BIG, 'ssd_cache_dir = ""', "blok_size = 3"],
)
def test_bad_config_file_is_one_error_line(tmp_path, lines):
    cfg = tmp_path / "kv.toml"
    cfg.write_text(lines + "\n")
    env = {"KVTOOL_CACHE_DIR": str(tmp_path)}
    result = runner.invoke(app_module.app, ["serve-once", "-p", "x", "--config", str(cfg)], env=env)
    assert "config field" in _assert_one_error_line(result)


def test_binary_config_file_is_one_error_line(tmp_path):
    cfg = tmp_path / "kv.toml"
    cfg.write_bytes(bytes(range(256)))
    result = runner.invoke(app_module.app, ["serve-once", "-p", "x", "--config", str(cfg)])
    assert "not a UTF-8 text file" in _assert_one_error_line(result)


def test_unknown_field_hint_is_on_the_same_line(tmp_path):
    cfg = tmp_path / "kv.toml"
    cfg.write_text("blok_size = 3\n")
    result = runner.invoke(app_module.app, ["serve-once", "-p", "x", "--config", str(cfg)])
    assert _assert_one_error_line(result).endswith("did you mean 'block_size'?")


@pytest.mark.slow
def test_usage_error_from_the_real_entry_point(tmp_path):
    res = subprocess.run(
        [sys.executable, "-m", "kvtool.cli.app", "serve-once", "--bogus"],
        capture_output=True, text=True, cwd=REPO, env={**os.environ, "KVTOOL_CACHE_DIR": str(tmp_path)},
    )  # fmt: skip
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.splitlines() == [
        "error: no such option: --bogus (Possible options: --verbose); see 'kvtool serve-once --help'"
    ]


# ------------------------------------------------------------------ -h and --version
@pytest.mark.parametrize("command", [[], *([c] for c in COMMANDS), ["model", "path"], ["model", "list"]])
def test_dash_h_is_help(command):
    short = runner.invoke(app_module.app, [*command, "-h"])
    long = runner.invoke(app_module.app, [*command, "--help"])
    assert short.exit_code == long.exit_code == 0
    assert short.stdout == long.stdout and "Usage:" in short.stdout


def test_version():
    result = runner.invoke(app_module.app, ["--version"])
    assert result.exit_code == 0
    assert result.stdout == f"kvtool {importlib.metadata.version('kvtool')}\n"


def test_no_arguments_prints_help():
    result = runner.invoke(app_module.app, [])
    assert result.exit_code == 2 and "Usage:" in result.stdout and result.stderr == ""


# ------------------------------------------------------------------ the root group's error table
def _toy_app(exc: BaseException) -> typer.Typer:
    toy = typer.Typer(cls=common.KVToolGroup, add_completion=False, pretty_exceptions_enable=False)

    @toy.command()
    def boom() -> None:
        raise exc

    @toy.command()
    def fine() -> None:
        pass

    return toy


def test_known_error_escaping_a_command_is_one_line_with_its_code_and_hint():
    result = runner.invoke(_toy_app(KVToolError("cache is locked", exit_code=3, hint="wait")), ["boom"])
    assert _assert_one_error_line(result, code=3) == "error: cache is locked; wait"


def test_file_not_found_is_one_line():
    result = runner.invoke(_toy_app(FileNotFoundError(2, "No such file", "/x/y")), ["boom"])
    assert _assert_one_error_line(result) == "error: file not found: /x/y"


def test_unknown_error_keeps_its_traceback():
    result = runner.invoke(_toy_app(RuntimeError("a bug")), ["boom"])
    assert result.exit_code == 1 and isinstance(result.exception, RuntimeError)
    assert "error:" not in result.stderr


def test_success_exits_0():
    assert runner.invoke(_toy_app(RuntimeError()), ["fine"]).exit_code == 0


def test_markup_in_a_message_is_printed_verbatim():
    result = runner.invoke(_toy_app(KVToolError("bad value [bold]x[/bold]")), ["boom"])
    assert _assert_one_error_line(result) == "error: bad value [bold]x[/bold]"


# ------------------------------------------------------------------ an --out that cannot be a directory
@pytest.mark.parametrize("command", [["bench-plan", "--trace", "synthetic", "--limit", "5"],
                                     ["bench", str(REPO / "bench_configs" / "quick.toml")]])
@pytest.mark.parametrize("below", [False, True])
def test_an_out_that_is_a_file_is_one_error_line_before_any_work(tmp_path, command, below):
    afile = tmp_path / "afile"
    afile.write_text("not a directory\n")
    out = afile / "sub" if below else afile
    result = runner.invoke(app_module.app, [*command, "--out", str(out), "--json"])
    line = _assert_one_error_line(result)
    assert line.startswith(f"error: --out {out}: ") and result.stdout == ""
    assert afile.read_text() == "not a directory\n"
