"""Tests of kvtool.ops.clean_segments: the fast path of `kvtool validate` calls a segment clean
only when the general path would find nothing wrong with it, whatever was damaged (a record's
bytes, a token id, a header byte, a header edited and resealed, a row), with one process or
several; and `validate --deep` finds each damage through it."""

from __future__ import annotations

import dataclasses
import os
import sqlite3
import struct
import threading

import numpy as np
import pytest

from kvtool.disk import segment as seg
from kvtool.disk.confined import ConfinedDir
from kvtool.disk.fsops import FileOps
from kvtool.disk.verify import header_digest
from kvtool.ops import clean_segments
from kvtool.ops.clean_segments import CleanSegments, find_clean
from kvtool.ops.scan import scan_cache
from kvtool.ops.validate import validate
from tests.store_helpers import block_path, flip_record_byte, make_chain, open_store, record_span


@pytest.fixture
def cache(tmp_path):
    """A closed cache, one namespace: chain A (4 blocks + tail entry, one segment), chain B
    (3 blocks, one segment each), chain C (6 blocks, one segment). Yields (cache_dir, store, chains)."""
    cache_dir = tmp_path / "kv"
    store = open_store(cache_dir)
    a = make_chain(store.layout_key, np.arange(18), tail=True)
    b = make_chain(store.layout_key, np.arange(100, 112), seed=10)
    c = make_chain(store.layout_key, np.arange(200, 224), seed=20)
    assert set(store.save_blocks(a)) == {"saved"}
    for blk in b:
        assert store.save_block(blk) == "saved"
    assert set(store.save_blocks(c)) == {"saved"}
    store.close()
    return cache_dir, store, (a, b, c)


def verdicts(cache_dir, deep: bool, workers: int = 1) -> tuple[dict[str, bool], CleanSegments]:
    """segment name -> clean, as `find_clean` decides on a fresh scan."""
    scan = scan_cache(cache_dir)
    (ns,) = scan.namespaces
    exp = ns.expected
    with ConfinedDir(scan.cache_dir, ns.name) as cdir:
        got = find_clean(cdir, ns.name, exp.kv, exp.block_size, ns.table, dict(ns.files), deep, workers=workers)
    return dict(zip(ns.table.segments, got.clean.tolist())), got


def name_of(store, block_hash: str) -> str:
    return block_path(store, block_hash).name.split(".")[0]


def reseal(path, edit) -> None:
    """Rewrite the header of segment `path` with `edit(header_bytes)` (same length) and a header
    checksum that matches the edit: a damage only the slot checks can find."""
    data = bytearray(path.read_bytes())
    (n,) = struct.unpack_from("<Q", data, 0)
    header = edit(bytes(data[8 : 8 + n]))
    assert len(header) == n and header != bytes(data[8 : 8 + n])
    key = b'"header_checksum":"'
    at = header.find(key) + len(key)
    header = header[:at] + header_digest(header).encode() + header[at + 32 :]
    data[8 : 8 + n] = header
    path.write_bytes(bytes(data))


def test_every_segment_as_written_is_clean(cache):
    cache_dir, store, (a, b, c) = cache
    for deep in (False, True):
        clean, got = verdicts(cache_dir, deep)
        assert len(clean) == 5 and all(clean.values())  # full blocks, a tail entry, 1 to 6 slots
        assert (got.size > 0).all() and (got.created > 0).all()
    rep = validate(cache_dir, deep=True, dry_run=True).namespaces[0]
    assert (rep.outcome, rep.problems) == ("clean", 0)


@pytest.mark.parametrize("where", [0.0, 0.5, 1.0])
def test_a_flipped_record_byte_is_not_clean_under_deep(cache, where):
    cache_dir, store, (a, b, c) = cache
    victim = c[2].block_hash
    flip_record_byte(store, victim, where=where)
    clean, _ = verdicts(cache_dir, deep=True)
    assert [name for name, ok in clean.items() if not ok] == [name_of(store, victim)]
    rep = validate(cache_dir, deep=True, dry_run=True).namespaces[0]
    assert rep.corrupt_removed == 1 and rep.broken_chain_removed == 3  # the block and what hangs below it


def test_a_flipped_kv_byte_passes_the_shallow_check(cache):
    cache_dir, store, (a, b, c) = cache
    flip_record_byte(store, c[2].block_hash, where=0.9)  # KV bytes, not token ids: only the checksum sees it
    clean, _ = verdicts(cache_dir, deep=False)
    assert all(clean.values())


def test_a_wrong_token_id_is_never_clean(cache):
    cache_dir, store, (a, b, c) = cache
    path = block_path(store, a[1].block_hash)
    off, _ = record_span(path, a[1].block_hash)
    data = bytearray(path.read_bytes())
    data[off + 4] ^= 0x01  # the second token id of block 1
    path.write_bytes(bytes(data))
    for deep in (False, True):
        clean, _ = verdicts(cache_dir, deep)
        assert [name for name, ok in clean.items() if not ok] == [path.name.split(".")[0]]
    rep = validate(cache_dir, deep=True, dry_run=True).namespaces[0]
    assert rep.corrupt_removed == 1


