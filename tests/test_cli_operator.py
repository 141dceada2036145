"""Operator commands say what they did: a cache directory that does not exist, remote hits in
human output, one name per option, human units, refusals before the model loads, `warm` into
an SSD budget, and tables that are not cut without a terminal."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from kvtool.cli import app as app_module

if not any(c.name == "inspect" for c in app_module.app.registered_commands):
    app_module._register()
runner = CliRunner()


def kvtool(*args: str, **kw):
    return runner.invoke(app_module.app, list(args), **kw)


def one_error_line(res, code: int = 2) -> str:
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.exit_code == code, (res.exit_code, res.output)
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    assert "Traceback" not in res.output and res.stdout == ""
    return lines[0]


# ------------------------------------------------------------------ a cache directory that does not exist
@pytest.mark.parametrize("command", [["inspect"], ["validate"], ["prune", "--yes"], ["rm", "--yes", "0123abcd"]])
@pytest.mark.parametrize("quiet", [[], ["--quiet"]])
def test_a_named_cache_dir_that_does_not_exist_is_one_error_line(tmp_path, command, quiet):
    absent = tmp_path / "does" / "not" / "exist"
    line = one_error_line(kvtool(*command, "--cache-dir", str(absent), *quiet))
    assert "does/not/exist" in line and "does not exist" in line and "--create" in line and not absent.exists()  # a long path is shortened in the middle


def test_a_missing_cache_dir_from_the_environment_is_refused_too(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTOOL_CACHE_DIR", str(tmp_path / "typo"))
    assert "KVTOOL_CACHE_DIR" in one_error_line(kvtool("validate", "--quiet"))


@pytest.mark.parametrize("command", [["inspect"], ["validate"], ["prune", "--yes"]])
def test_create_makes_the_directory_and_the_default_one_may_be_missing(tmp_path, monkeypatch, command):
    made = tmp_path / "new" / "kv"
    res = kvtool(*command, "--cache-dir", str(made), "--create", "--quiet")
    assert res.exit_code == 0 and res.output == "" and made.is_dir()
    monkeypatch.delenv("KVTOOL_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))  # the default: nothing cached yet
    res = kvtool(*command, "--quiet")
    assert res.exit_code == 0 and res.output == ""
    assert "does not apply" in one_error_line(kvtool("inspect", "--remote", "--create"))


@pytest.mark.parametrize("command", [["inspect"], ["validate"], ["prune", "--yes", "--ttl", "0s"], ["rm", "--yes", "KEY"]])
def test_a_namespace_directory_given_as_the_cache_dir_is_one_error_line(tmp_path, command):
    import numpy as np

    from tests.store_helpers import make_chain, open_store

    store = open_store(tmp_path / "kv")
    store.save_blocks(make_chain(store.layout_key, np.arange(8)))
    store.close()
    ns_dir = store.namespace_dir  # e.g. copied from `inspect --json`: was "no namespaces", exit 0, a lock made in it
    before = sorted(p.name for p in ns_dir.rglob("*"))
    args = [store.layout_key[:8] if arg == "KEY" else arg for arg in command]
    line = one_error_line(kvtool(*args, "--cache-dir", str(ns_dir)))
    assert "is a namespace directory" in line and f"--cache-dir {tmp_path / 'kv'}" in line
    assert sorted(p.name for p in ns_dir.rglob("*")) == before


# ------------------------------------------------------------------ remote hits beside RAM and SSD
def test_human_lines_name_remote_hits_beside_ram_and_ssd():
    from kvtool.cli.cmd_serve import _human_line
    from kvtool.engine.results import RequestResult
    from kvtool.server.requests import RequestRecord

    served = RequestResult(prompt_tokens=2048, cached_tokens=2037, remote_hit_tokens=2037, prefill_tokens=11)
    assert "cached 2037 (RAM 0, SSD 0, remote 2037)" in _human_line(1, served)
    record = RequestRecord(request=1, prompt_tokens=2048, cached_tokens=2037, remote_hit_tokens=2037,
                           prefill_tokens=11)
    assert "cached 2037 (RAM 0, SSD 0, remote 2037) | prefilled 11" in record.log_line()
    record = RequestRecord(request=2, prompt_tokens=2048, cached_tokens=2037, ssd_hit_tokens=2037,
                           ssd_bytes_read=1377520)
    assert "(RAM 0, SSD 2037, remote 0)" in record.log_line() and "1.3 MiB" in record.log_line()
    assert "1377520" not in record.log_line()


# ------------------------------------------------------------------ one name per option
@pytest.mark.parametrize("sub", ["inspect", "validate", "rm", "prune", "push"])
def test_remote_commands_take_remote_url_and_keep_url_hidden(sub):
    shown = kvtool("remote", sub, "--help", terminal_width=200).stdout
    assert "--remote-url" in shown and "--url" not in shown
    for flag in ("--remote-url", "--url"):  # both reach the server (none listens on port 1)
        res = kvtool("remote", sub, flag, "redis://127.0.0.1:1/0", "--timeout", "1s", "--yes" if sub in ("rm", "prune") else "--json",
                     *(["--idle", "7d"] if sub == "prune" else []), *(["--namespace", "0123abcd"] if sub == "rm" else []))
        assert "no such option" not in res.output and "cannot connect" in res.output, res.output


# ------------------------------------------------------------------ human units
def test_config_show_speaks_human_units_and_json_keeps_the_bytes():
    import json

    res = kvtool("config", "show", "--ram-bytes", "2GiB", terminal_width=200)
    rows = {line.split()[0]: line.split()[1:] for line in res.stdout.splitlines() if line.strip()}
    assert rows["ram_bytes"][:2] == ["2", "GiB"] and "2147483648" not in res.stdout
    assert rows["ssd_ttl"][0] == "7d"  # the TTL prune uses when none is set, not "-"
    doc = json.loads(kvtool("config", "show", "--ram-bytes", "2GiB", "--json").stdout)
    assert doc["settings"]["ram_bytes"]["value"] == 2147483648 and doc["settings"]["ssd_ttl"]["value"] is None


def test_the_server_start_line_speaks_human_units():
    from types import SimpleNamespace

    from kvtool.cli.cmd_serve_http import _describe
    from kvtool.config import KVToolConfig

    cache = SimpleNamespace(tiered=object(), config=KVToolConfig(ram_bytes=1 << 30), namespace_dir="/c/ns",
                            layout_key="ab" * 16)
    limits = SimpleNamespace(max_prompt_tokens=32768, max_tokens_cap=4096, max_body_bytes=8 << 20)
    line = _describe(SimpleNamespace(prefix_cache=cache, limits=limits, url="http://127.0.0.1:8080",
                                     model_name="tiny", model_path="/m", api_key_required=False, prefill_width=8,
                                     prefill_token_budget=256))
    assert "RAM 1 GiB" in line and "body <= 8 MiB" in line and "1073741824" not in line
    assert line.endswith("| prefill width 8, token budget 256")


# ------------------------------------------------------------------ refusals before the model loads
_REFUSE = """
import sys
from kvtool.cli import app
sys.argv = ["kvtool", *sys.argv[1:]]
try:
    app.main()
