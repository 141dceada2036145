"""Segment files (format 2): several KV blocks in one safetensors file, each verifiable alone.

A *segment* holds the blocks of one write batch (typically the new blocks of one request), so
a prefix hit reads one file instead of one per block (docs/design.md#segments-format-2-why-and-what).

File layout (a valid safetensors file, `safetensors.safe_open` and `mx.load` can open it):

    u64 LE header length N | header JSON (N bytes, space-padded to 8-byte alignment) | records

The header maps one `U8` tensor per block slot (`"b0"`, `"b1"`, ...) to its *record*, and its
`__metadata__` holds the format, the namespace's layout key and KV layout, and per slot
`"hash:parent:n_tokens:checksum"`. A block record is, in order, little-endian and C-contiguous:

    token ids int32 [n] | for each layer l: keys [1, H_l, n, Dk_l] | values [1, H_l, n, Dv_l]

i.e. exactly the slices of mlx-lm's `KVCache.state` along the sequence axis. `n < block_size`
only for a prompt's *tail entry* (its trailing partial block). In a quantized namespace
(`KVLayout.bits` > 0, the `layers` spec starts with `q<bits>g<group>:`) each layer's keys are
three tensors, packed uint32 words `[1, H_l, n, Dk_l*bits/32]`, scales and biases
`[1, H_l, n, Dk_l/group]`, and so are its values: slices of mlx-lm's `QuantizedKVCache`.

Checksums are xxh3-128 (`xxhash`): they detect corruption; identity is the blake2b chain hash,
and the exact token ids are compared on every hit. `header_checksum` covers the whole header
(with its own value zeroed), so a header edit that swaps two records' offsets fails
verification; each slot's checksum covers its record.

Codecs (opt-in, `KVToolConfig.ssd_codec`): in a `zstd` or `lz4` namespace every record is
stored compressed and its slot metadata is `"hash:parent:n_tokens:checksum:codec:raw_nbytes"`;
the checksum covers the *stored* bytes, and a decompressed size other than `raw_nbytes` counts
as a checksum failure.
"""

from __future__ import annotations

import functools
import json
import operator
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from kvtool.disk.codec import CODECS, ZSTD_LEVEL, CodecError, compress, decompress  # noqa: F401  (re-exported)
from kvtool.disk.headpieces import HeadPieces  # noqa: F401  (re-exported: where records go)
from kvtool.disk.hostblock import HostBlock
from kvtool.disk.kvlayout import QUANT_BITS, STORAGE_DTYPES, KVLayout  # noqa: F401  (re-exported)
from kvtool.disk.verify import (  # noqa: F401  (the rules: re-exported under the names callers use)
    HEADER_CK_KEY,
    ZERO_CHECKSUM,
    BlockFileError,
    check_header,
    header_digest,
    record_checksum,
    tokens_digest,
)

FORMAT_NAME = "kvtool-segment"
FORMAT_VERSION = 2
CHECKSUM_ALGO = "xxh3-128"
MAX_HEADER_BYTES = 1 << 26  # 64 MiB: far above any real header (~100 B per slot)
MAX_SLOTS = 1 << 16
_IOV_MAX = 1024  # POSIX minimum of IOV_MAX on Linux

TOKENS_DTYPE = np.dtype("<i4")  # a record's token ids


class Slot(NamedTuple):
    """One block record of a segment, as its (verified) header describes it (a named tuple: a
    header of many slots is parsed several times faster than with a frozen dataclass).

    Attributes:
        index: slot number.
        block_hash, parent_hash: chain hashes (hex).
        n_tokens: tokens in the record.
        checksum: xxh3-128 hex of the record.
        offset: byte offset of the record in the file.
        nbytes: stored record length (bytes; compressed size under a codec).
        codec: 'none' or the codec the record is stored with (`CODECS`).
        raw_nbytes: the record's decoded length (bytes); equals `nbytes` without a codec (every
            slot this module makes gives it).
    """

    index: int  # type: ignore[assignment]  # the slot number; shadows tuple.index, which nothing here calls
    block_hash: str
    parent_hash: str
    n_tokens: int
    checksum: str
    offset: int
    nbytes: int
    codec: str = "none"
    raw_nbytes: int = -1


