"""Tests of kvtool.ops.validate (plan_repairs + execute) and `kvtool validate` on real segment
caches: every damage kind is found by a dry run and repaired by a run, a second run is clean,
and no block that verifies is ever lost (repair without loss: docs/operations.md)."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import typer
from typer.testing import CliRunner

from kvtool.cli import cmd_validate
from kvtool.disk.lock import LOCK_FILENAME, PruneLocked
from kvtool.disk.namespace import SSDStore
from kvtool.ops.prune import prune
from kvtool.ops.scan import ScanError, scan_cache
from kvtool.ops.validate import REPAIRS, execute, plan_repairs, validate
from tests.store_helpers import (
    block_path,
    encode_segment,
    flip_record_byte,
    make_chain,
    make_layout,
    make_meta,
    open_store,
    segment_files,
    segment_name,
    segment_path,
    stored,
)

NOW_SKEW = 10 * 86400.0
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def cache(tmp_path):
    """A closed cache, one namespace: chain A (4 blocks + tail entry, one segment) and chain B
    (3 blocks, one segment each). Yields (cache_dir, store, (A, B))."""
    cache_dir = tmp_path / "kv"
    store = open_store(cache_dir)
    a = make_chain(store.layout_key, np.arange(18), tail=True)
    b = make_chain(store.layout_key, np.arange(100, 112), seed=10)
    assert set(store.save_blocks(a)) == {"saved"}
    for blk in b:
        assert store.save_block(blk) == "saved"
    store.close()
    return cache_dir, store, (a, b)


def sql(store, statement: str, params=()) -> None:
    with sqlite3.connect(store.namespace_dir / "index.sqlite") as conn:
        conn.execute(statement, params)


def raw_rows(cache_dir: Path) -> list:
    out = []
    for db in sorted(cache_dir.glob("*/index.sqlite")):
        try:
            with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
                out.append((conn.execute("SELECT * FROM meta ORDER BY key").fetchall(),
                            conn.execute("SELECT * FROM blocks ORDER BY hash").fetchall(),
                            conn.execute("SELECT * FROM segments ORDER BY name").fetchall()))  # fmt: skip
        except sqlite3.DatabaseError:  # a corrupt index: its bytes
            out.append(db.read_bytes())
    return out


def snapshot(cache_dir: Path) -> tuple[dict, list]:
    """Every file's bytes (index files and the maintenance lock file excluded) and every index's
    content: nothing changed."""
    files = {str(p.relative_to(cache_dir)): p.read_bytes() for p in sorted(cache_dir.rglob("*"))
             if p.is_file() and not p.is_symlink() and not p.name.startswith("index.sqlite")
             and p.name != LOCK_FILENAME}  # fmt: skip
    return files, raw_rows(cache_dir)


def only(report):
    assert len(report.namespaces) == 1
    return report.namespaces[0]


def loadable(cache_dir: Path, store, chains) -> set[str]:
    """Blocks a fresh store serves (verified, exact token ids)."""
    live = SSDStore(cache_dir, store.layout_key, make_meta())
    try:
        got = {b.block_hash for c in chains for b in c if live.load_block(b.block_hash, b.token_ids) is not None}
        assert live.stats()["ssd_load_corrupt"] == 0
        return got
    finally:
        live.close()


def every(chains) -> set[str]:
    return {b.block_hash for c in chains for b in c}


# ------------------------------------------------------------------ damage kinds
# each returns (report field, count, blocks that must still load afterwards: None = all)
def dmg_temp(store, chains):
    seg = segment_files(store)[0]
    (seg.parent / f".{seg.stem}.4194305.deadbeef.tmp").write_bytes(b"half a segment")
    return "temp_removed", 1, None


def dmg_missing(store, chains):
    block_path(store, chains[1][2].block_hash).unlink()  # a leaf: no chain breaks
    return "missing_rows_dropped", 1, every(chains) - {chains[1][2].block_hash}


def dmg_truncated(store, chains):
    p = block_path(store, chains[1][2].block_hash)
    p.write_bytes(p.read_bytes()[:-10])
    return "corrupt_removed", 1, every(chains) - {chains[1][2].block_hash}


def dmg_bad_header(store, chains):
    p = block_path(store, chains[1][2].block_hash)
    data = bytearray(p.read_bytes())
    data[20:28] = b"!!!!!!!!"
    p.write_bytes(bytes(data))
    return "corrupt_removed", 1, every(chains) - {chains[1][2].block_hash}


def dmg_foreign_segment(store, chains):
    """A valid segment of another namespace under the name of one of ours."""
    victim = chains[1][2]
    block_path(store, victim.block_hash).write_bytes(encode_segment([victim], make_layout(model_id="x")))
    return "corrupt_removed", 1, every(chains) - {victim.block_hash}


def dmg_orphan(store, chains):
    sql(store, "DELETE FROM blocks WHERE segment=?", (segment_name(store, chains[1][2].block_hash),))
    return "orphans_adopted", 1, None  # crash between rename and insert: re-adopted


def dmg_orphan_garbage(store, chains):
    name = "ee" * 16
    (store.namespace_dir / "ee").mkdir(exist_ok=True)  # a random segment name may have made it
    (store.namespace_dir / "ee" / f"{name}.safetensors").write_bytes(b"not a segment")
    return "orphans_removed", 1, None


def dmg_broken_chain(store, chains):
    p = block_path(store, chains[1][1].block_hash)
    sql(store, "DELETE FROM blocks WHERE hash=?", (chains[1][1].block_hash,))
    p.unlink()  # row, then file: block 2 loses its parent
    return "broken_chain_removed", 1, every(chains) - {chains[1][1].block_hash, chains[1][2].block_hash}


def dmg_future_access(store, chains):
    sql(store, "UPDATE blocks SET last_access=last_access+? WHERE hash=?", (NOW_SKEW, chains[0][0].block_hash))
    return "access_clamped", 1, None


def dmg_segment_row_missing(store, chains):
    sql(store, "DELETE FROM segments WHERE name=?", (segment_name(store, chains[0][0].block_hash),))
    return "segment_rows_fixed", 1, None


def dmg_segment_row_stale(store, chains):
    sql(store, "INSERT INTO segments VALUES (?, 100, 1, 0.0)", ("dd" * 16,))
    return "segment_rows_fixed", 1, None


def dmg_malformed_row(store, chains):
    """A middle block's row becomes unusable (typed wrong): dropped, and its record re-adopted
    because the chain below it needs it."""
    sql(store, "UPDATE blocks SET nbytes='lots' WHERE hash=?", (chains[0][1].block_hash,))
    return "bad_rows_dropped", 1, None


DAMAGES = [
    dmg_temp, dmg_missing, dmg_truncated, dmg_bad_header, dmg_foreign_segment, dmg_orphan, dmg_orphan_garbage,
    dmg_broken_chain, dmg_future_access, dmg_segment_row_missing, dmg_segment_row_stale, dmg_malformed_row,
]  # fmt: skip


def test_clean_cache_is_clean(cache):
    cache_dir, store, chains = cache
    before = snapshot(cache_dir)
    rep = only(validate(cache_dir, deep=True))
    assert (rep.status, rep.outcome, rep.problems, rep.rows, rep.files) == ("ok", "clean", 0, 8, 4)
    assert snapshot(cache_dir) == before


@pytest.mark.parametrize("damage", DAMAGES, ids=lambda f: f.__name__[4:])
def test_each_damage_is_repaired_once(cache, damage):
    cache_dir, store, chains = cache
    field, count, survivors = damage(store, chains)
    before = snapshot(cache_dir)
    dry = only(validate(cache_dir, dry_run=True))
    assert snapshot(cache_dir) == before  # a dry run changes nothing
    assert getattr(dry, field) == count and dry.outcome == "problems", dry.details

    rep = only(validate(cache_dir))
    assert getattr(rep, field) == count and rep.outcome == "repaired", rep.details
    assert rep.problems == dry.problems and rep.unlink_failed == 0
    second = only(validate(cache_dir, deep=True))
    assert second.problems == 0 and second.outcome == "clean", second.details
    assert loadable(cache_dir, store, chains) == (every(chains) if survivors is None else survivors)


@pytest.mark.parametrize(
    "column, value",
    [
        ("nbytes", 12345),
        ("num_tokens", 3),
        ("slot", 3),
        ("parent", "ab" * 16),
        ("tokens_digest", "cd" * 16),
        ("segment", None),  # another existing segment (set below)
        ("hash", "ef" * 16),  # the real block's row is gone; its chain needs it: re-adopted
    ],
)
@pytest.mark.parametrize("which", [1, 4], ids=["middle", "tail-entry"])
def test_one_wrong_row_loses_no_intact_block(cache, column, value, which):
    """One wrong `nbytes` once cost 19 intact blocks. A row that disagrees with a record that
    verifies is rewritten from the record; nothing is deleted."""
    cache_dir, store, chains = cache
    victim = chains[0][which]
    if column == "segment":
        value = segment_name(store, chains[1][0].block_hash)
    sql(store, f"UPDATE blocks SET {column}=? WHERE hash=?", (value, victim.block_hash))
    rep = only(validate(cache_dir))
    assert rep.broken_chain_removed == rep.missing_rows_dropped == 0 and rep.bytes_freed == 0, rep.details
    assert rep.corrupt_removed == (1 if column == "hash" else 0)  # the bogus row itself, no block
    assert rep.rows_repaired + rep.orphans_adopted == 1
    assert only(validate(cache_dir, deep=True)).problems == 0
    assert loadable(cache_dir, store, chains) == every(chains)


def test_flipped_record_byte_needs_deep(cache):
    cache_dir, store, (a, b) = cache
    flip_record_byte(store, b[0].block_hash)
    assert only(validate(cache_dir)).problems == 0  # header, sizes and token ids are fine
    rep = only(validate(cache_dir, deep=True))
    assert (rep.corrupt_removed, rep.broken_chain_removed) == (1, 2)  # its continuations are unreachable
    assert any(d.startswith("corrupt") and "checksum" in d for d in rep.details)
    assert stored(store) == every([a]) and len(segment_files(store)) == 1


def test_corrupt_record_in_a_shared_segment_keeps_the_others(cache):
    cache_dir, store, (a, b) = cache
    flip_record_byte(store, a[3].block_hash)  # block 3 of 5 in one segment
    rep = only(validate(cache_dir, deep=True))
    assert (rep.corrupt_removed, rep.broken_chain_removed) == (1, 1)  # block 3 and the tail below it
    assert loadable(cache_dir, store, (a, b)) == every((a, b)) - {a[3].block_hash, a[4].block_hash}


def test_wrong_meta_leaves_the_namespace_untouched(cache):
    """A wrong block_size once in the meta cost all 27 blocks. The layout key is a digest of
    the meta: a meta that does not hash to the name is 'foreign', reported, untouched."""
    cache_dir, store, chains = cache
    sql(store, "UPDATE meta SET value='8' WHERE key='block_size'")
    block_path(store, chains[1][2].block_hash).unlink()  # would be a repair in a usable namespace
    before = snapshot(cache_dir)
    rep = only(validate(cache_dir, deep=True))
    assert (rep.status, rep.outcome, rep.problems) == ("foreign", "skipped", 1) and "hash" in rep.message
    assert snapshot(cache_dir) == before


def test_outdated_namespace_is_reported_not_touched(cache):
    cache_dir, store, _ = cache
    sql(store, "UPDATE meta SET value='1' WHERE key='format_version'")
    before = snapshot(cache_dir)
    rep = only(validate(cache_dir, deep=True))
    assert (rep.status, rep.outcome, rep.problems, rep.format_version) == ("outdated", "skipped", 0, "1")
    assert "re-warm; `kvtool prune` removes them" in rep.message
    assert snapshot(cache_dir) == before


def corrupt_index(store) -> None:
    for suffix in ("-wal", "-shm"):
        Path(f"{store.namespace_dir / 'index.sqlite'}{suffix}").unlink(missing_ok=True)
    (store.namespace_dir / "index.sqlite").write_bytes(b"this is not a database at all" * 100)


def test_corrupt_index_is_rebuilt_with_every_block(cache):
    cache_dir, store, chains = cache
    corrupt_index(store)
    rep = only(validate(cache_dir))
    assert rep.status == "unreadable" and rep.outcome == "skipped" and "--rebuild-index" in rep.message
    before = snapshot(cache_dir)
    dry = only(validate(cache_dir, rebuild_index=True, dry_run=True))
    assert dry.index_rebuilt and dry.blocks_recovered == 8 and snapshot(cache_dir) == before
    rep = only(validate(cache_dir, rebuild_index=True))
    assert (rep.index_rebuilt, rep.blocks_recovered, rep.outcome, rep.orphans_removed) == (True, 8, "repaired", 0)
    assert (store.namespace_dir / "index.sqlite.corrupt").read_bytes().startswith(b"this is not")
    ns = only(scan_cache(cache_dir))  # the meta was lost: completed by the next open of the model
    assert ns.status == "uninitialized" and len(ns.rows) == 8
    assert only(validate(cache_dir)).problems == 0
    assert loadable(cache_dir, store, chains) == every(chains)
    assert only(validate(cache_dir, deep=True)).outcome == "clean"


def test_a_deleted_index_leaves_a_namespace_that_is_reported_and_rebuilt(cache):
    """Its segment files were invisible: inspect, validate, prune and rm saw no namespace (exit 0)."""
    cache_dir, store, chains = cache
    for suffix in ("", "-wal", "-shm"):
        Path(f"{store.namespace_dir / 'index.sqlite'}{suffix}").unlink(missing_ok=True)
    (cache_dir / ("ab" * 16)).mkdir()  # an empty namespace-named directory stays ignored
    ns = only(scan_cache(cache_dir))
    assert ns.status == "unreadable" and ns.message.startswith("index.sqlite is missing") and len(ns.files) == 4
    rep = only(validate(cache_dir))
    assert rep.outcome == "skipped" and rep.problems == 1 and "--rebuild-index" in rep.message
    rep = only(validate(cache_dir, rebuild_index=True))
    assert (rep.index_rebuilt, rep.blocks_recovered) == (True, 8)
    assert loadable(cache_dir, store, chains) == every(chains)
    assert only(validate(cache_dir)).problems == 0


def test_rebuild_keeps_a_readable_meta(cache):
    """An index whose block table is lost but whose meta still reads comes back complete."""
    cache_dir, store, chains = cache
    sql(store, "DROP TABLE blocks")
    assert only(scan_cache(cache_dir)).status == "unreadable"
    rep = only(validate(cache_dir, rebuild_index=True))
    assert rep.index_rebuilt and rep.blocks_recovered == 8
    ns = only(scan_cache(cache_dir))
    assert ns.status == "ok" and len(ns.rows) == 8 and ns.meta["model_id"] == "test-model"
    assert only(validate(cache_dir, deep=True)).problems == 0
    assert loadable(cache_dir, store, chains) == every(chains)


def test_duplicate_orphan_is_removed_without_a_problem(cache):
    cache_dir, store, (a, b) = cache
    src = block_path(store, b[0].block_hash)
    copy = segment_path(store, "0a" * 16)
    copy.parent.mkdir(exist_ok=True)
    copy.write_bytes(src.read_bytes())
    rep = only(validate(cache_dir))
    assert (rep.duplicates_removed, rep.problems, rep.outcome) == (1, 0, "repaired") and not copy.exists()
    assert only(validate(cache_dir)).duplicates_removed == 0


def test_plan_then_execute(cache):
    cache_dir, store, chains = cache
    dmg_missing(store, chains)
    plan = plan_repairs(scan_cache(cache_dir))
    assert plan.dry_run and not plan.executed and plan.problems == 1
    assert len(stored(store)) == 8
    execute(plan)
    assert plan.executed and not plan.dry_run and len(stored(store)) == 7
    assert set(plan.to_dict()["namespaces"][0]) >= set(REPAIRS) | {"status", "outcome", "details", "problems"}


def test_foreign_entries_are_ignored(cache):
    cache_dir, store, _ = cache
    (cache_dir / "notes.txt").write_text("mine")
    (cache_dir / ("f" * 32)).mkdir()  # 32-hex but no index.sqlite: not a namespace
    (store.namespace_dir / "README").write_text("x")
    rep = validate(cache_dir)
    assert only(rep).problems == 0 and only(rep).ignored_entries == 1
    assert (cache_dir / "notes.txt").exists() and (store.namespace_dir / "README").exists()


def test_namespace_selection_and_errors(cache, tmp_path):
    cache_dir, store, _ = cache
    other = SSDStore(cache_dir, make_layout(model_id="other"), make_meta(model_id="other"))
    other.close()
    assert len(validate(cache_dir).namespaces) == 2
    assert only(validate(cache_dir, namespace=store.layout_key[:6])).namespace == store.layout_key
    with pytest.raises(ScanError, match="no namespace"):
        validate(cache_dir, namespace="zz")
    assert validate(tmp_path / "nope").namespaces == []  # not created yet: an empty cache
    with pytest.raises(ScanError, match="not a directory"):
        validate(cache_dir / store.layout_key / "index.sqlite")


def test_validate_while_a_store_serves(cache):
    cache_dir, store, (a, b) = cache
    live = SSDStore(cache_dir, store.layout_key, make_meta())
    dmg_truncated(store, (a, b))
    validate(cache_dir, deep=True)
    assert live.load_block(b[2].block_hash, b[2].token_ids) is None
    assert live.stats()["ssd_load_corrupt"] == 0  # validate got there first: a plain miss
    assert live.load_block(b[1].block_hash, b[1].token_ids) is not None
    assert live.save_block(b[2]) == "saved"
    live.close()
    assert only(validate(cache_dir, deep=True)).problems == 0


@pytest.mark.parametrize("damage", [None, dmg_missing])
def test_progress_reports_every_segment(cache, damage):
    """Counts only grow, none past the total, and end at every segment (the fast check reports
    piece by piece, the general way segment by segment)."""
    cache_dir, store, chains = cache
    if damage is not None:
        damage(store, chains)
    seen = []
    validate(cache_dir, dry_run=True, progress=lambda ns, done, total: seen.append((done, total)))
    assert seen[-1] == (4, 4) and all(a < b <= t == 4 for (a, _), (b, t) in zip(seen, seen[1:]))


# ------------------------------------------------------------------ maintenance lock
LOCK_HOLDER = """
import sys, time
from pathlib import Path
from kvtool.disk.lock import cache_lock
with cache_lock(Path(sys.argv[1])):
    print("locked", flush=True)
    sys.stdin.readline()  # hold the lock until the test closes stdin
