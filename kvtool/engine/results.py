"""What a request through `kvtool.engine.Engine` returns: `RequestResult` (counts, times, text),
`StreamResponse` (one step of `Engine.stream`), and `KVBitsUnsupported`. MLX-free."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from kvtool.cache.hit import HitTokens
from kvtool.errors import KVToolError


class KVBitsUnsupported(KVToolError):
    """`kv_bits` asked for a model whose mlx-lm code cannot run a quantized KV cache (exit 2)."""


@dataclass
class RequestResult(HitTokens):
    """What one request did. Token counts in tokens, times in ms; where the prompt's tokens came
    from: `HitTokens`'s fields (and invariants). On a full hit the last prompt token is
    re-forwarded, so `cached_tokens = prompt_tokens - 1` and `prefill_tokens = 1`.
    `blocks_written` counts the request's new blocks (and tail entry) that reached the SSD: exact
    when the request returns with an inline (`--sync`) writer; with a background writer it is
    the count the writer accepted until `Engine.flush` / `close` sets the exact one. Blocks
    kept in RAM only (no SSD tier, a read-only cache, a full disk, evict_only) are not counted.
    `uncached_reason`: why this request did not use the cache: the model's reason (it runs
    uncached), or why a cached prefix found for this prompt was not used (KV quantisation: it
    ends where mlx-lm's cache is not quantized alike); None when the cache was used or simply
    held nothing for the prompt.
    """

    generated_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = "length"
    ttft_ms: float = 0.0
    prefill_ms: float = 0.0
    decode_tokens_per_s: float = 0.0
    ssd_load_ms: float = 0.0
    ssd_bytes_read: int = 0
    write_path_ms: float = 0.0
    blocks_written: int = 0
    writer_queue_depth: int = 0
    backpressure_events: int = 0
    uncached_reason: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class StreamResponse:
    """One step of `Engine.stream` (in the style of `mlx_lm.generate.GenerationResponse`).

    Attributes:
        text: the new text of this step (may be empty while a multi-byte character is pending).
        token: the generated token id.
        result: the request's `RequestResult` so far (complete on the last step).
        finish_reason: None until the last step, then 'length' | 'stop'.
    """

    text: str
    token: int
    result: RequestResult
    finish_reason: str | None = None


__all__ = ["KVBitsUnsupported", "RequestResult", "StreamResponse"]
