"""Reading and verifying the segment files of one namespace, for `validate` (repairs, rebuild).

Files are opened through a `ConfinedDir` (no symlink followed, only well-formed names); headers
are verified (checksum, namespace, KV layout, block size), records on demand (xxh3-128 checksum
over the whole record, token digest).

- `SegmentPass` (validate): one segment at a time, in file order: the file is opened once, its
  header read, then the records asked for are read in as few `preadv` calls as possible (the
  token ids of a record when only its digest is needed; whole records to verify them), in file
  order. Nothing is kept once the caller moves on: memory does not grow with the cache. (Clean
  segments, almost all of a healthy cache, are checked in batches by `kvtool.ops.clean_segments`
  and never come here.)
- `SegmentReader` (`--rebuild-index`): random access by (segment, slot), results cached.

This module never imports MLX.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import xxhash

from kvtool.disk import segment as seg
from kvtool.disk.confined import ConfinedDir
from kvtool.disk.index import IndexRow, SegmentRow
from kvtool.disk.segment import BlockFileError, KVLayout, SegmentHeader, Slot
from kvtool.disk.segment_template import created_of_text


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


class SegmentReader:
    """Verifying reads of one namespace's segment files (cached).

    Args:
        cdir: the namespace directory, opened confined.
        layout_key: the namespace (every header must name it).
        kv: the namespace's KV layout (None: accept the header's, e.g. when rebuilding an index
            whose meta is lost).
        block_size: tokens per full block (None: unknown); a longer record is refused.
    """

    def __init__(self, cdir: ConfinedDir, layout_key: str, kv: KVLayout | None, block_size: int | None):
        self.cdir, self.layout_key, self.kv, self.block_size = cdir, layout_key, kv, block_size
        self.errors: dict[str, str] = {}  # segment -> why its header is unusable
        self.sizes: dict[str, int] = {}
        self._headers: dict[str, SegmentHeader] = {}
        self._records: dict[tuple[str, int], Record | str] = {}
        self._fd: tuple[str, int] | None = None

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd[1])
            self._fd = None

    def __enter__(self) -> SegmentReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _open(self, name: str) -> int:
        if self._fd is not None and self._fd[0] == name:
            return self._fd[1]
        self.close()
        fd, size = self.cdir.open_segment(name)
        self.sizes[name] = size
        self._fd = (name, fd)
        return fd

    def header(self, name: str) -> SegmentHeader | None:
        """The verified header of segment `name`, or None (the reason is in `errors[name]`)."""
        if name in self._headers or name in self.errors:
            return self._headers.get(name)
        try:
            fd = self._open(name)
            header = seg.read_header(fd, self.sizes[name])
            if self.kv is not None:
                seg.check_header(header, self.layout_key, self.kv)
            elif header.layout_key != self.layout_key:
                raise BlockFileError("layout", f"segment of namespace {header.layout_key}")
            if self.block_size is not None:
                long = [s.index for s in header.slots if s.n_tokens > self.block_size]
                if long:
                    raise BlockFileError("shape", f"slot {long[0]} holds more tokens than a block ({self.block_size})")
        except FileNotFoundError:
            self.errors[name] = "missing"
            return None
        except (BlockFileError, OSError, ValueError) as exc:
            self.errors[name] = str(exc)
            return None
        self._headers[name] = header
        return header

    def record(self, name: str, index: int) -> Record | None:
        """Read slot `index` of segment `name` whole and verify it; None if it fails (the
        reason: `record_error`)."""
        key = (name, index)
        if key not in self._records:
            self._records[key] = self._read(name, index)
        got = self._records[key]
        return got if isinstance(got, Record) else None

    def record_error(self, name: str, index: int) -> str:
        got = self._records.get((name, index))
        return got if isinstance(got, str) else self.errors.get(name, "")

    def _read(self, name: str, index: int) -> Record | str:
        header = self.header(name)
        if header is None:
            return self.errors[name]
        if not 0 <= index < len(header.slots):
            return f"segment {name} has no slot {index}"
        slot = header.slots[index]
        try:
            block = seg.read_block(self._open(name), slot, header.kv)
        except (BlockFileError, OSError) as exc:
            return str(exc)
        return Record(name, slot, seg.tokens_digest(block.token_ids))

    def tokens_digest(self, name: str, index: int) -> str | None:
        """Digest of a record's token ids (one small read, no checksum), or None."""
        rec = self._records.get((name, index))
        if isinstance(rec, Record):
            return rec.tokens_digest
        header = self.header(name)
        if header is None or not 0 <= index < len(header.slots):
            return None
        slot = header.slots[index]
        if slot.codec != "none":  # compressed: the token ids are inside the encoded record
            rec = self.record(name, index)
            return rec.tokens_digest if rec is not None else None
        try:
            raw = os.pread(self._open(name), 4 * slot.n_tokens, slot.offset)
        except OSError:
            return None
        if len(raw) != 4 * slot.n_tokens:
            return None
        return seg.tokens_digest(np.frombuffer(raw, dtype="<i4"))

    def segment_row(self, name: str) -> SegmentRow | None:
        """The `segments` row a verified segment should have."""
        header = self.header(name)
        if header is None:
            return None
        return SegmentRow(name, self.sizes[name], len(header.slots), created_of(header))

    def verified_header(self, name: str) -> SegmentHeader:
        """The header of a segment already verified (a record of it was read): never None."""
        header = self.header(name)
        assert header is not None, f"segment {name} was not verified"
        return header

    def verified_segment_row(self, name: str) -> SegmentRow:
        """`segment_row` of a segment already verified (a record of it was read): never None."""
        row = self.segment_row(name)
        assert row is not None, f"segment {name} was not verified"
        return row


