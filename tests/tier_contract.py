"""The contract every `BlockTier` keeps (`kvtool.tiers.base`), as one class of tests: `TierContract`.

As zarr-python's `StoreTests`: a tier's test module subclasses `TierContract` and gives an `env`
fixture that builds its tier over the real backend (`TierEnv`: the tier, how to fill it, how to
damage one stored block, how to reopen it). A future tier passes this suite or is not done.

What it holds a tier to (capabilities, `Caps`, say which parts apply):
- the longest run: `longest_prefix` + `read_into` place exactly the leading entries held, bit-exact;
- a token-id mismatch is a miss, and a damaged record cuts the chain where it is;
- tail-entry (`find_any`) and sibling (`sibling_candidates`) lookups, or none at no cost;
- `put` / `remove` / `stats`; `release` after `close`, and reads after `close` miss;
- readers on several threads while another thread writes (a `threading.Barrier`, no sleeps);
- a persistent tier reopened over its store holds what it held.

Blocks are random KV (`tests.store_helpers`: 2 layers, 2 KV heads, head_dim 8, bfloat16 bit
patterns, 4-token blocks); a read is checked against them byte for byte in real `KVBuffers`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest

from kvtool.disk.hostblock import HostBlock
from kvtool.disk.segment import KVLayout
from kvtool.kv.blocks import from_host
from kvtool.kv.buffers import KVBuffers
from kvtool.tiers.base import BlockTier, ChainEntry, Put
from tests.store_helpers import make_chain

BS = 4  # tokens per block (`store_helpers.GEOMETRY`)
N_FULL = 5  # full blocks of the prompts below (and a 2-token tail entry)
WAIT_S = 20.0  # bound of every wait


class TierEnv:
    """A tier under test and what the contract needs to drive it (override per backend).

    Attributes:
        tier: the `BlockTier`.
        layout_key: its namespace (32 hex); blocks are chained under its root parent.
        kv: the namespace's KV layout.
    """

    tier: BlockTier
    layout_key: str
    kv: KVLayout

    def prepare(self, hosts: Sequence[HostBlock]) -> list[Any]:
        """What `fill` takes, made on the calling (MLX) thread: MLX blocks by default."""
        return [from_host(h) for h in hosts]

    def fill(self, prepared: Sequence[Any]) -> None:
        """Make the blocks held by the tier (by default `put` as new blocks, then `flush`)."""
        assert self.tier.put(prepared, Put.NEW) == len(prepared)
        assert self.tier.flush(WAIT_S)

    def corrupt(self, block_hash: str) -> None:
        """Damage what the tier holds for `block_hash` so that serving it would be wrong."""
        raise NotImplementedError

    def reopen(self) -> BlockTier:
        """Close the tier and open a new one over the same store (persistent tiers)."""
        raise NotImplementedError

    def close(self) -> None:
        """Teardown."""
        self.tier.close(WAIT_S)


def prompt(seed: int = 0, n_tokens: int = N_FULL * BS + 2) -> np.ndarray:
    """int32 prompt token ids `[n_tokens]`, distinct per seed."""
    return (np.arange(n_tokens, dtype=np.int32) + 1000 * seed).astype(np.int32)


def blocks_of(env: TierEnv, ids: np.ndarray, seed: int = 0) -> list[HostBlock]:
    """The prompt's blocks and tail entry (random KV, real chain hashes)."""
    return make_chain(env.layout_key, ids, seed=seed, block_size=BS, tail=True)


def entries(blocks: Sequence[HostBlock]) -> list[ChainEntry]:
    out, at = [], 0
    for b in blocks:
        out.append(ChainEntry(b.block_hash, b.parent_hash, at, at + b.num_tokens))
        at += b.num_tokens
    return out


