"""Batched restore of a chain of SSD blocks straight into the caller's KV buffers.

The request thread opens each segment of the chain once and checks its header (namespace, KV
layout, header checksum) and every slot (hash, parent = previous block of the chain, length).
The record reads then run on a small pool of reader threads: one `preadv` per run of
back-to-back records scatters them from the file into the destination buffers at their token
offsets (no staging copy; the iovec comes from per-head views made once, `segment.HeadPieces`),
then each record is hashed where it landed (xxh3) and the run's token ids are compared with the
prompt's in one numpy call. Small records (<= `STAGE_MAX_RECORD`) are read in chunks into a
per-thread staging buffer instead, hashed whole, and the verified ones copied into the buffers
with one numpy copy per tensor (`HeadPieces.place`, through `place`). Reads and hashing of
different runs overlap: `os.preadv` releases the GIL (xxhash keeps it for small inputs).

The first block that fails any check cuts the chain there: the caller recomputes the rest, so
the output stays exact. A damaged block loses its row (and its segment becomes suspect, so the
recomputed blocks replace its rows); an intact record holding other token ids than the prompt's
is damaged too when its row names the prompt's (`SSDStore.tokens_mismatch`: a swap with
re-sealed checksums), else a collision (its hash is isolated). Reader threads call no MLX
function: they only write into numpy views of buffers the request thread allocated.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from kvtool.disk import segment as seg
from kvtool.disk.rowtable import IndexRow
from kvtool.disk.segment import BlockFileError
from kvtool.disk.verify import record_digest, slot_holds

if TYPE_CHECKING:
    from kvtool.disk.namespace import SSDStore

log = logging.getLogger(__name__)


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


# Reader threads: one per core, 2 to 4 (hashing holds the GIL, so more threads only contend;
# cold reads are kept busy by the kernel's readahead, `_readahead`).
DEFAULT_READERS = min(4, max(2, _cores()))
TASK_BYTES = 8 << 20  # records per reader task: ~8 MiB
PARALLEL_MIN_BYTES = 32 << 20  # below this, thread hand-offs cost more than they overlap

# Small records are read run by run into a per-thread staging buffer, hashed whole and copied
# out with one numpy copy per destination tensor for up to `STAGE_BYTES` of records: per record
# one hash call, no iovec. Records above `STAGE_MAX_RECORD` are scattered straight into the
# buffers: an extra copy of them would not stay in the CPU's cache (docs/benchmarks.md).
STAGE_BYTES = 1 << 20
STAGE_MAX_RECORD = 256 << 10

DestFn = Callable[[int, int], Sequence[memoryview]]
PlaceFn = Callable[[int, int, np.ndarray], bool]

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _reader_pool() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=DEFAULT_READERS, thread_name_prefix="kvtool-reader")
        return _pool


_stage = threading.local()


def _staging(nbytes: int) -> np.ndarray:
    """This thread's staging buffer (uint8, at least `nbytes`; kept for the thread's next run)."""
    buf = getattr(_stage, "buf", None)
    if buf is None or buf.size < nbytes:
        buf = _stage.buf = np.empty(max(nbytes, STAGE_BYTES), np.uint8)
    return buf


_gc_lock = threading.Lock()
_gc_depth = 0
_gc_was_enabled = False


@contextmanager
def gc_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector (process-wide) for the block: the read phase of a
    restore makes an iovec piece (a `memoryview`) per record and head, short-lived acyclic objects
    by the ten thousand whose collections would cost a good part of the restore. Nests, and
    overlaps across threads: the collector is re-enabled (if it was enabled) when the last block
    exits."""
    global _gc_depth, _gc_was_enabled
    with _gc_lock:
        if _gc_depth == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_depth += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_depth -= 1
            if _gc_depth == 0 and _gc_was_enabled:
                gc.enable()


@dataclass
class RestoreResult:
    """What a chain restore placed.

    Attributes:
        n_ok: leading rows verified and placed in the destination.
        bytes_read: record bytes of those rows.
        failure: why the chain was cut (None if every row was restored).
    """

    n_ok: int = 0
    bytes_read: int = 0
    failure: str | None = None


class _Item(NamedTuple):  # a tuple: one per block, made faster than a dataclass
    pos: int  # position in the chain
    row: IndexRow
    slot: seg.Slot
    fd: int
    offset: int  # token offset in the prompt


