"""Canonical segment headers with placeholders: what `segment.encode` writes for a shape of
segment, rendered once, so that a header of that shape is checked by comparing bytes instead of
parsing JSON.

A *shape* is the namespace (layout key, KV layout), the token count of each slot, the record codec
`none`, and the length of the creation time's text (`repr(float)`: its length varies). For a shape
`template` asks `segment.encode` itself for the header, with `#` where per-file values go: the
creation time, the header checksum, and each slot's hash, parent and record checksum (32
lowercase hex digits each). A header equal to the template in every other byte, whose creation
time holds only `CREATED_CHARS` (no JSON escape) and whose digests hold lowercase hex, is one that
`segment.parse_header` reads as the slot table of the shape, field by field; a header of any
other shape, or any difference, goes the general way (`parse_header`).

Users: `kvtool.ops.clean_segments` (validate's batched fast path over whole segments) and
`kvtool.tiers.remote_value` (a remote hit's one-slot values).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from kvtool.disk import segment as seg
from kvtool.disk.hostblock import HostBlock
from kvtool.disk.kvlayout import KVLayout

__all__ = ["CREATED_CHARS", "CREATED_KEY", "CREATED_OK", "HOLE", "Template", "created_of_text", "created_span", "template"]

HOLE = ord("#")  # placeholder byte in a template: where the digests and the creation time go
CREATED_KEY = b'"created":"'
CREATED_CHARS = b"0123456789.eE+-infaINFA"  # what a creation time may hold in a template's header
CREATED_OK = np.zeros(256, dtype=bool)  # `CREATED_CHARS` as a lookup table (byte -> allowed)
CREATED_OK[np.frombuffer(CREATED_CHARS, dtype=np.uint8)] = True


class Template:
    """The canonical header of one segment shape (token count per slot, length of the creation
    time), with placeholders (`#`) where per-file values go.

    Attributes:
        hlen: header length N (the u64 at the file's start), padding included (bytes).
        file_size: bytes of the whole file.
        header: the header (without its 8-byte length), placeholders included (`[N]` bytes).
        arr: the same as uint8 `[N]`; holes: `[N]` bool, its placeholders.
        created_idx: positions of the creation time; hck_idx: of the header checksum (32 hex).
        hex_idx: positions of the per-slot hex digits: `[n, 3, 32]`, hash, parent, checksum.
        hck_at: where the header checksum's value starts in the header.
        fixed: `(start, stop)` of each run of bytes between placeholders, in header order
            (positions in the header).
        tokens, records: per slot, the `slice` of its token ids and of its whole record (file offsets).

    Raises:
        ValueError: the header's placeholders do not form the fields of the shape.
    """

    def __init__(self, header: bytes, n_tokens: tuple[int, ...], sizes: list[int], created_len: int):
        arr = np.frombuffer(header, dtype=np.uint8)
        holes = np.flatnonzero(arr == HOLE)
        n = len(n_tokens)
        if holes.size != created_len + 32 + 96 * n:
            raise ValueError("placeholder count differs from the template's fields")
        self.hlen = len(header)
        start = 8 + self.hlen
        offsets = np.concatenate([[0], np.cumsum(sizes)]) + start
        self.file_size = int(offsets[-1])
        self.header = header
        self.arr = arr
        self.holes = arr == HOLE  # [N] bool: where a header may differ from `arr`
        self.created_idx = holes[:created_len]
        self.hck_idx = holes[created_len : created_len + 32]
        self.hck_at = int(self.hck_idx[0])
        self.hex_idx = holes[created_len + 32 :].reshape(n, 3, 32)
        for pos in (self.created_idx, self.hck_idx, *self.hex_idx.reshape(-1, 32)):
            if pos[-1] - pos[0] != len(pos) - 1:  # every field is one run of placeholders
                raise ValueError("a template field is not contiguous")
        edges = np.flatnonzero(np.diff(np.concatenate([[1], self.holes.astype(np.int8), [1]])))
        self.fixed = [(int(a), int(b)) for a, b in zip(edges[0::2], edges[1::2])]  # runs of non-holes
        self.tokens = [slice(int(a), int(a) + 4 * t) for a, t in zip(offsets[:-1], n_tokens)]
        self.records = [slice(int(a), int(b)) for a, b in zip(offsets[:-1], offsets[1:])]


@lru_cache(maxsize=256)
def template(layout_key: str, kv: KVLayout, n_tokens: tuple[int, ...], created_len: int) -> Template | None:
    """The template of a shape, rendered by `segment.encode` itself (zero-filled records, placeholder
    hashes), or None if the shape cannot have one (a layout whose spec holds a `#`, or that a
    header's spec and dtype do not name exactly).

    Args:
        layout_key: the namespace.
        kv: its KV layout.
        n_tokens: each slot's token count (1 to `segment.MAX_SLOTS` slots).
        created_len: characters of the creation time's text.
    """
    hole = "#" * 32
    blocks = []
    for t in n_tokens:
        arrays = [np.zeros(s, dtype=d) for s, d in zip(kv.shapes(t), kv.storage_dtypes())]
        keys, values = kv.split(arrays)
        blocks.append(HostBlock(hole, hole, np.zeros(t, dtype=np.int32), keys, values, kv.dtype))
    try:
        if seg.parse_layout(kv.spec, kv.dtype) != kv:  # a header names its layout by spec and dtype
            return None
        buffers, slots = seg.encode(blocks, layout_key, kv, 0.0)
    except (seg.BlockFileError, ValueError):
        return None
    header = bytes(buffers[0])[8:].rstrip(b" ")
    for s in slots:
        header = header.replace(s.checksum.encode(), hole.encode())
    at = header.find(seg.HEADER_CK_KEY) + len(seg.HEADER_CK_KEY)
    header = header[:at] + hole.encode() + header[at + 32 :]
    old = CREATED_KEY + b'0.0"'
    if header.count(old) != 1:
        return None
    header = header.replace(old, CREATED_KEY + b"#" * created_len + b'"')
    header += b" " * (-(8 + len(header)) % 8)
    try:
        return Template(header, n_tokens, [s.nbytes for s in slots], created_len)
    except ValueError:
        return None


def created_span(buf: bytes | bytearray, limit: int) -> tuple[int, int] | None:
    """Where the creation time's text lies in a segment file's first bytes `buf` (file offsets,
    `(start, stop)`), looked for before `limit`; None if there is no such field early in the header."""
    at = buf.find(CREATED_KEY, 8, limit)
    end = buf.find(b'"', at + len(CREATED_KEY), at + 64) if at >= 0 else -1
    return None if end < 0 else (at + len(CREATED_KEY), end)


def created_of_text(text: str | bytes | bytearray | memoryview) -> float:
    """The creation time (unix seconds) a header holds as `text` (its metadata's value, or the
    bytes at `created_span`): 0.0 where it is no finite number >= 0."""
    try:
        t = float(text if isinstance(text, str) else bytes(text))
    except ValueError:
        return 0.0
    return t if t == t and 0.0 <= t < float("inf") else 0.0
