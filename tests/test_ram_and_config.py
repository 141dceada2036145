"""RAM tier (LRU, byte budget, pins), config validation, human units."""

import mlx.core as mx
import numpy as np
import pytest

from kvtool.config import ConfigError, KVToolConfig, load_config
from kvtool.kv.blocks import Block
from kvtool.tiers.ram import RamTier
from kvtool.units import parse_duration, parse_size


def _block(name: str) -> Block:
    k = mx.zeros((1, 1, 4, 4))  # 64 bytes
    return Block(name, "p", np.zeros(4, dtype=np.int32), [k], [k])  # 64 + 64 + 16 = 144 bytes


def test_lru_eviction_under_budget_and_callback():
    evicted = []
    ram = RamTier(3 * 144, on_evict=lambda b, persisted: evicted.append((b.block_hash, persisted)))
    for name in "abc":
        ram.put(_block(name), persisted=(name == "a"))
    ram.get("a")  # a becomes most recently used
    ram.put(_block("d"))
    assert evicted == [("b", False)]
    assert "a" in ram and "b" not in ram and ram.nbytes == 3 * 144


def test_pinned_blocks_survive_until_unpinned():
    evicted = []
    ram = RamTier(144, on_evict=lambda b, p: evicted.append(b.block_hash))
    ram.put(_block("a"), pin=True)
    ram.put(_block("b"), pin=True)
    assert evicted == [] and ram.nbytes == 288  # over budget while pinned
    ram.unpin(["a", "b"])
    assert evicted == ["a"] and len(ram) == 1


def test_zero_budget_keeps_nothing_unpinned():
    ram = RamTier(0)
    ram.put(_block("a"))
    assert len(ram) == 0


def test_config_validation_names_the_field(tmp_path):
    with pytest.raises(ConfigError, match="ssd_policy"):
        KVToolConfig(ssd_policy="sometimes")
    with pytest.raises(ConfigError, match="block_size"):
        KVToolConfig(block_size=0)
    f = tmp_path / "c.toml"
    f.write_text('ssd_durability = "durable"\nblock_size = 64\nbogus = 1\n')
    with pytest.raises(ConfigError, match="bogus"):
        load_config(f)
    f.write_text('[kvtool]\nssd_durability = "durable"\nblock_size = 64\n')
    cfg = load_config(f, block_size=128, ssd_policy=None)
    assert cfg.ssd_durability == "durable" and cfg.block_size == 128


def test_cache_dir_from_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("KVTOOL_CACHE_DIR", str(tmp_path / "kv"))
    assert KVToolConfig().ssd_cache_dir == tmp_path / "kv"


@pytest.mark.parametrize("text,expected", [("50GB", 50 * 10**9), ("512MiB", 512 * 2**20), ("1024", 1024), ("2k", 2048)])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text,expected", [("7d", 7 * 86400), ("12h", 43200), ("30m", 1800), ("45s", 45), ("1d12h", 129600)])
def test_parse_duration(text, expected):
    assert parse_duration(text) == expected


@pytest.mark.parametrize("text", ["1M", "2d1M", "30M"])
def test_an_uppercase_m_is_refused_as_ambiguous(text):
    """`--ttl 1M` from cron meant as a month must not prune everything older than a minute."""
    with pytest.raises(ValueError, match="ambiguous"):
        parse_duration(text)
    assert parse_duration(text.replace("M", "m")) > 0


@pytest.mark.parametrize("bad", ["", "GB", "12 parsecs", "-1d"])
def test_bad_units_raise(bad):
    with pytest.raises(ValueError):
        parse_duration(bad) if "d" in bad or "parsec" in bad else parse_size(bad)


def test_ram_trim_evicts_lru_unpinned_blocks_and_keeps_the_budget():
    from kvtool.tiers.ram import RamTier

    evicted = []
    ram = RamTier(1 << 30, on_evict=lambda b, p: evicted.append(b.block_hash))
    blocks = [_block(f"{i:032x}") for i in range(5)]
    for b in blocks:
        ram.put(b)
    ram.pin([blocks[0].block_hash])
    assert ram.trim(max_blocks=2) == 3 and len(ram) == 2
    assert evicted == [b.block_hash for b in blocks[1:4]]  # LRU order, the pinned one kept
    assert ram.trim(max_bytes=0) == 1 and len(ram) == 1 and blocks[0].block_hash in ram
    assert ram.capacity_bytes == 1 << 30
