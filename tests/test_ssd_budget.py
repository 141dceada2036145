"""The SSD tier's byte budget (`ssd_max_bytes`, kvtool.disk.budget): the namespace directory
stays within its bytes (as `du` counts them) while serving, across processes; least recently used
segments go first, with their descendants; recently used ones never; a restore reads a segment
evicted under it; evictions are counted. Real files and processes, no mocks."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from kvtool.config import KVToolConfig
from kvtool.disk import restore
from kvtool.disk.budget import DEFAULT_PROTECT_S
from kvtool.disk.namespace import SSDStore
from kvtool.disk.segment import FORMAT_VERSION, KVLayout
from kvtool.hashing import chain_hashes, layout_key, root_parent
from kvtool.ops.validate import validate
from kvtool.tiers.writer import AsyncWriter, SyncWriter, make_writer
from tests.store_helpers import contains, make_block
from tests.test_restore import Buffers, expected_bytes, offsets

REPO = Path(__file__).resolve().parent.parent
GEO = dict(n_layers=2, n_kv_heads=2, head_dim=64)
BLOCK = 16  # tokens: a record is ~16 KiB of float16
DTYPE = "float16"
KV = KVLayout.uniform(GEO["n_layers"], GEO["n_kv_heads"], GEO["head_dim"], DTYPE)
LAYOUT = layout_key("budget-model", KV.spec, DTYPE, BLOCK, format_version=FORMAT_VERSION)
META = {"model_id": "budget-model", "model_name": "budget", "kv_dtype": DTYPE, "block_size": str(BLOCK), "kv_layers": KV.spec}


def chain(seed: int, n_blocks: int = 4, prefix: list | None = None) -> list:
    """The blocks of a prompt of `n_blocks` full blocks (distinct per `seed`), with real chain
    hashes; `prefix`: a chain it continues."""
    head = [int(x) for b in prefix for x in b.token_ids] if prefix else []
    ids = np.array(head + [seed * 1000 + i for i in range(n_blocks * BLOCK)], dtype=np.int32)
    hashes = chain_hashes(ids, BLOCK, LAYOUT)
    parents = [root_parent(LAYOUT), *hashes]
    skip = len(prefix or [])
    return [make_block(hashes[i], parents[i], ids[i * BLOCK : (i + 1) * BLOCK], DTYPE, seed * 100 + i, **GEO)
            for i in range(skip, len(hashes))]  # fmt: skip


def du(path: Path) -> int:
    """Bytes under `path` as `du` counts them (allocated blocks of files and directories)."""
    total = os.lstat(path).st_blocks * 512
    for root, dirs, files in os.walk(path):
        for n in dirs + files:
            try:
                total += os.lstat(os.path.join(root, n)).st_blocks * 512
            except FileNotFoundError:
                continue
    return total


def segment_bytes(blocks) -> int:
    return 4096 + sum(KV.record_nbytes(len(b.token_ids)) for b in blocks)


def open_budgeted(cache_dir: Path, max_bytes: int | None, protect_s: float = 0.0, **kw) -> SSDStore:
    store = SSDStore(cache_dir, LAYOUT, META, **kw)
    store.set_max_bytes(max_bytes, protect_s=protect_s)
    return store


def loads(store: SSDStore, blocks) -> bool:
    return all(store.load_block(b.block_hash, b.token_ids, b.parent_hash) is not None for b in blocks)


# ----------------------------------------------------------------------------- one process
def test_the_directory_stays_within_the_budget_and_evictions_are_counted(tmp_path):
    one = segment_bytes(chain(0))
    budget = 16 * one + (768 << 10)  # 16 segments and room for the index and its log
    store = open_budgeted(tmp_path, budget)
    written = []
    for seed in range(5 * budget // one):
        blocks = chain(seed)
        assert store.save_blocks(blocks) == ["saved"] * len(blocks)
        written.append(blocks)
        assert du(store.namespace_dir) <= budget + one
    st = store.stats()
    assert st["ssd_budget_evictions"] > 0 and st["ssd_budget_evicted_bytes"] >= st["ssd_budget_evictions"] * (one - 4096)
    assert st["ssd_budget_evicted_blocks"] == 4 * st["ssd_budget_evictions"] and st["ssd_budget_refused"] == 0
    kept = [b for b in written if contains(store, b[0].block_hash)]
    assert kept and all(loads(store, b) for b in kept)  # what is left is intact and served
    assert store.budget is not None and store.budget.used_bytes() <= budget + one
    store.close()
    assert validate(tmp_path, deep=True).problems == 0  # no row without its file, no orphan


def used_bytes(store: SSDStore) -> int:
    """The namespace's bytes by the budget's own count (segments, reservations, index, dirs)."""
    store.set_max_bytes(1 << 50)
    assert store.budget is not None
    return store.budget.used_bytes()


def exact(store: SSDStore, max_bytes: int, protect_s: float) -> None:
    """A budget that evicts exactly what the write needs (no slack beyond it)."""
    store.set_max_bytes(max_bytes, protect_s=protect_s)
    assert store.budget is not None
    store.budget.evict_slack = 0.0


def test_least_recently_used_goes_first(tmp_path):
    now = [1000.0]
    store = open_budgeted(tmp_path, None, clock=lambda: now[0])
    one = segment_bytes(chain(0))
    hot, cold = chain(1), chain(2)
    for blocks in (hot, cold):
        store.save_blocks(blocks)
        now[0] += 10
    assert loads(store, hot)  # a use: `hot` is now the most recently used
    store.flush()
    now[0] += 10
    exact(store, used_bytes(store) + one // 2, protect_s=5.0)
    assert store.save_blocks(chain(3)) == ["saved"] * 4  # needs room: the least recently used goes
    assert not contains(store, cold[0].block_hash) and contains(store, hot[0].block_hash)
    assert store.stats()["ssd_budget_evictions"] == 1
    store.close()


def test_descendants_go_with_their_ancestor(tmp_path):
    """Segment P holds a prefix; segment Q holds its continuation q and an unrelated block y used
    later. The budget evicts P (the least recently used): q goes with it (no prefix lookup could
    reach it), y and Q's file stay."""
    now = [1000.0]
    store = open_budgeted(tmp_path, None, clock=lambda: now[0])
    prefix = chain(1, 2)
    store.save_blocks(prefix)
    now[0] += 10
    q, y = chain(1, 1, prefix=prefix)[0], chain(7, 1)[0]
    store.save_blocks([q, y])  # one segment
    now[0] += 40
    assert loads(store, [y])
    store.flush()
    now[0] += 10
    exact(store, used_bytes(store) + 60_000, protect_s=5.0)
    assert store.save_blocks(chain(6)) == ["saved"] * 4
    st = store.stats()
    assert (st["ssd_budget_evictions"], st["ssd_budget_evicted_blocks"]) == (1, 3)  # P's two blocks and q
    assert not contains(store, prefix[0].block_hash) and not contains(store, q.block_hash)
    assert contains(store, y.block_hash) and loads(store, [y])
    store.close()
    assert validate(tmp_path).problems == 0  # nothing unreachable left behind


