"""Progress without a terminal: `kvtool warm`, `validate` and `prune` with stderr in a file print
plain progress lines (`kvtool.progress`), at most every `KVTOOL_PROGRESS_INTERVAL_S` seconds
(0 here: a line at every update, so that the lines do not depend on timing)."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from rich.progress import Progress

from kvtool.progress import INTERVAL_ENV, LineProgress, describe_tasks, eta_text, format_eta, interval_s

REPO = Path(__file__).resolve().parent.parent
LINE = re.compile(r"^\[kvtool (\w+) \d+\.\d s\] (done: )?(.+)$")


def kvtool(*args: str, stderr_file: Path, interval: str = "0") -> subprocess.CompletedProcess:
    """Run the CLI with stderr redirected to a file (not a terminal)."""
    with open(stderr_file, "w") as err:
        res = subprocess.run([sys.executable, "-m", "kvtool.cli.app", *args], stdout=subprocess.PIPE, stderr=err,
                             text=True, cwd=REPO, timeout=300, env={**os.environ, INTERVAL_ENV: interval})
    return res


def progress_lines(path: Path, command: str) -> list[tuple[bool, str]]:
    """(closing line?, text) of the progress lines of `command` in a stderr file."""
    out = []
    for line in path.read_text().splitlines():
        m = LINE.match(line)
        if m and m.group(1) == command:
            out.append((m.group(2) is not None, m.group(3)))
    return out


def test_line_progress_prints_at_updates_once_due():
    stream = io.StringIO()
    with LineProgress("kvtool test", interval=0, stream=stream) as bar:
        task = bar.add_task("items", total=3, size="1 KiB")
        for i in range(1, 4):
            bar.update(task, completed=i)
    lines = stream.getvalue().splitlines()
    texts = [LINE.match(x).group(3) for x in lines]
    assert [re.sub(r"ETA \d+ s", "ETA", t) for t in texts] == [
        "items 1/3 | 2 left, ETA | size 1 KiB", "items 2/3 | 1 left, ETA | size 1 KiB", "items 3/3 | size 1 KiB",
        "items 3/3 | size 1 KiB"]
    assert lines[-1].split("] ")[1].startswith("done: ")
    quiet = io.StringIO()
    with LineProgress("kvtool test", interval=3600, stream=quiet) as bar:  # never due: no line, no closing line
        bar.update(bar.add_task("items", total=2), completed=2)
    assert quiet.getvalue() == ""


def test_eta_is_the_mean_item_time_times_the_items_left():
    now = [100.0]
    bar = Progress(disable=True, get_time=lambda: now[0])
    task = bar.add_task("warm", total=10, tokens=5)
    assert describe_tasks(bar.tasks) == "warm 0/10 | tokens 5"  # nothing done yet: no estimate
    now[0] += 12.0
    bar.update(task, completed=4)  # 3 s per prompt so far, 6 left
    assert describe_tasks(bar.tasks) == "warm 4/10 | 6 left, ETA 18 s | tokens 5"
    now[0] += 108.0
    assert eta_text(bar.tasks[0]) == "6 left, ETA 3 min 00 s"  # 120 s for 4: 30 s each
    bar.update(task, completed=10)
    assert eta_text(bar.tasks[0]) is None  # finished
    assert [format_eta(s) for s in (0.4, 59.6, 61, 3600 + 7 * 60 + 20)] == ["0 s", "1 min 00 s", "1 min 01 s", "1 h 07 min"]


def test_interval_setting(monkeypatch):
    monkeypatch.setenv(INTERVAL_ENV, "0.5")
    assert interval_s() == 0.5
    for bad in ("-1", "soon", "nan"):
        monkeypatch.setenv(INTERVAL_ENV, bad)
        assert interval_s() == 10.0
    monkeypatch.delenv(INTERVAL_ENV)
    assert interval_s() == 10.0


@pytest.mark.slow
def test_warm_validate_prune_print_progress_lines_without_a_terminal(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("first prompt about the cache and a few more words here\n"
                       "second prompt, something else entirely about blocks and tokens\n"
                       "a third prompt that is long enough to fill one block of the cache\n")
    cache = tmp_path / "kv"
    res = kvtool("warm", "--model", "tiny", "--cache-dir", str(cache), "--block-size", "8", str(prompts),
                 stderr_file=tmp_path / "warm.err")
    assert res.returncode == 0, (tmp_path / "warm.err").read_text()
    lines = progress_lines(tmp_path / "warm.err", "warm")
    assert [text.split(" | ")[0] for closing, text in lines if not closing] == ["warm 1/3", "warm 2/3", "warm 3/3"]
    assert [text.split(" | ")[1].split(", ETA ")[0] for closing, text in lines if not closing][:2] == ["2 left", "1 left"]
    assert lines[-1][0] and lines[-1][1].startswith("warm 3/3 | tokens ")
    assert "warmed 3/3 prompt(s)" in res.stdout  # the summary is unchanged, on stdout

    res = kvtool("validate", "--cache-dir", str(cache), stderr_file=tmp_path / "validate.err")
    assert res.returncode == 0, (tmp_path / "validate.err").read_text()
    lines = progress_lines(tmp_path / "validate.err", "validate")
    assert lines and lines[-1][0] and re.search(r"validate [0-9a-f]{12} (\d+)/\1", lines[-1][1]), lines
    res = kvtool("validate", "--quiet", "--cache-dir", str(cache), stderr_file=tmp_path / "quiet.err")
    assert res.returncode == 0 and (tmp_path / "quiet.err").read_text() == ""  # --quiet: silent

    res = kvtool("prune", "--max-bytes", "0", "--yes", "--cache-dir", str(cache), stderr_file=tmp_path / "prune.err")
    assert res.returncode == 0, (tmp_path / "prune.err").read_text()
    lines = progress_lines(tmp_path / "prune.err", "prune")
    assert lines and re.fullmatch(r"removing \d+ segment file\(s\)", lines[0][1]) and lines[-1][0], lines

    res = kvtool("warm", "--model", "tiny", "--cache-dir", str(cache), str(prompts), stderr_file=tmp_path / "slow.err",
                 interval="3600")
    assert res.returncode == 0 and progress_lines(tmp_path / "slow.err", "warm") == []  # shorter than the interval