# ----------------------------------------------------------------------------- write
def _record_pieces(block: HostBlock, kv: KVLayout) -> list[np.ndarray]:
    """The record's arrays in file order, C-contiguous little-endian (views where possible).

    Raises:
        BlockFileError: 'shape' if the block does not match `kv`.
    """
    n = int(np.asarray(block.token_ids).shape[0]) if np.ndim(block.token_ids) == 1 else 0
    per = kv.tensors_per_layer // 2
    if (block.dtype != kv.dtype or n <= 0 or len(block.keys) != kv.n_layers * per
            or len(block.values) != kv.n_layers * per + len(kv.states)):
        raise BlockFileError("shape", f"block {block.block_hash}: dtype/layers/tokens differ from the namespace")
    pieces = [np.ascontiguousarray(block.token_ids, dtype=TOKENS_DTYPE)]
    for arr, shape, storage in zip(kv.interleave(block.keys, block.values), kv.shapes(n), kv.storage_dtypes()):
        if tuple(arr.shape) != shape or arr.dtype.newbyteorder("<") != storage:
            raise BlockFileError("shape", f"block {block.block_hash}: tensor {arr.shape}/{arr.dtype}, expected {shape}/{storage}")
        pieces += _c_pieces(np.asarray(arr), storage)
    return pieces


def _c_pieces(arr: np.ndarray, storage: np.dtype) -> list[np.ndarray]:
    """C-contiguous pieces of `arr` in C order, without copying a strided view whose rows are
    contiguous (e.g. a block sliced from a `[1, H, T, D]` buffer: one piece per head)."""
    if arr.dtype != storage:
        arr = arr.astype(storage)
    if arr.flags.c_contiguous:
        return [arr]
    if arr.ndim <= 1:
        return [np.ascontiguousarray(arr)]
    return [p for sub in arr for p in _c_pieces(sub, storage)]


def encode(
    blocks: Sequence[HostBlock], layout_key: str, kv: KVLayout, created: float, codec: str = "none"
) -> tuple[list[memoryview], list[Slot]]:
    """Serialise blocks into one segment, without copying their KV.

    Args:
        blocks: 1..`MAX_SLOTS` blocks of the namespace (tail entries may hold fewer tokens).
        layout_key: namespace the file belongs to.
        kv: the namespace's KV layout.
        created: creation time (unix seconds).
        codec: 'none' (records stored as they are, no copy) or 'zstd' / 'lz4' (each record
            joined into one buffer and compressed; the checksum covers the compressed bytes).

    Returns:
        `(buffers, slots)`: the file content as buffers to write in order (`os.writev`), and
        the slots (offsets are file offsets).

    Raises:
        BlockFileError: 'shape' if a block does not match `kv`; ValueError on 0 or too many blocks.
    """
    if not 0 < len(blocks) <= MAX_SLOTS:
        raise ValueError(f"a segment holds 1..{MAX_SLOTS} blocks, got {len(blocks)}")
    if codec not in CODECS:
        raise ValueError(f"unknown codec {codec!r}")
    records: list[list] = [_record_pieces(b, kv) for b in blocks]
    raw_sizes = [sum(p.nbytes for p in pieces) for pieces in records]
    if codec != "none":
        records = [[compress(codec, b"".join(p.data.cast("B") for p in pieces))] for pieces in records]
    sums = [record_checksum(p) for p in records]
    sizes = [sum(memoryview(p).nbytes for p in pieces) for pieces in records]
    suffix = [f":{codec}:{raw}" if codec != "none" else "" for raw in raw_sizes]
    meta = {
        "format": FORMAT_NAME,
        "format_version": str(FORMAT_VERSION),
        "checksum_algo": CHECKSUM_ALGO,
        "layout_key": layout_key,
        "dtype": kv.dtype,
        "layers": kv.spec,
        "n_blocks": str(len(blocks)),
        "created": repr(float(created)),
        "header_checksum": ZERO_CHECKSUM,
    }
    tensors: dict[str, object] = {"__metadata__": meta}
    pos = 0
    for i, (b, size, ck) in enumerate(zip(blocks, sizes, sums)):
        meta[f"b{i}"] = f"{b.block_hash}:{b.parent_hash}:{b.token_ids.shape[0]}:{ck}{suffix[i]}"
        tensors[f"b{i}"] = {"dtype": "U8", "shape": [size], "data_offsets": [pos, pos + size]}
        pos += size
    header = json.dumps(tensors, separators=(",", ":")).encode()
    header += b" " * (-(8 + len(header)) % 8)
    header = _seal_header(header)
    data_start = 8 + len(header)
    slots, off = [], data_start
    for i, (b, size, ck, raw) in enumerate(zip(blocks, sizes, sums, raw_sizes)):
        slots.append(Slot(i, b.block_hash, b.parent_hash, int(b.token_ids.shape[0]), ck, off, size, codec, raw))
        off += size
    buffers = [memoryview(struct.pack("<Q", len(header)) + header)]
    buffers += [memoryview(p).cast("B") for pieces in records for p in pieces]
    return buffers, slots


