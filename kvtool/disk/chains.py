"""The parent-chain forest of a namespace's blocks: depths, effective access times, reachability.

Every stored block (or tail entry) names its parent; the first block of a prompt names the
namespace's *root parent* (`kvtool.hashing.root_parent`). Following `parent` links turns the
rows into a forest, except that an index can hold anything (a tampered or corrupt one can make
parents form a cycle), so the structure is treated as what it is in general: a functional graph
(each node has at most one stored parent), i.e. trees hanging off either a *top* node (whose
parent is not stored) or a cycle. Everything here terminates on cycles and is O(n).

- `depth`: 0 for a top node or a node on a cycle, else its parent's depth + 1.
- `effective_access`: the newest `last_access` in a block's subtree (the block and everything
  below it). A block is needed whenever a continuation of it is, so a prefix is never older than
  what hangs below it; on a cycle, every node sees the whole component.
- `rooted`: the chain reaches the namespace's root parent through stored rows (no cycle). Only a
  rooted block can ever be found by a prefix lookup.

Two layers: `build_forest` works on numpy arrays of node numbers (what the operator commands use
at a million blocks: about 40 bytes per block, no Python object per block), and `ChainTree` /
`build_chain_tree` wrap it for callers holding hashes (tests, small trees). Hashes of 32 hex
digits become `Keys` (two uint64 per hash) where many must be matched (`KeyIndex`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from types import MappingProxyType
from typing import NamedTuple

import numpy as np

# ----------------------------------------------------------------------------- keys
# A key is a 128-bit hash as two native uint64 (the big-endian halves of its 16 bytes), so
# numeric order is byte order and numpy sorts and searches it without Python objects.


def keys_from_hex(hashes: Sequence[str]) -> np.ndarray:
    """`[N, 2]` uint64 keys of 32-hex-digit hashes (the caller checked the pattern).

    Raises:
        ValueError: a string is not 32 hex digits.
    """
    if not hashes:
        return np.zeros((0, 2), dtype=np.uint64)
    raw = bytes.fromhex("".join(hashes))
    if len(raw) != 16 * len(hashes):
        raise ValueError("a hash is not 32 hex digits")
    return np.frombuffer(raw, dtype=">u8").reshape(-1, 2).astype(np.uint64)


def key_of_hex(h: str) -> np.ndarray:
    """The `[2]` key of one hash."""
    return keys_from_hex([h])[0]


_DIGITS = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)
_PAIRS = np.full(1 << 16, 256, dtype=np.uint16)  # two ASCII bytes (one native uint16) -> their byte; 256: not hex
_PAIRS[np.stack(np.meshgrid(_DIGITS, _DIGITS, indexing="ij"), -1).reshape(-1, 2).copy().view(np.uint16).ravel()] = (
    np.arange(256)  # a pair of lowercase hex digits, first the high nibble
)


def unhex_lower(chars: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`[k, 2m]` uint8 ASCII characters -> (`[k, m]` uint8 bytes, `[k]` bool: every character was a
    lowercase hex digit), one table lookup per pair (`bytes.fromhex` also takes uppercase and
    spaces, and stops at the first bad row)."""
    got = _PAIRS[np.ascontiguousarray(chars, dtype=np.uint8).view(np.uint16)]
    return got.astype(np.uint8), np.asarray((got < 256).all(axis=1))


def hex_of_keys(keys: np.ndarray) -> list[str]:
    """The hex strings of `[N, 2]` keys."""
    text = np.ascontiguousarray(keys, dtype=np.uint64).astype(">u8").tobytes().hex()
    return [text[i : i + 32] for i in range(0, len(text), 32)]


FIND_BATCH = 1 << 17  # queries looked up at a time
INDEX_DTYPE = np.int32  # node numbers in a forest (4 bytes: a namespace holds far fewer than 2**31 blocks)


