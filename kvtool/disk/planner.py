"""The segment planner: which segment files of a namespace go, by TTL, by a byte budget (least
recently used first) or by block (a prompt's blocks). One planner for `kvtool prune`, `kvtool rm
--prompt` and the SSD tier's own byte budget (`kvtool.disk.budget`).

The unit of removal is a *segment file*: bytes are freed only when a whole file goes. A
segment's access time is the newest *effective* access of its blocks (`kvtool.disk.chains`: a
prefix is needed whenever a continuation of it is). Rules:

- removing a block removes its descendants, in any segment (no prefix lookup can reach them);
- a segment goes when none of its blocks is kept (a segment that keeps a block stays whole);
- `apply_ttl(cutoff)`: segments last used before `cutoff` go;
- `fit_budget`: then the least recently used segments (ties: deepest blocks first, then by name)
  until the kept bytes fit, never a segment used at or after `protect_after`.

Blocks and segments are numbered and held in numpy arrays; `SegmentPlanner(segments, tree)`
builds one from `Segment`s and a `ChainTree` (tests, small namespaces), `from_arrays` and
`from_forest` from the commands' columns. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from kvtool.disk.chains import ChainTree, Forest, csr, gather

REASONS = ["kept", "ttl", "lru", "descendant", "prompt"]  # code = position; 0: kept


def reason_code(reason: str) -> int:
    """The number of a removal reason (new reasons are added on first use)."""
    if reason not in REASONS:
        REASONS.append(reason)
    return REASONS.index(reason)


_DESCENDANT = reason_code("descendant")


@dataclass(frozen=True)
class Segment:
    """A removal unit as the planner sees it.

    Attributes:
        name: segment name.
        size: file bytes (0 if the file is gone).
        blocks: hashes of the rows stored in it (empty when planned by file age).
        access: newest effective access of its blocks (or its file's age), unix seconds.
        depth: deepest chain depth of its blocks (LRU tie-break: deepest first).
    """

    name: str
    size: int
    blocks: tuple[str, ...]
    access: float
    depth: int = 0


class SegmentPlanner:
    """Chooses the segments of one namespace (pure: no I/O; property-tested).

    Args:
        segments: the namespace's segments, by name.
        tree: the chain tree of its blocks (None when planned by file age: no blocks known).
    """

    def __init__(self, segments: Mapping[str, Segment], tree: ChainTree | None):
        names = sorted(segments)
        hashes = list(tree.hashes) if tree is not None else []
        number = {h: i for i, h in enumerate(hashes)}
        seg_of: dict[int, int] = {}
        for s, name in enumerate(names):
            for b in segments[name].blocks:
                seg_of[number.setdefault(b, len(number))] = s
        hashes += list(number)[len(hashes) :]
        block_seg = np.full(len(number), -1, dtype=np.int64)
        if seg_of:
            block_seg[list(seg_of)] = list(seg_of.values())
        parent = np.full(len(number), -1, dtype=np.int64)
        if tree is not None:
            parent[: len(tree)] = tree.forest.parent
        segs = [segments[n] for n in names]
        self._setup(names, np.array([s.size for s in segs], dtype=np.int64), np.array([s.access for s in segs], dtype=np.float64),
                    np.array([s.depth for s in segs], dtype=np.int64), block_seg, csr(parent, len(number)),
                    lambda ids: [hashes[i] for i in ids])  # fmt: skip

    @classmethod
    def from_arrays(
        cls, names: Sequence[str], size: np.ndarray, access: np.ndarray, depth: np.ndarray, block_seg: np.ndarray,
        forest: Forest | None, block_names: Callable[[np.ndarray], list[str]],
    ) -> SegmentPlanner:  # fmt: skip
        """A planner from columns.

        Args:
            names: segment names, sorted (the tie-break of equal access and depth).
            size: `[m]` file bytes per segment; access: `[m]` its access time; depth: `[m]`.
            block_seg: `[n]` each block's segment number (-1: none).
            forest: the chain forest of the `n` blocks (None: no block has children).
            block_names: block numbers -> their hashes (for reports).
        """
        self = cls.__new__(cls)
        children = forest.children if forest is not None else csr(np.full(len(block_seg), -1), len(block_seg))
        self._setup(list(names), np.asarray(size, dtype=np.int64), np.asarray(access, dtype=np.float64),
                    np.asarray(depth, dtype=np.int64), np.asarray(block_seg, dtype=np.int64), children, block_names)  # fmt: skip
        return self

    @classmethod
    def from_forest(
        cls, names: Sequence[str], size: np.ndarray, block_seg: np.ndarray, forest: Forest,
        block_names: Callable[[np.ndarray], list[str]],
    ) -> SegmentPlanner:  # fmt: skip
        """A planner whose segments' access times and depths come from their blocks: a segment's
        access is the newest effective access of its blocks, its depth their deepest.

        Args:
            names: segment names, sorted; size: `[m]` their file bytes.
            block_seg: `[n]` each block's segment number (every block has one).
            forest: the chain forest of the `n` blocks.
            block_names: block numbers -> their hashes (for reports).
        """
        start, members = csr(block_seg, len(names))
        access = np.full(len(names), -np.inf)
        depth = np.zeros(len(names), dtype=np.int64)
        has = np.flatnonzero(np.diff(start) > 0)
        if has.size:  # per segment, the max over its run of `members` (segments without blocks: -inf / 0)
            access[has] = np.maximum.reduceat(forest.effective_access[members], start[has])
            depth[has] = np.maximum.reduceat(forest.depth[members], start[has])
        self = cls.__new__(cls)
        self._setup(list(names), np.asarray(size, dtype=np.int64), access, depth, np.asarray(block_seg), forest.children,
                    block_names, (start, members))  # fmt: skip
        return self

    def _setup(self, names: list[str], size: np.ndarray, access: np.ndarray, depth: np.ndarray, block_seg: np.ndarray,
               children: tuple[np.ndarray, np.ndarray], block_names: Callable[[np.ndarray], list[str]],
               blocks_of: tuple[np.ndarray, np.ndarray] | None = None) -> None:  # fmt: skip
        self.names, self.size, self.access, self.depth = names, size, access, depth
        self.block_seg = block_seg
        self._blocks_of = blocks_of if blocks_of is not None else csr(block_seg, len(names))
        self._children = children
        # a block with a child in another segment: only those can take a kept block with them
        # when their whole segment goes (the rest of a chain in the same segment goes anyway)
        cs, kids = children
        parents = np.repeat(np.arange(len(block_seg)), np.diff(cs)) if len(block_seg) else np.zeros(0, np.int64)
        self._outside = np.zeros(len(block_seg), dtype=bool)
        if len(kids):
            self._outside[parents[block_seg[kids] != block_seg[parents]]] = True
        self._block_names = block_names
        self.block_reason = np.zeros(len(block_seg), dtype=np.int8)
        self.seg_reason = np.zeros(len(names), dtype=np.int8)
        self._left = np.diff(self._blocks_of[0])  # blocks kept per segment
        self.kept_bytes = int(size.sum())

    # ------------------------------------------------------------------ choosing
    def choose_segments(self, ids: np.ndarray, reason: str) -> None:
        """Remove segments `ids` (numbers into `names`) for `reason`, their blocks, their
        descendants (any segment), and every segment left with no block."""
        code = reason_code(reason)
        ids = np.unique(np.asarray(ids, dtype=np.int64))
        ids = ids[self.seg_reason[ids] == 0]
        if not ids.size:
            return
        self._drop(ids, code)
        blocks = gather(*self._blocks_of, ids)
        fresh = blocks[self.block_reason[blocks] == 0]
        self.block_reason[fresh] = code
        self._left[ids] = 0
        self._propagate(fresh)

    def choose_segment(self, s: int, code: int) -> None:
        """`choose_segments` for the one segment numbered `s` (into `names`), not yet chosen, with
        reason code `code` (`reason_code`), without building arrays: `fit_budget`'s loop calls it
        once per segment. Lowers `kept_bytes` by its bytes and those of segments it leaves empty."""
        start, members = self._blocks_of
        blocks = members[start[s] : start[s + 1]]
        fresh = blocks[self.block_reason[blocks] == 0]
        self.block_reason[fresh] = code
        self.seg_reason[s] = code
        self._left[s] = 0
        self.kept_bytes -= int(self.size[s])
        if fresh.size and self._outside[fresh].any():
            self._propagate(fresh)

    def choose_blocks(self, blocks: np.ndarray, reason: str) -> None:
        """Remove the blocks numbered `blocks`, their descendants (any segment), and every segment
        left without a block (for `reason` if it held one of `blocks`, else 'descendant')."""
        code = reason_code(reason)
        fresh = np.unique(np.asarray(blocks, dtype=np.int64))
        fresh = fresh[self.block_reason[fresh] == 0]
        self.block_reason[fresh] = code
        segs = self.block_seg[fresh]
        segs = segs[segs >= 0]
        np.subtract.at(self._left, segs, 1)
        own = np.unique(segs)
        own = own[(self._left[own] == 0) & (self.seg_reason[own] == 0)]
        self._drop(own, code)
        self._propagate(fresh)

    def _propagate(self, fresh: np.ndarray) -> None:
        touched = []
        frontier = fresh
        while frontier.size:
            kids = gather(*self._children, frontier)
            kids = kids[self.block_reason[kids] == 0]
            if not kids.size:
                break
            self.block_reason[kids] = _DESCENDANT
            segs = self.block_seg[kids]
            segs = segs[segs >= 0]
            np.subtract.at(self._left, segs, 1)
            touched.append(segs)
            frontier = kids
        if touched:
            t = np.unique(np.concatenate(touched))
            self._drop(t[(self._left[t] == 0) & (self.seg_reason[t] == 0)], _DESCENDANT)

    def _drop(self, ids: np.ndarray, code: int) -> None:
        self.seg_reason[ids] = code
        self.kept_bytes -= int(self.size[ids].sum())

    def apply_ttl(self, cutoff: float) -> None:
        """Remove every segment last used before `cutoff` (all counted 'ttl'), then what hangs
        below their blocks."""
        self.choose_segments(np.flatnonzero((self.access < cutoff) & (self.seg_reason == 0)), "ttl")

    def lru_candidates(self, protect_after: float | None = None) -> np.ndarray:
        """Kept segment numbers, least recently used first (ties: deepest, then by name), without
        those used at or after `protect_after`."""
        ok = self.seg_reason == 0
        if protect_after is not None:
            ok &= self.access < protect_after
        ids = np.flatnonzero(ok)
        return ids[np.lexsort((ids, -self.depth[ids], self.access[ids]))]

    # ------------------------------------------------------------------ results
    def removed_segment_ids(self) -> np.ndarray:
        """Numbers of the segments chosen (sorted)."""
        return np.flatnonzero(self.seg_reason)

    def removed_block_ids(self) -> np.ndarray:
        """Numbers of the blocks chosen (sorted)."""
        return np.flatnonzero(self.block_reason)

    def removed_block_names(self) -> list[str]:
        """Hashes of the blocks chosen."""
        return self._block_names(self.removed_block_ids())

    def counts(self) -> dict[str, tuple[int, int, int]]:
        """reason -> `(blocks, segments, segment bytes)` removed for it."""
        blocks = np.bincount(self.block_reason, minlength=len(REASONS))
        segs = np.bincount(self.seg_reason, minlength=len(REASONS))
        sizes = np.bincount(self.seg_reason, weights=self.size, minlength=len(REASONS))
        return {r: (int(blocks[i]), int(segs[i]), int(sizes[i])) for i, r in enumerate(REASONS) if i}

    @property
    def removed_blocks(self) -> dict[str, str]:
        """hash -> reason of every block chosen (one string per block: small namespaces)."""
        ids = self.removed_block_ids()
        return dict(zip(self._block_names(ids), (REASONS[c] for c in self.block_reason[ids].tolist())))

    @property
    def removed_segments(self) -> dict[str, str]:
        """name -> reason of every segment chosen."""
        return {self.names[i]: REASONS[int(self.seg_reason[i])] for i in self.removed_segment_ids().tolist()}

    @property
    def segments(self) -> dict[str, Segment]:
        """The segments as `Segment`s (one string per block: small namespaces)."""
        start, members = self._blocks_of
        return {name: Segment(name, int(self.size[i]), tuple(self._block_names(members[start[i] : start[i + 1]])),
                              float(self.access[i]), int(self.depth[i])) for i, name in enumerate(self.names)}  # fmt: skip


def fit_budget(planners: Mapping[str, SegmentPlanner], max_bytes: int, protect_after: float | None = None) -> None:
    """Remove least recently used segments of `planners` (namespace -> planner, one LRU order;
    ties by name, then namespace) until their kept bytes fit `max_bytes` (as far as they can),
    never a segment used at or after `protect_after` (unix seconds; None: any segment may go)."""
    kept = sum(p.kept_bytes for p in planners.values())
    if kept <= max_bytes:
        return
    if len(planners) == 1:
        ((ns, p),) = planners.items()
        order: Sequence[tuple[SegmentPlanner, int]] = [(p, s) for s in p.lru_candidates(protect_after).tolist()]
    else:
        keyed = [(float(p.access[s]), -int(p.depth[s]), p.names[s], ns, s)
                 for ns, p in planners.items() for s in p.lru_candidates(protect_after).tolist()]  # fmt: skip
        order = [(planners[ns], s) for *_, ns, s in sorted(keyed)]
    code = reason_code("lru")
    for p, s in order:
        if kept <= max_bytes:
            break
        if p.seg_reason[s]:  # went as a descendant of an earlier choice
            continue
        before = p.kept_bytes
        p.choose_segment(s, code)
        kept -= before - p.kept_bytes


__all__ = ["Segment", "SegmentPlanner", "fit_budget", "REASONS", "reason_code"]
