"""The remote tier's store (`kvtool.tiers.remote_store`) against real redis-server processes: round
trips of real host blocks (one node, a 3-node cluster, split values), corruption of every kind
(a miss, deleted, counted), faults (SIGKILL, SIGSTOP, down at start: misses within the deadline,
the breaker, recovery), eviction under maxmemory, passwords, the async writer. Also the value
format and URL parsing without a server."""

from __future__ import annotations

import logging
import signal
import time

import numpy as np
import pytest
import redis

from kvtool.config.remote_url import RemoteURLError, mask_url, parse_remote_url
from kvtool.tiers import remote_value as rv
from kvtool.tiers.remote import remote_writer
from kvtool.tiers.remote_store import RemoteStore
from tests import redis_servers
from tests.redis_servers import AUTH_PASSWORD, RedisServer, free_port, get_blocks, make_chain, put_blocks, same_block

# the servers (pytest fixtures of tests/redis_servers.py)
redis_node, fresh_redis, redis_lru = redis_servers.redis_node, redis_servers.fresh_redis, redis_servers.redis_lru
redis_auth, redis_cluster = redis_servers.redis_auth, redis_servers.redis_cluster

TIMEOUT_S = 0.25
MARGIN_S = 1.5  # generous: the machine is shared


def _store(url: str, chain, **kw) -> RemoteStore:
    kw.setdefault("timeout_s", TIMEOUT_S)
    return RemoteStore(url, chain.layout_key, chain.kv, kw.pop("codec", "none"), **kw)


def _get(store: RemoteStore, chain, **kw):
    return get_blocks(store, chain.hashes, chain.parents, chain.tokens, **kw)


# ----------------------------------------------------------------------------- round trips
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("codec", ["none", "zstd"])
@pytest.mark.slow
def test_round_trip_single_node(redis_node, dtype, codec):
    chain = make_chain(8, model_id=f"rt-{dtype}-{codec}", dtype=dtype, seed=1)
    with _store(redis_node.url, chain, codec=codec) as store:
        assert store.longest_prefix(chain.hashes) == 0
        assert put_blocks(store, chain.blocks[:6]) == 6
        assert put_blocks(store, chain.blocks[:6]) == 0  # first writer wins
        assert store.longest_prefix(chain.hashes) == 6
        got = _get(store, chain, stop_at_miss=False)
        assert [g is not None for g in got] == [True] * 6 + [False] * 2
        assert all(same_block(g, b) for g, b in zip(got[:6], chain.blocks))
        stats = store.stats()
        assert stats["remote_hit_blocks"] == 6 and stats["remote_put_exists"] == 6 and stats["remote_errors"] == 0
        assert stats["remote_bytes_written"] > 0 and stats["remote_bytes_read"] >= stats["remote_bytes_written"]
        assert store.delete(chain.hashes) == 6
        assert store.longest_prefix(chain.hashes) == 0


@pytest.mark.slow
def test_round_trip_cluster_spreads_a_namespace(redis_cluster):
    chain = make_chain(24, model_id="rt-cluster", seed=2)
    with _store(redis_cluster.url, chain) as store:
        assert put_blocks(store, chain.blocks) == 24
        assert store.longest_prefix(chain.hashes) == 24
        got = _get(store, chain)
        assert all(g is not None and same_block(g, b) for g, b in zip(got, chain.blocks))
        assert store.stats()["remote_errors"] == 0
    per_node = [node.client().dbsize() for node in redis_cluster.nodes]
    assert sum(per_node) >= 24 and sum(1 for n in per_node if n) >= 2, per_node  # the hash tag is the chain hash


