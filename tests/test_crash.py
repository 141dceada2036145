"""Crash safety (docs/design.md#durability-modes): SIGKILL a serving process at seeded random moments, then repair and serve.

A worker process (`tests/crash_worker.py`) serves an endless stream of prompts with async
write-through (block size 16, so every request writes a segment file of many blocks plus its tail
entry, and their index rows in one transaction) and announces every phase and every SSD file
operation on stdout before it runs (file operations and index commits: once per segment). Each round starts a
worker on the SAME cache directory (the cache accumulates across crashes, as in real life), picks
a kill target (see `TARGETS`; every target is used before any repeats), reads the worker's lines up
to a seeded random occurrence of that target, waits a seeded random delay and SIGKILLs it. So the
kills land spread over imports / model load, engine construction (SSD open, startup reconcile),
prefill/decode, temp-file writes, fsyncs, renames, index commits, writer drains
(flush) and tier reopenings. After each kill:

- `validate` (the real `kvtool validate` CLI every 5th round, else `kvtool.ops.validate.validate`)
  exits 0 or 1 (1 iff it found problems) and never finds what the write protocol forbids: an index
  row without its segment file, a corrupt or incomplete segment, an orphan that cannot be adopted,
  or a broken parent chain (what it may do: remove the killed writer's temp file, adopt a segment
  renamed into place before its rows were committed);
- a second `validate` is clean (exit 0);
- on disk, segment rows and segment files match one to one, every block row points at a segment
  row and every segment row has block rows, and no temp file is left (the killed writer's pid is
  dead and reaped, so its temp files must go);
- an engine on that cache serves the prompt that was in flight and the one before it with token
  ids identical to mlx-lm's uncached greedy generation.
"""

from __future__ import annotations

import json
import os
import queue
import random
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvtool.config import KVToolConfig
from kvtool.disk.names import NAMESPACE_RE
from kvtool.engine import Engine
from kvtool.ops.validate import validate
from tests import crash_worker
from tests.test_engine import reference_tokens

REPO = Path(__file__).resolve().parent.parent
# Kill rounds per durability: 12 hits every kill target at least once (12 targets under durable);
# `KVTOOL_CRASH_KILLS` runs more (each round costs ~3.5 s on 2 cores).
KILLS = int(os.environ.get("KVTOOL_CRASH_KILLS", "12"))
CLI_EVERY = 5  # every 5th round validates through the real CLI (costs an MLX import each)
LINE_TIMEOUT_S = 60.0
VERIFY_TOKENS = 8
# What the write protocol forbids validate ever to find after a kill (it may remove a killed
# writer's temp files and adopt a segment renamed into place before its rows were committed).
FORBIDDEN = (
    "missing_rows_dropped", "corrupt_removed", "orphans_removed", "broken_chain_removed",
    "rows_repaired", "segment_rows_fixed", "bad_rows_dropped",
)  # fmt: skip


class Worker:
    """A crash_worker subprocess whose stdout lines are read by a thread into a queue."""

    def __init__(self, cache_dir: Path, durability: str, run_seed: int, stderr_path: Path, hold: tuple = ()):
        self._stderr = open(stderr_path, "wb")
        self.stderr_path = stderr_path
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.crash_worker", str(cache_dir), durability, str(run_seed),
             *(str(x) for x in hold)],
            cwd=REPO, stdout=subprocess.PIPE, stderr=self._stderr, env=dict(os.environ),
        )  # fmt: skip
        self.lines: queue.Queue = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for raw in self.proc.stdout:
            self.lines.put(raw.decode().rstrip("\n"))
        self.lines.put(None)  # EOF

    def read_until(self, target: str, occurrence: int) -> list[str]:
        """Lines up to the `occurrence`-th one that is `target` or starts with `target + ' '`.

        Fails the test if the worker ends or stalls first.
        """
        got: list[str] = []
        seen = 0
        while seen < occurrence:
            line = self.lines.get(timeout=LINE_TIMEOUT_S)
            if line is None:
                self.proc.wait(timeout=30)
                pytest.fail(f"worker ended (rc {self.proc.returncode}) before {target!r} x{occurrence}:\n"
                            f"{self.stderr_path.read_text()[-3000:]}")
            got.append(line)
            seen += line == target or line.startswith(target + " ")
        return got

    def kill(self) -> None:
        """SIGKILL, then reap: a zombie would still look alive to the temp-file owner check."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)
        self._reader.join(timeout=30)
        self._stderr.close()
        assert self.proc.returncode == -signal.SIGKILL, f"worker was not killed by SIGKILL: rc {self.proc.returncode}"


def kvtool_validate(cache_dir: Path) -> tuple[int, dict]:
    """The real `kvtool validate --json` in a subprocess: (exit code, report)."""
    res = subprocess.run(
        [sys.executable, "-m", "kvtool.cli.app", "validate", "--cache-dir", str(cache_dir), "--json"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert res.returncode in (0, 1), f"validate exit {res.returncode}: {res.stderr}"
    return res.returncode, json.loads(res.stdout)


def in_process_validate(cache_dir: Path) -> tuple[int, dict]:
    """`kvtool.ops.validate.validate`, with the CLI's exit-code rule (1 iff problems)."""
    doc = validate(cache_dir).to_dict()
    return (1 if doc["problems"] else 0), doc


