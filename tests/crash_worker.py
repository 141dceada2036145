"""Worker process for tests/test_crash.py: serve prompts forever with async write-through.

Usage: python -m tests.crash_worker CACHE_DIR DURABILITY RUN_SEED

It prints one line per phase and per SSD file operation, before the operation starts, so the
parent can SIGKILL it after a chosen number of lines (plus a random micro-delay) and thereby land
kills spread over model load, prefill/decode, segment file writes, index commits, writer drains and
tier reopenings. A request's new entries (full blocks and its tail entry) are written as one
segment file (queued batches may coalesce into one), so file operations and commits are
announced once per segment, not once per block:

    start                    before imports and model load
    loaded                   model loaded
    attached                 engine built (SSD tier opened, startup reconcile done)
    req <j>                  request j starts (prefill + decode; blocks enqueued after token 1)
    op <name>                the SSD tier is about to call FileOps.<name> (writer thread)
    commit                   the SSD store is about to insert a segment's rows (writer thread)
    done <j>                 request j returned
    flush / flushed          engine.flush(): writer drain + index flush
    reopen / reopened        engine.reconfigure(same config): stop writer, close index, reattach

Prompts are deterministic functions of (RUN_SEED, j), see `prompt_for`, so the parent can rebuild
the prompt that was in flight when it killed the worker. Only the tracing is added around the real
parts: the real model, files, SQLite index and writer thread run unchanged.
"""

from __future__ import annotations

import os
import random
import sys
import threading
import time

BLOCK_SIZE = 16
MAX_TOKENS = 4
SHARED_PREFIX_TOKENS = 3 * BLOCK_SIZE  # every prompt starts with these: dedup across runs
MAX_REQUESTS = 400  # a worker that is never killed still ends
DEMO_PROMPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "kvtool", "assets", "demo_prompt.txt")

_out_lock = threading.Lock()
HOLD_S = 1.0  # pause after announcing the kill target, so the kill lands before that operation
_hold = {"target": None, "occurrence": 0, "seen": 0}


def emit(line: str) -> None:
    """One unbuffered line on stdout (atomic w.r.t. the other thread).

    If `line` is the hold target's n-th occurrence (argv 4 and 5), the announcing thread then
    pauses: the parent's SIGKILL lands after the announcement and before the operation itself
    (e.g. a temp file opened but not written, written but not renamed, renamed but not indexed),
    whatever the scheduling.
    """
    with _out_lock:
        os.write(1, (line + "\n").encode())
        target = _hold["target"]
        hit = target is not None and (line == target or line.startswith(target + " "))
        if hit:
            _hold["seen"] += 1
    if hit and _hold["seen"] == _hold["occurrence"]:
        time.sleep(HOLD_S)


def token_stream(tokenizer) -> list[int]:
    with open(DEMO_PROMPT, encoding="utf-8") as fh:
        return list(tokenizer.encode(fh.read()))


def prompt_for(stream: list[int], run_seed: int, j: int) -> list[int]:
    """Prompt j of a run: the shared prefix, then 1-3 random slices of the stream.

    Every prompt gets a new chain after the shared prefix (new blocks to write); odd requests
    repeat the previous prompt's first slice, so they also hit blocks of the previous request
    (RAM, pending writes or SSD).
    """
    rng = random.Random(run_seed * 100_003 + j)
    prefix = stream[:SHARED_PREFIX_TOKENS]
    body: list[int] = []
    if j % 2 == 1:
        prev = random.Random(run_seed * 100_003 + j - 1)
        off = prev.randrange(SHARED_PREFIX_TOKENS, len(stream) - 200)
        body += stream[off : off + prev.randrange(40, 200)]
    for _ in range(rng.randrange(1, 4)):
        off = rng.randrange(SHARED_PREFIX_TOKENS, len(stream) - 200)
        body += stream[off : off + rng.randrange(20, 120)]
    return prefix + body


def main(argv: list[str]) -> int:
    cache_dir, durability, run_seed = argv[0], argv[1], int(argv[2])
    if len(argv) >= 5:
        _hold.update(target=argv[3], occurrence=int(argv[4]))
    emit("start")

    from kvtool.config import KVToolConfig
    from kvtool.disk.fsops import FileOps
    from kvtool.disk.index import BlockIndex
    from kvtool.engine import Engine
    from kvtool.models.loader import load_model

    class TracingFS(FileOps):
        """The real file operations, each announced on stdout before it runs."""

    for name in ("makedirs", "open_new", "write_all", "fsync", "close", "fsync_dir", "replace", "unlink"):
        def traced(self, *args, _name=name, **kw):
            emit(f"op {_name}")
            return getattr(FileOps, _name)(self, *args, **kw)

        setattr(TracingFS, name, traced)

    real_insert = BlockIndex.insert_segment

    def traced_insert(self, *args, **kw):
        emit("commit")
        return real_insert(self, *args, **kw)

    BlockIndex.insert_segment = traced_insert  # tracing only: the real insert runs

    loaded = load_model("tiny")
    emit("loaded")
    cfg = KVToolConfig(
        ssd_cache_dir=cache_dir,
        block_size=BLOCK_SIZE,
        ssd_policy="write_through",
        ssd_async_writes=True,
        ssd_durability=durability,
    )
    engine = Engine(loaded, cfg, fs=TracingFS())
    emit("attached")
    stream = token_stream(loaded.tokenizer)
    for j in range(MAX_REQUESTS):
        emit(f"req {j}")
        engine.generate(prompt_for(stream, run_seed, j), max_tokens=MAX_TOKENS)
        emit(f"done {j}")
        if j % 3 == 2:
            emit("flush")
            engine.flush()
            emit("flushed")
        if j % 7 == 6:
            emit("reopen")
            engine.reconfigure(cfg)
            emit("reopened")
    engine.close()
    emit("end")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
