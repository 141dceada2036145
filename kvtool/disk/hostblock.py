"""`HostBlock`: a KV block in host memory (numpy), with no MLX import.

This is the form that crosses threads and goes to disk: the SSD store and writer modules import
it from here so that they never load MLX. `kvtool.kv.blocks` converts to and from MLX arrays.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class HostBlock:
    """A block in host memory (numpy), the form that crosses threads and goes to disk.

    Holds no MLX arrays, so the SSD writer thread never calls MLX.

    Attributes:
        block_hash: chain hash (hex).
        parent_hash: chain hash of the previous block, or `root_parent(layout)` for the first.
        token_ids: int32 `[block_size]`.
        keys, values: per layer, `[1, n_kv_heads, block_size, head_dim]`; dtype float32 or
            float16, or uint16 holding bfloat16 bit patterns (see `dtype`).
        dtype: logical KV dtype name ('float32' | 'float16' | 'bfloat16').
    """

    block_hash: str
    parent_hash: str
    token_ids: np.ndarray
    keys: list[np.ndarray]
    values: list[np.ndarray]
    dtype: str

    @property
    def nbytes(self) -> int:
        """Bytes of KV tensors plus token ids."""
        return int(sum(a.nbytes for a in self.keys) + sum(a.nbytes for a in self.values) + self.token_ids.nbytes)

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])
