"""`kvtool remote inspect|validate|rm|prune`, `kvtool inspect|validate|prune|rm --remote` and
`kvtool.ops.remote_ops` against real redis-server processes: JSON and human output, repairs,
removal, budgets and idle times, one `error:` line for bad URLs, unreachable hosts, wrong
passwords and TLS failures (the password never printed), and for serving one warning and no tier
(the answer exact); the config's remote fields; and writers in 4 processes beside prune /
validate loops (no error, every readable value verifies)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvtool.cli import app as app_module
from kvtool.cli import removal
from kvtool.config import ConfigError, KVToolConfig
from kvtool.ops import remote_ops
from kvtool.tiers import remote_value as rv
from kvtool.tiers.remote_store import RemoteStore
from tests import redis_servers
from tests.redis_servers import AUTH_PASSWORD, free_port, get_blocks, make_chain, put_blocks

redis_node, redis_auth, redis_cluster = redis_servers.redis_node, redis_servers.redis_auth, redis_servers.redis_cluster
fresh_redis = redis_servers.fresh_redis

REPO = Path(__file__).resolve().parent.parent
if not app_module.app.registered_commands:
    app_module._register()
runner = CliRunner()


def _kvtool(*args: str, env: dict[str, str] | None = None, input: str | None = None):
    return runner.invoke(app_module.app, list(args), input=input, env={"COLUMNS": "200", "KVTOOL_REMOTE_URL": "",
                                                                       "KVTOOL_REMOTE_PASSWORD": "", **(env or {})})  # fmt: skip


def _json(result) -> dict:
    assert result.exit_code in (0, 1), (result.exit_code, result.output, result.exception)
    return json.loads(result.stdout)


def _one_error_line(result, *needles: str) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.output and AUTH_PASSWORD not in result.output
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def _fill(url: str, chain, **kw) -> None:
    with RemoteStore(url, chain.layout_key, chain.kv, timeout_s=2.0, **kw) as store:
        assert put_blocks(store, chain.blocks) == len(chain.blocks)


def _split_chain(model_id: str, n: int = 2, seed: int = 0):
    return make_chain(n, model_id=model_id, dtype="float32", head_dim=64, block_size=16, seed=seed)


# ----------------------------------------------------------------------------- inspect
@pytest.mark.slow
def test_inspect_json_and_human(redis_node):
    a, b = make_chain(5, model_id="cli-inspect-a", seed=1), _split_chain("cli-inspect-b")
    _fill(redis_node.url, a)
    _fill(redis_node.url, b, max_value_bytes=4096)
    doc = _json(_kvtool("remote", "inspect", "--url", redis_node.url, "--json"))
    assert doc["schema_version"] == 1 and doc["url"] == redis_node.url and not doc["cluster"]
    by_ns = {ns["namespace"]: ns for ns in doc["namespaces"]}
    assert by_ns[a.layout_key]["blocks"] == 5 and by_ns[a.layout_key]["parts"] == 0 and by_ns[a.layout_key]["bytes"] > 0
    assert by_ns[b.layout_key]["blocks"] == 2 and by_ns[b.layout_key]["split_values"] == 2 and by_ns[b.layout_key]["parts"] >= 6
    assert doc["servers"][0]["used_memory"] > 0 and "maxmemory_policy" in doc["servers"][0]
    one = _json(_kvtool("remote", "inspect", "--url", redis_node.url, "--namespace", a.layout_key[:8], "--json"))
    assert [ns["namespace"] for ns in one["namespaces"]] == [a.layout_key]
    human = _kvtool("remote", "inspect", "--url", redis_node.url)
    assert human.exit_code == 0 and a.layout_key in human.stdout and "redis 6." in human.stdout


@pytest.mark.slow
def test_inspect_cluster(redis_cluster):
    chain = make_chain(9, model_id="cli-inspect-cluster", seed=2)
    _fill(redis_cluster.url, chain)
    doc = _json(_kvtool("remote", "inspect", "--url", redis_cluster.url, "--json"))
    assert doc["cluster"] and len(doc["servers"]) == 3
    assert {ns["namespace"]: ns["blocks"] for ns in doc["namespaces"]}[chain.layout_key] == 9


# ----------------------------------------------------------------------------- validate
@pytest.mark.slow
def test_validate_finds_and_deletes_bad_values(fresh_redis):
    chain = make_chain(6, model_id="cli-validate", seed=3)
    split = _split_chain("cli-validate-split", seed=4)
    _fill(fresh_redis.url, chain)
    _fill(fresh_redis.url, split, max_value_bytes=4096)
    client = fresh_redis.client()
    k0, k1 = rv.value_key(chain.layout_key, chain.hashes[0]), rv.value_key(chain.layout_key, chain.hashes[1])
    client.setrange(k0, client.strlen(k0) - 2, b"\x00\x01")  # a flipped record byte
    client.set(k1, client.get(rv.value_key(chain.layout_key, chain.hashes[2])))  # another chain entry's value
    orphan = rv.part_key(rv.value_key(split.layout_key, split.hashes[0]), "00000000deadbeef", 0)
    client.set(orphan, b"x" * 100)
    k3 = rv.value_key(chain.layout_key, chain.hashes[3])
    client.set(k3, b"")  # an empty string is a value gone bad, not one that vanished
    for ns in (chain.layout_key, split.layout_key):
        dry = _kvtool("remote", "validate", "--url", fresh_redis.url, "--namespace", ns, "--dry-run", "--json")
        assert dry.exit_code == 1
    doc = _json(dry)
    assert doc["orphan_parts"] == 1 and doc["removed_keys"] == 0 and client.exists(orphan)
    res = _kvtool("remote", "validate", "--url", fresh_redis.url, "--json")
    assert res.exit_code == 1
    doc = _json(res)
    assert {p["key"] for p in doc["problems"]} == {k0, k1, k3} and doc["orphan_parts"] == 1 and doc["vanished"] == 0
    assert doc["ok"] == 3 + 2 and doc["removed_keys"] == 4
    assert not any(client.exists(k) for k in (k0, k1, k3, orphan))
    again = _kvtool("remote", "validate", "--url", fresh_redis.url)
    assert again.exit_code == 0, again.output
    assert "0 failed" in again.stdout


@pytest.mark.slow
def test_validate_a_key_of_another_type_first_in_its_batch(fresh_redis):
    """A list under a value key that sorts before the namespace's split value: one problem (the
    handler must not see a manifest that is not its own, nor none at all), the parts kept."""
    split = _split_chain("cli-validate-wrongtype", seed=5)
    _fill(fresh_redis.url, split, max_value_bytes=4096)
    client = fresh_redis.client()
    first = rv.value_key(split.layout_key, "0" * 32)
    client.rpush(first, b"x")
    res = _kvtool("remote", "validate", "--url", fresh_redis.url, "--json")
    doc = _json(res)
    assert res.exit_code == 1 and [p["key"] for p in doc["problems"]] == [first] and doc["ok"] == 2
    assert not client.exists(first) and doc["removed_keys"] == 1
    assert _kvtool("remote", "validate", "--url", fresh_redis.url).exit_code == 0


# ----------------------------------------------------------------------------- rm
@pytest.mark.slow
def test_rm_namespace_and_hashes(redis_node, monkeypatch):
    chain = make_chain(4, model_id="cli-rm", seed=5)
    split = _split_chain("cli-rm-split", seed=6)
    _fill(redis_node.url, chain)
    _fill(redis_node.url, split, max_value_bytes=4096)
    client = redis_node.client()
    _one_error_line(_kvtool("remote", "rm", "--url", redis_node.url, "--namespace", chain.layout_key), "--yes")
    dry = _json(_kvtool("remote", "rm", "--url", redis_node.url, "--namespace", chain.layout_key[:10], "--dry-run", "--json"))
    assert dry["values"] == 4 and dry["keys"] == 4 and dry["removed_keys"] == 0
    assert len(list(client.scan_iter(match=f"*{chain.layout_key}*"))) == 4
    with monkeypatch.context() as m:  # declined on a terminal: said so, exit 1, nothing removed
        m.setattr(removal, "interactive", lambda: True)
        res = _kvtool("remote", "rm", "--url", redis_node.url, "--namespace", chain.layout_key, input="n\n")
    assert res.exit_code == 1 and "aborted: nothing changed" in res.output and "Remove 4 block(s)" in res.output
    assert len(list(client.scan_iter(match=f"*{chain.layout_key}*"))) == 4
    one = _json(_kvtool("remote", "rm", "--url", redis_node.url, "--namespace", split.layout_key, "--hash", split.hashes[0],
                        "--yes", "--json"))  # fmt: skip
    assert one["values"] == 1 and one["keys"] >= 4 and one["removed_keys"] == one["keys"]
    assert not list(client.scan_iter(match=f"*{split.hashes[0]}*")) and list(client.scan_iter(match=f"*{split.hashes[1]}*"))
    done = _json(_kvtool("remote", "rm", "--url", redis_node.url, "--namespace", chain.layout_key, "--yes", "--json"))
    assert done["removed_keys"] == 4 and not list(client.scan_iter(match=f"*{chain.layout_key}*"))
    _one_error_line(_kvtool("remote", "rm", "--url", redis_node.url, "--namespace", "f" * 32 + "0", "--yes"), "namespace")
    _one_error_line(_kvtool("remote", "rm", "--url", redis_node.url, "--namespace", "zz", "--yes"), "namespace")
    _one_error_line(_kvtool("remote", "rm", "--url", redis_node.url, "--namespace", chain.layout_key, "--hash", "nothex",
                            "--yes"), "chain hash")  # fmt: skip


# ----------------------------------------------------------------------------- prune
@pytest.mark.slow
def test_prune_budget_and_idle(fresh_redis):
    a, b = make_chain(10, model_id="cli-prune-a", seed=7), make_chain(10, model_id="cli-prune-b", seed=8)
    _fill(fresh_redis.url, a)
    _fill(fresh_redis.url, b)
    conn = remote_ops.connect(fresh_redis.url)
    try:
        per_value = remote_ops.inspect(conn).namespaces[0].bytes // 10
        budget = per_value * 4
        dry = _json(_kvtool("remote", "prune", "--url", fresh_redis.url, "--max-bytes", str(budget), "--dry-run", "--json"))
        assert dry["values"] >= 12 and dry["removed_keys"] == 0 and set(dry["per_namespace"]) == {a.layout_key, b.layout_key}
        _one_error_line(_kvtool("remote", "prune", "--url", fresh_redis.url, "--max-bytes", str(budget)), "--yes")
        _one_error_line(_kvtool("remote", "prune", "--url", fresh_redis.url, "--yes"), "--idle")
        _one_error_line(_kvtool("remote", "prune", "--url", fresh_redis.url, "--idle", "7", "--yes"), "--idle")
        done = _json(_kvtool("remote", "prune", "--url", fresh_redis.url, "--max-bytes", str(budget), "--namespace",
                             a.layout_key, "--yes", "--json"))  # fmt: skip
        assert done["removed_keys"] == done["keys"] >= 6 and list(done["per_namespace"]) == [a.layout_key]
        sizes = {ns.namespace: ns.bytes for ns in remote_ops.inspect(conn).namespaces}
        assert sizes[a.layout_key] <= budget and sizes[b.layout_key] > budget
        time.sleep(4)  # Redis' LRU clock has a 1 s resolution
        with RemoteStore(fresh_redis.url, b.layout_key, b.kv, timeout_s=2.0) as store:
            assert all(get_blocks(store, b.hashes[:3], b.parents[:3], b.tokens[:3]))  # used now: kept
        report = remote_ops.prune(conn, idle_s=3.0)
        assert report.values == 7 + (10 - done["values"]) and report.removed_keys == report.keys
        left = remote_ops.inspect(conn).namespaces
        assert [(ns.namespace, ns.blocks) for ns in left] == [(b.layout_key, 3)]
    finally:
        conn.close()


# ----------------------------------------------------------------------------- bad input
@pytest.mark.slow
def test_bad_urls_unreachable_hosts_wrong_passwords_tls_are_one_error_line(redis_auth, redis_node):
    _one_error_line(_kvtool("remote", "inspect", "--url", f"http://:{AUTH_PASSWORD}@host"), "scheme", "***")
    _one_error_line(_kvtool("remote", "inspect", "--url", f"redis://:{AUTH_PASSWORD}@host:99999"), "***")
    _one_error_line(_kvtool("remote", "inspect"), "no remote server")
    _one_error_line(_kvtool("remote", "inspect", "--url", f"redis://127.0.0.1:{free_port()}", "--timeout", "500ms"),
                    "cannot connect")  # fmt: skip
    _one_error_line(_kvtool("remote", "inspect", "--url", redis_node.url, "--timeout", "2"), "--timeout")
    wrong = f"redis://:{AUTH_PASSWORD}x@127.0.0.1:{redis_auth.port}/0"
    _one_error_line(_kvtool("remote", "validate", "--url", wrong), "authentication")
    _one_error_line(_kvtool("remote", "inspect", env={"KVTOOL_REMOTE_URL": f"redis://127.0.0.1:{redis_auth.port}",
                                                      "KVTOOL_REMOTE_PASSWORD": AUTH_PASSWORD + "x"}), "authentication")  # fmt: skip
    _one_error_line(_kvtool("remote", "inspect", "--url", f"redis://127.0.0.1:{redis_auth.port}"), "authentication")
    _one_error_line(_kvtool("remote", "inspect", "--url", f"rediss://:{AUTH_PASSWORD}@127.0.0.1:{redis_node.port}?ssl_cert_reqs=none",
                            "--timeout", "1s"), "TLS")  # fmt: skip
    _one_error_line(_kvtool("remote", "inspect", "--url", redis_node.url, "--cluster"), "cluster")
    # the same through the ordinary commands' --remote / --remote-url
    _one_error_line(_kvtool("inspect", "--remote-url", f"http://:{AUTH_PASSWORD}@host"), "scheme", "***")
    _one_error_line(_kvtool("inspect", "--remote"), "no remote server", "--remote-url")
    _one_error_line(_kvtool("validate", "--remote-url", f"redis://127.0.0.1:{free_port()}"), "cannot connect")
    _one_error_line(_kvtool("prune", "--remote", "--max-bytes", "1GB", "--yes",
                            env={"KVTOOL_REMOTE_URL": f"redis://127.0.0.1:{redis_auth.port}",
                                 "KVTOOL_REMOTE_PASSWORD": AUTH_PASSWORD + "x"}), "authentication")  # fmt: skip
    _one_error_line(_kvtool("rm", "0123abcd", "--remote-url", wrong, "--yes"), "authentication")
    _one_error_line(_kvtool("inspect", "--remote-url", f"rediss://:{AUTH_PASSWORD}@127.0.0.1:{redis_node.port}"
                            "?ssl_cert_reqs=none"), "TLS", "***")  # fmt: skip
    ok = _kvtool("remote", "inspect", "--json", env={"KVTOOL_REMOTE_URL": f"redis://127.0.0.1:{redis_auth.port}",
                                                     "KVTOOL_REMOTE_PASSWORD": AUTH_PASSWORD})  # fmt: skip
    assert ok.exit_code == 0 and AUTH_PASSWORD not in ok.output
    shown = _json(_kvtool("remote", "inspect", "--url", redis_auth.url, "--json"))
    assert shown["url"] == f"redis://:***@127.0.0.1:{redis_auth.port}/0" and AUTH_PASSWORD not in json.dumps(shown)


@pytest.mark.slow
def test_serving_with_a_tls_url_on_a_plain_server_warns_once_and_answers_exactly(tiny_model, redis_node, tmp_path):
    from tests.test_families import reference_tokens

    url = f"rediss://:{AUTH_PASSWORD}@127.0.0.1:{redis_node.port}/0?ssl_cert_reqs=none"
    text = "The remote tier is off when its server does not speak TLS."
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTOOL_REMOTE")}
    r = subprocess.run([sys.executable, "-m", "kvtool.cli.app", "serve-once", "--model", "tiny", "--json", "-n", "6",
                        "--prompt", text, "--ignore-chat-template", "--cache-dir", str(tmp_path / "c"), "--remote-url", url],
                       capture_output=True, text=True, env={**env, "COLUMNS": "200"}, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert AUTH_PASSWORD not in r.stdout + r.stderr and "Traceback" not in r.stderr
    assert r.stderr.count("WARNING") == 1 and "TLS" in r.stderr and "***" in r.stderr, r.stderr
    doc = json.loads(r.stdout)
    res = doc["requests"][0]
    assert res["remote_hit_tokens"] == 0 and doc["stats"]["remote_bytes_written"] == 0
    ids = tiny_model.tokenizer.encode(text)
    assert res["token_ids"] == reference_tokens(tiny_model.model, tiny_model.tokenizer, ids, max_tokens=6)[:6]


# ----------------------------------------------------------------------------- --remote on the ordinary commands
@pytest.mark.slow
def test_inspect_validate_prune_rm_take_remote(fresh_redis, tmp_path):
    url = fresh_redis.url
    a, b = make_chain(6, model_id="cli-flag-a", seed=11), _split_chain("cli-flag-b", seed=12)
    _fill(url, a)
    _fill(url, b, max_value_bytes=4096)
    client = fresh_redis.client()
    conf = tmp_path / "kvtool.toml"
    conf.write_text(f'remote_url = "{url}"\n')

    def namespaces(doc: dict) -> dict:
        return {ns["namespace"]: (ns["blocks"], ns["split_values"], ns["parts"]) for ns in doc["namespaces"]}

    sub = _json(_kvtool("remote", "inspect", "--url", url, "--json"))
    for how in (("--remote-url", url), ("--remote", "--config", str(conf))):
        assert namespaces(_json(_kvtool("inspect", *how, "--json"))) == namespaces(sub)
    by_env = _json(_kvtool("inspect", "--remote", "--namespace", a.layout_key[:6], "--json", env={"KVTOOL_REMOTE_URL": url}))
    assert namespaces(by_env) == {a.layout_key: (6, 0, 0)} and by_env["url"] == url
    human = _kvtool("inspect", "--remote-url", url)
    assert human.exit_code == 0 and a.layout_key in human.stdout and "key(s) scanned" in human.stdout
    _one_error_line(_kvtool("inspect", "--remote-url", url, "--sort", "size"), "--sort", "--remote")
    _one_error_line(_kvtool("validate", "--remote-url", url, "--deep"), "--deep")

    k0 = rv.value_key(a.layout_key, a.hashes[0])
    client.setrange(k0, client.strlen(k0) - 2, b"\x00\x01")  # a flipped record byte
    dry = _kvtool("validate", "--remote-url", url, "--dry-run", "--json")
    assert dry.exit_code == 1 and [p["key"] for p in _json(dry)["problems"]] == [k0] and client.exists(k0)
    quiet = _kvtool("validate", "--remote", "--quiet", env={"KVTOOL_REMOTE_URL": url})
    assert quiet.exit_code == 1 and quiet.stdout == "" and "1 failed" in quiet.stderr and not client.exists(k0)
    clean = _kvtool("validate", "--remote-url", url, "--quiet")
    assert clean.exit_code == 0 and clean.stdout == clean.stderr == ""

    kept = _json(_kvtool("prune", "--remote-url", url, "--dry-run", "--json"))  # default TTL (7d): nothing idle that long
    assert kept["values"] == 0 and kept["kept_values"] == 5 + 2
    _one_error_line(_kvtool("prune", "--remote-url", url, "--ttl", "none", "--yes"), "--ttl, --max-bytes")
    _one_error_line(_kvtool("prune", "--remote-url", url, "--max-bytes", "1MB", "--all", "--yes"), "--all")
    _one_error_line(_kvtool("prune", "--remote-url", url, "--max-bytes", "1"), "--yes")
    pruned = _json(_kvtool("prune", "--remote-url", url, "--ttl", "none", "--max-bytes", "1", "--namespace", b.layout_key,
                           "--yes", "--json"))  # fmt: skip
    assert pruned["values"] == 2 and pruned["removed_keys"] == pruned["keys"] >= 6
    assert not list(client.scan_iter(match=f"*{b.layout_key}*"))

    _one_error_line(_kvtool("rm", a.layout_key[:8], "--remote-url", url), "--yes")
    _one_error_line(_kvtool("rm", a.layout_key[:4], "--remote-url", url, "--yes"), "too short")
    dry_rm = _json(_kvtool("rm", a.layout_key[:8], "--remote", "--config", str(conf), "--dry-run", "--json"))
    assert dry_rm["values"] == 5 and dry_rm["removed_keys"] == 0 and dry_rm["namespace"] == a.layout_key
    done = _json(_kvtool("rm", a.layout_key[:8], "--remote-url", url, "--yes", "--json"))
    assert done["removed_keys"] == 5 and not list(client.scan_iter(match="kvtool:*"))


@pytest.mark.slow
def test_rm_remote_removes_a_prompts_blocks(tiny_model, redis_node, tmp_path):
    from kvtool.engine import Engine

    text = open("kvtool/assets/demo_prompt.txt", encoding="utf-8").read()[:1500]
    eng = Engine(tiny_model, KVToolConfig(ssd_cache_dir=tmp_path / "c", ssd_async_writes=False, remote_url=redis_node.url,
                                          block_size=32))  # fmt: skip
    try:
        eng.generate(eng.encode(prompt=text), max_tokens=2)
        other = eng.encode(prompt="An unrelated prompt about sailing boats. " * 8)
        eng.generate(other, max_tokens=2)
        eng.flush()
        layout = eng.layout_key
    finally:
        eng.close()
    client = redis_node.client()
    before = len(list(client.scan_iter(match=f"kvtool:*:{layout}:*")))
    assert before > 4
    doc = _json(_kvtool("rm", "--remote-url", redis_node.url, "--model", "tiny", "--prompt", text, "--ignore-chat-template",
                        "--block-size", "32", "--yes", "--json"))  # fmt: skip
    full_blocks = len(tiny_model.tokenizer.encode(text)) // 32
    assert doc["namespace"] == layout and full_blocks - 1 <= doc["values"] <= full_blocks + 1
    assert doc["removed_keys"] == doc["keys"]
    left = len(list(client.scan_iter(match=f"kvtool:*:{layout}:*")))
    assert 0 < left == before - doc["keys"]  # the other prompt's blocks stay
    again = _json(_kvtool("rm", "--remote-url", redis_node.url, "--model", "tiny", "--prompt", text, "--ignore-chat-template",
                          "--block-size", "32", "--yes", "--json"))  # fmt: skip
    assert again["values"] == 0 and again["removed_keys"] == 0


def test_config_remote_fields(monkeypatch):
    cfg = KVToolConfig(remote_url=f"redis://:{AUTH_PASSWORD}@h:6379/0", remote_ttl="7d", remote_timeout="100ms",
                       remote_policy="on_evict", remote_cluster=True, remote_promote=False)  # fmt: skip
    assert cfg.remote_enabled and cfg.remote_ttl_s == 7 * 86400 and cfg.remote_timeout_s == 0.1
    assert AUTH_PASSWORD not in repr(cfg)
    assert KVToolConfig().remote_timeout_s == 0.25 and KVToolConfig().remote_ttl_s is None
    assert not KVToolConfig(remote_url="redis://h", remote_policy="off").remote_enabled
    monkeypatch.setenv("KVTOOL_REMOTE_URL", "redis+cluster://h:7000")
    assert KVToolConfig().remote_url == "redis+cluster://h:7000"
    for field, value, needle in [("remote_url", f"redis://:{AUTH_PASSWORD}@h:99999", r"\*\*\*"), ("remote_url", 5, "URL"),
                                 ("remote_timeout", "250", "no unit"), ("remote_timeout", "2m", "60s"),
                                 ("remote_ttl", "7", "no unit"), ("remote_policy", "sometimes", "write_through")]:  # fmt: skip
        with pytest.raises(ConfigError, match=needle) as err:
            KVToolConfig(**{field: value})
        assert AUTH_PASSWORD not in str(err.value) and err.value.field == field


# ----------------------------------------------------------------------------- concurrency
WORKER = r"""
import json, sys, time
import numpy as np
from kvtool.tiers.remote_store import RemoteStore
from tests.redis_servers import get_blocks, make_chain, put_blocks, same_block
url, worker, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
chains = [make_chain(12, model_id="concurrent", seed=s) for s in range(3)]          # shared by every worker
chains += [make_chain(2, model_id="concurrent-split", dtype="float32", head_dim=64, block_size=16, seed=s) for s in range(2)]
store = RemoteStore(url, chains[0].layout_key, chains[0].kv, timeout_s=2.0)
split = RemoteStore(url, chains[3].layout_key, chains[3].kv, timeout_s=2.0, max_value_bytes=4096)
bad = rounds = hits = 0
deadline = time.monotonic() + seconds
while time.monotonic() < deadline and rounds < 10_000:
    rounds += 1
    c = chains[(rounds + worker) % len(chains)]
    s = split if c.layout_key == chains[3].layout_key else store
    put_blocks(s, c.blocks[: 1 + (rounds * 7 + worker) % len(c.blocks)])
    got = get_blocks(s, c.hashes, c.parents, c.tokens, stop_at_miss=False)
    hits += sum(g is not None for g in got)
    bad += sum(1 for g, b in zip(got, c.blocks) if g is not None and not same_block(g, b))
