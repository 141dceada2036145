"""HeadPieces: where a restore's records go in `[1, H, T, D]` destination buffers, head by head:
as the iovec pieces of a `preadv` (`kvtool.disk.segment.read_records`), or copied from a staging
buffer in one numpy copy per destination for many records (`HeadPieces.place`,
`kvtool.disk.restore`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class HeadPieces:
    """Writable byte views of destination buffers, head by head: where a record's bytes go.

    A record holds, after its token ids, each tensor (K0, V0, K1, V1, ...) head by head as
    `[n, D]` rows. For destinations `[1, H, T, D]` (C-contiguous per head), `pieces(offset, n)`
    returns one memoryview per (tensor, head) over rows `offset .. offset + n`, in file order:
    the iovec of a `preadv` that places the record straight into the buffers. The per-head views
    are made once, so a chain of many records costs one slice per piece.

    Args:
        arrays: destinations in record order, each `[1, H, T, D]`, writable, with every head's
            `[T, D]` C-contiguous (a whole C-contiguous buffer, or a `[:, :, a:b, :]` slice of one).

    Raises:
        ValueError: an array is not 4-D with batch 1, not writable, or a head is not contiguous.
    """

    def __init__(self, arrays: Sequence[np.ndarray]):
        self._heads: list[tuple[memoryview, int]] = []
        self._rows: list[np.ndarray] = []  # per destination, its bytes `[H, T, D * itemsize]`
        for a in arrays:
            if a.ndim != 4 or a.shape[0] != 1:
                raise ValueError(f"destination must be [1, H, T, D], got shape {a.shape}")
            row = a.shape[3] * a.itemsize
            for h in range(a.shape[1]):
                head = a[0, h]
                if not head.flags.c_contiguous or not head.flags.writeable:
                    raise ValueError("each head of a destination must be writable and C-contiguous")
                self._heads.append((head.data.cast("B"), row))
            self._rows.append(a[0].view(np.uint8))

    def __call__(self, offset: int, n: int) -> list[memoryview]:
        """Views of rows `[offset, offset + n)` of every head, in file order."""
        return [mv[offset * row : (offset + n) * row] for mv, row in self._heads]

    def place(self, offset: int, n: int, records: np.ndarray) -> None:
        """Copy `count` records of `n` tokens each into rows `offset .. offset + count * n`, in
        one copy per destination for all of them (what `__call__`'s pieces would receive, record
        after record).

        Args:
            offset: token offset of the first record.
            n: tokens per record.
            records: uint8 `[count, B]`: each record's bytes after its token ids (B = the
                destinations' bytes for `n` tokens).

        Raises:
            ValueError: `records` is not `[count, B]`, or the rows run past a destination.
        """
        count, at = records.shape[0], 0
        for rows in self._rows:
            heads, cap, width = rows.shape
            if offset + count * n > cap:
                raise ValueError(f"rows {offset}..{offset + count * n} past a destination of {cap}")
            size = heads * n * width
            dst = np.reshape(rows[:, offset : offset + count * n, :], (heads, count, n * width), copy=False)
            dst[...] = records[:, at : at + size].reshape(count, heads, n * width).transpose(1, 0, 2)
            at += size
        if at != records.shape[1]:
            raise ValueError(f"records of {records.shape[1]} bytes, destinations take {at}")


__all__ = ["HeadPieces"]