def _seal_header(header: bytes) -> bytes:
    at = header.find(HEADER_CK_KEY) + len(HEADER_CK_KEY)
    return header[:at] + header_digest(header).encode() + header[at + 32 :]


# ----------------------------------------------------------------------------- read
@dataclass(frozen=True)
class SegmentHeader:
    """A parsed, verified segment header.

    Attributes:
        meta: the string metadata.
        kv: the KV layout it declares.
        slots: the block records, in file order.
        file_size: bytes the file must have.
    """

    meta: dict[str, str]
    kv: KVLayout
    slots: tuple[Slot, ...]
    file_size: int

    @property
    def layout_key(self) -> str:
        return self.meta["layout_key"]

    @functools.cached_property
    def codecs(self) -> frozenset[str]:
        """The codecs its records are stored with (computed once: a cached header is checked on
        every restore)."""
        return frozenset(s.codec for s in self.slots)


@functools.lru_cache(maxsize=64)
def parse_layout(text: str, dtype: str) -> KVLayout:
    """`KVLayout.parse`, memoized: every header of a namespace names the same layout, and a remote
    hit parses one header per block (`kvtool.tiers.remote_value`). Raises as `KVLayout.parse`."""
    return KVLayout.parse(text, dtype)


def parse_header(head: bytes | bytearray | memoryview, file_size: int) -> SegmentHeader:
    """Parse and verify a segment header (its checksum, offsets, layout, slot table).

    Args:
        head: at least the first `8 + N` bytes of the file.
        file_size: the file's size in bytes.

    Raises:
        BlockFileError: 'truncated', 'header' or 'version'.
    """
    if len(head) < 8:
        raise BlockFileError("truncated", f"{len(head)} bytes, no header length")
    (n,) = struct.unpack_from("<Q", head, 0)
    if n > MAX_HEADER_BYTES or n < 2:
        raise BlockFileError("header", f"header length {n} out of range")
    if len(head) < 8 + n:
        raise BlockFileError("truncated", f"header needs {8 + n} bytes, have {len(head)}")
    raw = bytes(head[8 : 8 + n])
    try:
        doc = json.loads(raw)
        meta = doc.pop("__metadata__")
        if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
            raise ValueError("metadata must map strings to strings")
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        raise BlockFileError("header", f"malformed header: {exc}") from None
    if meta.get("format") != FORMAT_NAME or meta.get("format_version") != str(FORMAT_VERSION):
        raise BlockFileError("version", f"not a {FORMAT_NAME} v{FORMAT_VERSION} file")
    if meta.get("checksum_algo") != CHECKSUM_ALGO or header_digest(raw) != meta.get("header_checksum"):
        raise BlockFileError("header", "header does not match its checksum")
    try:
        kv = parse_layout(meta["layers"], meta["dtype"])
        slots = _parse_slots(doc, meta, 8 + n, kv)
    except (ValueError, KeyError, TypeError) as exc:
        raise BlockFileError("header", f"malformed slot table: {exc}") from None
    size = 8 + n + sum(s.nbytes for s in slots)
    if file_size != size:
        raise BlockFileError("truncated", f"file has {file_size} bytes, header describes {size}")
    return SegmentHeader(meta, kv, slots, size)