def restore_chain(
    store: SSDStore,
    rows: Sequence[IndexRow],
    first_parent: str,
    token_ids: np.ndarray,
    token_offsets: Sequence[int],
    dest: DestFn,
    parallel: bool = True,
    ready: Callable[[], None] | None = None,
    place: PlaceFn | None = None,
) -> RestoreResult:
    """Restore consecutive chain blocks from SSD into destination buffers, verified.

    Args:
        store: the namespace's store (opens segments, drops bad rows, counts).
        rows: index rows of consecutive chain entries (from `SSDStore.lookup`).
        first_parent: the chain hash the first row's parent must be.
        token_ids: int32 prompt token ids `[T]`.
        token_offsets: per row, the prompt offset (tokens) of its first token.
        dest: `dest(offset, n)` -> the writable byte buffers that receive a record of `n`
            tokens placed at token `offset`: its data after the token ids, in file order
            (`segment.HeadPieces` over `[1, H, T, D]` buffers, or `KVBuffers.pieces`). Called
            from reader threads: no MLX.
        parallel: use the reader pool (False: read on the calling thread).
        ready: called on the calling thread after the segment headers are checked and before
            the first read (e.g. to wait for buffers whose allocation was started asynchronously).
        place: `place(offset, n, records)` copies verified records of `n` tokens each (uint8
            `[count, bytes after the token ids]`) to token `offset` and returns True, or returns
            False to have them copied into `dest`'s pieces (`HeadPieces.place`,
            `KVBuffers.place_records`). Called from reader threads: no MLX. None: small records
            are copied into `dest`'s pieces.

    Returns:
        A `RestoreResult`; rows beyond `n_ok` may have been partly written into `dest`.
    """
    items, fds, cut = _plan(store, rows, first_parent, token_offsets)
    try:
        if ready is not None:
            ready()
        with gc_paused():
            failures = _run(items, token_ids, dest, parallel, place)
    finally:
        for fd in fds:
            os.close(fd)
    n_ok = len(items)
    failure = cut
    for pos in sorted(failures):
        n_ok, (kind, message) = pos, failures[pos]
        failure = f"{kind}: {message}"
        it = items[pos]
        _handle_failure(store, it.row, kind, message, token_ids[it.offset : it.offset + it.slot.n_tokens])
        break
    if n_ok < len(items) or cut is not None:
        log.info("SSD chain cut after %d of %d block(s): %s", n_ok, len(rows), failure)
    ok = items[:n_ok]
    result = RestoreResult(n_ok, sum(it.slot.nbytes for it in ok), failure if n_ok < len(rows) else None)
    if ok:
        store.record_hits([it.row.hash for it in ok], result.bytes_read)
    return result


def _plan(store: SSDStore, rows: Sequence[IndexRow], first_parent: str,
          token_offsets: Sequence[int]) -> tuple[list[_Item], list[int], str | None]:  # fmt: skip
    """Open segments and check slots on the request thread (`verify.slot_holds`: hash, parent =
    the previous block of the chain, length); stop at the first bad row. Each segment's planned
    records are handed to the kernel's readahead as soon as the chain leaves that segment
    (`_readahead`)."""
    items: list[_Item] = []
    opened: dict[str, tuple[int, seg.SegmentHeader] | None] = {}
    fds: list[int] = []
    parent = first_parent
    span: list[int] = []  # [fd, first byte, end] of the current segment's planned records
    name, fd = None, -1
    slots: Sequence[seg.Slot] = ()
    append = items.append
    try:
        for pos, (row, offset) in enumerate(zip(rows, token_offsets)):
            h, index = row.hash, row.slot
            if row.segment != name:
                name = row.segment
                if name not in opened:
                    opened[name] = new = store.open_segment(name)
                    if new is not None:
                        fds.append(new[0])
                entry = opened[name]
                if entry is None:
                    return items, fds, f"segment {name} unusable"
                fd, slots = entry[0], entry[1].slots
            slot = slots[index] if index < len(slots) else None
            if slot is None or not slot_holds(slot, h, parent, row.num_tokens):
                store.discard(h, f"slot {index} of segment {name} does not hold it")
                return items, fds, "slot mismatch"
            start, end = slot.offset, slot.offset + slot.nbytes
            if span and span[0] == fd:
                if start < span[1]:
                    span[1] = start
                if end > span[2]:
                    span[2] = end
            else:
                _readahead(span)  # the previous segment's records
                span[:] = [fd, start, end]
            append(_Item(pos, row, slot, fd, offset))
            parent = h
        return items, fds, None
    finally:
        _readahead(span)


def _readahead(span: list[int]) -> None:
    """`posix_fadvise(WILLNEED)` over `[fd, start, end]` (then clears it) unless the records look
    cached already (`_looks_cached`): the kernel starts reading records that are not in the page
    cache while the request thread still checks headers and waits for its buffers' allocation,
    so a cold restore overlaps disk reads with that work. A no-op where the call is missing or
    fails (the reads stay correct, only not overlapped)."""
    if span and span[2] > span[1] and hasattr(os, "posix_fadvise"):
        fd, start, end = span
        if not _looks_cached(fd, start, end):
            try:
                os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_WILLNEED)
            except OSError:
                pass
    span.clear()


