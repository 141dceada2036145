"""The remote tier's values and keys: the same verified bytes as a segment file, under one key
(docs/design.md, "Remote tier store").

Value: a one-record segment (format 2, `kvtool.disk.segment.encode([block], ...)`), byte for byte
what a one-block segment file holds, so a remote hit is verified as an SSD hit is: header
checksum, namespace and KV layout, slot hash / parent / length, record checksum (xxh3-128), exact
token ids. No pickle, no code: only numbers and one JSON header.

Keys (one namespace = one layout key; see `value_key`):

    kvtool:s2:<layout key>:{<chain hash>}                 the value (or a parts manifest)
    kvtool:s2:<layout key>:{<chain hash>}:p:<nonce>:<i>   part i of a split value

`s2` is the segment format version (a new format starts new keys). The `{...}` is the Redis
Cluster hash tag: a value and its parts live in one slot (a split value is written in one MULTI
transaction), and the uniform chain hashes spread a namespace over every node of a cluster.

Split values: a value larger than `max_value_bytes` (16 MiB by default) is stored as parts of at
most that size, each under its part key, and the value key holds a *manifest*:
`kvtool-parts:1:<n parts>:<total bytes>:<part bytes>:<nonce>`. A reader checks the manifest
(counts, total against the bound it expects), fetches the parts, joins them and verifies the
whole as any value. The nonce (random, per write) keeps parts of two concurrent writers apart:
only the manifest that won `SET NX` names parts, and those are its own.

Hostile or damaged values are at worst misses: the size is bounded before anything is allocated,
every header field is checked, and every failure raises `RemoteValueError` (never another
exception). The checksums detect corruption, not forgery, as on SSD. MLX-free.
"""

from __future__ import annotations

import functools
import math
import re
import secrets
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from kvtool.disk import segment, segment_template, verify
from kvtool.disk.hostblock import HostBlock
from kvtool.disk.kvlayout import KVLayout
from kvtool.disk.segment import BlockFileError, CodecError

VALUE_FORMAT = f"s{segment.FORMAT_VERSION}"
KEY_PREFIX = "kvtool"
DEFAULT_MAX_VALUE_BYTES = 16 << 20  # bytes per stored string; larger values are split into parts
MIN_MAX_VALUE_BYTES = 1 << 10
MAX_PARTS = 4096
HEADER_SLACK = 16 << 10  # bytes: a one-slot header is ~0.5 KiB plus the layout spec
_HEX32 = re.compile(r"[0-9a-f]{32}")
_MANIFEST = re.compile(rb"kvtool-parts:1:([1-9][0-9]{0,4}):([1-9][0-9]{0,12}):([1-9][0-9]{0,12}):([0-9a-f]{16})")
MANIFEST_PREFIX = b"kvtool-parts:"
_KEY = re.compile(r"kvtool:(s[0-9]+):([0-9a-f]{32}):\{([0-9a-f]{32})\}(?::p:([0-9a-f]{16}):([0-9]{1,4}))?")
_TOKENS = np.dtype("<i4")


class RemoteValueError(BlockFileError):
    """A remote value that must not be used (a miss; the store deletes it).

    Attributes:
        kind: as `BlockFileError.kind` ('truncated', 'header', 'version', 'layout', 'shape',
            'slot', 'checksum', 'tokens'), plus 'size' (larger than the bound, before any
            parse) and 'parts' (a malformed manifest, or parts missing or of the wrong size).
    """


# ----------------------------------------------------------------------------- keys
def is_hex32(text: object) -> bool:
    """A 32-character lower-case hex string (a layout key or a chain hash)."""
    return isinstance(text, str) and _HEX32.fullmatch(text) is not None


def value_key(layout_key: str, chain_hash: str) -> str:
    """`kvtool:s2:<layout key>:{<chain hash>}`.

    Raises:
        ValueError: either is not 32 lower-case hex characters (nothing else may reach a key).
    """
    if not is_hex32(layout_key) or not is_hex32(chain_hash):
        raise ValueError("layout key and chain hash must be 32 lower-case hex characters")
    return f"{KEY_PREFIX}:{VALUE_FORMAT}:{layout_key}:{{{chain_hash}}}"


