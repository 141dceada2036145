"""The threat model (docs/design.md#threat-model) for the operator commands (`validate`, `prune`, `inspect`): nothing planted in a cache
directory can make them read, write or delete outside it, a hostile index cannot crash them,
and `prune` frees a 100%-full disk.

Every test watches a *sibling* directory of the cache (where a planted link or a traversal name
points) and asserts it is byte-for-byte unchanged afterwards.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from kvtool.cli import app as app_module
from kvtool.disk.index import BlockIndex
from kvtool.disk.lock import PruneError, cache_lock
from kvtool.disk.namespace import SSDStore
from kvtool.ops.inspect_cache import inspect_cache
from kvtool.ops.prune import prune
from kvtool.ops.scan import scan_cache
from kvtool.ops.validate import validate
from tests.store_helpers import block_path, index_rows, make_chain, make_meta, mounted_tmpfs, open_store, segment_files

REPO = Path(__file__).resolve().parent.parent
if not any(c.name == "prune" for c in app_module.app.registered_commands):
    app_module._register()
runner = CliRunner()


def state(root: Path) -> dict:
    """Every entry below `root` (links not followed): file bytes, link targets, directories."""
    out = {}
    for d, dirs, files in os.walk(root, followlinks=False):
        for name in dirs + files:
            p = Path(d) / name
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = ("link", os.readlink(p))
            elif p.is_dir():
                out[rel] = ("dir",)
            else:
                out[rel] = ("file", p.read_bytes())
    return out


@pytest.fixture
def world(tmp_path):
    """`tmp/kv` (a cache with one namespace: a chain of 4 blocks, one segment each, and a chain of
    3 in one segment) and `tmp/sibling` (someone else's files, e.g. a model)."""
    cache_dir = tmp_path / "kv"
    store = open_store(cache_dir)
    a = make_chain(store.layout_key, np.arange(16))
    b = make_chain(store.layout_key, np.arange(100, 112), seed=9)
    for blk in a:
        store.save_block(blk)
    store.save_blocks(b)
    store.close()
    sibling = tmp_path / "sibling"
    (sibling / "victim").mkdir(parents=True)
    (sibling / "victim" / "model.safetensors").write_bytes(b"precious weights")
    return cache_dir, store, (a, b), sibling


def run_everything(cache_dir: Path) -> None:
    """Every operator entry point, dry and real, in process and through the CLI."""
    scan_cache(cache_dir)
    inspect_cache(cache_dir)
    validate(cache_dir, deep=True, dry_run=True)
    validate(cache_dir, deep=True, rebuild_index=True)
    prune(cache_dir, ttl_s=0.0, dry_run=True)
    prune(cache_dir, ttl_s=0.0)
    for args in (["inspect", "--json"], ["validate", "--deep", "--json"], ["prune", "--ttl", "0s", "--yes", "--json"]):
        res = runner.invoke(app_module.app, [*args, "--cache-dir", str(cache_dir)])
        assert res.exit_code in (0, 1), res.output
        assert "Traceback" not in res.output


# ------------------------------------------------------------------ the lock
def test_symlinked_lock_is_refused_and_its_target_untouched(world):
    cache_dir, store, _, sibling = world
    victim = sibling / "victim" / "model.safetensors"
    (cache_dir / ".prune.lock").symlink_to(victim)
    before = state(sibling)
    with pytest.raises(PruneError, match="symlink"):
        prune(cache_dir, ttl_s=0.0)
    res = runner.invoke(app_module.app, ["prune", "--cache-dir", str(cache_dir), "--ttl", "0s", "--yes"])
    assert res.exit_code == 2 and "symlink" in res.output and "Traceback" not in res.output
    assert state(sibling) == before and len(scan_cache(cache_dir).namespaces[0].rows) == 7


def test_dangling_lock_link_creates_nothing(world):
    cache_dir, _, _, sibling = world
    target = sibling / "created-by-root"
    (cache_dir / ".prune.lock").symlink_to(target)
    with pytest.raises(PruneError):
        prune(cache_dir, ttl_s=0.0)
    assert not target.exists() and not target.is_symlink()


def test_hard_linked_or_special_lock_is_refused(world):
    cache_dir, _, _, sibling = world
    victim = sibling / "victim" / "model.safetensors"
    os.link(victim, cache_dir / ".prune.lock")
    with pytest.raises(PruneError, match="single link"):
        prune(cache_dir, ttl_s=0.0)
    assert victim.read_bytes() == b"precious weights"
    (cache_dir / ".prune.lock").unlink()
    os.mkfifo(cache_dir / ".prune.lock")
    with pytest.raises(PruneError, match="not a regular file"):
        prune(cache_dir, ttl_s=0.0)


def test_lock_writes_the_pid_in_place(world):
    cache_dir, _, _, _ = world
    with cache_lock(cache_dir) as path:
        assert path.read_text().split() == [str(os.getpid())]
        assert path.stat().st_size == 32
    with cache_lock(cache_dir):  # re-used, never truncated
        assert (cache_dir / ".prune.lock").stat().st_size == 32


# ------------------------------------------------------------------ hostile rows
TRAVERSALS = ["../../sibling/victim/model", "../sibling/victim/model", "//{sibling}/victim/model", "{sibling}/victim/model"]


@pytest.mark.parametrize("column", ["hash", "segment", "parent"])
@pytest.mark.parametrize("value", TRAVERSALS)
def test_traversal_and_absolute_names_in_rows_touch_nothing_outside(world, column, value):
    cache_dir, store, (a, b), sibling = world
    value = value.format(sibling=sibling)
    for suffix in ("", ".safetensors"):  # where a naive `ns / v[:2] / f"{v}.safetensors"` would land
        naive = Path(os.path.normpath(store.namespace_dir / value[:2] / f"{value}{suffix}"))
        if str(naive).startswith(str(sibling)):
            naive.parent.mkdir(parents=True, exist_ok=True)
            naive.write_bytes(b"precious")
    with sqlite3.connect(store.namespace_dir / "index.sqlite") as conn:
        conn.execute(f"UPDATE blocks SET {column}=? WHERE hash=?", (value, a[3].block_hash))
        conn.execute("UPDATE segments SET name=? WHERE name=?", (value, block_path(store, b[0].block_hash).stem))
    before = state(sibling)
    ns = scan_cache(cache_dir).namespaces[0]
    assert len(ns.bad_rows) == 1 and len(ns.bad_segment_rows) == 1
    run_everything(cache_dir)
    assert state(sibling) == before


def test_null_and_wrongly_typed_rows_are_reported_and_dropped(world):
    """A NULL hash (possible in an index whose schema lacks NOT NULL) or a text
    `nbytes`/`last_access` crashed prune and inspect. They are reported and dropped; the blocks
    whose records verify are re-adopted."""
    cache_dir, store, (a, b), sibling = world
    with sqlite3.connect(store.namespace_dir / "index.sqlite") as conn:
        cols = "hash, parent, segment, slot, num_tokens, nbytes, tokens_digest, created, last_access"
        conn.executescript(f"""
            ALTER TABLE blocks RENAME TO old_blocks;
            CREATE TABLE blocks (hash TEXT PRIMARY KEY, parent TEXT, segment TEXT, slot INTEGER,
                num_tokens INTEGER, nbytes INTEGER, tokens_digest TEXT, created REAL, last_access REAL);
            INSERT INTO blocks SELECT {cols} FROM old_blocks;
            DROP TABLE old_blocks;
        """)
        conn.execute("INSERT INTO blocks VALUES (NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL)")
        conn.execute("UPDATE blocks SET nbytes='big' WHERE hash=?", (a[1].block_hash,))
        conn.execute("UPDATE blocks SET last_access='yesterday' WHERE hash=?", (b[0].block_hash,))
        conn.execute("UPDATE blocks SET slot=-3 WHERE hash=?", (b[2].block_hash,))
    ns = scan_cache(cache_dir).namespaces[0]
    assert len(ns.bad_rows) == 4 and len(ns.rows) == 4
    report = inspect_cache(cache_dir).namespaces[0]
    assert report.health.bad_rows == 4 and not report.health.ok
    assert prune(cache_dir, ttl_s=None, max_bytes=None).problems == 0  # plans around them, no crash
    rep = validate(cache_dir).namespaces[0]
    assert rep.bad_rows_dropped == 4 and rep.corrupt_removed == rep.broken_chain_removed == 0, rep.details
    assert rep.orphans_adopted == 3  # a[1], b[0] and b[2] come back from their verified records
    assert validate(cache_dir, deep=True).problems == 0
    live = SSDStore(cache_dir, store.layout_key, make_meta())
    assert all(live.load_block(x.block_hash, x.token_ids) is not None for x in a + b)
    live.close()


# ------------------------------------------------------------------ symlinks inside the cache
def test_symlinked_fan_out_directory_is_never_followed(world):
    cache_dir, store, (a, b), sibling = world
    seg = block_path(store, a[3].block_hash)  # a leaf's own segment
    fan = sibling / "fan"
    fan.mkdir()
    sub = seg.parent
    for p in sub.iterdir():  # move the real fan-out dir's files out, link it instead
        os.replace(p, fan / p.name)
    (fan / f".{'ab' * 16}.4194305.deadbeef.tmp").write_bytes(b"someone's temp")  # looks like ours
    sub.rmdir()
    sub.symlink_to(fan)
    before = state(sibling)
    ns = scan_cache(cache_dir).namespaces[0]
    assert sub.name in ns.symlinks and seg.stem not in ns.files and ns.temps == ()
    rep = validate(cache_dir).namespaces[0]
    assert rep.symlinks == [sub.name] and rep.problems >= 1
    run_everything(cache_dir)
    assert state(sibling) == before and sub.is_symlink()


def test_a_symlinked_segment_file_is_reported_once_not_as_a_failed_unlink(world):
    cache_dir, store, (a, _), sibling = world
    seg = block_path(store, a[3].block_hash)  # a leaf's own segment, moved outside and linked back
    os.replace(seg, sibling / seg.name)
    seg.symlink_to(sibling / seg.name)
    before = state(sibling)
    rel = f"{seg.parent.name}/{seg.name}"
    rep = validate(cache_dir).namespaces[0]
    assert rep.symlinks == [rel] and rep.missing_rows_dropped == 1
    assert any(d.endswith(f"segment {seg.stem} is a symlink (never followed)") for d in rep.details), rep.details
    assert rep.unlink_failed == 0 and rep.problems == 2, rep.details  # was: 2 unlink failures of that one link
    again = validate(cache_dir).namespaces[0]
    assert again.symlinks == [rel] and again.problems == 1 and again.unlink_failed == 0
    assert state(sibling) == before and seg.is_symlink()


def test_symlinked_namespace_is_reported_and_never_followed(world):
    cache_dir, store, _, sibling = world
    os.rename(store.namespace_dir, sibling / "ns")  # a whole namespace, outside
    (cache_dir / store.layout_key).symlink_to(sibling / "ns")
    before = state(sibling)
    scan = scan_cache(cache_dir)
    assert scan.namespaces == () and scan.symlinks == (store.layout_key,)
    assert validate(cache_dir).problems == 1  # reported
    run_everything(cache_dir)
    assert state(sibling) == before


def test_only_kvtool_temp_names_are_temp_files(world):
    cache_dir, store, (a, _), _ = world
    sub = block_path(store, a[0].block_hash).parent
    mine = sub / f".{'cd' * 16}.4194305.deadbeef.tmp"
    mine.write_bytes(b"leftover")
    foreign = [sub / "notes.tmp", sub / ".x.1.y.tmp", store.namespace_dir / "backup.tmp"]
    for p in foreign:
        p.write_bytes(b"keep me")
    rep = validate(cache_dir).namespaces[0]
    assert rep.temp_removed == 1 and not mine.exists()
    assert all(p.read_bytes() == b"keep me" for p in foreign)


def test_symlinked_index_files_are_never_opened(world):
    cache_dir, store, _, sibling = world
    victim = sibling / "victim" / "model.safetensors"
    for suffix in ("-wal", "-shm"):
        Path(f"{store.namespace_dir / 'index.sqlite'}{suffix}").unlink(missing_ok=True)
    os.symlink(victim, f"{store.namespace_dir / 'index.sqlite'}-wal")
    before = state(sibling)
    assert scan_cache(cache_dir).namespaces[0].cause == "link"
    run_everything(cache_dir)
    assert state(sibling) == before


# ------------------------------------------------------------------ full disk
@pytest.fixture
def small_disk(tmp_path):
    """A 4 MiB tmpfs (the suite runs as root); unmounted afterwards."""
    with mounted_tmpfs(tmp_path / f"disk-{uuid.uuid4().hex[:6]}", "4m") as mnt:
        yield mnt


def fill(cache_dir: Path, close_first: bool) -> SSDStore:
    """Write segments, then fill what is left of the disk with a filler file. `close_first`: the
    store closes cleanly first (its WAL checkpointed away: SQLite then cannot open the index for
    writing on the full disk, only read it `immutable`); else it writes until the disk is full and
    closes after the filler."""
    store = open_store(cache_dir, dtype="float32", segment_max_bytes=256 << 10)
    for i in range(400):
        if close_first and os.statvfs(cache_dir).f_bavail * os.statvfs(cache_dir).f_frsize < 1 << 20:
            break  # leave room for the checkpoint of a clean close (a full disk keeps the WAL)
        chain = make_chain(store.layout_key, np.arange(1000 * i, 1000 * i + 64), "float32", seed=i)
        if "error" in store.save_blocks(chain):
            break
    if close_first:
        store.close()
        assert not Path(f"{store.namespace_dir / 'index.sqlite'}-wal").exists(), "the clean close kept its WAL"
    try:
        with open(cache_dir / "filler", "wb") as f:
            while True:
                f.write(b"x" * 4096)
                f.flush()
    except OSError:
        pass
    assert os.statvfs(cache_dir).f_bavail == 0, "the disk is not full"
    if not close_first:
        store.close()
    return store


@pytest.mark.parametrize("close_first", [False, True], ids=["index-opens", "index-write-needs-space"])
@pytest.mark.slow
def test_prune_frees_a_full_disk(small_disk, close_first):
    """Prune could not free a 100%-full disk (ENOSPC writing its pid; SQLite could not
    open the index). Now: the lock is taken without writing, and the index's rows are deleted
    after the files when the index itself needs space. A closed index is still read, by rows: the
    scan opens it `immutable` (no -wal / -shm to create), so the plan is by rows, not file age."""
    cache_dir = small_disk / "kv"
    store = fill(cache_dir, close_first)
    n_files = len(segment_files(store))
    res = subprocess.run(
        [sys.executable, "-m", "kvtool.cli.app", "prune", "--cache-dir", str(cache_dir), "--ttl", "none",
         "--max-bytes", "200KB", "--yes", "--json"],
        capture_output=True, text=True, cwd=REPO, timeout=120,
    )  # fmt: skip
    assert "Traceback" not in res.stderr, res.stderr
    doc = json.loads(res.stdout)
    ns = doc["namespaces"][0]
    assert ns["bytes_freed"] > 0 and ns["files_deleted"] > 0 and ns["unlink_failed"] == 0, ns
    assert not ns["by_file_age"]
    if close_first:  # the rows' write needed space: files first, then the rows
        assert "segment files removed before their rows" in ns["message"] and ns["rows_deleted"] > 0, ns
    assert os.statvfs(cache_dir).f_bavail * os.statvfs(cache_dir).f_frsize >= ns["bytes_freed"] // 2
    assert len(segment_files(store)) == n_files - ns["files_deleted"]
    (cache_dir / "filler").unlink()
    rep = validate(cache_dir).namespaces[0]  # rows and files agree again (rows of removed files go)
    assert rep.corrupt_removed == rep.broken_chain_removed == rep.orphans_removed == 0, rep.details
    assert validate(cache_dir).problems == 0
    idx = BlockIndex(store.namespace_dir / "index.sqlite", create=False)
    try:
        assert {r.segment for r in index_rows(idx)} == {p.stem for p in segment_files(store)}
    finally:
        idx.close()
