"""The remote tier shared between hosts, end to end, on real `redis-server` processes.

Host A (its own SSD directory, `remote_policy = write_through`) serves a prompt; host B (an empty
SSD directory, same server) serves it with its tokens from the remote tier, exactly as mlx-lm
would; B's SSD then holds the blocks (`remote_promote`), C with `remote_promote = false` keeps
its SSD empty. The same on a 3-node Redis Cluster and for a sliding-window model, a state-layer
model and 8-bit KV. A corrupted value, a killed server and a stopped server cost misses, never
output: every answer equals mlx-lm's greedy generation without a cache.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from kvtool.config import KVToolConfig
from kvtool.engine import Engine
from tests import redis_servers
from tests.test_families import loaded_family, prompt_for, reference_tokens
from tests.test_families import zoo as zoo  # noqa: F401  (the family zoo fixture)

redis_node, fresh_redis, redis_cluster = redis_servers.redis_node, redis_servers.fresh_redis, redis_servers.redis_cluster

MAX_TOKENS = 8


def long_prompt(tokenizer, n: int = 4100) -> list[int]:
    ids = tokenizer.encode(open("kvtool/assets/demo_prompt.txt", encoding="utf-8").read())
    return [int(t) for t in (ids * (n // len(ids) + 1))[:n]]


def engine(loaded, cache_dir, url, **kw) -> Engine:
    cfg_kw = {k: kw.pop(k) for k in list(kw) if k.startswith("remote_") or k in ("block_size",)}
    cfg = KVToolConfig(ssd_cache_dir=cache_dir, ssd_async_writes=False, remote_url=url, **cfg_kw)
    return Engine(loaded, cfg, **kw)


def serve_once(url: str | None, cache_dir, prompt_file, *extra: str) -> dict:
    """`kvtool serve-once` in a fresh process; the server from $KVTOOL_REMOTE_URL (None: none
    there, e.g. given with --remote-url in `extra`)."""
    env = {k: v for k, v in os.environ.items() if k != "KVTOOL_REMOTE_URL"}
    if url is not None:
        env["KVTOOL_REMOTE_URL"] = url
    r = subprocess.run([sys.executable, "-m", "kvtool.cli.app", "serve-once", "--model", "tiny", "--json",
                        "--max-tokens", str(MAX_TOKENS), "--prompt-file", str(prompt_file), "--ignore-chat-template",
                        "--cache-dir", str(cache_dir), *extra], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout)


@pytest.mark.slow
def test_host_b_serves_host_a_prompt_from_the_remote_tier(tiny_model, redis_node, tmp_path):
    ids = long_prompt(tiny_model.tokenizer)
    text = tiny_model.tokenizer.decode(ids)
    prompt_file = tmp_path / "p.txt"
    prompt_file.write_text(text)
    a = serve_once(redis_node.url, tmp_path / "a", prompt_file)  # host A: prefill, write-through
    n = a["requests"][0]["prompt_tokens"]
    ref = a["requests"][0]["token_ids"]
    b = serve_once(None, tmp_path / "b", prompt_file, "--remote-url", redis_node.url)["requests"][0]  # host B: empty SSD
    assert b["token_ids"] == ref
    assert b["remote_hit_tokens"] >= 0.95 * n and b["cached_tokens"] == b["ram_hit_tokens"] + b["ssd_hit_tokens"] \
        + b["remote_hit_tokens"]
    assert ref == reference_tokens(tiny_model.model, tiny_model.tokenizer, tiny_model.tokenizer.encode(text),
                                   max_tokens=MAX_TOKENS)[: len(ref)]
    again = serve_once("redis://127.0.0.1:1/0", tmp_path / "b", prompt_file)["requests"][0]  # B's SSD, no server
    assert again["ssd_hit_tokens"] >= 0.95 * n and again["token_ids"] == ref
    c_cfg = tmp_path / "c.toml"
    c_cfg.write_text("remote_promote = false\n")  # host C: remote hits stay out of its SSD
    c = serve_once(redis_node.url, tmp_path / "c2", prompt_file, "--config", str(c_cfg))["requests"][0]
    assert c["remote_hit_tokens"] >= 0.95 * n and c["token_ids"] == ref
    assert not list((tmp_path / "c2").rglob("*.safetensors"))


def _share(loaded, ids, url, tmp_path, **kw):
    ref = reference_tokens(loaded.model, loaded.tokenizer, ids,
                           **{k: v for k, v in kw.items() if k.startswith(("kv_", "quantized"))})
    a = engine(loaded, tmp_path / "a", url, **dict(kw))
    assert a.uncached_reason is None, a.uncached_reason
    assert a.generate(ids, max_tokens=MAX_TOKENS).token_ids == ref
    a.close()
    b = engine(loaded, tmp_path / "b", url, **dict(kw))
    res = b.generate(ids, max_tokens=MAX_TOKENS)
    stats = b.stats()
    b.close()
    assert res.token_ids == ref
    # B's SSD got the remote hits (`remote_promote`, written from the request's cache at release):
    # B again without the server serves them from its SSD, equal to mlx-lm
    again = engine(loaded, tmp_path / "b", None, **dict(kw))
    res2 = again.generate(ids, max_tokens=MAX_TOKENS)
    again.close()
    assert res2.token_ids == ref and res2.ssd_hit_tokens > 0 and res2.remote_hit_tokens == 0
    return res, stats


@pytest.mark.slow
def test_sharing_on_a_redis_cluster(tiny_model, redis_cluster, tmp_path):
    ids = long_prompt(tiny_model.tokenizer, 1000)
    res, stats = _share(tiny_model, ids, redis_cluster.url, tmp_path)
    assert res.remote_hit_tokens == len(ids) - 1 and stats["remote_hit_blocks"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("family,kw", [
    ("mistral_swa", {}),  # sliding-window layers
    ("mamba", {}),  # state layers (SSM)
    ("llama", {"kv_bits": 8, "kv_group_size": 32, "quantized_kv_start": 0, "prefill_step_size": 64}),
])
def test_sharing_across_cache_types(zoo, redis_node, tmp_path, family, kw):  # noqa: F811
    loaded = loaded_family(zoo, family)
    ids = prompt_for(loaded)
    res, _ = _share(loaded, ids, redis_node.url, tmp_path, block_size=64, **kw)
    assert res.remote_hit_tokens > 0 and res.cached_tokens == res.remote_hit_tokens


@pytest.mark.slow
def test_corrupt_remote_value_is_a_miss_and_deleted(tiny_model, redis_node, tmp_path):
    ids = long_prompt(tiny_model.tokenizer, 600)
    ref = reference_tokens(tiny_model.model, tiny_model.tokenizer, ids, max_tokens=MAX_TOKENS)
    a = engine(tiny_model, tmp_path / "a", redis_node.url, block_size=64)
    a.generate(ids, max_tokens=MAX_TOKENS)
    a.close()
    client = redis_node.client()
    keys = sorted(client.scan_iter(match=f"kvtool:*:{a.layout_key}:*"))
    victim = keys[len(keys) // 2]
    client.setrange(victim, client.strlen(victim) // 2, b"\x00\xff")
    corrupt = client.get(victim)
    b = engine(tiny_model, tmp_path / "b", redis_node.url, block_size=64)
    res = b.generate(ids, max_tokens=MAX_TOKENS)
    stats = b.stats()
    b.close()
    assert res.token_ids == ref and stats["remote_corrupt"] >= 1 and res.cached_tokens < len(ids) - 1
    assert client.get(victim) != corrupt  # deleted; B's recomputed block was written through in its place


@pytest.mark.slow
def test_killed_and_stopped_server_cost_misses_never_output(tiny_model, fresh_redis, tmp_path):
    ids = long_prompt(tiny_model.tokenizer, 600)
    ref = reference_tokens(tiny_model.model, tiny_model.tokenizer, ids, max_tokens=MAX_TOKENS)
    a = engine(tiny_model, tmp_path / "a", fresh_redis.url, block_size=64)
    a.generate(ids, max_tokens=MAX_TOKENS)
    a.close()
    fresh_redis.proc.send_signal(signal.SIGSTOP)  # a stalled server: every call ends at its deadline
    try:
        b = engine(tiny_model, tmp_path / "b", fresh_redis.url, block_size=64)
        t0 = time.monotonic()
        res = b.generate(ids, max_tokens=MAX_TOKENS)
        assert res.token_ids == ref and res.remote_hit_tokens == 0
        assert time.monotonic() - t0 < 30  # generous: deadlines are 250 ms, no hang
        b.close()
    finally:
        fresh_redis.proc.send_signal(signal.SIGCONT)
    port = fresh_redis.port
    fresh_redis.proc.kill()  # SIGKILL: the values are gone with it (no persistence)
    fresh_redis.proc.wait()
    c = engine(tiny_model, tmp_path / "c", fresh_redis.url, block_size=64)
    assert c.generate(ids, max_tokens=MAX_TOKENS).token_ids == ref
    fresh_redis.start(port)  # back: once C's circuit breaker lets calls through, C writes through again
    client = fresh_redis.client()
    deadline = time.monotonic() + 60
    k = 0
    while not any(client.scan_iter(match=f"kvtool:*:{c.layout_key}:*", count=1000)):
        assert time.monotonic() < deadline, "the remote tier never came back"
        k += 1
        c.generate(ids[64 * k :], max_tokens=1)  # a new chain each time: new blocks to write through
        c.flush()
        time.sleep(0.5)
    c.close()
    other = ids[64 * k :]
    d = engine(tiny_model, tmp_path / "d", fresh_redis.url, block_size=64)
    res = d.generate(other, max_tokens=MAX_TOKENS)
    d.close()
    assert res.remote_hit_tokens > 0
    assert res.token_ids == reference_tokens(tiny_model.model, tiny_model.tokenizer, other, max_tokens=MAX_TOKENS)


@pytest.mark.slow
def test_warm_to_remote_and_remote_push_start_another_host_warm(tiny_model, redis_node, tmp_path):
    """`warm --to-remote` pushes what it warmed; `remote push` pushes an SSD cache written without
    a remote tier; either way host B serves the prompt from the remote tier, exactly."""
    from kvtool.config import KVToolConfig

    ids = long_prompt(tiny_model.tokenizer, 700)
    text = tiny_model.tokenizer.decode(ids)
    (tmp_path / "p.txt").write_text(text)
    env = dict(os.environ, KVTOOL_REMOTE_URL=redis_node.url, KVTOOL_REMOTE_POLICY="off")  # only the push writes
    r = subprocess.run([sys.executable, "-m", "kvtool.cli.app", "warm", str(tmp_path / "p.txt"), "--model", "tiny",
                        "--whole", "--ignore-chat-template", "--cache-dir", str(tmp_path / "a"), "--to-remote", "--json"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "pushed to redis://127.0.0.1" in r.stderr and json.loads(r.stdout)["schema_version"]
    b = serve_once(redis_node.url, tmp_path / "b", tmp_path / "p.txt")["requests"][0]
    assert b["remote_hit_tokens"] > 0 and b["prefill_tokens"] <= 64
    # an SSD cache filled with no remote tier at all, pushed afterwards
    eng = Engine(tiny_model, KVToolConfig(ssd_cache_dir=tmp_path / "c", ssd_async_writes=False, remote_url=None))
    other = ids[100:]
    eng.generate(other, max_tokens=1)
    eng.close()
    env.pop("KVTOOL_REMOTE_POLICY")
    r = subprocess.run([sys.executable, "-m", "kvtool.cli.app", "remote", "push", "--cache-dir", str(tmp_path / "c"),
                        "--json"], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    (ns,) = json.loads(r.stdout)["namespaces"]
    assert ns["blocks_read"] == ns["blocks_stored"] > 0 and ns["bad_records"] == 0
    d = engine(tiny_model, tmp_path / "d", redis_node.url)
    res = d.generate(other, max_tokens=MAX_TOKENS)
    d.close()
    assert res.remote_hit_tokens == len(other) - 1
    assert res.token_ids == reference_tokens(tiny_model.model, tiny_model.tokenizer, other, max_tokens=MAX_TOKENS)


@pytest.mark.slow
def test_server_killed_mid_write_costs_nothing_locally(tiny_model, fresh_redis, tmp_path):
    """Host A writes through to a server that stalls (SIGSTOP) and is then killed (SIGKILL) while
    A's remote writes are in flight: A's request is exact, A shuts down, its SSD tier lost nothing."""
    ids = long_prompt(tiny_model.tokenizer, 900)
    ref = reference_tokens(tiny_model.model, tiny_model.tokenizer, ids, max_tokens=MAX_TOKENS)
    a = engine(tiny_model, tmp_path / "a", fresh_redis.url, block_size=64)
    fresh_redis.proc.send_signal(signal.SIGSTOP)
    try:
        assert a.generate(ids, max_tokens=MAX_TOKENS).token_ids == ref  # the writes queue behind a stalled server
    finally:
        fresh_redis.proc.kill()
        fresh_redis.proc.wait()
    assert a.close().shutdown_clean
    local = engine(tiny_model, tmp_path / "a", None, block_size=64)  # the same SSD directory, no remote tier
    res = local.generate(ids, max_tokens=MAX_TOKENS)
    local.close()
    assert res.token_ids == ref and res.ssd_hit_tokens == len(ids) - 1
