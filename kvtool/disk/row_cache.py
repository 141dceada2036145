"""The rows a namespace index's prefix lookups read, kept per process (`BlockIndex.get_many`).

A prompt's lookup reads one row per block (256 rows at 16k tokens of 64-token blocks: ~0.9 ms
of SQL and row checks, docs/benchmarks.md); a repeated prefix is answered from here instead. The
cache is exact: the index empties it when another connection or process has committed (SQLite's
`PRAGMA data_version`, compared before every use) and after every write of its own, except that a
segment insert drops only the rows it replaces and an access-time flush changes none (a cached
row keeps the `last_access` it was read with). Only rows that exist are kept, never an absence.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence

from kvtool.disk.rowtable import IndexRow

# Rows kept (~600 bytes each: ~10 MB; at 64 tokens a block, 1M tokens of prompts). A full cache
# drops its older half (insertion order).
ROW_CACHE_ROWS = 1 << 14


class RowCache:
    """hash -> `IndexRow` for one index connection; not thread-safe (the index's lock guards it).

    Attributes:
        hits: rows answered from the cache so far.
    """

    def __init__(self) -> None:
        self._rows: dict[str, IndexRow] = {}
        self._version: int | None = None
        self.hits = 0

    def lookup(self, version: int, hashes: Sequence[str]) -> tuple[dict[str, IndexRow], list[str]]:
        """(cached rows of `hashes`, the hashes to read from the database) at `data_version`
        `version`; a version other than the last one seen empties the cache first."""
        if version != self._version:
            self._rows.clear()
            self._version = version
        rows = self._rows
        found = {h: row for h in hashes if (row := rows.get(h)) is not None}
        missing = [h for h in hashes if h not in found] if len(found) < len(hashes) else []
        self.hits += len(found)
        return found, missing

    def add(self, rows: Iterable[IndexRow]) -> None:
        """Keep rows just read from the database (under the version of the last `lookup`)."""
        for row in rows:
            self._rows[row.hash] = row
        if len(self._rows) > ROW_CACHE_ROWS:
            for h in list(itertools.islice(self._rows, len(self._rows) // 2)):
                del self._rows[h]

    def drop(self, hashes: Iterable[str]) -> None:
        """Forget the rows of `hashes` (this connection is replacing them)."""
        for h in hashes:
            self._rows.pop(h, None)

    def clear(self) -> None:
        """Forget every row."""
        self._rows.clear()
