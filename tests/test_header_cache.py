"""Tests of kvtool.disk.header_cache: parsed segment headers reused per process, only while a
file's header bytes are the verified ones.

- a segment read twice is parsed once;
- a segment rewritten in place (same path, inode and size, its mtime put back) with a damaged
  record still fails that record's checksum on the next restore: the chain is cut there;
- rewritten in place with a damaged header (not re-sealed), it is parsed again and refused;
- rewritten in place with another valid header of the same size, the new header is used;
- the cache stays within its bounds (entries and bytes), least recently used first out.
"""

from __future__ import annotations

import os

import numpy as np

from kvtool.disk import restore
from kvtool.disk import segment as seg
from kvtool.disk.header_cache import HEADERS, HeaderCache
from kvtool.hashing import root_parent
from tests.store_helpers import block_path, encode_segment, make_chain, open_store, record_span, segment_files
from tests.test_restore import Buffers, expected_bytes, offsets


def saved(store, n_tokens=30):
    ids = np.arange(500, 500 + n_tokens, dtype=np.int32)
    chain = make_chain(store.layout_key, ids, "bfloat16", seed=3)
    assert set(store.save_blocks(chain)) == {"saved"}
    assert len(segment_files(store)) == 1
    return chain, ids


def restore_all(store, chain, ids):
    rows = store.lookup([b.block_hash for b in chain])
    bufs = Buffers(store.expected.kv, len(ids) + 4)
    res = restore.restore_chain(store, rows, root_parent(store.layout_key), ids, offsets(rows), bufs.dest, False)
    return res, bufs


def rewrite_in_place(path, data: bytes) -> None:
    """Write `data` over the file at `path` (same inode; the size must not change) and put its
    mtime back: the file's `fstat` identity is what it was."""
    st = os.stat(path)
    assert len(data) == st.st_size
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, data, 0)
    finally:
        os.close(fd)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    after = os.stat(path)
    assert HeaderCache.key_of(after) == HeaderCache.key_of(st)


def test_a_segment_is_parsed_once(tmp_path):
    store = open_store(tmp_path)
    chain, ids = saved(store)
    misses, hits = HEADERS.misses, HEADERS.hits
    for _ in range(3):
        res, bufs = restore_all(store, chain, ids)
        assert (res.n_ok, res.failure) == (len(chain), None)
        assert bufs.tokens_bytes(len(chain) * 4) == expected_bytes(chain, len(chain))
    assert HEADERS.misses - misses == 1 and HEADERS.hits - hits == 2
    store.close()


def test_rewritten_in_place_with_a_damaged_record_is_still_caught(tmp_path):
    store = open_store(tmp_path)
    chain, ids = saved(store)
    assert restore_all(store, chain, ids)[0].n_ok == len(chain)  # its header is cached now
    victim = chain[4]
    path = block_path(store, victim.block_hash)
    off, n = record_span(path, victim.block_hash)
    data = bytearray(path.read_bytes())
    data[off + n // 2] ^= 0x10
    rewrite_in_place(path, bytes(data))
    hits = HEADERS.hits
    res, bufs = restore_all(store, chain, ids)
    assert HEADERS.hits == hits + 1  # the header bytes are unchanged: reused, as a parse would give it
    assert res.n_ok == 4 and res.failure is not None and res.failure.startswith("checksum")
    assert bufs.tokens_bytes(16) == expected_bytes(chain, 4)
    assert store.stats()["ssd_load_corrupt"] == 1
    assert store.lookup([victim.block_hash]) == []  # its row is dropped
    store.close()


def test_rewritten_in_place_with_a_damaged_header_is_parsed_again_and_refused(tmp_path):
    store = open_store(tmp_path)
    chain, ids = saved(store)
    assert restore_all(store, chain, ids)[0].n_ok == len(chain)
    path = block_path(store, chain[0].block_hash)
    data = bytearray(path.read_bytes())
    at = bytes(data).find(chain[2].block_hash.encode())  # a slot's hash in the metadata
    data[at] = ord("0") if data[at] != ord("0") else ord("1")
    rewrite_in_place(path, bytes(data))
    misses = HEADERS.misses
    res, _ = restore_all(store, chain, ids)
    assert HEADERS.misses == misses + 1
    assert res.n_ok == 0 and res.failure is not None
    assert store.stats()["ssd_load_corrupt"] == 1
    assert store.lookup([chain[0].block_hash]) == []  # the segment's rows are dropped
    store.close()


def test_rewritten_in_place_with_another_valid_header_uses_the_new_one(tmp_path):
    """The same blocks encoded again with another creation time (same length): another header,
    valid, of the same size; the restore reads it, not the cached one."""
    store = open_store(tmp_path)
    chain, ids = saved(store)
    path = block_path(store, chain[0].block_hash)
    old = path.read_bytes()
    old_header = seg.parse_header(old, len(old))
    assert restore_all(store, chain, ids)[0].n_ok == len(chain)
    created = float(old_header.meta["created"])
    # another creation time whose encoding has the same length (one of these shifts keeps the digits)
    candidates = (encode_segment(chain, store.layout_key, created=created + d) for d in (1.0, -1.0, 2.0, -2.0, 0.5, -0.5))
    new = next((c for c in candidates if len(c) == len(old)), None)
    assert new is not None, "no other creation time encodes to a header of the same length"
    assert new != old
    rewrite_in_place(path, new)
    misses = HEADERS.misses
    res, bufs = restore_all(store, chain, ids)
    assert HEADERS.misses == misses + 1
    assert (res.n_ok, res.failure) == (len(chain), None)
    assert bufs.tokens_bytes(len(chain) * 4) == expected_bytes(chain, len(chain))
    store.close()


def test_bounds_least_recently_used_first(tmp_path):
    store = open_store(tmp_path)
    paths = []
    for seed in range(4):
        ids = np.arange(100 * seed, 100 * seed + 8, dtype=np.int32)
        chain = make_chain(store.layout_key, ids, "bfloat16", seed=seed)
        assert set(store.save_blocks(chain)) == {"saved"}
        paths.append(block_path(store, chain[0].block_hash))
    cache = HeaderCache(max_entries=2)

    def read(path):
        fd = os.open(path, os.O_RDONLY)
        try:
            return cache.read(fd, os.fstat(fd))
        finally:
            os.close(fd)

    for p in paths[:3]:
        read(p)
    assert len(cache) == 2 and cache.misses == 3
    read(paths[2])
    assert cache.hits == 1
    read(paths[0])  # evicted (least recently used): parsed again
    assert cache.misses == 4
    size = os.path.getsize(paths[0])
    head_len = 8 + int.from_bytes(paths[0].read_bytes()[:8], "little")
    small = HeaderCache(max_bytes=head_len - 1)  # a header larger than the whole cache is not kept
    fd = os.open(paths[0], os.O_RDONLY)
    try:
        assert small.read(fd, os.fstat(fd)).file_size == size
    finally:
        os.close(fd)
    assert len(small) == 0
    store.close()
