"""Every block row of a namespace index in one pass, as columns (`RowTable`): what the operator
commands (`inspect`, `prune`, `validate`, `rm --prompt`) and the SSD byte budget plan from.

The rows are kept as numpy columns (88 bytes per row, no Python object per row): hashes, parents
and token digests as `[N, 2]` uint64 keys (`kvtool.disk.chains`), segments as numbers into a
sorted name list. `IndexRow`s are made on demand (`row(i)`, iteration) for the few rows a
command reports or rewrites.

A chunk of rows (a range of rowids) crosses into Python as one string that SQLite builds
(`group_concat`, without the GIL), which becomes one `bytes.fromhex` and a few numpy arrays. A
malformed row (as `IndexRow.from_db` decides) is never loaded and its rowid is kept
(`bad_rowids`, for `kvtool validate`); a chunk with such a row, or a time the fast form cannot
carry exactly, is read again one tuple per row and checked row by row.
"""

from __future__ import annotations

import math
import re
import sqlite3
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple

import numpy as np

from kvtool.disk.chains import KeyIndex, hex_of_keys, keys_from_hex
from kvtool.disk.names import is_segment_name

CHUNK_ROWS = 1 << 14  # rows converted at a time (bounds the Python objects alive while loading)
PARALLEL_MIN_ROWS = 1 << 17  # rows from which a second connection reads half the chunks (`load_rows(also=...)`)
INT32_MAX = (1 << 31) - 1
_FOUR_HASHES = re.compile(r"[0-9a-f]{128}")


def _int(v: object, lo: int = 0) -> int | None:
    """`v` if it is an int >= `lo` (not a bool: SQLite returns plain ints), else None."""
    return v if type(v) is int and v >= lo else None


def _time(v: object) -> float | None:
    """`v` as a float if it is a finite number >= 0 (SQLite REAL: a float; an int is taken), else None."""
    if type(v) is float:
        return v if 0.0 <= v < math.inf else None
    return float(v) if type(v) is int and v >= 0 else None


class IndexRow(NamedTuple):
    """One row of `blocks`: a block (or a prompt's tail entry) stored in a segment (a named tuple:
    a lookup makes one per block of the prompt, several times faster than a frozen dataclass).

    Attributes:
        hash: block chain hash (32 hex, primary key).
        parent: parent block hash (32 hex); the layout's root parent for a first block.
        segment: name of the segment file holding it (32 hex).
        slot: its record number in the segment.
        num_tokens: tokens in the block (< block_size only for a tail entry).
        nbytes: size of its record in the segment (bytes).
        tokens_digest: `segment.tokens_digest` of its token ids (32 hex).
        created: unix seconds when it was written.
        last_access: unix seconds of the last save/load (batched, may lag by flush_interval_s).
    """

    hash: str
    parent: str
    segment: str
    slot: int
    num_tokens: int
    nbytes: int
    tokens_digest: str
    created: float
    last_access: float

    @classmethod
    def from_db(cls, values: Sequence[object]) -> IndexRow | None:
        """A row from raw column values, or None if any value is malformed (NULL, wrong type,
        out of range, a hash or segment name that is not 32 lowercase hex digits)."""
        h, parent, seg, slot, n_tok, nbytes, digest, created, last = values
        try:  # one regex over the four names joined: 4 x 32 hex digits (this is the hot path)
            if not _FOUR_HASHES.fullmatch(h + parent + seg + digest) or not len(h) == len(parent) == len(seg) == 32:  # type: ignore[operator, arg-type]  # non-str: TypeError, caught
                return None
        except TypeError:
            return None
        slot, n_tok, nbytes, created, last = _int(slot), _int(n_tok, 1), _int(nbytes, 1), _time(created), _time(last)
        if slot is None or n_tok is None or nbytes is None or created is None or last is None:
            return None
        return cls(h, parent, seg, slot, n_tok, nbytes, digest, created, last)  # type: ignore[arg-type]  # str names: checked above


