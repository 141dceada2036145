"""Bad input to the model-loading commands ends in one `error:` line and exit 2, never a traceback
or unbounded work (issue 32, findings 7, 8 and 9).

Real subprocesses of the real entry point on the tiny model (head dim 32, context 32768 per its
config.json): a seed out of mx.random.seed's range, KV quantization settings the model's head dim
does not take, a hard open-files limit below mlx-lm's 4096 (set in the child with
`resource.setrlimit`), `--max-tokens` past the context length, prompts past `--max-prompt-tokens`,
a non-finite `--temp`, a fractional `--max-bytes`, and `inspect --json --quiet`.
"""

from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TIMEOUT_S = 180.0  # generous: the machine is shared


def kvtool(*args: str, limit_files: int | None = None, **kw) -> subprocess.CompletedProcess:
    def low_limit() -> None:  # in the child, before exec: as `ulimit -n N` does
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit_files, limit_files))

    return subprocess.run([sys.executable, "-m", "kvtool.cli.app", *args], capture_output=True, text=True, cwd=REPO,
                          timeout=TIMEOUT_S, preexec_fn=low_limit if limit_files else None, **kw)


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
