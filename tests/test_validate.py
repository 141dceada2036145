"""Tests of kvtool.ops.validate and `kvtool validate` (real cache directories and indexes)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import typer
from tests.store_helpers import block_path, make_block, make_chain, make_layout, make_meta, open_store
from typer.testing import CliRunner

from kvtool.cli import cmd_validate
from kvtool.ops.validate import ValidateError, validate
from kvtool.store import blockfile
from kvtool.store.index import BlockIndex
from kvtool.store.ssd import SSDStore

PROMPTS = (np.arange(16), np.arange(100, 112))  # chains of 4 and 3 blocks (block_size 4)


@pytest.fixture
def cache(tmp_path):
    """A closed cache with one namespace holding two chains; yields (cache_dir, store, chains)."""
    store = open_store(tmp_path)
    chains = [make_chain(store.layout_key, p, "bfloat16", seed=10 * i) for i, p in enumerate(PROMPTS)]
    for chain in chains:
        for b in chain:
            assert store.save_block(b) == "saved"
    store.close()
    return tmp_path, store, chains


def snapshot(cache_dir: Path) -> tuple[dict, list]:
    """Every file's bytes (index files excluded) and every index row, to prove nothing changed."""
    files = {
        str(p.relative_to(cache_dir)): p.read_bytes()
        for p in sorted(cache_dir.rglob("*"))
        if p.is_file() and not p.name.startswith("index.sqlite")
    }
    rows = []
    for idx_path in sorted(cache_dir.glob("*/index.sqlite")):
        idx = BlockIndex(idx_path, create=False)
        rows.append((idx.get_meta().get("format_version"), list(idx.rows())))
        idx.close()
    return files, rows


def only(report):
    assert len(report.namespaces) == 1
    return report.namespaces[0]


def rows_of(store) -> dict:
    idx = BlockIndex(store.namespace_dir / "index.sqlite", create=False)
    try:
        return {r.hash: r for r in idx.rows()}
    finally:
        idx.close()


# ------------------------------------------------------------------ damage kinds
def dmg_temp(store, chains):
    p = block_path(store, chains[0][0].block_hash).parent / f".{chains[0][0].block_hash}.4194305.dead.tmp"
    p.write_bytes(b"half a block")
    return "temp_removed", 1


def dmg_missing(store, chains):
    block_path(store, chains[0][3].block_hash).unlink()  # a leaf: no chain breaks
    return "missing_rows_dropped", 1


def dmg_truncated(store, chains):
    p = block_path(store, chains[0][3].block_hash)
    p.write_bytes(p.read_bytes()[:-10])
    return "corrupt_removed", 1


def dmg_bad_header(store, chains):
    p = block_path(store, chains[1][2].block_hash)
    data = bytearray(p.read_bytes())
    data[12:20] = b"!!!!!!!!"
    p.write_bytes(bytes(data))
    return "corrupt_removed", 1


def dmg_foreign(store, chains):
    """A block of another namespace copied in under a hash of ours (valid file, wrong layout)."""
    victim = chains[1][2]
    foreign = make_block(victim.block_hash, victim.parent_hash, victim.token_ids)
    block_path(store, victim.block_hash).write_bytes(blockfile.encode(foreign, make_layout(model_id="x"), 0.0))
    return "corrupt_removed", 1


def dmg_orphan_good(store, chains):
    idx = BlockIndex(store.namespace_dir / "index.sqlite")
    idx.delete([chains[0][3].block_hash])  # row lost (e.g. crash between rename and insert)
    idx.close()
    return "orphans_adopted", 1


def dmg_orphan_bad(store, chains):
    h = "ee" * 16
    (store.namespace_dir / "ee").mkdir()
    (store.namespace_dir / "ee" / f"{h}.safetensors").write_bytes(b"not a block")
    return "orphans_removed", 1


def dmg_broken_chain(store, chains):
    idx = BlockIndex(store.namespace_dir / "index.sqlite")
    idx.delete([chains[0][1].block_hash])  # row gone, then file: blocks 2 and 3 lose their parent
    idx.close()
    block_path(store, chains[0][1].block_hash).unlink()
    return "broken_chain_removed", 2


DAMAGES = [dmg_temp, dmg_missing, dmg_truncated, dmg_bad_header, dmg_foreign, dmg_orphan_good, dmg_orphan_bad, dmg_broken_chain]


def test_clean_cache_is_clean(cache):
    cache_dir, store, chains = cache
    rep = only(validate(cache_dir, deep=True))
    assert rep.status == "clean" and rep.problems == 0 and rep.rows == rep.files == 7