def _parse_slots(doc: dict, meta: dict[str, str], data_start: int, kv: KVLayout) -> tuple[Slot, ...]:
    n_blocks = int(meta["n_blocks"])
    if not 0 < n_blocks <= MAX_SLOTS or len(doc) != n_blocks:
        raise ValueError(f"n_blocks {n_blocks} does not match {len(doc)} tensors")
    slots, pos = [], 0
    sizes: dict[int, int] = {}  # n_tokens -> record bytes (a header's records are mostly one length)
    for i in range(n_blocks):
        key = f"b{i}"
        t = doc[key]
        first, last = t["data_offsets"]
        start, end = int(first), int(last)
        fields = meta[key].split(":")
        codec, raw = "none", None
        if len(fields) == 6:
            h, parent, n_tok, ck, codec, raw_text = fields
            if codec not in CODECS[1:] or not raw_text.isdigit():
                raise ValueError(f"slot {i}: bad codec fields")
            raw = int(raw_text)
        else:
            h, parent, n_tok, ck = fields
        n_tokens = int(n_tok)
        if raw is None:
            raw = end - start
        want = sizes.get(n_tokens)
        if want is None:
            want = sizes[n_tokens] = kv.record_nbytes(n_tokens)
        if t["dtype"] != "U8" or start != pos or raw != want or n_tokens <= 0 or end - start <= 0:
            raise ValueError(f"slot {i}: offsets or size inconsistent")
        slots.append(Slot(i, h, parent, n_tokens, ck, data_start + start, end - start, codec, raw))
        pos = end
    return tuple(slots)


def read_header(fd: int, file_size: int) -> SegmentHeader:
    """Read and verify the header of an open segment file (two small preads at most).

    Raises:
        BlockFileError: see `parse_header`; OSError from the read.
    """
    return parse_header(read_head(fd, file_size), file_size)


def read_head(fd: int, file_size: int) -> bytes:
    """The first bytes of an open segment file of `file_size` bytes, the whole header among them
    when its length field is plausible (two small preads at most; unchecked: `parse_header`).

    Raises:
        OSError: the read failed.
    """
    head = os.pread(fd, 64 << 10, 0)
    if len(head) >= 8:
        (n,) = struct.unpack_from("<Q", head, 0)
        if len(head) < 8 + n <= min(file_size, 8 + MAX_HEADER_BYTES):
            head += os.pread(fd, 8 + n - len(head), len(head))
    return head


def read_record(fd: int, slot: Slot, tokens: np.ndarray, dest: Sequence[np.ndarray]) -> None:
    """Scatter one record from the file into `tokens` and `dest` with `preadv`, then verify it.

    Args:
        fd: open segment file.
        slot: the record (from a verified header).
        tokens: int32 `[slot.n_tokens]`, receives the token ids.
        dest: per tensor in record order (K0, V0, K1, V1, ...) a view `[1, H, n, D]` of the
            destination in the storage dtype; each head's `[n, D]` must be C-contiguous
            (true for a slice `buf[:, :, t:t+n, :]` of a C-contiguous cache buffer).

    Raises:
        BlockFileError: 'truncated' (short read) or 'checksum'. Token ids are the caller's check.
        OSError: the read failed.
    """
    pieces = [arr[0, h].data.cast("B") for arr in dest for h in range(arr.shape[1])]
    if read_records(fd, [slot], tokens, [pieces]) is not None:
        raise BlockFileError("checksum", f"record {slot.index} ({slot.block_hash}) does not match its checksum")


