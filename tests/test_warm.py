"""Tests of kvtool.jobs.warm and `kvtool warm`: sources, write-through whatever the policy, a warm
run then `serve-once` in a new process (all SSD hits, same tokens as uncached), the second run
writing nothing, interruption, bad input."""

from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvtool.cli import app as app_module
from kvtool.config import KVToolConfig
from kvtool.engine import Engine
from kvtool.jobs.warm import WarmError, load_sources, warm
from kvtool.ops.validate import validate
from kvtool.prompts import Request
from kvtool.units import format_bytes

REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / "kvtool" / "assets" / "demo_prompt.txt"
BS = 64
MAX_TOKENS = 6

if not any(c.name == "warm" for c in app_module.app.registered_commands):
    app_module._register()
runner = CliRunner()


def kvtool(*args, **kw):
    """The real entry point in a subprocess."""
    return subprocess.run([sys.executable, "-m", "kvtool.cli.app", *args], capture_output=True, text=True, cwd=REPO, **kw)


@pytest.fixture(scope="module")
def texts() -> list[str]:
    """Three prompts of 2-4 blocks that share no block."""
    text = DEMO.read_text(encoding="utf-8")
    return [" ".join(text[1000 * i : 1000 * i + 600 + 200 * i].split()) for i in range(3)]


@pytest.fixture
def prompts_file(tmp_path, texts) -> Path:
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(texts) + "\n\n")
    return path


def engine_for(loaded, cache_dir: Path, **overrides) -> Engine:
    return Engine(loaded, KVToolConfig(ssd_cache_dir=cache_dir, block_size=BS, **overrides))


def rows(cache_dir: Path) -> int:
    (db,) = list(cache_dir.glob("*/index.sqlite"))
    with sqlite3.connect(db) as conn:
        return conn.execute("SELECT COUNT(*) FROM blocks").fetchone()[0]


# ------------------------------------------------------------------ sources
def test_sources_lines_whole_jsonl_and_directory(tmp_path, prompts_file, texts):
    assert [p.request.prompt for p in load_sources([prompts_file])] == texts  # blank lines skipped
    assert [p.source for p in load_sources([prompts_file])][1] == f"{prompts_file}:2"
    (whole,) = load_sources([prompts_file], whole=True)
    assert whole.request.prompt == prompts_file.read_text()
    jsonl = tmp_path / "r.jsonl"
    jsonl.write_text(json.dumps({"prompt": "a"}) + "\n" + json.dumps({"messages": [{"role": "user", "content": "b"}]}) + "\n")
    reqs = [p.request for p in load_sources([jsonl])]
    assert reqs == [Request(prompt="a"), Request(messages=[{"role": "user", "content": "b"}])]
    docs = tmp_path / "docs"
    (docs / "sub").mkdir(parents=True)
    (docs / "b.md").write_text("bee\nline two")
    (docs / "a.txt").write_text("ay")
    (docs / "sub" / "c.txt").write_text("sea")
    (docs / "skip.json").write_text("{}")
    (docs / ".hidden.txt").write_text("no")
    found = load_sources([docs, jsonl])
    assert [p.request.prompt for p in found] == ["ay", "bee\nline two", "sea", "a", None]


@pytest.mark.parametrize(
    "setup, message",
    [
        (lambda d: d / "absent.txt", "not found"),
        (lambda d: (d / "empty.txt").write_text("  \n") and d / "empty.txt", "empty"),
        (lambda d: (d / "bad.jsonl").write_text('{"prompt": "x"}\nnot json\n') and d / "bad.jsonl", "bad.jsonl:2"),
        (lambda d: (d / "bin.txt").write_bytes(b"\xff\xfe\x00") and d / "bin.txt", "not UTF-8"),
        (lambda d: (d / "nodocs").mkdir() or d / "nodocs", "no .txt/.md files"),
    ],
    ids=["missing", "empty", "bad-jsonl", "binary", "empty-dir"],
)
def test_bad_sources(tmp_path, setup, message):
    path = setup(tmp_path)
    with pytest.raises(WarmError, match=message):
        load_sources([path])
    res = runner.invoke(app_module.app, ["warm", "--cache-dir", str(tmp_path / "kv"), str(path)])
    assert res.exit_code == 2 and message in res.output and "Traceback" not in res.output
    assert not (tmp_path / "kv").exists()  # failed before loading the model or opening the cache