def part_key(main_key: str, nonce: str, index: int) -> str:
    """Key of part `index` of the split value at `main_key` (same cluster slot)."""
    return f"{main_key}:p:{nonce}:{index}"


def namespace_pattern(layout_key: str | None = None) -> str:
    """SCAN `MATCH` pattern of every key of a namespace (or of every kvtool key of this format)."""
    if layout_key is not None and not is_hex32(layout_key):
        raise ValueError("layout key must be 32 lower-case hex characters")
    return f"{KEY_PREFIX}:{VALUE_FORMAT}:{layout_key}:*" if layout_key else f"{KEY_PREFIX}:*"


@dataclass(frozen=True)
class KeyInfo:
    """What a key name says.

    Attributes:
        format: the value format (`s2`); another one is an outdated key.
        layout_key: the namespace.
        chain_hash: the block's chain hash.
        nonce, part: for a part key, its writer's nonce and index; None for a value key.
    """

    format: str
    layout_key: str
    chain_hash: str
    nonce: str | None = None
    part: int | None = None

    @property
    def main_key(self) -> str:
        return f"{KEY_PREFIX}:{self.format}:{self.layout_key}:{{{self.chain_hash}}}"


def parse_key(key: str | bytes) -> KeyInfo | None:
    """The parts of a kvtool key; None for any other key name."""
    if isinstance(key, bytes):
        try:
            key = key.decode("ascii")
        except UnicodeDecodeError:
            return None
    m = _KEY.fullmatch(key)
    if m is None:
        return None
    return KeyInfo(m.group(1), m.group(2), m.group(3), m.group(4), int(m.group(5)) if m.group(5) else None)


# ----------------------------------------------------------------------------- values
def encode_value(block: HostBlock, layout_key: str, kv: KVLayout, codec: str = "none", created: float | None = None) -> bytes:
    """The value of one block: a one-record segment (see the module docstring).

    Raises:
        BlockFileError: 'shape' if the block does not match `kv`; ValueError on an unknown codec.
    """
    buffers, _ = segment.encode([block], layout_key, kv, time.time() if created is None else created, codec)
    return b"".join(buffers)


@functools.lru_cache(maxsize=256)
def value_bound(kv: KVLayout, n_tokens: int, codec: str | None) -> int:
    """The largest value (bytes) a block of `n_tokens` tokens of layout `kv` can have: its record
    (at worst slightly larger compressed than raw: lz4 and zstd bounds) plus a header. Memoized
    (`KVLayout` is frozen and hashable): it is asked once per value read."""
    raw = kv.record_nbytes(max(n_tokens, 1))
    stored = raw if codec in ("none",) else raw + raw // 255 + 1024
    return stored + HEADER_SLACK + 2 * len(kv.spec)


def decode_value(
    data: bytes | bytearray | memoryview,
    layout_key: str,
    kv: KVLayout | None,
    codec: str | None,
    expected_hash: str,
    expected_parent: str | None,
    *,
    expected_tokens: np.ndarray | Sequence[int] | None = None,
    max_bytes: int = DEFAULT_MAX_VALUE_BYTES,
) -> HostBlock:
    """Verify a value and return its block (arrays are read-only views of `data`).

    Args:
        data: the value's bytes (parts already joined).
        layout_key: the namespace the value must belong to.
        kv: the namespace's KV layout; None: the header's own (offline validation only).
        codec: the namespace's record codec; None: any known codec (offline validation only).
        expected_hash: the chain hash of the key the value came from.
        expected_parent: the parent the chain asks for; None: any (offline validation).
        expected_tokens: the exact token ids the block must hold (a restore always gives them).
        max_bytes: refuse larger values before parsing anything (bytes); with `kv` and
            `expected_tokens` the bound is also `value_bound(...)`.

    Raises:
        RemoteValueError: anything wrong; `kind` says what (never another exception type).
    """
    n = len(data)
    bound = max_bytes
    if kv is not None and expected_tokens is not None:
        bound = min(bound, value_bound(kv, len(expected_tokens), codec))
    if n > bound:
        raise RemoteValueError("size", f"value of {n} bytes, at most {bound} expected")
    try:
        return _decode(memoryview(data).cast("B"), layout_key, kv, codec, expected_hash, expected_parent, expected_tokens)
    except RemoteValueError:
        raise
    except BlockFileError as exc:
        raise RemoteValueError(exc.kind, str(exc).partition(": ")[2]) from None
    except (ValueError, KeyError, TypeError, IndexError, OverflowError, RecursionError, struct.error, MemoryError) as exc:
        raise RemoteValueError("header", f"malformed value: {type(exc).__name__}: {str(exc)[:200]}") from None