def read_records(fd: int, slots: Sequence[Slot], tokens: np.ndarray, pieces: Sequence[Sequence[memoryview]]) -> int | None:
    """Read records that lie back to back in the file with one `preadv` batch, then verify them.

    Args:
        fd: open segment file.
        slots: the records, in file order (from a verified header).
        tokens: int32 `[sum of the slots' n_tokens]`, C-contiguous: receives their token ids.
        pieces: per record, the writable byte buffers of its data after the token ids, in file
            order (`HeadPieces`); their sizes must add up to the record's size.

    Returns:
        The position (in `slots`) of the first record that fails its checksum, or None.

    Raises:
        BlockFileError: 'truncated' (short read) or 'slot' (records not contiguous, or buffers
            of another size than the records).
        OSError: the read failed.
    """
    if tokens.dtype != TOKENS_DTYPE or not tokens.flags.c_contiguous or tokens.size != sum(s.n_tokens for s in slots):
        raise BlockFileError("slot", "token buffer does not match the records")
    tok = tokens.data.cast("B")
    iovs: list[list[memoryview]] = []
    at = 0
    for slot, rest in zip(slots, pieces):
        n = slot.n_tokens * TOKENS_DTYPE.itemsize
        iovs.append([tok[at : at + n], *rest])
        at += n
    for a, b in zip(slots, slots[1:]):
        if a.offset + a.nbytes != b.offset:
            raise BlockFileError("slot", "records are not contiguous")
    if any(s.codec != "none" for s in slots):
        return _read_compressed(fd, slots, iovs)
    flat = [m for iov in iovs for m in iov]
    preadv_all(fd, flat, slots[0].offset, sum(sl.nbytes for sl in slots))
    for pos, (slot, iov) in enumerate(zip(slots, iovs)):
        if record_checksum(iov) != slot.checksum:
            return pos
    return None


def _read_compressed(fd: int, slots: Sequence[Slot], iovs: Sequence[list[memoryview]]) -> int | None:
    """`read_records` for compressed records: one read of the stored bytes into a staging
    buffer, then per record: checksum of the stored bytes, decompress, copy into `iovs`."""
    for slot, iov in zip(slots, iovs):
        if sum(m.nbytes for m in iov) != slot.raw_nbytes:
            raise BlockFileError("slot", "destination size differs from the record size")
    staging = bytearray(sum(s.nbytes for s in slots))
    view = memoryview(staging)
    preadv_all(fd, [view], slots[0].offset, len(staging))
    at = 0
    for pos, (slot, iov) in enumerate(zip(slots, iovs)):
        stored = view[at : at + slot.nbytes]
        at += slot.nbytes
        if record_checksum((stored,)) != slot.checksum:
            return pos
        try:
            raw = memoryview(decompress(slot.codec, stored, slot.raw_nbytes))
        except CodecError:
            return pos
        done = 0
        for m in iov:
            m[:] = raw[done : done + m.nbytes]
            done += m.nbytes
    return None


_NBYTES = operator.attrgetter("nbytes")


def preadv_all(fd: int, iov: list[memoryview], offset: int, nbytes: int) -> None:
    """preadv every buffer of `iov` (`nbytes` in all) from file offset `offset`, resuming after
    short reads.

    Raises:
        BlockFileError: 'truncated' (the file ends first) or 'slot' (the buffers do not hold
            `nbytes`); OSError from the read.
    """
    sizes = list(map(_NBYTES, iov))  # one C-level pass: a restore has ~100 pieces per record
    if sum(sizes) != nbytes:
        raise BlockFileError("slot", "destination size differs from the record size")
    iov = list(iov)  # resumption replaces entries; the caller's list stays intact
    i = 0
    while i < len(iov):
        batch = iov[i : i + _IOV_MAX]
        got = os.preadv(fd, batch, offset)
        want = sum(sizes[i : i + len(batch)])
        offset += got
        if got == want:
            i += len(batch)
            continue
        if got == 0:
            raise BlockFileError("truncated", "file ended inside a record")
        for m in batch:  # short read: skip what was filled, resume mid-buffer
            if got >= m.nbytes:
                got -= m.nbytes
                i += 1
            else:
                iov[i] = m[got:]
                sizes[i] = iov[i].nbytes
                break


def read_block(fd: int, slot: Slot, kv: KVLayout, dtype_name: str | None = None) -> HostBlock:
    """Read one record into fresh host arrays and verify its checksum (validate, tests).

    Raises:
        BlockFileError: 'truncated' or 'checksum'; OSError from the read.
    """
    tokens = np.empty(slot.n_tokens, dtype=TOKENS_DTYPE)
    arrays = [np.empty(s, dtype=st) for s, st in zip(kv.shapes(slot.n_tokens), kv.storage_dtypes())]
    read_record(fd, slot, tokens, arrays)
    keys, values = kv.split(arrays)
    return HostBlock(slot.block_hash, slot.parent_hash, tokens, keys, values, dtype_name or kv.dtype)