@dataclass(frozen=True, slots=True)  # no __dict__: one per row or file, by the million
class SegmentRow:
    """One row of `segments`: a segment file.

    Attributes:
        name: segment name (32 hex).
        nbytes: file size (bytes).
        n_blocks: records in the file.
        created: unix seconds when it was written.
    """

    name: str
    nbytes: int
    n_blocks: int
    created: float

    @classmethod
    def from_db(cls, values: Sequence[object]) -> SegmentRow | None:
        name, nbytes, n_blocks, created = values
        nums = (_int(nbytes, 1), _int(n_blocks, 1), _time(created))
        if not is_segment_name(name) or None in nums:
            return None
        return cls(name, *nums)  # type: ignore[arg-type]  # no None in nums: checked above


@dataclass
class RowTable:
    """The well-formed block rows of one index, as columns (row `i` across all of them).

    Rows are ordered by hash. Sizes in bytes, times in unix seconds.

    Attributes:
        hash, parent, digest: `[N, 2]` uint64 keys of the hash, parent hash and tokens digest.
        seg: `[N]` int64, the row's segment as a number into `segments`.
        segments: the names of the segments rows point at, sorted.
        slot, num_tokens: `[N]` int32 (values past 2**31 - 1, well-formed but impossible, as that).
        nbytes: `[N]` int32, the record size (as `slot`).
        created, last_access: `[N]` float64.
        bad_rowids: rowids of the malformed rows left out.
    """

    hash: np.ndarray
    parent: np.ndarray
    digest: np.ndarray
    seg: np.ndarray
    segments: list[str]
    slot: np.ndarray
    num_tokens: np.ndarray
    nbytes: np.ndarray
    created: np.ndarray
    last_access: np.ndarray
    bad_rowids: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return int(self.seg.shape[0])

    @classmethod
    def empty(cls) -> RowTable:
        """A table without rows."""
        keys, ints, floats = np.zeros((0, 2), np.uint64), np.zeros(0, np.int64), np.zeros(0, np.float64)
        return cls(keys, keys, keys, ints, [], ints, ints, ints, floats, floats, [])

    def __iter__(self) -> Iterator[IndexRow]:
        for i in range(len(self)):
            yield self.row(i)

    def __getitem__(self, i: int) -> IndexRow:
        return self.row(i)

    def row(self, i: int) -> IndexRow:
        """Row `i` as an `IndexRow`."""
        h, p, d = hex_of_keys(np.stack([self.hash[i], self.parent[i], self.digest[i]]))
        return IndexRow(h, p, self.segments[int(self.seg[i])], int(self.slot[i]), int(self.num_tokens[i]),
                        int(self.nbytes[i]), d, float(self.created[i]), float(self.last_access[i]))  # fmt: skip

    def hashes(self, rows: np.ndarray | None = None) -> list[str]:
        """The hashes of `rows` (row numbers; None: every row), as hex."""
        return hex_of_keys(self.hash if rows is None else self.hash[rows])

    @cached_property
    def index(self) -> KeyIndex:
        """Lookup of rows by hash key (the rows are in hash order: no copy)."""
        return KeyIndex(self.hash, is_sorted=True)

    def find(self, hashes: list[str]) -> np.ndarray:
        """Row numbers of `hashes` (32-hex strings), -1 where absent."""
        return self.index.find(keys_from_hex(hashes))

    def parent_rows(self) -> np.ndarray:
        """`[N]` int64: the row number of each row's parent, -1 if its parent has no row."""
        return self.index.find(self.parent)

    @cached_property
    def segment_numbers(self) -> dict[str, int]:
        """segment name -> its number in `segments` (segments some row points at)."""
        return {name: i for i, name in enumerate(self.segments)}

    @cached_property
    def by_segment(self) -> tuple[np.ndarray, np.ndarray]:
        """`(order, start)`: the row numbers sorted by (segment, slot), and where each segment's
        rows begin in it: segment `s`'s rows are `order[start[s]:start[s + 1]]`."""
        key = (self.seg.astype(np.uint64) << np.uint64(32)) | self.slot.astype(np.uint64)  # both >= 0: lexsort's order
        order = np.argsort(key, kind="stable").astype(np.int32)
        start = np.zeros(len(self.segments) + 1, dtype=np.int64)
        np.cumsum(np.bincount(self.seg, minlength=len(self.segments)), out=start[1:])
        return order, start