def assert_rows_match_files(cache_dir: Path) -> int:
    """Segment rows and segment files match one to one, block rows and segment rows agree, no
    temp file anywhere. Returns the number of block rows."""
    temps = [os.path.join(d, f) for d, _, files in os.walk(cache_dir) for f in files if f.endswith(".tmp")]
    assert temps == [], f"temp files left: {temps}"
    rows_total = 0
    for ns in sorted(cache_dir.iterdir()):
        if not (NAMESPACE_RE.match(ns.name) and (ns / "index.sqlite").exists()):
            continue
        con = sqlite3.connect(f"file:{ns / 'index.sqlite'}?mode=ro", uri=True)
        try:
            tables = {t for (t,) in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
            # no tables: killed while the namespace was being created (validate: 'uninitialized')
            has_tables = {"blocks", "segments"} <= tables
            segments = {n for (n,) in con.execute("SELECT name FROM segments")} if has_tables else set()
            used = {n for (n,) in con.execute("SELECT DISTINCT segment FROM blocks")} if has_tables else set()
            n_rows = con.execute("SELECT COUNT(*) FROM blocks").fetchone()[0] if has_tables else 0
        finally:
            con.close()
        files = {}
        for p in ns.rglob("*.safetensors"):
            stem = p.name[: -len(".safetensors")]
            assert p.parent.parent == ns and p.parent.name == stem[:2], f"segment file out of place: {p}"
            files[stem] = p
        assert set(files) - segments == set(), f"segment files without a segment row: {sorted(set(files) - segments)[:5]}"
        assert segments - set(files) == set(), f"segment rows without a file: {sorted(segments - set(files))[:5]}"
        assert used == segments, f"block rows / segment rows disagree: {sorted(used ^ segments)[:5]}"
        rows_total += n_rows
    return rows_total


# Kill targets: (line, max occurrence, max delay after it). The m-th occurrence of the line is
# read (m random in [1, max]), then the worker gets a random delay and is killed. 'start' + up to
# 1.6 s lands in imports / model load; 'loaded' + up to 20 ms in engine construction (geometry
# probe, SSD open, startup reconcile); 'req' in prefill/decode; 'op ...' / 'commit' inside a
# segment write or its index commit (writer thread); 'flush' in a writer drain; 'reopen' in a tier
# close and reopen; 'done' between requests. File operations and commits happen once per segment
# (about one per request), so their occurrences are counted in requests, like 'req'. ('op
# open_new' x1 is the startup write probe; 'op fsync_dir' counts the namespace directory's fsync
# after a new fan-out subdirectory as well as each segment directory's.)
TARGETS = {
    "start": (1, 1.6),
    "loaded": (1, 0.02),
    "req": (12, 0.004),
    "op open_new": (14, 0.002),
    "op write_all": (12, 0.002),
    "op replace": (12, 0.002),
    "commit": (12, 0.002),
    "flush": (4, 0.002),
    "reopen": (2, 0.01),
    "done": (12, 0.002),
}
DURABLE_TARGETS = {"op fsync": (12, 0.002), "op fsync_dir": (20, 0.002)}


def _kill_plans(rng: random.Random, durability: str, n: int) -> list[tuple[str, int, float]]:
    """n kill plans (target line, occurrence, delay); every target is used before any repeats."""
    targets = {**TARGETS, **(DURABLE_TARGETS if durability == "durable" else {})}
    order: list[str] = []
    while len(order) < n:
        names = sorted(targets)
        rng.shuffle(names)
        order += names
    plans = []
    for name in order[:n]:
        max_m, max_delay = targets[name]
        plans.append((name, rng.randint(1, max_m), rng.uniform(0.0, max_delay)))
    return plans


def _in_flight(lines: list[str]) -> list[int]:
    """Indices of the last two requests the worker started (the in-flight one last)."""
    started = [int(line.split()[1]) for line in lines if line.startswith("req ")]
    return started[-2:]


@pytest.mark.slow
@pytest.mark.parametrize("durability,seed", [("best_effort", 3101), ("durable", 3102)])
def test_sigkill_at_random_moments_then_validate_and_serve(tiny_model, tmp_path, durability, seed):
    rng = random.Random(seed)
    cache_dir = tmp_path / "kv"
    stream = crash_worker.token_stream(tiny_model.tokenizer)
    verify_cfg = KVToolConfig(ssd_cache_dir=cache_dir, block_size=crash_worker.BLOCK_SIZE, ssd_async_writes=False)
    phases: dict[str, int] = {}
    repaired_rounds = 0
    ssd_hit_tokens = 0
    rows_kept = 0  # block rows after the previous round: a kill may never lose a committed block
    for round_no, (target, occurrence, delay) in enumerate(_kill_plans(rng, durability, KILLS)):
        run_seed = seed * 1000 + round_no
        # File and index operations: the worker holds right after announcing the chosen one, so
        # the kill deterministically lands just before it (mid-write); other targets: random delay.
        hold = (target, occurrence) if target.startswith("op ") or target == "commit" else ()
        worker = Worker(cache_dir, durability, run_seed, tmp_path / f"worker{round_no}.err", hold)
        lines = worker.read_until(target, occurrence)
        time.sleep(delay)  # where the kill lands, not a synchronisation
        worker.kill()
        phases[target] = phases.get(target, 0) + 1

        if not cache_dir.exists():  # killed before the tier was opened: nothing to check on disk
            assert not any(line.startswith("attached") for line in lines)
            continue
        check = kvtool_validate if round_no % CLI_EVERY == 0 else in_process_validate
        code, doc = check(cache_dir)
        assert code == (1 if doc["problems"] else 0)
        for ns in doc["namespaces"]:
            # 'uninitialized': killed while creating the namespace (index file, no schema yet):
            # nothing was stored, nothing to repair, the next open completes it. Otherwise the
            # namespace is usable ('ok', or 'empty' before its first segment) and validate's
            # outcome is 'clean' or 'repaired'.
            if ns["status"] != "uninitialized":
                assert ns["status"] in ("ok", "empty") and ns["outcome"] in ("clean", "repaired"), ns
            bad = {k: ns[k] for k in FORBIDDEN if ns.get(k)}
            assert not bad, f"round {round_no} (kill at {target!r} x{occurrence}): validate found {bad}: {ns['details']}"
        repaired_rounds += code
        code2, doc2 = check(cache_dir)
        assert code2 == 0, f"second validate not clean after round {round_no}: {doc2}"
        rows = assert_rows_match_files(cache_dir)
        assert rows >= rows_kept, f"round {round_no} (kill at {target!r} x{occurrence}): {rows_kept - rows} block(s) lost"

        engine = Engine(tiny_model, verify_cfg)
        try:
            for j in _in_flight(lines) or [0]:
                ids = crash_worker.prompt_for(stream, run_seed, j)
                res = engine.generate(ids, max_tokens=VERIFY_TOKENS)
                ref = reference_tokens(tiny_model.model, tiny_model.tokenizer, ids, max_tokens=VERIFY_TOKENS)
                assert res.token_ids == ref, f"round {round_no} request {j}: cached output differs"
                ssd_hit_tokens += res.ssd_hit_tokens
        finally:
            assert engine.close().shutdown_clean
        rows_kept = assert_rows_match_files(cache_dir)

    print(f"\n{durability}: kill points {dict(sorted(phases.items()))}; rounds needing repair {repaired_rounds}/{KILLS};"
          f" {rows_kept} block rows at the end, 0 lost")
    # The test must be able to fail: kills must land mid-write (some rounds needed repairs)
    # and the verifying serves must have read the crashed cache.
    assert repaired_rounds >= 1
    assert ssd_hit_tokens > 0


_KILL_DURING_OPEN = """
import os, signal, sys
from kvtool.disk.index import BlockIndex
from kvtool.disk.namespace import SSDStore
from tests.store_helpers import make_layout, make_meta

def die(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)

setattr(BlockIndex, sys.argv[2], die)
SSDStore(sys.argv[1], make_layout(), make_meta())
"""


@pytest.mark.parametrize("where,method", [
    ("before_schema", "_transaction"),  # BlockIndex.__init__ connected (file exists), no tables yet
    ("before_meta", "get_meta"),  # schema committed, SSDStore._open has not written the meta yet
])  # fmt: skip
@pytest.mark.slow
def test_sigkill_while_a_new_namespace_is_created(tmp_path, where, method):
    """Regression for a crash window the random test can hit ('loaded' target): a process killed
    while `SSDStore._open` creates a new namespace leaves `index.sqlite` without tables or with an
    empty `meta`. `kvtool validate` must still leave the cache clean (second run exits 0), as
    after any other kill; the engine itself already reinitialises such an index on open."""
    cache_dir = tmp_path / "kv"
    res = subprocess.run([sys.executable, "-c", _KILL_DURING_OPEN, str(cache_dir), method], cwd=REPO, timeout=120)
    assert res.returncode == -signal.SIGKILL
    assert list(cache_dir.glob("*/index.sqlite"))
    kvtool_validate(cache_dir)
    code2, doc2 = kvtool_validate(cache_dir)
    assert code2 == 0, f"second validate exits {code2}: {doc2['namespaces']}"