@pytest.mark.parametrize("where", [b'"data_offsets"', b'"created":"'])
def test_a_flipped_header_byte_is_not_clean(cache, where):
    cache_dir, store, (a, b, c) = cache
    path = block_path(store, c[0].block_hash)
    data = bytearray(path.read_bytes())
    at = data.find(where) + len(where)
    data[at - 3 if where == b'"data_offsets"' else at] ^= 0x01  # a letter of a key; a digit of the time
    path.write_bytes(bytes(data))
    clean, _ = verdicts(cache_dir, deep=True)
    assert not clean[path.name.split(".")[0]] and sum(clean.values()) == 4


@pytest.mark.parametrize("field", ["parent", "n_tokens", "checksum", "layout", "offsets"])
def test_a_resealed_header_edit_is_not_clean(cache, field):
    """A header whose checksum matches but whose content disagrees with the rows or the records."""
    cache_dir, store, (a, b, c) = cache
    path = block_path(store, c[3].block_hash)
    meta = seg.parse_header(path.read_bytes(), path.stat().st_size).meta

    def edit(header: bytes) -> bytes:
        h, p, n, ck = meta["b3"].split(":")
        if field == "parent":
            return header.replace(p.encode(), ("0" * 32).encode(), 1)
        if field == "n_tokens":  # one token more or less: its record size no longer fits
            other = str(int(n) + 1 if int(n) % 10 != 9 else int(n) - 1)
            return header.replace(f"{h}:{p}:{n}:".encode(), f"{h}:{p}:{other}:".encode())
        if field == "checksum":  # another record's checksum
            return header.replace(ck.encode(), meta["b2"].split(":")[3].encode())
        if field == "layout":
            return header.replace(b'"dtype":"bfloat16"', b'"dtype":"float16\\u0000"'[:18])
        return header.replace(b'"data_offsets":[0,', b'"data_offsets":[1,')

    reseal(path, edit)
    clean, _ = verdicts(cache_dir, deep=True)
    assert not clean[path.name.split(".")[0]] and sum(clean.values()) == 4
    assert validate(cache_dir, deep=True, dry_run=True).namespaces[0].problems > 0


@pytest.mark.parametrize("column", ["parent", "tokens_digest", "num_tokens", "nbytes", "slot"])
def test_a_wrong_row_makes_its_segment_not_clean(cache, column):
    cache_dir, store, (a, b, c) = cache
    victim = c[4].block_hash
    value = {"parent": "0" * 32, "tokens_digest": "f" * 32, "num_tokens": 3, "nbytes": 7, "slot": 0}[column]
    with sqlite3.connect(store.namespace_dir / "index.sqlite") as conn:
        conn.execute(f"UPDATE blocks SET {column} = ? WHERE hash = ?", (value, victim))
    clean, _ = verdicts(cache_dir, deep=True)
    assert [name for name, ok in clean.items() if not ok] == [name_of(store, victim)]
    rep = validate(cache_dir, deep=True, dry_run=True).namespaces[0]
    assert rep.rows_repaired == 1  # rewritten from its record: nothing lost


def test_a_slot_without_a_row_is_not_clean(cache):
    cache_dir, store, (a, b, c) = cache
    with sqlite3.connect(store.namespace_dir / "index.sqlite") as conn:
        conn.execute("DELETE FROM blocks WHERE hash = ?", (c[5].block_hash,))
    clean, _ = verdicts(cache_dir, deep=True)
    assert [name for name, ok in clean.items() if not ok] == [name_of(store, c[0].block_hash)]
    assert validate(cache_dir, deep=True, dry_run=True).namespaces[0].orphans_adopted == 1


@pytest.mark.parametrize("created", [1e20, float("nan"), 7.0])
def test_creation_times_read_as_the_general_path_reads_them(tmp_path, created):
    from kvtool.ops.records import created_of

    store = open_store(tmp_path / "kv")
    blocks = make_chain(store.layout_key, np.arange(32))
    assert set(store.save_blocks(blocks)) == {"saved"}
    store.close()
    path = block_path(store, blocks[0].block_hash)
    data = path.read_bytes()
    header = seg.parse_header(data, len(data))
    new, _ = seg.encode(blocks, store.layout_key, header.kv, created)
    path.write_bytes(b"".join(bytes(b) for b in new))
    with sqlite3.connect(store.namespace_dir / "index.sqlite") as conn:
        conn.execute("UPDATE segments SET nbytes = ?", (path.stat().st_size,))
    clean, got = verdicts(tmp_path / "kv", deep=True)
    assert all(clean.values())
    want = created_of(seg.parse_header(path.read_bytes(), path.stat().st_size))
    assert got.created.tolist() == [want]


def test_workers_give_the_same_verdicts(cache):
    cache_dir, store, (a, b, c) = cache
    flip_record_byte(store, b[1].block_hash)
    flip_record_byte(store, c[5].block_hash, where=0.0)
    one, got1 = verdicts(cache_dir, deep=True, workers=1)
    two, got2 = verdicts(cache_dir, deep=True, workers=2)
    assert one == two and sum(one.values()) == 3
    assert np.array_equal(got1.size, got2.size) and np.array_equal(got1.created, got2.created)


