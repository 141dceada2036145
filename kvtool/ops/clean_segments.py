"""The fast path of `kvtool validate`: which segments are clean, checked in batches, as columns
(docs/design.md#operator-commands-at-scale).

A segment is *clean* when its file verifies and its rows describe it exactly: one row per slot,
each matching its own slot (hash, parent, token count, record size, token digest; `deep`: every
record's checksum too). `validate` keeps nothing of a clean segment but its size, slot count and
creation time, and checks every other segment the general way (`kvtool.ops.records.SegmentPass`).

Per segment, Python makes one confined open, one read of the whole file, a few digests over
slices of it and a copy of its header; the rest runs on whole batches with numpy: the header must
be byte for byte the one `segment.encode` writes for the slot table the rows describe
(`kvtool.disk.segment_template`; a header of any other shape is no fault: the general path
parses it), then the header checksum, each slot's hash and parent and each record's token digest
(and with `deep` its checksum) are compared vectorised. The check runs once the listing is known
(a segment is clean only if listed with the size of the file judged), over forked worker
processes for a large cache; the result is the same with one process or several.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import cast

import numpy as np

from kvtool.disk import segment as seg
from kvtool.disk.chains import unhex_lower
from kvtool.disk.confined import ConfinedDir
from kvtool.disk.kvlayout import KVLayout
from kvtool.disk.rowtable import RowTable
from kvtool.disk.segment_template import CREATED_OK, Template, created_of_text, created_span, template
from kvtool.disk.verify import raw_digest, sealed_header_digest

SHALLOW_MAX = 64 << 10  # without `deep`, a larger segment file is read whole only if ... (bytes)
SHALLOW_GAP = 64 << 10  # ... its token ids lie this close (`records.SPAN_GAP`: one read there too), else the general way
DEEP_MAX = 64 << 20  # with `deep`, the largest file read whole in one read (bytes)
BATCH_SEGMENTS = 256  # segments whose headers are checked together
BATCH_BYTES = 8 << 20  # ... or fewer, so the headers kept for a batch stay small (bytes)
PARALLEL_MIN = 16384  # segments below which one process does all (starting workers costs more than they save)
CHUNKS_PER_WORKER = 8  # pieces of work per worker (a loaded core finishes fewer)
PIECE_MAX = 2048  # segments per piece at most (progress is reported piece by piece)
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
    templates: dict = field(default_factory=dict)  # (shape, length of the creation time) -> `Template` or None

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


def find_clean(cdir: ConfinedDir, layout_key: str, kv: KVLayout, block_size: int, table: RowTable, files: Mapping,
               deep: bool, workers: int | None = None, progress=None,
               meanwhile: Callable[[], None] | None = None) -> CleanSegments:  # fmt: skip
    """Which segments of `table` are clean (see the module docstring); reads their files once.

    Args:
        cdir: the namespace directory, opened confined.
        layout_key, kv, block_size: the namespace's geometry.
        table: its rows.
        files: segment name -> its listed file (`scan.SegmentFile`: `size` in bytes); a segment
            not listed, or listed with another size than the file read, is not clean.
        deep: verify every record's checksum too.
        workers: processes to use (None: one per CPU, for a cache of `PARALLEL_MIN` segments or
            more, where `fork` exists; else 1).
        progress: called as `progress(segments_done, segments_total)` as each piece of work (at
            most `PIECE_MAX` segments) is done.
        meanwhile: called once while the workers check (this process would only wait), or
            before the check where it runs here; not called when no segment needs a check.

    Returns:
        The verdicts (`CleanSegments`), by segment number of `table`.
    """
    n_seg = len(table.segments)
    if not n_seg:
        return CleanSegments.none(0)
    if workers is None:
        workers = (os.cpu_count() or 1) if n_seg >= PARALLEL_MIN and _can_fork() else 1
    order, start = table.by_segment
    ctx = _Context(cdir, layout_key, kv, block_size, table, order, start, table.num_tokens[order], table.segments, deep)
    out = CleanSegments.none(n_seg)
    listed = np.array([f.size if (f := files.get(name)) is not None else -1 for name in ctx.names], dtype=np.int64)
    cand, limit = _candidates(table, order, start, kv, block_size, deep)
    cand = cand[(listed[cand] > 0) & (listed[cand] <= limit[cand])]  # listed files only, within their limit
    pieces = _pieces(cand, workers)
    done = 0
    for segs, (clean, size, created) in zip(pieces, _run(ctx, pieces, workers, meanwhile) if cand.size else iter(())):
        out.clean[segs], out.size[segs], out.created[segs] = clean, size, created
        done += len(segs)
        if progress is not None:  # once per piece: a progress bar's update costs ~5 us a call
            progress(done, int(cand.size))
    same = out.clean & (listed == out.size)  # the file judged is the one listed
    out.size[~same], out.created[~same] = 0, 0.0
    out.clean, out.listed = same, listed
    return out


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
                deep: bool) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """Segment numbers worth a fast check by their rows (slots 0..n-1 once each, token counts of a
    block or less, record sizes of uncompressed records), and the largest file read whole of each
    segment (`[S]` int64 bytes: `DEEP_MAX`; without `deep`, `SHALLOW_MAX` where the general way
    would not read it whole either)."""
    n_seg = len(table.segments)
    rows = order
    count = np.diff(start)
    seg_of = np.repeat(np.arange(n_seg, dtype=np.int32), count)  # int32 here: a million rows' arrays stay small
    slot, nt, nb = table.slot[rows], table.num_tokens[rows], table.nbytes[rows]
    pos = np.arange(len(rows), dtype=np.int32)
    pos -= start[:-1].astype(np.int32)[seg_of]
    bad = slot != pos
    del pos
    sizes = np.array([0] + [kv.record_nbytes(t) for t in range(1, block_size + 1)], dtype=np.int64)
    fine = (nt >= 1) & (nt <= block_size)
    bad |= ~fine
    bad |= nb != sizes[np.where(fine, nt, 0)]
    ok = (np.bincount(seg_of[bad], minlength=n_seg) == 0) & (count > 0)
    limit = np.full(n_seg, DEEP_MAX, dtype=np.int64)
    if not deep:  # the bytes between two records' token ids, at most (a record's KV)
        gap = np.zeros(n_seg, dtype=np.int64)
        held = np.flatnonzero(count > 0)
        gap[held] = np.maximum.reduceat(nb.astype(np.int64) - 4 * nt.astype(np.int64), start[held])
        limit[gap > SHALLOW_GAP] = SHALLOW_MAX
    return np.flatnonzero(ok), limit


def _check(ctx: _Context, segs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Verdicts of segments `segs` through the Python check: `(clean [k] bool, size [k] int64,
    created [k] float64)`."""
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
    or None (unreadable, too large, a header of no known shape or that fails its checksum: the general
    path decides)."""
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
    head = bytes(view[8 : 8 + tpl.hlen])
    if sealed_header_digest(head, tpl.hck_at) != head[tpl.hck_at : tpl.hck_at + 32]:  # the header checksum
        return None
    part = cast(_Slicer, view.__getitem__)  # the loops run in C: `map`, not a comprehension
    toks = b"".join(map(raw_digest, map(part, tpl.tokens)))
    recs = b"".join(map(raw_digest, map(part, tpl.records))) if ctx.deep else b""
    return buf, tpl, head, toks + recs, created_of_text(buf[span[0] : span[1]])


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
        stored, hex_ok = unhex_lower(heads[:, tpl.hex_idx.reshape(-1)])
        ok &= hex_ok
        fields = stored.reshape(k, n, 3, 16)  # per slot: hash, parent, checksum
        computed = np.frombuffer(b"".join(d for _, _, d, _ in items), dtype=np.uint8).reshape(k, -1, 16)
        rows = ctx.order[ctx.start[segs[at]][:, None] + np.arange(n)]  # [k, n] row numbers, slot order
        # `np.take` along the rows: a gather of [N, 2] keys ~3x faster than fancy indexing
        ok &= (_keys(fields[:, :, 0]) == np.take(t.hash, rows, axis=0)).all(axis=(1, 2))
        ok &= (_keys(fields[:, :, 1]) == np.take(t.parent, rows, axis=0)).all(axis=(1, 2))
        ok &= (_keys(computed[:, :n]) == np.take(t.digest, rows, axis=0)).all(axis=(1, 2))  # token digests
        if ctx.deep:
            ok &= (computed[:, n : 2 * n] == fields[:, :, 2]).all(axis=(1, 2))  # record checksums
        good = at[ok]
        clean[good], size[good] = True, tpl.file_size
        created[good] = np.array([w for _, _, _, w in items], dtype=np.float64)[ok]


def _keys(raw: np.ndarray) -> np.ndarray:
    """`[..., 16]` uint8 (a hash's bytes) -> `[..., 2]` uint64 keys (`kvtool.disk.chains`)."""
    return np.ascontiguousarray(raw).view(">u8").astype(np.uint64)


__all__ = ["find_clean", "CleanSegments", "SHALLOW_MAX", "DEEP_MAX", "PARALLEL_MIN"]
