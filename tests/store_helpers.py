"""Helpers for the SSD tier tests: random host blocks, chains, namespace meta, fault-injecting FileOps."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import numpy as np

from kvtool.blocks import HostBlock, chain_hashes, layout_key, root_parent
from kvtool.store.fsops import FileOps
from kvtool.store.ssd import SSDStore

STORAGE = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}
GEOMETRY = dict(n_layers=2, n_kv_heads=2, head_dim=8, block_size=4)


def make_layout(dtype: str = "bfloat16", model_id: str = "test-model", **geometry) -> str:
    g = {**GEOMETRY, **geometry}
    return layout_key(model_id, g["n_layers"], g["n_kv_heads"], g["head_dim"], dtype, g["block_size"])


def make_meta(dtype: str = "bfloat16", model_id: str = "test-model", **geometry) -> dict[str, str]:
    g = {**GEOMETRY, **geometry}
    return {"model_id": model_id, "model_name": "test", "kv_dtype": dtype, **{k: str(v) for k, v in g.items()}}


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


def make_chain(layout: str, token_ids, dtype: str = "bfloat16", seed: int = 0, block_size: int = 4) -> list[HostBlock]:
    """The blocks of a prompt, with real chain hashes (first parent = the layout's root parent)."""
    ids = np.asarray(token_ids, dtype=np.int32)
    hashes = chain_hashes(ids, block_size, layout)
    parents = [root_parent(layout), *hashes[:-1]]
    return [
        make_block(h, p, ids[i * block_size : (i + 1) * block_size], dtype, seed + i)
        for i, (h, p) in enumerate(zip(hashes, parents))
    ]


def assert_same_block(a: HostBlock, b: HostBlock) -> None:
    """Bit-exact equality (compares raw bytes, so NaN patterns count)."""
    assert (a.block_hash, a.parent_hash, a.dtype) == (b.block_hash, b.parent_hash, b.dtype)
    assert np.array_equal(a.token_ids, b.token_ids) and a.token_ids.dtype == np.int32
    assert len(a.keys) == len(b.keys) == len(a.values) == len(b.values)
    for x, y in zip([*a.keys, *a.values], [*b.keys, *b.values]):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert x.tobytes() == y.tobytes()


def open_store(cache_dir: Path, dtype: str = "bfloat16", **kw) -> SSDStore:
    return SSDStore(cache_dir, make_layout(dtype), make_meta(dtype), **kw)


def block_path(store: SSDStore, block_hash: str) -> Path:
    return store.namespace_dir / block_hash[:2] / f"{block_hash}.safetensors"


class FaultFS(FileOps):
    """FileOps that counts calls and raises `OSError(fail[op])` from the named operations.

    Args:
        fail: op name ('open_new', 'write_all', 'fsync', 'replace', 'read_bytes', 'makedirs',
            'fsync_dir', 'unlink', ...) -> errno to raise.
    """

    def __init__(self, fail: dict[str, int] | None = None):
        self.fail = dict(fail or {})
        self.calls: dict[str, int] = {}

    def _hit(self, op: str) -> None:
        self.calls[op] = self.calls.get(op, 0) + 1
        if op in self.fail:
            code = self.fail[op]
            raise OSError(code, f"injected {os.strerror(code)} in {op}")

    def makedirs(self, path):
        self._hit("makedirs")
        return super().makedirs(path)

    def open_new(self, path):
        self._hit("open_new")
        return super().open_new(path)

    def write_all(self, fd, data):
        if "write_all" in self.fail:  # a partial write first, like a disk filling up
            os.write(fd, bytes(memoryview(data)[:7]))
        self._hit("write_all")
        return super().write_all(fd, data)

    def fsync(self, fd):
        self._hit("fsync")
        return super().fsync(fd)

    def fsync_dir(self, path):
        self._hit("fsync_dir")
        return super().fsync_dir(path)

    def replace(self, src, dst):
        self._hit("replace")
        return super().replace(src, dst)

    def unlink(self, path, missing_ok=True):
        self._hit("unlink")
        return super().unlink(path, missing_ok)

    def read_bytes(self, path):
        self._hit("read_bytes")
        return super().read_bytes(path)


ERRNOS = {"ENOSPC": errno.ENOSPC, "EIO": errno.EIO, "EACCES": errno.EACCES, "EROFS": errno.EROFS}
