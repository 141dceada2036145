"""A running `kvtool serve` whose namespace or cache directory is swapped for a symlink writes
nothing outside its cache (hostile round 3, finding 1).

Real processes: a `kvtool serve` subprocess on the tiny model (blocks of 16 tokens, synchronous
SSD writes, so each answer's blocks are on disk when it returns), real renames and symlinks made
while it runs, the requests over HTTP. Before the fix the server went on creating fan-out
directories and segment files in the symlink's target (its rows went to the old, still-open
index). Now every write and unlink first checks that the namespace and the cache root are still
the directories it opened (device, inode); where they are not, the SSD tier is disabled with its
reason and the server goes on answering from RAM or by prefill.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.test_serve_hostile import get_json, normal_text, server_stats, start_kvtool

pytestmark = pytest.mark.slow

FLAGS = ("--block-size", "16", "--sync")


def ask(n: int) -> dict:
    """A chat request whose prompt no earlier request shares past its first words."""
    text = f"Question {n}: " + " ".join(f"word{n}x{i}" for i in range(40))
    return {"model": "default_model", "max_tokens": 4, "temperature": 0.0, "messages": [{"role": "user", "content": text}]}


def tree(root: Path) -> list[str]:
    """Every entry below `root` (relative paths), symlinks not followed."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def written(server) -> int:
    return int(server_stats(server)["cache"].get("ssd_segments_written", 0))


@pytest.mark.parametrize("swap", ["namespace", "cache root"])
def test_a_swapped_directory_gets_no_file_and_the_server_goes_on(tmp_path, swap):
    server = start_kvtool(tmp_path, "swap", *FLAGS)
    cache = tmp_path / "cache-swap"
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("not kvtool's")
    try:
        first = normal_text(server, ask(0))
        ns = Path(server_stats(server)["namespace_dir"])
        assert ns.parent == cache and written(server) >= 1  # the first answer's blocks are on disk
        if swap == "namespace":
            os.rename(ns, cache / "ns.old")
            (outside / ns.name).mkdir()  # a target that looks like the namespace: the fan-out dirs would go here
            ns.symlink_to(outside / ns.name, target_is_directory=True)
        else:
            os.rename(cache, tmp_path / "cache.old")
            cache.symlink_to(outside, target_is_directory=True)
        before = tree(outside)
        for n in range(1, 7):  # six new prompts, as in the report
            assert normal_text(server, ask(n))
        assert normal_text(server, ask(0)) == first  # same answer (RAM hit or prefill)
        assert tree(outside) == before, tree(outside)  # nothing created (or removed) outside
        assert get_json(server, "/health") == (200, {"status": "ok"})
        reason = server_stats(server)["ssd_disabled_reason"]
        assert reason and "moved or replaced while open" in reason
    finally:
        server.stop()