def read(tier: BlockTier, kv: KVLayout, chain: Sequence[ChainEntry], ids: np.ndarray,
         buffers: KVBuffers | None = None) -> tuple[int, KVBuffers]:  # fmt: skip
    """Look the chain up and place what the tier found; returns (entries placed, buffers)."""
    buffers = buffers if buffers is not None else KVBuffers.allocate(kv, int(ids.size) + 8)
    handles = tier.longest_prefix(chain, ids)
    try:
        n = tier.read_into(chain[: len(handles)], handles, ids, buffers).n_ok if handles else 0
    finally:
        tier.release(handles)
    return n, buffers


def assert_placed(buffers: KVBuffers, kv: KVLayout, blocks: Sequence[HostBlock], chain: Sequence[ChainEntry]) -> None:
    """The buffers hold exactly `blocks` at their entries' offsets (raw bytes)."""
    for b, e in zip(blocks, chain):
        for got, want in zip(buffers.dest(e.start, e.stop - e.start), kv.interleave(b.keys, b.values)):
            assert got.tobytes() == np.ascontiguousarray(want).tobytes(), f"entry at {e.start} differs"


class TierContract:
    """The contract tests; a subclass provides the `env` fixture (a `TierEnv`)."""

    def test_longest_run_is_placed_bit_exact(self, env: TierEnv):
        ids = prompt(1)
        blocks = blocks_of(env, ids, seed=1)
        chain = entries(blocks)
        env.fill(env.prepare(blocks[:3]))
        n, buffers = read(env.tier, env.kv, chain, ids)
        assert n == 3, f"placed {n} entries, want {3}"
        assert_placed(buffers, env.kv, blocks[:3], chain)
        assert read(env.tier, env.kv, chain[3:], ids)[0] == 0  # not held: nothing

    def test_token_id_mismatch_is_a_miss(self, env: TierEnv):
        ids = prompt(2)
        blocks = blocks_of(env, ids, seed=2)
        chain = entries(blocks)
        env.fill(env.prepare(blocks))
        other = ids.copy()
        other[BS + 1] += 1  # block 1's key, another token: a colliding hash must not serve it
        n, buffers = read(env.tier, env.kv, chain, other)
        assert n == 1, f"placed {n} entries, want {1}"
        assert_placed(buffers, env.kv, blocks[:1], chain)

    def test_damaged_block_cuts_the_chain(self, env: TierEnv):
        ids = prompt(3)
        blocks = blocks_of(env, ids, seed=3)
        chain = entries(blocks)
        env.fill(env.prepare(blocks))
        env.corrupt(blocks[2].block_hash)
        n, buffers = read(env.tier, env.kv, chain, ids)
        assert n == 2, f"placed {n} entries, want {2}"
        assert_placed(buffers, env.kv, blocks[:2], chain)

    def test_tail_entry_lookup(self, env: TierEnv):
        ids = prompt(4)
        blocks = blocks_of(env, ids, seed=4)
        tail, e = blocks[-1], entries(blocks)[-1]
        env.fill(env.prepare(blocks))
        k = tail.num_tokens
        cands = [("0" * 32, k + 1), (tail.block_hash, k)]
        got = env.tier.find_any(cands, ids, e.start)
        if not env.tier.caps.finds_tails:
            assert got is None
            return
        assert got is not None and got[1:] == (tail.block_hash, k)
        buffers = KVBuffers.allocate(env.kv, int(ids.size) + 8)
        assert env.tier.read_into([e], [got[0]], ids, buffers).n_ok == 1
        env.tier.release([got[0]])
        assert_placed(buffers, env.kv, [tail], [e])
        assert env.tier.find_any([("f" * 32, k)], ids, e.start) is None

    def test_sibling_lookup(self, env: TierEnv):
        ids = prompt(5)
        blocks = blocks_of(env, ids, seed=5)
        env.fill(env.prepare(blocks))
        parent, child = blocks[1].block_hash, blocks[2]
        found = list(env.tier.sibling_candidates(parent, set()))
        if not env.tier.caps.lists_siblings:
            assert found == []
            return
        assert [b.block_hash for b, _ in found] == [child.block_hash]
        assert np.array_equal(np.asarray(found[0][0].token_ids), child.token_ids)
        assert list(env.tier.sibling_candidates(parent, {child.block_hash})) == []

    def test_put_remove_stats(self, env: TierEnv):
        ids = prompt(6)
        blocks = blocks_of(env, ids, seed=6)
        chain = entries(blocks)
        env.fill(env.prepare(blocks))
        stats = env.tier.stats()
        assert all(isinstance(k, str) and isinstance(v, int) for k, v in stats.items())
        if not env.tier.caps.removes:
            assert env.tier.remove([b.block_hash for b in blocks]) == 0
            return
        assert env.tier.remove([b.block_hash for b in blocks[2:]]) == len(blocks) - 2
        assert read(env.tier, env.kv, chain, ids)[0] == 2

    def test_release_after_close_and_reads_miss(self, env: TierEnv):
        ids = prompt(7)
        blocks = blocks_of(env, ids, seed=7)
        chain = entries(blocks)
        env.fill(env.prepare(blocks))
        handles = env.tier.longest_prefix(chain, ids)
        assert handles
        assert env.tier.close(WAIT_S)
        env.tier.release(handles)  # no error
        assert read(env.tier, env.kv, chain, ids)[0] == 0

    def test_concurrent_readers_and_a_writer(self, env: TierEnv):
        ids_a, ids_b = prompt(8), prompt(9)
        a, b = blocks_of(env, ids_a, seed=8), blocks_of(env, ids_b, seed=9)
        chain_a = entries(a)
        env.fill(env.prepare(a))
        n_readers, rounds = 3, 8
        # buffers and MLX blocks made on this thread: tier calls only on the others
        buffers = [[KVBuffers.allocate(env.kv, int(ids_a.size) + 8) for _ in range(rounds)] for _ in range(n_readers)]
        prepared_b = env.prepare(b)
        start = threading.Barrier(n_readers + 1, timeout=WAIT_S)
        errors: list[BaseException] = []
        placed: list[int] = []

        def run(fn: Callable[[], None]) -> Callable[[], None]:
            def body() -> None:
                try:
                    start.wait()
                    fn()
                except BaseException as exc:  # noqa: BLE001 - re-raised on the test's thread
                    errors.append(exc)
            return body

        def reader(i: int) -> Callable[[], None]:
            def go() -> None:
                for buf in buffers[i]:
                    n, _ = read(env.tier, env.kv, chain_a, ids_a, buf)
                    assert_placed(buf, env.kv, a[:n], chain_a)
                    placed.append(n)
            return go

        threads = [threading.Thread(target=run(reader(i))) for i in range(n_readers)]
        threads.append(threading.Thread(target=run(lambda: env.fill(prepared_b))))
        for t in threads:
            t.start()
        for t in threads:
            t.join(WAIT_S * 3)
        assert not any(t.is_alive() for t in threads)
        if errors:
            raise errors[0]
        assert placed == [len(a)] * (n_readers * rounds)
        n, buf = read(env.tier, env.kv, entries(b), ids_b)
        assert n == len(b), f"placed {n} entries, want {len(b)}"
        assert_placed(buf, env.kv, b, entries(b))

    def test_reopened_tier_holds_its_blocks(self, env: TierEnv):
        if not env.tier.caps.persistent:
            pytest.skip("not a persistent tier")
        ids = prompt(10)
        blocks = blocks_of(env, ids, seed=10)
        chain = entries(blocks)
        env.fill(env.prepare(blocks))
        tier = env.reopen()
        n, buffers = read(tier, env.kv, chain, ids)
        assert n == len(blocks), f"placed {n} entries, want {len(blocks)}"
        assert_placed(buffers, env.kv, blocks, chain)


CONTRACT_TESTS = sorted(name for name in vars(TierContract) if name.startswith("test_"))

__all__ = ["CONTRACT_TESTS", "TierContract", "TierEnv", "assert_placed", "blocks_of", "entries", "prompt", "read"]
