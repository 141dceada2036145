"""Fault injection at the engine level (docs/design.md#failure-isolation): a failing disk never fails a request.

Faults are injected through the sanctioned seam, a `FileOps` subclass passed as
`Engine(..., fs=...)` (`tests.store_helpers.FaultFS`): the suite runs as root, so chmod cannot make
a directory read-only. Everything else is real: the tiny model, the files, SQLite, the writer
threads. For each fault the engine must return mlx-lm's uncached greedy output, raise nothing,
keep serving from RAM, count the failures, and leave no temp file behind; under `persistent` (and
`durable`) the writer retries each failed block exactly `ssd_persistent_max_retries` times.

A request's new entries (its full blocks and its tail entry) go to the writer as one batch, which
the store writes as ONE segment file: file operations are counted per segment, blocks per entry.
A cache directory the process cannot write is opened read-only and still serves its hits.
"""

from __future__ import annotations

import errno
import os
import threading

import pytest

from kvtool.config import KVToolConfig
from kvtool.disk.fsops import FileOps
from kvtool.engine import Engine
from tests.store_helpers import FaultFS
from tests.test_engine import BS, MAX_TOKENS, reference_tokens

N_BLOCKS = 5
TAIL = 10  # the prompt's trailing partial block: stored as a tail entry
N_ENTRIES = N_BLOCKS + 1  # what a cold request writes: its full blocks and its tail entry
RETRIES = 2  # not the default (3): proves the configured value is the one used
WRITERS = {"sync": False, "async": True}


@pytest.fixture(scope="module")
def prompt(tiny_model):
    text = open("kvtool/assets/demo_prompt.txt", encoding="utf-8").read()
    return tiny_model.tokenizer.encode(text)[: N_BLOCKS * BS + TAIL]


@pytest.fixture(scope="module")
def reference(tiny_model, prompt):
    return reference_tokens(tiny_model.model, tiny_model.tokenizer, prompt)


def _config(tmp_path, writer="sync", **kw):
    return KVToolConfig(
        ssd_cache_dir=tmp_path / "kv", block_size=BS, ssd_async_writes=WRITERS[writer],
        ssd_persistent_max_retries=RETRIES, **kw,
    )  # fmt: skip


def _temp_files(root):
    return [f for _, _, files in os.walk(root) for f in files if f.endswith(".tmp")]


def _segment_files(root):
    return sorted(root.rglob("*.safetensors"))


def _index_rows(root) -> int:
    import sqlite3

    total = 0
    for db in root.glob("*/index.sqlite"):
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as con:
            total += con.execute("SELECT COUNT(*) FROM blocks").fetchone()[0]
    return total


def _serve(engine, prompt, reference):
    """One request; it must succeed with the uncached output."""
    res = engine.generate(prompt, max_tokens=MAX_TOKENS)
    assert res.token_ids == reference
    assert res.prompt_tokens == res.cached_tokens + res.prefill_tokens
    return res


def _populate(tiny_model, tmp_path, prompt):
    eng = Engine(tiny_model, _config(tmp_path))
    eng.generate(prompt, max_tokens=1)
    assert eng.close().shutdown_clean
    assert len(_segment_files(tmp_path / "kv")) == 1  # one request, one segment
    assert _index_rows(tmp_path / "kv") == N_ENTRIES


# --------------------------------------------------------------------------- write faults
WRITE_FAULTS = [("ENOSPC", "write_all"), ("EIO", "write_all"), ("EACCES", "open_new"), ("EIO", "replace")]


@pytest.mark.parametrize("writer", sorted(WRITERS))
@pytest.mark.parametrize("durability", ["best_effort", "persistent"])
@pytest.mark.parametrize("code,op", WRITE_FAULTS, ids=[f"{c}-{o}" for c, o in WRITE_FAULTS])
@pytest.mark.slow
def test_write_fault_keeps_serving_from_ram(tiny_model, prompt, reference, tmp_path, writer, durability, code, op):
    _write_fault_case(tiny_model, prompt, reference, tmp_path, writer, durability, code, op)


@pytest.mark.parametrize("writer", sorted(WRITERS))
@pytest.mark.slow
def test_durable_fsync_fault_is_retried(tiny_model, prompt, reference, tmp_path, writer):
    _write_fault_case(tiny_model, prompt, reference, tmp_path, writer, "durable", "EIO", "fsync")