@pytest.mark.parametrize("where", ["node", "cluster"])
@pytest.mark.slow
def test_split_values_round_trip_and_delete(request, where):
    server = request.getfixturevalue("redis_node" if where == "node" else "redis_cluster")
    chain = make_chain(3, model_id=f"split-{where}", dtype="float32", head_dim=64, block_size=16, seed=3)
    assert len(rv.encode_value(chain.blocks[0], chain.layout_key, chain.kv)) > 3 * 4096
    with _store(server.url, chain, max_value_bytes=4096) as store:
        assert put_blocks(store, chain.blocks) == 3
        assert put_blocks(store, chain.blocks) == 0
        got = _get(store, chain)
        assert all(g is not None and same_block(g, b) for g, b in zip(got, chain.blocks))
        for other in (2048, 1 << 20):  # readers configured otherwise read the same parts
            with _store(server.url, chain, max_value_bytes=other) as reader:
                assert all(g is not None for g in _get(reader, chain))
        assert store.delete(chain.hashes[:1]) == 1
        client = redis.Redis.from_url(server.url.replace("redis+cluster", "redis")) if where == "node" else None
        if client is not None:
            assert not list(client.scan_iter(match=f"*{chain.hashes[0]}*"))  # parts went with it


@pytest.mark.slow
def test_an_evicted_part_is_a_miss_not_corruption(redis_node):
    chain = make_chain(1, model_id="split-evicted", dtype="float32", head_dim=64, block_size=16, seed=4)
    with _store(redis_node.url, chain, max_value_bytes=4096) as store:
        put_blocks(store, chain.blocks)
        client = redis_node.client()
        parts = [k for k in client.scan_iter(match=f"*{chain.hashes[0]}*:p:*")]
        assert len(parts) >= 3
        client.unlink(parts[1])
        assert _get(store, chain) == [None]
        assert store.stats()["remote_corrupt"] == 0
        assert not list(client.scan_iter(match=f"*{chain.hashes[0]}*"))  # manifest and other parts gone


@pytest.mark.slow
def test_round_trip_over_a_unix_socket(tmp_path):
    sock = tmp_path / "redis.sock"
    chain = make_chain(3, model_id="unix", seed=17)
    with RedisServer(["--unixsocket", str(sock), "--unixsocketperm", "700"]):
        with _store(f"unix://{sock}?db=2", chain) as store:
            assert put_blocks(store, chain.blocks) == 3
            assert all(g is not None and same_block(g, b) for g, b in zip(_get(store, chain), chain.blocks))


# ----------------------------------------------------------------------------- corruption
def _corrupt_cases(chain, other_chain, other_layout):
    key = rv.value_key(chain.layout_key, chain.hashes[0])
    good = rv.encode_value(chain.blocks[0], chain.layout_key, chain.kv)
    forged = chain.blocks[0]
    forged_ids = type(forged)(forged.block_hash, forged.parent_hash, forged.token_ids + 1, forged.keys, forged.values, forged.dtype)
    return key, {
        "flipped byte": lambda c: c.setrange(key, len(good) - 3, bytes([good[-3] ^ 0xFF])),
        "flipped header byte": lambda c: c.setrange(key, 20, b"X"),
        "truncated": lambda c: c.set(key, good[:-10]),
        "empty header": lambda c: c.set(key, b"\x00" * 8),
        "garbage": lambda c: c.set(key, b"hello world, not a segment"),
        "another chain's value": lambda c: c.set(key, rv.encode_value(chain.blocks[1], chain.layout_key, chain.kv)),
        "another layout's value": lambda c: c.set(key, rv.encode_value(other_chain.blocks[0], other_chain.layout_key, other_chain.kv)),
        "same layout key, other shape": lambda c: c.set(key, rv.encode_value(other_layout.blocks[0], chain.layout_key, other_layout.kv)),
        "other token ids": lambda c: c.set(key, rv.encode_value(forged_ids, chain.layout_key, chain.kv)),
        "oversized": lambda c: c.set(key, good + b"\x00" * (rv.value_bound(chain.kv, 4, "none"))),
        "bad manifest": lambda c: c.set(key, b"kvtool-parts:1:2:99999999999:8:0123456789abcdef"),
        "a list, not a string": lambda c: (c.unlink(key), c.rpush(key, b"x")),
        "empty value": lambda c: c.set(key, b""),  # SET NX can never replace it: it must be deleted
    }


