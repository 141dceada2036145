"""A real process SIGKILLed between the two steps of a write or a removal (`tests.kill_worker`
injects the kill at that point, so it lands there every time), then `kvtool validate`:

- a `prune` or `rm --prompt` killed after committing its row deletions and before unlinking the
  files: `validate` neither crashes on the namespace (empty index, segment files left) nor
  serves the removed blocks again; it finishes the removal;
- a cache killed during its very first write, between the segment file's rename and the commit
  of its rows: `validate` adopts the file's blocks (nothing was asked to be removed).
"""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvtool.disk.names import INDEX_FILENAME
from tests.store_helpers import make_chain, open_store, segment_files, stored

REPO = Path(__file__).resolve().parent.parent
PROMPTS = [np.arange(12) + 100 * i for i in range(4)]  # four chains of 3 blocks (block_size 4), one segment each

pytestmark = pytest.mark.slow


def kill_worker(*args: str) -> None:
    """Run `tests.kill_worker` with `args`; it must die by its own SIGKILL."""
    proc = subprocess.run([sys.executable, "-m", "tests.kill_worker", *args], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, proc.stdout, proc.stderr)


def kvtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvtool.cli.app", *args], cwd=REPO, capture_output=True, text=True, timeout=300)


def validate_json(cache_dir: Path, *extra: str) -> tuple[int, dict]:
    """`kvtool validate --json` as a process: (exit code, its namespace report). No traceback."""
    proc = kvtool("validate", "--cache-dir", str(cache_dir), "--json", *extra)
    assert "Traceback" not in proc.stderr and proc.returncode in (0, 1), (proc.returncode, proc.stderr)
    (ns,) = json.loads(proc.stdout)["namespaces"]
    return proc.returncode, ns


@pytest.fixture
def cache(tmp_path):
    """A namespace holding `PROMPTS`; returns (cache dir, the closed store, the prompts' hashes)."""
    cache_dir = tmp_path / "kv"
    store = open_store(cache_dir)
    chains = []
    for i, ids in enumerate(PROMPTS):
        blocks = make_chain(store.layout_key, ids, seed=10 * i)
        assert store.save_blocks(blocks) == ["saved"] * 3
        chains.append([b.block_hash for b in blocks])
    store.close()
    return cache_dir, store, chains


def test_validate_after_a_prune_killed_between_rows_and_files(cache):
    """Hostile round 3, finding 3: every row deleted and committed, every file left: `validate` used to
    crash (IndexError) on the empty index. Now it repairs it, and a second run finds it clean."""
    cache_dir, store, _ = cache
    files = segment_files(store)
    kill_worker("unlink", str(cache_dir), "prune", "--max-bytes", "0", "--yes", "--quiet")
    assert stored(store) == set() and segment_files(store) == files  # the state a kill there leaves
    code, ns = validate_json(cache_dir)
    assert ns["outcome"] == "repaired" and code == 1
    code, ns = validate_json(cache_dir, "--deep")
    assert code == 0 and ns["problems"] == 0


def test_validate_adopts_a_first_write_killed_before_its_commit(tmp_path):
    """Hostile round 3, finding 3: killed during the cache's very first write, after the segment file's
    rename, before its rows' commit: `validate` adopts its blocks (and used to crash)."""
    cache_dir = tmp_path / "kv"
    kill_worker("first-write", str(cache_dir))
    store = open_store(cache_dir)
    store.close()
    assert stored(store) == set() and len(segment_files(store)) == 1 and (store.namespace_dir / INDEX_FILENAME).exists()
    code, ns = validate_json(cache_dir)
    assert code == 1 and ns["orphans_adopted"] == 2
    code, ns = validate_json(cache_dir, "--deep")
    assert code == 0 and ns["problems"] == 0
    assert stored(store) == {b.block_hash for b in make_chain(store.layout_key, np.arange(8))}


def journal(store) -> list[str]:
    """The index's removal journal (raw read; [] without one)."""
    with sqlite3.connect(store.namespace_dir / INDEX_FILENAME) as conn:
        if conn.execute("SELECT 1 FROM sqlite_master WHERE name='removals'").fetchone() is None:
            return []
        return [r[0] for r in conn.execute("SELECT name FROM removals ORDER BY name")]


def test_a_prune_killed_before_its_unlinks_is_finished_by_validate(cache):
    """Hostile round 3, finding 4: rows deleted and committed, files left: the next `validate` removes
    the files (it used to re-adopt them and serve the pruned blocks again)."""
    cache_dir, store, _ = cache
    files = segment_files(store)
    kill_worker("unlink", str(cache_dir), "prune", "--max-bytes", "0", "--yes", "--quiet")
    assert stored(store) == set() and segment_files(store) == files
    recorded = journal(store)  # with the rows' deletion, in the same transaction
    code, ns = validate_json(cache_dir)
    assert stored(store) == set() and segment_files(store) == []  # not re-adopted: finished
    assert code == 1 and ns["removals_finished"] == len(files) and ns["orphans_adopted"] == 0
    assert recorded == sorted(p.stem for p in files) and journal(store) == []
    code, ns = validate_json(cache_dir, "--deep")
    assert code == 0 and ns["problems"] == 0 and stored(store) == set()


def test_an_rm_prompt_killed_before_its_unlinks_stays_removed(cache):
    """Hostile round 3, finding 4: `rm --prompt` of one prompt killed between its rows' commit and its
    unlinks; `validate` finishes it: that prompt's blocks stay removed, the others are intact."""
    cache_dir, store, chains = cache
    gone, kept = chains[1], [h for i, c in enumerate(chains) if i != 1 for h in c]
    kill_worker("rm-prompt", str(cache_dir), *gone)
    assert stored(store) == set(kept) and len(segment_files(store)) == len(PROMPTS)
    code, ns = validate_json(cache_dir, "--deep")
    assert stored(store) == set(kept) and len(segment_files(store)) == len(PROMPTS) - 1  # not re-adopted
    assert code == 1 and ns["removals_finished"] == 1 and ns["orphans_adopted"] == 0 and journal(store) == []
    code, ns = validate_json(cache_dir, "--deep")
    assert code == 0 and ns["problems"] == 0 and stored(store) == set(kept)
    reopened = open_store(cache_dir)
    try:
        assert reopened.count_prefix(gone) == 0 and all(reopened.count_prefix(c) == 3 for i, c in enumerate(chains) if i != 1)
    finally:
        reopened.close()


def test_a_rebuild_honours_the_removal_journal_too(cache):
    """A prune killed after its rows' commit, then the index loses its meta (an `uninitialized`
    namespace, rebuilt from its files by `validate --rebuild-index`): the journaled files are
    removed, never recovered."""
    cache_dir, store, _ = cache
    files = segment_files(store)
    kill_worker("unlink", str(cache_dir), "prune", "--max-bytes", "0", "--yes", "--quiet")
    with sqlite3.connect(store.namespace_dir / INDEX_FILENAME) as conn:
        conn.execute("DELETE FROM meta")
    code, ns = validate_json(cache_dir, "--rebuild-index")
    assert ns["index_rebuilt"] and ns["blocks_recovered"] == 0 and ns["removals_finished"] == len(files), ns
    assert segment_files(store) == [] and stored(store) == set()