_NAMES_OK = " AND ".join([f"typeof({c})='text' AND length({c})=32" for c in ("hash", "parent", "segment", "tokens_digest")]
                         + [f"typeof({c})='integer'" for c in ("slot", "num_tokens", "nbytes")])  # fmt: skip
# Per row: the hash, parent and token digest as one string (or NULL when a value has the wrong
# type or length), the segment name, the three integers and the two times. A chunk of rows
# becomes one `bytes.fromhex`; small integers are shared objects.
_PACKED = (f"SELECT rowid, CASE WHEN {_NAMES_OK} THEN hash || parent || tokens_digest END, segment, slot, num_tokens,"
           " nbytes, created, last_access FROM blocks")  # fmt: skip
_PACKED_HEX = 3 * 32  # hex digits of one row's packed names
_HEX_ROW = re.compile(rf"[0-9a-f]{{{_PACKED_HEX}}}")
_HEX_NAME = re.compile(r"[0-9a-f]{32}")
_UPPER = "ABCDEF"  # `bytes.fromhex` takes them; a name must be lowercase
# The fast form: a whole chunk of rows as one string that SQLite builds (`group_concat`; no Python
# object per row), each row as 184 hex digits: its four names, its three integers (8 digits each)
# and its two times scaled by 2**22 (16 digits each: exact for any time from 2**30 s, 2004, to 2**41
# s whose last bit is 2**-22 s or coarser, as `time.time()` values are). A row that is malformed or
# carries another time is left out of the string; its chunk is then read the slow way.
_TIME_SCALE = 1 << 22
_TIME_MAX = float(1 << 41)
_TIME_OK = " AND ".join(f"typeof({c}) IN ('integer','real') AND {c} >= 0 AND {c} < {_TIME_MAX!r} AND "
                        f"{c} * {float(_TIME_SCALE)!r} = CAST({c} * {float(_TIME_SCALE)!r} AS INTEGER)"
                        for c in ("created", "last_access"))  # fmt: skip
_FAST_ROW = ("hash || parent || tokens_digest || segment || printf('%08x%08x%08x%016x%016x', "
             f"min(slot, {INT32_MAX}), min(num_tokens, {INT32_MAX}), min(nbytes, {INT32_MAX}), "
             f"CAST(created * {float(_TIME_SCALE)!r} AS INTEGER), "
             f"CAST(last_access * {float(_TIME_SCALE)!r} AS INTEGER))")  # fmt: skip
_FAST = f"SELECT COUNT(*), group_concat(CASE WHEN {_NAMES_OK} AND {_TIME_OK} THEN {_FAST_ROW} END, '') FROM blocks"
_FAST_BYTES = 92  # bytes of one row in the fast form


