"""Read-only operator commands leave a cache as they found it: `inspect`, `prune --dry-run` and
`validate --dry-run` create no `-wal` / `-shm` beside an index that had none (`BlockIndex(quiet=
True)`, `kvtool.disk.snapshot.read_quietly`), still see what a live writer committed to its WAL,
and read again when a writer opens or changes the index while they read it. Real SQLite, real
processes."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time
from contextlib import closing
from pathlib import Path

import numpy as np
import pytest

from kvtool.disk.index import BlockIndex
from kvtool.disk.snapshot import read_quietly
from tests.store_helpers import make_chain, open_store

REPO = Path(__file__).resolve().parent.parent
HANG_GUARD_S = 120  # a subprocess that hangs fails the test instead of the suite (not a timing check)
WRITER = """
import sys, time
from contextlib import closing
from pathlib import Path
import numpy as np
from tests.store_helpers import make_chain, open_store
store = open_store(Path(sys.argv[1]))
for b in make_chain(store.layout_key, np.arange(200, 220), "bfloat16", seed=99):
    assert store.save_block(b) == "saved"
store.index.flush()
print("ready", flush=True)
sys.stdin.read()  # holds the index open until the test closes stdin
store.close()
"""


def kvtool(*args: str) -> subprocess.CompletedProcess:
    """The real CLI in a fresh process."""
    return subprocess.run([sys.executable, "-m", "kvtool.cli.app", *args], capture_output=True, text=True, cwd=REPO,
                          timeout=HANG_GUARD_S)  # fmt: skip


def entries(root: Path) -> dict[str, tuple]:
    """Every entry under `root` (side files included): mode, size, mtime in ns, content of files."""
    out = {}
    for p in sorted([root, *root.rglob("*")]):
        st = p.lstat()
        out[str(p.relative_to(root))] = (st.st_mode, st.st_size, st.st_mtime_ns, p.read_bytes() if p.is_file() else None)
    return out


@pytest.fixture
def cache(tmp_path):
    """A closed cache (no process has its index open: no -wal / -shm): (cache_dir, index path)."""
    cache_dir = tmp_path / "kv"
    store = open_store(cache_dir)
    for i, prompt in enumerate((np.arange(16), np.arange(100, 112))):
        for block in make_chain(store.layout_key, prompt, "bfloat16", seed=10 * i):
            assert store.save_block(block) == "saved"
    store.close()
    db = store.namespace_dir / "index.sqlite"
    assert not Path(f"{db}-wal").exists() and not Path(f"{db}-shm").exists()
    return cache_dir, db


@pytest.mark.parametrize("command", [("inspect",), ("inspect", "--json"), ("prune", "--dry-run", "--ttl", "1s"),
                                     ("prune", "--dry-run", "--max-bytes", "1KB", "--json"), ("validate", "--dry-run"),
                                     ("validate", "--dry-run", "--deep", "--json")])  # fmt: skip
def test_read_only_commands_leave_the_cache_as_found(cache, command):
    cache_dir, _ = cache
    before = entries(cache_dir)
    res = kvtool(*command, "--cache-dir", str(cache_dir))
    assert res.returncode == 0, res.stderr
    after = entries(cache_dir)
    assert sorted(set(after) - set(before)) == [], "files created"
    assert after == before


def test_read_only_commands_see_what_a_live_writer_committed_and_create_nothing(cache):
    """A writer holds the index open with rows only in its WAL: `inspect` sees them (`mode=ro`
    through the writer's -wal / -shm), creates no file, and leaves the index file as it was."""
    cache_dir, db = cache
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(cache_dir)], cwd=REPO, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert writer.stdout is not None and writer.stdout.readline().strip() == "ready"
        with closing(sqlite3.connect(f"file:{db}?immutable=1", uri=True)) as conn:  # the index file alone
            (in_file,) = conn.execute("SELECT COUNT(*) FROM blocks").fetchone()
        names, index_bytes = sorted(p.name for p in db.parent.iterdir()), db.read_bytes()
        res = kvtool("inspect", "--json", "--cache-dir", str(cache_dir))
        assert res.returncode == 0, res.stderr
        (ns,) = json.loads(res.stdout)["namespaces"]
        assert ns["blocks"] == in_file + 5 == 12  # the writer's 5 blocks, committed to its WAL only
        assert sorted(p.name for p in db.parent.iterdir()) == names and db.read_bytes() == index_bytes
    finally:
        writer.communicate("", timeout=HANG_GUARD_S)
    assert writer.returncode == 0


