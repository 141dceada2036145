"""Damaged SSD entries are misses plus clean-up, with unchanged output (issue 2).

Each case: a first engine writes the prompt's blocks; the files are damaged on disk; a new
engine (empty RAM tier, like a restarted process) serves the same prompt. The damaged block and
every block after it must be a miss, the bad entry removed, the matching counter raised, and the
generated tokens equal to mlx-lm's uncached greedy output.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from kvtool.blocks import chain_hashes
from kvtool.config import KVToolConfig
from kvtool.engine import Engine
from kvtool.store.ssd import block_relpath
from tests.test_engine import BS, MAX_TOKENS, reference_tokens

DAMAGED = 2  # index of the damaged block (of 5)


@pytest.fixture(scope="module")
def prompt(tiny_model):
    text = open("kvtool/assets/demo_prompt.txt", encoding="utf-8").read()
    return tiny_model.tokenizer.encode(text)[: 5 * BS + 7]


@pytest.fixture(scope="module")
def reference(tiny_model, prompt):
    return reference_tokens(tiny_model.model, tiny_model.tokenizer, prompt)


def _config(tmp_path, **kw):
    # evict_only + a large RAM budget: the damaged run writes nothing back, so clean-up shows
    return KVToolConfig(ssd_cache_dir=tmp_path / "kv", block_size=BS, ssd_async_writes=False, **kw)


def _populate(tiny_model, prompt, tmp_path):
    eng = Engine(tiny_model, _config(tmp_path))
    eng.generate(prompt, max_tokens=1)
    ns = eng.namespace_dir
    layout = eng.layout_key
    assert eng.close().shutdown_clean
    hashes = chain_hashes(np.asarray(prompt), BS, layout)
    return ns, hashes


def _serve_after_damage(tiny_model, prompt, tmp_path):
    eng = Engine(tiny_model, _config(tmp_path, ssd_policy="evict_only"))
    res = eng.generate(prompt, max_tokens=MAX_TOKENS)
    stats = eng.stats()
    index = eng.tiered.ssd.index
    return eng, res, stats, index


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _flip(path):
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF  # inside the last tensor's bytes
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage,counter", [(_truncate, "ssd_load_corrupt"), (_flip, "ssd_load_corrupt")])
def test_damaged_block_is_a_miss_with_clean_up(tiny_model, prompt, reference, tmp_path, damage, counter):
    ns, hashes = _populate(tiny_model, prompt, tmp_path)
    bad = ns / block_relpath(hashes[DAMAGED])
    damage(bad)
    eng, res, stats, index = _serve_after_damage(tiny_model, prompt, tmp_path)
    assert res.token_ids == reference
    assert res.ssd_hit_tokens == DAMAGED * BS and res.prefill_tokens == len(prompt) - DAMAGED * BS
    assert stats[counter] == 1
    assert not index.contains(hashes[DAMAGED]) and not bad.exists()
    eng.close()


def test_index_row_whose_file_is_gone(tiny_model, prompt, reference, tmp_path):
    ns, hashes = _populate(tiny_model, prompt, tmp_path)
    # (a) gone while a server runs: the lookup finds the row, not the file
    eng = Engine(tiny_model, _config(tmp_path, ssd_policy="evict_only"))
    (ns / block_relpath(hashes[DAMAGED])).unlink()
    res = eng.generate(prompt, max_tokens=MAX_TOKENS)
    assert res.token_ids == reference and res.ssd_hit_tokens == DAMAGED * BS
    stats = eng.stats()
    assert stats["ssd_load_missing"] == 1 and stats["ssd_stale_index_cleaned"] == 1
    assert not eng.tiered.ssd.index.contains(hashes[DAMAGED])
    eng.close()
    # (b) gone before a restart: the startup reconcile drops the row
    (ns / block_relpath(hashes[DAMAGED + 1])).unlink()
    eng = Engine(tiny_model, _config(tmp_path, ssd_policy="evict_only"))
    assert eng.tiered.ssd.reconcile_report.missing_rows_dropped == 1
    res = eng.generate(prompt, max_tokens=MAX_TOKENS)
    assert res.token_ids == reference and res.ssd_hit_tokens == DAMAGED * BS
    eng.close()


def test_block_file_of_another_namespace_is_rejected(tiny_model, prompt, reference, tmp_path):
    ns, hashes = _populate(tiny_model, prompt, tmp_path)
    # Same model and tokens, other block size: another layout key, so another namespace.
    other = Engine(tiny_model, KVToolConfig(ssd_cache_dir=tmp_path / "kv", block_size=2 * BS, ssd_async_writes=False))
    other.generate(prompt, max_tokens=1)
    other_hash = chain_hashes(np.asarray(prompt), 2 * BS, other.layout_key)[1]
    foreign = other.namespace_dir / block_relpath(other_hash)
    assert other.namespace_dir != ns
    other.close()
    shutil.copyfile(foreign, ns / block_relpath(hashes[DAMAGED]))
    eng, res, stats, index = _serve_after_damage(tiny_model, prompt, tmp_path)
    assert res.token_ids == reference
    assert res.ssd_hit_tokens == DAMAGED * BS
    assert stats["ssd_load_corrupt"] == 1
    assert not index.contains(hashes[DAMAGED])
    eng.close()


def test_forced_hash_collision_is_never_served(tiny_model, prompt, reference, tmp_path):
    """Two different prompts whose blocks collide by an injected hash: the stored block's token
    ids differ from the request's, so it is never used and the hash is isolated."""
    def weak_hash(parent: bytes, ids: np.ndarray) -> str:
        return "%032x" % (len(ids) + parent[0])  # depends on nothing but the position

    cfg = _config(tmp_path)
    eng = Engine(tiny_model, cfg, hash_fn=weak_hash)
    other = [t + 1 for t in prompt]
    eng.generate(other, max_tokens=1)
    eng.close()
    eng = Engine(tiny_model, cfg, hash_fn=weak_hash)
    res = eng.generate(prompt, max_tokens=MAX_TOKENS)
    assert res.token_ids == reference and res.cached_tokens == 0
    assert eng.stats()["ssd_hash_collision_detected"] >= 1
    eng.close()