def load_rows(conn: sqlite3.Connection, where: str = "1", args: tuple = (), *, full: bool = True,
              also: sqlite3.Connection | None = None) -> RowTable:  # fmt: skip
    """Read the rows of `blocks` (those matching `where`, SQL over its columns, with `?`
    parameters `args`) in one snapshot (one read transaction: the caller's, else its own), `CHUNK_ROWS`
    of rowids at a time; malformed rows (as `IndexRow.from_db` decides) are left out and their rowids
    kept in `bad_rowids`.

    Args:
        conn: the index's connection.
        where, args: which rows.
        full: keep every column; False keeps only what a plan needs (hash, parent, segment,
            num_tokens, last_access: 52 bytes a row instead of 88); the others read as zeros.
        also: a second connection in a read transaction that sees `conn`'s very snapshot
            (`kvtool.disk.snapshot.read_snapshot(pair=True)` proves it): from `PARALLEL_MIN_ROWS` rows on,
            every other chunk is read through it, in a second thread (SQLite runs without the GIL:
            two cores share the work). The table is the same either way.

    Raises:
        sqlite3.Error: the read failed.
    """
    own = not conn.in_transaction
    if own:
        conn.execute("BEGIN")
    try:
        (expect, first, last) = conn.execute(f"SELECT COUNT(*), MIN(rowid), MAX(rowid) FROM blocks WHERE ({where})",
                                             args).fetchone()  # fmt: skip
        cols = _Columns(int(expect), full)
        chunks = range(first, last + 1, CHUNK_ROWS) if expect else range(0)
        if also is None or expect < PARALLEL_MIN_ROWS:
            _load_chunks(conn, cols, where, args, chunks)
        else:
            _load_in_two(conn, also, cols, where, args, chunks)
    finally:
        if own:
            conn.execute("COMMIT")
    return cols.table()


def _load_chunks(conn: sqlite3.Connection, cols: _Columns, where: str, args: tuple, chunks: range) -> None:
    """The rows of the rowid chunks starting at `chunks` into `cols` (which may be shared: `add`
    takes its lock)."""
    for lo in chunks:
        bounds = (*args, lo, lo + CHUNK_ROWS)
        n, text = conn.execute(f"{_FAST} WHERE ({where}) AND rowid >= ? AND rowid < ?", bounds).fetchone()
        got = _convert_fast(text, n) if n else None
        if got is not None:
            cols.add(*got)
        elif n:  # some row is malformed or unusual (a time the fast form cannot carry): row by row
            _load_rows_slowly(conn, cols, f"({where}) AND rowid >= ? AND rowid < ?", bounds)


def _load_in_two(conn: sqlite3.Connection, also: sqlite3.Connection, cols: _Columns, where: str, args: tuple,
                 chunks: range) -> None:  # fmt: skip
    """`_load_chunks` with the odd chunks read through `also` in a second thread.

    Raises:
        sqlite3.Error: either read failed (the other is waited for first).
    """
    with ThreadPoolExecutor(1, thread_name_prefix="kvtool-rows") as helper:
        odd = helper.submit(_load_chunks, also, cols, where, args, chunks[1::2])
        _load_chunks(conn, cols, where, args, chunks[::2])
    odd.result()


def _load_rows_slowly(conn: sqlite3.Connection, cols: _Columns, where: str, args: tuple) -> None:
    """The rows matching `where`, one Python tuple each, into `cols` (malformed ones by rowid)."""
    cur = conn.execute(f"{_PACKED} WHERE ({where})", args)
    while True:
        chunk = cur.fetchmany(CHUNK_ROWS)
        if not chunk:
            break
        columns = list(zip(*chunk))
        del chunk
        got = _convert(columns[1:])
        if got is None:  # some row is malformed: sort them out one by one
            ok = [i for i, row in enumerate(zip(*columns[1:])) if _row_ok(row)]
            cols.add_bad([columns[0][i] for i in sorted(set(range(len(columns[0]))) - set(ok))])
            got = _convert([[c[i] for i in ok] for c in columns[1:]]) if ok else None
            if got is None:
                continue
        cols.add(*got)


