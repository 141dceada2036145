"""Tests of kvtool.ops.inspect_cache and `kvtool inspect`: a rendering of the shared scan (documented
JSON keys, ages, chains, health), read-only behaviour, and `--prompt` (the model's own
`PrefixCache.probe` on a read-only store) agreeing with a following `serve-once`."""

from __future__ import annotations

import json
import os
import sqlite3
import time
from contextlib import closing
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from kvtool.cli import app as app_module
from kvtool.config import KVToolConfig
from kvtool.disk.index import BlockIndex
from kvtool.disk.namespace import SSDStore
from kvtool.disk.segment import FORMAT_VERSION
from kvtool.engine import Engine
from kvtool.hashing import layout_key
from kvtool.ops.inspect_cache import AGE_BUCKETS, inspect_cache, render
from kvtool.ops.scan import ScanError, scan_cache
from tests.store_helpers import block_path, free_fan_out, make_chain, make_layout, make_meta, open_store, segment_files

REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / "kvtool" / "assets" / "demo_prompt.txt"
NOW = time.time() + 60.0  # after the fixture's writes, never before
BS = 64

REPORT_KEYS = {"cache_dir", "now", "namespaces", "totals"}
REPORT_KEYS = REPORT_KEYS | {"symlinks"}
REPORT_KEYS = REPORT_KEYS | {"schema_version", "scanned", "sort", "filter", "limit"}  # added later, none removed (docs/design.md#command-line-contract)
NAMESPACE_KEYS = {
    "namespace", "status", "message", "model_id", "model_name", "model_class", "layout_key", "block_size", "kv_dtype",
    "kv_layers", "n_layers", "n_kv_heads", "head_dim", "format_version", "blocks", "tail_entries", "segments", "bytes",
    "chains", "max_depth", "oldest_access", "newest_access", "age_histogram", "shutdown_clean",
    "shutdown_partial_flush", "created", "last_open", "last_close", "last_used", "health",
}  # fmt: skip
NAMESPACE_KEYS = NAMESPACE_KEYS | {"selfcheck"}  # the self-check verdict (kvtool.cache.selfcheck), added later
NAMESPACE_KEYS = NAMESPACE_KEYS | {"reply_check"}  # the reply probe's verdict (kvtool.cache.reply), added later
HEALTH_KEYS = {"rows", "files", "missing_files", "orphan_files", "temp_files", "bad_rows", "symlinks", "irregular", "ok"}
PROBE_KEYS = {
    "schema_version", "cache_dir", "model", "namespace", "namespace_exists", "block_size", "prompt_tokens", "full_blocks",
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
    with closing(sqlite3.connect(store.namespace_dir / "index.sqlite")) as conn, conn:  # closed: no -wal / -shm left
        conn.executemany("UPDATE blocks SET last_access=? WHERE hash=?", [(NOW - a, b.block_hash) for a, b in zip(ages, chain)])
    return cache_dir, store, chain


def tree(cache_dir: Path) -> dict:
    """Every entry's name (an index's -wal / -shm too), every file's bytes and every index's meta
    and rows: inspect must change nothing and create nothing. (Index files are compared by
    content: closing the last connection checkpoints the WAL. An index without side files is read
    `immutable`, so that this reading creates none either.)"""
    out = {str(p.relative_to(cache_dir)): p.read_bytes() if p.is_file() else None for p in sorted(cache_dir.rglob("*"))
           if not p.name.startswith("index.sqlite")}  # fmt: skip
    out["names"] = sorted(str(p.relative_to(cache_dir)) for p in cache_dir.rglob("*"))
    for db in sorted(cache_dir.glob("*/index.sqlite")):
        quiet = not any(os.path.exists(f"{db}{side}") for side in ("-wal", "-shm", "-journal"))
        with closing(sqlite3.connect(f"file:{db}?{'immutable=1' if quiet else 'mode=ro'}", uri=True)) as conn:
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
    free = free_fan_out(store.namespace_dir)
    (store.namespace_dir / free).symlink_to(tmp_path)
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
    res = run_cli("--cache-dir", str(tmp_path / "absent"), "--create")  # --create: an empty cache
    assert res.exit_code == 0 and "no namespaces" in res.output and (tmp_path / "absent").is_dir()
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
    assert sorted(p.name for p in ns.path.iterdir() if p.is_file()) == ["index.sqlite"]  # the scan created no -wal / -shm
    before = tree(cache_dir)
    probe = json.loads(run_cli(*args, "--prompt", text).stdout)
    assert tree(cache_dir) == before  # read-only: no meta update, no reconcile, no touch, no -wal / -shm
    assert probe["namespace_exists"] and probe["would_hit"] and probe["prompt_tokens"] == len(ids)
    # the 2 blocks and the 5-token tail entry after them (a tail prefix hit, as serve-once gets)
    assert (probe["cached_blocks"], probe["cached_tokens"]) == (2, 2 * BS + 5) and probe["full_blocks"] == len(ids) // BS

    served = runner.invoke(app_module.app, ["serve-once", "--json", "--prompt", text, "--max-tokens", "2",
                                            "--cache-dir", str(cache_dir), "--block-size", str(BS)])  # fmt: skip
    assert served.exit_code == 0, served.output
    r = json.loads(served.stdout)["requests"][0]
    assert r["ssd_hit_tokens"] == r["cached_tokens"] == probe["reused_tokens"] == probe["cached_tokens"]

    human = run_cli("--cache-dir", str(cache_dir), "--block-size", str(BS), "--prompt", text)
    assert human.exit_code == 0 and f"would hit: {len(ids)} of {len(ids)}" in human.output  # full blocks + tail
    raw = json.loads(run_cli(*args, "--prompt", text, "--ignore-chat-template").stdout)
    assert raw["prompt_tokens"] != len(ids) and raw["namespace"] == probe["namespace"]


# ------------------------------------------------------------------ the table
@pytest.fixture
def three(tmp_path):
    """Three namespaces of models 'beta' (3 blocks, used 2 h ago), 'alpha' (1 block, 3 d ago) and
    'gamma' (2 blocks, 10 min ago), model classes from mlx_lm; returns (cache_dir, {model name: layout key})."""
    global NOW  # the table renders ages against the real clock: anchor NOW at this test, not at collection
    NOW = time.time() + 60.0
    cache_dir = tmp_path / "kv"
    keys = {}
    for name, n, age in (("beta", 3, BETA_AGE), ("alpha", 1, ALPHA_AGE), ("gamma", 2, GAMMA_AGE)):
        meta = {**make_meta(model_id=name), "model_name": name, "model_class": f"mlx_lm.models.{name}.Model"}
        key = layout_key(name, meta["kv_layers"], meta["kv_dtype"], BS_TEST, format_version=FORMAT_VERSION,
                         model_class=meta["model_class"])  # fmt: skip
        store = SSDStore(cache_dir, key, meta)
        chain = make_chain(store.layout_key, np.arange(4 * n))
        for b in chain:
            store.save_block(b)
        store.close()
        conn = sqlite3.connect(store.namespace_dir / "index.sqlite")
        with conn:
            conn.execute("UPDATE blocks SET last_access=?", (NOW - age,))
            conn.executemany("UPDATE meta SET value=? WHERE key=?", [(str(NOW - age), k) for k in ("created", "last_open", "last_close")])
        conn.close()
        for index_file in store.namespace_dir.glob("index.sqlite*"):  # the index's last write is a use too
            os.utime(index_file, (NOW - age, NOW - age))
        keys[name] = store.layout_key
    return cache_dir, keys


BS_TEST = 4  # store_helpers.GEOMETRY
BETA_AGE, ALPHA_AGE, GAMMA_AGE = 2 * 3600 + 600, 3 * 86400 + 3600, 690  # before NOW (60 s ahead of the clock)


def names(doc) -> list[str]:
    return [ns["model_name"] for ns in doc["namespaces"]]


def test_table_has_one_row_per_namespace_with_model_name_class_and_last_used(three):
    cache_dir, keys = three
    res = run_cli("--cache-dir", str(cache_dir))
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    header = lines[0].split()
    assert header == ["namespace", "model", "class", "status", "size", "blocks", "segments", "last", "used"]
    rows = [line.split() for line in lines[2:5]]
    assert [r[1] for r in rows] == ["alpha", "beta", "gamma"]  # default: by model name
    assert [r[2] for r in rows] == ["alpha.Model", "beta.Model", "gamma.Model"]  # mlx_lm.models. dropped
    for r, name in zip(rows, ("alpha", "beta", "gamma")):
        assert keys[name].startswith(r[0]) and len(r[0]) >= 8  # a key prefix, not the bare 32-hex hash
        assert r[3] == "ok" and r[-2] == dict(alpha="3d", beta="2h", gamma="10m")[name] and r[-1] == "ago"
    assert [r[6] for r in rows] == ["1", "3", "2"] and [r[7] for r in rows] == ["1", "3", "2"]  # blocks, segments
    assert lines[-1].startswith("3 namespace(s), ") and len(lines) == 6  # header, rule, 3 rows, total
    assert "layout" not in res.stdout  # the details only with --namespace
    detail = run_cli("--cache-dir", str(cache_dir), "--namespace", keys["beta"][:6])
    assert detail.exit_code == 0 and "class mlx_lm.models.beta.Model" in detail.stdout and "ages " in detail.stdout


def test_sort_filter_limit_in_table_and_json(three):
    cache_dir, keys = three
    doc = lambda *a: json.loads(run_cli("--cache-dir", str(cache_dir), "--json", *a).stdout)  # noqa: E731
    assert names(doc()) == ["alpha", "beta", "gamma"]
    assert names(doc("--sort", "size")) == ["beta", "gamma", "alpha"]
    assert names(doc("--sort", "blocks")) == ["beta", "gamma", "alpha"]
    assert names(doc("--sort", "last-used")) == ["gamma", "beta", "alpha"]
    assert names(doc("--sort", "NAME")) == ["alpha", "beta", "gamma"]
    assert names(doc("--filter", "MM")) == ["gamma"]  # model name, case-insensitive
    assert names(doc("--filter", keys["beta"][3:9])) == ["beta"]  # a part of the key
    limited = doc("--sort", "last-used", "--limit", "2")
    assert names(limited) == ["gamma", "beta"] and limited["scanned"] == 3 and limited["totals"]["namespaces"] == 2
    assert (limited["sort"], limited["filter"], limited["limit"]) == ("last-used", None, 2)
    assert limited["totals"]["blocks"] == 5
    last = {ns["model_name"]: ns["last_used"] for ns in doc()["namespaces"]}
    assert last["gamma"] == pytest.approx(NOW - GAMMA_AGE) and last["alpha"] == pytest.approx(NOW - ALPHA_AGE)
    none = run_cli("--cache-dir", str(cache_dir), "--filter", "nothing-like-it")
    assert none.exit_code == 0 and "none of the 3 namespace(s)" in none.stdout
    top = run_cli("--cache-dir", str(cache_dir), "--sort", "size", "--limit", "1")
    assert top.exit_code == 0 and "beta" in top.stdout and "alpha" not in top.stdout and "1 namespace(s) (of 3)" in top.stdout


def test_schema_version_and_bad_selection_options(three):
    cache_dir, _ = three
    doc = json.loads(run_cli("--cache-dir", str(cache_dir), "--json").stdout)
    assert list(doc)[0] == "schema_version" and doc["schema_version"] == 1 and set(doc) == REPORT_KEYS
    for args, needle in [(["--sort", "age"], "'age' is not one of size, last-used, name, blocks"),
                         (["--limit", "-1"], "--limit"),
                         (["--prompt", "hi", "--sort", "size"], "only apply to the cache listing")]:  # fmt: skip
        res = run_cli("--cache-dir", str(cache_dir), *args)
        lines = [line for line in res.stderr.splitlines() if line.strip()]
        assert res.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], res.output


