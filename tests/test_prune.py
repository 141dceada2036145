"""Tests of kvtool.ops.prune and `kvtool prune`: TTL and LRU at segment granularity, descendants,
outdated namespaces, future access times, dry run, the lock, the CLI contract (cron-safety, exit
codes, JSON), pruning while another process serves, and property tests of the planner."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from kvtool.cli import app as app_module
from kvtool.cli import cmd_prune, removal
from kvtool.disk.chains import build_chain_tree
from kvtool.disk.index import BlockIndex
from kvtool.disk.namespace import SSDStore
from kvtool.hashing import root_parent
from kvtool.ops.prune import (
    LOCK_FILENAME,
    PruneError,
    PruneLocked,
    Segment,
    SegmentPlanner,
    cache_lock,
    execute_prune,
    fit_budget,
    plan_prune,
    prune,
)
from kvtool.ops.scan import ScanError, scan_cache
from kvtool.ops.validate import validate
from tests.store_helpers import (
    block_path,
    index_rows,
    make_chain,
    make_layout,
    make_meta,
    open_store,
    segment_files,
    stored,
)

REPO = Path(__file__).resolve().parent.parent
NOW = time.time()  # reset per test (`_now`): access times must not be in the future
DAY = 86400.0
PROMPTS = (np.arange(16), np.arange(100, 112))  # chains of 4 and 3 blocks (block_size 4)

if not any(c.name == "prune" for c in app_module.app.registered_commands):
    app_module._register()
runner = CliRunner()


@pytest.fixture(autouse=True)
def _now():
    global NOW
    NOW = time.time()


def run_cli(*args, **kw):
    return runner.invoke(app_module.app, ["prune", *args], **kw)


@pytest.fixture
def cache(tmp_path):
    """A closed cache, one namespace, two chains, one segment file per block (so blocks and
    segments coincide); yields (cache_dir, store, chains)."""
    cache_dir = tmp_path / "kv"
    store = open_store(cache_dir)
    chains = [make_chain(store.layout_key, p, "bfloat16", seed=10 * i) for i, p in enumerate(PROMPTS)]
    for chain in chains:
        for b in chain:
            assert store.save_block(b) == "saved"
    store.close()
    return cache_dir, store, chains


def set_access(store, times: dict[str, float]) -> None:
    """Set `last_access` of rows directly in the index (as if used at those times)."""
    with sqlite3.connect(store.namespace_dir / "index.sqlite") as conn:
        conn.executemany("UPDATE blocks SET last_access=? WHERE hash=?", [(t, h) for h, t in times.items()])


def hashes(chain) -> list[str]:
    return [b.block_hash for b in chain]


def sizes(store) -> dict[str, int]:
    """block hash -> bytes of its segment file (one block per segment in `cache`)."""
    return {h: block_path(store, h).stat().st_size for h in stored(store)}


def plan(cache_dir, **kw):
    now = kw.pop("now", NOW)
    return plan_prune(scan_cache(cache_dir, kw.pop("namespace", None), now=now), **kw)


def snapshot(cache_dir: Path) -> tuple[dict, list]:
    files = {str(p.relative_to(cache_dir)): p.read_bytes() for p in sorted(cache_dir.rglob("*"))
             if p.is_file() and not p.name.startswith("index.sqlite")}  # fmt: skip
    rows = []
    for db in sorted(cache_dir.glob("*/index.sqlite")):
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
            rows.append(conn.execute("SELECT * FROM blocks ORDER BY hash").fetchall())
    return files, rows


def assert_consistent(cache_dir: Path, store, chains) -> None:
    """Every kept block is loadable, its parent chain is intact, and validate finds nothing."""
    kept = stored(store)
    for chain in chains:
        present = [b.block_hash in kept for b in chain]
        assert present == sorted(present, reverse=True), "a kept block lost its parent"
    live = SSDStore(cache_dir, store.layout_key, make_meta())
    for chain in chains:
        for b in chain:
            assert (live.load_block(b.block_hash, b.token_ids) is not None) == (b.block_hash in kept)
    live.close()
    assert validate(cache_dir, deep=True).problems == 0


# ------------------------------------------------------------------ planning rules
def test_ttl_removes_old_chains_only(cache):
    cache_dir, store, (old, new) = cache
    set_access(store, {**{h: NOW - 10 * DAY for h in hashes(old)}, **{h: NOW - DAY for h in hashes(new)}})
    p = plan(cache_dir, ttl_s=7 * DAY)
    ns = p.namespaces[0]
    assert (ns.ttl_blocks, ns.lru_blocks, ns.prune_blocks, ns.blocks_after) == (4, 0, 4, 3)
    assert (ns.ttl_segments, ns.prune_segments, ns.segments_after) == (4, 4, 3)
    assert set(ns.hashes) == set(hashes(old))
    paths = [block_path(store, h) for h in hashes(old)]
    execute_prune(p)
    assert stored(store) == set(hashes(new))
    assert ns.rows_deleted == ns.files_deleted == 4 and ns.bytes_freed == ns.prune_bytes > 0
    assert not any(path.exists() for path in paths)
    assert_consistent(cache_dir, store, (old, new))
    # the clock decides: the same cache 2 days later loses the second chain too
    assert plan(cache_dir, ttl_s=7 * DAY, now=NOW + 8 * DAY).namespaces[0].prune_blocks == 3


def test_ttl_uses_the_newest_access_below_a_block(cache):
    """A prefix whose row is stale but whose continuation was just used is in use (its KV was
    needed; e.g. it came from a RAM tier that does not touch SSD rows): kept, as is the chain."""
    cache_dir, store, (old, new) = cache
    set_access(store, {**{h: NOW - 30 * DAY for h in hashes(old)[:3] + hashes(new)}, hashes(old)[3]: NOW - 60.0})
    assert set(plan(cache_dir, ttl_s=7 * DAY).namespaces[0].hashes) == set(hashes(new))


def test_ttl_trims_an_old_tail_and_keeps_the_used_prefix(cache):
    cache_dir, store, (old, new) = cache
    times = {h: NOW for h in hashes(old) + hashes(new)}
    times.update({h: NOW - 10 * DAY for h in hashes(old)[2:]})  # tail unused for 10 days
    set_access(store, times)
    p = prune(cache_dir, ttl_s=7 * DAY, now=NOW)
    assert set(p.namespaces[0].hashes) == set(hashes(old)[2:])
    assert_consistent(cache_dir, store, (old, new))


def test_lru_under_budget_removes_least_recent_leaves_first(cache):
    cache_dir, store, (a, b) = cache
    # chain a used an hour ago, chain b now; within a chain the parent was touched first
    set_access(store, {**{h: NOW - 3600 + i for i, h in enumerate(hashes(a))},
                       **{h: NOW + i for i, h in enumerate(hashes(b))}})  # fmt: skip
    size = sizes(store)
    budget = sum(size.values()) - size[a[3].block_hash] - size[a[2].block_hash]
    ns = plan(cache_dir, max_bytes=budget).namespaces[0]
    assert set(ns.hashes) == set(hashes(a)[2:]) and ns.lru_blocks == ns.lru_segments == 2 and ns.bytes_after == budget
    one = sum(size.values()) - size[a[3].block_hash]
    assert plan(cache_dir, max_bytes=one).namespaces[0].hashes == [a[3].block_hash]
    budget = size[b[0].block_hash] + size[b[1].block_hash]
    p = plan(cache_dir, max_bytes=budget)  # all of a, then b's tail
    assert set(p.namespaces[0].hashes) == set(hashes(a) + hashes(b)[2:])
    execute_prune(p)
    assert stored(store) == set(hashes(b)[:2])
    assert_consistent(cache_dir, store, (a, b))


def test_descendants_of_a_pruned_block_go_too(cache):
    """Shared prefixes: removing a block removes every continuation below it; nothing kept
    ever hangs off a removed block, whatever the access times (random, 20 rounds)."""
    cache_dir, store, chains = cache
    live = SSDStore(cache_dir, store.layout_key, make_meta())
    branch = make_chain(store.layout_key, np.concatenate([np.arange(8), np.arange(50, 58)]), seed=99)
    assert branch[0].block_hash == chains[0][0].block_hash  # shares 2 blocks with chain 0
    for blk in branch[2:]:
        assert live.save_block(blk) == "saved"
    live.close()
    rows = {r.hash: r for r in index_rows(BlockIndex(store.namespace_dir / "index.sqlite", create=False))}
    rng = np.random.default_rng(0)
    for _ in range(20):
        set_access(store, {h: NOW - float(rng.integers(0, 20)) * DAY for h in rows})
        p = plan(cache_dir, ttl_s=float(rng.integers(0, 20)) * DAY, max_bytes=int(rng.integers(0, 12)) * 700)
        gone = set(p.namespaces[0].hashes)
        assert not [h for h, r in rows.items() if h not in gone and r.parent in gone]
        if chains[0][1].block_hash in gone:  # the shared block: both continuations go
            assert set(hashes(chains[0])[2:]) | set(hashes(branch)[2:]) <= gone


def test_a_segment_is_the_unit_of_removal(tmp_path):
    """A segment holding an old block and a recently used one stays whole; a removed block's
    descendant in such a kept segment loses its row, not the file."""
    cache_dir = tmp_path / "kv"
    store = open_store(cache_dir)
    a = make_chain(store.layout_key, np.arange(12))  # a0 a1 a2
    b = make_chain(store.layout_key, np.arange(200, 204), seed=5)  # b0
    store.save_blocks(a[:2])  # segment 1: a0 a1
    store.save_blocks([a[2], b[0]])  # segment 2: a2 (a1's child) and b0
    store.close()
    set_access(store, {a[0].block_hash: NOW - 30 * DAY, a[1].block_hash: NOW - 30 * DAY,
                       a[2].block_hash: NOW - 30 * DAY, b[0].block_hash: NOW})  # fmt: skip
    seg1, seg2 = block_path(store, a[0].block_hash), block_path(store, b[0].block_hash)
    ns = plan(cache_dir, ttl_s=7 * DAY).namespaces[0]
    assert set(ns.hashes) == set(hashes(a)) and ns.segment_names == [seg1.stem]
    assert (ns.ttl_blocks, ns.descendant_blocks, ns.ttl_segments, ns.descendant_segments) == (2, 1, 1, 0)
    assert ns.prune_bytes == seg1.stat().st_size and ns.bytes_after == seg2.stat().st_size
    execute_prune(scan_plan := plan(cache_dir, ttl_s=7 * DAY))
    assert scan_plan.namespaces[0].files_deleted == 1
    assert stored(store) == {b[0].block_hash} and not seg1.exists() and seg2.exists()
    assert validate(cache_dir, deep=True).problems == 0  # the unreferenced record stays unreferenced
    # a used block anywhere in a segment keeps the whole file under the TTL
    set_access(store, {b[0].block_hash: NOW - 30 * DAY})
    assert plan(cache_dir, ttl_s=7 * DAY).namespaces[0].segment_names == [seg2.stem]


def test_future_access_is_clamped_and_cannot_keep_a_chain_forever(cache):
    cache_dir, store, (a, b) = cache
    set_access(store, {**{h: NOW + 100 * DAY for h in hashes(a)}, **{h: NOW - DAY for h in hashes(b)}})
    p = prune(cache_dir, ttl_s=7 * DAY, now=NOW)
    assert p.namespaces[0].access_clamped == 4 and p.namespaces[0].prune_blocks == 0
    assert {r.last_access for r in index_rows(BlockIndex(store.namespace_dir / "index.sqlite", create=False))
            if r.hash in hashes(a)} == {NOW}  # fmt: skip
    later = prune(cache_dir, ttl_s=7 * DAY, now=NOW + 8 * DAY)
    assert set(later.namespaces[0].hashes) == set(hashes(a) + hashes(b)) and stored(store) == set()


def test_outdated_namespace_is_removed_whole_by_ttl(cache, tmp_path):
    cache_dir, store, _ = cache
    old = cache_dir / ("cd" * 16)
    (old / "ab").mkdir(parents=True)
    idx = BlockIndex(old / "index.sqlite")
    idx.set_meta({"format_version": "1", "layout_key": old.name, "model_name": "old"})
    idx.close()
    (old / "ab" / f"{'ab' * 16}.safetensors").write_bytes(b"v1 block" * 100)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("mine")
    (old / "link").symlink_to(outside)
    os.utime(old / "index.sqlite", (NOW - 30 * DAY, NOW - 30 * DAY))
    fresh = plan(cache_dir, ttl_s=60 * DAY)
    assert not [ns for ns in fresh.namespaces if ns.remove_namespace]
    p = prune(cache_dir, ttl_s=7 * DAY, now=NOW)
    by = {ns.namespace: ns for ns in p.namespaces}
    assert by[old.name].status == "outdated" and by[old.name].remove_namespace and by[old.name].bytes_freed >= 800
    # only kvtool's files go: the planted link (not a kvtool name) is left, listed, and keeps the directory
    assert sorted(os.listdir(old)) == ["link"] and by[old.name].left == ["link"]
    assert (outside / "keep.txt").read_text() == "mine"
    assert store.namespace_dir.exists()
    # and the message says so (it said "removed whole" while the directory stayed)
    assert "removed whole" not in by[old.name].message and by[old.name].message.endswith("not kvtool's, left: link")


def test_all_is_one_lru_over_every_namespace(cache):
    cache_dir, store, chains = cache
    other = SSDStore(cache_dir, make_layout(model_id="other"), make_meta(model_id="other"))
    other_chain = make_chain(other.layout_key, np.arange(200, 216))
    for blk in other_chain:
        other.save_block(blk)
    other.close()
    set_access(store, {h: NOW for c in chains for h in hashes(c)})
    set_access(other, {h: NOW - DAY for h in hashes(other_chain)})
    budget = sum(sizes(store).values())
    per_ns = plan(cache_dir, max_bytes=budget)
    assert per_ns.total("prune_blocks") == 0  # each namespace fits on its own
    glob = plan(cache_dir, max_bytes=budget, all_namespaces=True)
    by_ns = {ns.namespace: ns for ns in glob.namespaces}
    assert set(by_ns[other.layout_key].hashes) == set(hashes(other_chain)) and by_ns[store.layout_key].prune_blocks == 0
    assert glob.total("bytes_after") <= budget and glob.scope == "all"
    only = plan(cache_dir, ttl_s=0.0, namespace=other.layout_key[:8])
    assert [ns.namespace for ns in only.namespaces] == [other.layout_key]


def test_dry_run_changes_nothing(cache):
    cache_dir, store, _ = cache
    before = snapshot(cache_dir)
    p = prune(cache_dir, ttl_s=0.0, dry_run=True)
    assert p.total("prune_blocks") == 7 and not p.executed and p.total("rows_deleted") == 0
    res = run_cli("--cache-dir", str(cache_dir), "--ttl", "0s", "--max-bytes", "1", "--dry-run", "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["dry_run"] and not doc["executed"] and doc["totals"]["prune_blocks"] == 7
    assert snapshot(cache_dir) == before and not (cache_dir / LOCK_FILENAME).exists()


def test_errors(cache, tmp_path):
    cache_dir, _, _ = cache
    with pytest.raises(ScanError, match="no namespace"):
        prune(cache_dir, ttl_s=1.0, namespace="zz")
    with pytest.raises(PruneError, match="not both"):
        prune(cache_dir, ttl_s=1.0, namespace="ab", all_namespaces=True)
    with pytest.raises(PruneError, match="does not exist"):
        prune(tmp_path / "absent", ttl_s=1.0)
    with pytest.raises(PruneError, match=">= 0"):
        plan(cache_dir, max_bytes=-1)


# ------------------------------------------------------------------ lock
@pytest.mark.slow
def test_lock_refuses_a_second_prune(cache):
    cache_dir, store, _ = cache
    with cache_lock(cache_dir):
        with pytest.raises(PruneLocked, match=f"pid {os.getpid()}"):
            prune(cache_dir, ttl_s=0.0)
        res = subprocess.run(
            [sys.executable, "-m", "kvtool.cli.app", "prune", "--cache-dir", str(cache_dir), "--ttl", "0s", "--yes"],
            capture_output=True, text=True, cwd=REPO,
        )  # fmt: skip
        assert res.returncode == cmd_prune.EXIT_LOCKED == 3
        assert "another kvtool prune, rm or validate is running" in res.stderr and "Traceback" not in res.stderr
        assert len(stored(store)) == 7
    assert prune(cache_dir, ttl_s=0.0).total("rows_deleted") == 7  # released on exit
    assert (cache_dir / LOCK_FILENAME).exists()


# ------------------------------------------------------------------ CLI
def test_cli_refuses_without_a_terminal_unless_yes(cache):
    cache_dir, store, _ = cache
    res = run_cli("--cache-dir", str(cache_dir), "--ttl", "0s")
    assert res.exit_code == 2 and "--yes" in res.output and len(stored(store)) == 7
    res = run_cli("--cache-dir", str(cache_dir), "--ttl", "0s", "--yes", "--quiet")
    assert res.exit_code == 0 and res.output == "" and stored(store) == set()
    res = run_cli("--cache-dir", str(cache_dir), "--yes", "--quiet")  # nothing left: still quiet
    assert res.exit_code == 0 and res.output == ""


def test_cli_confirmation_on_a_terminal(cache, monkeypatch):
    cache_dir, store, _ = cache
    monkeypatch.setattr(removal, "interactive", lambda: True)
    res = run_cli("--cache-dir", str(cache_dir), "--ttl", "0s", input="n\n")
    assert res.exit_code == 1 and "aborted" in res.output and len(stored(store)) == 7
    res = run_cli("--cache-dir", str(cache_dir), "--ttl", "0s", input="y\n")
    assert res.exit_code == 0 and "pruned 7 block(s)" in res.output and stored(store) == set()


def test_cli_json_schema(cache):
    cache_dir, store, _ = cache
    res = run_cli("--cache-dir", str(cache_dir), "--max-bytes", "2KiB", "--ttl", "none", "--yes", "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert set(doc) == {"schema_version", "cache_dir", "ttl_s", "max_bytes", "scope", "now", "namespaces", "dry_run",
                        "executed", "totals", "problems"}  # fmt: skip
    assert doc["ttl_s"] is None and doc["max_bytes"] == 2048 and doc["scope"] == "namespace" and doc["executed"]
    ns = doc["namespaces"][0]
    assert set(ns) == {
        "namespace", "model_name", "status", "message", "blocks", "segments", "bytes", "ttl_blocks", "ttl_segments",
        "ttl_bytes", "lru_blocks", "lru_segments", "lru_bytes", "descendant_blocks", "descendant_segments",
        "descendant_bytes", "prune_blocks", "prune_segments", "prune_bytes", "blocks_after", "segments_after",
        "bytes_after", "remove_namespace", "by_file_age", "rows_deleted", "files_deleted", "bytes_freed",
        "unlink_failed", "index_failed", "access_clamped", "left",
    }  # fmt: skip
    assert ns["rows_deleted"] == ns["prune_blocks"] == 7 - ns["blocks_after"] and 0 < ns["bytes_after"] <= 2048
    assert doc["totals"]["rows_deleted"] == ns["rows_deleted"] and len(stored(store)) == ns["blocks_after"]
    assert ns["files_deleted"] == ns["prune_segments"] and ns["bytes_freed"] == ns["prune_bytes"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--ttl", "7 days"], "not a duration"),
        (["--max-bytes", "50XB"], "not a size"),
        (["--namespace", "zz", "--yes"], "no namespace"),
        (["--namespace", "ab", "--all", "--yes"], "not both"),
    ],
)
def test_cli_bad_input(cache, args, message):
    cache_dir, _, _ = cache
    res = run_cli("--cache-dir", str(cache_dir), *args)
    assert res.exit_code == 2 and message in res.output and "Traceback" not in res.output


def test_cli_missing_cache_dir_and_help(tmp_path):
    res = run_cli("--cache-dir", str(tmp_path / "absent"), "--yes", "--create")  # --create: an empty cache
    assert res.exit_code == 0 and "nothing to prune" in res.output and (tmp_path / "absent").is_dir()
    res = run_cli("--help")
    assert res.exit_code == 0 and "kvtool prune --ttl 7d --dry-run" in res.output and "crontab" in res.output


# ------------------------------------------------------------------ prune while serving
@pytest.mark.slow
def test_prune_while_another_process_serves(tmp_path, tiny_model):
    """`prune --max-bytes` (tiny budget) runs again and again in this process while
    `kvtool serve-once` answers requests from the same cache in another: no request fails and
    every output equals the uncached one."""
    from kvtool.config import KVToolConfig
    from kvtool.engine import Engine

    bs = 64
    cache_dir = tmp_path / "kv"
    text = (REPO / "kvtool" / "assets" / "demo_prompt.txt").read_text(encoding="utf-8")
    prompts = [text[1200 * i : 1200 * i + 700 + 150 * i] for i in range(3)]  # no shared blocks
    order = [i // 2 % 3 for i in range(12)]  # each prompt twice in a row: the second can hit
    reqs = [{"prompt": prompts[i], "max_tokens": 6} for i in order]
    (tmp_path / "reqs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in reqs))
    ref_engine = Engine(tiny_model, KVToolConfig(ssd_enabled=False, ram_bytes=0, block_size=bs))
    expected = [ref_engine.generate(ref_engine.encode(prompt=p), max_tokens=6).token_ids for p in prompts]
    warm = Engine(tiny_model, KVToolConfig(ssd_cache_dir=cache_dir, block_size=bs, ssd_async_writes=False))
    for p in prompts:
        warm.prefill(warm.encode(prompt=p))
    warm.close()
    per_prompt = sum(f.stat().st_size for f in segment_files(next(cache_dir.iterdir())))

    cmd = [sys.executable, "-m", "kvtool.cli.app", "serve-once", "--requests", str(tmp_path / "reqs.jsonl"), "--json",
           "--cache-dir", str(cache_dir), "--block-size", str(bs), "--ram-bytes", "0", "--ignore-chat-template"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    pruned = rounds = 0
    try:
        while proc.poll() is None:
            p = prune(cache_dir, ttl_s=None, max_bytes=per_prompt // 2)  # about one prompt's segment
            pruned += p.total("rows_deleted")
            rounds += 1
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    doc = json.loads(out)
    assert [r["token_ids"] for r in doc["requests"]] == [expected[i] for i in order]
    assert pruned > 0 and rounds > 1 and any(r["ssd_hit_tokens"] for r in doc["requests"])
    assert doc["stats"]["ssd_load_corrupt"] == 0
    assert validate(cache_dir, deep=True).namespaces[0].corrupt_removed == 0


def test_unreadable_namespace_is_left_alone_and_reported(cache):
    cache_dir, store, _ = cache
    broken = cache_dir / ("ab" * 16)
    broken.mkdir()
    (broken / "index.sqlite").write_bytes(b"this is not a database at all" * 100)
    res = run_cli("--cache-dir", str(cache_dir), "--ttl", "0s", "--yes", "--quiet")
    assert res.exit_code == 1 and "1 problem(s)" in res.output and stored(store) == set()
    assert "1 problem(s): abababab: left alone (unreadable) (run kvtool validate)" in res.output  # --quiet's one line says which
    assert (broken / "index.sqlite").read_bytes().startswith(b"this is not")


def test_a_live_reader_sees_pruned_blocks_as_plain_misses(cache):
    cache_dir, store, (a, b) = cache
    live = SSDStore(cache_dir, store.layout_key, make_meta())  # e.g. a serve-once process
    assert live.count_prefix(hashes(a)) == 4
    set_access(store, {**{h: NOW - 10 * DAY for h in hashes(a)}, **{h: NOW for h in hashes(b)}})
    prune(cache_dir, ttl_s=7 * DAY, now=NOW)
    assert [live.load_block(x.block_hash, x.token_ids) for x in a] == [None] * 4
    assert live.load_block(b[0].block_hash, b[0].token_ids) is not None
    st_ = live.stats()
    assert st_["ssd_load_corrupt"] == st_["ssd_load_fail"] == 0 and st_["ssd_load_miss"] == 4
    assert live.save_block(a[0]) == "saved"  # and it can store the block again
    live.close()
    assert validate(cache_dir, deep=True).problems == 0


# ------------------------------------------------------------------ planner properties
def _h(i: int) -> str:
    return f"{i:032x}"


ROOT = root_parent("f" * 32)


@st.composite
def namespaces(draw):
    """Random blocks (parents among themselves, cycles included, or the root, or absent), random
    segments (sizes, membership), random access times."""
    n = draw(st.integers(0, 24))
    parent_of = st.one_of(st.integers(0, max(n - 1, 0)).map(_h), st.just(ROOT), st.just("e" * 32))
    entries = [(_h(i), draw(parent_of) if n else ROOT, draw(st.floats(0, 100, allow_nan=False))) for i in range(n)]
    n_seg = draw(st.integers(1, max(n, 1)))
    member = [draw(st.integers(0, n_seg - 1)) for _ in range(n)]
    seg_sizes = [draw(st.integers(0, 1000)) for _ in range(n_seg)]
    return entries, member, seg_sizes


def _planner(entries, member, seg_sizes) -> SegmentPlanner:
    tree = build_chain_tree(entries, ROOT)
    blocks: dict[int, list[str]] = {}
    for (h, _, _), m in zip(entries, member):
        blocks.setdefault(m, []).append(h)
    segs = {}
    for m, hs in blocks.items():  # segments hold at least one block
        nodes = [tree.nodes[h] for h in hs]
        segs[_h(m)] = Segment(_h(m), seg_sizes[m], tuple(hs), max(n.effective_access for n in nodes),
                              max(n.depth for n in nodes))  # fmt: skip
    return SegmentPlanner(segs, tree)


@settings(max_examples=300, deadline=None)
@given(namespaces(), st.one_of(st.none(), st.floats(0, 120)), st.one_of(st.none(), st.integers(0, 5000)))
def test_planner_properties(ns, cutoff, budget):
    entries, member, seg_sizes = ns
    p = _planner(entries, member, seg_sizes)
    if cutoff is not None:
        p.apply_ttl(cutoff)
    if budget is not None:
        fit_budget({"ns": p}, budget)
    parent = {h: par for h, par, _ in entries}
    removed, gone = set(p.removed_blocks), set(p.removed_segments)
    # no kept block hangs off a removed one
    assert not [h for h in parent if h not in removed and parent[h] in removed]
    # a segment goes exactly when none of its blocks is kept; kept bytes are the kept files
    for name, seg in p.segments.items():
        assert (name in gone) == all(b in removed for b in seg.blocks)
    assert p.kept_bytes == sum(s.size for n, s in p.segments.items() if n not in gone)
    # budget met
    if budget is not None:
        assert p.kept_bytes <= budget
    # TTL respected: expired segments all go, and a kept segment was used since the cutoff
    if cutoff is not None:
        for name, seg in p.segments.items():
            if seg.access < cutoff:
                assert name in gone
            if name not in gone:
                assert seg.access >= cutoff
    # without a budget, only the TTL and descendants remove anything
    if budget is None:
        for h, why in p.removed_blocks.items():
            assert why in ("ttl", "descendant")
            if why == "descendant":
                assert parent[h] in removed


@settings(max_examples=100, deadline=None)
@given(namespaces(), st.integers(0, 5000))
def test_lru_removes_least_recent_segments_first(ns, budget):
    entries, member, seg_sizes = ns
    p = _planner(entries, member, seg_sizes)
    fit_budget({"ns": p}, budget)
    chosen = [n for n, why in p.removed_segments.items() if why == "lru"]
    if chosen:  # every kept segment was used at least as recently as every segment the LRU chose
        newest_chosen = max(p.segments[n].access for n in chosen)
        assert all(s.access >= newest_chosen for n, s in p.segments.items() if n not in p.removed_segments)
