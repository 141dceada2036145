"""The fast path of `kvtool validate`: which segments are clean, checked in batches, as columns.

A segment is *clean* when its file verifies and its rows describe it exactly: one row per slot,
each matching its own slot (hash, parent, token count, record size, token digest; `deep`: every
record's checksum too). Almost every segment of a healthy cache is; `validate` then keeps nothing
of it but its size, slot count and creation time, and checks every other segment the general way
(`kvtool.ops.records.SegmentPass`).

Per segment the work left in Python is constant, whatever its slot count: one confined open and
one read of the whole file, a few digests of its records over slices of that buffer (`map` over
precomputed slices), and a copy of its header bytes. Everything else runs on whole batches of
segments with numpy:

- The header must be byte for byte the one `segment.encode` writes for the slot table the rows
  describe (`Template`: `encode` itself renders it once per shape, with placeholders where the
  digests and the creation time go). Such a header is what `segment.parse_header` accepts, read
  exactly as it reads it: the format, layout key, KV layout, slot count, offsets and record sizes
  are in the template's fixed bytes; the placeholders must hold lowercase hex digits (the
  creation time: characters that need no JSON escape). A header of any other shape (an older
  writer, a compressed namespace, a repair of a hand-edited file) is no fault: the general path
  parses it.
- Then, vectorised over the batch: the header checksum (xxh3-128 of the header with its own value
  zeroed), each slot's hash and parent against its row's, each record's token digest against the
  row's, and with `deep` each record's checksum against its slot's.

Where kvtool's compiled check is built (`clean_native`: the same verdicts, in C, without the GIL)
the check starts as soon as the rows are read (`start_clean`; `validate` starts it from the scan,
`scan_cache(on_rows=...)`, while the directory listing is still being taken in and the plan made):
threads, one per CPU for a large cache, take ranges of consecutive segments, each finding its own
candidates from the rows and reading their files (at most their limit, confined). The listing
confirms afterwards (`CleanCheck.result(files)`): a segment is clean only if it is listed with
the size of the file judged, so a file gone or resized between the two goes the general way.
(Segment files are written once, under a new name, by rename; an edit in place that keeps the
size is no more seen than one made after the check in the order used before.)
The Python check runs once the listing is known, over worker processes for a large cache (`fork`,
where the platform has it: they share the row table without copying it, and send back only the
verdicts). The result is the same with one thread or process or several.

This module never imports MLX.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import sys
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import cast

import numpy as np
import xxhash

from kvtool.disk import segment as seg
from kvtool.disk.chains import unhex_lower
from kvtool.disk.confined import ConfinedDir
from kvtool.disk.kvlayout import KVLayout
from kvtool.disk.namespace_core import Expected
from kvtool.disk.rowtable import RowTable
from kvtool.disk.segment_template import CREATED_OK, Template, created_of_text, created_span, template
from kvtool.ops import clean_native

SHALLOW_MAX = 64 << 10  # without `deep`, a larger segment file is read whole only if ... (bytes)
SHALLOW_GAP = 64 << 10  # ... its token ids lie this close (`records.SPAN_GAP`: one read there too), else the general way
DEEP_MAX = 64 << 20  # with `deep`, the largest file read whole in one read (bytes)
BATCH_SEGMENTS = 256  # segments whose headers are checked together
BATCH_BYTES = 8 << 20  # ... or fewer, so the headers kept for a batch stay small (bytes)
PARALLEL_MIN = 16384  # segments below which one process does all (starting workers costs more than they save)
CHUNKS_PER_WORKER = 8  # pieces of work per worker (a loaded core finishes fewer)
PIECE_MAX = 2048  # segments per piece at most (progress is reported piece by piece)
_ZERO = seg.ZERO_CHECKSUM.encode()
_MISSING = object()
_Slicer = Callable[[slice], memoryview]  # made once: a subscripted type costs ~1.5 us a call


@dataclass
class CleanSegments:
    """Verdicts of `find_clean`, by segment number of the row table.

    Attributes:
        clean: `[S]` bool, the segment is clean (see the module docstring).
        size: `[S]` int64, its file size (bytes; 0 where not clean).
        created: `[S]` float64, its header's creation time (`records.created_of`; 0 where not clean).
        listed: `[S]` int64, its listed file size (bytes; -1: not listed); None where not known.
    """

    clean: np.ndarray
    size: np.ndarray
    created: np.ndarray
    listed: np.ndarray | None = None

    @classmethod
    def none(cls, n: int) -> CleanSegments:
        """No segment clean (of `n`)."""
        return cls(np.zeros(n, dtype=bool), np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.float64))


@dataclass
class _Context:
    """What every batch needs (shared with forked workers as it is)."""

    cdir: ConfinedDir
    layout_key: str
    kv: KVLayout
    block_size: int
    table: RowTable
    order: np.ndarray  # row numbers by (segment, slot)
    start: np.ndarray  # where each segment's rows begin in `order`
    nt: np.ndarray  # the rows' token counts (int32) in `order`: segment by segment, slot by slot
    names: list[str]
    deep: bool
    limit: np.ndarray  # per segment: the largest file read whole (bytes; filled by `_candidates`' callers)
    templates: dict = field(default_factory=dict)  # (shape, length of the creation time) -> `Template` or None
    native: dict = field(default_factory=dict)  # `Template` -> its arrays for the compiled check (`clean_native`)

    @cached_property
    def bounds(self) -> list[int]:
        """`start` as Python ints."""
        return self.start.tolist()

    def shape_of(self, s: int) -> bytes:
        """Segment `s`'s shape: its rows' token counts, slot by slot (int32 bytes)."""
        bounds = self.bounds
        return self.nt[bounds[s] : bounds[s + 1]].tobytes()

    def template_of(self, key: tuple[bytes, int]) -> Template | None:
        """The template of `(shape, length of the creation time)`, rendered once per key."""
        tpl = self.templates.get(key, _MISSING)
        if tpl is _MISSING:
            n_tok = tuple(np.frombuffer(key[0], dtype=np.int32).tolist())
            tpl = self.templates[key] = template(self.layout_key, self.kv, n_tok, key[1])
        return tpl


_SHARED: _Context | None = None  # the context forked workers inherit


def find_clean(cdir: ConfinedDir, layout_key: str, kv: KVLayout, block_size: int, table: RowTable, files: dict,
               deep: bool, workers: int | None = None, progress=None,
               meanwhile: Callable[[], None] | None = None) -> CleanSegments:  # fmt: skip
    """Which segments of `table` are clean (see the module docstring); reads their files once.
    `start_clean(...).result(files, ...)` in one step.

    Args:
        cdir: the namespace directory, opened confined.
        layout_key, kv, block_size: the namespace's geometry.
        table: its rows.
        files: segment name -> its listed file (`scan.SegmentFile`: `size` in bytes); a segment
            not listed, or listed with another size than the file read, is not clean.
        deep: verify every record's checksum too.
        workers: threads (compiled check) or processes to use (None: one per CPU, for a cache of
            `PARALLEL_MIN` segments or more, where `fork` exists; else 1).
        progress: called as `progress(segments_done, segments_total)` as each piece of work (at
            most `PIECE_MAX` segments) is done.
        meanwhile: called once while the workers check (this process would only wait), or
            before the check where it runs here; not called when no segment needs a check.

    Returns:
        The verdicts (`CleanSegments`), by segment number of `table`.
    """
    with start_clean(cdir, layout_key, kv, block_size, table, deep, workers) as started:
        return started.result(files, progress, meanwhile)


def start_clean(cdir: ConfinedDir, layout_key: str, kv: KVLayout, block_size: int, table: RowTable, deep: bool,
                workers: int | None = None) -> CleanCheck:  # fmt: skip
    """Start the check as soon as the rows are read: the compiled check (`clean_native`, where
    built) prepares, reads and judges on threads from now on, while the caller lists the
    directory and plans; `CleanCheck.result(files)` then keeps the segments whose listed file is
    the one read. The Python check starts in `result`. Arguments as `find_clean`'s; `cdir` must
    stay open until the check is closed (`CleanCheck.close`, or a `with` block)."""
    many = len(table.segments) >= PARALLEL_MIN
    native = clean_native.available()
    if workers is None:
        workers = (os.cpu_count() or 1) if many and (native or _can_fork()) else 1
    return CleanCheck(table, lambda: _prepare(cdir, layout_key, kv, block_size, table, deep), workers, native)


def _prepare(cdir: ConfinedDir, layout_key: str, kv: KVLayout, block_size: int, table: RowTable,
             deep: bool) -> _Context | None:  # fmt: skip
    """The check's context (candidates and limits are found piece by piece), or None for a table
    without rows."""
    n_seg = len(table.segments)
    if not n_seg:
        return None
    order, start = table.by_segment
    limit = np.full(n_seg, DEEP_MAX, dtype=np.int64)
    return _Context(cdir, layout_key, kv, block_size, table, order, start, table.num_tokens[order], table.segments,
                    deep, limit)  # fmt: skip


def _candidates_of(ctx: _Context, a: int = 0, b: int | None = None) -> np.ndarray:
    """`_candidates` of segments `a..b-1` of `ctx`, their limits put into `ctx.limit`."""
    b = len(ctx.names) if b is None else b
    cand, limit = _candidates(ctx.table, ctx.order, ctx.start, ctx.kv, ctx.block_size, ctx.deep, a, b)
    ctx.limit[a:b] = limit
    return cand


class CleanCheck:
    """A clean-segment check under way (`start_clean`). The compiled one is prepared (`prepare()`:
    the rows by segment) and run on `workers` threads from the start, in ranges of consecutive
    segments, each finding its own candidates; the Python one (in `workers` forked processes)
    starts once `result` has the listing."""

    def __init__(self, table: RowTable, prepare: Callable[[], _Context | None], workers: int, native: bool):
        self.table, self.workers = table, workers
        self.ranges: list[tuple[int, int]] = []
        self.futures: list[Future] = []
        self.pool: ThreadPoolExecutor | None = None
        if native:
            # one batch buffer per thread, made here: in the threads' own malloc arenas they would
            # stay beside this thread's free memory (at a million blocks ~20 MB more peak RSS)
            self.buffers: queue.SimpleQueue[bytearray] = queue.SimpleQueue()
            for _ in range(workers):
                self.buffers.put(bytearray(clean_native.BATCH_BYTES))
            self.pool = ThreadPoolExecutor(workers, thread_name_prefix="kvtool-clean")
            self.prepared: Future = self.pool.submit(self._dispatch, prepare)
        else:
            self.prepared = Future()
            self.prepared.set_result(prepare())

    def _dispatch(self, prepare: Callable[[], _Context | None]) -> _Context | None:
        """(On a pool thread.) Prepare, then hand the ranges to the pool."""
        ctx = prepare()
        if ctx is not None and self.pool is not None:
            self.ranges = _ranges(len(ctx.names), self.workers)
            self.futures = [self.pool.submit(self._check, ctx, a, b) for a, b in self.ranges]
        return ctx

    def _check(self, ctx: _Context, a: int, b: int) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """(On a pool thread.) The candidates of segments `a..b-1` and their verdicts
        (`clean_native.check`), with a batch buffer of the pool's."""
        segs = _candidates_of(ctx, a, b)
        buf = self.buffers.get()
        try:
            return segs, clean_native.check(ctx, segs, buf=buf)
        finally:
            self.buffers.put(buf)

    def __enter__(self) -> CleanCheck:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop: ranges not begun are dropped, the threads end (their files are closed)."""
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.pool = None

    def result(self, files: Mapping, progress=None, meanwhile: Callable[[], None] | None = None) -> CleanSegments:
        """The verdicts, by segment number (`find_clean`'s arguments); a segment is clean only if
        `files` lists it with the size of the file judged.

        Raises:
            what preparing or checking raised.
        """
        native = self.pool is not None
        if native and meanwhile is not None:
            meanwhile()
        ctx = self.prepared.result()
        if ctx is None:
            return CleanSegments.none(0)
        n_seg = len(ctx.names)
        out = CleanSegments.none(n_seg)
        listed = np.array([f.size if (f := files.get(name)) is not None else -1 for name in ctx.names], dtype=np.int64)
        results: Iterable[tuple[np.ndarray, tuple[np.ndarray, np.ndarray, np.ndarray]]]
        if native:
            results = (f.result() for f in self.futures)
            spans = [b - a for a, b in self.ranges]
        else:  # the Python check: listed files only, within their limit
            cand = _candidates_of(ctx)
            cand = cand[(listed[cand] > 0) & (listed[cand] <= ctx.limit[cand])]
            pieces = _pieces(cand, self.workers)
            results = zip(pieces, _run(ctx, pieces, self.workers, meanwhile) if cand.size else iter(()))
            spans = [len(p) for p in pieces]
            n_seg = int(cand.size)
        done = 0
        for span, (segs, (clean, size, created)) in zip(spans, results):
            out.clean[segs], out.size[segs], out.created[segs] = clean, size, created
            done += span
            if progress is not None:  # once per piece: a progress bar's update costs ~5 us a call
                progress(done, n_seg)
        self.close()
        same = out.clean & (listed == out.size)  # the file judged is the one listed
        out.size[~same], out.created[~same] = 0, 0.0
        out.clean, out.listed = same, listed
        return out


class StartedChecks:
    """Clean-segment checks started from `scan_cache`'s `on_rows` hook (`start`: one per namespace,
    each on its own confined directory), handed to the planner by namespace (`take`); `close`
    stops what is left and closes the directories."""

    def __init__(self, deep: bool):
        self.deep = deep
        self.checks: dict[str, CleanCheck] = {}
        self.dirs: list[ConfinedDir] = []

    def __enter__(self) -> StartedChecks:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self, path: Path, expected: Expected, table: RowTable) -> None:
        """Start the check of namespace directory `path` (`scan.RowsHook`); nothing if it cannot
        be opened (the planner then checks the usual way, and reports why)."""
        try:
            cdir = ConfinedDir(path.parent, path.name)
        except (OSError, ValueError):
            return
        self.dirs.append(cdir)
        self.checks[path.name] = start_clean(cdir, path.name, expected.kv, expected.block_size, table, self.deep)

    def take(self, name: str, table: RowTable | None) -> CleanCheck | None:
        """The check started for namespace `name` on this very `table` (once), or None (none was
        started, or on rows the scan then read again another way: that one is stopped)."""
        check = self.checks.pop(name, None)
        if check is not None and (table is None or check.table is not table):
            check.close()
            return None
        return check

    def close(self) -> None:
        for check in self.checks.values():
            check.close()
        self.checks.clear()
        for cdir in self.dirs:
            cdir.close()
        self.dirs.clear()


def _ranges(n_seg: int, workers: int) -> list[tuple[int, int]]:
    """Segments `0..n_seg-1` as `_pieces` splits them, each piece as its range `(a, b)`."""
    return [(int(p[0]), int(p[-1]) + 1) for p in _pieces(np.arange(n_seg), workers) if p.size]


def _pieces(segs: np.ndarray, workers: int) -> list[np.ndarray]:
    """`segs` in consecutive pieces: `CHUNKS_PER_WORKER` per worker (one with one worker), of at
    most `PIECE_MAX` segments."""
    return np.array_split(segs, max(workers * CHUNKS_PER_WORKER if workers > 1 else 1, -(-len(segs) // PIECE_MAX)))


def _can_fork() -> bool:
    return sys.platform.startswith("linux") and "fork" in multiprocessing.get_all_start_methods()


def _run(ctx: _Context, pieces: list[np.ndarray], workers: int, meanwhile=None):
    """Each piece's verdicts through the Python check, in order: in this process, or in `workers`
    forked ones; `meanwhile()` once, while the workers run (before the check, in this process)."""
    global _SHARED
    if workers <= 1:
        if meanwhile is not None:
            meanwhile()
        for part in pieces:
            yield _check(ctx, part)
        return
    _SHARED = ctx
    try:
        try:
            pool = multiprocessing.get_context("fork").Pool(workers)
        except OSError:  # no process to be had (a limit): this one does all
            yield from _run(ctx, pieces, 1, meanwhile)
            return
        with pool:
            results = pool.imap(_check_shared, pieces)
            if meanwhile is not None:
                meanwhile()
            yield from results
    finally:
        _SHARED = None


def _check_shared(part: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    assert _SHARED is not None
    return _check(_SHARED, part)


def _candidates(table: RowTable, order: np.ndarray, start: np.ndarray, kv: KVLayout, block_size: int,
                deep: bool, a: int = 0, b: int | None = None) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """Segment numbers in `a..b-1` (None: to the last) worth a fast check by their rows (slots
    0..n-1 once each, token counts of a block or less, record sizes of uncompressed records), and
    the largest file read whole of each segment `a..b-1` (`[b - a]` int64 bytes: `DEEP_MAX`;
    without `deep`, `SHALLOW_MAX` where the general way would not read it whole either)."""
    b = len(table.segments) if b is None else b
    lo, hi = int(start[a]), int(start[b])
    first = start[a : b + 1] - lo  # where each segment's rows begin among `rows`
    rows = order[lo:hi]
    count = np.diff(first)
    seg_of = np.repeat(np.arange(b - a, dtype=np.int32), count)  # int32 here: a million rows' arrays stay small
    slot, nt, nb = table.slot[rows], table.num_tokens[rows], table.nbytes[rows]
    pos = np.arange(hi - lo, dtype=np.int32)
    pos -= first.astype(np.int32)[seg_of]
    bad = slot != pos
    del pos
    sizes = np.array([0] + [kv.record_nbytes(t) for t in range(1, block_size + 1)], dtype=np.int64)
    fine = (nt >= 1) & (nt <= block_size)
    bad |= ~fine
    bad |= nb != sizes[np.where(fine, nt, 0)]
    ok = (np.bincount(seg_of[bad], minlength=b - a) == 0) & (count > 0)
    limit = np.full(b - a, DEEP_MAX, dtype=np.int64)
    if not deep:  # the bytes between two records' token ids, at most (a record's KV)
        gap = np.zeros(b - a, dtype=np.int64)
        held = np.flatnonzero(count > 0)
        gap[held] = np.maximum.reduceat(nb.astype(np.int64) - 4 * nt.astype(np.int64), first[held])
        limit[gap > SHALLOW_GAP] = SHALLOW_MAX
    return a + np.flatnonzero(ok), limit


def _check(ctx: _Context, segs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Verdicts of segments `segs` through the Python check: `(clean [k] bool, size [k] int64,
    created [k] float64)` (`clean_native.check` gives the same)."""
    k = len(segs)
    clean, size, created = np.zeros(k, dtype=bool), np.zeros(k, dtype=np.int64), np.zeros(k, dtype=np.float64)
    limit = DEEP_MAX  # what a candidate may hold (`_candidates` chose them by their listed size)
    buf = bytearray(0)
    groups: dict[Template, list] = {}
    held = waiting = 0
    for j, s in enumerate(segs.tolist()):
        got = _read(ctx, s, buf, limit)
        if got is None:
            continue
        buf, tpl, header, digests, when = got
        groups.setdefault(tpl, []).append((j, header, digests, when))
        held, waiting = held + len(header), waiting + 1
        if held >= BATCH_BYTES or waiting >= BATCH_SEGMENTS:
            _judge(ctx, segs, groups, clean, size, created)
            groups, held, waiting = {}, 0, 0
    _judge(ctx, segs, groups, clean, size, created)
    return clean, size, created