class KeyIndex:
    """Exact lookup of keys among `N` distinct keys (sorted once: O(N log N); each query
    O(log N), vectorised).

    Args:
        keys: `[N, 2]` uint64, distinct.
    """

    def __init__(self, keys: np.ndarray, is_sorted: bool = False):
        keys = np.asarray(keys, dtype=np.uint64).reshape(-1, 2)
        if is_sorted:  # already in key order (a `RowTable`'s hashes): views, no copy
            self.order: np.ndarray | None = None
            self.hi, self.lo = keys[:, 0], keys[:, 1]
        else:
            self.order = np.lexsort((keys[:, 1], keys[:, 0]))
            self.hi = keys[self.order, 0]
            self.lo = keys[self.order, 1]

    @cached_property
    def _unique_hi(self) -> bool:
        return not bool((self.hi[1:] == self.hi[:-1]).any()) if self.hi.shape[0] > 1 else True

    def find(self, queries: np.ndarray) -> np.ndarray:
        """Positions (in the keys given) of `queries` (`[Q, 2]`), -1 where absent (in slices of
        `FIND_BATCH` queries, each searched in sorted order: the temporaries stay small and the
        search walks the keys in order, whatever `Q`)."""
        q = np.asarray(queries, dtype=np.uint64).reshape(-1, 2)
        if q.shape[0] > FIND_BATCH:
            return np.concatenate([self.find(q[i : i + FIND_BATCH]) for i in range(0, q.shape[0], FIND_BATCH)])
        n = self.hi.shape[0]
        out = np.full(q.shape[0], -1, dtype=np.int64)
        if n == 0 or q.shape[0] == 0:
            return out
        by = np.argsort(q[:, 0], kind="stable")
        qhi, qlo = q[by, 0], q[by, 1]
        left = np.searchsorted(self.hi, qhi, side="left")
        at = np.minimum(left, n - 1)
        if self._unique_hi:  # one search: the high half names at most one key
            hit = (self.hi[at] == qhi) & (self.lo[at] == qlo)
            found = at[hit]
            out[by[hit]] = found if self.order is None else self.order[found]
            return out
        right = np.searchsorted(self.hi, qhi, side="right")
        hit = (right - left == 1) & (self.lo[at] == qlo)
        found = at[hit]
        out[by[hit]] = found if self.order is None else self.order[found]
        for i in np.flatnonzero(right - left > 1):  # equal high halves: rare, searched exactly
            a, b = int(left[i]), int(right[i])
            j = a + int(np.searchsorted(self.lo[a:b], qlo[i]))
            if j < b and self.lo[j] == qlo[i]:
                out[by[i]] = j if self.order is None else self.order[j]
        return out


# ----------------------------------------------------------------------------- forest
def csr(groups: np.ndarray, n_groups: int) -> tuple[np.ndarray, np.ndarray]:
    """Members grouped: `(start, members)` where group `g`'s members (indices `i` with
    `groups[i] == g`, ascending) are `members[start[g]:start[g + 1]]`; negative groups are left out."""
    groups = np.asarray(groups)
    valid = np.flatnonzero(groups >= 0).astype(INDEX_DTYPE)
    members = valid[np.argsort(groups[valid], kind="stable")]
    del valid
    start = np.zeros(n_groups + 1, dtype=np.int64)
    np.cumsum(np.bincount(groups[members], minlength=n_groups), out=start[1:])
    return start, members


