"""The parent-chain tree of a namespace's blocks: `kvtool.store.chains` (moved there so that the
SSD store's byte budget, `kvtool.store.ssd_budget`, plans with it too; this name is kept for
callers that import it from here).

This module never imports MLX.
"""

from __future__ import annotations

from kvtool.store.chains import ChainNode, ChainTree, Forest, build_chain_tree, build_forest

__all__ = ["ChainNode", "ChainTree", "Forest", "build_chain_tree", "build_forest"]
