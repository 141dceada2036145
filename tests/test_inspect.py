"""Tests of kvtool.ops.inspect_cache and `kvtool inspect`: a rendering of the shared scan (documented
JSON keys, ages, chains, health), read-only behaviour, and `--prompt` (the model's own
`PrefixCache.probe` on a read-only store) agreeing with a following `serve-once`."""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from kvtool.cli import app as app_module
from kvtool.config import KVToolConfig
from kvtool.engine import Engine
from kvtool.ops.inspect_cache import AGE_BUCKETS, inspect_cache, render
from kvtool.ops.scan import ScanError, scan_cache
from kvtool.store.index import BlockIndex
from kvtool.store.ssd import SSDStore
from tests.store_helpers import block_path, make_chain, make_layout, make_meta, open_store, segment_files

REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / "kvtool" / "assets" / "demo_prompt.txt"
NOW = time.time() + 60.0  # after the fixture's writes, never before
BS = 64

REPORT_KEYS = {"cache_dir", "now", "namespaces", "totals"}
REPORT_KEYS = REPORT_KEYS | {"symlinks"}
NAMESPACE_KEYS = {
    "namespace", "status", "message", "model_id", "model_name", "model_class", "layout_key", "block_size", "kv_dtype",
    "kv_layers", "n_layers", "n_kv_heads", "head_dim", "format_version", "blocks", "tail_entries", "segments", "bytes",
    "chains", "max_depth", "oldest_access", "newest_access", "age_histogram", "shutdown_clean",
    "shutdown_partial_flush", "created", "last_open", "last_close", "health",
}  # fmt: skip
HEALTH_KEYS = {"rows", "files", "missing_files", "orphan_files", "temp_files", "bad_rows", "symlinks", "ok"}
PROBE_KEYS = {
    "cache_dir", "model", "namespace", "namespace_exists", "block_size", "prompt_tokens", "full_blocks",
    "cached_blocks", "cached_tokens", "reused_tokens", "would_hit",
}  # fmt: skip

if not any(c.name == "inspect" for c in app_module.app.registered_commands):
    app_module._register()
runner = CliRunner()


def run_cli(*args):
    return runner.invoke(app_module.app, ["inspect", *args])


@pytest.fixture
def cache(tmp_path):
    """One namespace with a chain of 4 blocks (one segment file each) and a tail entry (its own
    segment), used 10 min, 2 h, 3 d, 40 d and 40 d before NOW."""
    cache_dir = tmp_path / "kv"
    store = open_store(cache_dir)
    chain = make_chain(store.layout_key, np.arange(18), tail=True)
    for b in chain:
        store.save_block(b)
    store.close()
    ages = [600, 2 * 3600, 3 * 86400, 40 * 86400, 40 * 86400]
    with sqlite3.connect(store.namespace_dir / "index.sqlite") as conn:
        conn.executemany("UPDATE blocks SET last_access=? WHERE hash=?", [(NOW - a, b.block_hash) for a, b in zip(ages, chain)])
    return cache_dir, store, chain


def tree(cache_dir: Path) -> dict:
    """Every file's bytes and every index's meta and rows: inspect must change nothing.
    (Index files are compared by content: closing the last connection checkpoints the WAL.)"""
    out = {str(p.relative_to(cache_dir)): p.read_bytes() for p in sorted(cache_dir.rglob("*"))
           if p.is_file() and not p.name.startswith("index.sqlite")}  # fmt: skip
    for db in sorted(cache_dir.glob("*/index.sqlite")):
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
            out[str(db)] = (conn.execute("SELECT * FROM meta ORDER BY key").fetchall(),
                            conn.execute("SELECT * FROM blocks ORDER BY hash").fetchall())  # fmt: skip
    return out