def created_of(header: SegmentHeader) -> float:
    """A segment's creation time from its header (0.0 if absent or malformed)."""
    return created_of_text(header.meta.get("created", "0"))


def row_disagrees(row: IndexRow, slot: Slot) -> str | None:
    """How a row differs from the header slot it points at, or None."""
    if slot.block_hash != row.hash:
        return f"slot {row.slot} of {row.segment} holds {slot.block_hash}"
    for what, mine, theirs in (("parent", row.parent, slot.parent_hash), ("num_tokens", row.num_tokens, slot.n_tokens),
                               ("nbytes", row.nbytes, slot.nbytes)):  # fmt: skip
        if mine != theirs:
            return f"{what} {mine!r} differs from its record ({theirs!r})"
    return None


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
        kv: the namespace's KV layout.
        block_size: tokens per full block; a longer record is refused.
    """

    def __init__(self, cdir: ConfinedDir, layout_key: str, kv: KVLayout, block_size: int):
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
            seg.check_header(header, self.layout_key, self.kv)
            long = [s.index for s in header.slots if s.n_tokens > self.block_size]
            if long:
                raise BlockFileError("shape", f"slot {long[0]} holds more tokens than a block ({self.block_size})")
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
            tokens = xxhash.xxh3_128_hexdigest(data[: 4 * s.n_tokens])
            if not whole:
                chk.digests[i] = tokens
            elif xxhash.xxh3_128_hexdigest(data) != s.checksum:
                chk.records[i] = f"checksum: record {s.index} ({s.block_hash}) does not match its checksum"
            else:
                chk.records[i] = Record(chk.name, s, tokens)

    def _decode(self, fd: int, s: Slot) -> Record | str:
        assert self.current is not None and self.current.header is not None
        try:
            block = seg.read_block(fd, s, self.current.header.kv)
        except (BlockFileError, OSError) as exc:
            return str(exc)
        return Record(self.current.name, s, seg.tokens_digest(block.token_ids))


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


__all__ = ["SegmentReader", "SegmentPass", "SegmentCheck", "Record", "created_of", "row_disagrees", "SPAN_GAP", "SPAN_MAX"]