@pytest.mark.parametrize("case", list(_corrupt_cases(make_chain(2), make_chain(1, model_id="x"), make_chain(1, head_dim=16))[1]))
@pytest.mark.slow
def test_a_bad_value_is_a_miss_deleted_and_counted(redis_node, case):
    chain = make_chain(2, model_id=f"corrupt-{case}", seed=5)
    other = make_chain(1, model_id="other-model", seed=6)
    other_shape = make_chain(1, model_id="other-model", head_dim=16, seed=7)
    key, cases = _corrupt_cases(chain, other, other_shape)
    client = redis_node.client()
    with _store(redis_node.url, chain) as store:
        assert put_blocks(store, chain.blocks) == 2
        cases[case](client)
        got = _get(store, chain, stop_at_miss=False)
        assert got[0] is None and got[1] is not None and same_block(got[1], chain.blocks[1])
        assert client.exists(key) == 0, "a bad value is deleted"
        stats = store.stats()
        assert stats["remote_corrupt"] + stats["remote_errors"] >= 1
        assert stats["remote_breaker_open"] == 0  # a bad value is not a server failure
        assert put_blocks(store, chain.blocks[:1]) == 1 and _get(store, chain)[0] is not None  # stored again: a hit


def test_decode_value_raises_only_its_error_on_mutations():
    chain = make_chain(1, seed=8)
    good = rv.encode_value(chain.blocks[0], chain.layout_key, chain.kv, codec="lz4")
    rng = np.random.default_rng(0)
    for i in range(400):
        data = bytearray(good)
        if i % 4 == 0:
            data = data[: rng.integers(0, len(data))]
        else:
            for _ in range(rng.integers(1, 4)):
                data[rng.integers(0, len(data))] = int(rng.integers(0, 256))
        try:
            block = rv.decode_value(bytes(data), chain.layout_key, chain.kv, "lz4", chain.hashes[0], chain.parents[0],
                                    expected_tokens=chain.tokens[0])  # fmt: skip
        except rv.RemoteValueError:
            continue
        assert same_block(block, chain.blocks[0])  # a mutation that verifies changed nothing that matters


def test_value_format_is_a_one_record_segment():
    from kvtool.disk import segment

    chain = make_chain(1, seed=9)
    value = rv.encode_value(chain.blocks[0], chain.layout_key, chain.kv)
    header = segment.parse_header(value, len(value))
    assert header.layout_key == chain.layout_key and len(header.slots) == 1 and header.kv == chain.kv
    assert rv.VALUE_FORMAT == f"s{segment.FORMAT_VERSION}"
    key = rv.value_key(chain.layout_key, chain.hashes[0])
    assert key == f"kvtool:s2:{chain.layout_key}:{{{chain.hashes[0]}}}"
    info = rv.parse_key(rv.part_key(key, "0123456789abcdef", 3))
    assert info is not None and info.main_key == key and info.part == 3
    with pytest.raises(ValueError):
        rv.value_key(chain.layout_key, "*")


# ----------------------------------------------------------------------------- faults
@pytest.mark.slow
def test_sigkill_misses_within_deadline_breaker_then_recovery(fresh_redis):
    chain = make_chain(4, model_id="faults-kill", seed=10)
    with _store(fresh_redis.url, chain, breaker_backoff_s=0.3) as store:
        assert put_blocks(store, chain.blocks) == 4
        fresh_redis.signal(signal.SIGKILL)
        for _ in range(4):
            t0 = time.monotonic()
            assert _get(store, chain) == [None] * 4
            assert store.longest_prefix(chain.hashes) == 0
            assert put_blocks(store, chain.blocks) == 0
            assert time.monotonic() - t0 < 3 * TIMEOUT_S + MARGIN_S
        stats = store.stats()
        assert stats["remote_breaker_open"] == 1 and stats["remote_breaker_trips"] == 1 and stats["remote_errors"] >= 3
        assert not store.available and stats["remote_dropped_writes"] >= 4
        fresh_redis.start(fresh_redis.port)  # empty: no persistence
        deadline = time.monotonic() + 20
        while put_blocks(store, chain.blocks) == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        got = _get(store, chain)
        assert all(g is not None and same_block(g, b) for g, b in zip(got, chain.blocks))
        assert store.available and store.stats()["remote_breaker_open"] == 0


