"""Tests of kvtool.cli.output: one output object, three modes (human / --json / --quiet), exactly
one versioned JSON document, progress bars only for a person on a terminal (docs/design.md#command-line-contract)."""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console
from rich.table import Table

from kvtool.cli.output import SCHEMA_VERSION, Output, OutputMode, versioned


def make(mode: OutputMode, terminal: bool = False) -> tuple[Output, io.StringIO, io.StringIO]:
    """An Output writing to string buffers (JSON goes to `sys.stdout`: read it with capsys)."""
    out_buf, err_buf = io.StringIO(), io.StringIO()
    out = Output(
        mode, console=Console(file=out_buf, width=100, force_terminal=terminal),
        err_console=Console(file=err_buf, width=100, force_terminal=terminal),
    )  # fmt: skip
    return out, out_buf, err_buf


def table() -> Table:
    t = Table("namespace", "size")
    t.add_row("3fa2c1d0", "1.0 KiB")
    return t


def drive(out: Output) -> None:
    """Everything a command does, once."""
    out.print("plain [bold]text[/]")
    out.table(table())
    out.emit({"cache_dir": "/x", "namespaces": []}, lambda: out.print("human result"))
    out.note("a note")
    out.problem("a problem")


def test_from_flags_picks_the_mode_and_json_keeps_its_document_under_quiet():
    assert Output.from_flags().mode == OutputMode.HUMAN
    assert Output.from_flags(json_out=True).mode == OutputMode.JSON
    assert Output.from_flags(quiet=True).mode == OutputMode.QUIET
    both = Output.from_flags(json_out=True, quiet=True)  # --json is the script interface: the document still prints
    assert (both.mode, both.json, both.quiet, both.human) == (OutputMode.JSON, True, True, False)
    h, j, q = Output.from_flags(), Output.from_flags(json_out=True), Output.from_flags(quiet=True)
    assert (h.human, h.json, h.quiet) == (True, False, False)
    assert (j.human, j.json, j.quiet) == (False, True, False)
    assert (q.human, q.json, q.quiet) == (False, False, True)


def test_human_mode_prints_text_and_tables_on_stdout_and_no_json(capsys):
    out, stdout, stderr = make(OutputMode.HUMAN)
    drive(out)
    text = stdout.getvalue()
    assert "plain text" in text and "3fa2c1d0" in text and "human result" in text
    assert "[bold]" not in text and "{" not in text  # markup rendered, no JSON
    assert stderr.getvalue().splitlines() == ["a note", "a problem"]
    assert capsys.readouterr().out == ""
    assert out.interaction is out.console  # a confirmation shows its plan on stdout


def test_json_mode_prints_exactly_one_versioned_document(capsys):
    out, stdout, stderr = make(OutputMode.JSON)
    drive(out)
    doc = json.loads(capsys.readouterr().out)  # the whole of stdout is one document
    assert doc == {"schema_version": SCHEMA_VERSION, "cache_dir": "/x", "namespaces": []}
    assert list(doc)[0] == "schema_version" and SCHEMA_VERSION == 1
    assert stdout.getvalue() == ""  # no text, no table on the console
    assert stderr.getvalue().splitlines() == ["a note", "a problem"]  # stderr never pollutes the JSON
    with pytest.raises(RuntimeError, match="exactly one"):
        out.document({"again": True})
    assert out.interaction is out.err_console  # a confirmation's plan goes to stderr


def test_json_document_is_built_lazily_and_keeps_its_own_keys(capsys):
    out, _, _ = make(OutputMode.JSON)
    calls = []
    out.emit(lambda: calls.append(1) or {"schema_version": 99, "a": [1, 2]}, lambda: None)
    assert calls == [1]
    assert json.loads(capsys.readouterr().out) == {"schema_version": 1, "a": [1, 2]}
    human, _, _ = make(OutputMode.HUMAN)
    human.emit(lambda: calls.append(2) or {}, lambda: None)
    assert calls == [1]  # never built for a person
    assert versioned({"b": 1}) == {"schema_version": 1, "b": 1}


