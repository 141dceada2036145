"""Tests of kvtool.ops.scan and kvtool.disk.chains: one read-only scan shared by inspect, validate
and prune (statuses, rows vs files, temps, symlinks, malformed rows), the chain tree (property
tests: effective access, depth, reachability, termination on cycles), and the MLX boundary of
the operator commands (a subprocess never imports mlx)."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtool.disk.chains import build_chain_tree, build_forest, rooted_nodes
from kvtool.disk.index import BlockIndex
from kvtool.hashing import root_parent
from kvtool.ops.scan import NamespaceStatus, ScanError, meta_problem, scan_cache
from tests.store_helpers import make_chain, make_layout, make_meta, max_depth, open_store, segment_files

REPO = Path(__file__).resolve().parent.parent
NOW = 1_800_000_000.0
S = NamespaceStatus


def sql(ns_dir: Path, statement: str, params=()) -> None:
    """Change an index behind kvtool's back (tampering, corruption)."""
    with sqlite3.connect(ns_dir / "index.sqlite") as conn:
        conn.execute(statement, params)


@pytest.fixture
def cache(tmp_path):
    """A closed cache: one namespace, two chains (4 blocks + tail, 3 blocks), one segment each."""
    cache_dir = tmp_path / "kv"
    store = open_store(cache_dir)
    chains = [make_chain(store.layout_key, np.arange(18), tail=True), make_chain(store.layout_key, np.arange(100, 112), seed=7)]
    for chain in chains:
        assert set(store.save_blocks(chain)) == {"saved"}
    store.close()
    return cache_dir, store, chains


def only(scan):
    assert len(scan.namespaces) == 1
    return scan.namespaces[0]


def files_of(cache_dir: Path) -> dict:
    return {str(p.relative_to(cache_dir)): p.read_bytes() for p in sorted(cache_dir.rglob("*"))
            if p.is_file() and not p.is_symlink() and "-wal" not in p.name and "-shm" not in p.name}  # fmt: skip


# ------------------------------------------------------------------ scan
def test_ok_namespace_rows_files_and_tree(cache):
    cache_dir, store, (a, b) = cache
    before = files_of(cache_dir)
    ns = only(scan_cache(cache_dir, now=NOW))
    assert ns.status == S.OK and ns.usable and ns.message == ""
    assert len(ns.rows) == 8 and len(ns.files) == 2 and ns.missing == () and ns.orphans == ()
    assert ns.bytes == ns.file_bytes == sum(p.stat().st_size for p in segment_files(store))
    assert ns.expected.block_size == 4 and ns.format_version == "2"
    tree = ns.tree
    assert tree.tops() == sorted([a[0].block_hash, b[0].block_hash]) and tree.unrooted() == []
    assert [tree.nodes[x.block_hash].depth for x in a] == [0, 1, 2, 3, 4]  # the tail hangs below block 3
    assert files_of(cache_dir) == before  # read-only


def test_empty_and_uninitialized(tmp_path):
    store = open_store(tmp_path)
    store.close()
    assert only(scan_cache(tmp_path)).status == S.EMPTY
    half = tmp_path / ("ab" * 16)
    half.mkdir()
    BlockIndex(half / "index.sqlite").close()  # schema, no meta: creation interrupted
    by = {ns.name: ns for ns in scan_cache(tmp_path).namespaces}
    assert by[half.name].status == S.UNINITIALIZED and not by[half.name].usable


def test_unreadable_outdated_foreign(cache):
    cache_dir, store, _ = cache
    garbage = cache_dir / ("ab" * 16)
    garbage.mkdir()
    (garbage / "index.sqlite").write_bytes(b"this is not a database at all" * 100)
    old = cache_dir / ("cd" * 16)
    old.mkdir()
    idx = BlockIndex(old / "index.sqlite")
    idx.set_meta({"format_version": "1", "layout_key": old.name})
    idx.close()
    by = {ns.name: ns for ns in scan_cache(cache_dir).namespaces}
    assert by[garbage.name].status == S.UNREADABLE and by[garbage.name].cause == "index"
    assert "--rebuild-index" in by[garbage.name].message
    assert by[old.name].status == S.OUTDATED and "re-warm; `kvtool prune` removes them" in by[old.name].message
    sql(store.namespace_dir, "UPDATE meta SET value='8' WHERE key='block_size'")
    ns = scan_cache(cache_dir, store.layout_key).namespaces[0]
    assert ns.status == S.FOREIGN and "does not hash" in ns.message and ns.rows == ()


