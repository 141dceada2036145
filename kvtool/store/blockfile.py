"""The block file format (version 1): one safetensors file per block.

Layout (see docs/DESIGN.md "Block file"): 8-byte little-endian header length `N`, `N` bytes
of JSON header (tensor table + string `__metadata__`), then the data section holding every
tensor's bytes. Tensors:

- `token_ids`: int32 `[block_size]`
- `layers.{i}.keys`, `layers.{i}.values`: `[1, n_kv_heads, block_size, head_dim]`,
  F32 / F16 / BF16 (BF16 travels in numpy as uint16 bit patterns).

Metadata (all strings): `format_version`, `layout_key`, `block_hash`, `parent_hash`,
`num_tokens`, `created`, `dtype`, `n_layers`, `checksum` (blake2b-128 hex of the data section).

Files are written with the real `safetensors.serialize`; reading parses the header and views
the tensors straight out of the one buffer the file was read into (no per-tensor copies).

This module never imports MLX at import time (the SSD writer thread calls it).
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import safetensors

from kvtool.hostblock import HostBlock

FORMAT_VERSION = 1
FILE_SUFFIX = ".safetensors"
CHECKSUM_BYTES = 16  # blake2b-128
MAX_HEADER_BYTES = 1 << 24  # a sane bound; real headers are a few KB
_CHECKSUM_PLACEHOLDER = "_" * (2 * CHECKSUM_BYTES)  # same length as the hex digest

# logical dtype name -> (safetensors header code, TensorSpec name, numpy storage dtype)
_DTYPES: dict[str, tuple[str, str, np.dtype]] = {
    "float32": ("F32", "float32", np.dtype("<f4")),
    "float16": ("F16", "float16", np.dtype("<f2")),
    "bfloat16": ("BF16", "bfloat16", np.dtype("<u2")),
}
_INT32 = ("I32", "int32", np.dtype("<i4"))
REQUIRED_META = ("format_version", "layout_key", "block_hash", "parent_hash", "num_tokens",
                 "created", "dtype", "n_layers", "checksum")  # fmt: skip


class BlockFileError(Exception):
    """A block file that must not be used.

    Attributes:
        kind: 'truncated' (shorter/longer than its header says), 'header' (unparseable
            header or metadata), 'version' (unknown format version), 'checksum' (data does not
            match its checksum), 'layout' (another namespace's block), 'hash' (not the block
            asked for), 'shape' (tensor names/shapes/dtypes inconsistent with the namespace),
            'tokens' (token ids differ from the expected ones).
    """

    def __init__(self, kind: str, message: str):
        super().__init__(f"{kind}: {message}")
        self.kind = kind


@dataclass(frozen=True)
class Expected:
    """What a block of one namespace must look like (all checks optional except geometry).

    Attributes:
        layout_key: the namespace's layout key.
        n_layers, n_kv_heads, head_dim, block_size: KV geometry.
        dtype: 'float32' | 'float16' | 'bfloat16'.
        block_hash: the hash the file is stored under, or None to skip the check.
    """

    layout_key: str
    n_layers: int
    n_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str
    block_hash: str | None = None

    @classmethod
    def from_meta(cls, layout_key: str, meta: dict[str, str], block_hash: str | None = None) -> "Expected":
        """Build from namespace index metadata (string values).

        Raises:
            KeyError, ValueError: a geometry key is missing or not an integer.
        """
        return cls(
            layout_key=layout_key,
            n_layers=int(meta["n_layers"]),
            n_kv_heads=int(meta["n_kv_heads"]),
            head_dim=int(meta["head_dim"]),
            block_size=int(meta["block_size"]),
            dtype=meta["kv_dtype"],
            block_hash=block_hash,
        )


@dataclass(frozen=True)
class Header:
    """A parsed block file header.

    Attributes:
        meta: the string metadata.
        tensors: name -> (dtype code e.g. 'BF16', shape, (start, end) offsets in the data section).
        data_start: byte offset of the data section in the file (8 + header length).
        data_len: bytes the tensors cover (the file must be exactly `data_start + data_len`).
    """

    meta: dict[str, str]
    tensors: dict[str, tuple[str, tuple[int, ...], tuple[int, int]]]
    data_start: int
    data_len: int

    @property
    def file_size(self) -> int:
        return self.data_start + self.data_len


def tokens_digest(token_ids: np.ndarray) -> str:
    """blake2b-128 hex of token ids as little-endian int32 (the index's `tokens_digest`)."""
    data = np.ascontiguousarray(token_ids, dtype="<i4").tobytes()
    return hashlib.blake2b(data, digest_size=CHECKSUM_BYTES).hexdigest()


def data_checksum(data: bytes | bytearray | memoryview) -> str:
    """blake2b-128 hex of a file's data section."""
    return hashlib.blake2b(data, digest_size=CHECKSUM_BYTES).hexdigest()


# --------------------------------------------------------------------------- encode
def encode(block: HostBlock, layout_key: str, created: float) -> bytes:
    """Serialize one block into the bytes of its block file.

    Args:
        block: the block; `keys[i]`/`values[i]` `[1, n_kv_heads, block_size, head_dim]` in the
            storage dtype of `block.dtype` (uint16 for bfloat16), `token_ids` int32 `[block_size]`.
        layout_key: namespace the file belongs to.
        created: creation time (unix seconds).

    Returns:
        The complete file content (safetensors).

    Raises:
        BlockFileError: kind 'shape' if the block's tensors are inconsistent.
    """
    check_block(block)
    code, spec_name, storage = _DTYPES[block.dtype]
    keep_alive = []  # holds the arrays whose raw pointers serialize() reads
    specs: dict[str, Any] = {}

    def add(name: str, arr: np.ndarray, dtype: np.dtype, spec: str) -> None:
        a = np.ascontiguousarray(arr, dtype=dtype)
        keep_alive.append(a)
        specs[name] = safetensors.TensorSpec(dtype=spec, shape=a.shape, data_ptr=a.ctypes.data, data_len=a.nbytes)

    add("token_ids", block.token_ids, _INT32[2], _INT32[1])
    for i, (k, v) in enumerate(zip(block.keys, block.values)):
        add(f"layers.{i}.keys", k, storage, spec_name)
        add(f"layers.{i}.values", v, storage, spec_name)
    meta = {
        "format_version": str(FORMAT_VERSION),
        "layout_key": layout_key,
        "block_hash": block.block_hash,
        "parent_hash": block.parent_hash,
        "num_tokens": str(block.num_tokens),
        "created": repr(float(created)),
        "dtype": block.dtype,
        "n_layers": str(len(block.keys)),
        "checksum": _CHECKSUM_PLACEHOLDER,
    }
    out = safetensors.serialize(specs, metadata=meta)
    keep_alive.clear()  # the serialized bytes no longer need the arrays
    return _patch_checksum(bytes(out))


def _patch_checksum(out: bytes) -> bytes:
    """Replace the checksum placeholder (same length) with the digest of the data section."""
    (n,) = struct.unpack_from("<Q", out, 0)
    header = out[8 : 8 + n]
    needle = f'"checksum":"{_CHECKSUM_PLACEHOLDER}"'.encode()
    pos = header.find(needle)
    if pos < 0 or header.find(needle, pos + 1) >= 0:  # never expected: serde writes compact JSON
        raise BlockFileError("header", "checksum placeholder not found exactly once")
    digest = data_checksum(memoryview(out)[8 + n :]).encode()
    at = 8 + pos + len(b'"checksum":"')
    return out[:at] + digest + out[at + len(digest) :]


def check_block(block: HostBlock) -> None:
    """Check a block's own consistency (before writing it).

    Raises:
        BlockFileError: kind 'shape' on unknown dtype, no layers, or mismatched tensors.
    """
    if block.dtype not in _DTYPES:
        raise BlockFileError("shape", f"unsupported dtype {block.dtype!r}")
    storage = _DTYPES[block.dtype][2]
    bs = int(np.asarray(block.token_ids).shape[0]) if np.ndim(block.token_ids) == 1 else -1
    if bs <= 0 or not block.keys or len(block.keys) != len(block.values):
        raise BlockFileError("shape", "token_ids must be 1-D and keys/values non-empty and of equal length")
    shape = tuple(block.keys[0].shape)
    if len(shape) != 4 or shape[0] != 1 or shape[2] != bs:
        raise BlockFileError("shape", f"layer shape {shape} is not [1, heads, {bs}, head_dim]")
    for a in (*block.keys, *block.values):
        if tuple(a.shape) != shape or a.dtype.newbyteorder("<") != storage:
            raise BlockFileError("shape", f"tensor {a.shape}/{a.dtype} differs from {shape}/{storage}")


# --------------------------------------------------------------------------- decode
def read_header(data: bytes | bytearray | memoryview, file_size: int | None = None) -> Header:
    """Parse the header of a block file from its first bytes.

    Args:
        data: the file content, or at least its first `8 + N` bytes.
        file_size: size of the whole file; defaults to `len(data)`.

    Returns:
        The parsed `Header` (format version, offsets and sizes checked; nothing else).

    Raises:
        BlockFileError: 'truncated' (file shorter or longer than the header says), 'header'
            (malformed JSON, offsets, or missing metadata), 'version' (unknown format version).
    """
    size = len(data) if file_size is None else file_size
    if len(data) < 8:
        raise BlockFileError("truncated", f"{len(data)} bytes, no header length")
    (n,) = struct.unpack_from("<Q", data, 0)
    if n > MAX_HEADER_BYTES:
        raise BlockFileError("header", f"header length {n} out of range")
    if len(data) < 8 + n:
        raise BlockFileError("truncated", f"header needs {8 + n} bytes, have {len(data)}")
    try:
        doc = json.loads(bytes(data[8 : 8 + n]))
        meta = doc.pop("__metadata__")
        if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
            raise ValueError("metadata must map strings to strings")
        tensors = {}
        for name, t in doc.items():
            start, end = (int(x) for x in t["data_offsets"])
            tensors[name] = (str(t["dtype"]), tuple(int(s) for s in t["shape"]), (start, end))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise BlockFileError("header", f"malformed header: {exc}") from None
    missing = [k for k in REQUIRED_META if k not in meta]
    if missing:
        raise BlockFileError("header", f"missing metadata {missing}")
    if meta["format_version"] != str(FORMAT_VERSION):
        raise BlockFileError("version", f"format_version {meta['format_version']!r}, expected {FORMAT_VERSION}")
    data_len = _check_offsets(tensors)
    if size != 8 + n + data_len:
        raise BlockFileError("truncated", f"file has {size} bytes, header describes {8 + n + data_len}")
    return Header(meta, tensors, 8 + n, data_len)


def _check_offsets(tensors: dict[str, tuple[str, tuple[int, ...], tuple[int, int]]]) -> int:
    """Offsets must tile the data section without gaps or overlap; returns its length."""
    spans = sorted(span for _, _, span in tensors.values())
    pos = 0
    for start, end in spans:
        if start != pos or end < start:
            raise BlockFileError("header", "tensor offsets do not tile the data section")
        pos = end
    return pos


def check_header(header: Header, expected: Expected) -> None:
    """Check a header against what its namespace stores (cheap: no tensor bytes read).

    Raises:
        BlockFileError: 'layout', 'hash' or 'shape'.
    """
    meta = header.meta
    if meta["layout_key"] != expected.layout_key:
        raise BlockFileError("layout", f"block of namespace {meta['layout_key']}, not {expected.layout_key}")
    if expected.block_hash is not None and meta["block_hash"] != expected.block_hash:
        raise BlockFileError("hash", f"file holds block {meta['block_hash']}, not {expected.block_hash}")
    if meta["dtype"] != expected.dtype or meta["dtype"] not in _DTYPES:
        raise BlockFileError("shape", f"dtype {meta['dtype']}, namespace stores {expected.dtype}")
    if meta["n_layers"] != str(expected.n_layers) or meta["num_tokens"] != str(expected.block_size):
        raise BlockFileError("shape", "n_layers or num_tokens differ from the namespace")
    code, _, storage = _DTYPES[expected.dtype]
    kv_shape = (1, expected.n_kv_heads, expected.block_size, expected.head_dim)
    want = {"token_ids": (_INT32[0], (expected.block_size,))}
    for i in range(expected.n_layers):
        want[f"layers.{i}.keys"] = want[f"layers.{i}.values"] = (code, kv_shape)
    if set(header.tensors) != set(want):
        raise BlockFileError("shape", "tensor names differ from the namespace's layout")
    for name, (dt, shape, (start, end)) in header.tensors.items():
        w_dt, w_shape = want[name]
        itemsize = 4 if name == "token_ids" else storage.itemsize
        if dt != w_dt or shape != w_shape or end - start != itemsize * int(np.prod(shape)):
            raise BlockFileError("shape", f"{name}: {dt}{list(shape)}, expected {w_dt}{list(w_shape)}")


def decode(
    data: bytes | bytearray,
    expected: Expected | None = None,
    verify_checksum: bool = True,
) -> tuple[HostBlock, dict[str, str]]:
    """Parse (and verify) a whole block file.

    Args:
        data: the file's complete content. The returned arrays view this buffer (writable if
            `data` is a bytearray), so keep it alive as long as the block.
        expected: the namespace's layout; None checks only the file's self-consistency.
        verify_checksum: recompute the blake2b-128 of the data section.

    Returns:
        `(block, meta)`: a `HostBlock` (token_ids int32 `[block_size]`; per layer keys/values
        `[1, n_kv_heads, block_size, head_dim]` float32/float16/uint16-bf16) and the string metadata.

    Raises:
        BlockFileError: any kind; see `BlockFileError`.
    """
    header = read_header(data)
    meta = header.meta
    if expected is None:
        expected = _self_expected(header)
    check_header(header, expected)
    if verify_checksum and data_checksum(memoryview(data)[header.data_start :]) != meta["checksum"]:
        raise BlockFileError("checksum", "data section does not match its checksum")
    storage = _DTYPES[meta["dtype"]][2]

    def view(name: str, dtype: np.dtype) -> np.ndarray:
        _, shape, (start, end) = header.tensors[name]
        off = header.data_start + start
        return np.frombuffer(data, dtype=dtype, count=(end - start) // dtype.itemsize, offset=off).reshape(shape)

    n = expected.n_layers
    block = HostBlock(
        block_hash=meta["block_hash"],
        parent_hash=meta["parent_hash"],
        token_ids=view("token_ids", _INT32[2]),
        keys=[view(f"layers.{i}.keys", storage) for i in range(n)],
        values=[view(f"layers.{i}.values", storage) for i in range(n)],
        dtype=meta["dtype"],
    )
    return block, meta


def _self_expected(header: Header) -> Expected:
    """The layout a file claims for itself (for checks without a namespace)."""
    meta = header.meta
    try:
        _, shape, _ = header.tensors["layers.0.keys"]
        return Expected(meta["layout_key"], int(meta["n_layers"]), shape[1], shape[3], int(meta["num_tokens"]), meta["dtype"])
    except (KeyError, IndexError, ValueError):
        raise BlockFileError("shape", "no usable layers.0.keys tensor") from None


def verify(
    data: bytes | bytearray,
    expected: Expected,
    expected_token_ids: np.ndarray | None = None,
) -> tuple[HostBlock, dict[str, str]]:
    """Decode with every check: layout, hash, shapes, checksum, and token ids.

    The checksum is checked before the tokens, so a damaged file is reported as 'checksum',
    and only an intact file holding other tokens under the same hash as 'tokens' (a collision).

    Raises:
        BlockFileError: any kind.
    """
    block, meta = decode(data, expected, verify_checksum=True)
    if expected_token_ids is not None and not np.array_equal(block.token_ids, expected_token_ids):
        raise BlockFileError("tokens", f"block {meta['block_hash']} holds other token ids")
    return block, meta