_PROBE = bytearray(1)  # one byte read by `_looks_cached` (its contents are never used)
_PROBES = 4


def _looks_cached(fd: int, start: int, end: int) -> bool:
    """True if `_PROBES` bytes spread over `[start, end)` (`end > start`) of `fd` are in the page cache
    (`preadv(RWF_NOWAIT)` reads each without waiting for the disk): the readahead hint is then
    skipped, since on cached pages it is only a walk over them (~0.1 ms per 16 MiB). False where
    `RWF_NOWAIT` is missing or refused (Linux < 4.14, another OS, a file system without it)."""
    flag = getattr(os, "RWF_NOWAIT", None)
    if flag is None:
        return False
    step = (end - 1 - start) // (_PROBES - 1)
    try:
        return all(os.preadv(fd, [_PROBE], start + k * step, flag) == 1 for k in range(_PROBES))
    except OSError:  # EAGAIN: not cached; EOPNOTSUPP: not supported here
        return False


def _tasks(items: list[_Item]) -> list[list[_Item]]:
    """Split the chain into reader tasks of ~`TASK_BYTES` consecutive records."""
    tasks: list[list[_Item]] = []
    size = TASK_BYTES
    for it in items:
        if size >= TASK_BYTES:
            tasks.append([])
            size = 0
        tasks[-1].append(it)
        size += it.slot.nbytes
    return tasks


def _read_task(task: list[_Item], token_ids: np.ndarray, dest: DestFn, place: PlaceFn | None = None) -> dict[int, tuple[str, str]]:
    """Read and verify records in order, one `preadv` batch per run of back-to-back records
    (small records: staged, `_read_staged`); stop at the first failure (returned by chain
    position)."""
    for run in _contiguous_runs(task):
        if all(it.slot.codec == "none" and it.slot.nbytes <= STAGE_MAX_RECORD for it in run):
            failed = _read_staged(run, token_ids, dest, place)
            if failed:
                return failed
            continue
        sizes = [it.slot.n_tokens for it in run]
        tokens = np.empty(sum(sizes), dtype=np.int32)
        try:
            bad = seg.read_records(run[0].fd, [it.slot for it in run], tokens,
                                   [dest(it.offset, n) for it, n in zip(run, sizes)])
        except (BlockFileError, OSError):  # find the exact record: read the run one by one
            return _read_one_by_one(run, token_ids, dest)
        wrong = _first_wrong_tokens(run, sizes, tokens, token_ids)
        if bad is not None and (wrong is None or bad <= wrong):
            it = run[bad]
            return {it.pos: ("checksum", f"record {it.slot.index} ({it.row.hash}) does not match its checksum")}
        if wrong is not None:
            return {run[wrong].pos: ("tokens", "holds other token ids")}
    return {}