def _decode(view: memoryview, layout_key: str, kv: KVLayout | None, codec: str | None, expected_hash: str,
            expected_parent: str | None, expected_tokens) -> HostBlock:  # fmt: skip
    if kv is not None and codec == "none" and expected_parent is not None and expected_tokens is not None:
        block = _decode_canonical(view, layout_key, kv, expected_hash, expected_parent, expected_tokens)
        if block is not None:
            return block
    header = segment.parse_header(view, len(view))
    segment.check_header(header, layout_key, kv or header.kv, codec)
    kv = header.kv
    if len(header.slots) != 1:
        raise RemoteValueError("slot", f"{len(header.slots)} records, a value holds one")
    slot = header.slots[0]
    n_expected = None if expected_tokens is None else len(expected_tokens)
    why = verify.slot_problem(slot, expected_hash, expected_parent, n_expected)
    if why is not None:
        raise RemoteValueError("slot", why[:300])
    stored = view[slot.offset : slot.offset + slot.nbytes]
    if verify.record_checksum((stored,)) != slot.checksum:
        raise RemoteValueError("checksum", f"record of {slot.block_hash} does not match its checksum")
    record: memoryview | bytes = stored
    if slot.codec != "none":
        try:
            record = segment.decompress(slot.codec, stored, slot.raw_nbytes)
        except CodecError as exc:
            raise RemoteValueError("checksum", str(exc)) from None
    if len(record) != kv.record_nbytes(slot.n_tokens):
        raise RemoteValueError("checksum", "record size differs from the layout's")
    return _block(kv, record, slot.n_tokens, slot.block_hash, slot.parent_hash, expected_tokens)


def _block(kv: KVLayout, record: memoryview | bytes, n_tokens: int, block_hash: str, parent_hash: str,
           expected_tokens) -> HostBlock:  # fmt: skip
    """The block of a verified record (views of `record`), its token ids checked against
    `expected_tokens` (None: not checked).

    Raises:
        RemoteValueError: 'tokens' if they differ.
    """
    tokens = np.frombuffer(record, dtype=_TOKENS, count=n_tokens)
    if expected_tokens is not None and not _same_tokens(tokens, expected_tokens):
        raise RemoteValueError("tokens", f"block {block_hash} holds other token ids (chain-hash collision?)")
    keys, values = _tensors(kv, n_tokens, record, tokens.nbytes)
    return HostBlock(block_hash, parent_hash, tokens.astype(np.int32, copy=False), keys, values, kv.dtype)


class _Canon(NamedTuple):
    """Where a canonical one-slot value of a shape (`segment_template.Template`) holds what varies,
    as positions in the value (its 8-byte header length included): the block hash, parent and
    record checksum (32 hex digits each), the header checksum, the creation time; the fixed runs
    between them (`(start, stop, bytes)`); and the record's span."""

    t: segment_template.Template
    hash_at: int
    parent_at: int
    ck_at: int
    hck_at: int
    created: slice
    fixed: tuple[tuple[int, int, bytes], ...]
    record: slice


@functools.lru_cache(maxsize=64)
def _canon(layout_key: str, kv: KVLayout, n_tokens: int, created_len: int) -> _Canon | None:
    t = segment_template.template(layout_key, kv, (n_tokens,), created_len)
    if t is None:
        return None
    (h, p, c), c_idx = t.hex_idx[0] + 8, t.created_idx + 8
    return _Canon(t, int(h[0]), int(p[0]), int(c[0]), t.hck_at + 8, slice(int(c_idx[0]), int(c_idx[-1]) + 1),
                  tuple((a + 8, b + 8, t.header[a:b]) for a, b in t.fixed), t.records[0])  # fmt: skip