def test_quiet_prints_only_problems(cache, three):
    cache_dir, _ = three
    res = run_cli("--cache-dir", str(cache_dir), "--quiet")
    assert res.exit_code == 0 and res.output == ""
    cache_dir, store, chain = cache
    block_path(store, chain[3].block_hash).unlink()  # row without file
    res = run_cli("--cache-dir", str(cache_dir), "--quiet")
    assert res.exit_code == 1 and res.stdout == "" and "1 missing files" in res.stderr and "kvtool validate" in res.stderr
    res = run_cli("--cache-dir", str(cache_dir), "--quiet", "--json")  # --json keeps its document under --quiet
    assert res.exit_code == 1 and json.loads(res.stdout)["namespaces"] and "1 missing files" in res.stderr


def test_ago_and_short_keys():
    from kvtool.cli.cmd_inspect import SORT_METAVAR, ago, short_keys
    from kvtool.ops.inspect_cache import InspectSort

    assert [ago(NOW - s, NOW) for s in (5, 125, 3 * 3600 + 5, 2 * 86400, 90 * 86400, 800 * 86400)] == [
        "5s ago", "2m ago", "3h ago", "2d ago", "3mo ago", "2y ago"]  # fmt: skip
    assert ago(None, NOW) == "-" and ago(NOW + 100, NOW) == "0s ago"
    a, b, c = "abcdef0123" + "0" * 22, "abcdef0199" + "0" * 22, "ff" * 16
    assert short_keys([a, b, c]) == {a: "abcdef012", b: "abcdef019", c: "ffffffff"}
    assert short_keys([a]) == {a: a[:8]} and short_keys([a, a]) == {a: a[:8]}
    assert SORT_METAVAR == "[" + "|".join(InspectSort) + "]"  # the help lists exactly the sort keys