def _write_fault_case(tiny_model, prompt, reference, tmp_path, writer, durability, code, op):
    fs = FaultFS()
    eng = Engine(tiny_model, _config(tmp_path, writer, ssd_durability=durability), fs=fs)
    assert eng.tiered.ssd.enabled  # the fault starts after a healthy open
    fs.calls.clear()  # count only calls made under the fault (not the startup probe)
    fs.fail[op] = getattr(errno, code)

    cold = _serve(eng, prompt, reference)
    assert cold.blocks_written == (N_ENTRIES if writer == "async" else 0)  # async: accepted, not yet written
    assert eng.flush()  # every accepted write attempted (retries included)
    assert cold.blocks_written == 0  # settled: none reached the disk
    warm = _serve(eng, prompt, reference)  # the entries stayed in RAM: a full hit
    assert warm.ram_hit_tokens == len(prompt) - 1 and warm.ssd_hit_tokens == 0 and warm.prefill_tokens == 1

    st = eng.stats()
    retries = RETRIES if durability != "best_effort" else 0
    assert st["writer_enqueue_total"] == N_ENTRIES
    assert st["writer_save_fail"] == N_ENTRIES and st["writer_save_success"] == 0
    assert st["ssd_save_fail"] == N_ENTRIES * (1 + retries) and st["ssd_save_success"] == 0
    assert st["writer_retry_attempts"] == retries * N_ENTRIES
    assert st["writer_retry_final_fail"] == (N_ENTRIES if retries else 0)
    # one segment per attempt, not one file per block; a full disk splits it in halves first
    # (6 -> 3 -> 2 -> 1 blocks: the first block alone does not fit either, so the rest is not tried)
    per_attempt = 4 if code == "ENOSPC" else 1
    assert fs.calls[op] == per_attempt * (1 + retries)
    assert eng.close().shutdown_clean

    kv = tmp_path / "kv"
    assert _temp_files(kv) == [] and _segment_files(kv) == [] and _index_rows(kv) == 0
    restarted = Engine(tiny_model, _config(tmp_path, writer))  # healthy disk again, empty RAM
    res = _serve(restarted, prompt, reference)
    assert res.cached_tokens == 0  # nothing half-written was indexed
    restarted.close()


# ---------------------------------------------------------------------------- read faults
@pytest.mark.parametrize("writer", sorted(WRITERS))
@pytest.mark.parametrize("code", ["ENOSPC", "EIO", "EACCES"])
def test_read_fault_is_a_miss(tiny_model, prompt, reference, tmp_path, writer, code):
    _populate(tiny_model, tmp_path, prompt)
    fs = FaultFS({"open_read": getattr(errno, code)})
    eng = Engine(tiny_model, _config(tmp_path, writer), fs=fs)
    res = _serve(eng, prompt, reference)
    assert res.cached_tokens == 0 and res.ssd_hit_tokens == 0
    assert eng.flush()
    st = eng.stats()
    assert st["ssd_load_fail"] == 1 and st["ssd_load_hits"] == 0  # one segment, opened once
    assert fs.calls["open_read"] == 1
    again = _serve(eng, prompt, reference)  # from RAM now (a full hit)
    assert again.ram_hit_tokens == len(prompt) - 1
    assert eng.close().shutdown_clean
    assert _temp_files(tmp_path / "kv") == []
    assert _index_rows(tmp_path / "kv") == N_ENTRIES  # a read error drops nothing


# ------------------------------------------------------------------- read-only directory
class ReadOnlyFS(FaultFS):
    """A read-only file system: every call that would create, change or remove fails."""

    WRITE_OPS = ("open_new", "write_all", "fsync", "fsync_dir", "replace", "unlink")

    def __init__(self, code: int):
        super().__init__({op: code for op in self.WRITE_OPS})

    def makedirs(self, path, mode=0o700):
        if not os.path.isdir(path):
            self._hit("makedirs_new")
            raise OSError(self.fail["open_new"], "injected read-only file system")
        return FileOps.makedirs(self, path, mode)


def _tree(root):
    return {p.relative_to(root): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))
            if not p.name.endswith(("-wal", "-shm"))}


@pytest.mark.parametrize("writer", sorted(WRITERS))
@pytest.mark.parametrize("code", ["EROFS", "EACCES"])
def test_read_only_empty_cache_dir_disables_the_store(tiny_model, prompt, reference, tmp_path, writer, code):
    (tmp_path / "kv").mkdir()
    eng = Engine(tiny_model, _config(tmp_path, writer), fs=ReadOnlyFS(getattr(errno, code)))
    ssd = eng.tiered.ssd
    assert not ssd.enabled and ssd.disabled_reason
    cold = _serve(eng, prompt, reference)
    assert cold.cached_tokens == 0
    warm = _serve(eng, prompt, reference)
    assert warm.ram_hit_tokens == len(prompt) - 1
    st = eng.stats()
    assert st["writer_enqueue_rejected"] == N_ENTRIES and st["writer_enqueue_total"] == 0
    assert st["ssd_save_success"] == 0 and st["ssd_load_hits"] == 0
    eng.close()
    assert list((tmp_path / "kv").iterdir()) == []


