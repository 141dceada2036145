"""The parent-chain tree of a namespace's blocks: depths, effective access times, reachability.

Every stored block (or tail entry) names its parent; the first block of a prompt names the
namespace's *root parent* (`kvtool.hashing.root_parent`). Following `parent` links turns the
rows into a forest, except that an index can hold anything (a tampered or corrupt one can make
parents form a cycle), so the structure is treated as what it is in general: a functional graph
(each node has at most one stored parent), i.e. trees hanging off either a *top* node (whose
parent is not stored) or a cycle. Everything here is iterative, O(n), and terminates on cycles.

- `depth`: 0 for a top node or a node on a cycle, else its parent's depth + 1.
- `effective_access`: the newest `last_access` in a block's subtree (the block and everything
  below it). A block is needed whenever a continuation of it is, so a prefix is never older than
  what hangs below it; on a cycle, every node sees the whole component.
- `rooted`: the chain reaches the namespace's root parent through stored rows (no cycle). Only a
  rooted block can ever be found by a prefix lookup.

This module never imports MLX.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import NamedTuple


class ChainNode(NamedTuple):
    """One block in the chain tree (immutable).

    Attributes:
        hash: the block's chain hash.
        parent: its parent hash (stored or not).
        last_access: its own last access (unix seconds, clamped to the scan time).
        depth: 0 if its parent is not stored or it lies on a cycle, else parent depth + 1.
        effective_access: newest `last_access` in its subtree (itself included).
        rooted: its chain of stored parents ends at the namespace's root parent.
        in_cycle: it lies on a cycle of parent links (a corrupt or tampered index).
    """

    hash: str
    parent: str
    last_access: float
    depth: int
    effective_access: float
    rooted: bool
    in_cycle: bool


@dataclass(frozen=True)
class ChainTree:
    """The blocks of one namespace as a parent-chain tree (read-only).

    Attributes:
        root: the namespace's root parent (the parent of every prompt's first block).
        nodes: hash -> `ChainNode`.
        children: hash -> hashes of the stored blocks whose parent it is (sorted).
    """

    root: str
    nodes: Mapping[str, ChainNode]
    children: Mapping[str, tuple[str, ...]]

    def __len__(self) -> int:
        return len(self.nodes)

    def descendants(self, hashes: Iterable[str], include: bool = True) -> set[str]:
        """Every stored block below `hashes` (and, with `include`, those of `hashes` that are
        stored). Cycle-safe."""
        start = [h for h in hashes if h in self.nodes]
        seen: set[str] = set(start) if include else set()
        stack = list(start)
        while stack:
            for c in self.children.get(stack.pop(), ()):
                if c not in seen:
                    seen.add(c)
                    stack.append(c)
        return seen

    def unrooted(self) -> list[str]:
        """Blocks no prefix lookup can reach (their chain does not end at the root), sorted."""
        return sorted(h for h, n in self.nodes.items() if not n.rooted)

    def tops(self) -> list[str]:
        """Blocks whose parent is not stored (first blocks of chains, or broken chains), sorted."""
        return sorted(h for h, n in self.nodes.items() if n.parent not in self.nodes)

    @property
    def max_depth(self) -> int:
        """Largest depth (-1 when empty)."""
        return max((n.depth for n in self.nodes.values()), default=-1)


def build_chain_tree(
    entries: Iterable[tuple[str, str, float]], root: str, now: float | None = None
) -> ChainTree:
    """Build the chain tree of `(hash, parent, last_access)` entries.

    Args:
        entries: one per stored block; a repeated hash keeps its last entry.
        root: the namespace's root parent.
        now: access times later than this are clamped to it (clock skew, tampering); None = no clamp.

    Returns:
        The tree. O(n) time and memory, whatever the parent links (cycles included).
    """
    parent: dict[str, str] = {}
    access: dict[str, float] = {}
    for h, p, t in entries:
        parent[h] = p
        access[h] = t if now is None else min(t, now)
    kids: dict[str, list[str]] = {}
    for h, p in parent.items():
        if p in parent:
            kids.setdefault(p, []).append(h)
    children = {p: tuple(sorted(cs)) for p, cs in kids.items()}
    cycles = _find_cycles(parent)
    in_cycle = {h for cyc in cycles for h in cyc}

    # BFS from the bases (tops and cycle nodes): parents come before their children.
    depth: dict[str, int] = {}
    rooted: dict[str, bool] = {}
    order: list[str] = []
    queue: deque[str] = deque()
    for h in sorted(parent):
        if h in in_cycle or parent[h] not in parent:
            depth[h] = 0
            rooted[h] = h not in in_cycle and parent[h] == root
            order.append(h)
            queue.append(h)
    while queue:
        h = queue.popleft()
        for c in children.get(h, ()):
            if c in depth:  # a cycle node (a base already)
                continue
            depth[c] = depth[h] + 1
            rooted[c] = rooted[h] and h not in in_cycle
            order.append(c)
            queue.append(c)

    eff = dict(access)
    for h in reversed(order):  # children before parents
        p = parent[h]
        if p in eff and h not in in_cycle:
            eff[p] = max(eff[p], eff[h])
    for cyc in cycles:  # every node of a cycle sees the whole component
        newest = max(eff[h] for h in cyc)
        for h in cyc:
            eff[h] = newest

    nodes = {
        h: ChainNode(h, parent[h], access[h], depth[h], eff[h], rooted[h], h in in_cycle) for h in parent
    }
    return ChainTree(root, MappingProxyType(nodes), MappingProxyType(children))


def _find_cycles(parent: Mapping[str, str]) -> list[list[str]]:
    """The cycles of the functional graph `h -> parent[h]` (only stored parents), each once."""
    state: dict[str, int] = {}  # 1: on the current walk, 2: done
    cycles: list[list[str]] = []
    for start in parent:
        if start in state:
            continue
        path: list[str] = []
        pos: dict[str, int] = {}
        cur: str | None = start
        while cur is not None and cur not in state:
            state[cur] = 1
            pos[cur] = len(path)
            path.append(cur)
            nxt = parent[cur]
            cur = nxt if nxt in parent else None
        if cur is not None and state[cur] == 1:
            cycles.append(path[pos[cur] :])
        for h in path:
            state[h] = 2
    return cycles


__all__ = ["ChainNode", "ChainTree", "build_chain_tree"]