@pytest.mark.slow
def test_sigstop_returns_within_deadline(fresh_redis):
    chain = make_chain(4, model_id="faults-stop", seed=11)
    with _store(fresh_redis.url, chain, breaker_backoff_s=0.3) as store:
        assert put_blocks(store, chain.blocks) == 4
        fresh_redis.signal(signal.SIGSTOP)
        try:
            for _ in range(4):
                t0 = time.monotonic()
                assert _get(store, chain) == [None] * 4
                assert time.monotonic() - t0 < 2 * TIMEOUT_S + MARGIN_S
            assert store.stats()["remote_breaker_open"] == 1
        finally:
            fresh_redis.signal(signal.SIGCONT)
        deadline = time.monotonic() + 20
        got = _get(store, chain)
        while got[0] is None and time.monotonic() < deadline:
            time.sleep(0.1)
            got = _get(store, chain)
        assert all(g is not None and same_block(g, b) for g, b in zip(got, chain.blocks))


@pytest.mark.slow
def test_down_at_start_then_reconnects(caplog):
    chain = make_chain(2, model_id="faults-start", seed=12)
    server = RedisServer()
    port = free_port()
    try:
        with caplog.at_level(logging.WARNING, logger="kvtool"):
            t0 = time.monotonic()
            store = _store(f"redis://127.0.0.1:{port}/0", chain, breaker_backoff_s=0.2, breaker_max_backoff_s=0.5)
            assert time.monotonic() - t0 < TIMEOUT_S + MARGIN_S
        assert not store.available and _get(store, chain) == [None, None]
        assert sum("unavailable" in r.getMessage() for r in caplog.records) == 1  # logged once
        server.start(port)
        deadline = time.monotonic() + 20
        while put_blocks(store, chain.blocks) == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert all(g is not None for g in _get(store, chain)) and store.available
        store.close()
        assert _get(store, chain) == [None, None]  # closed: misses, no error
    finally:
        server.close()


@pytest.mark.slow
def test_cluster_node_killed_misses_within_deadline():
    from tests.redis_servers import RedisClusterProcesses

    chain = make_chain(12, model_id="cluster-fault", seed=13)
    with RedisClusterProcesses(3) as cluster, _store(cluster.url, chain, breaker_backoff_s=0.3) as store:
        assert put_blocks(store, chain.blocks) == 12
        cluster.nodes[2].signal(signal.SIGKILL)
        for _ in range(4):
            t0 = time.monotonic()
            got = _get(store, chain, stop_at_miss=False)
            assert all(g is None or same_block(g, b) for g, b in zip(got, chain.blocks))
            assert time.monotonic() - t0 < 3 * TIMEOUT_S + MARGIN_S
        assert store.stats()["remote_errors"] >= 1


# ----------------------------------------------------------------------------- eviction
@pytest.mark.slow
def test_eviction_under_maxmemory_gives_misses_not_errors(redis_lru):
    chain = make_chain(400, model_id="evict", dtype="float32", head_dim=64, block_size=16, seed=14)
    nbytes = sum(len(rv.encode_value(b, chain.layout_key, chain.kv)) for b in chain.blocks)
    assert nbytes > 3 * 2 * 1024 * 1024  # 3x maxmemory
    with _store(redis_lru.url, chain, timeout_s=2.0) as store:
        writer = remote_writer(store, max_queue_bytes=64 << 20)
        for i in range(0, 400, 20):
            assert writer.enqueue_many(chain.blocks[i : i + 20]) == 20
        assert writer.stop(60)
        got = _get(store, chain, stop_at_miss=False)
        hits = [g for g in got if g is not None]
        assert 0 < len(hits) < 400
        assert all(same_block(g, b) for g, b in zip(got, chain.blocks) if g is not None)
        stats = store.stats()
        assert stats["remote_errors"] == 0 and stats["remote_corrupt"] == 0 and stats["remote_dropped_writes"] == 0
    assert redis_lru.client().info("stats")["evicted_keys"] > 0


