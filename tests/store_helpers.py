"""Helpers for the SSD tier tests: random host blocks, chains, namespace meta, segment paths,
record damage, a fault-injecting FileOps, and reads over the public API of the store, its
index, its chain tree and its writer's counters. MLX-free (store tests never load MLX)."""

from __future__ import annotations

import errno
import os
import sqlite3
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from kvtool.disk import segment as seg
from kvtool.disk.chains import ChainTree
from kvtool.disk.fsops import FileOps
from kvtool.disk.hostblock import HostBlock
from kvtool.disk.index import BlockIndex
from kvtool.disk.names import segment_relpath
from kvtool.disk.namespace import SSDStore
from kvtool.disk.rowtable import IndexRow
from kvtool.disk.segment import FORMAT_VERSION, KVLayout
from kvtool.hashing import chain_hashes, layout_key, root_parent, tail_hash
from kvtool.tiers.writer_batch import Counters

STORAGE = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}
GEOMETRY = dict(n_layers=2, n_kv_heads=2, head_dim=8, block_size=4)


def kv_layout(dtype: str = "bfloat16", **geometry) -> KVLayout:
    """The namespace KV layout for `GEOMETRY` (overridable: n_layers, n_kv_heads, head_dim)."""
    g = {**GEOMETRY, **geometry}
    return KVLayout.uniform(g["n_layers"], g["n_kv_heads"], g["head_dim"], dtype)


def make_layout(dtype: str = "bfloat16", model_id: str = "test-model", **geometry) -> str:
    """Layout key (namespace name) of a test namespace."""
    g = {**GEOMETRY, **geometry}
    return layout_key(model_id, kv_layout(dtype, **g).spec, dtype, g["block_size"], format_version=FORMAT_VERSION)


def make_meta(dtype: str = "bfloat16", model_id: str = "test-model", **geometry) -> dict[str, str]:
    """SSDStore meta (string values) of a test namespace."""
    g = {**GEOMETRY, **geometry}
    return {
        "model_id": model_id,
        "model_name": "test",
        "kv_dtype": dtype,
        "block_size": str(g["block_size"]),
        "kv_layers": kv_layout(dtype, **g).spec,
    }


def random_kv(rng: np.random.Generator, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """Random KV in the storage dtype (bfloat16 = random uint16 bit patterns, NaNs included)."""
    if dtype == "bfloat16":
        return rng.integers(0, 1 << 16, size=shape, dtype=np.uint16)
    return rng.standard_normal(shape).astype(STORAGE[dtype])


def make_block(
    block_hash: str,
    parent_hash: str,
    token_ids,
    dtype: str = "bfloat16",
    seed: int = 0,
    n_layers: int = GEOMETRY["n_layers"],
    n_kv_heads: int = GEOMETRY["n_kv_heads"],
    head_dim: int = GEOMETRY["head_dim"],
) -> HostBlock:
    """A block (or tail entry: any number of tokens) with random KV."""
    rng = np.random.default_rng(seed)
    ids = np.asarray(token_ids, dtype=np.int32)
    shape = (1, n_kv_heads, len(ids), head_dim)
    return HostBlock(
        block_hash=block_hash,
        parent_hash=parent_hash,
        token_ids=ids,
        keys=[random_kv(rng, dtype, shape) for _ in range(n_layers)],
        values=[random_kv(rng, dtype, shape) for _ in range(n_layers)],
        dtype=dtype,
    )


def make_chain(
    layout: str, token_ids, dtype: str = "bfloat16", seed: int = 0, block_size: int = 4, tail: bool = False
) -> list[HostBlock]:
    """The blocks of a prompt, with real chain hashes (first parent = the layout's root parent).

    With `tail=True` the prompt's trailing partial block (if any) is appended as a tail entry,
    keyed as `kvtool.hashing.tail_hash` keys it.
    """
    ids = np.asarray(token_ids, dtype=np.int32)
    hashes = chain_hashes(ids, block_size, layout)
    parents = [root_parent(layout), *hashes]
    blocks = [
        make_block(h, p, ids[i * block_size : (i + 1) * block_size], dtype, seed + i)
        for i, (h, p) in enumerate(zip(hashes, parents))
    ]
    if tail:
        t = tail_hash(ids, block_size, layout, hashes)
        if t is not None:
            blocks.append(make_block(t, parents[len(hashes)], ids[len(hashes) * block_size :], dtype, seed + len(hashes)))
    return blocks


def assert_same_block(a: HostBlock, b: HostBlock) -> None:
    """Bit-exact equality (compares raw bytes, so NaN patterns count)."""
    assert (a.block_hash, a.parent_hash, a.dtype) == (b.block_hash, b.parent_hash, b.dtype)
    assert np.array_equal(a.token_ids, b.token_ids) and a.token_ids.dtype == np.int32
    assert len(a.keys) == len(b.keys) == len(a.values) == len(b.values)
    for x, y in zip([*a.keys, *a.values], [*b.keys, *b.values]):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert x.tobytes() == y.tobytes()


def open_store(cache_dir: Path, dtype: str = "bfloat16", **kw) -> SSDStore:
    """An SSDStore of the default test namespace (`GEOMETRY`)."""
    return SSDStore(cache_dir, make_layout(dtype), make_meta(dtype), **kw)


# ----------------------------------------------------------------------------- reads
def contains(store_or_index: SSDStore | BlockIndex, block_hash: str) -> bool:
    """A store: True if its index has a usable row for `block_hash` (`count_prefix`; the file
    is not read). An index: True if `block_hash` has a well-formed row (`get`)."""
    if isinstance(store_or_index, SSDStore):
        return store_or_index.count_prefix([block_hash]) == 1
    return store_or_index.get(block_hash) is not None


def index_rows(index: BlockIndex) -> Iterator[IndexRow]:
    """Every well-formed row of `index` (a snapshot taken when called, ordered by hash)."""
    columns = "hash, parent, segment, slot, num_tokens, nbytes, tokens_digest, created, last_access"
    with index.connection() as conn:
        raw = conn.execute(f"SELECT {columns} FROM blocks ORDER BY hash").fetchall()
    return iter([r for r in map(IndexRow.from_db, raw) if r is not None])


def max_depth(tree: ChainTree) -> int:
    """The largest depth in `tree` (-1 when empty)."""
    return int(tree.forest.depth.max()) if len(tree.forest) else -1


def wait_counters(counters: Counters, predicate: Callable[[dict[str, int]], bool], timeout: float) -> bool:
    """Wait until `predicate(counters.snapshot())` holds (polled every millisecond).

    Returns:
        The predicate's last value (False if `timeout` seconds passed first).
    """
    deadline = time.monotonic() + timeout
    while not predicate(counters.snapshot()):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.001)
    return True


