"""The docs describe the CLI as it is: docs/commands.md is exactly what scripts/gen_commands_doc.py
generates from the code, every command has `--help` with an example, the `serve-once --json`
schema block names exactly the keys a real run prints, every `kvtool ...` line of README.md names
a real command and real options, and every file README.md links to exists."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text(encoding="utf-8")
COMMANDS_MD = REPO / "docs" / "commands.md"
REGENERATE = ".venv/bin/python scripts/gen_commands_doc.py"


def _gen_module():
    spec = importlib.util.spec_from_file_location("gen_commands_doc", REPO / "scripts" / "gen_commands_doc.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GEN = _gen_module()
APP = GEN.build_app()  # every command module registered into a new root app


def _command_paths(cmd, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Leaf command paths, e.g. ('serve-once',), ('model', 'path'). (Typer vendors Click: a
    group is told apart by its `commands`, not by a Click class.)"""
    subs = getattr(cmd, "commands", None)
    if not subs:
        return [path]
    return [p for name, sub in sorted(subs.items()) for p in _command_paths(sub, (*path, name))]


PATHS = _command_paths(typer.main.get_command(APP))


def _commands_doc() -> str:
    return COMMANDS_MD.read_text(encoding="utf-8")


def _section(text: str, heading: str) -> str:
    """`text` from `heading` (a whole line) to the next heading of the same or a higher level."""
    start = text.index(f"\n{heading}\n") + len(heading) + 2
    level = len(heading) - len(heading.lstrip("#"))
    nxt = re.search(rf"^#{{1,{level}}} ", text[start:], re.M)
    return text[start : start + nxt.start()] if nxt else text[start:]


def test_the_command_list_is_complete():
    assert len(PATHS) >= 10 and ("serve-once",) in PATHS and ("model", "path") in PATHS


def test_commands_md_is_generated_from_the_code():
    current = _commands_doc() if COMMANDS_MD.exists() else ""
    assert current == GEN.render(), f"docs/commands.md is out of date: regenerate it with `{REGENERATE}`"


@pytest.mark.parametrize("path", PATHS, ids=" ".join)
def test_every_command_is_in_commands_md(path):
    heading = "#" * (1 + len(path)) + f" `kvtool {' '.join(path)}`"
    assert f"\n{heading}\n" in _commands_doc(), f"{heading!r} is missing from docs/commands.md: run `{REGENERATE}`"


@pytest.mark.parametrize("path", PATHS, ids=" ".join)
def test_every_command_has_help_with_an_example(path):
    res = CliRunner().invoke(APP, [*path, "--help"], env={"COLUMNS": "120"})
    assert res.exit_code == 0, res.output
    assert "Example" in res.output
    assert f"kvtool {' '.join(path)}" in " ".join(res.output.split())  # the example uses the command


def _schema_block() -> str:
    section = _section(_commands_doc(), "## `kvtool serve-once`")
    return re.search(r"```json\n(.*?)```", section, re.S).group(1)


@pytest.mark.slow  # a serve-once subprocess
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
    hint = f"edit docs/json/serve-once.md, then run `{REGENERATE}`"
    assert not undocumented, f"serve-once --json prints {undocumented}, not in docs/commands.md: {hint}"
    assert not gone, f"docs/commands.md names {gone}: serve-once --json does not print them: {hint}"
    assert set(doc["requests"][0]) == request_keys, hint
    assert stats_keys <= set(doc["stats"]), hint


def test_validate_json_keys_are_the_documented_ones(tmp_path):
    block = re.search(r"```json\n(.*?)```", _section(_commands_doc(), "## `kvtool validate`"), re.S).group(1)
    namespace = block[block.index('"namespaces": [') : block.index("\n  ],")]
    documented = set(re.findall(r'"(\w+)":', namespace)) - {"namespaces"}
    from tests.store_helpers import open_store

    open_store(tmp_path / "kv").close()
    res = CliRunner().invoke(APP, ["validate", "--json", "--cache-dir", str(tmp_path / "kv")])
    (ns,) = json.loads(res.stdout)["namespaces"]
    hint = f"edit docs/json/validate.md, then run `{REGENERATE}`"
    assert set(ns) == documented, (sorted(set(ns) - documented), sorted(documented - set(ns)), hint)


def _readme_command_lines() -> list[list[str]]:
    """Every `kvtool ...` command line in README.md's fenced code blocks, as words: continuation
    lines joined, comments and leading `VAR=value` assignments dropped; crontab lines
    (`... /path/to/.venv/bin/kvtool prune ...`) included."""
    lines = []
    for block in re.findall(r"```[a-z]*\n(.*?)```", README, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("  #")[0].strip()
            words = line.split()
            while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
                words = words[1:]
            if words and words[0] == "kvtool":
                lines.append(words)
            elif "/kvtool " in line:
                lines.append(["kvtool", *line.split("/kvtool ", 1)[1].split()])
    return lines


def test_readme_shows_the_main_commands():
    assert {"serve", "serve-once", "prune", "validate"} <= {words[1] for words in _readme_command_lines()}


@pytest.mark.parametrize("words", _readme_command_lines(), ids=lambda w: " ".join(w[:4]))
def test_every_readme_command_line_runs(words):
    """`kvtool <command> --help` runs for every command line in README.md, and knows its options."""
    known = set()
    for p in PATHS:
        known.update(p[:i] for i in range(1, len(p) + 1))
    path = [w for w in words[1:3] if re.fullmatch(r"[a-z][a-z0-9-]*", w)]
    while path and tuple(path) not in known:
        path.pop()
    assert path, f"README.md: `{' '.join(words)}` names no kvtool command"
    res = CliRunner().invoke(APP, [*path, "--help"], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    help_text = " ".join(res.output.split())
    for option in (w.split("=")[0] for w in words if w.startswith("--")):
        assert option in help_text, f"README.md: `kvtool {' '.join(path)}` has no option {option}"


def test_every_file_readme_links_to_exists():
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README)
    assert targets
    missing = [t for t in targets if not t.startswith(("http://", "https://")) and not (REPO / t).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"


@pytest.mark.parametrize("doc", sorted((REPO / "docs").glob("*.md")), ids=lambda p: p.name)
def test_every_file_a_doc_links_to_exists(doc):
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text(encoding="utf-8"))
    missing = [t for t in targets if not t.startswith(("http://", "https://")) and not (doc.parent / t).exists()]
    assert not missing, f"{doc.relative_to(REPO)} links to files that do not exist: {missing}"


def test_readme_shared_tier_is_safe_to_copy():
    """The README's shared-tier section: it says where
    the server comes from on Linux and macOS, its example listens on loopback only, and it points to
    a password and TLS for several machines (not 'every interface, no password' by copy-paste)."""
    section = README.split("## Share the cache between machines", 1)[1].split("\n## ", 1)[0]
    starts = [line for line in section.splitlines() if line.lstrip().startswith("redis-server")]
    assert starts and all("--bind 127.0.0.1" in line for line in starts), starts
    assert "apt install" in section and "brew install" in section and "valkey" in section.lower()
    assert "requirepass" in section and "KVTOOL_REMOTE_PASSWORD" in section and "rediss://" in section
