"""The clean-segment check of `kvtool validate` (`kvtool.ops.clean_segments`) through kvtool's
compiled part for it (`kvtool/ops/_segcheck.c`): the same verdicts, without Python per file.

Per batch of segments (at most `BATCH_SEGMENTS`, and the files that fit in one reused buffer of
`BATCH_BYTES`, or one larger file alone): one C call opens and reads every file whole, confined as
`ConfinedDir.open_segment` opens it (fan-out directory and file `O_NOFOLLOW`, `lstat` before the
open, `fstat` after: no FIFO or device is ever opened), and finds each header's creation time.
The files are grouped by template (their rows' shape and the length of that creation time, as
`clean_segments._read` keys them), and one C call per group judges every file against its
template and its rows exactly as `clean_segments._judge` does (fixed header bytes, creation time
characters, lowercase hex digests, hash and parent, token digests, `deep`: record checksums, the
header checksum), with libxxhash's xxh3-128. The creation time of a clean file is read in Python,
as `records.created_of` reads it.

Used where the extension was built (`available()`); the Python path otherwise. Both give the same
`CleanSegments` (tests compare them on clean and damaged caches).

This module never imports MLX.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np

from kvtool.disk import compiled
from kvtool.disk.segment_template import Template, created_of_text

BATCH_SEGMENTS = 256  # segments read per call
BATCH_BYTES = 4 << 20  # ... or fewer: the files that fit in a buffer of this size (bytes; a larger file alone)


def _module() -> ModuleType | None:
    return compiled.load("kvtool.ops._segcheck")


def available() -> bool:
    """Whether the compiled check was built for this install."""
    return _module() is not None


def check(ctx: Any, segs: np.ndarray, buf: bytearray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`clean_segments._check` through the compiled check (`ctx`: its `_Context`, not imported
    here: that module imports this one): `(clean [k] bool, size [k] int64, created [k] float64)`
    of segments `segs` (numbers of `ctx.table`), each file read if it is at most `ctx.limit[s]`
    bytes. Safe to run on several threads at once (the GIL is released while files are read and
    judged), each with its own `buf` (the batch buffer; None: one of `BATCH_BYTES` is made).

    Raises:
        RuntimeError: the extension is not built (callers ask `available()` first).
    """
    mod = _module()
    if mod is None:
        raise RuntimeError("kvtool.ops._segcheck is not built")
    k = len(segs)
    clean, size, created = np.zeros(k, dtype=bool), np.zeros(k, dtype=np.int64), np.zeros(k, dtype=np.float64)
    limits = np.ascontiguousarray(ctx.limit[segs], dtype=np.int64)
    if buf is None:
        buf = bytearray(BATCH_BYTES)  # reused batch after batch: files are read until it is full
    a = 0
    while a < k:
        part = segs[a : a + BATCH_SEGMENTS]
        got = np.frombuffer(mod.read(ctx.cdir.fd, [ctx.names[s] for s in part.tolist()], limits[a : a + len(part)], buf),
                            dtype=np.int64).reshape(-1, 5)  # fmt: skip
        short = np.flatnonzero(got[:, 1] == -2)  # from the first file that did not fit on: the next batch
        if short.size and short[0] == 0:  # one file larger than the buffer (at most its limit): room for it
            buf = bytearray(int(got[0, 2]))
            continue
        if short.size:
            part, got = part[: short[0]], got[: short[0]]
        _judge_batch(ctx, mod, part, got, buf, a, clean, size, created)
        a += len(part)
    return clean, size, created


def _judge_batch(ctx: Any, mod: ModuleType, part: np.ndarray, got: np.ndarray, buf: bytearray, a: int,
                 clean: np.ndarray, size: np.ndarray, created: np.ndarray) -> None:  # fmt: skip
    """Judge the files of segments `part` as read into `buf` (`got`: `read`'s `[k, 5]` rows), per
    template; their verdicts go to `clean`, `size`, `created` from position `a` on."""
    offs, sizes, hlens, c0, c1 = got.T
    groups: dict[tuple[bytes, int], list[int]] = {}
    shape_of, seg_of, clen = ctx.shape_of, part.tolist(), (c1 - c0).tolist()
    for j in np.flatnonzero((sizes > 8) & (c0 >= 0)).tolist():
        groups.setdefault((shape_of(seg_of[j]), clen[j]), []).append(j)
    view = memoryview(buf)
    for key, members in groups.items():
        tpl = ctx.template_of(key)
        if tpl is None:
            continue
        idx = np.array(members, dtype=np.int64)
        idx = idx[(sizes[idx] == tpl.file_size) & (hlens[idx] == tpl.hlen)]
        if not idx.size:
            continue
        n = tpl.hex_idx.shape[0]
        rows = ctx.order[ctx.start[part[idx]][:, None] + np.arange(n)].reshape(-1)  # row numbers, slot order
        t = ctx.table  # their keys gathered here (numpy's `take` overlaps the random reads), then read in order
        want = [np.take(keys, rows, axis=0) for keys in (t.hash, t.parent, t.digest)]
        verdict = np.frombuffer(
            mod.judge(buf, np.ascontiguousarray(offs[idx]), np.arange(len(rows), dtype=np.int64), *want,
                      *_layout(ctx, tpl), ctx.deep),
            dtype=np.uint8).astype(bool)  # fmt: skip
        good = idx[verdict]
        at = a + good
        clean[at], size[at] = True, tpl.file_size
        created[at] = [created_of_text(view[o + s : o + e]) for o, s, e in zip(offs[good].tolist(), c0[good].tolist(), c1[good].tolist())]


def _layout(ctx: Any, tpl: Template) -> tuple:
    """The template as the C judge takes it: `(header, fixed [r, 2], fields [n, 3], tokens [n, 2],
    records [n, 2], created start, created length, header checksum position, file size)` (int64
    arrays; made once per template)."""
    got = ctx.native.get(tpl)
    if got is None:
        fixed = np.array(tpl.fixed, dtype=np.int64).reshape(-1, 2)
        fields = np.ascontiguousarray(tpl.hex_idx[:, :, 0], dtype=np.int64)
        tokens = np.array([(s.start, s.stop - s.start) for s in tpl.tokens], dtype=np.int64)
        records = np.array([(s.start, s.stop - s.start) for s in tpl.records], dtype=np.int64)
        c_start = int(tpl.created_idx[0]) if len(tpl.created_idx) else 0
        got = ctx.native[tpl] = (tpl.header, fixed, fields, tokens, records, c_start, len(tpl.created_idx), tpl.hck_at,
                                 tpl.file_size)  # fmt: skip
    return got


__all__ = ["available", "check", "BATCH_SEGMENTS", "BATCH_BYTES"]
