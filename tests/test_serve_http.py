"""`kvtool serve` (mlx-lm's OpenAI server on kvtool's tiers) and its prompt-cache adapter.

End to end: `kvtool serve` and plain `mlx_lm.server` (the oracle) in subprocesses on the tiny
model, the same requests through the `openai` client; a restart of `kvtool serve` serves the
conversation's prefix from SSD with the oracle's greedy output; SIGHUP reconfigures live; SIGTERM
during a request drains and leaves a cache `kvtool validate` finds clean.
In process: the adapter's protocol (fetch / segment and final inserts / trim / stats) and the
mlx-lm server options it fills in.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from tests.server_procs import REPO, START_TIMEOUT_S, ServerProc, free_port

openai = pytest.importorskip("openai")

DEMO = (REPO / "kvtool" / "assets" / "demo_prompt.txt").read_text()
MAX_TOKENS = 16
REQUEST_LINE = re.compile(
    r"kvtool request (\d+): prompt (\d+) tok \| cached (\d+) \(RAM (\d+), SSD (\d+), remote \d+\) \| prefilled (\d+)"
)


# --------------------------------------------------------------------------- processes
class Proc(ServerProc):
    """A server subprocess (`tests.server_procs.ServerProc`) whose request lines can be read."""

    def requests(self) -> list[tuple[int, ...]]:
        return [tuple(int(g) for g in m.groups()) for m in REQUEST_LINE.finditer(self.text())]


def start_kvtool(tmp: Path, name: str, *extra: str) -> Proc:
    proc = Proc([sys.executable, "-m", "kvtool.cli.app", "serve", "--model", "tiny", "--port", "0",
                 "--cache-dir", str(tmp / "cache"), *extra], tmp / f"{name}.log")
    m = proc.wait_for(r"listening on (http://127\.0\.0\.1:\d+)")
    proc.url = m.group(1)
    return proc


def start_oracle(tmp: Path, model_path: str) -> Proc:
    port = free_port()
    proc = Proc([sys.executable, "-m", "mlx_lm.server", "--model", model_path, "--port", str(port)],
                tmp / "oracle.log")
    proc.url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            with urllib.request.urlopen(proc.url + "/health", timeout=1) as r:
                if r.status == 200:
                    return proc
        except OSError:
            pass
        if proc.p.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"oracle did not start:\n{proc.text()[-3000:]}")
        time.sleep(0.1)


def client(proc: Proc):
    return openai.OpenAI(base_url=proc.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def stats(proc: Proc) -> dict:
    with urllib.request.urlopen(proc.url + "/kvtool/stats", timeout=10) as r:
        return json.loads(r.read())


# --------------------------------------------------------------------------- requests
SYSTEM = "You answer questions about Python's documentation. " + DEMO[:2600]
USERS = ["What does the first paragraph say about modules?", "And what about the second one, in short?",
         "Summarise both answers in one sentence."]


def chat(c, messages, *, stream=False, **kw) -> tuple[str, str, int | None]:
    """(text, finish_reason, cached prompt tokens) of a greedy chat request."""
    args = dict(model="default_model", messages=messages, max_tokens=MAX_TOKENS, temperature=0.0, **kw)
    if not stream:
        r = c.chat.completions.create(**args)
        details = r.usage.prompt_tokens_details
        return r.choices[0].message.content, r.choices[0].finish_reason, details.cached_tokens if details else None
    text, finish, cached = "", None, None
    for chunk in c.chat.completions.create(stream=True, stream_options={"include_usage": True}, **args):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None and chunk.usage.prompt_tokens_details is not None:
            cached = chunk.usage.prompt_tokens_details.cached_tokens
    return text, finish, cached


def complete(c, prompt: str) -> tuple[str, str]:
    r = c.completions.create(model="default_model", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0)
    return r.choices[0].text, r.choices[0].finish_reason


def conversation(replies: list[str], turn: int) -> list[dict]:
    """The messages of `turn` (0-based): system, then user/assistant pairs, then the new user message."""
    msgs = [{"role": "system", "content": SYSTEM}]
    for i in range(turn):
        msgs += [{"role": "user", "content": USERS[i]}, {"role": "assistant", "content": replies[i]}]
    return msgs + [{"role": "user", "content": USERS[turn]}]


def run_turns(c, n_turns: int, *, stream_from: int = 1) -> list[tuple[str, str, int | None]]:
    out, replies = [], []
    for t in range(n_turns):
        res = chat(c, conversation(replies, t), stream=t >= stream_from)
        out.append(res)
        replies.append(res[0])
    return out


def kvtool_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvtool.cli.app", *args], capture_output=True, text=True, cwd=REPO,
                          timeout=60)


# --------------------------------------------------------------------------- end to end
@pytest.mark.slow
def test_serve_matches_mlx_lm_server_across_restart_sighup_and_sigterm(tmp_path):
    model_path = kvtool_cli("model", "path", "tiny").stdout.strip()
    cfg = tmp_path / "kv.toml"
    cfg.write_text("block_size = 64\n")
    oracle = start_oracle(tmp_path, model_path)
    a = None
    try:
        a = start_kvtool(tmp_path, "a", "--config", str(cfg))
        assert "kvtool: reply KV reuse" in a.text() and "kvtool kvtool" not in a.text()  # one prefix per line
        # -- the oracle: plain mlx_lm.server, its own in-memory prompt cache, same requests in the same order
        oc = client(oracle)
        o_completion = complete(oc, DEMO[:400])
        o_turns = run_turns(oc, 3)
        o_seeded = chat(oc, conversation([t[0] for t in o_turns], 2), seed=7)  # seed: mlx-lm's sequential path
        oracle.stop()
        assert all(t[1] in ("length", "stop") and t[0] for t in o_turns)

        # -- process A: cold cache, then RAM hits within the conversation
        ac = client(a)
        assert complete(ac, DEMO[:400]) == o_completion
        a_turns = run_turns(ac, 2)
        assert [t[:2] for t in a_turns] == [t[:2] for t in o_turns[:2]]
        assert a_turns[1][2] > 0  # turn 2 reused turn 1's prompt blocks (usage.cached_tokens)
        reqs = a.requests()
        assert len(reqs) == 3 and reqs[0][2] == 0  # one log line per request; the first one cold
        _, prompt, cached, ram, ssd, prefilled = reqs[2]
        assert cached == ram > 0 and ssd == 0 and prompt == cached + prefilled
        # the handlers tokenized every prompt for the generation thread (same outputs as above)
        assert stats(a)["server"]["prompts_pretokenized"] == 3
        assert a.stop(signal.SIGTERM) == 143
        assert "shutdown_clean=True" in a.text()

        # -- process B: a restart, empty RAM: turn 2 again comes from SSD, greedy output unchanged
        b = start_kvtool(tmp_path, "b", "--config", str(cfg))
        a = b
        bc = client(b)
        replies = [t[0] for t in o_turns]
        assert chat(bc, conversation(replies, 1))[:2] == o_turns[1][:2]
        _, prompt, cached, ram, ssd, prefilled = b.requests()[-1]
        assert ssd > 0 and cached == ram + ssd and prompt == cached + prefilled
        last = stats(b)["requests"][-1]
        assert last["ssd_hit_tokens"] == ssd and stats(b)["cache"]["ssd_load_hits"] > 0
        # turn 3 (streamed): RAM (blocks promoted from SSD) + new blocks; and the seeded (sequential) path
        assert chat(bc, conversation(replies, 2), stream=True)[:2] == o_turns[2][:2]
        assert b.requests()[-1][3] > 0  # RAM hit tokens
        assert chat(bc, conversation(replies, 2), seed=7)[:2] == o_seeded[:2]

        # -- SIGHUP: live reconfiguration under a new layout (block size 32), output unchanged
        old_layout = stats(b)["layout_key"]
        cfg.write_text("block_size = 32\n")
        b.p.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 20
        while stats(b)["block_size"] != 32:
            assert time.monotonic() < deadline, b.text()[-2000:]
            time.sleep(0.05)
        assert stats(b)["layout_key"] != old_layout
        assert chat(bc, conversation(replies, 2))[:2] == o_turns[2][:2]
        assert b.requests()[-1][2] == 0  # the new namespace is empty

        # -- SIGTERM during a request: drained, exit 143, the cache validates clean
        n_before = len(b.requests())
        long_prompt = (DEMO * 2)[:12000]
        errors: list[BaseException] = []

        def in_flight():
            try:
                complete(client(b), long_prompt)
            except BaseException as exc:  # noqa: BLE001 - the server goes away mid-request
                errors.append(exc)

        t = threading.Thread(target=in_flight, daemon=True)
        t.start()
        deadline = time.monotonic() + 20
        while len(b.requests()) == n_before:  # the request's line: fetched, now prefilling
            assert time.monotonic() < deadline, b.text()[-2000:]
            time.sleep(0.01)
        assert b.stop(signal.SIGTERM) == 143
        t.join(30)
        assert "stopped by SIGTERM" in b.text() and "shutdown_clean=True" in b.text()
        res = kvtool_cli("validate", "--cache-dir", str(tmp_path / "cache"), "--json")
        assert res.returncode == 0, res.stdout + res.stderr
        doc = json.loads(res.stdout)
        assert doc["clean"] and len(doc["namespaces"]) == 2
    finally:
        oracle.kill()
        if a is not None:
            a.kill()


@pytest.mark.slow
def test_bad_input_is_one_clean_line(tmp_path):
    for args, needle in ((["--model", "./no/such/model"], "model path not found"),
                         (["--max-kv-size", "64"], "RotatingKVCache"),
                         (["--log-level", "LOUD"], "--log-level"),
                         (["--policy", "sometimes"], "--policy")):
        res = kvtool_cli("serve", "--cache-dir", str(tmp_path), "--port", "0", *args)
        assert res.returncode == 2, res.stderr
        assert needle in res.stderr and "Traceback" not in res.stderr


@pytest.mark.slow
def test_address_in_use_is_refused(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        res = kvtool_cli("serve", "--cache-dir", str(tmp_path), "--port", str(s.getsockname()[1]))
    assert res.returncode == 2 and "cannot listen on" in res.stderr and "Traceback" not in res.stderr


# --------------------------------------------------------------------------- in process
def test_server_options_are_mlx_lm_servers(monkeypatch):
    """Every option mlx_lm.server's parser defines, with the same defaults (guards an mlx-lm upgrade)."""
    import mlx_lm.server as mls

    from kvtool.server.mlx_options import defaults

    seen = {}
    monkeypatch.setattr(mls, "run", lambda host, port, provider: seen.update(vars(provider.cli_args)))
    monkeypatch.setattr(sys, "argv", ["mlx_lm.server"])
    mls.main()
    ours = defaults()
    assert set(ours) == set(seen)
    assert {k: v for k, v in ours.items()} == {k: seen[k] for k in ours}


