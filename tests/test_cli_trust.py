"""What an operator relies on when running kvtool as a service: one duration syntax with units,
`rm` that never picks a namespace by a short or shared prefix, one meaning for `-m`, honest
`--help`, one version string, `schema_version` in every JSON document, shell completion.

In-process with `CliRunner` (as tests/test_cli_errors.py); no model is loaded.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import re
import shutil
import tomllib
from pathlib import Path

import numpy as np
import pytest
import typer
from typer.testing import CliRunner

import kvtool
from kvtool import config as config_module
from kvtool.cli import app as app_module
from kvtool.cli import common
from kvtool.config import ConfigError, KVToolConfig, load_config
from kvtool.units import parse_duration, parse_size
from tests.store_helpers import make_chain, open_store, stored

REPO = Path(__file__).resolve().parent.parent
if not app_module.app.registered_commands:
    app_module._register()
runner = CliRunner()
ROOT = typer.main.get_command(app_module.app)


def _paths(cmd, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every command path, groups included: (), ('prune',), ('model',), ('model', 'list'), ..."""
    subs = getattr(cmd, "commands", None) or {}
    return [path, *(p for name, sub in sorted(subs.items()) for p in _paths(sub, (*path, name)))]


def _command(path: tuple[str, ...]):
    cmd = ROOT
    for name in path:
        cmd = cmd.commands[name]
    return cmd


PATHS = _paths(ROOT)


def cli(*args: str, **kw):
    return runner.invoke(app_module.app, list(args), **kw)


def one_error_line(res) -> str:
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.exit_code == 2, (res.exit_code, res.output, res.exception)
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    assert res.stdout == ""
    return lines[0]


@pytest.fixture
def cache(tmp_path):
    """A cache with one namespace of 3 blocks, last used now."""
    cache_dir = tmp_path / "kv"
    store = open_store(cache_dir)
    for block in make_chain(store.layout_key, np.arange(12)):
        store.save_block(block)
    store.close()
    return cache_dir, store


# ------------------------------------------------------------------ 1. one duration syntax
def test_durations_take_a_unit_or_a_combination():
    single = {"7d": 604800, "12h": 43200, "30m": 1800, "45s": 45, "2w": 1209600, "1.5h": 5400}
    combined = {"1d12h": 129600, "1h 30m": 5400, "2d6h30m15s": 196215}
    assert {text: parse_duration(text) for text in {**single, **combined}} == {**single, **combined}
    with pytest.raises(ValueError, match="given twice"):
        parse_duration("1h1h")


@pytest.mark.parametrize("bare", ["7", 7, 7.5, "0", " 12 "])
def test_a_bare_number_is_not_a_duration_and_the_message_names_the_units(bare):
    with pytest.raises(ValueError) as info:
        parse_duration(bare)
    message = str(info.value)
    assert "no unit" in message and all(f"({name})" in message for name in ("days", "hours", "minutes", "seconds"))


def test_prune_refuses_a_bare_ttl_with_one_error_line(cache):
    cache_dir, store = cache
    line = one_error_line(cli("prune", "--cache-dir", str(cache_dir), "--ttl", "7", "--dry-run"))
    assert "--ttl" in line and "7d (days)" in line and "7s (seconds)" in line
    assert len(stored(store)) == 3