def _decode_canonical(view: memoryview, layout_key: str, kv: KVLayout, expected_hash: str, expected_parent: str,
                      expected_tokens) -> HostBlock | None:  # fmt: skip
    """A value whose header is byte for byte the one `segment.encode` writes for this block (the
    namespace, the expected hash, parent and token count: `segment_template`), checked by
    comparing bytes; its checksums and token ids are verified as `_decode` verifies them. Returns
    None for any other header (the general parse then decides, with its precise error) and raises
    `RemoteValueError` only where the general path would too: a checksum or the token ids differ.

    Args:
        view: the value's bytes (`[len]` uint8 memoryview).
        expected_tokens: the block's token ids (int32 `[n]`, or a sequence of ints).
    """
    if len(view) < 8 or len(expected_hash) != 32 or len(expected_parent) != 32:
        return None
    hlen = int.from_bytes(view[:8], "little")
    if 8 + hlen > min(len(view), 8 + segment.MAX_HEADER_BYTES):
        return None
    head = bytes(view[: 8 + hlen])  # the header length and the header: the one copy made
    span = segment_template.created_span(head, len(head))
    c = None if span is None else _canon(layout_key, kv, len(expected_tokens), span[1] - span[0])
    if c is None or c.t.file_size != len(view) or c.t.hlen != hlen:
        return None
    for a, b, fixed in c.fixed:
        if head[a:b] != fixed:
            return None
    h, p, at = c.hash_at, c.parent_at, c.hck_at
    if (head[h : h + 32] != expected_hash.encode() or head[p : p + 32] != expected_parent.encode()
            or head[c.created].translate(None, segment_template.CREATED_CHARS)):  # fmt: skip
        return None
    if verify.sealed_header_digest(head[8:], at - 8) != head[at : at + 32]:
        return None  # (the general path says which field)
    record = view[c.record]
    if verify.record_checksum((record,)).encode() != head[c.ck_at : c.ck_at + 32]:
        raise RemoteValueError("checksum", f"record of {expected_hash} does not match its checksum")
    return _block(kv, record, len(expected_tokens), expected_hash, expected_parent, expected_tokens)


def _same_tokens(tokens: np.ndarray, expected: np.ndarray | Sequence[int]) -> bool:
    """Exactly the expected token ids (int32 arrays compared as bytes; anything else by value)."""
    if isinstance(expected, np.ndarray) and expected.dtype == _TOKENS and expected.shape == tokens.shape:
        return tokens.tobytes() == expected.tobytes()
    return bool(np.array_equal(tokens, np.asarray(expected)))


@functools.lru_cache(maxsize=256)
def _plan(kv: KVLayout, n_tokens: int) -> tuple[bool, tuple[tuple[np.dtype, int, tuple[int, ...]], ...]]:
    """How a record of `n_tokens` tokens of layout `kv` is cut into its tensors, memoized (a
    remote hit cuts one record per block): `(uniform, entries)`, entries `(dtype, count, shape)`
    in record order; `uniform` when every tensor has one shape and dtype (plain K/V, no state
    arrays): then one entry for them all, of shape `[2 * n_layers, *shape]` (one cut, `_tensors`)."""
    shapes, dtypes = kv.shapes(n_tokens), kv.storage_dtypes()
    if not kv.states and not kv.bits and len(set(shapes)) == 1 and len(set(dtypes)) == 1:
        return True, ((dtypes[0], len(shapes) * math.prod(shapes[0]), (len(shapes), *shapes[0])),)
    return False, tuple((st, math.prod(shape), shape) for shape, st in zip(shapes, dtypes))


def _tensors(kv: KVLayout, n_tokens: int, record: memoryview | bytes, at: int) -> tuple[list, list]:
    """(keys, values) of a record: read-only views of `record` from byte `at` (after the token
    ids), shapes and dtypes as `kv.shapes(n_tokens)` / `kv.storage_dtypes()`, split as `kv.split`."""
    uniform, plan = _plan(kv, n_tokens)
    if uniform:  # K0, V0, K1, V1, ... of one shape: one view, cut along its first axis
        st, count, shape = plan[0]
        whole = np.frombuffer(record, dtype=st, count=count, offset=at).reshape(shape)
        return list(whole[0::2]), list(whole[1::2])
    arrays = []
    for st, count, shape in plan:
        arrays.append(np.frombuffer(record, dtype=st, count=count, offset=at).reshape(shape))
        at += count * st.itemsize
    return kv.split(arrays)