# ----------------------------------------------------------------------------- on disk
def encode_segment(blocks, layout: str, dtype: str | None = None, created: float = 0.0, kv: KVLayout | None = None) -> bytes:
    """The bytes of a segment file holding `blocks` (format 2)."""
    kv = kv or kv_layout(dtype or blocks[0].dtype)
    buffers, _ = seg.encode(blocks, layout, kv, created)
    return b"".join(bytes(b) for b in buffers)


def segment_name(store: SSDStore, block_hash: str) -> str | None:
    """Name of the segment holding `block_hash` per the store's index (raw read), or None."""
    row = store.index.get(block_hash) if store.index is not None else None
    if row is not None:
        return row.segment
    with sqlite3.connect(store.namespace_dir / "index.sqlite") as conn:
        found = conn.execute("SELECT segment FROM blocks WHERE hash=?", (block_hash,)).fetchone()
    return found[0] if found else None


def segment_path(store: SSDStore, name: str) -> Path:
    """Path of segment `name` of the store's namespace."""
    return store.namespace_dir / segment_relpath(name)


def block_path(store: SSDStore, block_hash: str) -> Path:
    """The segment file holding `block_hash` (found through the index).

    Raises:
        KeyError: the index has no row for the block.
    """
    name = segment_name(store, block_hash)
    if name is None:
        raise KeyError(f"no index row for {block_hash}")
    return segment_path(store, name)


def free_fan_out(ns_dir: Path) -> str:
    """A two-hex-digit fan-out directory name not present in `ns_dir` (segment names are random,
    so any fixed name may already be taken)."""
    return next(f"{i:02x}" for i in range(256) if not (ns_dir / f"{i:02x}").exists())


def segment_files(store_or_dir) -> list[Path]:
    """Every segment file of a namespace (a store or its namespace directory), sorted."""
    ns = store_or_dir.namespace_dir if isinstance(store_or_dir, SSDStore) else Path(store_or_dir)
    return sorted(p for p in ns.glob("??/*.safetensors") if not p.is_symlink())


