"""Reading a chain ahead from the remote tier (`kvtool.tiers.remote_read.ValueRead`) against a
real redis-server: values come back in chain order across many small batches, each verified; a
bad value in a later batch is a miss there (deleted, counted) and cuts the read; a read taken in
part, cancelled, or cut by a closed store leaves no error; a hit through `RemoteBlockTier` places
exactly the verified blocks and stops reading at the first bad one."""

from __future__ import annotations

import numpy as np
import pytest

from kvtool.tiers import remote_value as rv
from kvtool.tiers.base import ChainEntry
from kvtool.tiers.remote import RemoteBlockTier
from kvtool.tiers.remote_read import DEFAULT_WIRE_WINDOW
from kvtool.tiers.remote_store import RemoteStore
from tests import redis_servers
from tests.redis_servers import get_blocks, make_chain, put_blocks, same_block

redis_node = redis_servers.redis_node

N = 24


def _store(url: str, chain, **kw) -> RemoteStore:
    one = rv.value_bound(chain.kv, len(chain.tokens[0]), "none")
    kw.setdefault("read_batch_bytes", 3 * one)  # 3 values per batch: 8 batches
    return RemoteStore(url, chain.layout_key, chain.kv, "none", timeout_s=0.25, **kw)


@pytest.mark.parametrize("ahead,threads", [(0, 1), (1, 1), (2, 2), (4, 3)])
def test_read_ahead_yields_every_block_in_chain_order(redis_node, ahead, threads):
    chain = make_chain(N, model_id=f"read-ahead-{ahead}-{threads}", seed=21)
    with _store(redis_node.url, chain, read_ahead=ahead, read_threads=threads) as store:
        assert put_blocks(store, chain.blocks) == N
        reading = store.read(chain.hashes, chain.parents, chain.tokens)
        assert len(reading.batches) == 8
        assert reading.window == (DEFAULT_WIRE_WINDOW if ahead == 0 else 0)  # one node: requests sent ahead
        got = list(reading.blocks())
        assert [k for k, _ in got] == list(range(N))
        assert all(b is not None and same_block(b, want) for (_, b), want in zip(got, chain.blocks))
        stats = store.stats()
        assert stats["remote_hit_blocks"] == N and stats["remote_lookups"] == 1 and stats["remote_errors"] == 0


@pytest.mark.parametrize("ahead", [0, 2])
def test_a_bad_value_in_a_later_batch_cuts_the_read_there(redis_node, ahead):
    chain = make_chain(N, model_id=f"read-ahead-corrupt-{ahead}", seed=22)
    client = redis_node.client()
    with _store(redis_node.url, chain, read_ahead=ahead) as store:
        assert put_blocks(store, chain.blocks) == N
        bad = 13  # the second value of the fifth batch
        key = rv.value_key(chain.layout_key, chain.hashes[bad])
        client.setrange(key, client.strlen(key) - 5, b"\xff\x00")
        got = list(store.read(chain.hashes, chain.parents, chain.tokens).blocks())
        assert [k for k, _ in got] == list(range(15))  # stops after the batch with the miss
        assert all(b is not None for _, b in got[:bad]) and got[bad][1] is None and got[bad + 1][1] is not None
        assert client.exists(key) == 0
        assert store.stats()["remote_corrupt"] == 1
        # the same through get_blocks without stopping: only the bad one is missing
        assert put_blocks(store, chain.blocks[bad : bad + 1]) == 1
        client.set(rv.value_key(chain.layout_key, chain.hashes[3]), b"garbage")
        blocks = get_blocks(store, chain.hashes, chain.parents, chain.tokens, stop_at_miss=False)
        assert [b is None for b in blocks] == [k == 3 for k in range(N)]


def test_a_read_taken_in_part_cancelled_or_closed_is_quiet(redis_node):
    chain = make_chain(N, model_id="read-ahead-cancel", seed=23)
    with _store(redis_node.url, chain, read_ahead=3, read_threads=3) as store:
        assert put_blocks(store, chain.blocks) == N
        reading = store.read(chain.hashes, chain.parents, chain.tokens)
        got = list(reading.blocks(5))
        assert [k for k, _ in got] == list(range(5)) and all(b is not None for _, b in got)
        reading.cancel()
        reading.cancel()
        assert all(b is not None and same_block(b, chain.blocks[k]) for k, b in reading.blocks())  # what had come
        assert store.stats()["remote_errors"] == 0
        reading = store.read(chain.hashes, chain.parents, chain.tokens)
        store.close()  # batches in flight end as misses (or errors), never as exceptions
        assert all(b is None or same_block(b, chain.blocks[k]) for k, b in reading.blocks())
        assert get_blocks(store, chain.hashes, chain.parents, chain.tokens) == [None] * N


