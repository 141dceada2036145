"""What `warm` and `import` share about writing blocks to the SSD tier.

Imports nothing heavy (no MLX): the engine is only an annotation.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from kvtool.engine import Engine  # (MLX: for annotations only)


def ssd_write_problem(engine: Engine, command: str) -> str | None:
    """Why `engine` (a `kvtool.engine.Engine`) cannot write blocks to SSD for `command` ("warm",
    "import"), as one line; None if it can."""
    if engine.uncached_reason is not None:
        return f"this model cannot be cached: {engine.uncached_reason}"
    ssd = engine.cache.ssd
    if ssd is None:
        return f"the SSD tier is off (ssd_enabled = false): {command} writes blocks to SSD only"
    if not ssd.enabled or ssd.read_only:
        return f"the SSD tier is unavailable: {ssd.disabled_reason}"
    return None


class WriteCounts(NamedTuple):
    """What the SSD writer did between two stats snapshots, in blocks (bytes where named).

    Attributes:
        written: blocks written to SSD (`ssd_save_success`).
        nbytes: bytes of the segment files written (`ssd_bytes_written`).
        dedup: blocks already stored (`ssd_save_dedup_skip`).
        failed: final write failures, after retries (`writer_save_fail`), plus blocks the writer
            rejected (`writer_enqueue_rejected`: stopped, or the store disabled).
        over_budget: blocks the SSD byte budget had no room for even after eviction
            (`writer_budget_refused`): the budget at work, not a failure.
    """

    written: int
    nbytes: int
    dedup: int
    failed: int
    over_budget: int

    def set_on(self, report: Any) -> None:
        """Set these counts on a `WarmReport` or `ImportReport`, under their JSON names
        (`blocks_written`, `bytes_written`, `blocks_dedup`, `blocks_failed`, `blocks_over_budget`)."""
        report.blocks_written, report.bytes_written, report.blocks_dedup = self.written, self.nbytes, self.dedup
        report.blocks_failed, report.blocks_over_budget = self.failed, self.over_budget


def stats_delta(base: Mapping, now: Mapping, *keys: str) -> list[int]:
    """`now[key] - base[key]` for each of `keys` (a missing key counts 0)."""
    return [int(now.get(key, 0)) - int(base.get(key, 0)) for key in keys]


def write_counts(base: Mapping, now: Mapping) -> WriteCounts:
    """What the SSD writer did between two stats snapshots (`Engine.stats()` or
    `PrefixCache.stats().to_dict()`)."""
    written, nbytes, dedup, failed, rejected, over_budget = stats_delta(
        base, now, "ssd_save_success", "ssd_bytes_written", "ssd_save_dedup_skip", "writer_save_fail",
        "writer_enqueue_rejected", "writer_budget_refused")
    return WriteCounts(written, nbytes, dedup, failed + rejected, over_budget)


__all__ = ["WriteCounts", "ssd_write_problem", "stats_delta", "write_counts"]
