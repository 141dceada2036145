"""Reading and verifying the segment files of one namespace, for `validate` (repairs, rebuild).

Files are opened through a `ConfinedDir` (no symlink followed, only well-formed names); headers
are verified (checksum, namespace, KV layout, block size), records on demand (xxh3-128 checksum
over the whole record, token digest, and their token ids against the slot's chain hash:
`chained`, so a record swapped with re-sealed checksums is never a source of a row).

`SegmentPass` reads one segment at a time: the file is opened once, its header read, then the
records asked for are read in file order in as few `preadv` calls as possible (the token ids of
a record when only its digest is needed; whole records to verify them). Nothing is kept once the
caller moves on: memory does not grow with the cache. Every check is one of `kvtool.disk.verify`'s
rules.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from kvtool.disk import segment as seg
from kvtool.disk.confined import ConfinedDir
from kvtool.disk.rowtable import IndexRow, SegmentRow
from kvtool.disk.segment import BlockFileError, KVLayout, SegmentHeader, Slot
from kvtool.disk.segment_template import created_of_text
from kvtool.disk.verify import check_header, record_checksum, tokens_digest
from kvtool.hashing import blake2b_chain


@dataclass(frozen=True)
class Record:
    """A verified block record: where it is and what a row for it must say.

    Attributes:
        segment: segment name.
        slot: the header's slot.
        tokens_digest: `segment.tokens_digest` of its token ids.
    """

    segment: str
    slot: Slot
    tokens_digest: str

    def row(self, created: float, last_access: float) -> IndexRow:
        """The index row describing this record."""
        s = self.slot
        return IndexRow(s.block_hash, s.parent_hash, self.segment, s.index, s.n_tokens, s.nbytes, self.tokens_digest,
                        created, last_access)  # fmt: skip


def created_of(header: SegmentHeader) -> float:
    """A segment's creation time from its header (0.0 if absent or malformed)."""
    return created_of_text(header.meta.get("created", "0"))


UNCHAINED = "tokens: record {index} holds token ids that do not hash to its block {hash} (a swapped or forged record)"


def chained(slot: Slot, token_ids: np.ndarray | memoryview | bytes) -> bool:
    """True if a record's token ids (int32, or their little-endian bytes) hash, after its slot's
    parent, to its slot's block hash (`kvtool.hashing.blake2b_chain`, the chain hash of full
    blocks and tail entries alike). A record that passes its checksum but fails this holds another
    block's tokens (records swapped with their checksums moved and the header re-sealed): a row
    is never rewritten or adopted from it."""
    ids = np.frombuffer(token_ids, dtype="<i4") if isinstance(token_ids, bytes | bytearray | memoryview) else token_ids
    return blake2b_chain(bytes.fromhex(slot.parent_hash), ids) == slot.block_hash


SPAN_GAP = 64 << 10  # ranges closer than this are read with one preadv (bytes)
SPAN_MAX = 16 << 20  # the most one read takes at a time (bytes): bounds the buffer


@dataclass
class SegmentCheck:
    """What one `SegmentPass.read` learned about one segment file.

    Attributes:
        name: segment name.
        size: file size (bytes); 0 if it could not be opened.
        header: the verified header, or None (`error` says why).
        error: why the segment is unusable ('missing' when absent), or None.
        records: slot -> `Record` (verified whole) or why it does not verify, for the slots asked
            to verify.
        digests: slot -> tokens digest (hex; token ids read, record not verified), for the slots
            asked for a digest only.
    """

    name: str
    size: int = 0
    header: SegmentHeader | None = None
    error: str | None = None
    records: dict[int, Record | str] = field(default_factory=dict)
    digests: dict[int, str] = field(default_factory=dict)

    def segment_row(self) -> SegmentRow | None:
        """The `segments` row the file should have (None if its header is unusable)."""
        if self.header is None:
            return None
        return SegmentRow(self.name, self.size, len(self.header.slots), created_of(self.header))