def test_prune_ttl_combination_and_config_ssd_ttl(cache, tmp_path):
    cache_dir, _ = cache
    res = cli("prune", "--cache-dir", str(cache_dir), "--ttl", "1d12h", "--dry-run", "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["ttl_s"] == 129600
    cfg = tmp_path / "kvtool.toml"
    cfg.write_text('ssd_ttl = "12h"\n')
    res = cli("prune", "--cache-dir", str(cache_dir), "--config", str(cfg), "--dry-run", "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["ttl_s"] == 43200
    assert load_config(cfg).ttl_s == 43200 and KVToolConfig().ttl_s == 7 * 86400  # the default: 7d


@pytest.mark.parametrize("line", ["ssd_ttl = 7", 'ssd_ttl = "7"', "ssd_ttl = 7.5"])
def test_config_ssd_ttl_refuses_a_bare_number(tmp_path, line):
    cfg = tmp_path / "kvtool.toml"
    cfg.write_text(line + "\n")
    with pytest.raises(ConfigError) as info:
        load_config(cfg)
    assert info.value.field == "ssd_ttl" and "(days)" in str(info.value) and "(seconds)" in str(info.value)
    assert "ssd_ttl" in one_error_line(cli("prune", "--config", str(cfg), "--dry-run"))


def test_ssd_ttl_days_still_works_with_a_deprecation_warning_logged_once(tmp_path, monkeypatch):
    monkeypatch.setattr(config_module.validators, "_DEPRECATIONS_LOGGED", set())
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("kvtool.config")
    logger.addHandler(handler)
    try:
        cfg = tmp_path / "old.toml"
        cfg.write_text("ssd_ttl_days = 3\n")
        assert load_config(cfg).ttl_s == 3 * 86400
        assert load_config(cfg).replace(block_size=16).ttl_s == 3 * 86400
    finally:
        logger.removeHandler(handler)
    warnings = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "ssd_ttl_days" in warnings[0] and 'ssd_ttl = "3d"' in warnings[0]
    both = tmp_path / "both.toml"
    both.write_text('ssd_ttl_days = 3\nssd_ttl = "3d"\n')
    with pytest.raises(ConfigError, match="not both"):
        load_config(both)


# ------------------------------------------------------------------ 2. rm: no short or shared prefix
def test_rm_refuses_short_prefixes_and_never_deletes_on_an_ambiguous_one(cache):
    cache_dir, store = cache
    key = store.layout_key
    for short in (key[:1], key[:7]):
        line = one_error_line(cli("rm", "--cache-dir", str(cache_dir), short, "--dry-run"))
        assert "too short" in line and "8 hex digits" in line
    twin = cache_dir / (key[:8] + ("0" if key[8] != "0" else "1") * 24)  # a second key with the same 8 digits
    shutil.copytree(store.namespace_dir, twin)
    line = one_error_line(cli("rm", "--cache-dir", str(cache_dir), key[:8], "--yes"))
    assert "2 namespaces" in line and "nothing removed" in line
    assert store.namespace_dir.is_dir() and twin.is_dir() and len(stored(store)) == 3


# ------------------------------------------------------------------ 3. -m is --model everywhere
def test_dash_m_means_model_in_every_command():
    seen = []
    for path in PATHS:
        for param in _command(path).params:
            if "-m" in param.opts:
                assert param.name == "model", (path, param.name)
                seen.append(path)
            if param.name == "model" and param.param_type_name == "option":
                assert "-m" in param.opts, path
            if param.name == "max_tokens":
                assert param.opts == ["--max-tokens", "-n"], (path, param.opts)
    assert {("serve-once",), ("serve",), ("warm",), ("inspect",), ("rm",), ("import",), ("export",)} <= set(seen)
    line = one_error_line(cli("rm", "-m", "tiny", "0123456789abcdef"))
    assert "--model" in line and "only apply with a prompt" in line


# ------------------------------------------------------------------ 4. help: no type tags on switches, defaults, no stray spaces
def _help_text(path: tuple[str, ...]) -> str:
    """`kvtool PATH --help` as one line of words (panel borders and line wraps removed)."""
    res = cli(*path, "--help", env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    words = re.sub(r"[│╭╮╰╯─]", " ", res.stdout)
    return " ".join(words.split())


@pytest.mark.parametrize("path", PATHS, ids=lambda p: " ".join(p) or "kvtool")
def test_help_has_no_type_tag_on_switches_and_no_stray_spaces(path):
    text = _help_text(path)
    assert "<bool>" not in text
    stray = re.findall(r"\S+ [.,;:)](?:\s|$)|\( \S+", text)
    assert not stray, stray
    # rich markup eats an unescaped `[table]` of the help text: every one must show
    markup = {"[bold]", "[dim]", "[red]", "[green]", "[yellow]", "[cyan]"}
    brackets = [b for b in re.findall(r"(?<!\\)\[[\w.]+\]", _command(path).help or "") if b not in markup]
    assert all(b in text for b in brackets), [b for b in brackets if b not in text]


CACHE_DEFAULTS = {"--policy": KVToolConfig().ssd_policy.value, "--durability": KVToolConfig().ssd_durability.value,
                  "--sync": "async", "--block-size": str(KVToolConfig().block_size), "--codec": KVToolConfig().ssd_codec.value}


@pytest.mark.parametrize("path", [p for p in PATHS if any(o.name == "policy" for o in _command(p).params)],
                         ids=" ".join)
def test_cache_options_show_their_defaults(path):
    text = _help_text(path)
    for flag, default in CACHE_DEFAULTS.items():
        if flag == "--codec" and not any(o.name == "codec" for o in _command(path).params):
            continue
        row = text[text.rindex(flag + " "):]
        row = row[: row.find(" --", len(flag))]
        assert f"[default: {default}]" in row, (flag, row)
    ram = text[text.rindex("--ram-bytes "):]
    assert parse_size(re.search(r"\[default: (\S+)\]", ram).group(1)) == KVToolConfig().ram_bytes


# ------------------------------------------------------------------ 5. one version string
def test_one_version_string_from_pyproject():
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    res = cli("--version")
    assert res.exit_code == 0 and res.stdout.strip() == f"kvtool {version}"
    assert importlib.metadata.version("kvtool") == kvtool.__version__ == version
    upgrading = (REPO / "docs" / "operations.md").read_text(encoding="utf-8")
    newest = re.search(r"^#+ Changes in (\d+\.\d+)", upgrading, re.M)
    assert newest and version.startswith(newest.group(1) + "."), "docs/operations.md's newest 'Changes in' is not this version"


# ------------------------------------------------------------------ 6. schema_version everywhere
def test_every_json_document_has_schema_version(cache, tmp_path):
    from tests.test_bench_report import make_run

    cache_dir, store = cache
    run_dir = make_run(tmp_path)
    commands = [["model", "list"], ["report", str(run_dir)], ["inspect", "--cache-dir", str(cache_dir)],
                ["validate", "--cache-dir", str(cache_dir)], ["prune", "--cache-dir", str(cache_dir), "--ttl", "none", "--yes"],
                ["rm", store.layout_key[:8], "--cache-dir", str(cache_dir), "--dry-run"]]  # fmt: skip
    for args in commands:
        res = cli(*args, "--json")
        assert res.exit_code == 0, (args, res.output)
        doc = json.loads(res.stdout)
        assert isinstance(doc, dict) and list(doc)[0] == "schema_version" and doc["schema_version"] == 1, args


def test_print_json_adds_schema_version(capsys):
    common.print_json({"a": 1})
    assert json.loads(capsys.readouterr().out) == {"schema_version": 1, "a": 1}
    sources = [p for p in (REPO / "kvtool" / "cli").glob("*.py") if p.name not in ("common.py", "output.py")]
    assert not [p.name for p in sources if "json.dumps(" in p.read_text()]  # every document goes through them


# ------------------------------------------------------------------ 7. shell completion
def test_shell_completion_is_available():
    text = _help_text(())
    assert "--install-completion" in text and "--show-completion" in text
    # the script `--show-completion` prints, asked for by shell name: `--show-completion` itself
    # detects the shell from the process tree (none under an xdist worker: "Shell not supported")
    res = cli(prog_name="kvtool", env={"_KVTOOL_COMPLETE": "source_bash"})
    assert res.exit_code == 0 and "_KVTOOL_COMPLETE=complete_bash" in res.stdout