@pytest.mark.parametrize("damage", DAMAGES, ids=lambda f: f.__name__[4:])
def test_each_damage_is_repaired_once(cache, damage):
    cache_dir, store, chains = cache
    field, count = damage(store, chains)
    before = snapshot(cache_dir)
    dry = only(validate(cache_dir, dry_run=True))
    assert snapshot(cache_dir) == before  # dry run changes nothing
    assert getattr(dry, field) == count and dry.problems == count and dry.status == "problems"

    rep = only(validate(cache_dir))
    assert getattr(rep, field) == count and rep.problems == count and rep.status == "repaired"
    second = only(validate(cache_dir, deep=True))
    assert second.problems == 0 and second.status == "clean"
    # the store serves exactly what is indexed, and everything indexed is loadable
    served = SSDStore(cache_dir, store.layout_key, make_meta())
    for chain in chains:
        for b in chain:
            out = served.load_block(b.block_hash, b.token_ids)
            assert (out is not None) == (b.block_hash in rows_of(store))
    assert served.stats()["ssd_load_corrupt"] == 0
    served.close()


def test_orphan_is_readopted_with_its_metadata(cache):
    cache_dir, store, chains = cache
    original = rows_of(store)[chains[0][3].block_hash]
    dmg_orphan_good(store, chains)
    validate(cache_dir)
    adopted = rows_of(store)[chains[0][3].block_hash]
    assert (adopted.parent, adopted.path, adopted.nbytes, adopted.tokens_digest, adopted.created) == (
        original.parent, original.path, original.nbytes, original.tokens_digest, original.created
    )  # fmt: skip


def test_flipped_data_byte_needs_deep(cache):
    cache_dir, store, chains = cache
    p = block_path(store, chains[1][0].block_hash)
    data = bytearray(p.read_bytes())
    data[-1] ^= 0xFF
    p.write_bytes(bytes(data))
    assert only(validate(cache_dir)).problems == 0  # header, size and shapes are fine
    rep = only(validate(cache_dir, deep=True))
    # the corrupt first block goes, and its two children lose their chain
    assert (rep.corrupt_removed, rep.broken_chain_removed) == (1, 2)
    assert not p.exists() and len(rows_of(store)) == 4
    assert any(d.startswith("corrupt") and "checksum" in d for d in rep.details)


def test_unknown_format_version_is_untouched(cache):
    cache_dir, store, chains = cache
    idx = BlockIndex(store.namespace_dir / "index.sqlite")
    idx.set_meta({"format_version": "7"})
    idx.close()
    block_path(store, chains[0][0].block_hash).unlink()  # would be a problem in a v1 namespace
    before = snapshot(cache_dir)
    rep = only(validate(cache_dir, deep=True))
    assert rep.status == "unknown_format" and rep.format_version == "7" and rep.problems == 1
    assert snapshot(cache_dir) == before


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
    with pytest.raises(ValidateError, match="no namespace"):
        validate(cache_dir, namespace="zz")
    with pytest.raises(ValidateError, match="does not exist"):
        validate(tmp_path / "nope")


def test_validate_while_a_store_serves(cache):
    cache_dir, store, chains = cache
    live = SSDStore(cache_dir, store.layout_key, make_meta())
    dmg_truncated(store, chains)
    validate(cache_dir, deep=True)
    assert live.load_block(chains[0][3].block_hash, chains[0][3].token_ids) is None
    assert live.stats()["ssd_load_corrupt"] == 0  # validate got there first: a plain miss
    assert live.load_block(chains[0][2].block_hash, chains[0][2].token_ids) is not None
    assert live.save_block(chains[0][3]) == "saved"
    live.close()
    assert only(validate(cache_dir, deep=True)).problems == 0


def test_progress_reports_every_file(cache):
    cache_dir, _, _ = cache
    seen = []
    validate(cache_dir, progress=lambda ns, done, total: seen.append((done, total)))
    assert seen[-1] == (7, 7) and len(seen) == 7


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
    dmg_missing(store, chains)
    dry = cli("--cache-dir", str(cache_dir), "--dry-run", "--json")
    assert dry.exit_code == 1 and json.loads(dry.stdout)["namespaces"][0]["missing_rows_dropped"] == 1
    fixed = cli("--cache-dir", str(cache_dir))
    assert fixed.exit_code == 1 and "1 problem(s) found" in fixed.stdout
    assert cli("--cache-dir", str(cache_dir)).exit_code == 0
    missing = cli("--cache-dir", str(tmp_path / "absent"))
    assert missing.exit_code == 2 and "does not exist" in missing.output
    assert cli("--cache-dir", str(cache_dir), "--namespace", "zz").exit_code == 2


def test_cli_help_has_example(cli):
    res = cli("--help")
    assert res.exit_code == 0 and "kvtool validate --deep" in res.stdout and "--dry-run" in res.stdout


def test_cache_dir_env_default(cache, cli, monkeypatch):
    cache_dir, _, _ = cache
    monkeypatch.setenv("KVTOOL_CACHE_DIR", str(cache_dir))
    res = cli("--json")
    assert res.exit_code == 0 and json.loads(res.stdout)["cache_dir"] == str(cache_dir)