# ----------------------------------------------------------------------------- split values
@dataclass(frozen=True)
class Manifest:
    """A split value's manifest.

    Attributes:
        n_parts: number of parts (2..`MAX_PARTS`).
        total: bytes of the joined value.
        part_bytes: bytes of every part but the last (the writer's `max_value_bytes`).
        nonce: the writer's 16-hex nonce (in every part key).
    """

    n_parts: int
    total: int
    part_bytes: int
    nonce: str

    def encode(self) -> bytes:
        return b"kvtool-parts:1:%d:%d:%d:%s" % (self.n_parts, self.total, self.part_bytes, self.nonce.encode())

    def part_keys(self, main_key: str) -> list[str]:
        return [part_key(main_key, self.nonce, i) for i in range(self.n_parts)]


def is_manifest(data: bytes | bytearray | memoryview) -> bool:
    """Does a stored value look like a parts manifest (rather than a segment)? A segment starts
    with its u64 header length, which these ASCII bytes would make far too large."""
    return bytes(data[: len(MANIFEST_PREFIX)]) == MANIFEST_PREFIX


def split_value(value: bytes, max_value_bytes: int) -> tuple[Manifest, list[bytes]] | None:
    """None if `value` fits in one string of `max_value_bytes`; else its manifest (fresh nonce)
    and its parts, each at most `max_value_bytes`.

    Raises:
        ValueError: the value would need more than `MAX_PARTS` parts.
    """
    if len(value) <= max_value_bytes:
        return None
    n = -(-len(value) // max_value_bytes)
    if n > MAX_PARTS:
        raise ValueError(f"a value of {len(value)} bytes needs {n} parts of {max_value_bytes} bytes (at most {MAX_PARTS})")
    view = memoryview(value)
    parts = [bytes(view[i * max_value_bytes : (i + 1) * max_value_bytes]) for i in range(n)]
    return Manifest(n, len(value), max_value_bytes, secrets.token_hex(8)), parts


def parse_manifest(data: bytes | bytearray | memoryview, max_total: int) -> Manifest:
    """Check a manifest: its syntax, `total <= max_total` (bytes, checked before any part is
    fetched; a reader's bound for the block), and the part count its part size needs. (The part
    size is the writer's `max_value_bytes`: readers configured otherwise read its parts alike.)

    Raises:
        RemoteValueError: 'parts' or 'size'.
    """
    m = _MANIFEST.fullmatch(bytes(data[:128]))
    if m is None or len(data) > 128:
        raise RemoteValueError("parts", "malformed parts manifest")
    manifest = Manifest(int(m.group(1)), int(m.group(2)), int(m.group(3)), m.group(4).decode())
    if manifest.total > max_total:
        raise RemoteValueError("size", f"split value of {manifest.total} bytes, at most {max_total} expected")
    if not 2 <= manifest.n_parts <= MAX_PARTS or manifest.n_parts != -(-manifest.total // manifest.part_bytes):
        raise RemoteValueError("parts", f"{manifest.n_parts} parts of {manifest.part_bytes} bytes for {manifest.total} bytes")
    return manifest


def manifest_part_keys(key: str, head: object) -> list[str]:
    """The part keys that value `key`'s manifest names, from the value's first 128 bytes `head`
    (a GETRANGE reply); [] if it is no well-formed manifest (a whole value, an error, absent)."""
    if isinstance(head, bytes) and is_manifest(head):
        try:
            return parse_manifest(head, 1 << 62).part_keys(key)
        except RemoteValueError:
            pass
    return []


def join_parts(manifest: Manifest, parts: Sequence[bytes | None]) -> bytes:
    """The joined value of `parts` (in order).

    Raises:
        RemoteValueError: 'parts': a part is missing (evicted, expired, deleted) or of another
            size than the manifest implies.
    """
    if len(parts) != manifest.n_parts or any(not isinstance(p, bytes) for p in parts):
        raise RemoteValueError("parts", "a part of a split value is missing")
    sizes = [len(p) for p in parts]  # type: ignore[arg-type]
    if sum(sizes) != manifest.total or any(s != manifest.part_bytes for s in sizes[:-1]):
        raise RemoteValueError("parts", "parts of a split value have other sizes than its manifest says")
    return b"".join(parts)  # type: ignore[arg-type]