def _in_use(store: RemoteStore) -> int:
    """Connections the store's pool has handed out and not taken back."""
    return len(store._get_client().connection_pool._in_use_connections)


def test_wire_read_cancelled_with_replies_on_the_wire_drops_its_connection(redis_node):
    chain = make_chain(N, model_id="read-wire-cancel", seed=25)
    with _store(redis_node.url, chain) as store:
        assert put_blocks(store, chain.blocks) == N
        for taken in (0, 2, 5, 7):  # batches 1-4 (and more) on the wire when it is cancelled
            reading = store.read(chain.hashes, chain.parents, chain.tokens)
            assert reading.window and len(reading.batches) == 8
            got = list(reading.blocks(taken))
            assert [k for k, _ in got] == list(range(taken)) and all(b is not None for _, b in got)
            reading.cancel()
            assert _in_use(store) == 0
        # had a connection with unread replies gone back to the pool, these would read stale replies
        assert store.longest_prefix(chain.hashes) == N
        blocks = get_blocks(store, chain.hashes, chain.parents, chain.tokens)
        assert all(b is not None and same_block(b, want) for b, want in zip(blocks, chain.blocks))
        stats = store.stats()
        assert stats["remote_errors"] == 0 and stats["remote_corrupt"] == 0 and _in_use(store) == 0


def test_wire_read_stays_in_step_past_a_key_of_another_type(redis_node):
    chain = make_chain(N, model_id="read-wire-wrongtype", seed=26)
    client = redis_node.client()
    with _store(redis_node.url, chain) as store:
        assert put_blocks(store, chain.blocks) == N
        for k in (4, 10):  # replies of the server's error in the middle of batches 2 and 4
            key = rv.value_key(chain.layout_key, chain.hashes[k])
            client.unlink(key)
            client.rpush(key, b"not a string")
        assert store.longest_prefix(chain.hashes) == N  # the keys exist
        blocks = get_blocks(store, chain.hashes, chain.parents, chain.tokens, stop_at_miss=False)
        assert [b is None for b in blocks] == [k in (4, 10) for k in range(N)]
        assert all(same_block(b, want) for b, want in zip(blocks, chain.blocks) if b is not None)
        assert client.exists(rv.value_key(chain.layout_key, chain.hashes[4])) == 0  # ours to replace: deleted
        assert store.longest_prefix(chain.hashes) == 4
        assert store.stats()["remote_errors"] == 0 and _in_use(store) == 0


class _Buffers:
    """What `RemoteBlockTier.read_into` needs of `KVBuffers`: host blocks placed at offsets."""

    def __init__(self):
        self.placed: dict[int, object] = {}

    def ready(self) -> None:
        pass

    def place_host(self, offset: int, block) -> None:
        self.placed[offset] = block


@pytest.mark.parametrize("ahead", [0, 2])
def test_tier_places_verified_blocks_and_stops_at_the_first_bad_one(redis_node, ahead):
    chain = make_chain(N, model_id=f"read-ahead-tier-{ahead}", seed=24)
    ids = np.concatenate(chain.tokens)
    bs = len(chain.tokens[0])
    entries = [ChainEntry(h, p, i * bs, (i + 1) * bs) for i, (h, p) in enumerate(zip(chain.hashes, chain.parents))]
    client = redis_node.client()
    with _store(redis_node.url, chain, read_ahead=ahead) as store:
        assert put_blocks(store, chain.blocks) == N
        client.set(rv.value_key(chain.layout_key, chain.hashes[17]), b"not a value")
        tier = RemoteBlockTier(store)
        handles = tier.longest_prefix(entries, ids)
        assert len(handles) == N
        buffers = _Buffers()
        res = tier.read_into(entries, handles, ids, buffers)  # type: ignore[arg-type]
        tier.release(handles)
        assert res.n_ok == 17 and sorted(buffers.placed) == [i * bs for i in range(17)]
        assert all(same_block(buffers.placed[i * bs], chain.blocks[i]) for i in range(17))  # type: ignore[arg-type]
        # a shorter run than the lookup found (a trimmed hit): only those are placed
        handles = tier.longest_prefix(entries[:10], ids)
        buffers = _Buffers()
        assert tier.read_into(entries[:4], handles[:4], ids, buffers).n_ok == 4  # type: ignore[arg-type]
        tier.release(handles)
        assert sorted(buffers.placed) == [i * bs for i in range(4)]
        assert store.stats()["remote_corrupt"] == 1