@pytest.mark.parametrize("writer_stays", [True, False])
def test_a_quiet_read_is_read_again_when_a_writer_comes_meanwhile(cache, writer_stays):
    """The quiet (`immutable`) read does not see a writer that opens the index after it began: it
    is read again `mode=ro`, whether the writer still holds the index open (its -wal / -shm) or
    committed and closed (its checkpoint changed the file)."""
    _, db = cache
    calls = []

    def read(index: BlockIndex) -> str | None:
        calls.append(index.immutable)
        if len(calls) == 1:
            writer = sqlite3.connect(db, isolation_level=None)
            writer.execute("INSERT OR REPLACE INTO meta(key, value) VALUES ('probe', 'written')")
            if not writer_stays:
                writer.close()
            calls.append(writer)
        return index.get_meta().get("probe")

    try:
        assert read_quietly(db, read) == "written"
        assert calls[0] is True and calls[2] is False  # quiet first, then `mode=ro`
    finally:
        if writer_stays:
            calls[1].close()


def test_a_quiet_read_of_an_index_no_one_changed_is_read_once(cache):
    _, db = cache
    before = entries(db.parent)
    opened = []
    assert read_quietly(db, lambda index: opened.append(index.immutable) or index.totals()[0]) == 7
    assert opened == [True] and entries(db.parent) == before


def test_quiet_opens_mode_ro_where_side_files_exist(cache):
    """With a -wal / -shm beside it (a process has it open, or was killed), a quiet open is `mode=ro`
    (the WAL's commits are seen), and `unchanged` stays True."""
    _, db = cache
    with BlockIndex(db, create=False) as writer:
        writer.set_meta({"probe": "in the wal"})
        assert Path(f"{db}-wal").exists()
        with BlockIndex(db, create=False, read_only=True, quiet=True) as index:
            assert not index.immutable and index.get_meta()["probe"] == "in the wal"
            time.sleep(0.01)
            writer.set_meta({"probe": "again"})
            assert index.unchanged() and index.get_meta()["probe"] == "again"
    with BlockIndex(db, create=False, read_only=True, quiet=True) as index:  # closed cleanly: quiet again
        assert index.immutable and index.get_meta()["probe"] == "again"
        assert not os.path.exists(f"{db}-wal")


def test_prompt_probe_reads_again_when_a_writer_comes_meanwhile(tmp_path, tiny_model):
    """`inspect --prompt`'s store opens its index quietly; a writer that stores more of the prompt
    while it is open is seen: the probe is made again on the index opened `mode=ro`."""
    from kvtool.cli.cmd_inspect import _probe_ssd, read_only_engine
    from kvtool.config import KVToolConfig
    from kvtool.engine import Engine

    bs = 64
    cfg = KVToolConfig(ssd_cache_dir=tmp_path / "kv", block_size=bs, ssd_async_writes=False)
    text = " ".join((REPO / "kvtool" / "assets" / "demo_prompt.txt").read_text(encoding="utf-8")[:1500].split())
    first = Engine(tiny_model, cfg)
    ids = first.encode(prompt=text, chat_template=True)
    first.prefill(ids[:bs])  # one block on SSD
    first.close()
    probe = read_only_engine("tiny", cfg, {})
    try:
        quiet_index = probe.cache.ssd.index
        assert quiet_index.immutable and not Path(f"{quiet_index.path}-wal").exists()
        writer = Engine(tiny_model, cfg)  # stores a second block, and holds the index open
        try:
            writer.prefill(ids[: 2 * bs])
            assert probe.cache.probe(ids) == bs  # the quiet read: the file as it was when opened
            assert _probe_ssd(probe, ids) == 2 * bs  # read again `mode=ro`: the writer's commit
            assert probe.cache.ssd.index is not quiet_index and not probe.cache.ssd.index.immutable
        finally:
            writer.close()
    finally:
        probe.close()
