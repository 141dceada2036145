"""`kvtool rm NAMESPACE` killed half-way (SIGKILL, a real process): segment files go first, several
fan-out directories at once, the index last, so what is left is a namespace whose rows name
missing files, which `validate` repairs (the blocks still on disk stay usable), or which a second
`rm` finishes. Also: the parallel removal never follows a symlink planted in the namespace."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from kvtool.disk.names import INDEX_FILENAME, SUBDIR_RE
from kvtool.disk.namespace import SSDStore
from kvtool.ops.remove import remove_namespace
from kvtool.ops.remove_tree import remove_tree
from kvtool.ops.scan import scan_cache
from kvtool.ops.validate import validate
from tests.store_helpers import free_fan_out, make_chain, make_layout, make_meta, open_store

REPO = Path(__file__).resolve().parent.parent
SEGMENTS = 2000  # one two-block prompt each: ~8 files per fan-out directory


def fan_out(ns_dir: Path) -> list[str]:
    return [n for n in os.listdir(ns_dir) if SUBDIR_RE.match(n)]


@pytest.fixture
def cache(tmp_path):
    """A namespace of `SEGMENTS` segments and another namespace (which nothing may touch)."""
    cache_dir = tmp_path / "kv"
    store = open_store(cache_dir)
    for i in range(SEGMENTS):
        assert store.save_blocks(make_chain(store.layout_key, np.arange(8) + 8 * i, seed=i)) == ["saved"] * 2
    store.close()
    other = SSDStore(cache_dir, make_layout(model_id="other"), make_meta(model_id="other"))
    other.save_blocks(make_chain(other.layout_key, np.arange(8)))
    other.close()
    return cache_dir, store.layout_key, other.layout_key


def kill_mid_rm(cache_dir: Path, namespace: str) -> None:
    """Start `kvtool rm`, SIGKILL it as soon as its first fan-out directory is gone."""
    ns_dir = cache_dir / namespace
    before = len(fan_out(ns_dir))
    proc = subprocess.Popen([sys.executable, "-m", "kvtool.cli.app", "rm", namespace[:12], "--yes", "--cache-dir",
                             str(cache_dir), "--quiet"], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:
        if len(fan_out(ns_dir)) < before:
            proc.send_signal(signal.SIGKILL)
            break
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read() if proc.stderr else ""
    left = fan_out(ns_dir)
    assert 0 < len(left) < before and (ns_dir / INDEX_FILENAME).exists()  # killed half-way: files first, index last


@pytest.mark.slow
def test_validate_repairs_a_namespace_whose_rm_was_killed(cache):
    cache_dir, ns, other = cache
    kill_mid_rm(cache_dir, ns)
    scan = scan_cache(cache_dir, ns)
    assert scan.namespaces[0].usable and scan.namespaces[0].missing  # rows whose files are gone
    files_left = len(scan.namespaces[0].files)
    first = validate(cache_dir, ns)
    rep = first.namespaces[0]
    assert rep.missing_rows_dropped > 0 and rep.corrupt_removed == 0 and rep.orphans_removed == 0
    again = validate(cache_dir, deep=True)
    assert again.problems == 0
    (after,) = [n for n in scan_cache(cache_dir).namespaces if n.name == ns]
    assert len(after.files) == files_left > 0 and after.row_count == 2 * files_left  # what is on disk stays usable
    assert [n.row_count for n in scan_cache(cache_dir).namespaces if n.name == other] == [2]


@pytest.mark.slow
def test_a_second_rm_finishes_a_killed_one(cache):
    cache_dir, ns, other = cache
    kill_mid_rm(cache_dir, ns)
    plan = remove_namespace(cache_dir, ns[:12])
    (p,) = plan.namespaces
    assert p.namespace_removed and p.problems == 0 and not (cache_dir / ns).exists()
    assert [(n.name, n.row_count) for n in scan_cache(cache_dir).namespaces] == [(other, 2)]
    assert validate(cache_dir, deep=True).problems == 0


def test_parallel_removal_never_follows_a_symlink(tmp_path):
    """Symlinks planted as a fan-out directory, as a segment file and as the index: the links under
    kvtool's names go (the link itself), the others are left and listed, what they point at stays."""
    cache_dir = tmp_path / "kv"
    store = open_store(cache_dir)
    for i in range(20):
        store.save_blocks(make_chain(store.layout_key, np.arange(8) + 8 * i, seed=i))
    store.close()
    ns = store.layout_key
    victim = tmp_path / "victim"
    (victim / "sub").mkdir(parents=True)
    (victim / "keep.txt").write_text("keep")
    (victim / "sub" / "keep.txt").write_text("keep")
    ns_dir = cache_dir / ns
    some = sorted(fan_out(ns_dir))[0]
    free = free_fan_out(ns_dir)
    (ns_dir / "zz").symlink_to(victim)  # not a fan-out name
    (ns_dir / free).symlink_to(victim)  # a fan-out name
    (ns_dir / some / ("f" * 32 + ".safetensors")).symlink_to(victim / "keep.txt")
    (ns_dir / some / "deeper").symlink_to(victim / "sub")
    (ns_dir / "index.sqlite-wal").symlink_to(victim / "keep.txt")
    out = remove_tree(cache_dir, ns, workers=8)
    planted = {f"{some}/deeper", "zz", f"{some}/{'f' * 32}.safetensors"}  # links kvtool did not make: left, listed
    assert {f"{some}/deeper", "zz"} <= set(out.left) <= planted and not out.removed
    assert {str(p.relative_to(ns_dir)) for p in ns_dir.rglob("*")} == set(out.left) | {some}
    assert (victim / "keep.txt").read_text() == "keep" and (victim / "sub" / "keep.txt").read_text() == "keep"