def test_recently_used_segments_are_never_evicted_the_write_is_refused(tmp_path):
    one = segment_bytes(chain(0))
    store = open_budgeted(tmp_path, None)
    store.save_blocks(chain(0))
    budget = used_bytes(store) + one // 2
    store.set_max_bytes(budget, protect_s=3600.0)  # everything was used within the hour
    assert store.save_blocks(chain(1)) == ["refused"] * 4  # the budget at work: not an error
    st = store.stats()
    assert st["ssd_budget_refused"] == 4 and st["ssd_budget_evictions"] == 0
    assert contains(store, chain(0)[0].block_hash) and du(store.namespace_dir) <= budget + one
    with sqlite3.connect(store.namespace_dir / "index.sqlite") as conn:
        assert conn.execute("SELECT COUNT(*) FROM reservations").fetchone() == (0,)  # nothing left reserved
    store.close()


class _Records(logging.Handler):
    """Every record of the `kvtool` loggers, whatever their propagation (a CLI run in this
    process turns it off)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_refused_segment_is_counted_once_never_retried_and_no_failure(tmp_path, kind):
    """A segment the budget has no room for answers 'refused': the writer counts it apart from
    the failures, makes no retry round even under `persistent`, and logs no WARNING (one INFO
    line from the budget, one DEBUG line from the writer)."""
    one = segment_bytes(chain(0))
    store = open_budgeted(tmp_path, None)
    store.save_blocks(chain(0))
    store.set_max_bytes(used_bytes(store) + one // 2, protect_s=3600.0)  # nothing may be evicted
    delays: list[float] = []
    make = AsyncWriter if kind == "async" else SyncWriter
    writer = make(store, durability="persistent", max_retries=3, sleep=delays.append)
    logger, seen = logging.getLogger("kvtool"), _Records()
    level = logger.level
    logger.addHandler(seen)
    logger.setLevel(logging.DEBUG)
    try:
        assert writer.enqueue_many(chain(1), must_write=True) == 4
        assert writer.flush(5.0) and writer.stop(5.0)
    finally:
        logger.removeHandler(seen)
        logger.setLevel(level)
    ws, st = writer.get_stats(), store.stats()
    assert ws["writer_budget_refused"] == 4 and ws["writer_save_fail"] == ws["writer_retry_final_fail"] == 0
    assert ws["writer_retry_attempts"] == 0 and delays == []  # one attempt: no backoff, no second save
    assert st["ssd_budget_refused"] == 4 and st["ssd_save_fail"] == 0 and st["ssd_save_success"] == 4  # chain(0)
    assert not any(contains(store, b.block_hash) for b in chain(1))
    assert [r.getMessage() for r in seen.records if r.levelno >= logging.WARNING] == []
    budget_lines = [r for r in seen.records if "byte budget" in r.getMessage()]
    assert [r.levelno for r in budget_lines] == [logging.INFO, logging.DEBUG], budget_lines
    store.close()


@pytest.mark.slow
def test_a_reservation_of_a_dead_process_is_dropped(tmp_path):
    store = open_budgeted(tmp_path, None)
    store.save_blocks(chain(0))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    with sqlite3.connect(store.namespace_dir / "index.sqlite") as conn:
        conn.execute("INSERT INTO reservations VALUES (?, ?, ?, ?)", ("ab" * 16, 1 << 40, int(dead.stdout), time.time()))
    store.set_max_bytes(used_bytes(store) + 10 * segment_bytes(chain(0)))
    assert store.save_blocks(chain(1)) == ["saved"] * 4  # the dead writer's terabyte does not count
    with sqlite3.connect(store.namespace_dir / "index.sqlite") as conn:
        assert conn.execute("SELECT COUNT(*) FROM reservations").fetchone() == (0,)
    store.close()


def test_a_restore_reads_a_segment_evicted_while_it_is_open(tmp_path):
    """The segment is opened and checked, then another process's budget evicts it (rows deleted,
    file unlinked) before the records are read: Linux keeps an open file readable, the restore
    completes with the exact bytes."""
    store = open_budgeted(tmp_path, None)
    blocks = chain(1)
    store.save_blocks(blocks)
    rows = store.lookup([b.block_hash for b in blocks])
    ids = np.concatenate([b.token_ids for b in blocks])
    other = open_budgeted(tmp_path, None)  # another writer, with a tight budget
    other.set_max_bytes(used_bytes(other) + segment_bytes(blocks) // 2, protect_s=0.0)

    def evict_now() -> None:  # runs after the segments are opened, before the first read
        assert other.save_blocks(chain(2)) == ["saved"] * 4
        assert not contains(store, blocks[0].block_hash) and not (store.namespace_dir / rows[0].segment[:2] /
                                                                  f"{rows[0].segment}.safetensors").exists()  # fmt: skip

    bufs = Buffers(KV, len(ids) + 8)
    res = restore.restore_chain(store, rows, root_parent(LAYOUT), ids, offsets(rows), bufs.dest, ready=evict_now)
    assert res.n_ok == len(blocks) and res.failure is None
    assert bufs.tokens_bytes(len(ids)) == expected_bytes(blocks, len(blocks))
    assert other.stats()["ssd_budget_evictions"] == 1 and store.stats()["ssd_load_corrupt"] == 0
    other.close()
    store.close()


def test_make_writer_hands_the_configured_budget_to_the_store(tmp_path):
    cfg = KVToolConfig(ssd_cache_dir=tmp_path, ssd_max_bytes="3MiB", ssd_async_writes=False)
    assert cfg.ssd_max_bytes == 3 << 20 and KVToolConfig(ssd_cache_dir=tmp_path).ssd_max_bytes is None
    store = SSDStore(tmp_path, LAYOUT, META)
    writer = make_writer(store, cfg)
    assert store.budget is not None and store.budget.max_bytes == 3 << 20
    writer.stop()
    store.close()


# ----------------------------------------------------------------------------- processes
WRITER = r"""
import json, sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from tests.test_ssd_budget import chain, open_budgeted
store = open_budgeted(Path(sys.argv[2]), int(sys.argv[3]))
first, n = int(sys.argv[4]), int(sys.argv[5])
outcomes = []
for seed in range(first, first + n):  # a request every few ms: faster than serving, slow enough for du to see
    outcomes.append(store.save_blocks(chain(seed)))
    time.sleep(0.005)