@pytest.mark.parametrize("writer", sorted(WRITERS))
@pytest.mark.parametrize("code", ["EROFS", "EACCES"])
def test_read_only_populated_cache_dir_serves_hits(tiny_model, prompt, reference, tmp_path, writer, code):
    """A cache the process cannot write (mounted read-only, another user's) still serves
    its hits, read-only: nothing is written, touched or removed, and the output is exact."""
    _populate(tiny_model, tmp_path, prompt)
    kv = tmp_path / "kv"
    before = _tree(kv)
    fs = ReadOnlyFS(getattr(errno, code))
    eng = Engine(tiny_model, _config(tmp_path, writer, ssd_durability="persistent"), fs=fs)
    ssd = eng.tiered.ssd
    assert ssd.enabled and ssd.read_only and ssd.disabled_reason
    hit = _serve(eng, prompt, reference)
    assert hit.ssd_hit_tokens == len(prompt) - 1 and hit.prefill_tokens == 1  # full hit from SSD
    longer = prompt + prompt[: 2 * BS]  # new blocks: kept in RAM, never written
    ref_longer = reference_tokens(tiny_model.model, tiny_model.tokenizer, longer)
    res = _serve(eng, longer, ref_longer)
    assert res.cached_tokens >= N_BLOCKS * BS
    assert eng.flush()
    st = eng.stats()
    assert st["ssd_load_hits"] == N_ENTRIES and st["ssd_save_success"] == 0
    eng.close()
    assert {k: fs.calls.get(k, 0) for k in ReadOnlyFS.WRITE_OPS if k != "open_new"} == dict.fromkeys(
        [k for k in ReadOnlyFS.WRITE_OPS if k != "open_new"], 0
    )
    assert fs.calls.get("open_new", 0) == 1  # the startup probe only
    assert _tree(kv) == before


# ---------------------------------------------------------- queued, not yet written = a hit
class BlockedWriteFS(FileOps):
    """Real file operations, except that the first `write_all` waits for `release`."""

    def __init__(self):
        self.entered = threading.Event()
        self.release = threading.Event()

    def write_all(self, fd, data):
        self.entered.set()
        assert self.release.wait(timeout=60), "test never released the blocked write"
        return super().write_all(fd, data)


@pytest.mark.parametrize("policy", ["write_through", "evict_only"])
def test_queued_block_is_a_pending_hit(tiny_model, prompt, reference, tmp_path, policy):
    """RAM keeps nothing (ram_bytes=0), the writer is stuck on the request's segment: the second
    request must find every entry in the writer's pending buffer (RAM -> pending -> SSD)."""
    fs = BlockedWriteFS()
    eng = Engine(tiny_model, _config(tmp_path, "async", ssd_policy=policy, ram_bytes=0), fs=fs)
    try:
        cold = _serve(eng, prompt, reference)
        assert cold.cached_tokens == 0
        assert fs.entered.wait(timeout=60)  # the writer thread is inside the first write
        hit = _serve(eng, prompt, reference)
        st = eng.stats()
        assert st["kv_pending_hits"] == N_ENTRIES
        assert hit.ssd_hit_tokens == len(prompt) - 1 and hit.ram_hit_tokens == 0
        assert st["ssd_load_hits"] == 0 and st["ssd_save_success"] == 0  # nothing came from disk
    finally:
        fs.release.set()
    assert eng.close().shutdown_clean
    # write_through hands the request's entries over as one batch: one segment; evict_only sends
    # each entry as RAM evicts it (ram_bytes=0: at once), and the writer coalesces the batches
    # queued behind the blocked one: 1 segment per write, timing decides how many
    segments = len(_segment_files(tmp_path / "kv"))
    assert segments == 1 if policy == "write_through" else 1 <= segments <= N_ENTRIES
    assert _temp_files(tmp_path / "kv") == [] and _index_rows(tmp_path / "kv") == N_ENTRIES
    restarted = Engine(tiny_model, _config(tmp_path))
    res = _serve(restarted, prompt, reference)
    assert res.ssd_hit_tokens == len(prompt) - 1  # a full hit, tail entry included
    restarted.close()


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_read_only_cache_is_not_retried_like_a_failing_disk(tiny_model, prompt, reference, tmp_path, writer):
    """A read-only store refuses every save by design: the writer must not take its blocks (host
    copies, queue bytes) nor run persistent-mode retry rounds with backoff for them (with the sync
    writer those backoff sleeps land on the request thread, request after request)."""
    _populate(tiny_model, tmp_path, prompt)
    eng = Engine(tiny_model, _config(tmp_path, writer, ssd_durability="persistent"), fs=ReadOnlyFS(errno.EROFS))
    assert eng.tiered.ssd.read_only
    _serve(eng, prompt, reference)
    longer = prompt + prompt[: 2 * BS]
    _serve(eng, longer, reference_tokens(tiny_model.model, tiny_model.tokenizer, longer))
    assert eng.flush()
    st = eng.stats()
    eng.close()
    # Regression (found in review, fixed): kvtool/tiers/writer_sync.py, WriterBase._store_enabled.
    assert st["writer_retry_attempts"] == 0 and st["writer_retry_final_fail"] == 0, st
    assert st["writer_enqueue_total"] == 0 and st["writer_enqueue_rejected"] > 0, st
