"""The README documents the CLI as it is: every command is in its Commands table and has `--help`
with an example, and the `serve-once --json` schema block names exactly the keys a real run prints."""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from kvtool.cli import app as app_module
from kvtool.cli import common

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text(encoding="utf-8")


def _fresh_app() -> typer.Typer:
    """Every command module registered into a new root app (the shared `app` stays untouched)."""
    fresh = typer.Typer(cls=common.KVToolGroup, context_settings={"help_option_names": ["-h", "--help"]},
                        add_completion=False)
    for name in app_module.COMMAND_MODULES:
        importlib.import_module(f"kvtool.cli.{name}").register(fresh)
    return fresh


def _command_paths(cmd, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Leaf command paths, e.g. ('serve-once',), ('model', 'path'). (Typer vendors Click: a
    group is told apart by its `commands`, not by a Click class.)"""
    subs = getattr(cmd, "commands", None)
    if not subs:
        return [path]
    return [p for name, sub in sorted(subs.items()) for p in _command_paths(sub, (*path, name))]


APP = _fresh_app()
PATHS = _command_paths(typer.main.get_command(APP))


def _section(heading: str) -> str:
    """README text from `heading` (a whole line) to the next heading of any level."""
    start = README.index(f"\n{heading}\n") + len(heading) + 2
    nxt = re.search(r"^#{1,6} ", README[start:], re.M)
    return README[start : start + nxt.start()] if nxt else README[start:]


def _table_commands() -> dict[str, set[str]]:
    """Commands named in the Commands table: `kvtool NAME [SUB/SUB] ...` -> {NAME: {SUB, ...}}."""
    out: dict[str, set[str]] = {}
    for span in re.findall(r"`kvtool ([^`]+)`", _section("## Commands")):
        words = span.split()
        subs = words[1].split("/") if len(words) > 1 and re.fullmatch(r"[a-z-]+(/[a-z-]+)*", words[1]) else []
        out.setdefault(words[0], set()).update(subs)
    return out


def test_the_command_list_is_complete():
    assert len(PATHS) >= 10 and ("serve-once",) in PATHS and ("model", "path") in PATHS


@pytest.mark.parametrize("path", PATHS, ids=" ".join)
def test_every_command_is_in_the_readme_table(path):
    table = _table_commands()
    assert path[0] in table, f"`kvtool {path[0]}` is missing from README.md's Commands table"
    if len(path) > 1:
        assert path[1] in table[path[0]], f"`kvtool {' '.join(path)}` is missing from README.md's Commands table"


@pytest.mark.parametrize("path", PATHS, ids=" ".join)
def test_every_command_has_help_with_an_example(path):
    res = CliRunner().invoke(APP, [*path, "--help"], env={"COLUMNS": "120"})
    assert res.exit_code == 0, res.output
    assert "Example" in res.output
    assert f"kvtool {' '.join(path)}" in " ".join(res.output.split())  # the example uses the command


def _schema_block() -> str:
    section = _section("### `serve-once --json` schema")
    return re.search(r"```json\n(.*?)```", section, re.S).group(1)


def test_serve_once_json_keys_are_the_documented_ones(tmp_path):
    block = _schema_block()
    top = set(re.findall(r'^  "(\w+)":', block, re.M))
    requests = block[block.index('"requests": [') + len('"requests": [') : block.index("\n  ],")]
    request_keys = set(re.findall(r'"(\w+)":', requests))
    stats_line = next(line for line in block.splitlines() if line.startswith('  "stats":'))
    stats_keys = set(re.findall(r'"(\w+)":', stats_line)) - {"stats"}
    assert top and request_keys and stats_keys

    res = subprocess.run(
        [sys.executable, "-m", "kvtool.cli.app", "serve-once", "--json", "--prompt", "hello there",
         "--max-tokens", "2", "--cache-dir", str(tmp_path / "kv")],
        capture_output=True, text=True, cwd=REPO, env=dict(os.environ), timeout=120,
    )
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    undocumented, gone = sorted(set(doc) - top), sorted(top - set(doc))
    assert not undocumented, f"serve-once --json prints {undocumented}: not in README.md's schema block"
    assert not gone, f"README.md's schema block names {gone}: serve-once --json does not print them"
    assert set(doc["requests"][0]) == request_keys
    assert stats_keys <= set(doc["stats"])