def test_quiet_mode_prints_nothing_but_problems(capsys):
    out, stdout, stderr = make(OutputMode.QUIET)
    drive(out)
    assert stdout.getvalue() == "" and capsys.readouterr().out == ""
    assert stderr.getvalue().splitlines() == ["a problem"]  # no note
    assert out.interaction is out.err_console


@pytest.mark.parametrize("mode", list(OutputMode))
def test_progress_only_for_a_person_on_a_terminal(mode):
    for terminal in (False, True):
        out, _, _ = make(mode, terminal=terminal)
        assert out.show_progress == (mode == OutputMode.HUMAN and terminal)


def test_defaults_to_the_shared_consoles():
    from kvtool.cli import common

    out = Output()
    assert out.console is common.console and out.err_console is common.err_console


# ------------------------------------------------------------------ the commands that print through it
@pytest.fixture
def cache(tmp_path):
    """A small clean cache (one namespace, one chain) and a config file pointing at it."""
    import numpy as np

    from tests.store_helpers import make_chain, open_store

    cache_dir = tmp_path / "kv"
    store = open_store(cache_dir)
    for b in make_chain(store.layout_key, np.arange(12), tail=True):
        store.save_block(b)
    store.close()
    cfg = tmp_path / "kvtool.toml"
    cfg.write_text(f'ssd_cache_dir = "{cache_dir}"\n')
    return cache_dir, store, cfg


def _cli():
    from typer.testing import CliRunner

    from kvtool.cli import app as app_module

    if not any(c.name == "rm" for c in app_module.app.registered_commands):
        app_module._register()
    runner = CliRunner()
    return lambda *args: runner.invoke(app_module.app, list(args))


@pytest.mark.parametrize("command", [["inspect"], ["validate"], ["prune", "--yes", "--ttl", "none"], ["rm", "--dry-run"]])
def test_every_json_document_is_versioned_and_quiet_is_silent(cache, command):
    cache_dir, store, _ = cache
    cli = _cli()
    args = [*command, *([store.layout_key[:8]] if command[0] == "rm" else []), "--cache-dir", str(cache_dir)]
    res = cli(*args, "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert list(doc)[0] == "schema_version" and doc["schema_version"] == SCHEMA_VERSION
    quiet = cli(*args, "--quiet")
    assert quiet.exit_code == 0 and quiet.output == ""
    both = cli(*args, "--json", "--quiet")  # one rule in every command: the document, and nothing else
    assert both.exit_code == 0, both.output
    assert both.stderr == ""
    assert json.loads(both.stdout).keys() == doc.keys()


def test_validate_reads_config_and_quiet_prints_only_problems(cache, monkeypatch):
    cache_dir, store, cfg = cache
    cli = _cli()
    (cache_dir.parent / "elsewhere").mkdir()  # a named cache directory must exist (else one error line)
    monkeypatch.setenv("KVTOOL_CACHE_DIR", str(cache_dir.parent / "elsewhere"))  # the environment wins over the file
    res = cli("validate", "--config", str(cfg), "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["cache_dir"] == str(cache_dir.parent / "elsewhere")
    monkeypatch.delenv("KVTOOL_CACHE_DIR")
    res = cli("validate", "--config", str(cfg), "--json")  # no variable: the config's cache dir
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["cache_dir"] == str(cache_dir)
    assert cli("validate", "--config", str(cfg.parent / "absent.toml")).exit_code == 2
    next(store.namespace_dir.glob("??/*.safetensors")).unlink()  # rows whose file is gone
    res = cli("validate", "--config", str(cfg), "--quiet")
    lines = res.stderr.splitlines()
    assert res.exit_code == 1 and res.stdout == ""
    assert lines[0].startswith(store.layout_key) and "missing" in lines[0] and "problem(s) found" in lines[-1]
    assert cli("validate", "--config", str(cfg), "--quiet").output == ""  # repaired: silent again