# ------------------------------------------------------------------ warm
@pytest.mark.parametrize("policy, async_writes, durability", [
    ("evict_only", True, "best_effort"), ("write_through", False, "durable"),
])  # fmt: skip
def test_warm_writes_through_whatever_the_policy(tmp_path, tiny_model, prompts_file, policy, async_writes, durability):
    cache_dir = tmp_path / "kv"
    engine = engine_for(tiny_model, cache_dir, ssd_policy=policy, ssd_async_writes=async_writes, ssd_durability=durability)
    report = warm(engine, load_sources([prompts_file]))
    engine.close()
    n_blocks = sum(p.prompt_tokens // BS + (p.prompt_tokens % BS > 0) for p in report.prompts)  # + tail entries
    assert n_blocks >= 6 and report.blocks_written == n_blocks == rows(cache_dir)
    assert report.prompts_prefilled == 3 and report.blocks_failed == 0 and report.flushed
    assert report.bytes_written == sum(p.stat().st_size for p in cache_dir.glob("*/*/*.safetensors"))
    assert validate(cache_dir, deep=True).problems == 0


@pytest.mark.slow
def test_warm_then_serve_in_a_new_process_hits_ssd_and_matches_uncached(tmp_path, tiny_model, prompts_file, texts):
    cache_dir = tmp_path / "kv"
    args = ["warm", "--cache-dir", str(cache_dir), "--block-size", str(BS), "--json", str(prompts_file)]
    first = runner.invoke(app_module.app, args)
    assert first.exit_code == 0, first.output
    doc = json.loads(first.stdout)
    assert doc["prompts_prefilled"] == 3 and doc["blocks_written"] == rows(cache_dir) > 0
    assert doc["shutdown_clean"] is True and doc["interrupted"] is None

    again = runner.invoke(app_module.app, args)  # a second identical run writes nothing
    assert again.exit_code == 0, again.output
    doc2 = json.loads(again.stdout)
    assert doc2["blocks_written"] == 0 and doc2["prompts_skipped"] == 3 and doc2["tokens_prefilled"] == 0

    served = kvtool("serve-once", "--json", "--prompt", texts[2], "--max-tokens", str(MAX_TOKENS),
                    "--cache-dir", str(cache_dir), "--block-size", str(BS))  # fmt: skip
    assert served.returncode == 0, served.stderr
    r = json.loads(served.stdout)["requests"][0]
    # warm and serve-once apply the same chat template: a full hit, only the last token re-forwarded
    assert r["prompt_tokens"] % BS != 0 and r["ssd_hit_tokens"] == r["prompt_tokens"] - 1 and r["ram_hit_tokens"] == 0
    uncached = Engine(tiny_model, KVToolConfig(ssd_enabled=False, ram_bytes=0, block_size=BS))
    ref = uncached.generate(uncached.encode(prompt=texts[2], chat_template=True), max_tokens=MAX_TOKENS)
    assert r["token_ids"] == ref.token_ids and len(ref.token_ids) > 0


def test_short_and_chat_prompts(tmp_path, tiny_model):
    src = tmp_path / "r.jsonl"
    long_text = " ".join(DEMO.read_text(encoding="utf-8")[:900].split())
    src.write_text("\n".join(json.dumps(x) for x in [
        {"prompt": "a"}, {"prompt": "hi there"}, {"messages": [{"role": "user", "content": long_text}]}]) + "\n")
    engine = engine_for(tiny_model, tmp_path / "kv")
    report = warm(engine, load_sources([src]))
    assert [p.status for p in report.prompts] == ["too_short", "prefilled", "prefilled"]  # "hi there": a tail entry
    again = warm(engine, load_sources([src]))
    engine.close()
    assert [p.status for p in again.prompts] == ["too_short", "skipped", "skipped"]
    assert report.prompts_too_short == 1 and report.blocks_written == rows(tmp_path / "kv") > 0


def test_a_refused_warm_leaves_no_namespace_behind(tmp_path, prompts_file):
    """A warm whose prompt is refused (over --max-prompt-tokens) after the model loaded stores
    nothing: the namespace it opened goes again, and the cache directory if it made it; a cache
    directory that was there stays, and a warm that stores blocks keeps its namespace."""
    refused = ["warm", str(prompts_file), "--model", "tiny", "--max-prompt-tokens", "5", "--cache-dir"]
    r = runner.invoke(app_module.app, [*refused, str(tmp_path / "new")])
    assert r.exit_code == 2 and "--max-prompt-tokens" in r.stderr and not (tmp_path / "new").exists()
    (tmp_path / "kept").mkdir()
    r = runner.invoke(app_module.app, [*refused, str(tmp_path / "kept")])
    assert r.exit_code == 2 and list((tmp_path / "kept").iterdir()) == []
    r = runner.invoke(app_module.app, ["warm", str(prompts_file), "--model", "tiny", "--cache-dir", str(tmp_path / "kept")])
    assert r.exit_code == 0 and rows(tmp_path / "kept") > 0


def test_interrupt_drains_and_keeps_what_was_written(tmp_path, tiny_model, prompts_file):
    """Ctrl-C (KeyboardInterrupt) after the first prompt: flushed, reported, cache valid."""
    cache_dir = tmp_path / "kv"
    engine = engine_for(tiny_model, cache_dir, ssd_async_writes=True)

    def stop_after_first(report):
        raise KeyboardInterrupt

    report = warm(engine, load_sources([prompts_file]), progress=stop_after_first)
    status = engine.close()
    assert report.interrupted == "KeyboardInterrupt" and report.prompts_done == 1 and report.flushed
    n = report.prompts[0].prompt_tokens
    assert report.blocks_written == n // BS + (n % BS > 0) == rows(cache_dir)  # full blocks + tail entry
    assert status.shutdown_clean and validate(cache_dir, deep=True).problems == 0


@pytest.mark.slow
def test_sigint_in_a_subprocess_exits_130_after_draining(tmp_path):
    text = " ".join(DEMO.read_text(encoding="utf-8").split())
    src = tmp_path / "many.txt"
    src.write_text("\n".join(f"{i} {text[:400]}" for i in range(400)))  # ~minutes of work
    cache_dir = tmp_path / "kv"
    proc = subprocess.Popen([sys.executable, "-m", "kvtool.cli.app", "warm", "--json", "--cache-dir", str(cache_dir),
                             "--block-size", str(BS), str(src)], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    deadline = time.monotonic() + 60
    while not list(cache_dir.glob("*/*/*.safetensors")) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    doc = json.loads(out)
    assert doc["interrupted"] == "SIGINT" and doc["shutdown_clean"] is True and 0 < doc["prompts_done"] < 400
    assert doc["blocks_written"] == rows(cache_dir)
    assert validate(cache_dir, deep=True).problems == 0


# ------------------------------------------------------------------ CLI errors and help
def test_last_progress_line_and_json_count_what_the_drained_writer_wrote(tmp_path, prompts_file):
    """Without a terminal (a progress line at every update here), the closing line counts the
    blocks and bytes on disk once the background writer drained, as --json and the index do, not
    what was written when the last prompt was done (its blocks still queued: durable writes)."""
    cache = tmp_path / "kv"
    res = kvtool("warm", "--model", "tiny", "--json", "--async", "--durability", "durable", "--cache-dir", str(cache),
                 str(prompts_file), env={**os.environ, "KVTOOL_PROGRESS_INTERVAL_S": "0"}, timeout=600)  # fmt: skip
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    lines = [line for line in res.stderr.splitlines() if line.startswith("[kvtool warm ")]
    assert lines and "done: warm 3/3 " in lines[-1], res.stderr
    found = re.search(r"\| blocks (\d+) \| bytes (.+)$", lines[-1])
    assert found is not None, lines[-1]
    assert int(found[1]) == doc["blocks_written"] == doc["blocks_resident"] == rows(cache) > 0
    assert found[2] == format_bytes(doc["bytes_written"]) and doc["bytes_written"] == doc["bytes_resident"]


def test_model_that_does_not_load(tmp_path, prompts_file):
    res = runner.invoke(app_module.app, ["warm", "--model", str(tmp_path / "nomodel"), "--cache-dir",
                                         str(tmp_path / "kv"), str(prompts_file)])  # fmt: skip
    assert res.exit_code == 2 and "error:" in res.output and "Traceback" not in res.output


def test_unusable_cache_dir(tmp_path, prompts_file):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    res = runner.invoke(app_module.app, ["warm", "--cache-dir", str(blocker), str(prompts_file)])
    assert res.exit_code == 2 and "SSD tier is unavailable" in res.output


def test_help_has_examples():
    res = runner.invoke(app_module.app, ["warm", "--help"])
    assert res.exit_code == 0 and "kvtool warm --model tiny prompts.txt" in res.output and "--whole" in res.output
    assert os.environ.get("KVTOOL_MODELS_DIR")  # conftest keeps models out of the user's cache