"""


@pytest.mark.slow
def test_repair_waits_for_the_maintenance_lock_dry_run_does_not(cache, cli):
    """Another process (a prune, rm or validate) holds the lock: a repairing validate refuses
    with exit 3 and changes nothing; a dry run still reads and reports."""
    cache_dir, store, chains = cache
    dmg_missing(store, chains)
    holder = subprocess.Popen([sys.executable, "-c", LOCK_HOLDER, str(cache_dir)], cwd=REPO, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "locked"
        before = snapshot(cache_dir)
        with pytest.raises(PruneLocked, match=f"pid {holder.pid}"):
            validate(cache_dir)
        res = cli("--cache-dir", str(cache_dir))
        assert res.exit_code == 3 and "another kvtool prune, rm or validate is running" in res.output
        assert snapshot(cache_dir) == before
        dry = validate(cache_dir, dry_run=True)
        assert only(dry).missing_rows_dropped == 1 and not dry.executed
    finally:
        holder.communicate("\n", timeout=60)
    assert only(validate(cache_dir)).missing_rows_dropped == 1  # released: repaired now
    assert only(validate(cache_dir)).outcome == "clean"


def test_prune_refused_while_validate_repairs(cache):
    """The lock is held from the scan on: a prune started while validate plans is refused."""
    cache_dir, store, chains = cache
    dmg_missing(store, chains)
    refused = []

    def progress(namespace: str, done: int, total: int) -> None:
        if not refused:
            with pytest.raises(PruneLocked):
                prune(cache_dir, ttl_s=0.0)
            refused.append(done)

    assert only(validate(cache_dir, progress=progress)).missing_rows_dropped == 1
    assert refused and len(stored(store)) == len(every(chains)) - 1  # prune removed nothing
    assert prune(cache_dir, ttl_s=0.0).total("rows_deleted") == len(every(chains)) - 1  # released


# ------------------------------------------------------------------ CLI
@pytest.fixture
def cli():
    app = typer.Typer()

    @app.callback()
    def _root() -> None:
        """kvtool (test app)"""

    cmd_validate.register(app)
    runner = CliRunner()
    return lambda *args: runner.invoke(app, ["validate", *args])


def test_cli_exit_codes_and_json(cache, cli, tmp_path):
    cache_dir, store, chains = cache
    ok = cli("--cache-dir", str(cache_dir), "--json")
    assert ok.exit_code == 0, ok.output
    doc = json.loads(ok.stdout)
    assert doc["clean"] and doc["namespaces"][0]["namespace"] == store.layout_key
    assert set(doc) == {"schema_version", "cache_dir", "deep", "dry_run", "executed", "rebuild_index", "symlinks",
                        "namespaces", "problems", "clean"}
    dmg_missing(store, chains)
    dry = cli("--cache-dir", str(cache_dir), "--dry-run", "--json")
    assert dry.exit_code == 1 and json.loads(dry.stdout)["namespaces"][0]["missing_rows_dropped"] == 1
    fixed = cli("--cache-dir", str(cache_dir))
    assert fixed.exit_code == 1 and "1 problem(s) found" in fixed.stdout
    assert cli("--cache-dir", str(cache_dir)).exit_code == 0
    missing = cli("--cache-dir", str(tmp_path / "absent"), "--create")  # --create: an empty cache
    assert missing.exit_code == 0 and "no namespaces" in missing.output and (tmp_path / "absent").is_dir()
    assert cli("--cache-dir", str(cache_dir), "--namespace", "zz").exit_code == 2


def test_cli_rebuild_index(cache, cli):
    cache_dir, store, chains = cache
    corrupt_index(store)
    res = cli("--cache-dir", str(cache_dir))
    assert res.exit_code == 1 and "--rebuild-index" in res.output
    res = cli("--cache-dir", str(cache_dir), "--rebuild-index", "--json")
    ns = json.loads(res.stdout)["namespaces"][0]
    assert res.exit_code == 1 and ns["index_rebuilt"] and ns["blocks_recovered"] == 8


def test_cli_help_has_example(cli):
    res = cli("--help")
    assert res.exit_code == 0 and "kvtool validate --deep" in res.stdout and "--rebuild-index" in res.stdout


def test_cache_dir_env_default(cache, cli, monkeypatch):
    cache_dir, _, _ = cache
    monkeypatch.setenv("KVTOOL_CACHE_DIR", str(cache_dir))
    res = cli("--json")
    assert res.exit_code == 0 and json.loads(res.stdout)["cache_dir"] == str(cache_dir)
