"""Capacity planning on a request trace (`kvtool bench-plan`): a trace's block sequence replayed
through kvtool's own tier stack and eviction, without a model, at each RAM / SSD budget and write
policy asked for (docs/benchmarks.md#capacity-planning-on-the-mooncake-traces).

What runs is kvtool's code, fed stand-ins:
- the stack is a real `TierStack` (`kvtool.tiers.stack`): its walk (`collect`), write policies
  (`insert`, write-back of what RAM evicts, `touch` of RAM hits on the SSD), promotion and pins;
- RAM is the real `RamTier` (LRU, byte budget, pins) holding stand-in `Block`s: no arrays, one
  stand-in token (the block's id) each, `nbytes` = the block's tokens x the KV bytes per token;
- the SSD tier is `PlanSsdTier`, an in-memory stand-in whose eviction decision is the SSD byte
  budget's own (`kvtool.disk.budget.SSDBudget`: when a segment does not fit, `fit_budget` of
  `kvtool.disk.planner` frees least recently used segments down to `EVICT_SLACK` below the budget,
  never one used in the last `DEFAULT_PROTECT_S` seconds, descendants with their ancestors).
  A segment is one write batch of at most `WRITE_BATCH_BYTES` (as `SsdBlockTier` cuts them).
  Why not the real SSD tier: its budget counts the bytes of real segment files, and the stand-in
  payloads would have to be written at their real size (the conversation trace's 182,790 distinct
  blocks are 11 TiB at 8B-class KV sizes): what is replaced is only the file system.
Time is the trace's (`timestamp`), writes are synchronous (`ssd_async_writes = false`: nothing
waits in a writer's queue), and a request is one fetch, one store, one release in that order, as
`PrefixCache` serves it. Not modelled: tail-entry and partial-block hits (a trace has no tokens),
the re-forward of a full hit's last token, and the index's and headers' bytes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvtool.bench.trace import TraceError, TraceRequest
from kvtool.config import KVToolConfig
from kvtool.disk.budget import DEFAULT_PROTECT_S, EVICT_SLACK
from kvtool.disk.chains import build_forest
from kvtool.disk.planner import SegmentPlanner, fit_budget
from kvtool.kv.blocks import Block
from kvtool.models.limits import kv_bytes_per_token as model_kv_bytes_per_token
from kvtool.tiers.base import Caps, ChainEntry, Put, ReadResult, TierBase, WritePolicy
from kvtool.tiers.ssd import WRITE_BATCH_BYTES
from kvtool.tiers.stack import TierStack
from kvtool.units import MAX_BYTES

ROOT = "root"  # the parent of a trace's first blocks
# KV bytes per token of common shapes: layers x KV heads x head dim x 2 (K, V) x 2 bytes (bf16)
KV_SHAPES = {
    "8b": 32 * 8 * 128 * 2 * 2,  # Llama-3.1-8B: 131072
    "32b": 64 * 8 * 128 * 2 * 2,  # Qwen2.5-32B: 262144
    "70b": 80 * 8 * 128 * 2 * 2,  # Llama-3.1-70B: 327680
}
POLICIES = {"write_through": WritePolicy.THROUGH, "evict_only": WritePolicy.ON_EVICT}


def kv_bytes_per_token(spec: str) -> int:
    """KV bytes per token from a number, a name of `KV_SHAPES` (`8b`, `32b`, `70b`), or a model
    directory's config.json (layers x KV heads x head dim x 2 x bytes of its dtype).

    Raises:
        TraceError: none of these, or a config.json without the fields.
    """
    text = spec.strip().lower()
    if text.isdigit() and int(text) > 0:
        return int(text)
    if text in KV_SHAPES:
        return KV_SHAPES[text]
    path = Path(spec) / "config.json"
    if not path.is_file():
        raise TraceError(f"--kv-bytes-per-token {spec!r}: not a positive number, a shape ({', '.join(KV_SHAPES)}) "
                         "or a model directory with a config.json")  # fmt: skip
    try:
        return model_kv_bytes_per_token(Path(spec))
    except (OSError, ValueError) as exc:
        raise TraceError(f"{path}: cannot compute the KV bytes per token ({exc})") from None


class PlanSsdTier(TierBase):
    """The SSD tier as the stack sees it (backs RAM, persistent), holding block sizes only; its
    byte budget decides as `SSDBudget` does (see the module docstring).

    Args:
        max_bytes: the budget (bytes); None: unbounded.
        policy: `WritePolicy.THROUGH` (write_through) or `ON_EVICT` (evict_only).

    Attributes:
        now: the clock (seconds): the trace time of the request being replayed.
        used: bytes of the segments held; written: bytes `put` accepted;
        refused: blocks not stored (their segment could not fit); evicted: blocks evicted.
    """

    name = "ssd"
    caps = Caps(persistent=True, backs_ram=True, finds_tails=False, lists_siblings=False)
    takes_promotions = False

    def __init__(self, max_bytes: int | None, policy: WritePolicy):
        self.max_bytes, self.policy = max_bytes, policy
        self.now = 0.0
        self.used = self.written = self.refused = self.evicted = 0
        # hashes are numbered once (`_number`); held blocks live in slots of parallel arrays, so an
        # eviction builds the planner's columns with numpy, not per block in Python
        self._number: dict[str, int] = {ROOT: 0}
        self._names: list[str] = [ROOT]
        self._slot_of = np.full(1024, -1, dtype=np.int64)  # hash number -> slot (-1: not held)
        self._bid = np.zeros(1024, dtype=np.int64)  # slot -> hash number, parent's hash number, segment
        self._pid = np.zeros(1024, dtype=np.int64)
        self._seg = np.zeros(1024, dtype=np.int64)
        self._access = np.zeros(1024, dtype=np.float64)
        self._alive = np.zeros(1024, dtype=bool)
        self._free: list[int] = []
        self._slots = 0  # slots ever used
        self._seg_bytes = np.zeros(1024, dtype=np.int64)  # segment number -> bytes (0: gone)
        self._next_segment = 0

    def _held(self, block_hash: str) -> int:
        """The slot of a held block, or -1."""
        n = self._number.get(block_hash)
        return -1 if n is None else int(self._slot_of[n])

    def __contains__(self, block_hash: str) -> bool:
        return self._held(block_hash) >= 0

    def longest_prefix(self, chain: Sequence[ChainEntry], ids: np.ndarray) -> list[Any]:
        out = []
        for e in chain:
            slot = self._held(e.hash)
            if slot < 0:
                break
            self._access[slot] = self.now
            out.append(e.hash)
        return out

    def read_into(self, chain, handles, ids, buffers) -> ReadResult:
        """Nothing to place (the plan fills no buffers): every handle counts as read."""
        return ReadResult(len(handles))

    def touch(self, hashes: list[str]) -> None:
        for h in hashes:
            slot = self._held(h)
            if slot >= 0:
                self._access[slot] = self.now

    def put(self, blocks: Sequence[Block], why: Put) -> int:
        fresh = [b for b in blocks if self._held(b.block_hash) < 0]  # the store's dedup
        batch: list[Block] = []
        accepted = size = 0
        for b in fresh:
            if batch and size + b.nbytes > WRITE_BATCH_BYTES:
                accepted += self._save(batch, size)
                batch, size = [], 0
            batch.append(b)
            size += b.nbytes
        if batch:
            accepted += self._save(batch, size)
        return accepted

    def _save(self, batch: list[Block], size: int) -> int:
        """One segment: reserve its bytes (evicting if needed), then hold its blocks."""
        if self.max_bytes is not None and self.used + size > self.max_bytes:
            self._evict(size)
            if self.used + size > self.max_bytes:
                self.refused += len(batch)
                return 0
        seg = self._next_segment
        self._next_segment += 1
        self._seg_bytes = _fit(self._seg_bytes, seg + 1, 0)
        self._seg_bytes[seg] = size
        for b in batch:
            slot = self._take_slot()
            bid, pid = self._num(b.block_hash), self._num(b.parent_hash)
            self._bid[slot], self._pid[slot], self._seg[slot], self._access[slot] = bid, pid, seg, self.now
            self._alive[slot] = True
            self._slot_of[bid] = slot
        self.used += size
        self.written += size
        return len(batch)

    def _num(self, h: str) -> int:
        n = self._number.get(h)
        if n is None:
            n = self._number[h] = len(self._names)
            self._names.append(h)
            self._slot_of = _fit(self._slot_of, n + 1, -1)
        return n

    def _take_slot(self) -> int:
        if self._free:
            return self._free.pop()
        slot, self._slots = self._slots, self._slots + 1
        self._bid, self._pid, self._seg = (_fit(a, slot + 1, 0) for a in (self._bid, self._pid, self._seg))
        self._access, self._alive = _fit(self._access, slot + 1, 0), _fit(self._alive, slot + 1, False)
        return slot

    def _evict(self, need: int) -> None:
        """`SSDBudget._evict` on the held blocks: the planner frees least recently used segments
        until `used + need` is `EVICT_SLACK` below the budget, protected ones excepted."""
        assert self.max_bytes is not None
        live = np.flatnonzero(self._alive[: self._slots])
        row = np.full(self._slots, -1, dtype=np.int64)
        row[live] = np.arange(live.size)
        parent_slot = self._slot_of[self._pid[live]]
        parent = np.where(parent_slot >= 0, row[np.maximum(parent_slot, 0)], -1)
        segs, block_seg = np.unique(self._seg[live], return_inverse=True)
        forest = build_forest(parent, self._pid[live] == 0, self._access[live], self.now)
        planner = SegmentPlanner.from_forest([f"{s:012d}" for s in segs.tolist()], self._seg_bytes[segs], block_seg,
                                             forest, lambda ids: [self._names[i] for i in self._bid[live[ids]]])  # fmt: skip
        target = int(self.max_bytes * (1 - EVICT_SLACK)) - need
        fit_budget({"ns": planner}, max(target, 0), protect_after=self.now - DEFAULT_PROTECT_S)
        gone = live[planner.removed_block_ids()]
        self._alive[gone] = False
        self._slot_of[self._bid[gone]] = -1
        self._free += gone.tolist()
        self.evicted += int(gone.size)
        dropped = segs[planner.removed_segment_ids()]
        self.used -= int(self._seg_bytes[dropped].sum())
        self._seg_bytes[dropped] = 0

    def resident(self) -> set[str]:
        """Hashes of the blocks held."""
        return {self._names[i] for i in self._bid[: self._slots][self._alive[: self._slots]].tolist()}


def _fit(a: np.ndarray, n: int, fill: Any) -> np.ndarray:
    """`a`, or `a` grown (doubling, new cells `fill`) to hold at least `n` cells."""
    if n <= a.size:
        return a
    out = np.full(max(n, 2 * a.size), fill, dtype=a.dtype)
    out[: a.size] = a
    return out


@dataclass
class PlanPoint:
    """One capacity point's result (tokens and bytes over the whole trace).

    Attributes:
        trace: its name; policy: the SSD write policy; ram_bytes, ssd_bytes: budgets (bytes;
            ssd_bytes 0: no SSD tier).
        requests, prompt_tokens: what the trace asked.
        ram_hit_tokens, ssd_hit_tokens: prompt tokens served from each tier (prefill saved).
        max_hit_tokens: what an unbounded cache serves (the theoretical maximum).
        hit_rate, ram_hit_rate, ssd_hit_rate: hit tokens / prompt tokens; max_hit_rate likewise;
        share_of_max: hit tokens / max_hit_tokens.
        full_prefix_requests: requests whose whole reachable prefix (the blocks seen before) hit,
            of `reachable_requests` that had one.
        ram_written_bytes, ssd_written_bytes, ram_read_bytes, ssd_read_bytes: bytes per tier.
        ssd_evicted_blocks, ssd_refused_blocks: the SSD budget's evictions and refusals.
        wall_s: seconds this point took.
    """

    trace: str
    policy: str
    ram_bytes: int
    ssd_bytes: int
    requests: int = 0
    prompt_tokens: int = 0
    ram_hit_tokens: int = 0
    ssd_hit_tokens: int = 0
    max_hit_tokens: int = 0
    hit_rate: float = 0.0
    ram_hit_rate: float = 0.0
    ssd_hit_rate: float = 0.0
    max_hit_rate: float = 0.0
    share_of_max: float = 0.0
    full_prefix_requests: int = 0
    reachable_requests: int = 0
    ram_written_bytes: int = 0
    ssd_written_bytes: int = 0
    ram_read_bytes: int = 0
    ssd_read_bytes: int = 0
    ssd_evicted_blocks: int = 0
    ssd_refused_blocks: int = 0
    wall_s: float = 0.0

    def finish(self) -> None:
        """Fill the rates from the counts."""
        n = max(self.prompt_tokens, 1)
        hits = self.ram_hit_tokens + self.ssd_hit_tokens
        self.hit_rate, self.ram_hit_rate, self.ssd_hit_rate = hits / n, self.ram_hit_tokens / n, self.ssd_hit_tokens / n
        self.max_hit_rate = self.max_hit_tokens / n
        self.share_of_max = hits / self.max_hit_tokens if self.max_hit_tokens else 1.0

    def record(self) -> dict[str, Any]:
        """The point as a plain dict (JSON, CSV rows)."""
        return asdict(self)


def reachable_blocks(requests: Sequence[TraceRequest]) -> list[int]:
    """Per request, how many leading blocks an unbounded cache holds when it arrives (the ids
    seen in earlier requests)."""
    seen: set[int] = set()
    out = []
    for r in requests:
        n = 0
        while n < len(r.hash_ids) and r.hash_ids[n] in seen:
            n += 1
        out.append(n)
        seen.update(r.hash_ids)
    return out


def _stack(ram_bytes: int, ssd: PlanSsdTier | None) -> TierStack:
    config = KVToolConfig(ssd_enabled=False, ram_bytes=min(ram_bytes, MAX_BYTES))
    return TierStack(config, "plan", {}, lower=[ssd] if ssd is not None else [])


def _chain(r: TraceRequest) -> list[ChainEntry]:
    parents = [ROOT, *(str(h) for h in r.hash_ids[:-1])]
    return [ChainEntry(str(h), p, i, i + 1) for i, (h, p) in enumerate(zip(r.hash_ids, parents))]


def _block(e: ChainEntry, tokens: int, kv_bytes: int) -> Block:
    """A stand-in block: one stand-in token (its id), no arrays, the KV bytes of its tokens."""
    return Block(e.hash, e.parent, np.array([int(e.hash)], dtype=np.int64), [], [], nbytes=tokens * kv_bytes)


def replay(requests: Sequence[TraceRequest], point: PlanPoint, kv_bytes: int,
           on_request: Callable[[], None] | None = None) -> TierStack:  # fmt: skip
    """Replay `requests` through a `TierStack` at `point`'s budgets and policy; its counts are
    filled in place (`PlanPoint.finish` included).

    Args:
        requests: the trace.
        point: the budgets (`ram_bytes`, `ssd_bytes`: 0 no SSD tier, `MAX_BYTES` unbounded) and
            `policy` (a key of `POLICIES`).
        kv_bytes: KV bytes per token.
        on_request: called after each request (progress).

    Returns:
        The stack as the trace left it (`stack.ram`, `stack.backing`: what is resident).
    """
    t0 = time.monotonic()
    ssd = PlanSsdTier(None if point.ssd_bytes >= MAX_BYTES else point.ssd_bytes, POLICIES[point.policy]) if point.ssd_bytes else None
    stack = _stack(point.ram_bytes, ssd)
    reach = reachable_blocks(requests)
    for r, n_reach in zip(requests, reach):
        if ssd is not None:
            ssd.now = max(ssd.now, r.timestamp_ms / 1000)
        chain = _chain(r)
        ids = np.array(r.hash_ids, dtype=np.int64)
        found = stack.collect(chain, ids)
        hits = {"ram": 0, "ssd": 0}
        promote, sources = [], []
        for i, (tier, _) in enumerate(found):
            hits[tier.name] += r.block_tokens(i)
            if tier.caps.promotes:
                promote.append(_block(chain[i], r.block_tokens(i), kv_bytes))
                sources.append(tier)
        new = [_block(e, r.block_tokens(i), kv_bytes) for i, e in enumerate(chain) if i >= len(found)]
        stack.insert(new)  # store
        if promote:  # release: promotion, then the pins
            stack.promote(promote, sources)
        stack.release(found)
        _count(point, r, hits, len(found), n_reach, kv_bytes)
        point.ram_written_bytes += sum(b.nbytes for b in new) + (sum(b.nbytes for b in promote) if stack.ram.capacity_bytes else 0)
        if on_request is not None:
            on_request()
    if ssd is not None:
        point.ssd_written_bytes, point.ssd_evicted_blocks, point.ssd_refused_blocks = ssd.written, ssd.evicted, ssd.refused
    point.wall_s = time.monotonic() - t0
    point.finish()
    return stack


def _count(point: PlanPoint, r: TraceRequest, hits: dict[str, int], n_found: int, n_reach: int, kv_bytes: int) -> None:
    point.requests += 1
    point.prompt_tokens += r.input_length
    point.ram_hit_tokens += hits["ram"]
    point.ssd_hit_tokens += hits["ssd"]
    point.ram_read_bytes += hits["ram"] * kv_bytes
    point.ssd_read_bytes += hits["ssd"] * kv_bytes
    point.max_hit_tokens += sum(r.block_tokens(i) for i in range(n_reach))
    if n_reach:
        point.reachable_requests += 1
        point.full_prefix_requests += n_found >= n_reach


__all__ = ["KV_SHAPES", "POLICIES", "ROOT", "PlanPoint", "PlanSsdTier", "kv_bytes_per_token", "reachable_blocks", "replay"]
