"""Every tier against the one `BlockTier` contract (`tests.tier_contract.TierContract`): RAM, the
writer's pending buffer, SSD (a real namespace on disk, SQLite index) and the remote tier on real
`redis-server` processes (one node and a 3-node cluster). And the suite bites: a RAM tier that
skips the token-id check fails it.
"""

from __future__ import annotations

import threading
import uuid

import numpy as np
import pytest
from _pytest.outcomes import Skipped

from kvtool.config.remote_url import make_client
from kvtool.disk.fsops import FileOps
from kvtool.kv.blocks import Block
from kvtool.tiers import remote_value as rv
from kvtool.tiers.base import BlockTier, WritePolicy
from kvtool.tiers.pending import PendingTier
from kvtool.tiers.ram import RamBlockTier, RamTier
from kvtool.tiers.remote import RemoteBlockTier
from kvtool.tiers.remote_store import RemoteStore
from kvtool.tiers.ssd import SsdBlockTier
from kvtool.tiers.writer import AsyncWriter
from tests import redis_servers
from tests.store_helpers import flip_record_byte, kv_layout, make_layout, open_store
from tests.tier_contract import CONTRACT_TESTS, WAIT_S, TierContract, TierEnv

redis_node, redis_cluster = redis_servers.redis_node, redis_servers.redis_cluster


def _layout() -> str:
    return make_layout(model_id=f"contract-{uuid.uuid4().hex}")  # a namespace per test: servers are shared


# ----------------------------------------------------------------------------- RAM
class RamEnv(TierEnv):
    def __init__(self, tier_class: type[RamBlockTier] = RamBlockTier):
        self.layout_key, self.kv = _layout(), kv_layout()
        self.ram = RamTier(1 << 30)
        self.tier = tier_class(self.ram)

    def corrupt(self, block_hash: str) -> None:
        """The block held under the hash is another tokens' block (what a hash collision gives)."""
        b = self.ram.get(block_hash)
        assert b is not None
        self.ram.remove([block_hash])
        self.ram.put(Block(b.block_hash, b.parent_hash, b.token_ids + 1, b.keys, b.values))


class TestRamTier(TierContract):
    @pytest.fixture
    def env(self):
        env = RamEnv()
        yield env
        env.close()


# ----------------------------------------------------------------------------- pending
class GatedFS(FileOps):
    """FileOps whose writes hold until `gate` is set: the writer's blocks stay pending."""

    def __init__(self) -> None:
        self.gate = threading.Event()

    def write_all(self, fd, data) -> None:
        if not self.gate.wait(WAIT_S * 4):
            raise RuntimeError("test gate never opened")
        super().write_all(fd, data)


class PendingEnv(TierEnv):
    def __init__(self, tmp_path):
        self.fs = GatedFS()
        self.store = open_store(tmp_path, fs=self.fs)
        self.layout_key, self.kv = self.store.layout_key, kv_layout()
        self.writer = AsyncWriter(self.store)
        self.tier = PendingTier(self.writer)

    def prepare(self, hosts):
        return list(hosts)

    def fill(self, prepared) -> None:
        assert self.writer.enqueue_many(prepared) == len(prepared)

    def corrupt(self, block_hash: str) -> None:
        host = self.writer.get_pending(block_hash)
        assert host is not None
        host.token_ids = host.token_ids + 1  # another tokens' block under the hash

    def close(self) -> None:
        self.tier.close(WAIT_S)
        self.fs.gate.set()
        assert self.writer.stop(WAIT_S)
        self.store.close()


class TestPendingTier(TierContract):
    @pytest.fixture
    def env(self, tmp_path):
        env = PendingEnv(tmp_path)
        yield env
        env.close()


# ----------------------------------------------------------------------------- SSD
class SsdEnv(TierEnv):
    def __init__(self, tmp_path):
        self.path = tmp_path
        self.layout_key, self.kv = make_layout(), kv_layout()
        self.tier = self._open()

    def _open(self) -> SsdBlockTier:
        store = open_store(self.path)
        assert store.enabled
        self.store = store
        return SsdBlockTier(store, AsyncWriter(store), WritePolicy.THROUGH)

    def corrupt(self, block_hash: str) -> None:
        flip_record_byte(self.store, block_hash)

    def reopen(self) -> BlockTier:
        assert self.tier.close(WAIT_S)
        self.tier = self._open()
        return self.tier


class TestSsdTier(TierContract):
    @pytest.fixture
    def env(self, tmp_path):
        env = SsdEnv(tmp_path)
        yield env
        env.close()


# ----------------------------------------------------------------------------- remote
class RemoteEnv(TierEnv):
    def __init__(self, url: str):
        self.url = url
        self.layout_key, self.kv = _layout(), kv_layout()
        self.tier = self._open()

    def _open(self) -> RemoteBlockTier:
        self.store = RemoteStore(self.url, self.layout_key, self.kv, timeout_s=2.0)
        return RemoteBlockTier(self.store, WritePolicy.THROUGH)

    def corrupt(self, block_hash: str) -> None:
        client = make_client(self.store.remote, 2.0)
        client.set(rv.value_key(self.layout_key, block_hash), b"not a value")
        client.close()

    def reopen(self) -> BlockTier:
        self.tier.close(WAIT_S)
        self.tier = self._open()
        return self.tier


@pytest.mark.slow
class TestRemoteTierNode(TierContract):
    @pytest.fixture
    def env(self, redis_node):
        env = RemoteEnv(redis_node.url)
        yield env
        env.close()


@pytest.mark.slow
class TestRemoteTierCluster(TierContract):
    @pytest.fixture
    def env(self, redis_cluster):
        env = RemoteEnv(redis_cluster.url)
        yield env
        env.close()


# ----------------------------------------------------------------------------- the suite bites
class NoTokenCheckRam(RamBlockTier):
    """A RAM tier with one contract broken on purpose: it serves a block by its hash alone,
    without comparing the prompt's token ids."""

    def _get(self, h: str, expected: np.ndarray) -> Block | None:
        return self.ram.get(h)


def run_contract(make_env) -> dict[str, str]:
    """Run every contract test on fresh envs; returns test name -> 'passed' | 'skipped' | 'FAILED: ...'."""
    out = {}
    for name in CONTRACT_TESTS:
        env = make_env()
        try:
            getattr(TierContract(), name)(env)
            out[name] = "passed"
        except Skipped:
            out[name] = "skipped"
        except AssertionError as exc:
            out[name] = f"FAILED: {str(exc).splitlines()[0] if str(exc) else 'assert'}"
        finally:
            env.close()
    return out


def test_the_suite_passes_a_sound_tier_and_fails_a_broken_one():
    sound = run_contract(RamEnv)
    assert all(v in ("passed", "skipped") for v in sound.values()), sound
    broken = run_contract(lambda: RamEnv(NoTokenCheckRam))
    failed = sorted(k for k, v in broken.items() if v.startswith("FAILED"))
    print("broken tier:", broken)
    assert failed == ["test_damaged_block_cuts_the_chain", "test_token_id_mismatch_is_a_miss"], broken