def test_report_fields_ages_and_health(cache):
    cache_dir, store, chain = cache
    (ns,) = inspect_cache(cache_dir, now=NOW).namespaces
    assert (ns.status, ns.namespace, ns.layout_key, ns.model_name, ns.model_id) == ("ok", store.layout_key, store.layout_key, "test", "test-model")
    assert (ns.block_size, ns.kv_dtype, ns.n_layers, ns.n_kv_heads, ns.head_dim) == (4, "bfloat16", 2, 2, 8)
    assert (ns.kv_layers, ns.format_version, ns.shutdown_clean) == ("2x8x8,2x8x8", "2", True)
    assert (ns.blocks, ns.tail_entries, ns.segments, ns.chains, ns.max_depth) == (5, 1, 5, 1, 4)
    assert ns.bytes == sum(p.stat().st_size for p in segment_files(store))
    assert (ns.oldest_access, ns.newest_access) == (NOW - 40 * 86400, NOW - 600)
    assert ns.age_histogram == {"<1h": 1, "<1d": 1, "<7d": 1, "<30d": 0, "older": 2}
    assert list(ns.age_histogram) == [label for label, _ in AGE_BUCKETS]
    h = ns.health
    assert h.ok and (h.rows, h.files, h.missing_files, h.orphan_files, h.bad_rows, h.symlinks) == (5, 5, 0, 0, 0, 0)
    assert render(scan_cache(cache_dir, now=NOW)) == inspect_cache(cache_dir, now=NOW)  # a rendering of the scan


def test_health_counts_missing_orphan_temp_bad_and_symlinks(cache, tmp_path):
    cache_dir, store, chain = cache
    orphan = make_chain(store.layout_key, np.arange(40, 44))[0]
    live = SSDStore(cache_dir, store.layout_key, make_meta())
    live.save_block(orphan)
    live.close()
    with sqlite3.connect(store.namespace_dir / "index.sqlite") as conn:  # file without row
        conn.execute("DELETE FROM blocks WHERE hash=?", (orphan.block_hash,))
        conn.execute("UPDATE blocks SET num_tokens='many' WHERE hash=?", (chain[2].block_hash,))  # malformed
    block_path(store, chain[3].block_hash).unlink()  # row without file
    seg = block_path(store, chain[0].block_hash)
    (seg.parent / f".{seg.stem}.1.abcdef01.tmp").write_bytes(b"x")
    (seg.parent / "someone-elses.tmp").write_bytes(b"x")  # not a kvtool temp file
    (store.namespace_dir / "ee").symlink_to(tmp_path)
    (ns,) = inspect_cache(cache_dir, now=NOW).namespaces
    h = ns.health
    # orphans: the segment whose row was deleted, and the one only a malformed row names
    assert (h.rows, h.files, h.missing_files, h.orphan_files, h.temp_files, h.bad_rows, h.symlinks, h.ok) == (
        4, 5, 1, 2, 1, 1, 1, False)  # fmt: skip
    res = run_cli("--cache-dir", str(cache_dir))
    assert res.exit_code == 1 and "1 missing files, 2 orphan files" in res.output


