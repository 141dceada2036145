"""Reading and verifying the segment files of one namespace, for `validate` (repairs, rebuild).

A `SegmentReader` opens segment files through a `ConfinedDir` (no symlink followed, only
well-formed names), verifies headers (checksum, namespace, KV layout, block size) and, on
demand, records (xxh3-128 checksum over the whole record, token digest). Results are cached, so
a record is read at most once per run whatever the number of rows that point at it.

This module never imports MLX.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from kvtool.ops.confined import ConfinedDir
from kvtool.store import segment as seg
from kvtool.store.index import IndexRow, SegmentRow
from kvtool.store.segment import BlockFileError, KVLayout, SegmentHeader, Slot


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
    try:
        t = float(header.meta.get("created", "0"))
    except ValueError:
        return 0.0
    return t if t == t and 0.0 <= t < float("inf") else 0.0


def row_disagrees(row: IndexRow, slot: Slot) -> str | None:
    """How a row differs from the header slot it points at, or None."""
    if slot.block_hash != row.hash:
        return f"slot {row.slot} of {row.segment} holds {slot.block_hash}"
    for what, mine, theirs in (("parent", row.parent, slot.parent_hash), ("num_tokens", row.num_tokens, slot.n_tokens),
                               ("nbytes", row.nbytes, slot.nbytes)):  # fmt: skip
        if mine != theirs:
            return f"{what} {mine!r} differs from its record ({theirs!r})"
    return None


__all__ = ["SegmentReader", "Record", "created_of", "row_disagrees"]
