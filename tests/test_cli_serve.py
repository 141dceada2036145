"""`kvtool serve-once` end to end: help, bad input, two processes sharing the SSD tier, SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvtool.cli import app as app_module
from kvtool.config import DEFAULT_BLOCK_SIZE

REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / "kvtool" / "assets" / "demo_prompt.txt"
app_module._register() if not app_module.app.registered_commands else None
runner = CliRunner()


def kvtool(*args, env=None, **kw):
    """Run the real console entry point in a subprocess."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "kvtool.cli.app", *args], capture_output=True, text=True,
                          env=full_env, cwd=REPO, **kw)


@pytest.mark.slow  # tests/test_docs.py checks the same, one command per test, in the fast set
def test_every_command_has_help_with_an_example():
    top = runner.invoke(app_module.app, ["--help"])
    assert top.exit_code == 0 and "Example" in top.output
    names = [c.name for c in app_module.app.registered_commands] + [g.name for g in app_module.app.registered_groups]
    assert "serve-once" in names
    for name in names:
        out = runner.invoke(app_module.app, [name, "--help"])
        assert out.exit_code == 0, name
        assert "kvtool " + name in out.output.replace("\n", " ") or "Example" in out.output, name


@pytest.mark.parametrize("args,needle", [
    (["--prompt-file", "/no/such/file.txt"], "file not found"),
    (["--prompt", "hi", "--policy", "sometimes"], "--policy"),
    (["--prompt", "hi", "--durability", "forever"], "--durability"),
    (["--prompt", "hi", "--model", "./no/such/model"], "model path not found"),
    (["--prompt", "hi", "--ram-bytes", "lots"], "--ram-bytes"),
    (["--prompt", "hi", "--prompt-file", "x"], "exactly one"),
    ([], "exactly one"),
])
@pytest.mark.slow
def test_bad_input_is_one_clean_line(args, needle, tmp_path):
    res = kvtool("serve-once", "--cache-dir", str(tmp_path), *args)
    assert res.returncode == 2
    assert needle in res.stderr and "Traceback" not in res.stderr
    assert len([line for line in res.stderr.splitlines() if line.strip()]) == 1


@pytest.mark.slow
def test_bad_config_file_value_names_the_field(tmp_path):
    cfg = tmp_path / "kv.toml"
    cfg.write_text("block_size = -3\n")
    res = kvtool("serve-once", "--prompt", "hi", "--config", str(cfg), "--cache-dir", str(tmp_path))
    assert res.returncode == 2 and "block_size" in res.stderr and "Traceback" not in res.stderr


@pytest.mark.slow
def test_two_processes_share_the_ssd_tier(tmp_path):
    """The acceptance scenario: a >= 1,000-token prompt served by two processes in a row."""
    args = ["serve-once", "--json", "--prompt-file", str(DEMO), "--max-tokens", "16"]
    env = {"KVTOOL_CACHE_DIR": str(tmp_path / "kv")}
    first = kvtool(*args, env=env)
    assert first.returncode == 0, first.stderr
    second = kvtool(*args, env=env)
    assert second.returncode == 0, second.stderr
    a, b = json.loads(first.stdout), json.loads(second.stdout)
    ra, rb = a["requests"][0], b["requests"][0]
    assert ra["prompt_tokens"] >= 1000 and ra["cached_tokens"] == 0
    bs = DEFAULT_BLOCK_SIZE
    n_full = ra["prompt_tokens"] // bs
    tail = 1 if ra["prompt_tokens"] % bs else 0
    # the tail entry makes a replay a full hit: only the last token is re-forwarded
    assert rb["ssd_hit_tokens"] == ra["prompt_tokens"] - 1 and rb["ram_hit_tokens"] == 0
    assert rb["prefill_tokens"] == 1
    assert rb["token_ids"] == ra["token_ids"] and len(rb["token_ids"]) == 16
    for doc in (a, b):
        r = doc["requests"][0]
        assert r["prompt_tokens"] == r["cached_tokens"] + r["prefill_tokens"]
        assert r["cached_tokens"] == r["ram_hit_tokens"] + r["ssd_hit_tokens"]
        assert doc["shutdown_clean"] is True and doc["warmup_ms"] > 0
    # counters are taken after the drain: every block of the first run is counted as written
    assert a["stats"]["ssd_save_success"] == n_full + tail and a["stats"]["writer_pending"] == 0
    assert b["stats"]["ssd_load_hits"] == n_full + tail
    assert a["stats"]["ssd_segments_written"] == 1 and a["ssd_disabled_reason"] is None