def test_cli_json_has_the_documented_keys_and_changes_nothing(cache):
    cache_dir, store, _ = cache
    other = SSDStore(cache_dir, make_layout(model_id="other"), make_meta(model_id="other"))  # open: not clean
    (cache_dir / "notes.txt").write_text("not a namespace")
    before = tree(cache_dir)
    res = run_cli("--cache-dir", str(cache_dir), "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert set(doc) == REPORT_KEYS and doc["totals"] == {"namespaces": 2, "blocks": 5, "bytes": doc["namespaces"][0]["bytes"] + doc["namespaces"][1]["bytes"]}
    for ns in doc["namespaces"]:
        assert set(ns) == NAMESPACE_KEYS and set(ns["health"]) == HEALTH_KEYS
        assert set(ns["age_histogram"]) == {"<1h", "<1d", "<7d", "<30d", "older"}
    by_name = {ns["namespace"]: ns for ns in doc["namespaces"]}
    assert by_name[other.layout_key]["shutdown_clean"] is False and by_name[store.layout_key]["shutdown_clean"] is True
    assert tree(cache_dir) == before
    one = json.loads(run_cli("--cache-dir", str(cache_dir), "--json", "--namespace", store.layout_key[:6]).stdout)
    assert [ns["namespace"] for ns in one["namespaces"]] == [store.layout_key]
    other.close()


def test_unreadable_outdated_and_foreign_namespaces(cache):
    cache_dir, store, _ = cache
    idx = BlockIndex(store.namespace_dir / "index.sqlite")
    idx.set_meta({"format_version": "1"})
    idx.close()
    broken = cache_dir / ("ab" * 16)
    broken.mkdir()
    (broken / "index.sqlite").write_bytes(b"this is not a database at all" * 100)
    by_ns = {ns.namespace: ns for ns in inspect_cache(cache_dir, now=NOW).namespaces}
    assert by_ns[store.layout_key].status == "outdated" and "kvtool prune" in by_ns[store.layout_key].message
    assert by_ns["ab" * 16].status == "unreadable" and "--rebuild-index" in by_ns["ab" * 16].message
    res = run_cli("--cache-dir", str(cache_dir))
    assert res.exit_code == 1 and "unreadable" in res.output
    idx = BlockIndex(store.namespace_dir / "index.sqlite")
    idx.set_meta({"format_version": "2", "block_size": "16"})
    idx.close()
    (ns,) = inspect_cache(cache_dir, store.layout_key, now=NOW).namespaces
    assert ns.status == "foreign" and ns.problem


def test_errors(cache, tmp_path):
    cache_dir, _, _ = cache
    with pytest.raises(ScanError, match="no namespace"):
        inspect_cache(cache_dir, namespace="zz")
    res = run_cli("--cache-dir", str(cache_dir), "--namespace", "zz")
    assert res.exit_code == 2 and "no namespace" in res.output and "Traceback" not in res.output
    res = run_cli("--cache-dir", str(tmp_path / "absent"))
    assert res.exit_code == 2 and "does not exist" in res.output
    res = run_cli("--cache-dir", str(cache_dir), "--prompt", "hi", "--model", str(tmp_path / "nomodel"))
    assert res.exit_code == 2 and "error:" in res.output and "Traceback" not in res.output
    res = run_cli("--cache-dir", str(cache_dir), "--prompt-file", str(tmp_path / "absent.txt"))
    assert res.exit_code == 2 and "absent.txt" in res.output
    res = run_cli("--help")
    assert res.exit_code == 0 and "kvtool inspect --model tiny --prompt-file doc.txt" in res.output


def test_prompt_probe_agrees_with_a_following_serve_once(tmp_path, tiny_model):
    cache_dir = tmp_path / "kv"
    cache_dir.mkdir()
    text = " ".join(DEMO.read_text(encoding="utf-8")[:1500].split())
    args = ["--cache-dir", str(cache_dir), "--block-size", str(BS), "--json"]

    cold = json.loads(run_cli(*args, "--prompt", text).stdout)
    assert set(cold) == PROBE_KEYS and not cold["namespace_exists"] and cold["cached_tokens"] == 0
    assert list(cache_dir.iterdir()) == []  # probing created nothing

    engine = Engine(tiny_model, KVToolConfig(ssd_cache_dir=cache_dir, block_size=BS, ssd_async_writes=False))
    ids = engine.encode(prompt=text, chat_template=True)  # as serve-once and inspect encode a --prompt
    engine.prefill(ids[: 2 * BS + 5])  # only the first two blocks (and a tail of 5 tokens) reach SSD
    engine.close()
    (ns,) = scan_cache(cache_dir).namespaces  # a real model's meta hashes to its namespace name
    assert ns.status == "ok" and ns.meta["model_class"] and ns.meta["libraries"]
    before = tree(cache_dir)
    probe = json.loads(run_cli(*args, "--prompt", text).stdout)
    assert tree(cache_dir) == before  # read-only: no meta update, no reconcile, no touch
    assert probe["namespace_exists"] and probe["would_hit"] and probe["prompt_tokens"] == len(ids)
    assert (probe["cached_blocks"], probe["cached_tokens"]) == (2, 2 * BS) and probe["full_blocks"] == len(ids) // BS

    served = runner.invoke(app_module.app, ["serve-once", "--json", "--prompt", text, "--max-tokens", "2",
                                            "--cache-dir", str(cache_dir), "--block-size", str(BS)])  # fmt: skip
    assert served.exit_code == 0, served.output
    r = json.loads(served.stdout)["requests"][0]
    assert r["ssd_hit_tokens"] == r["cached_tokens"] == probe["reused_tokens"] == probe["cached_tokens"]

    human = run_cli("--cache-dir", str(cache_dir), "--block-size", str(BS), "--prompt", text)
    assert human.exit_code == 0 and f"would hit: {len(ids)} of {len(ids)}" in human.output  # full blocks + tail
    raw = json.loads(run_cli(*args, "--prompt", text, "--ignore-chat-template").stdout)
    assert raw["prompt_tokens"] != len(ids) and raw["namespace"] == probe["namespace"]