class SegmentPass:
    """Reads the segment files of one namespace one at a time, each opened once.

    Args:
        cdir: the namespace directory, opened confined.
        layout_key: the namespace (every header must name it).
        kv: the namespace's KV layout (None: accept the header's, e.g. when rebuilding an index
            whose meta is lost).
        block_size: tokens per full block (None: unknown); a longer record is refused.
    """

    def __init__(self, cdir: ConfinedDir, layout_key: str, kv: KVLayout | None, block_size: int | None):
        self.cdir, self.layout_key, self.kv, self.block_size = cdir, layout_key, kv, block_size
        self._buf = bytearray()
        self._fd: int | None = None
        self.current: SegmentCheck | None = None

    def open(self, name: str) -> SegmentCheck:
        """Open segment `name` and verify its header (closing the one open before). The file stays
        open for `read` until the next `open` or `close`."""
        self.close()
        chk = self.current = SegmentCheck(name)
        try:
            fd, chk.size = self.cdir.open_segment(name)
        except FileNotFoundError:
            chk.error = "missing"
            return chk
        except (OSError, ValueError) as exc:
            chk.error = str(exc)
            return chk
        self._fd = fd
        try:
            header = seg.read_header(fd, chk.size)
            check_header(header, self.layout_key, self.kv, block_size=self.block_size)
        except (BlockFileError, OSError, ValueError) as exc:
            chk.error = str(exc)
            self.close()
            return chk
        chk.header = header
        return chk

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> SegmentPass:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def read(self, verify: Iterable[int] = (), digest: Iterable[int] = ()) -> None:
        """Read, in file order, the records `verify` (whole: checksum and token digest, into
        `current.records`) and the token ids of `digest` (into `current.digests`) of the segment
        `open` verified. A compressed record is always verified whole."""
        chk, fd = self.current, self._fd
        if chk is None or chk.header is None or fd is None:
            return
        slots = chk.header.slots
        whole = set(verify)
        wanted: list[tuple[int, int, int, bool]] = []  # (start, end, slot, whole)
        for i in sorted(whole | set(digest)):
            s = slots[i]
            if s.codec != "none":
                chk.records[i] = self._decode(fd, s)
            elif i in whole:
                wanted.append((s.offset, s.offset + s.nbytes, i, True))
            else:
                wanted.append((s.offset, s.offset + 4 * s.n_tokens, i, False))
        for span in _spans(wanted):
            self._read_span(fd, chk, span)

    def _read_span(self, fd: int, chk: SegmentCheck, span: list[tuple[int, int, int, bool]]) -> None:
        first, last = span[0][0], max(end for _, end, _, _ in span)
        if len(self._buf) < last - first:
            self._buf = bytearray(last - first)
        view = memoryview(self._buf)[: last - first]
        try:
            got = os.preadv(fd, [view], first)
        except OSError as exc:
            for _, _, i, whole in span:
                (chk.records if whole else chk.digests)[i] = str(exc) if whole else ""
            return
        slots = chk.header.slots if chk.header is not None else ()
        for start, end, i, whole in span:
            s = slots[i]
            if end - first > got:
                if whole:
                    chk.records[i] = "truncated: file ended inside a record"
                continue
            data = view[start - first : end - first]
            tokens = tokens_digest(data[: 4 * s.n_tokens])
            if not whole:
                chk.digests[i] = tokens
            elif record_checksum((data,)) != s.checksum:
                chk.records[i] = f"checksum: record {s.index} ({s.block_hash}) does not match its checksum"
            elif not chained(s, data[: 4 * s.n_tokens]):
                chk.records[i] = UNCHAINED.format(index=s.index, hash=s.block_hash)
            else:
                chk.records[i] = Record(chk.name, s, tokens)

    def _decode(self, fd: int, s: Slot) -> Record | str:
        assert self.current is not None and self.current.header is not None
        try:
            block = seg.read_block(fd, s, self.current.header.kv)
        except (BlockFileError, OSError) as exc:
            return str(exc)
        if not chained(s, block.token_ids):
            return UNCHAINED.format(index=s.index, hash=s.block_hash)
        return Record(self.current.name, s, tokens_digest(block.token_ids))


def _spans(wanted: list[tuple[int, int, int, bool]]) -> list[list[tuple[int, int, int, bool]]]:
    """Ranges (sorted by start) grouped into reads: neighbours closer than `SPAN_GAP` share one,
    up to `SPAN_MAX` bytes (a larger range is a read of its own)."""
    spans: list[list[tuple[int, int, int, bool]]] = []
    first = end = 0
    for item in sorted(wanted):
        if spans and item[0] - end <= SPAN_GAP and item[1] - first <= SPAN_MAX:
            spans[-1].append(item)
            end = max(end, item[1])
        else:
            spans.append([item])
            first, end = item[0], item[1]
    return spans


__all__ = ["SegmentPass", "SegmentCheck", "Record", "created_of", "SPAN_GAP", "SPAN_MAX"]