except SystemExit as exc:
    print("exit", exc.code, "mlx_lm" in sys.modules, "kvtool.engine" in sys.modules)
"""


@pytest.mark.parametrize("args, needle", [
    (["serve", "--prompt-cache-size", "10"], "--prompt-cache-size"),
    (["serve", "--port", "0", "--max-kv-size=100"], "--max-kv-size 100"),
    (["serve-once", "--max-kv-size", "100", "--prompt", "hi"], "--max-kv-size 100"),
    (["warm", "--max-kv-size", "100", "prompts.txt"], "--max-kv-size 100"),
])
def test_flag_refusals_come_before_mlx_lm_or_the_model_load(args, needle):
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-c", _REFUSE, *args], capture_output=True, text=True, timeout=120)
    assert res.stdout.split() == ["exit", "2", "False", "False"], (res.stdout, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], res.stderr


# ------------------------------------------------------------------ warm into an SSD byte budget
@pytest.fixture
def three_documents(tmp_path):
    from pathlib import Path

    demo = (Path(app_module.__file__).parents[1] / "assets" / "demo_prompt.txt").read_text()
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(3):
        (docs / f"d{i}.txt").write_text(f"{i} {demo}")
    return docs


def test_warm_into_a_budget_says_what_is_resident_in_one_note_and_exits_0(tmp_path, three_documents):
    import json

    cache_dir = tmp_path / "kv"
    res = kvtool("warm", "--model", "tiny", "--whole", str(three_documents), "--cache-dir", str(cache_dir),
                 "--ssd-max-bytes", "4MB", "--sync")
    assert res.exit_code == 0, res.output
    assert "WARNING" not in res.stderr and "kept in RAM only" not in res.output
    notes = [line for line in res.stderr.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and "evicted" in notes[0], res.stderr
    assert res.stderr.count("byte budget") == 1, res.stderr  # the note only: no per-segment line
    listing = json.loads(kvtool("inspect", "--cache-dir", str(cache_dir), "--json").stdout)["namespaces"][0]
    assert 0 < listing["blocks"] and f"now resident: {listing['blocks']} block(s)" in res.stdout, res.stdout
    tight = kvtool("warm", "--model", "tiny", "--whole", str(three_documents), "--cache-dir", str(tmp_path / "kv1"),
                   "--ssd-max-bytes", "1MB", "--json")  # no segment fits: the budget at work, not a failure
    doc = json.loads(tight.stdout)
    assert tight.exit_code == 0 and doc["blocks_failed"] == 0 and doc["blocks_over_budget"] > 0, tight.output
    assert doc["blocks_resident"] == 0 and "WARNING" not in tight.stderr and "byte budget" not in tight.stderr


# ------------------------------------------------------------------ tables: full width in files, one style
def test_a_table_in_a_file_is_as_wide_as_its_content_and_in_the_one_style():
    import io

    from rich.console import Console
    from rich.table import Table

    from kvtool.cli.output import print_table

    model = "mlx-community/" + "Very-Long-Model-Name-" * 4 + "4bit"
    table = Table(title="kvtool prune " + "/x" * 60)
    for column in ("namespace", "model", "stored"):
        table.add_column(column, no_wrap=column != "model")
    table.add_row("0123456789ab", model, "1.0 GiB (3)")
    buf = io.StringIO()
    print_table(Console(file=buf, width=80), table)  # not a terminal: a file or a pipe
    text = buf.getvalue()
    assert model in text and "/x" * 60 in text and "…" not in text
    assert "─" in text and not set("┏━┃┡╇│┌┐") & set(text)  # a rule under the header, nothing else
    assert len(text.splitlines()) == 4


@pytest.mark.parametrize("command", ["validate", "inspect", "prune"])
def test_every_operator_table_uses_the_light_style(tmp_path, command):
    from tests.store_helpers import open_store

    cache_dir = tmp_path / "kv"
    open_store(cache_dir).close()
    res = kvtool(command, "--cache-dir", str(cache_dir), *(["--dry-run"] if command == "prune" else []))
    assert res.exit_code == 0, res.output
    assert "─" in res.stdout and not set("┏━┃┡╇│") & set(res.stdout), res.stdout


def test_format_size_is_whole_in_the_largest_unit_it_reaches_else_rounded():
    from kvtool.units import format_size

    assert [format_size(n) for n in (2 << 30, 8 << 20, 64_000_000, 1536 << 20, 500)] == [
        "2 GiB", "8 MiB", "61.0 MiB", "1.5 GiB", "500 B"]


# ------------------------------------------------------------------ paths that look like rich markup
@pytest.mark.parametrize("command", [["inspect"], ["inspect", "--namespace", "KEY"], ["validate"],
                                     ["prune", "--dry-run", "--max-bytes", "1"], ["prune", "--yes", "--max-bytes", "1"]])
def test_a_cache_dir_whose_path_looks_like_markup_is_printed_verbatim(tmp_path, command):
    import numpy as np

    from tests.store_helpers import make_chain, open_store

    cache_dir = tmp_path / "q[" / "red]z[bold]"  # "[/red]" and "[bold]" in one path: both are rich markup
    store = open_store(cache_dir)
    for block in make_chain(store.layout_key, np.arange(8), "bfloat16"):
        store.save_block(block)
    store.close()
    command = [store.layout_key if arg == "KEY" else arg for arg in command]
    res = kvtool(*command, "--cache-dir", str(cache_dir), terminal_width=400)
    assert res.exit_code == 0 and "Traceback" not in res.output, res.output
    assert str(cache_dir) in res.stdout, res.stdout


def test_config_show_export_and_import_print_a_markup_path_verbatim(tmp_path):
    where = tmp_path / "q[" / "red]z[bold]"
    where.mkdir(parents=True)
    (where / "kv.toml").write_text("block_size = 64\n")
    res = kvtool("config", "show", "--cache-dir", str(where / "kv"), "--config", str(where / "kv.toml"), terminal_width=400)
    assert res.exit_code == 0 and str(where / "kv") in res.stdout and str(where / "kv.toml") in res.stdout, res.output
    out = where / "p.safetensors"
    res = kvtool("export", str(out), "--model", "tiny", "--prompt", "hello there", "--fill", "--cache-dir", str(where / "kv"),
                 terminal_width=400)
    assert res.exit_code == 0 and f"wrote {out}:" in res.stdout, res.output  # was a rich MarkupError traceback
    res = kvtool("import", str(out), "--model", "tiny", "--cache-dir", str(where / "kv"), terminal_width=400)
    assert res.exit_code == 0 and f"imported {out}:" in res.stdout, res.output
