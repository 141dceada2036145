"""Chain hashes and layout keys (MLX-free: `validate`, `prune` and `inspect` import this).

Block identity is a *chain hash* (as in vLLM's prefix caching; docs/design.md#chain-hash): the digest of
the parent block's digest followed by the block's token ids as little-endian int32. The first
block's parent is a digest of the *layout key*, so two models (or dtypes, block sizes, format
versions, library versions) never share a hash. blake2b-128 is used, never Python's `hash()`,
so hashes are identical across processes and machines; hashing a prompt is O(n).

A prompt's *tail entry* (its trailing partial block of r < block_size tokens) is keyed the same
way: `hash_fn(parent, tail_ids)`; the different input length keeps it apart from full blocks.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence

import numpy as np

HASH_DIGEST_BYTES = 16  # blake2b-128, hex-encoded to 32 characters
LAYOUT_VERSION = 2  # bump when the meaning of a layout key's fields changes

HashFn = Callable[[bytes, np.ndarray], str]


def layout_key(
    model_id: str,
    kv_spec: str,
    kv_dtype: str,
    block_size: int,
    *,
    format_version: int,
    model_class: str = "",
    versions: str = "",
    extra: str = "",
) -> str:
    """Digest of everything that makes stored KV interchangeable; also the namespace name.

    Args:
        model_id: digest of the model's weights/config (and adapter), see `kvtool.models`.
        kv_spec: per-layer KV shapes, `KVLayout.spec` (e.g. "2x64x64,2x64x64").
        kv_dtype: 'float32' | 'float16' | 'bfloat16'.
        block_size: tokens per block.
        format_version: the on-disk segment format version.
        model_class: the model's Python class (its code computes the KV).
        versions: library versions that compute the KV, e.g. "mlx=0.32.4,mlx_lm=0.32.2"; an
            upgrade starts a new namespace (old ones age out through `kvtool prune`).
        extra: anything else that changes the KV (cache type options, quantisation).

    Returns:
        32 hex characters (blake2b-128).
    """
    text = (
        f"kvtool-layout|v={LAYOUT_VERSION}|fmt={format_version}|model={model_id}|class={model_class}"
        f"|kv={kv_spec}|dtype={kv_dtype}|block={block_size}|lib={versions}|extra={extra}"
    )
    return hashlib.blake2b(text.encode(), digest_size=HASH_DIGEST_BYTES).hexdigest()


def root_parent(layout: str) -> str:
    """The parent digest of a prompt's first block: a digest of the layout key (hex)."""
    return hashlib.blake2b(b"kvtool-root|" + layout.encode(), digest_size=HASH_DIGEST_BYTES).hexdigest()


def blake2b_chain(parent: bytes, token_ids: np.ndarray) -> str:
    """Default chain hash: blake2b-128(parent digest || token ids as little-endian int32) -> hex."""
    h = hashlib.blake2b(parent, digest_size=HASH_DIGEST_BYTES)
    h.update(np.ascontiguousarray(token_ids, dtype="<i4").tobytes())
    return h.hexdigest()


def blake2b_chain_prefixes(parent: bytes, token_ids: np.ndarray) -> list[str]:
    """`[blake2b_chain(parent, token_ids[:k]) for k in 1..len(token_ids)]` in one pass: each
    hash extends the previous one's state by one token (`hashlib` state copies), O(len) instead
    of O(len^2) bytes hashed, and one Python step per token instead of a whole hash call.

    Args:
        parent: the parent digest (bytes).
        token_ids: int token ids `[k]`.

    Returns:
        `len(token_ids)` hex digests, shortest prefix first.
    """
    data = np.ascontiguousarray(token_ids, dtype="<i4").tobytes()
    h = hashlib.blake2b(parent, digest_size=HASH_DIGEST_BYTES)
    out = []
    for i in range(0, len(data), 4):
        h.update(data[i : i + 4])
        out.append(h.copy().hexdigest())
    return out


def chain_hashes(
    token_ids: Sequence[int] | np.ndarray,
    block_size: int,
    layout: str,
    hash_fn: HashFn = blake2b_chain,
) -> list[str]:
    """Chain hashes of every *full* block of a prompt, O(len(token_ids)).

    Args:
        token_ids: prompt token ids (int).
        block_size: tokens per block.
        layout: the layout key (the namespace's name); seeds the first parent.
        hash_fn: injectable hash for tests (e.g. to force collisions).

    Returns:
        `len(token_ids) // block_size` hex digests; element i covers tokens
        `[i*block_size, (i+1)*block_size)`.
    """
    ids = np.asarray(token_ids, dtype=np.int32)
    parent = root_parent(layout)
    out: list[str] = []
    if hash_fn is blake2b_chain:  # the same digests, from one byte string: ~2x fewer Python steps per block
        data, step = np.ascontiguousarray(ids, dtype="<i4").tobytes(), 4 * block_size
        digest = bytes.fromhex(parent)
        for i in range(len(ids) // block_size):
            digest = hashlib.blake2b(digest + data[i * step : (i + 1) * step], digest_size=HASH_DIGEST_BYTES).digest()
            out.append(digest.hex())
        return out
    for i in range(len(ids) // block_size):
        parent = hash_fn(bytes.fromhex(parent), ids[i * block_size : (i + 1) * block_size])
        out.append(parent)
    return out


def tail_hash(
    token_ids: Sequence[int] | np.ndarray,
    block_size: int,
    layout: str,
    full_hashes: Sequence[str],
    hash_fn: HashFn = blake2b_chain,
) -> str | None:
    """Key of a prompt's tail entry (its last `len % block_size` tokens), or None if it has none.

    Args:
        token_ids: prompt token ids.
        block_size: tokens per block.
        layout: the layout key.
        full_hashes: `chain_hashes(token_ids, ...)` (the tail's parent is the last of them).
        hash_fn: the chain hash function.
    """
    ids = np.asarray(token_ids, dtype=np.int32)
    start = len(full_hashes) * block_size
    if start >= len(ids):
        return None
    parent = full_hashes[-1] if full_hashes else root_parent(layout)
    return hash_fn(bytes.fromhex(parent), ids[start:])


def key_extra_of_meta(meta: Mapping[str, str]) -> str:
    """The `extra` part of a layout key, from namespace meta: KV quantisation, sliding windows and
    the record codec (`kv_codec`, absent for plain records)."""
    parts = []
    if meta.get("kv_quantization"):
        parts.append(meta["kv_quantization"])
    if meta.get("kv_windows"):
        parts.append("windows=" + meta["kv_windows"])
    if meta.get("kv_codec") and meta["kv_codec"] != "none":
        parts.append("codec=" + meta["kv_codec"])
    return ";".join(parts)


def layout_key_of_meta(meta: Mapping[str, str], format_version: int | None = None) -> str:
    """The layout key a namespace meta stands for: the one recipe shared by `PrefixCache` (which
    writes the meta) and `kvtool.ops.scan` (which checks a directory against its meta).

    Args:
        meta: string values for model_id, kv_layers, kv_dtype, block_size, and optionally
            model_class, libraries, kv_quantization, kv_windows, kv_codec, format_version.
        format_version: overrides `meta["format_version"]`.

    Raises:
        KeyError, ValueError: a required key is missing or not a number.
    """
    fmt = int(meta["format_version"]) if format_version is None else format_version
    return layout_key(
        meta["model_id"], meta["kv_layers"], meta["kv_dtype"], int(meta["block_size"]), format_version=fmt,
        model_class=meta.get("model_class", ""), versions=meta.get("libraries", ""), extra=key_extra_of_meta(meta),
    )