store.close()
print(json.dumps({"stats": store.stats(), "saved": sum(o == ["saved"] * 4 for o in outcomes)}))
"""


def _sample(path: Path, stop: threading.Event, peak: list[int]) -> None:
    while not stop.wait(0.001):
        try:
            peak[0] = max(peak[0], du(path))
        except FileNotFoundError:
            pass


@pytest.mark.slow
def test_two_processes_share_one_budget(tmp_path):
    """Two writer processes, 5x the budget of distinct segments between them: the directory never
    holds more than the budget plus one segment at any sampled moment."""
    one = segment_bytes(chain(0))
    budget = 24 * one + (768 << 10)
    open_budgeted(tmp_path, budget).close()  # the namespace exists before both start
    n = 5 * budget // one // 2
    stop, peak = threading.Event(), [0]
    sampler = threading.Thread(target=_sample, args=(tmp_path / LAYOUT, stop, peak))
    sampler.start()
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(REPO), str(tmp_path), str(budget), str(first), str(n)],
                              stdout=subprocess.PIPE, text=True) for first in (0, 10_000)]  # fmt: skip
    outs = [json.loads(p.communicate(timeout=600)[0]) for p in procs]
    stop.set()
    sampler.join()
    assert all(p.returncode == 0 for p in procs)
    assert peak[0] <= budget + one, (peak[0], budget, one)
    assert sum(o["saved"] for o in outs) > n  # the budget made room: most writes were stored
    assert sum(o["stats"]["ssd_budget_evictions"] for o in outs) > 0
    assert validate(tmp_path, deep=True).problems == 0


# ----------------------------------------------------------------------------- acceptance
def _serve_once(cache: Path, requests: Path, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "kvtool.cli.app", "serve-once", "--json", "--requests", str(requests), "--max-tokens", "2",
           "--cache-dir", str(cache), "--ram-bytes", "0", *extra]  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)


def _segment_max(path: Path) -> int:
    """The largest segment file's allocated size (bytes); a file the budget evicts between the
    listing and its `lstat` counts as 0."""
    sizes = [0]
    for p in path.glob("*/??/*.safetensors"):
        with contextlib.suppress(FileNotFoundError):
            sizes.append(os.lstat(p).st_blocks * 512)
    return max(sizes)


@pytest.mark.slow
def test_serving_five_times_the_budget_from_two_processes(tmp_path):
    """Two `kvtool serve-once` processes serve 5x the budget of distinct prompts (groups share a
    two-block prefix) into one cache with `--ssd-max-bytes`, in two waves: the cache directory as
    `du` counts it never holds more than the budget plus one segment at any sampled moment, every
    output equals a run without cache, and the evictions show in the stats. The second wave
    starts once the first wave's segments are older than the protection window
    (`DEFAULT_PROTECT_S`): within it a full budget refuses writes instead of evicting, so a single
    wave shows evictions only on a machine slow enough to serve past the window."""
    budget = 6 << 20
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau".split()
    rng = np.random.default_rng(7)
    prompts = []
    for i in range(100):  # ~230 tokens each: 3 blocks and a tail, ~200 KiB a segment (tiny's KV)
        prefix = " ".join(rng.choice(words, 90, replace=True).tolist()) if i % 5 == 0 else prompts[-1][0]
        prompts.append((prefix, f"{prefix} request {i}: " + " ".join(rng.choice(words, 80).tolist())))
    files = []
    for k in range(4):  # two waves of 50 prompts (their own prefixes), each process every other one
        f = tmp_path / f"requests{k}.jsonl"
        f.write_text("".join(json.dumps({"prompt": p}) + "\n" for _, p in prompts[50 * (k // 2) :][: 50][k % 2 :: 2]))
        files.append(f)
    cache = tmp_path / "kv"
    stop, peak, seg = threading.Event(), [0], [0]

    def sample() -> None:
        while not stop.wait(0.005):
            if cache.exists():
                peak[0] = max(peak[0], du(cache))
                seg[0] = max(seg[0], _segment_max(cache))

    sampler = threading.Thread(target=sample)
    sampler.start()
    outs = []
    for wave in (files[:2], files[2:]):
        if outs:
            time.sleep(DEFAULT_PROTECT_S + 0.5)
        procs = [_serve_once(cache, f, "--ssd-max-bytes", str(budget)) for f in wave]
        outs += [(p, *p.communicate(timeout=1200)) for p in procs]
    stop.set()
    sampler.join()
    assert [p.returncode for p, _, _ in outs] == [0] * 4, [err[-2000:] for _, _, err in outs]
    docs = [json.loads(out) for _, out, _ in outs]
    assert peak[0] <= budget + seg[0], (peak[0], budget, seg[0])
    evictions = sum(d["stats"]["ssd_budget_evictions"] for d in docs)
    written = sum(d["stats"]["ssd_segments_written"] for d in docs)
    assert evictions > 0 and written * seg[0] > budget  # the budget was passed over (within a wave, writes are refused)
    print(f"budget {budget} B, largest segment {seg[0]} B, peak du {peak[0]} B, segments written {written}, "
          f"evicted {evictions}, refused blocks {sum(d['stats']['ssd_budget_refused'] for d in docs)}")  # shown with -s
    # every output equals a run without cache; a replay in a fifth process hits what is left
    baseline = [_serve_once(tmp_path / "none", f, "--no-ssd") for f in files]
    base = [json.loads(p.communicate(timeout=1200)[0]) for p in baseline]
    for d, b in zip(docs, base):
        assert [r["token_ids"] for r in d["requests"]] == [r["token_ids"] for r in b["requests"]]
    replay = _serve_once(cache, files[3], "--ssd-max-bytes", str(budget))
    again = json.loads(replay.communicate(timeout=1200)[0])
    assert [r["token_ids"] for r in again["requests"]] == [r["token_ids"] for r in base[3]["requests"]]
    assert sum(r["ssd_hit_tokens"] for r in again["requests"]) > 0
    assert du(cache) <= budget + seg[0]