def _read_staged(run: list[_Item], token_ids: np.ndarray, dest: DestFn, place: PlaceFn | None) -> dict[int, tuple[str, str]]:
    """`_read_task` for a run of small records: chunks of records of one length that hold
    consecutive prompt tokens, each read whole into the staging buffer (`_read_chunk`)."""
    i = 0
    while i < len(run):
        first = run[i].slot
        n, size, at = first.n_tokens, first.nbytes, run[i].offset
        j, limit = i + 1, i + max(1, STAGE_BYTES // size)
        while (j < len(run) and j < limit and run[j].slot.n_tokens == n and run[j].slot.nbytes == size
               and run[j].offset == at + (j - i) * n):  # fmt: skip
            j += 1
        failed = _read_chunk(run[i:j], token_ids, dest, place)
        if failed:
            return failed
        i = j
    return {}


def _read_chunk(chunk: list[_Item], token_ids: np.ndarray, dest: DestFn, place: PlaceFn | None) -> dict[int, tuple[str, str]]:
    """Read back-to-back records of `n` tokens each, holding prompt tokens `offset ..`, into the
    staging buffer; check each record's checksum over its bytes and the token ids of all at once;
    copy the records before the first failure into the destination (`place`, else `dest`)."""
    c, n, size, offset = len(chunk), chunk[0].slot.n_tokens, chunk[0].slot.nbytes, chunk[0].offset
    stage = _staging(c * size)[: c * size]
    try:
        seg.preadv_all(chunk[0].fd, [stage.data], chunk[0].slot.offset, c * size)
    except (BlockFileError, OSError):  # find the exact record: read the run one by one
        return _read_one_by_one(chunk, token_ids, dest)
    recs, mv = stage.reshape(c, size), stage.data
    bad = next((k for k, it in enumerate(chunk) if record_digest(mv[k * size : (k + 1) * size]) != it.slot.checksum), c)
    got = recs[:, : 4 * n].view(seg.TOKENS_DTYPE).reshape(-1)  # each record's token ids, in order
    wrong = _first_wrong_tokens(chunk, [n] * c, got, token_ids)
    ok = min(bad, c if wrong is None else wrong)
    if ok and not (place is not None and place(offset, n, recs[:ok, 4 * n :])):
        for k in range(ok):
            _copy_into(dest(offset + k * n, n), recs[k, 4 * n :])
    if ok == c:
        return {}
    it = chunk[ok]
    if bad == ok:
        return {it.pos: ("checksum", f"record {it.slot.index} ({it.row.hash}) does not match its checksum")}
    return {it.pos: ("tokens", "holds other token ids")}


def _copy_into(pieces: Sequence[memoryview], data: np.ndarray) -> None:
    """Copy `data` (one record's bytes after its token ids) into `pieces`, in order."""
    src, at = data.data, 0
    for m in pieces:
        m[:] = src[at : at + m.nbytes]
        at += m.nbytes
    if at != src.nbytes:
        raise BlockFileError("slot", "destination size differs from the record size")


def _first_wrong_tokens(run: list[_Item], sizes: list[int], got: np.ndarray, token_ids: np.ndarray) -> int | None:
    """Position in `run` of the first record whose token ids differ from the prompt's, or None.
    A run's records hold consecutive prompt tokens: one comparison over the whole run."""
    start = run[0].offset
    if not _consecutive(run, sizes):
        at = 0
        for k, (it, n) in enumerate(zip(run, sizes)):  # not consecutive in the prompt: one by one
            if not np.array_equal(got[at : at + n], token_ids[it.offset : it.offset + n]):
                return k
            at += n
        return None
    want = token_ids[start : start + got.size]
    if want.size == got.size and np.array_equal(got, want):
        return None
    diff = np.flatnonzero(got[: want.size] != want)
    first = int(diff[0]) if diff.size else want.size  # a prompt shorter than the run differs at its end
    return int(np.searchsorted(np.cumsum(sizes), first, side="right"))


def _consecutive(run: list[_Item], sizes: list[int]) -> bool:
    """True if the run's records hold consecutive prompt tokens (a loop over Python ints: numpy
    scalars cost more per record)."""
    at = run[0].offset
    for it, n in zip(run, sizes):
        if it.offset != at:
            return False
        at += n
    return True


def _read_one_by_one(run: list[_Item], token_ids: np.ndarray, dest: DestFn) -> dict[int, tuple[str, str]]:
    for it in run:
        n = it.slot.n_tokens
        tokens = np.empty(n, dtype=np.int32)
        try:
            if seg.read_records(it.fd, [it.slot], tokens, [dest(it.offset, n)]) is not None:
                raise BlockFileError("checksum", f"record {it.slot.index} ({it.row.hash}) does not match its checksum")
        except BlockFileError as exc:
            return {it.pos: (exc.kind, str(exc))}
        except OSError as exc:
            return {it.pos: ("io", str(exc))}
        if not np.array_equal(tokens, token_ids[it.offset : it.offset + n]):
            return {it.pos: ("tokens", "holds other token ids")}
    return {}


def _contiguous_runs(task: list[_Item]) -> list[list[_Item]]:
    """Consecutive items whose records lie back to back in the same open file."""
    runs: list[list[_Item]] = []
    for it in task:
        last = runs[-1][-1] if runs else None
        if last is not None and last.fd == it.fd and last.slot.offset + last.slot.nbytes == it.slot.offset:
            runs[-1].append(it)
        else:
            runs.append([it])
    return runs


def _run(items: list[_Item], token_ids: np.ndarray, dest: DestFn, parallel: bool,
         place: PlaceFn | None) -> dict[int, tuple[str, str]]:  # fmt: skip
    tasks = _tasks(items)
    failures: dict[int, tuple[str, str]] = {}
    if not parallel or len(tasks) <= 1 or sum(it.slot.nbytes for it in items) < PARALLEL_MIN_BYTES:
        for task in tasks:
            failures.update(_read_task(task, token_ids, dest, place))
            if failures:
                break
        return failures
    futures = [_reader_pool().submit(_read_task, task, token_ids, dest, place) for task in tasks]
    for fut in futures:
        failures.update(fut.result())
    return failures


def _handle_failure(store: SSDStore, row: IndexRow, kind: str, message: str, expected: np.ndarray) -> None:
    """Count and clean up the first failed block of a chain. `expected`: the prompt's token ids
    for that block."""
    if kind == "tokens":
        store.tokens_mismatch(row, expected, "load")
    elif kind == "io":
        log.warning("SSD read of block %s failed: %s", row.hash, message)
        store.inc("ssd_load_fail")
    else:
        store.discard(row.hash, message)
