"""`KVLayout`: the per-layer shapes and dtypes of a namespace's KV, and so of every block record
(plain K/V, quantized packed words + scales + biases, state-layer checkpoints). MLX-free.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# logical dtype name -> numpy storage dtype (bfloat16 travels as its uint16 bit pattern)
STORAGE_DTYPES: dict[str, np.dtype] = {
    "float32": np.dtype("<f4"),
    "float16": np.dtype("<f2"),
    "bfloat16": np.dtype("<u2"),
}
QUANT_BITS = (2, 3, 4, 5, 6, 8)  # bit widths `mx.quantize` packs into uint32 words
_PACKED_DTYPE = np.dtype("<u4")


@dataclass(frozen=True)
class KVLayout:
    """Per-layer KV shapes and dtype of a namespace (MLX-free).

    Plain (mlx-lm `KVCache`): per layer a keys `[1, H, n, Dk]` and a values `[1, H, n, Dv]`
    tensor in `dtype`. Quantized (`bits` > 0, mlx-lm `QuantizedKVCache`, `mx.quantize` along the
    head dim in groups of `group_size`): per layer the keys' packed words `[1, H, n, Dk*bits/32]`
    (uint32), scales and biases `[1, H, n, Dk/group_size]` (in `dtype`), then the same three
    for the values.

    State layers (hybrid and SSM models, mlx-lm `ArraysCache`) and per-layer cache lists
    (mlx-lm `CacheList`): `kinds` names every model cache entry, `k` for a KV layer (in
    `layers`), the number of state arrays of a state layer, or a parenthesised group for a
    `CacheList` (`"1k1k"`: conv, attention, conv, attention; `"(2k)(2k)"`: two layers of
    [state of 2 arrays, attention]). A record then ends with the state arrays of every state
    layer (`states`: their shapes, in cache order; dtype `state_dtypes[i]` or `dtype`), the
    recurrent state after the record's last token (a tail entry: before it, see `kvtool.cache.prefix`).

    Attributes:
        layers: per KV layer `(n_kv_heads, k_head_dim, v_head_dim)`; layers may differ (MLA,
            models with per-layer head counts).
        dtype: 'float32' | 'float16' | 'bfloat16' (of the KV, or of the scales and biases).
        bits: 0 (plain KV) or the quantisation width (`QUANT_BITS`).
        group_size: quantisation group (elements of the head dim per scale/bias); 0 if plain.
        kinds: "" (every layer a KV layer) or per model cache entry `k` / state-array count /
            `(`...`)` for a `CacheList` (see above).
        states: shapes of the state arrays of the state layers, in layer order.
        state_dtypes: per state array its dtype name where it differs from `dtype` (SSM states
            are often float32 in a bfloat16 model); () when every state is in `dtype`.
    """

    layers: tuple[tuple[int, int, int], ...]
    dtype: str
    bits: int = 0
    group_size: int = 0
    kinds: str = ""
    states: tuple[tuple[int, ...], ...] = ()
    state_dtypes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.dtype not in STORAGE_DTYPES:
            raise ValueError(f"unsupported KV dtype {self.dtype!r}")
        if (not self.layers and not self.states) or any(len(s) != 3 or min(s) <= 0 for s in self.layers):
            raise ValueError(f"bad layer shapes {self.layers!r}")
        if self.kinds or self.states:
            n_k = self.kinds.count("k")
            counts = [int(c) for c in self.kinds if c.isdigit()]
            if (not _kinds_ok(self.kinds) or n_k != len(self.layers) or sum(counts) != len(self.states)
                    or 0 in counts or any(not s or min(s) <= 0 for s in self.states)):
                raise ValueError(f"bad state layers kinds={self.kinds!r} states={self.states!r}")
            if self.bits:
                raise ValueError("quantized KV with state layers or cache lists is not supported")
        if self.state_dtypes and (len(self.state_dtypes) != len(self.states)
                                  or any(d not in STORAGE_DTYPES for d in self.state_dtypes)):
            raise ValueError(f"bad state dtypes {self.state_dtypes!r}")
        if self.bits or self.group_size:
            if self.bits not in QUANT_BITS or self.group_size <= 0:
                raise ValueError(f"bad quantisation bits={self.bits} group_size={self.group_size}")
            for _, dk, dv in self.layers:
                for d in (dk, dv):
                    if d % self.group_size or (d * self.bits) % 32:
                        raise ValueError(f"head dim {d} does not quantise with bits={self.bits} "
                                         f"group_size={self.group_size}")

    @classmethod
    def uniform(cls, n_layers: int, n_kv_heads: int, head_dim: int, dtype: str, bits: int = 0,
                group_size: int = 0) -> KVLayout:
        """Every layer `[1, n_kv_heads, T, head_dim]` for keys and values."""
        return cls(tuple((n_kv_heads, head_dim, head_dim) for _ in range(n_layers)), dtype, bits, group_size)

    @classmethod
    def parse(cls, text: str, dtype: str) -> KVLayout:
        """Inverse of `layout.spec`: `"HxDkxDv,HxDkxDv,..."`, quantized `"q8g64:HxDkxDv,..."`.

        Raises:
            ValueError: malformed text.
        """
        text, *extras = text.split("|")
        kinds, states, sdt = "", tuple[tuple[int, ...], ...](), list[str]()
        for part in extras:
            key, sep, val = part.partition("=")
            if key == "kinds" and sep:
                kinds = val
            elif key == "states" and sep:
                shapes = []
                for item in val.split(",") if val else []:
                    shape, at, name = item.partition("@")
                    shapes.append(tuple(int(x) for x in shape.split("x")))
                    sdt.append(name if at else dtype)
                states = tuple(shapes)
            else:
                raise ValueError(f"malformed layout part {part!r}")
        state_dtypes = tuple(sdt) if any(d != dtype for d in sdt) else ()
        bits = group = 0
        if text.startswith("q"):
            quant, sep, text = text.partition(":")
            b, g_sep, g = quant[1:].partition("g")
            if not sep or not g_sep or not b.isdigit() or not g.isdigit():
                raise ValueError(f"malformed quantisation prefix {quant!r}")
            bits, group = int(b), int(g)
        layers = tuple(tuple(int(x) for x in part.split("x")) for part in text.split(",")) if text else ()
        return cls(layers, dtype, bits, group, kinds, states, state_dtypes)  # type: ignore[arg-type]  # 3 ints per layer: __post_init__ checks it

    @property
    def spec(self) -> str:
        """Compact text form, e.g. `"2x64x64,2x64x64"`, quantized `"q8g64:2x64x64,..."` (part of
        the layout key and of every segment header)."""
        plain = ",".join("x".join(str(x) for x in s) for s in self.layers)
        if self.kinds:
            plain += f"|kinds={self.kinds}|states=" + ",".join(
                "x".join(str(x) for x in s) + (f"@{d}" if d != self.dtype else "")
                for s, d in zip(self.states, self.state_dtype_names()))
        return f"q{self.bits}g{self.group_size}:{plain}" if self.bits else plain

    @property
    def quantized(self) -> bool:
        return self.bits > 0

    @property
    def n_layers(self) -> int:
        """KV layers (state layers excluded)."""
        return len(self.layers)

    @property
    def has_states(self) -> bool:
        return bool(self.states)

    def state_dtype_names(self) -> tuple[str, ...]:
        """Per state array its dtype name."""
        return self.state_dtypes or (self.dtype,) * len(self.states)

    def state_nbytes(self) -> int:
        """Bytes of the state arrays every record ends with."""
        return sum(int(np.prod(s)) * STORAGE_DTYPES[d].itemsize
                   for s, d in zip(self.states, self.state_dtype_names()))

    @property
    def itemsize(self) -> int:
        """Bytes per element of `dtype` (of the KV, or of the scales and biases)."""
        return STORAGE_DTYPES[self.dtype].itemsize

    @property
    def tensors_per_layer(self) -> int:
        """Record tensors per layer: 2 (keys, values) or 6 (packed, scales, biases of each)."""
        return 6 if self.bits else 2

    def _dim_shapes(self, d: int) -> list[int]:
        if not self.bits:
            return [d]
        return [d * self.bits // 32, d // self.group_size, d // self.group_size]

    def token_nbytes(self) -> int:
        """KV bytes per token over all layers (keys + values; packed words, scales and biases)."""
        return self._sizes[0]

    @functools.cached_property
    def _sizes(self) -> tuple[int, int]:
        """(KV bytes per token, state bytes per record), computed once (the restore hot path)."""
        n_kv = len(self.shapes(1)) - len(self.states)
        per_token = sum(shape[1] * shape[3] * st.itemsize
                        for shape, st in zip(self.shapes(1)[:n_kv], self.storage_dtypes()[:n_kv]))
        return per_token, self.state_nbytes()

    def record_nbytes(self, n_tokens: int) -> int:
        """Bytes of one record of `n_tokens` tokens (token ids and state arrays included)."""
        per_token, states = self._sizes
        return n_tokens * (4 + per_token) + states

    def shapes(self, n_tokens: int) -> list[tuple[int, ...]]:
        """Shapes of the record's KV tensors in record order: plain K0, V0, K1, V1, ...;
        quantized K0 packed, K0 scales, K0 biases, V0 packed, V0 scales, V0 biases, K1 ..."""
        return list(self._shapes(n_tokens))

    @functools.lru_cache(maxsize=64)  # noqa: B019  (KVLayout is frozen and hashable; few lengths)
    def _shapes(self, n_tokens: int) -> tuple[tuple[int, ...], ...]:
        out: list[tuple[int, ...]] = []
        for h, dk, dv in self.layers:
            out += [(1, h, n_tokens, x) for x in self._dim_shapes(dk)]
            out += [(1, h, n_tokens, x) for x in self._dim_shapes(dv)]
        return tuple(out + list(self.states))

    def storage_dtypes(self) -> list[np.dtype]:
        """numpy storage dtype of each record tensor, in record order (as `shapes`)."""
        st = STORAGE_DTYPES[self.dtype]
        per_layer = [st, st] if not self.bits else [_PACKED_DTYPE, st, st] * 2
        return per_layer * self.n_layers + [STORAGE_DTYPES[d] for d in self.state_dtype_names()]

    def interleave(self, keys: Sequence, values: Sequence) -> list:
        """Record order of a block's tensors: `keys`/`values` hold 1 (plain) or 3 (quantized:
        packed, scales, biases) tensors per KV layer, layer after layer; `values` then ends with
        the state arrays (state layers)."""
        k = self.tensors_per_layer // 2
        out: list = []
        for layer in range(self.n_layers):
            out += list(keys[layer * k : (layer + 1) * k]) + list(values[layer * k : (layer + 1) * k])
        return out + list(values[self.n_layers * k :])

    def split(self, tensors: Sequence) -> tuple[list, list]:
        """Inverse of `interleave`: record-order tensors -> (keys, values)."""
        k = self.tensors_per_layer // 2
        keys: list = []
        values: list = []
        for layer in range(self.n_layers):
            base = layer * 2 * k
            keys += list(tensors[base : base + k])
            values += list(tensors[base + k : base + 2 * k])
        return keys, values + list(tensors[self.n_layers * 2 * k :])


def _kinds_ok(kinds: str) -> bool:
    """`kinds` is a sequence of `k`, digits and balanced, non-empty parenthesised groups."""
    depth = 0
    prev = ""
    for c in kinds:
        if c == "(":
            depth += 1
        elif c == ")":
            if depth == 0 or prev == "(":
                return False
            depth -= 1
        elif c != "k" and not c.isdigit():
            return False
        prev = c
    return depth == 0