def _read(ctx: _Context, s: int, buf: bytearray, limit: int):
    """Read segment `s` whole: `(buffer, its template, header bytes, token digests, record digests)`,
    or None (unreadable, too large, a header of no known shape: the general path decides)."""
    try:
        fd, size = ctx.cdir.open_segment(ctx.names[s])
    except (OSError, ValueError):
        return None
    try:
        if not 8 < size <= limit:
            return None
        if len(buf) < size:
            buf = bytearray(max(size, 2 * len(buf)))
        view = memoryview(buf)[:size]
        if os.preadv(fd, [view], 0) != size:
            return None
    except OSError:
        return None
    finally:
        os.close(fd)
    span = created_span(buf, min(size, 8 + seg.MAX_HEADER_BYTES))  # early in the metadata
    if span is None:
        return None
    tpl = ctx.template_of((ctx.shape_of(s), span[1] - span[0]))
    if tpl is None or tpl.file_size != size or int.from_bytes(buf[:8], "little") != tpl.hlen:
        return None
    digest = xxhash.xxh3_128_digest
    part = cast(_Slicer, view.__getitem__)  # the loops run in C: `map`, not a comprehension
    toks = b"".join(map(digest, map(part, tpl.tokens)))
    recs = b"".join(map(digest, map(part, tpl.records))) if ctx.deep else b""
    head = bytes(view[8 : 8 + tpl.hlen])
    sealed = digest(head[: tpl.hck_at] + _ZERO + head[tpl.hck_at + 32 :])  # the header checksum it must hold
    return buf, tpl, head, toks + recs + sealed, created_of_text(buf[span[0] : span[1]])