@pytest.mark.parametrize(
    "change, why",
    [
        ({"layout_key": "ab" * 16}, "names layout"),
        ({"kv_layers": "2x8x8"}, "does not hash"),
        ({"model_id": "someone-else"}, "does not hash"),
        ({"kv_dtype": "float99"}, "malformed"),
        ({"block_size": "four"}, "malformed"),
    ],
)
def test_meta_problem(change, why):
    name = make_layout()
    meta = {**make_meta(), "format_version": "2", "layout_key": name}
    assert meta_problem(name, meta) is None
    assert why in meta_problem(name, {**meta, **change})


def test_missing_orphans_temps_symlinks_other(cache, tmp_path):
    cache_dir, store, (a, b) = cache
    seg_a, seg_b = segment_files(store)
    sql(store.namespace_dir, "DELETE FROM blocks WHERE segment=?", (seg_b.stem,))  # b's file: an orphan
    seg_a.unlink()  # a's rows: missing
    ns_dir = store.namespace_dir
    (seg_b.parent / f".{seg_b.stem}.4194305.deadbeef.tmp").write_bytes(b"x")  # kvtool temp (dead pid)
    (seg_b.parent / "notes.tmp").write_bytes(b"x")  # not kvtool's: never a temp
    outside = tmp_path / "outside"
    outside.mkdir()
    fan = next(f"{i:02x}" for i in range(256) if not (ns_dir / f"{i:02x}").exists())  # segment names are random
    (outside / f"{fan * 16}.safetensors").write_bytes(b"fake")
    (ns_dir / fan).symlink_to(outside)  # a symlinked fan-out directory: never followed
    (cache_dir / ("ff" * 16)).symlink_to(outside)  # a symlinked namespace
    ns = only(scan_cache(cache_dir, store.layout_key))
    assert ns.missing == (seg_a.stem,) and ns.orphans == (seg_b.stem,)
    assert [t.relpath for t in ns.temps] == [f"{seg_b.parent.name}/.{seg_b.stem}.4194305.deadbeef.tmp"]
    assert ns.temps[0].leftover
    assert fan in ns.symlinks and f"{seg_b.parent.name}/notes.tmp" in ns.other
    assert fan * 16 not in ns.files
    full = scan_cache(cache_dir)
    assert [n.name for n in full.namespaces] == [store.layout_key] and full.symlinks == ("ff" * 16,)


def test_malformed_rows_and_future_access_are_reported(cache):
    cache_dir, store, (a, _) = cache
    ns_dir = store.namespace_dir
    sql(ns_dir, "UPDATE blocks SET last_access='yesterday' WHERE hash=?", (a[1].block_hash,))
    sql(ns_dir, "UPDATE blocks SET hash='../../victim' WHERE hash=?", (a[4].block_hash,))
    sql(ns_dir, "UPDATE blocks SET last_access=? WHERE hash=?", (NOW + 10 * 86400, a[0].block_hash))
    ns = only(scan_cache(cache_dir, now=NOW))
    assert len(ns.bad_rows) == 2 and len(ns.rows) == 6
    assert ns.future_rows == (a[0].block_hash,)
    assert ns.tree.nodes[a[0].block_hash].last_access == NOW  # clamped
    assert a[2].block_hash in ns.tree.unrooted()  # its parent's row is malformed


def test_symlinked_index_is_never_opened(cache, tmp_path):
    cache_dir, store, _ = cache
    victim = tmp_path / "victim.db"
    victim.write_bytes(b"precious")
    wal = store.namespace_dir / "index.sqlite-wal"
    wal.unlink(missing_ok=True)
    wal.symlink_to(victim)
    ns = only(scan_cache(cache_dir))
    assert ns.status == S.UNREADABLE and ns.cause == "link" and "never followed" in ns.message
    assert victim.read_bytes() == b"precious"