# ----------------------------------------------------------------------------- passwords
@pytest.mark.slow
def test_password_from_url_or_env_and_never_shown(redis_auth, monkeypatch, caplog):
    chain = make_chain(2, model_id="auth", seed=15)
    with _store(redis_auth.url, chain) as store:
        assert put_blocks(store, chain.blocks) == 2
        assert AUTH_PASSWORD not in repr(store) and AUTH_PASSWORD not in store.url
    monkeypatch.setenv("KVTOOL_REMOTE_PASSWORD", AUTH_PASSWORD)
    with _store(f"redis://127.0.0.1:{redis_auth.port}/0", chain) as store:
        assert all(g is not None for g in _get(store, chain))
    monkeypatch.delenv("KVTOOL_REMOTE_PASSWORD")
    wrong = f"redis://:{AUTH_PASSWORD}-wrong@127.0.0.1:{redis_auth.port}/0"
    with caplog.at_level(logging.DEBUG, logger="kvtool"):
        with _store(wrong, chain) as store:
            assert not store.available and _get(store, chain) == [None, None]
    assert caplog.records and not any(AUTH_PASSWORD in r.getMessage() for r in caplog.records)
    assert any("authentication" in r.getMessage() for r in caplog.records)


# ----------------------------------------------------------------------------- writer
@pytest.mark.slow
def test_writer_drains_skips_queued_hashes_and_drops_after_stop(redis_node):
    """The remote tier's writer (the one `AsyncWriter`, `when_full="shed"`: the shedding itself is
    `tests/test_writer_shed.py::test_when_full_shed_drops_at_once_whatever_the_durability`)."""
    chain = make_chain(10, model_id="writer", seed=16)
    with _store(redis_node.url, chain) as store:
        writer = remote_writer(store)
        assert writer.enqueue_many(chain.blocks) == 10
        assert writer.enqueue_many(chain.blocks[:3]) in (0, 3)  # hashes still queued are skipped
        assert writer.flush(10) and store.longest_prefix(chain.hashes) == 10
        assert writer.stop(10) and writer.queue_bytes() == 0
        assert writer.get_stats()["writer_save_success"] == 10
        assert writer.enqueue_many(chain.blocks) == 0  # stopped: dropped, counted by the store
        assert store.stats()["remote_dropped_writes"] == 10


# ----------------------------------------------------------------------------- URLs
@pytest.mark.parametrize("url,reason", [
    ("http://host", "scheme"), ("redis//host", "scheme"), ("redis://", "no host"), ("redis://h:0", "port"),
    ("redis://h:99999", "malformed"), ("redis://h/abc", "db"), ("redis://h?x=1", "unknown option"),
    ("redis+cluster://h/3", "database 0"), ("unix://relative.sock", "absolute"), ("redis://h?ssl_ca_certs=/x", "rediss"),
    ("redis://ho st", "spaces"), ("", "empty"), ("rediss://h?ssl_cert_reqs=maybe", "ssl_cert_reqs"),
])  # fmt: skip
def test_malformed_urls_are_one_clear_error(url, reason):
    with pytest.raises(RemoteURLError, match=reason):
        parse_remote_url(url)


def test_urls_parse_and_mask():
    r = parse_remote_url("rediss://alice:pw%2Fx@example.org:6380/2?ssl_ca_certs=/etc/ca.pem&ssl_cert_reqs=required", env={})
    assert (r.host, r.port, r.db, r.username, r.password, r.tls, r.cluster) == ("example.org", 6380, 2, "alice", "pw/x", True, False)
    assert r.ssl == {"ssl_ca_certs": "/etc/ca.pem", "ssl_cert_reqs": "required"} and "pw" not in r.masked
    assert parse_remote_url("redis+cluster://h:7000", env={}).cluster
    assert parse_remote_url("unix:///run/redis.sock?db=1", env={"KVTOOL_REMOTE_PASSWORD": "e"}).password == "e"
    assert mask_url("redis://:sec@h") == "redis://:***@h" and mask_url("redis://u:sec@h") == "redis://u:***@h"
    assert mask_url("redis://sec@h:1") == "redis://***@h:1" and mask_url("unix:///s?password=sec&db=1") == "unix:///s?password=***&db=1"
    assert "sec" not in mask_url("redis://:sec@h:99999x")