@pytest.mark.slow
def test_requests_file_serves_in_order_with_ram_hits(tmp_path):
    text = DEMO.read_text()[:3000]
    reqs = tmp_path / "r.jsonl"
    reqs.write_text("\n".join(json.dumps(x) for x in [
        {"prompt": text, "max_tokens": 4},
        {"prompt": text + " And one more question?", "max_tokens": 4},
        {"messages": [{"role": "user", "content": "Hello there"}]},
    ]))
    res = kvtool("serve-once", "--json", "--requests", str(reqs), "--block-size", "64", "--cache-dir", str(tmp_path / "kv"))
    assert res.returncode == 0, res.stderr
    r = json.loads(res.stdout)["requests"]
    assert len(r) == 3 and r[0]["generated_tokens"] == 4
    assert r[1]["ram_hit_tokens"] > 0 and r[1]["ssd_hit_tokens"] == 0


def _serve_once_until_a_segment_then(tmp_path, sig: int, *flags: str) -> tuple[subprocess.Popen, str, str, Path]:
    """Start serve-once on 40 long requests, send `sig` once the first segment file is on SSD;
    (process, stdout, stderr, cache dir)."""
    text = DEMO.read_text()
    reqs = tmp_path / "r.jsonl"
    reqs.write_text("\n".join(json.dumps({"prompt": f"{i} {text}", "max_tokens": 64}) for i in range(40)))
    cache = tmp_path / "kv"
    proc = subprocess.Popen([sys.executable, "-m", "kvtool.cli.app", "serve-once", *flags, "--requests", str(reqs),
                             "--block-size", "64", "--cache-dir", str(cache)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not list(cache.glob("*/*/*.safetensors")) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    return proc, out, err, cache


@pytest.mark.slow
def test_sigint_says_interrupted_in_the_human_summary(tmp_path):
    proc, out, err, _ = _serve_once_until_a_segment_then(tmp_path, signal.SIGINT)
    assert proc.returncode == 130, err
    assert out.splitlines()[-1].startswith("interrupted (SIGINT): cache: "), out  # was the plain "cache: " line


@pytest.mark.slow
def test_sigterm_takes_the_clean_path(tmp_path):
    """SIGTERM while serving: the writer drains, the index records a clean shutdown, exit 143."""
    proc, out, err, cache = _serve_once_until_a_segment_then(tmp_path, signal.SIGTERM, "--json")
    assert proc.returncode == 143, err
    doc = json.loads(out)
    assert doc["interrupted"] == "SIGTERM" and doc["shutdown_clean"] is True
    import sqlite3

    (index,) = list(cache.glob("*/index.sqlite"))
    meta = dict(sqlite3.connect(index).execute("select key, value from meta").fetchall())
    assert meta["shutdown_clean"] == "1"


@pytest.mark.slow
def test_mlx_lm_conventions_stdin_chat_template_and_max_tokens(tmp_path):
    """`--prompt -` reads stdin, the chat template is applied like mlx_lm.generate, -n is --max-tokens."""
    from mlx_lm import load

    from kvtool.models import embedded

    args = ["serve-once", "--json", "--prompt", "-", "-n", "3", "--system-prompt", "Be brief.",
            "--cache-dir", str(tmp_path / "kv")]
    res = kvtool(*args, input="hello world")
    assert res.returncode == 0, res.stderr
    req = json.loads(res.stdout)["requests"][0]
    assert req["generated_tokens"] <= 3
    _, tok = load(str(embedded.model_dir("tiny")))
    text = tok.apply_chat_template([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello world"}],
                                   tokenize=False, add_generation_prompt=True)
    assert req["prompt_tokens"] == len(tok.encode(text, add_special_tokens=False))  # mlx_lm.generate's tokens
    raw = kvtool("serve-once", "--json", "--prompt", "hello world", "--ignore-chat-template", "-n", "2",
                 "--cache-dir", str(tmp_path / "kv"))
    assert raw.returncode == 0, raw.stderr
    assert json.loads(raw.stdout)["requests"][0]["prompt_tokens"] == len(tok.encode("hello world"))


@pytest.mark.slow
def test_max_kv_size_is_refused_with_one_line(tmp_path):
    res = kvtool("serve-once", "--prompt", "hi", "--max-kv-size", "128", "--cache-dir", str(tmp_path))
    assert res.returncode == 2
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and "RotatingKVCache" in lines[0]
