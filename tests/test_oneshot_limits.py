"""Bad input to the model-loading commands ends in one `error:` line and exit 2, never a traceback
or unbounded work (the third hostile round: findings 7, 8 and 9).

Real subprocesses of the real entry point on the tiny model (head dim 32, context 32768 per its
config.json): a seed out of mx.random.seed's range, KV quantization settings the model's head dim
does not take, a hard open-files limit below mlx-lm's 4096 (set in the child with
`resource.setrlimit`), `--max-tokens` past the context length, prompts past `--max-prompt-tokens`.
(Finding 9's cases, refused before any model loads, are in tests/test_cli_errors.py and
tests/test_output.py.)
"""

from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TIMEOUT_S = 180.0  # generous: the machine is shared


def kvtool(*args: str, limit_files: int | None = None, timeout: float = TIMEOUT_S) -> subprocess.CompletedProcess:
    def low_limit() -> None:  # in the child, before exec: as `ulimit -n N` does
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit_files, limit_files))

    return subprocess.run([sys.executable, "-m", "kvtool.cli.app", *args], capture_output=True, text=True, cwd=REPO,
                          timeout=timeout, preexec_fn=low_limit if limit_files else None)


def assert_one_error(res: subprocess.CompletedProcess, *needles: str) -> str:
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.returncode == 2, (res.returncode, res.stderr[-3000:])
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr[-3000:]
    assert "Traceback" not in res.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


# ----------------------------------------------------------------------------- finding 7
@pytest.mark.slow
def test_kv_group_size_the_head_dim_does_not_take_is_refused_at_load(tmp_path):
    """tiny's head dim is 32: --kv-group-size 64 cannot quantize it (mlx-lm failed with a traceback
    once a prompt reached --quantized-kv-start); refused before any prefill, by serve-once and serve."""
    cache = ["--cache-dir", str(tmp_path / "cache")]
    line = assert_one_error(kvtool("serve-once", "-p", "hi", "-n", "2", "--kv-bits", "4", "--kv-group-size", "64",
                                   *cache), "head dim is 32", "--kv-group-size 64")
    assert "hint" not in line or "--kv-group-size" in line
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())  # no namespace opened
    assert_one_error(kvtool("serve", "--port", "0", "--kv-bits", "4", "--kv-group-size", "64", *cache),
                     "head dim is 32")
    ok = kvtool("serve-once", "-p", "hi", "-n", "2", "--kv-bits", "4", "--kv-group-size", "32", *cache)
    assert ok.returncode == 0, ok.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("args", [["serve-once", "-p", "hi", "-n", "2"], ["warm", "{src}"], ["serve", "--port", "0"]])
def test_a_hard_open_files_limit_below_4096_is_one_error_line(args, tmp_path):
    """mlx-lm sets RLIMIT_NOFILE to (2048, 4096) when imported: under a lower hard limit its import
    raised ValueError with a traceback in every model-loading command."""
    src = tmp_path / "p.txt"
    src.write_text("one prompt\n")
    res = kvtool(*[a.replace("{src}", str(src)) for a in args], "--cache-dir", str(tmp_path / "cache"),
                 limit_files=1024)
    assert_one_error(res, "open files is 1024", "4096")


@pytest.mark.slow
@pytest.mark.parametrize("seed", ["-1", str(1 << 64)])
def test_serve_once_seed_outside_mx_random_range_is_one_error_line(seed, tmp_path):
    assert_one_error(kvtool("serve-once", "-p", "hi", "-n", "2", "--seed", seed, "--cache-dir", str(tmp_path)),
                     "--seed")


# ----------------------------------------------------------------------------- finding 8
@pytest.mark.slow
def test_serve_once_max_tokens_past_the_context_is_refused(tmp_path):
    """-n 99999999999999999999999 generated until killed (kvtool serve caps max_tokens at the
    context length, 32768 for tiny); now one error line before any prefill."""
    cache = ["--cache-dir", str(tmp_path / "cache")]
    assert_one_error(kvtool("serve-once", "-p", "hi", "-n", "99999999999999999999999", *cache, timeout=60),
                     "--max-tokens 99999999999999999999999", "context length (32768 tokens)")
    reqs = tmp_path / "r.jsonl"
    reqs.write_text('{"prompt": "hi", "max_tokens": 4}\n{"prompt": "hello", "max_tokens": 1000000000}\n')
    assert_one_error(kvtool("serve-once", "--requests", str(reqs), *cache, timeout=60), "request 1: max_tokens")


@pytest.mark.slow
def test_prompts_past_max_prompt_tokens_are_refused_before_the_prefill(tmp_path):
    """A 50k-token --system-prompt (past tiny's 32,768-token context) prefilled for minutes; the
    limit is kvtool serve's (--max-prompt-tokens, default the context length), in serve-once and warm."""
    cache = ["--cache-dir", str(tmp_path / "cache")]
    assert_one_error(kvtool("serve-once", "-p", "hi", "-n", "2", "--system-prompt", "a " * 50000, *cache, timeout=60),
                     "the prompt has 500", "more than the limit of 32768", "--max-prompt-tokens")
    assert_one_error(kvtool("serve-once", "-p", "word " * 200, "-n", "2", "--max-prompt-tokens", "50", *cache),
                     "more than the limit of 50")
    src = tmp_path / "p.txt"
    src.write_text("a short prompt\n" + "word " * 200 + "\n")
    assert_one_error(kvtool("warm", str(src), "--max-prompt-tokens", "50", *cache), f"{src}:2", "limit of 50")
    ok = kvtool("serve-once", "-p", "word " * 20, "-n", "2", "--max-prompt-tokens", "100", *cache)
    assert ok.returncode == 0, ok.stderr[-2000:]
