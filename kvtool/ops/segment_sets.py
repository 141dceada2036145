"""Sets of segment names for `kvtool validate`'s planner, without a string per segment.

A `SegmentSet` holds the row table's segments as a mask by segment number (`RowTable.segments`,
sorted names) and only the other names (an orphan file, a rewritten row's new segment) as
strings: unions, differences and membership are numpy work, and names are made only for the
members a caller lists.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from kvtool.disk.rowtable import RowTable


class SegmentSet:
    """A set of segment names of one namespace.

    Args:
        table: the namespace's rows (its `segments` name the mask's positions).
        mask: `[S]` bool by segment number of `table` (None: none of them).
        names: more members, by name (those among `table.segments` go into the mask).

    Attributes:
        extra: the members that are not among `table.segments`.
    """

    __slots__ = ("table", "mask", "extra")

    def __init__(self, table: RowTable, mask: np.ndarray | None = None, names: Iterable[str] = ()):
        self.table = table
        self.mask = np.zeros(len(table.segments), dtype=bool) if mask is None else mask
        self.extra: set[str] = set()
        self.add(names)

    @classmethod
    def of_rows(cls, table: RowTable, rows: np.ndarray) -> SegmentSet:
        """The segments holding the rows of mask `rows` (`[N]` bool)."""
        return cls(table, np.bincount(table.seg[rows], minlength=len(table.segments)) > 0)

    def add(self, names: Iterable[str]) -> SegmentSet:
        """Add `names` (in place); returns self."""
        numbers = self.table.segment_numbers
        for name in names:
            s = numbers.get(name)
            if s is None:
                self.extra.add(name)
            else:
                self.mask[s] = True
        return self

    def __contains__(self, name: object) -> bool:
        s = self.table.segment_numbers.get(name) if isinstance(name, str) else None
        return bool(self.mask[s]) if s is not None else name in self.extra

    def __or__(self, other: SegmentSet) -> SegmentSet:
        return SegmentSet(self.table, self.mask | other.mask, self.extra | other.extra)

    def __sub__(self, other: SegmentSet) -> SegmentSet:
        return SegmentSet(self.table, self.mask & ~other.mask, self.extra - other.extra)

    def __len__(self) -> int:
        return int(self.mask.sum()) + len(self.extra)

    def names(self) -> list[str]:
        """The members, sorted."""
        segments = self.table.segments
        return sorted([segments[s] for s in np.flatnonzero(self.mask).tolist()] + list(self.extra))


__all__ = ["SegmentSet"]
