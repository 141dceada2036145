"""Deleting a remote value that was rewritten meanwhile (`kvtool.tiers.remote_cas`), against a real
redis-server: a deleter reads a split value's manifest, another deleter removes the value and a
writer stores it again (a new manifest, new parts), then the first deleter deletes. The rewrite
must survive whole (its manifest and parts: no orphan parts at rest, still a hit), for the
reader's removal of an incomplete value, `RemoteStore.delete`, and `kvtool remote
prune|validate|rm`. The rewrite is done from a hook between the deleter's read and its delete
(a wrapped function of the code under test; the server is real, nothing is faked). Also: the
script's decision for each kind of value stored and read, the same deletes on a 3-node cluster,
and a server that refuses scripts (an ACL user without @scripting: a plain UNLINK instead)."""

from __future__ import annotations

import pytest
import redis

from kvtool.ops import remote_ops
from kvtool.tiers import remote_cas
from kvtool.tiers import remote_store as remote_store_module
from kvtool.tiers import remote_value as rv
from kvtool.tiers.remote_store import RemoteStore
from tests import redis_servers
from tests.redis_servers import get_blocks, make_chain, put_blocks, same_block

redis_node, redis_cluster, fresh_redis = redis_servers.redis_node, redis_servers.redis_cluster, redis_servers.fresh_redis

pytestmark = pytest.mark.slow  # redis-server processes

SPLIT = 4096  # max_value_bytes: a value of the chains below is 4+ parts


def _chain(model_id: str, n: int = 1):
    return make_chain(n, model_id=model_id, dtype="float32", head_dim=64, block_size=16, seed=7)


def _store(url: str, chain) -> RemoteStore:
    return RemoteStore(url, chain.layout_key, chain.kv, "none", timeout_s=2.0, max_value_bytes=SPLIT)


def _keys(client, chain) -> list[str]:
    return sorted(k.decode() for k in client.scan_iter(match=f"*{chain.hashes[0]}*"))


def _rewrite(client, chain, url: str) -> bytes:
    """What another deleter and a writer do meanwhile: the value and every part of it go, the
    value is stored again (a new nonce). Returns the new manifest."""
    old = _keys(client, chain)
    assert old and client.unlink(*old) == len(old)
    with _store(url, chain) as writer:
        assert put_blocks(writer, chain.blocks[:1]) == 1
    manifest = client.get(rv.value_key(chain.layout_key, chain.hashes[0]))
    assert rv.is_manifest(manifest)
    return manifest


def _assert_rewrite_intact(client, chain, url: str, manifest: bytes) -> None:
    key = rv.value_key(chain.layout_key, chain.hashes[0])
    conn = remote_ops.connect(url)
    try:
        report = remote_ops.validate(conn, chain.layout_key, dry_run=True)
    finally:
        conn.close()
    assert (report.orphan_parts, report.problems) == (0, []), "no part without a manifest"
    assert client.get(key) == manifest, "the rewritten value keeps its manifest"
    named = rv.manifest_part_keys(key, manifest)
    assert _keys(client, chain) == sorted([key, *named]), "no part without a manifest, none missing"
    with _store(url, chain) as reader:
        got = get_blocks(reader, chain.hashes[:1], chain.parents[:1], chain.tokens[:1])
        assert got[0] is not None and same_block(got[0], chain.blocks[0])


def test_reader_removing_an_incomplete_value_spares_its_rewrite(redis_node, monkeypatch):
    chain = _chain("cas-reader")
    client = redis_node.client()
    with _store(redis_node.url, chain) as store:
        assert put_blocks(store, chain.blocks) == 1
        parts = [k for k in _keys(client, chain) if ":p:" in k]
        assert len(parts) >= 3
        client.unlink(parts[1])  # evicted: the reader drops the rest of the value
        written: list[bytes] = []
        unlink = store.unlink

        def rewrite_then_unlink(*args, **kw):
            written.append(_rewrite(client, chain, redis_node.url))
            return unlink(*args, **kw)

        monkeypatch.setattr(store, "unlink", rewrite_then_unlink)
        assert get_blocks(store, chain.hashes, chain.parents, chain.tokens) == [None]
        assert len(written) == 1 and store.stats()["remote_corrupt"] == 0
    _assert_rewrite_intact(client, chain, redis_node.url, written[0])


def test_store_delete_spares_a_rewrite_after_its_read(redis_node, monkeypatch):
    chain = _chain("cas-delete")
    client = redis_node.client()
    written: list[bytes] = []
    pipelined = remote_store_module.pipelined

    def read_then_rewrite(*args, **kw):
        out = pipelined(*args, **kw)
        if not written:  # after `delete` read the heads
            written.append(_rewrite(client, chain, redis_node.url))
        return out

    with _store(redis_node.url, chain) as store:
        assert put_blocks(store, chain.blocks) == 1
        monkeypatch.setattr(remote_store_module, "pipelined", read_then_rewrite)
        assert store.delete(chain.hashes) == 0  # what it read was gone; the rewrite is newer than the delete
    _assert_rewrite_intact(client, chain, redis_node.url, written[0])


