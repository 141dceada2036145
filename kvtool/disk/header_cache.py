"""HeaderCache: parsed, verified segment headers of one process, reused while a file's header
bytes are the very bytes that were verified.

A prefix hit reads the same segments again and again (a system prompt, a conversation's earlier
turns); comparing header bytes is far cheaper than parsing and checking them again.

kvtool never writes into a segment once renamed into place, but a file may still change under
the same path (damage, another tool, a test), so an entry is keyed on the file's identity (`key_of`
its `fstat`) *and* used only when the header bytes read now are exactly the bytes that were parsed
and verified and the file has the same size: `segment.parse_header` depends on nothing else, so a
cached header is the header a fresh parse would return. Every record is still read and checked
(slot, tokens, checksum) on every hit.
"""

from __future__ import annotations

import os
import struct
import threading
from collections import OrderedDict

from kvtool.disk.segment import SegmentHeader, parse_header, read_head

DEFAULT_MAX_ENTRIES = 256
DEFAULT_MAX_BYTES = 8 << 20  # header bytes kept; the parsed slot tables take ~2x that

Key = tuple[int, int, int, int]


class HeaderCache:
    """A bounded LRU of parsed segment headers (thread-safe).

    Args:
        max_entries: headers kept at most.
        max_bytes: sum of the kept headers' lengths (bytes) at most.

    Attributes:
        hits, misses: headers reused / parsed (for tests and benchmarks).
    """

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES, max_bytes: int = DEFAULT_MAX_BYTES):
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._entries: OrderedDict[Key, tuple[bytes, SegmentHeader]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    @staticmethod
    def key_of(st: os.stat_result) -> Key:
        """A file's identity, from its `fstat`: (st_dev, st_ino, st_size, st_mtime_ns)."""
        return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)

    def read(self, fd: int, st: os.stat_result) -> SegmentHeader:
        """`segment.read_header(fd, st.st_size)` (`st`: the open file `fd`'s `fstat`), without
        parsing when the header bytes read now equal those of the header cached for this file.

        Raises:
            BlockFileError: as `segment.parse_header` (a header that fails is not kept).
            OSError: the read failed.
        """
        key = self.key_of(st)
        head = read_head(fd, st.st_size)
        with self._lock:
            got = self._entries.get(key)
            if got is not None:
                self._entries.move_to_end(key)
        if got is not None:
            raw, header = got
            if header.file_size == st.st_size and head[: len(raw)] == raw:
                self.hits += 1
                return header
        self.misses += 1
        header = parse_header(head, st.st_size)
        (n,) = struct.unpack_from("<Q", head, 0)  # parsed: the length field is sound
        self._keep(key, bytes(head[: 8 + n]), header)
        return header

    def _keep(self, key: Key, raw: bytes, header: SegmentHeader) -> None:
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= len(old[0])
            if len(raw) <= self.max_bytes:
                self._entries[key] = (raw, header)
                self._bytes += len(raw)
            while self._entries and (len(self._entries) > self.max_entries or self._bytes > self.max_bytes):
                _, (gone, _) = self._entries.popitem(last=False)
                self._bytes -= len(gone)

    def __len__(self) -> int:
        return len(self._entries)


HEADERS = HeaderCache()  # the process's: `SSDStore.open_segment` of every namespace (keys differ by inode)

__all__ = ["HeaderCache", "HEADERS", "DEFAULT_MAX_ENTRIES", "DEFAULT_MAX_BYTES"]