print(json.dumps({"rounds": rounds, "hits": hits, "bad": bad,
                  "errors": store.stats()["remote_errors"] + split.stats()["remote_errors"],
                  "corrupt": store.stats()["remote_corrupt"] + split.stats()["remote_corrupt"]}))
"""


@pytest.mark.slow  # ~10 s: 4 writer processes for 6 s
def test_writers_in_four_processes_beside_prune_and_validate(fresh_redis):
    seconds = 6.0
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, fresh_redis.url, str(w), str(seconds)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for w in range(4)]  # fmt: skip
    conn = remote_ops.connect(fresh_redis.url)
    loops = 0
    try:
        deadline = time.monotonic() + seconds + 30
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline and loops < 5000:
            loops += 1
            remote_ops.prune(conn, max_bytes=30_000)  # removes values under the writers' feet
            report = remote_ops.validate(conn)
            assert not report.problems, report.problems
        results = []
        for p in procs:
            out, err = p.communicate(timeout=60)
            assert p.returncode == 0, err[-3000:]
            results.append(json.loads(out.strip().splitlines()[-1]))
        final = remote_ops.validate(conn, dry_run=True)
    finally:
        conn.close()
        for p in procs:
            if p.poll() is None:
                p.kill()
    print(f"{loops} prune+validate loops beside", results)
    assert loops >= 2
    assert all(r["bad"] == 0 and r["errors"] == 0 and r["corrupt"] == 0 for r in results), results
    assert sum(r["hits"] for r in results) > 0
    assert not final.problems and final.orphan_parts == 0 and final.checked == final.ok + final.incomplete