@pytest.mark.parametrize("op", ["prune", "validate", "rm-hash", "rm-namespace"])
def test_remote_ops_spare_a_rewrite_after_their_read(redis_node, monkeypatch, op):
    chain = _chain(f"cas-{op}")
    client = redis_node.client()
    with _store(redis_node.url, chain) as store:
        assert put_blocks(store, chain.blocks) == 1
    if op == "validate":  # an incomplete value: validate deletes it
        client.unlink(next(k for k in _keys(client, chain) if k.endswith(":1")))
    hook = {"prune": "_choose", "validate": "_confirm_orphans"}.get(op, "_memory")  # between read and delete
    written: list[bytes] = []
    original = getattr(remote_ops, hook)

    def rewrite_meanwhile(*args, **kw):
        if not written:
            written.append(_rewrite(client, chain, redis_node.url))
        return original(*args, **kw)

    monkeypatch.setattr(remote_ops, hook, rewrite_meanwhile)
    conn = remote_ops.connect(redis_node.url)
    try:
        if op == "prune":
            remote_ops.prune(conn, max_bytes=0, namespace=chain.layout_key)
        elif op == "validate":
            assert remote_ops.validate(conn, chain.layout_key).incomplete == 1
        else:
            remote_ops.rm(conn, chain.layout_key, chain.hashes if op == "rm-hash" else ())
    finally:
        conn.close()
    assert len(written) == 1
    _assert_rewrite_intact(client, chain, redis_node.url, written[0])


def test_compare_and_delete_takes_only_what_was_read(redis_node):
    client = redis_node.client()
    key = rv.value_key("c" * 32, "d" * 32)
    m1, m2 = (rv.Manifest(2, 5000, 4096, n).encode() for n in ("0123456789abcdef", "fedcba9876543210"))
    long_garbage = rv.MANIFEST_PREFIX + b"x" * 200  # no manifest: one of >= 128 bytes
    cases = [  # (stored, what was read, deleted?)
        (m1, m1, True), (m1, m2, False), (m1, b"", False), (b"kvtool-parts:junk", b"kvtool-parts:junk", True),
        (b"a whole value", b"", True), (b"", b"", True), (long_garbage, b"", True), (None, b"", False),
        (["a list"], b"", True), (["a list"], m1, False),
    ]  # fmt: skip
    for stored, read, deleted in cases:
        client.unlink(key)
        if isinstance(stored, list):
            client.rpush(key, *stored)
        elif stored is not None:
            client.set(key, stored)
        pipe = client.pipeline(transaction=False)
        remote_cas.queue_unlink(pipe, (key, read))
        remote_cas.queue_unlink(pipe, "kvtool:absent")
        assert pipe.execute() == [int(deleted), 0], (stored, read)
        assert client.exists(key) == (0 if deleted or stored is None else 1), (stored, read)
    assert remote_cas.guard(m1) == m1 and remote_cas.guard(b"kvtool-parts:junk") == b"kvtool-parts:junk"
    assert remote_cas.guard(long_garbage[:128]) == b"" and remote_cas.guard(b"\x10\0\0\0") == b""
    assert remote_cas.guard(None) == b"" and remote_cas.guard(Exception("WRONGTYPE")) == b""


def test_compare_and_delete_on_a_cluster(redis_cluster):
    chain = _chain("cas-cluster", n=6)  # values on several nodes, each with its parts (one hash tag)
    conn = remote_ops.connect(redis_cluster.url)
    try:
        with _store(redis_cluster.url, chain) as store:
            assert put_blocks(store, chain.blocks) == 6
            for h in chain.hashes[:2]:  # a part evicted: the reader removes the rest
                conn.client.unlink(remote_ops.scan(conn, f"*{h}*:p:*")[0][0])
            got = get_blocks(store, chain.hashes, chain.parents, chain.tokens, stop_at_miss=False)
            assert [g is None for g in got] == [True] * 2 + [False] * 4
            assert remote_ops.rm(conn, chain.layout_key, chain.hashes[2:4]).removed_keys == 2 * 10
            assert store.delete(chain.hashes[4:5]) == 1
            assert remote_ops.prune(conn, max_bytes=0, namespace=chain.layout_key).removed_keys == 10
        assert remote_ops.scan(conn, f"*{chain.layout_key}*") == ([], False)
    finally:
        conn.close()


def test_a_server_refusing_scripts_gets_a_plain_unlink(fresh_redis):
    chain = _chain("cas-no-scripts", n=3)
    admin = fresh_redis.client()
    admin.acl_setuser("kvonly", enabled=True, passwords=["+kv-pass"], keys=["*"], commands=["+@all", "-@scripting"])
    url = fresh_redis.url.replace("redis://", "redis://kvonly:kv-pass@")
    with _store(url, chain) as store:
        assert put_blocks(store, chain.blocks) == 3
        admin.unlink(next(k for k in _keys(admin, chain) if k.endswith(":1")))  # an incomplete value
        assert get_blocks(store, chain.hashes[:1], chain.parents[:1], chain.tokens[:1]) == [None]
        assert _keys(admin, chain) == [], "removed all the same"
        assert store.delete(chain.hashes[1:2]) == 1 and store.stats()["remote_errors"] == 0
    conn = remote_ops.connect(url)
    try:
        assert remote_ops.rm(conn, chain.layout_key, chain.hashes[2:]).removed_keys == 10
    finally:
        conn.close()
    assert admin.dbsize() == 0
    with pytest.raises(redis.exceptions.ResponseError):  # the script was refused: the fallback removed them
        redis.Redis.from_url(url).eval(remote_cas.SCRIPT, 1, "k", b"")
