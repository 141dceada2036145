"""The rules a segment file and its records are checked by, in one place.

Every reader of segments applies these and no others: a request's restore (`kvtool.disk.restore`
through `SSDStore.check_slot` and `segment.read_records`), `validate` (`kvtool.ops.records`, the
batched `kvtool.ops.clean_segments`), `--rebuild-index` (`kvtool.ops.rebuild`) and the remote
tier's values (`kvtool.tiers.remote_value`: `check_header`, `slot_problem`, `record_checksum`,
`sealed_header_digest`):

| rule | here |
|---|---|
| header checksum: xxh3-128 of the header JSON with its own value zeroed | `header_digest`, `sealed_header_digest` |
| the header names the namespace, its KV layout, its codec; no record longer than a block | `check_header` |
| a slot holds the block asked for: hash, parent (the previous block of the chain), length, size | `slot_problem`, `slot_holds` |
| a record matches its checksum (xxh3-128 of its stored bytes) | `record_checksum`, `record_digest` |
| the index row's token digest: xxh3-128 of the token ids as little-endian int32 | `tokens_digest` |

The fixed bytes of a header (everything but the hashes, checksums and creation time, for a slot
table of a given shape) are the ones `segment.encode` writes: `kvtool.disk.segment_template`
renders them from `encode` itself. How a header is parsed and records are read is
`kvtool.disk.segment`'s.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from typing import Protocol

import numpy as np
import xxhash

from kvtool.disk.kvlayout import KVLayout

ZERO_CHECKSUM = "0" * 32
HEADER_CK_KEY = b'"header_checksum":"'
_ZERO = ZERO_CHECKSUM.encode()
_TOKENS_DTYPE = np.dtype("<i4")
raw_digest = xxhash.xxh3_128_digest  # the 16 bytes of a checksum (the batched checks compare these)


class BlockFileError(Exception):
    """A segment file or record that must not be used.

    Attributes:
        kind: 'truncated' (file shorter/longer than its header says), 'header' (unparseable
            header or metadata, or header checksum mismatch), 'version' (unknown format),
            'layout' (another namespace's file), 'shape' (KV layout differs from the
            namespace's, or a record longer than a block), 'slot' (no such slot, or its
            hash/parent/length is not the one asked for), 'checksum' (record data does not
            match its checksum), 'tokens' (intact record holding other token ids: a chain-hash
            collision).
    """

    def __init__(self, kind: str, message: str):
        super().__init__(f"{kind}: {message}")
        self.kind = kind


class _Slot(Protocol):
    """What the rules read of a header's slot (`segment.Slot`)."""

    @property
    def index(self) -> int: ...
    @property
    def block_hash(self) -> str: ...
    @property
    def parent_hash(self) -> str: ...
    @property
    def n_tokens(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def codec(self) -> str: ...


class _Header(Protocol):
    """What the rules read of a parsed header (`segment.SegmentHeader`)."""

    @property
    def layout_key(self) -> str: ...
    @property
    def kv(self) -> KVLayout: ...
    @property
    def slots(self) -> Sequence[_Slot]: ...
    @property
    def codecs(self) -> frozenset[str]: ...


def sealed_header_digest(head: bytes, at: int) -> bytes:
    """The header checksum a header must hold (32 lowercase hex digits, as bytes), given the
    position `at` of its 32-digit value in `head` (the header bytes, or any bytes that hold the
    header at the same offset as the value): xxh3-128 of `head` with that value zeroed."""
    return xxhash.xxh3_128_hexdigest(head[:at] + _ZERO + head[at + 32 :]).encode()


def header_digest(header: bytes) -> str:
    """The header checksum of header JSON `header` (its `header_checksum` value zeroed).

    Raises:
        BlockFileError: 'header' if `header_checksum` is not found exactly once.
    """
    pos = header.find(HEADER_CK_KEY)
    if pos < 0 or header.find(HEADER_CK_KEY, pos + 1) >= 0:
        raise BlockFileError("header", "header_checksum not found exactly once")
    return sealed_header_digest(header, pos + len(HEADER_CK_KEY)).decode()


def check_header(header: _Header, layout_key: str, kv: KVLayout | None, codec: str | None = None,
                 block_size: int | None = None) -> None:  # fmt: skip
    """The segment belongs to namespace `layout_key` with KV layout `kv` (None: any), every
    record stored with `codec` (None: any), none longer than `block_size` tokens (None: any).

    Raises:
        BlockFileError: 'layout', 'shape' or 'header' (a record of another codec).
    """
    if header.layout_key != layout_key:
        raise BlockFileError("layout", f"segment of namespace {header.layout_key}, not {layout_key}")
    if kv is not None and header.kv != kv:
        raise BlockFileError("shape", f"KV layout {header.kv.spec}/{header.kv.dtype}, namespace has {kv.spec}/{kv.dtype}")
    if codec is not None and not header.codecs <= {codec}:
        raise BlockFileError("header", f"records stored with another codec than the namespace's ({codec})")
    if block_size is not None:
        long = [s.index for s in header.slots if s.n_tokens > block_size]
        if long:
            raise BlockFileError("shape", f"slot {long[0]} holds more tokens than a block ({block_size})")


def slot_problem(slot: _Slot, block_hash: str, parent: str | None = None, n_tokens: int | None = None,
                 nbytes: int | None = None) -> str | None:  # fmt: skip
    """How header slot `slot` differs from the block asked for (its hash; its parent, token count
    and record size where given), or None: it holds that block."""
    if slot.block_hash != block_hash:
        return f"slot {slot.index} holds {slot.block_hash}, not {block_hash}"
    for what, mine, theirs in (("parent", parent, slot.parent_hash), ("num_tokens", n_tokens, slot.n_tokens),
                               ("nbytes", nbytes, slot.nbytes)):  # fmt: skip
        if mine is not None and mine != theirs:
            return f"{what} {mine!r} differs from its record ({theirs!r})"
    return None


def slot_holds(slot: _Slot, block_hash: str, parent: str, n_tokens: int) -> bool:
    """`slot_problem(slot, block_hash, parent, n_tokens) is None` (hash, parent and length all
    given), without a message: the restore's per-block check."""
    return slot.block_hash == block_hash and slot.parent_hash == parent and slot.n_tokens == n_tokens


def record_checksum(pieces: Iterable) -> str:
    """The checksum of a record stored as `pieces` (buffers, in file order): xxh3-128 hex."""
    h = xxhash.xxh3_128()
    deque(map(h.update, pieces), maxlen=0)  # the loop in C: ~100 pieces per record on a restore
    return h.hexdigest()


def record_digest(record: bytes | memoryview) -> str:
    """`record_checksum` of a record held in one contiguous buffer (bytes, or a memoryview such
    as a C-contiguous numpy array's `.data`): one call, ~2x faster than hashing it in pieces."""
    return xxhash.xxh3_128_hexdigest(record)


def tokens_digest(token_ids: np.ndarray | Sequence[int] | bytes | memoryview) -> str:
    """The index row's `tokens_digest`: xxh3-128 hex of token ids as little-endian int32 (an
    array of ids, or their bytes as a record stores them)."""
    if not isinstance(token_ids, bytes | bytearray | memoryview):
        token_ids = np.ascontiguousarray(token_ids, dtype=_TOKENS_DTYPE).tobytes()
    return xxhash.xxh3_128_hexdigest(token_ids)


__all__ = [
    "BlockFileError", "check_header", "slot_problem", "slot_holds", "record_checksum", "record_digest", "tokens_digest", "header_digest",
    "sealed_header_digest", "raw_digest", "ZERO_CHECKSUM", "HEADER_CK_KEY",
]  # fmt: skip
