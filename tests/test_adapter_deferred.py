"""A final insert starts the copies of the prompt's blocks; they reach the tiers at the next cache
call on the same thread (`KVToolPromptCache.settle`), never on another live thread: a fetch finds
them, `close` settles a finished thread's stores, and a reconfiguration or a close drops (and
counts) those of a thread that still runs, releasing their hits' pins."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from kvtool.config import KVToolConfig
from kvtool.prefix import PrefixCache
from kvtool.server import KVToolPromptCache
from tests.test_serve_http import _run

BS = 16


def make(tiny_model, path) -> KVToolPromptCache:
    cfg = KVToolConfig(ssd_cache_dir=path, block_size=BS, ssd_async_writes=False)
    pc = PrefixCache.for_model(tiny_model.model, cfg, model_id=tiny_model.model_id, model_name="tiny")
    return KVToolPromptCache(pc, model_key="M")


@pytest.fixture()
def prompts():
    rng = np.random.default_rng(3)
    shared = [int(t) for t in rng.integers(3, 4000, 40)]
    return [shared + [int(t) for t in rng.integers(3, 4000, 30)] for _ in range(3)]


def serve(adapter, model, prompt) -> None:
    """One request as mlx-lm's server makes it: fetch, prefill, 2 generated tokens, final insert."""
    cache, rest = adapter.fetch_nearest_cache("M", prompt)
    adapter.insert_cache("M", prompt + [5, 6], _run(model, list(rest) + [5, 6], cache), cache_type="assistant")


def pins(adapter) -> int:
    ram = adapter.prefix_cache.tiered.ram
    return sum(e.pins for e in ram._entries.values())


def in_thread(fn) -> threading.Thread:
    t = threading.Thread(target=fn)
    t.start()
    t.join()
    return t


def test_a_fetch_on_the_same_thread_finds_the_blocks_a_final_insert_started(tiny_model, prompts, tmp_path):
    adapter = make(tiny_model, tmp_path)
    try:
        ram = adapter.prefix_cache.tiered.ram
        serve(adapter, tiny_model.model, prompts[0])
        assert len(ram) == 0 and adapter._deferred  # started, not handed over yet
        cache, rest = adapter.fetch_nearest_cache("M", prompts[0])
        assert len(rest) == 1 and len(ram) == 70 // BS + 1  # settled first: a full hit
        assert adapter.stats()["requests"][0]["blocks_stored"] == 70 // BS + 1
    finally:
        adapter.close()


def test_another_thread_never_settles_the_generation_threads_stores(tiny_model, prompts, tmp_path):
    adapter = make(tiny_model, tmp_path)
    go, done = threading.Event(), threading.Event()

    def generation():
        serve(adapter, tiny_model.model, prompts[0])
        go.set()
        done.wait(30)
        adapter.settle()  # the loop goes idle

    gen = threading.Thread(target=generation)
    gen.start()
    try:
        assert go.wait(30)
        st = adapter.stats()  # a handler thread's scrape: nothing of the generation thread's is settled
        assert st["adapter"]["blocks_stored"] == 0 and len(adapter) == 0 and adapter._deferred
        done.set()
        gen.join(30)
        assert adapter.stats()["adapter"]["blocks_stored"] == 70 // BS + 1 and not adapter._deferred
    finally:
        done.set()
        adapter.close()


def test_close_settles_the_stores_of_a_thread_that_ended(tiny_model, prompts, tmp_path):
    adapter = make(tiny_model, tmp_path)
    in_thread(lambda: serve(adapter, tiny_model.model, prompts[0]))
    status = adapter.close()
    assert status.shutdown_clean and adapter.stats()["adapter"]["stores_dropped"] == 0
    again = make(tiny_model, tmp_path)  # a restart: the prompt is on SSD
    try:
        assert again.prefix_cache.probe(prompts[0]) == len(prompts[0])
    finally:
        again.close()


@pytest.mark.parametrize("how", ["reconfigure", "close"])
def test_stores_of_a_running_thread_are_dropped_and_their_pins_released(tiny_model, prompts, tmp_path, how):
    adapter = make(tiny_model, tmp_path)
    go, done = threading.Event(), threading.Event()

    def generation():
        serve(adapter, tiny_model.model, prompts[0])
        serve(adapter, tiny_model.model, prompts[1])  # settles the first (same thread), starts the second
        go.set()
        done.wait(30)

    gen = threading.Thread(target=generation)
    gen.start()
    try:
        assert go.wait(30)
        assert pins(adapter) > 0  # the second request's hit: the shared blocks stay pinned until it settles
        if how == "reconfigure":
            adapter.reconfigure(adapter.prefix_cache.config)
        else:
            adapter.close()
        st = adapter.stats()["adapter"]
        assert st["stores_dropped"] == 1 and st["blocks_stored"] == 70 // BS + 1 and not adapter._deferred
        if how == "reconfigure":
            assert pins(adapter) == 0
            assert adapter.prefix_cache.probe(prompts[0]) == len(prompts[0])  # the settled one was stored
            assert adapter.prefix_cache.probe(prompts[1]) == 40 // BS * BS + 8  # the dropped one was not
    finally:
        done.set()
        gen.join(30)
        adapter.close()