def test_scan_errors(cache, tmp_path):
    cache_dir, _, _ = cache
    with pytest.raises(ScanError, match="no namespace"):
        scan_cache(cache_dir, "zz")
    assert scan_cache(tmp_path / "absent").namespaces == ()  # not created yet: an empty cache
    (tmp_path / "file").write_text("x")
    with pytest.raises(ScanError, match="not a directory"):
        scan_cache(tmp_path / "file")
    assert ScanError("x").exit_code == 2


# ------------------------------------------------------------------ chain tree properties
def _h(i: int) -> str:
    return f"{i:032x}"


ROOT = root_parent("f" * 32)


@st.composite
def parent_graphs(draw, max_nodes: int = 30):
    """Random rows: parents drawn from the rows themselves (cycles and self-loops included), the
    root parent, or an absent hash."""
    n = draw(st.integers(0, max_nodes))
    targets = st.one_of(st.integers(0, max(n - 1, 0)).map(_h), st.just(ROOT), st.just("e" * 32))
    parents = [draw(targets) if n else ROOT for _ in range(n)]
    times = draw(st.lists(st.floats(0, 2 * NOW, allow_nan=False), min_size=n, max_size=n))
    return [(_h(i), p, t) for i, (p, t) in enumerate(zip(parents, times))]


def _walk(parent: dict, h: str) -> list[str]:
    """h, its parent, ... while stored, stopping before a repeat."""
    out, seen = [], set()
    while h in parent and h not in seen:
        seen.add(h)
        out.append(h)
        h = parent[h]
    return out


@settings(max_examples=300, deadline=None)
@given(parent_graphs())
def test_chain_tree_properties(entries):
    tree = build_chain_tree(entries, ROOT, now=NOW)  # terminates on any parent links
    parent = {h: p for h, p, _ in entries}
    access = {h: min(t, NOW) for h, _, t in entries}
    assert set(tree.nodes) == set(parent)
    for h, node in tree.nodes.items():
        chain = _walk(parent, h)
        end = parent[chain[-1]]
        in_cycle = h in _walk(parent, parent[h]) if parent[h] in parent else False
        assert node.in_cycle == in_cycle
        assert node.rooted == (end == ROOT and end not in parent)
        below = {x for x in parent if h in _walk(parent, x)}  # h's subtree (h included)
        assert tree.descendants([h]) == below
        assert node.effective_access == max(access[x] for x in below)
        assert node.last_access == access[h]
        if node.in_cycle or parent[h] not in parent:
            assert node.depth == 0
        else:
            assert node.depth == tree.nodes[parent[h]].depth + 1
        if parent[h] in parent:
            assert tree.nodes[parent[h]].effective_access >= node.effective_access


@settings(max_examples=300, deadline=None)
@given(n=st.integers(0, 40), data=st.data())
def test_rooted_nodes_by_pointer_jumping_equals_the_forest(n, data):
    """`rooted_nodes` (validate's reachability) is `build_forest(...).rooted` on any parent links:
    chains, cycles, self-loops, nodes below a cycle, tops at the root or not."""
    parent = np.array(data.draw(st.lists(st.integers(-1, max(n - 1, -1)), min_size=n, max_size=n)), dtype=np.int64)
    at_root = np.array(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)), dtype=bool)
    assert np.array_equal(rooted_nodes(parent, at_root), build_forest(parent, at_root, None).rooted)


def test_rooted_nodes_of_a_long_chain_and_a_long_cycle():
    n = 5000
    chain = np.arange(-1, n - 1)  # node i's parent is i - 1: depth n - 1
    assert rooted_nodes(chain, np.arange(n) == 0).all() and not rooted_nodes(chain, np.zeros(n, bool)).any()
    cycle = np.roll(np.arange(n), 1)  # one cycle through every node
    assert not rooted_nodes(cycle, np.ones(n, bool)).any()


