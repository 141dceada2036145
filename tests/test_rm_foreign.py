"""`kvtool rm NAMESPACE` and `validate --rebuild-index` remove only files kvtool writes (hostile round 3,
finding 5): a 32-hex directory whose `index.sqlite` is not a kvtool index is refused whole; user
files inside a real namespace are left (and listed, the dry run included), and the directories
holding them stay; a rebuild without kvtool meta never removes a file under a segment's name that
is no segment of the namespace."""

from __future__ import annotations

import json
import sqlite3

import numpy as np
from typer.testing import CliRunner

from kvtool.cli import app as app_module
from kvtool.disk.names import INDEX_FILENAME
from kvtool.ops.scan import scan_cache
from kvtool.ops.validate import validate
from tests.store_helpers import free_fan_out, make_chain, open_store, segment_files, stored

if not any(c.name == "rm" for c in app_module.app.registered_commands):
    app_module._register()
runner = CliRunner()


def rm(cache_dir, *args):
    return runner.invoke(app_module.app, ["rm", "--cache-dir", str(cache_dir), *args])


def plant_user_files(ns_dir) -> dict:
    """A user's files in a directory: at the top, in a sub-directory, in a fan-out directory."""
    (ns_dir / "sub").mkdir(parents=True, exist_ok=True)
    files = {ns_dir / "notes.txt": "mine", ns_dir / "sub" / "photo.jpg": "jpeg"}
    fan = sorted(p for p in ns_dir.iterdir() if len(p.name) == 2 and p.is_dir())
    if fan:
        files[fan[0] / "readme.md"] = "mine too"
    for path, text in files.items():
        path.write_text(text)
    return files


def one_segment_namespace(tmp_path):
    """A cache with one namespace holding one segment (8 tokens): (cache dir, its closed store,
    the namespace directory, the segment file)."""
    cache_dir = tmp_path / "kv"
    store = open_store(cache_dir)
    store.save_blocks(make_chain(store.layout_key, np.arange(8)))
    store.close()
    (seg_file,) = segment_files(store.namespace_dir)
    return cache_dir, store, store.namespace_dir, seg_file


def test_rm_refuses_a_directory_whose_index_is_not_kvtools(tmp_path):
    cache_dir = tmp_path / "kv"
    for i, content in enumerate(["text", "sqlite"]):
        foreign = cache_dir / (f"{i}" * 32)
        files = plant_user_files(foreign)
        if content == "text":
            (foreign / INDEX_FILENAME).write_text("my notes, not a database\n")
        else:
            with sqlite3.connect(foreign / INDEX_FILENAME) as conn:
                conn.execute("CREATE TABLE photos (name TEXT)")
        before = sorted(p.relative_to(foreign) for p in foreign.rglob("*"))
        res = rm(cache_dir, foreign.name[:10], "--yes")
        assert res.exit_code == 2 and "not a kvtool namespace" in res.output, res.output
        assert sorted(p.relative_to(foreign) for p in foreign.rglob("*")) == before
        assert all(path.read_text() == text for path, text in files.items())


def test_rm_namespace_removes_only_kvtool_files_and_lists_the_rest(tmp_path):
    cache_dir = tmp_path / "kv"
    store = open_store(cache_dir)
    for i in range(6):
        store.save_blocks(make_chain(store.layout_key, np.arange(8) + 8 * i, seed=i))
    store.close()
    ns_dir = store.namespace_dir
    files = plant_user_files(ns_dir)
    (ns_dir / free_fan_out(ns_dir)).mkdir()  # an empty directory under a fan-out name: goes
    left = sorted(str(p.relative_to(ns_dir)) for p in files if p.parent.name != "sub") + ["sub/"]  # a user's directory: listed, not entered
    dry = rm(cache_dir, store.layout_key[:10], "--dry-run", "--json")
    assert dry.exit_code == 0, dry.output
    assert json.loads(dry.stdout)["namespaces"][0]["left"] == left
    human = rm(cache_dir, store.layout_key[:10], "--dry-run")
    assert "notes.txt" in human.output and "sub/" in human.output and "would be left" in human.output
    res = rm(cache_dir, store.layout_key[:10], "--yes", "--json")
    assert res.exit_code == 0, res.output
    (ns,) = json.loads(res.stdout)["namespaces"]
    assert ns["left"] == left and not ns["namespace_removed"] and ns["files_deleted"] == 6
    assert all(path.read_text() == text for path, text in files.items())
    remaining = sorted(str(p.relative_to(ns_dir)) for p in ns_dir.rglob("*") if p.is_file())
    assert remaining == sorted(str(p.relative_to(ns_dir)) for p in files)  # every kvtool file gone, the user's kept
    assert not segment_files(ns_dir) and not (ns_dir / INDEX_FILENAME).exists()


def test_rebuild_without_kvtool_meta_never_removes_a_foreign_file_named_like_a_segment(tmp_path):
    cache_dir, store, ns_dir, seg_file = one_segment_namespace(tmp_path)
    foreign = seg_file.parent / ("ab" * 16 + ".safetensors")
    foreign = ns_dir / "ab" / foreign.name
    foreign.parent.mkdir(exist_ok=True)
    foreign.write_bytes(b"a user's tensor file, not a kvtool segment" * 10)
    (ns_dir / INDEX_FILENAME).write_text("not a database")
    for suffix in ("-wal", "-shm"):
        (ns_dir / (INDEX_FILENAME + suffix)).unlink(missing_ok=True)
    plan = validate(cache_dir, rebuild_index=True)
    (rep,) = plan.namespaces
    assert rep.index_rebuilt and rep.blocks_recovered == 2, rep
    assert foreign.read_bytes().startswith(b"a user's tensor file")
    assert stored(store) == {b.block_hash for b in make_chain(store.layout_key, np.arange(8))}
    # a directory with neither kvtool meta nor one segment of its namespace is not rebuilt at all
    other = cache_dir / ("7" * 32)
    (other / "ab").mkdir(parents=True)
    (other / "ab" / ("ab" * 16 + ".safetensors")).write_bytes(b"not a segment")
    (other / INDEX_FILENAME).write_text("not a database")
    rep = validate(cache_dir, other.name, rebuild_index=True).namespaces[0]
    assert rep.outcome == "failed" and not rep.index_rebuilt
    assert (other / "ab" / ("ab" * 16 + ".safetensors")).read_bytes() == b"not a segment"
    assert (other / INDEX_FILENAME).read_text() == "not a database"
    assert [n.status.value for n in scan_cache(cache_dir, other.name).namespaces] == ["unreadable"]


def test_names_with_a_trailing_newline_are_not_kvtools(tmp_path):
    """A name is kvtool's only if it matches whole: `$` in a regex also matches before a trailing
    newline, so a user's `<segment name>\\n.safetensors`, a `<fan-out>\\n` directory and a
    `<temp name>\\n` file were taken for kvtool's and deleted."""
    cache_dir, store, ns_dir, seg_file = one_segment_namespace(tmp_path)
    sub = seg_file.parent.name
    planted = [
        seg_file.parent / (sub + "c" * 30 + "\n.safetensors"),
        ns_dir / (sub + "\n") / (sub + "d" * 30 + ".safetensors"),
        ns_dir / ("." + "e" * 32 + ".123.0badbeef.tmp\n"),
    ]
    for path in planted:
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(b"a user's file")
    res = rm(cache_dir, store.layout_key[:10], "--yes", "--json")
    assert res.exit_code == 0, res.output
    assert all(path.read_bytes() == b"a user's file" for path in planted)
    assert not seg_file.exists() and not (ns_dir / INDEX_FILENAME).exists()