def _judge(ctx: _Context, segs: np.ndarray, groups: dict, clean: np.ndarray, size: np.ndarray,
           created: np.ndarray) -> None:  # fmt: skip
    """Decide the segments read (`_read`), one numpy pass per template."""
    t = ctx.table
    for tpl, items in groups.items():
        at = np.array([j for j, _, _, _ in items], dtype=np.int64)
        k, n = len(items), tpl.hex_idx.shape[0]
        heads = np.frombuffer(b"".join(h for _, h, _, _ in items), dtype=np.uint8).reshape(k, tpl.hlen)
        ok = ~((heads != tpl.arr) & ~tpl.holes).any(axis=1)  # every fixed byte as `encode` writes it
        ok &= CREATED_OK[heads[:, tpl.created_idx]].all(axis=1)
        stored, hex_ok = unhex_lower(heads[:, np.concatenate([tpl.hck_idx, tpl.hex_idx.reshape(-1)])])
        ok &= hex_ok
        fields = stored[:, 16:].reshape(k, n, 3, 16)  # per slot: hash, parent, checksum
        computed = np.frombuffer(b"".join(d for _, _, d, _ in items), dtype=np.uint8).reshape(k, -1, 16)
        rows = ctx.order[ctx.start[segs[at]][:, None] + np.arange(n)]  # [k, n] row numbers, slot order
        # `np.take` along the rows: a gather of [N, 2] keys ~3x faster than fancy indexing
        ok &= (_keys(fields[:, :, 0]) == np.take(t.hash, rows, axis=0)).all(axis=(1, 2))
        ok &= (_keys(fields[:, :, 1]) == np.take(t.parent, rows, axis=0)).all(axis=(1, 2))
        ok &= (_keys(computed[:, :n]) == np.take(t.digest, rows, axis=0)).all(axis=(1, 2))  # token digests
        if ctx.deep:
            ok &= (computed[:, n : 2 * n] == fields[:, :, 2]).all(axis=(1, 2))  # record checksums
        ok &= (computed[:, -1] == stored[:, :16]).all(axis=1)  # header checksum
        good = at[ok]
        clean[good], size[good] = True, tpl.file_size
        created[good] = np.array([w for _, _, _, w in items], dtype=np.float64)[ok]


def _keys(raw: np.ndarray) -> np.ndarray:
    """`[..., 16]` uint8 (a hash's bytes) -> `[..., 2]` uint64 keys (`kvtool.disk.chains`)."""
    return np.ascontiguousarray(raw).view(">u8").astype(np.uint64)


__all__ = ["find_clean", "start_clean", "CleanCheck", "StartedChecks", "CleanSegments", "SHALLOW_MAX", "DEEP_MAX", "PARALLEL_MIN"]