class _Columns:
    """The columns being filled, each allocated once for the rows counted (grown if more come),
    then put in hash order one at a time (the peak is the table plus one column)."""

    def __init__(self, n: int, full: bool):
        self.n, self.full = 0, full
        self.lock = threading.Lock()  # two loading threads (`_load_in_two`) add chunks
        self.bad: list[int] = []
        self.segments: dict[str, int] = {}  # segment name -> number in order of appearance
        self.cols: dict[str, np.ndarray] = {"hash": np.zeros((n, 2), np.uint64), "parent": np.zeros((n, 2), np.uint64),
                                            "seg": np.zeros(n, np.int32), "num_tokens": np.zeros(n, np.int32),
                                            "last_access": np.zeros(n, np.float64)}  # fmt: skip
        if full:
            self.cols.update(digest=np.zeros((n, 2), np.uint64), slot=np.zeros(n, np.int32), nbytes=np.zeros(n, np.int32),
                             created=np.zeros(n, np.float64))  # fmt: skip

    def add_bad(self, rowids: list[int]) -> None:
        """Rowids of malformed rows left out."""
        with self.lock:
            self.bad += rowids

    def add(self, raw: np.ndarray, segs: tuple | _SegmentNames, seg_raw: np.ndarray, ints: np.ndarray,
            times: np.ndarray) -> None:  # fmt: skip
        """A converted chunk of rows (`_convert`, `_convert_fast`), appended to the columns."""
        with self.lock:
            self._add(raw, segs, seg_raw, ints, times)

    def _add(self, raw: np.ndarray, segs: tuple | _SegmentNames, seg_raw: np.ndarray, ints: np.ndarray,
             times: np.ndarray) -> None:  # fmt: skip
        m = len(raw)
        c = self.cols
        if self.n + m > len(c["hash"]):  # rows inserted after the count (no enclosing transaction)
            grow = max(m, len(c["hash"]) // 4)
            for k, a in c.items():
                c[k] = np.concatenate([a, np.zeros((grow, *a.shape[1:]), a.dtype)])
        at = slice(self.n, self.n + m)
        # a segment's rows are inserted together, so they come in runs: one dict lookup per run
        keys = seg_raw.view(">u8").reshape(m, 2)
        starts = np.flatnonzero(np.concatenate([[True], (keys[1:] != keys[:-1]).any(axis=1)]))
        number = self.segments.setdefault
        runs = np.array([number(segs[i], len(self.segments)) for i in starts.tolist()], dtype=np.int32)
        c["seg"][at] = np.repeat(runs, np.diff(np.append(starts, m)))
        names = raw.view(">u8").reshape(m, 3, 2)
        c["hash"][at], c["parent"][at] = names[:, 0], names[:, 1]
        # int32: larger values (a tampered row; still well-formed) are kept as INT32_MAX, which no
        # slot, block or record reaches: every comparison with a header answers as for the value
        np.minimum(ints, INT32_MAX, out=ints)
        c["num_tokens"][at], c["last_access"][at] = ints[1], times[1]
        if self.full:
            c["digest"][at], c["slot"][at], c["nbytes"][at], c["created"][at] = names[:, 2], ints[0], ints[2], times[0]
        self.n += m

    def table(self) -> RowTable:
        n, c = self.n, self.cols
        order = _hash_order(c["hash"][:n])
        out: dict[str, np.ndarray] = {}
        for k in list(c):  # one column copied at a time, the old one freed (`take`: [N, 2] keys ~3x faster than `[order]`)
            out[k] = np.take(c.pop(k)[:n], order, axis=0)
        names = sorted(self.segments)
        renumber = np.zeros(max(len(names), 1), dtype=np.int32)
        renumber[[self.segments[x] for x in names]] = np.arange(len(names), dtype=np.int32)
        seg = renumber[out.pop("seg")] if n else out.pop("seg")
        ints0, floats0 = np.broadcast_to(np.int32(0), (n,)), np.broadcast_to(np.float64(0.0), (n,))  # not read: no memory
        if self.full:
            digest, slot, nbytes, created = out["digest"], out["slot"], out["nbytes"], out["created"]
        else:
            digest, slot, nbytes, created = np.broadcast_to(np.zeros(2, np.uint64), (n, 2)), ints0, ints0, floats0
        return RowTable(out["hash"], out["parent"], digest, seg, names, slot, out["num_tokens"], nbytes, created,
                        out["last_access"], sorted(self.bad))  # fmt: skip


def _hash_order(keys: np.ndarray) -> np.ndarray:
    """The order of `[N, 2]` keys: by their high halves alone (one sort of N numbers) when those
    are distinct, as they are but by a 1-in-2**64 chance; else by both."""
    order = np.argsort(keys[:, 0], kind="stable")
    high = keys[order, 0]
    if (high[1:] == high[:-1]).any():
        order = np.lexsort((keys[:, 1], keys[:, 0]))
    return order


def _convert(columns: list) -> tuple[np.ndarray, tuple, np.ndarray, np.ndarray, np.ndarray] | None:
    """`([n, 48] bytes of hash, parent, digest; segment names; [n, 16] their bytes; [3, n] ints;
    [2, n] times)` of
    columns `packed names, segment, slot, num_tokens, nbytes, created, last_access`, or None if
    a row is malformed."""
    packed, segs, slot, n_tok, nbytes, created, last = columns
    if None in packed:  # a name or number of the wrong type or length (see _NAMES_OK)
        return None
    joined, seg_joined = "".join(packed), "".join(segs)
    try:
        raw, seg_raw = bytes.fromhex(joined), bytes.fromhex(seg_joined)
    except ValueError:  # not hex
        return None
    if len(raw) * 2 != _PACKED_HEX * len(packed) or len(seg_raw) != 16 * len(segs):  # whitespace inside a name
        return None
    if any(c in joined or c in seg_joined for c in _UPPER):
        return None
    ints = np.array([slot, n_tok, nbytes], dtype=np.int64)
    if not ((ints[0] >= 0).all() and (ints[1:] >= 1).all()):
        return None
    if not (set(map(type, created)) | set(map(type, last))) <= {int, float}:
        return None
    times = np.array([created, last], dtype=np.float64)
    if not (np.isfinite(times).all() and (times >= 0).all()):
        return None
    return (np.frombuffer(raw, dtype=np.uint8).reshape(len(packed), _PACKED_HEX // 2), segs,
            np.frombuffer(seg_raw, dtype=np.uint8).reshape(len(segs), 16), ints, times)  # fmt: skip


def _convert_fast(text: str | None, n: int) -> tuple[np.ndarray, _SegmentNames, np.ndarray, np.ndarray,
                                                     np.ndarray] | None:  # fmt: skip
    """`_convert`'s result from a chunk of `n` rows in the fast form, or None if a row was left out
    or is malformed (the chunk is then read row by row)."""
    if text is None or len(text) != 2 * _FAST_BYTES * n or any(c in text for c in _UPPER):
        return None
    try:
        raw = np.frombuffer(bytes.fromhex(text), dtype=np.uint8).reshape(n, _FAST_BYTES)
    except ValueError:  # not hex
        return None
    ints = np.ascontiguousarray(raw[:, 64:76]).view(">u4").astype(np.int64).T.copy()  # [3, n]
    if not ((ints[1:] >= 1).all()):
        return None
    times = np.ascontiguousarray(raw[:, 76:92]).view(">u8").astype(np.float64).T / _TIME_SCALE  # [2, n], exact
    seg_raw = raw[:, 48:64]
    return np.ascontiguousarray(raw[:, :48]), _SegmentNames(seg_raw), np.ascontiguousarray(seg_raw), ints, times


class _SegmentNames:
    """The segment names of a chunk, made on demand (`_Columns.add` asks one per run of rows)."""

    def __init__(self, raw: np.ndarray):
        self.raw = raw

    def __getitem__(self, i: int) -> str:
        return self.raw[i].tobytes().hex()


def _row_ok(row: tuple) -> bool:
    """One row (`packed names, segment, slot, num_tokens, nbytes, created, last_access`) is
    well-formed, as `IndexRow.from_db` requires."""
    packed, seg, slot, n_tok, nbytes, created, last = row
    if packed is None or _HEX_ROW.fullmatch(packed) is None or _HEX_NAME.fullmatch(seg) is None:
        return False
    if slot < 0 or n_tok < 1 or nbytes < 1:  # ints: the SQL checked their type
        return False
    return all(type(v) in (int, float) and math.isfinite(v) and v >= 0 for v in (created, last))


__all__ = ["RowTable", "IndexRow", "SegmentRow", "load_rows", "CHUNK_ROWS"]