def record_span(path: Path, block_hash: str) -> tuple[int, int]:
    """(file offset, length) of the record of `block_hash` inside segment file `path`."""
    header = read_segment_header(path)
    for s in header.slots:
        if s.block_hash == block_hash:
            return s.offset, s.nbytes
    raise KeyError(f"{block_hash} not in {path}")


def read_segment_header(path: Path) -> seg.SegmentHeader:
    """The parsed (verified) header of a segment file."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return seg.read_header(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


def flip_record_byte(store: SSDStore, block_hash: str, where: float = 0.5, bit: int = 0x40) -> Path:
    """Flip one bit inside the record of `block_hash` (its segment's other records stay intact).

    `where` is the relative position inside the record (0.0 = first byte, 1.0 = last byte).
    Returns the segment path.
    """
    path = block_path(store, block_hash)
    off, n = record_span(path, block_hash)
    pos = off + min(n - 1, int(where * (n - 1)))
    data = bytearray(path.read_bytes())
    data[pos] ^= bit
    path.write_bytes(bytes(data))
    return path


class FaultFS(FileOps):
    """FileOps that counts calls and raises `OSError(fail[op])` from the named operations.

    Args:
        fail: op name ('makedirs', 'open_new', 'write_all', 'fsync', 'close', 'fsync_dir',
            'replace', 'unlink', 'open_read', 'mtime',
            'listdir', ...) -> errno to raise.

    Attributes:
        calls: op name -> number of calls.
        paths: op name -> paths it was called with (path-taking ops only).
    """

    def __init__(self, fail: dict[str, int] | None = None):
        self.fail = dict(fail or {})
        self.calls: dict[str, int] = {}
        self.paths: dict[str, list[Path]] = {}

    def _hit(self, op: str, path=None) -> None:
        self.calls[op] = self.calls.get(op, 0) + 1
        if path is not None:
            self.paths.setdefault(op, []).append(Path(path))
        if op in self.fail:
            code = self.fail[op]
            raise OSError(code, f"injected {os.strerror(code)} in {op}", None if path is None else str(path))

    # write side
    def makedirs(self, path, mode=0o700):
        self._hit("makedirs", path)
        return super().makedirs(path, mode)

    def open_new(self, path):
        self._hit("open_new", path)
        return super().open_new(path)

    def write_all(self, fd, data):
        if "write_all" in self.fail:  # a partial write first, like a disk filling up
            bufs = data if isinstance(data, (list, tuple)) else [data]
            first = memoryview(bufs[0]).cast("B") if bufs else memoryview(b"")
            os.write(fd, bytes(first[:7]))
        self._hit("write_all")
        return super().write_all(fd, data)

    def fsync(self, fd):
        self._hit("fsync")
        return super().fsync(fd)

    def close(self, fd):
        try:
            super().close(fd)  # the descriptor is released even when a fault is injected
        finally:
            self._hit("close")

    def fsync_dir(self, path):
        self._hit("fsync_dir", path)
        return super().fsync_dir(path)

    def replace(self, src, dst):
        self._hit("replace", dst)
        return super().replace(src, dst)

    def unlink(self, path, missing_ok=True):
        self._hit("unlink", path)
        return super().unlink(path, missing_ok)

    # read side
    def open_read(self, path):
        self._hit("open_read", path)
        return super().open_read(path)

    def mtime(self, path):
        self._hit("mtime", path)
        return super().mtime(path)

    def listdir(self, path):
        self._hit("listdir", path)
        return super().listdir(path)

    # predicates: counted, never failed (they answer False instead of raising)
    def exists(self, path):
        self.calls["exists"] = self.calls.get("exists", 0) + 1
        return super().exists(path)

    def is_dir(self, path):
        self.calls["is_dir"] = self.calls.get("is_dir", 0) + 1
        return super().is_dir(path)


ERRNOS = {"ENOSPC": errno.ENOSPC, "EIO": errno.EIO, "EACCES": errno.EACCES, "EROFS": errno.EROFS}


def stored(store: SSDStore) -> set[str]:
    """Hashes of the rows in `store`'s index, read through a fresh connection."""
    idx = BlockIndex(store.namespace_dir / "index.sqlite", create=False)
    try:
        return {r.hash for r in index_rows(idx)}
    finally:
        idx.close()


@contextmanager
def mounted_tmpfs(mnt: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` (e.g. "4m") mounted on the new directory `mnt`, unmounted afterwards.
    Skips the test where mounting is not allowed (it needs root or CAP_SYS_ADMIN)."""
    mnt.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root / CAP_SYS_ADMIN): {res.stderr.strip()}")
    try:
        yield mnt
    finally:
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
