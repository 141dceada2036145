"""`RequestRecord`: what kvtool's prompt cache did for one request of `kvtool serve` (its
`/kvtool/stats` rows, its log line, the input of the Prometheus request metrics)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass
class RequestRecord:
    """What the cache did for one request (one `fetch_nearest_cache`). Tokens in tokens, times in ms.

    `prompt_tokens == cached_tokens + prefill_tokens`,
    `cached_tokens == ram_hit_tokens + ssd_hit_tokens + remote_hit_tokens`.
    """

    request: int
    prompt_tokens: int
    cached_tokens: int = 0
    ram_hit_tokens: int = 0
    ssd_hit_tokens: int = 0
    remote_hit_tokens: int = 0
    prefill_tokens: int = 0
    ssd_load_ms: float = 0.0
    ssd_bytes_read: int = 0
    fetch_ms: float = 0.0
    uncached_reason: str | None = None
    blocks_stored: int = 0  # chain entries handed to the tiers (segment ends + the request's end)
    store_ms: float = 0.0  # generation-thread time spent storing them (slicing, RAM insert, SSD hand-over)
    prefill_ms: float = 0.0  # generation-thread time of kvtool's own prefill (windowed / state-layer models)
    generated_tokens: int | None = None  # known once the request finished
    finished: bool = False

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def log_line(self) -> str:
        line = (
            f"request {self.request}: prompt {self.prompt_tokens} tok | cached {self.cached_tokens} "
            f"(RAM {self.ram_hit_tokens}, SSD {self.ssd_hit_tokens}) | prefilled {self.prefill_tokens}"
        )
        if self.remote_hit_tokens:
            line += f" | remote {self.remote_hit_tokens} tok"
        if self.ssd_hit_tokens:
            line += f" | SSD load {self.ssd_load_ms:.1f} ms, {self.ssd_bytes_read} B"
        if self.uncached_reason:
            line += f" | uncached: {self.uncached_reason}"
        return line


__all__ = ["RequestRecord"]