def gather(start: np.ndarray, members: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """The members of every group in `groups` (a CSR from `csr`), concatenated."""
    groups = np.asarray(groups, dtype=np.int64)
    first, last = start[groups], start[groups + 1]
    counts = last - first
    total = int(counts.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    offsets = np.repeat(first - np.cumsum(counts) + counts, counts) + np.arange(total)
    return members[offsets]


@dataclass
class Forest:
    """The chain forest of `n` nodes (numbered `0..n-1`), as arrays.

    Attributes:
        parent: `[n]` int32, the stored parent's number, -1 if the parent is not stored.
        last_access: `[n]` float64 (clamped to `now` if one was given).
        depth: `[n]` int32 (see the module docstring).
        rooted: `[n]` bool.
        in_cycle: `[n]` bool.
        effective_access: `[n]` float64.
        levels: node numbers by BFS level from the bases (tops, then cycle nodes): parents
            always come before their children.
    """

    parent: np.ndarray
    last_access: np.ndarray
    depth: np.ndarray
    rooted: np.ndarray
    in_cycle: np.ndarray
    effective_access: np.ndarray
    levels: list[np.ndarray] = field(default_factory=list, repr=False)

    def __len__(self) -> int:
        return int(self.parent.shape[0])

    @cached_property
    def children(self) -> tuple[np.ndarray, np.ndarray]:
        """The children CSR (`csr(parent)`): node `i`'s children are `members[start[i]:start[i+1]]`."""
        return csr(self.parent, len(self))

    def descendants(self, nodes: np.ndarray, include: bool = True) -> np.ndarray:
        """`[n]` bool: the stored nodes below `nodes` (and, with `include`, `nodes`). Cycle-safe."""
        start, members = self.children
        mask = np.zeros(len(self), dtype=bool)
        frontier = np.unique(np.asarray(nodes, dtype=np.int64))
        if include:
            mask[frontier] = True
        while frontier.size:
            kids = gather(start, members, frontier)
            kids = kids[~mask[kids]]
            mask[kids] = True
            frontier = kids
        return mask

    def tops(self) -> np.ndarray:
        """Nodes whose parent is not stored."""
        return np.flatnonzero(self.parent < 0)


def build_forest(parent: np.ndarray, at_root: np.ndarray, last_access: np.ndarray | None, now: float | None = None) -> Forest:
    """The forest of `n` nodes.

    Args:
        parent: `[n]` int64, each node's stored parent (-1: its parent is not stored).
        at_root: `[n]` bool, the node's parent is the namespace's root parent.
        last_access: `[n]` float64 (unix seconds); None: only depths and reachability are wanted
            (`last_access` and `effective_access` are then zeros, and cost no memory).
        now: access times later than this are clamped to it (clock skew, tampering); None = no clamp.

    Returns:
        The forest. O(n) time and memory plus one numpy step per BFS level (the longest chain).
    """
    parent = np.asarray(parent, dtype=INDEX_DTYPE)
    n = parent.shape[0]
    if last_access is None:
        access = np.broadcast_to(np.float64(0.0), (n,))
    else:
        access = np.array(last_access, dtype=np.float64)
        if now is not None:
            np.minimum(access, now, out=access)
    depth = np.full(n, -1, dtype=INDEX_DTYPE)
    rooted = np.zeros(n, dtype=bool)
    in_cycle = np.zeros(n, dtype=bool)
    start, members = csr(parent, n)
    tops = np.flatnonzero(parent < 0)
    depth[tops] = 0
    rooted[tops] = np.asarray(at_root, dtype=bool)[tops]
    levels = _bfs(tops, depth, rooted, parent, start, members)
    unreached = np.flatnonzero(depth < 0)
    cycles: list[np.ndarray] = []
    if unreached.size:  # cycles (a tampered index) and what hangs below them
        cycles = _find_cycles(parent, unreached)
        bases = np.concatenate(cycles)
        in_cycle[bases] = True
        depth[bases] = 0
        levels += _bfs(bases, depth, rooted, parent, start, members)
    if last_access is None:
        return Forest(parent, access, depth, rooted, in_cycle, access, levels)
    eff = access.copy()
    for level in reversed(levels):  # children before parents
        up = level[(parent[level] >= 0) & ~in_cycle[level]]
        if up.size:
            np.maximum.at(eff, parent[up], eff[up])
    for cyc in cycles:  # every node of a cycle sees the whole component
        eff[cyc] = eff[cyc].max()
    return Forest(parent, access, depth, rooted, in_cycle, eff, levels)


def rooted_nodes(parent: np.ndarray, at_root: np.ndarray) -> np.ndarray:
    """`[n]` bool: the nodes whose chain of stored parents ends, without a cycle, at a node whose
    parent is the namespace's root parent: `build_forest(parent, at_root, None).rooted`, found by
    pointer jumping (each round doubles how far a node looks up its chain, so a chain of depth `d`
    takes ~log2(d) rounds over the nodes not yet at their top; a node in or below a cycle never
    reaches one, and stops after log2(n) rounds). No depths, levels or children: for a caller that
    needs only reachability (O(n log d) time, three `[n]` arrays).

    Args:
        parent: `[n]` int, each node's stored parent (-1: its parent is not stored).
        at_root: `[n]` bool, the node's parent is the namespace's root parent.
    """
    parent = np.asarray(parent, dtype=INDEX_DTYPE)
    n = parent.shape[0]
    jump = np.where(parent >= 0, parent, np.arange(n, dtype=INDEX_DTYPE)).astype(INDEX_DTYPE)  # a node's top is itself
    active = np.flatnonzero(parent[jump] >= 0)  # nodes whose jump is not yet a top
    for _ in range(max(1, n.bit_length())):
        if not active.size:
            break
        jump[active] = jump[jump[active]]
        active = active[parent[jump[active]] >= 0]
    return (parent[jump] < 0) & np.asarray(at_root, dtype=bool)[jump]


def _bfs(bases: np.ndarray, depth: np.ndarray, rooted: np.ndarray, parent: np.ndarray, start: np.ndarray,
         members: np.ndarray) -> list[np.ndarray]:  # fmt: skip
    """Level-by-level walk from `bases` (depth already set), setting depth and rootedness;
    nodes that already have a depth (cycle nodes) are not entered again."""
    levels = [bases]
    frontier = bases
    while frontier.size:
        kids = gather(start, members, frontier)
        kids = kids[depth[kids] < 0]
        if not kids.size:
            break
        depth[kids] = depth[parent[kids]] + 1
        rooted[kids] = rooted[parent[kids]]
        levels.append(kids)
        frontier = kids
    return levels


def _find_cycles(parent: np.ndarray, nodes: np.ndarray) -> list[np.ndarray]:
    """The cycles of the functional graph `i -> parent[i]` among `nodes` (every one of which
    leads into a cycle), each once. O(len(nodes))."""
    state: dict[int, int] = {}  # 1: on the current walk, 2: done
    cycles: list[np.ndarray] = []
    for first in nodes.tolist():
        if first in state:
            continue
        path: list[int] = []
        pos: dict[int, int] = {}
        cur = first
        while cur >= 0 and cur not in state:
            state[cur] = 1
            pos[cur] = len(path)
            path.append(cur)
            cur = int(parent[cur])
        if cur >= 0 and state[cur] == 1:
            cycles.append(np.array(path[pos[cur] :], dtype=np.int64))
        for h in path:
            state[h] = 2
    return cycles


# ----------------------------------------------------------------------------- by hash
class ChainNode(NamedTuple):
    """One block in the chain tree: its hash, parent hash (stored or not), own last access (unix
    seconds, clamped), and `depth`, `effective_access`, `rooted` as the module docstring defines
    them; `in_cycle`: it lies on a cycle of parent links (a corrupt or tampered index)."""

    hash: str
    parent: str
    last_access: float
    depth: int
    effective_access: float
    rooted: bool
    in_cycle: bool


class ChainTree:
    """The blocks of one namespace as a parent-chain tree, by hash (read-only): a `Forest`
    with the hashes of its nodes. `nodes` and `children` are built on first use (one Python
    object per block: for tests and small trees; the commands use `forest`).

    Args:
        root: the namespace's root parent.
        hashes: node `i`'s hash, or a function giving them all (called on first use).
        parents: node `i`'s parent hash, or a function giving them all.
        forest: the forest of those nodes.
    """

    def __init__(self, root: str, hashes: Sequence[str] | Callable[[], Sequence[str]],
                 parents: Sequence[str] | Callable[[], Sequence[str]], forest: Forest):  # fmt: skip
        self.root = root
        self.forest = forest
        self._hash_source = hashes
        self._parent_source = parents

    def __len__(self) -> int:
        return len(self.forest)

    @cached_property
    def hashes(self) -> Sequence[str]:
        """Node `i`'s hash, for `i` in `0..len-1` (the forest's node numbers)."""
        src = self._hash_source
        return src() if callable(src) else src

    @cached_property
    def _parents(self) -> Sequence[str]:
        src = self._parent_source
        return src() if callable(src) else src

    @cached_property
    def _number(self) -> dict[str, int]:
        return {h: i for i, h in enumerate(self.hashes)}

    @cached_property
    def nodes(self) -> Mapping[str, ChainNode]:
        """hash -> `ChainNode`."""
        f = self.forest
        cols = zip(self.hashes, self._parents, f.last_access.tolist(), f.depth.tolist(), f.effective_access.tolist(),
                   f.rooted.tolist(), f.in_cycle.tolist())  # fmt: skip
        return MappingProxyType({c[0]: ChainNode(*c) for c in cols})

    @cached_property
    def children(self) -> Mapping[str, tuple[str, ...]]:
        """hash -> hashes of the stored blocks whose parent it is (sorted)."""
        kids: dict[str, list[str]] = {}
        for i, p in enumerate(self.forest.parent.tolist()):
            if p >= 0:
                kids.setdefault(self.hashes[p], []).append(self.hashes[i])
        return MappingProxyType({p: tuple(sorted(cs)) for p, cs in kids.items()})

    def descendants(self, hashes: Iterable[str], include: bool = True) -> set[str]:
        """Every stored block below `hashes` (and, with `include`, those of `hashes` that are
        stored). Cycle-safe."""
        start = [self._number[h] for h in hashes if h in self._number]
        mask = self.forest.descendants(np.array(start, dtype=np.int64), include)
        return {self.hashes[i] for i in np.flatnonzero(mask).tolist()}

    def unrooted(self) -> list[str]:
        """Blocks no prefix lookup can reach (their chain does not end at the root), sorted."""
        return sorted(self.hashes[i] for i in np.flatnonzero(~self.forest.rooted).tolist())

    def tops(self) -> list[str]:
        """Blocks whose parent is not stored (first blocks of chains, or broken chains), sorted."""
        return sorted(self.hashes[i] for i in self.forest.tops().tolist())


def build_chain_tree(entries: Iterable[tuple[str, str, float]], root: str, now: float | None = None) -> ChainTree:
    """Build the chain tree of `(hash, parent, last_access)` entries (any strings).

    Args:
        entries: one per stored block; a repeated hash keeps its last entry.
        root: the namespace's root parent.
        now: access times later than this are clamped to it (clock skew, tampering); None = no clamp.

    Returns:
        The tree. O(n) time and memory, whatever the parent links (cycles included).
    """
    last: dict[str, tuple[str, float]] = {}
    for h, p, t in entries:
        last[h] = (p, t)
    hashes = list(last)
    number = {h: i for i, h in enumerate(hashes)}
    parents = [p for p, _ in last.values()]
    parent = np.array([number.get(p, -1) for p in parents], dtype=np.int64)
    at_root = np.array([p == root for p in parents], dtype=bool)
    access = np.array([t for _, t in last.values()], dtype=np.float64)
    return ChainTree(root, hashes, parents, build_forest(parent, at_root, access, now))


__all__ = [
    "ChainNode", "ChainTree", "Forest", "KeyIndex", "build_chain_tree", "build_forest", "csr", "gather",
    "keys_from_hex", "key_of_hex", "hex_of_keys", "rooted_nodes",
]  # fmt: skip