@pytest.mark.parametrize("gap, fast", [(1 << 16, True), (8, False)])
def test_shallow_reads_a_large_file_whole_only_where_the_general_way_would(cache, monkeypatch, gap, fast):
    """Without `deep`, a file over `SHALLOW_MAX` is checked fast only if its records' token ids lie
    within `SHALLOW_GAP` of each other (the general way would read it whole too); else the general
    way reads just its header and token ids. Either way validate finds it clean."""
    cache_dir, store, (a, b, c) = cache
    monkeypatch.setattr(clean_segments, "SHALLOW_MAX", 64)  # every test segment is larger
    monkeypatch.setattr(clean_segments, "SHALLOW_GAP", gap)
    clean, _ = verdicts(cache_dir, deep=False)
    assert all(clean.values()) == fast and (any(clean.values()) == fast)
    assert all(verdicts(cache_dir, deep=True)[0].values())  # `deep` reads every byte anyway
    rep = validate(cache_dir, dry_run=True).namespaces[0]
    assert (rep.outcome, rep.problems) == ("clean", 0)


@pytest.mark.parametrize("swap", ["fifo", "symlink", "gone"])
def test_a_file_swapped_after_the_listing_is_never_opened_nor_clean(cache, swap):
    """Between the listing and the check, a segment file becomes a FIFO (never opened: no hang),
    a symlink to a good copy (never followed) or nothing: that segment is not clean, the others are."""
    cache_dir, store, (a, b, c) = cache
    scan = scan_cache(cache_dir)
    (ns,) = scan.namespaces
    path = block_path(store, c[0].block_hash)
    copy = path.with_name("copy")
    path.rename(copy)
    if swap == "fifo":
        os.mkfifo(path)
    elif swap == "symlink":
        path.symlink_to(copy)
    with ConfinedDir(scan.cache_dir, ns.name) as cdir:
        got = find_clean(cdir, ns.name, ns.expected.kv, ns.expected.block_size, ns.table, dict(ns.files), True)
    clean = dict(zip(ns.table.segments, got.clean.tolist()))
    assert [name for name, ok in clean.items() if not ok] == [path.name.split(".")[0]]


# ------------------------------------------------------------------ the listing, batches
def test_only_files_listed_as_read_are_clean(cache):
    """A segment is clean only if the listing has it, with the size of the file judged (a file
    listed with another size, or not listed, goes the general way)."""
    cache_dir, store, (a, b, c) = cache
    scan = scan_cache(cache_dir)
    (ns,) = scan.namespaces
    exp = ns.expected
    names = ns.table.segments
    files = dict(ns.files)
    changed, gone = names[0], names[1]
    files[changed] = dataclasses.replace(files[changed], size=files[changed].size + 1)
    del files[gone]
    with ConfinedDir(scan.cache_dir, ns.name) as cdir:
        got = find_clean(cdir, ns.name, exp.kv, exp.block_size, ns.table, files, True)
    clean = dict(zip(names, got.clean.tolist()))
    assert [n for n, ok in clean.items() if not ok] == sorted([changed, gone])
    assert all(got.size[i] == 0 and got.created[i] == 0 for i in (0, 1))


def test_batches_of_any_size_give_the_same_verdicts(cache, monkeypatch):
    """Headers judged in batches of any byte size (one file, two, all): the same verdicts."""
    cache_dir, store, (a, b, c) = cache
    flip_record_byte(store, c[2].block_hash)
    want, _ = verdicts(cache_dir, deep=True)
    sizes = sorted(f.stat().st_size for f in cache_dir.rglob("*.safetensors"))
    for room in (sizes[0] + 1, sizes[-1] + 1, sizes[0] + sizes[1] + 1):
        monkeypatch.setattr(clean_segments, "BATCH_BYTES", room)
        assert verdicts(cache_dir, deep=True)[0] == want
    assert sum(want.values()) == len(want) - 1


class _NoListing(FileOps):
    """Lists nothing inside a namespace directory (the listing fails after the rows are read)."""

    def listdir(self, path):
        if len(path.name) == 32:
            raise PermissionError(13, "listing refused", str(path))
        return super().listdir(path)


def test_a_namespace_whose_listing_fails_leaves_nothing_behind(cache):
    """The rows are read, the listing then fails, so the namespace is unreadable and never
    planned: no descriptor or thread is left behind."""
    cache_dir, store, chains = cache
    fds = set(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else None
    threads = {t.name for t in threading.enumerate()}
    plan = validate(cache_dir, deep=True, dry_run=True, fs=_NoListing())
    (rep,) = plan.namespaces
    assert rep.status == "unreadable" and "cannot list" in rep.message
    assert {t.name for t in threading.enumerate()} <= threads
    if fds is not None:
        assert set(os.listdir("/proc/self/fd")) <= fds