@pytest.fixture()
def adapter(tiny_model, tmp_path):
    from kvtool.cache.prefix import PrefixCache
    from kvtool.config import KVToolConfig
    from kvtool.server import KVToolPromptCache

    cfg = KVToolConfig(ssd_cache_dir=tmp_path / "cache", block_size=16, ssd_async_writes=False)
    pc = PrefixCache.for_model(tiny_model.model, cfg, model_id=tiny_model.model_id, model_name="tiny")
    cache = KVToolPromptCache(pc, model_key="M", max_pending=2)
    yield cache
    cache.close()


def _run(model, tokens: list[int], cache=None):
    """Prefill `tokens` into `cache` (a fresh one if None), as the server would: returns the cache."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = cache if cache is not None else make_prompt_cache(model)
    model(mx.array([tokens]), cache=cache)
    mx.eval([c.state for c in cache])
    return cache


def test_adapter_protocol_stores_prompt_blocks_only(adapter, tiny_model):
    model = tiny_model.model
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(3, 4000, 70)]
    generated = [5, 6, 7]

    cache, rest = adapter.fetch_nearest_cache("M", prompt)
    assert cache is None and rest == prompt
    # a "system" segment of 40 tokens ends: its 2 full blocks are stored, no tail entry
    seg = _run(model, prompt[:40])
    adapter.insert_cache("M", prompt[:40], seg, cache_type="system")
    assert adapter.stats()["adapter"]["blocks_stored"] == 2
    # the request finishes: prompt + generated tokens in the cache; only the prompt's blocks go in
    full = _run(model, prompt[40:] + generated, seg)
    adapter.insert_cache("M", prompt + generated, full, cache_type="assistant")
    st = adapter.stats()
    assert st["adapter"]["blocks_stored"] == 70 // 16 + 1  # 4 full blocks + the tail entry, no duplicate
    assert st["adapter"]["waiting"] == 0 and len(adapter) == 5 and adapter.nbytes > 0

    # the same prompt again: a full hit, the last token re-forwarded; the cache holds prompt KV only
    cache, rest = adapter.fetch_nearest_cache("M", prompt)
    assert rest == prompt[-1:] and cache[0].offset == 69
    # a longer prompt sharing the prompt: its full blocks and its tail entry hit (tail prefix)
    other = prompt + [9] * 20
    cache2, rest2 = adapter.fetch_nearest_cache("M", other)
    assert rest2 == [9] * 20 and cache2[0].offset == 70
    rec = adapter.stats()["requests"][-1]
    assert rec["cached_tokens"] == rec["ram_hit_tokens"] == 70 and rec["prefill_tokens"] == 20

    # another model key: uncached, nothing stored
    assert adapter.fetch_nearest_cache("other", prompt) == (None, prompt)
    assert adapter.stats()["requests"][-1]["uncached_reason"].startswith("model")

    # max_pending=2: the oldest waiting hit was released (its pins with it)
    st = adapter.stats()["adapter"]
    assert st["waiting"] == 2 and st["waiting_expired"] == 0
    adapter.fetch_nearest_cache("M", [1, 2, 3])
    assert adapter.stats()["adapter"]["waiting"] == 2 and adapter.stats()["adapter"]["waiting_expired"] == 1

    # the longer prompt's request finishes: its new block and tail entry are stored, its pins released
    adapter.insert_cache("M", other + generated, _run(model, rest2 + generated, cache2))
    assert len(adapter) == 7 and adapter.stats()["adapter"]["waiting"] == 1

    # trim_to: least recently used RAM blocks go (mlx-lm's byte accounting: nbytes / len)
    adapter.trim_to(n_sequences=3)
    assert len(adapter) == 3
    adapter.trim_to(n_bytes=0)
    assert len(adapter) == 0 and adapter.nbytes == 0
    assert set(adapter.stats_by_type()) == {"kvtool RAM blocks", "kvtool requests in flight"}


def test_a_segment_of_one_new_block_is_stored_by_the_final_insert(adapter, tiny_model):
    """A warm prompt's last segment (a cached system prompt, then a short user turn) completes one
    new block: its insert stores nothing (no copy of the whole cache before the first token); the
    final insert stores that block with the rest, and the output of a repeat equals the first."""
    model = tiny_model.model
    rng = np.random.default_rng(1)
    system = [int(t) for t in rng.integers(3, 4000, 40)]  # 2 full blocks + 8 tokens
    adapter.fetch_nearest_cache("M", system + [7])
    adapter.insert_cache("M", system + [7, 8], _run(model, system + [7, 8]))
    prompt = system + [int(t) for t in rng.integers(3, 4000, 12)] + [5, 6]  # user turn ends at 52: block 3 completes
    cache, rest = adapter.fetch_nearest_cache("M", prompt)
    assert len(prompt) - len(rest) == 40  # 2 blocks + the 8-token tail entry of the first prompt
    before = adapter.stats()["adapter"]["blocks_stored"]
    seg = _run(model, rest[:-2], cache)
    adapter.insert_cache("M", prompt[:-2], seg, cache_type="user")
    st = adapter.stats()["adapter"]
    assert (st["blocks_stored"], st["inserts_segment_deferred"]) == (before, 1)
    full = _run(model, rest[-2:] + [9], seg)
    adapter.insert_cache("M", prompt + [9], full, cache_type="assistant")
    assert adapter.stats()["adapter"]["blocks_stored"] == before + 2  # block 3 and the 6-token tail entry
    again, rest2 = adapter.fetch_nearest_cache("M", prompt)
    assert rest2 == prompt[-1:] and again[0].offset == len(prompt) - 1  # a full hit
    adapter.insert_cache("M", prompt + [9], _run(model, rest2 + [9], again), cache_type="assistant")
    # a segment that completes two new blocks is stored at once (requests sharing it find it now)
    longer = prompt + [int(t) for t in rng.integers(3, 4000, 40)] + [5, 6]
    cache3, rest3 = adapter.fetch_nearest_cache("M", longer)
    seg3 = _run(model, rest3[:-2], cache3)
    n = adapter.stats()["adapter"]["blocks_stored"]
    adapter.insert_cache("M", longer[:-2], seg3, cache_type="user")
    assert adapter.stats()["adapter"]["blocks_stored"] == n + (len(longer) - 2) // 16 - 3


def test_adapter_skips_caches_it_cannot_slice(adapter, tiny_model):
    model = tiny_model.model
    prompt = list(range(10, 50))
    adapter.fetch_nearest_cache("M", prompt)
    cache = _run(model, prompt)
    quantized = [c.to_quantized(group_size=32, bits=8) for c in cache]  # as with --kv-bits
    adapter.insert_cache("M", prompt + [1], quantized)
    st = adapter.stats()["adapter"]
    assert st["blocks_stored"] == 0 and st["inserts_uncacheable"] == 1 and st["waiting"] == 0
    # an insert nobody waits for (e.g. after a reconfiguration) is ignored
    adapter.insert_cache("M", prompt + [1], cache)
    assert adapter.stats()["adapter"]["inserts_unmatched"] == 1


def test_adapter_interleaved_requests_match_their_own_prompts(adapter, tiny_model):
    """Continuous batching: two requests fetched, finished in the other order, each stored once."""
    model = tiny_model.model
    p1 = list(range(100, 150))
    p2 = p1[:32] + list(range(500, 530))  # shares two blocks with p1
    adapter.fetch_nearest_cache("M", p1)
    adapter.fetch_nearest_cache("M", p2)
    adapter.insert_cache("M", p2 + [1, 2], _run(model, p2 + [1, 2]))
    adapter.insert_cache("M", p1 + [3], _run(model, p1 + [3]))
    st = adapter.stats()["adapter"]
    assert st["inserts_final"] == 2 and st["waiting"] == 0 and st["inserts_unmatched"] == 0
    assert len(adapter) == (62 // 16 + 1) + (50 // 16 + 1 - 2)  # p2's 3 blocks + tail; p1's 1 new block + tail
    cache, rest = adapter.fetch_nearest_cache("M", p1)
    assert rest == p1[-1:] and cache[0].offset == 49
