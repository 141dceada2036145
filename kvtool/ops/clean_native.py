"""The clean-segment check of `kvtool validate` (`kvtool.ops.clean_segments`) through kvtool's
compiled part for it (`kvtool/ops/_segcheck.c`): the same verdicts, without Python per file.

Per batch of segments (at most `BATCH_SEGMENTS`, and files of at most `BATCH_BYTES` together, by
their listed sizes): one C call opens and reads every file whole into one buffer, confined as
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

from kvtool.store import compiled
from kvtool.store.segment_template import Template, created_of_text

BATCH_SEGMENTS = 256  # segments read per call
BATCH_BYTES = 8 << 20  # ... or fewer, so one batch's buffer stays small (bytes, by listed size)
LIMIT = 64 << 20  # the largest file read (`clean_segments.DEEP_MAX`: candidates are chosen by it)


def _module() -> ModuleType | None:
    return compiled.load("kvtool.ops._segcheck")


def available() -> bool:
    """Whether the compiled check was built for this install."""
    return _module() is not None


def check(ctx: Any, segs: np.ndarray, tick=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`clean_segments._check` through the compiled check (`ctx`: its `_Context`, not imported
    here: that module imports this one): `(clean [k] bool, size [k] int64,
    created [k] float64)` of segments `segs` (numbers of `ctx.table`); `tick(1)` for each segment
    once its batch is checked.

    Raises:
        RuntimeError: the extension is not built (callers ask `available()` first).
    """
    mod = _module()
    if mod is None:
        raise RuntimeError("kvtool.ops._segcheck is not built")
    k = len(segs)
    clean, size, created = np.zeros(k, dtype=bool), np.zeros(k, dtype=np.int64), np.zeros(k, dtype=np.float64)
    listed = ctx.listed[segs]
    for a, b in _batches(listed):
        part = segs[a:b]
        buf = bytearray(int(listed[a:b].sum()))
        got = np.frombuffer(mod.read(ctx.cdir.fd, [ctx.names[s] for s in part.tolist()], LIMIT, buf), dtype=np.int64)
        offs, sizes, hlens, c0, c1 = got.reshape(-1, 5).T
        groups: dict[tuple[bytes, int], list[int]] = {}
        shape, seg_of, clen = ctx.shape, part.tolist(), (c1 - c0).tolist()
        for j in np.flatnonzero((sizes > 8) & (c0 >= 0)).tolist():
            groups.setdefault((shape[seg_of[j]], clen[j]), []).append(j)
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
            view = memoryview(buf)
            created[at] = [created_of_text(view[o + s : o + e]) for o, s, e in zip(offs[good].tolist(), c0[good].tolist(), c1[good].tolist())]
        if tick is not None:  # each segment once, as the Python path counts them
            for _ in range(b - a):
                tick(1)
    return clean, size, created


def _batches(listed: np.ndarray) -> list[tuple[int, int]]:
    """`(start, stop)` of consecutive segments: at most `BATCH_SEGMENTS` and `BATCH_BYTES` of
    listed size each (a larger file alone)."""
    out, a, held = [], 0, 0
    for j, n in enumerate(listed.tolist()):
        if j > a and (j - a >= BATCH_SEGMENTS or held + n > BATCH_BYTES):
            out.append((a, j))
            a, held = j, 0
        held += n
    if a < len(listed):
        out.append((a, len(listed)))
    return out


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
