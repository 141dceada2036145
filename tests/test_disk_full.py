"""Disk-full soak (docs/design.md#failure-isolation): a cache on a small tmpfs filled to 100 %.

serve-once still answers with the exact output (writes fail and are counted, no temp file or
orphan segment is left), warm reports its failed blocks without a traceback, validate runs, and
prune frees the cache's space. Needs root (mount); skipped with the reason where mount is refused.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from tests.store_helpers import mounted_tmpfs

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "kvtool" / "assets" / "demo_prompt.txt"


def _cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvtool.cli.app", *args]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(_cmd(*args), capture_output=True, text=True, cwd=REPO, timeout=300)


@pytest.fixture
def tmpfs(tmp_path):
    with mounted_tmpfs(tmp_path / "mnt", "8m") as mnt:
        yield mnt


def _fill(mnt: Path) -> None:
    """Fill the file system to the last byte with a file outside the cache directory."""
    fd = os.open(mnt / "filler", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        for size in (1 << 16, 4096, 512, 1):
            while True:
                try:
                    os.write(fd, b"\0" * size)
                except OSError:
                    break
    finally:
        os.close(fd)
    assert os.statvfs(mnt).f_bavail == 0


def _segments_without_rows(cache: Path) -> list[Path]:
    orphans = []
    for db in cache.glob("*/index.sqlite"):
        names = {r[0] for r in sqlite3.connect(f"file:{db}?mode=ro", uri=True).execute("SELECT name FROM segments")}
        orphans += [p for p in db.parent.glob("*/*.safetensors") if p.stem not in names]
    return orphans


@pytest.mark.slow
def test_full_disk_serve_warm_validate_prune(tmpfs, tmp_path):
    text = DEMO.read_text(encoding="utf-8")
    first, second = tmp_path / "a.txt", tmp_path / "b.txt"
    first.write_text(text[:1200], encoding="utf-8")
    second.write_text(text[3000:4400], encoding="utf-8")
    cache = tmpfs / "kv"
    ref = run("serve-once", "--json", "--prompt-file", str(second), "--max-tokens", "6", "--no-ssd", "--cache-dir", str(tmp_path / "r"))
    assert ref.returncode == 0, ref.stderr
    expected = json.loads(ref.stdout)["requests"][0]["token_ids"]

    ok = run("serve-once", "--json", "--prompt-file", str(first), "--max-tokens", "2", "--cache-dir", str(cache))
    assert ok.returncode == 0, ok.stderr
    _fill(tmpfs)

    served = run("serve-once", "--json", "--prompt-file", str(second), "--max-tokens", "6", "--cache-dir", str(cache), "--sync")
    assert served.returncode == 0, served.stderr
    doc = json.loads(served.stdout)
    assert doc["requests"][0]["token_ids"] == expected
    assert doc["stats"]["ssd_save_fail"] + doc["stats"]["writer_save_fail"] > 0 or doc["ssd_disabled_reason"]
    os.truncate(tmpfs / "filler", max(0, (tmpfs / "filler").stat().st_size - (1 << 20)))  # room to read SQLite
    assert not list(cache.rglob("*.tmp")) and not _segments_without_rows(cache)
    _fill(tmpfs)

    warmed = run("warm", "--json", "--whole", str(second), "--cache-dir", str(cache))
    assert warmed.returncode in (1, 2) and "Traceback" not in warmed.stderr, warmed.stderr

    checked = run("validate", "--json", "--cache-dir", str(cache))
    assert checked.returncode in (0, 1) and "Traceback" not in checked.stderr, checked.stderr

    pruned = run("prune", "--yes", "--json", "--max-bytes", "0", "--cache-dir", str(cache))
    assert pruned.returncode == 0 and "Traceback" not in pruned.stderr, pruned.stdout + pruned.stderr
    assert not list(cache.glob("*/*/*.safetensors"))  # the cache's space is free again
    assert os.statvfs(tmpfs).f_bavail > 0