def test_chain_tree_big_cycle_and_long_chain_are_linear():
    n = 50_000
    cyc = [(_h(i), _h((i + 1) % n), float(i)) for i in range(n)]
    tree = build_chain_tree(cyc, ROOT)
    assert all(nd.in_cycle and not nd.rooted and nd.effective_access == n - 1 for nd in tree.nodes.values())
    line = [(_h(0), ROOT, 5.0)] + [(_h(i), _h(i - 1), float(i % 7)) for i in range(1, n)]
    tree = build_chain_tree(line, ROOT)
    assert tree.nodes[_h(0)].effective_access == 6.0 and max_depth(tree) == n - 1 and tree.unrooted() == []


# ------------------------------------------------------------------ MLX boundary
def _mlx_modules(args: list[str], cwd: Path) -> tuple[subprocess.CompletedProcess, set[str]]:
    res = subprocess.run([sys.executable, "-X", "importtime", "-m", "kvtool.cli.app", *args], cwd=cwd,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    names = {line.rsplit("|", 1)[-1].strip() for line in res.stderr.splitlines() if line.startswith("import time:")}
    return res, {n for n in names if n.split(".")[0].startswith("mlx")}


@pytest.mark.parametrize(
    "args",
    [
        ["validate", "--help"],
        ["validate", "--json"],
        ["validate", "--deep", "--rebuild-index"],
        ["prune", "--dry-run", "--json"],
        ["inspect", "--json"],
    ],
    ids=lambda a: " ".join(a),
)
@pytest.mark.slow
def test_operator_commands_never_import_mlx(tmp_path, args):
    cache_dir = tmp_path / "kv"
    store = open_store(cache_dir)  # a real namespace: validate/prune/inspect read it
    store.save_blocks(make_chain(store.layout_key, np.arange(8)))
    store.close()
    cmd = args if args[-1] == "--help" else [*args, "--cache-dir", str(cache_dir)]
    res, mlx = _mlx_modules(cmd, REPO)
    assert res.returncode == 0, res.stderr[-2000:]
    assert mlx == set(), f"{' '.join(args)} imported {sorted(mlx)}"


@pytest.mark.slow
def test_validate_on_an_empty_cache_never_imports_mlx(tmp_path):
    res, mlx = _mlx_modules(["validate", "--cache-dir", str(tmp_path)], REPO)
    assert res.returncode == 0 and "no namespaces" in res.stdout and mlx == set()


def test_the_three_commands_share_the_scan_and_prune_never_imports_inspect():
    """Inspect, validate and prune all plan from `scan_cache`; prune does not depend on
    inspect. (Checked on the import statements of each module.)"""
    import ast

    def imports(module: str) -> set[str]:
        tree = ast.parse((REPO / "kvtool" / "ops" / f"{module}.py").read_text())
        return {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}

    for module in ("inspect_cache", "validate", "prune"):
        assert "kvtool.ops.scan" in imports(module), module
    assert not any("inspect" in m for m in imports("prune"))


def test_layout_key_recipe_is_shared_with_prefix_cache(tmp_path):
    """A namespace written by PrefixCache (incl. sliding-window and quantisation meta) scans as ok:
    `kvtool.hashing.layout_key_of_meta` is the one recipe both use."""
    from kvtool.cache.prefix import KVGeometry, PrefixCache
    from kvtool.config import KVToolConfig
    from kvtool.hashing import layout_key_of_meta

    pc = PrefixCache(KVToolConfig(ssd_cache_dir=tmp_path, ram_bytes=0), geometry=KVGeometry(2, 2, 8), model_id="m" * 32,
                     model_class="x.Model")
    meta = pc._namespace_meta(64)
    assert layout_key_of_meta(meta, 2) == pc.layout_key
    for extra in ({"kv_windows": "96,-"}, {"kv_quantization": "kv_bits=8;group=64"}):
        assert layout_key_of_meta({**meta, **extra}, 2) != pc.layout_key
    pc.close()
    scan = scan_cache(tmp_path)
    assert [ns.status.value for ns in scan.namespaces] == ["empty"] or [ns.status.value for ns in scan.namespaces] == ["ok"]
