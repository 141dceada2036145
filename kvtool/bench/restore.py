"""The restore benchmark (docs/benchmarks.md#restore-path): how fast a cached prompt's KV comes back.

For each KV shape and prompt length, one run measures, every measurement in a fresh process,
cold (page cache of the files dropped) and warm (files read through first), `repeats` times:

- `raw-read`: the same bytes read from one file with `os.preadv` (the disk ceiling);
- `mlx-lm`: `load_prompt_cache` + eval of a `save_prompt_cache` file of the same KV;
- `kvtool`: `fetch` of the same KV stored through kvtool (`restore_worker.store_kv`);
- `append-after-prefill`: the first-append reference (a cache filled as a prefill fills it).

For the real `ttft_model` (default `tiny`): time to first token of an SSD hit (`kvtool serve-once`
in a fresh process), of recompute (`serve-once --no-ssd`), and of mlx-lm's `load_prompt_cache`
+ forward of the last prompt token. Writer: kvtool's store + flush MB/s against `dd` and a
Python write loop of the same bytes.

Writes `<out>/measurements.csv` (every measurement), `summary.csv` (median, min, max),
`run.json` (spec, machine) and `report.md` (`restore_report`). Rows go to disk after every
section, so an interrupted run keeps what it measured.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from kvtool.bench import machine, restore_report
from kvtool.bench import restore_pagecache as pagecache
from kvtool.bench import restore_worker as worker
from kvtool.bench.loadserver import child_env
from kvtool.bench.restore_worker import KVShape, resolve_api

DEFAULT_LENGTHS = (1024, 4096, 16384, 32768)
DEFAULT_REPEATS = 3
DEFAULT_WRITER_MB = 256
DEFAULT_OUT_ROOT = Path("results/restore")
DEFAULT_WORKER_TIMEOUT_S = 1800
STATES = ("cold", "warm")
PARTS = ("load", "ttft", "writer")
NO_STATE = "n/a"  # recompute and writer rows: no cached files to be cold or warm

SHAPES: dict[str, KVShape] = {
    # the default preset's real KV (kvtool/models/embedded.py: tiny = 2 layers, 2 KV heads,
    # hidden 128 / 4 heads = head_dim 32, float32)
    "tiny": KVShape("tiny", 2, 2, 32, "float32"),
    "qwen0.5b-f32": KVShape("qwen0.5b", 24, 2, 64, "float32"),
    "qwen0.5b-bf16": KVShape("qwen0.5b", 24, 2, 64, "bfloat16"),
}
DEFAULT_SHAPES = tuple(SHAPES)

COLUMNS = [
    "section", "shape", "dtype", "prompt_tokens", "kv_bytes", "method", "cache_state", "repeat",
    "ms", "gbps", "bytes_io", "peak_rss_bytes", "peak_rss_ratio", "resident_before", "drop",
    "open_ms", "ssd_load_ms", "ssd_hit_tokens", "cached_tokens", "first_token", "first_append_ms",
    "sync_ms", "kv_ok", "kvtool_api",
]


@dataclass
class RestoreSpec:
    """What one run measures.

    Attributes:
        lengths: prompt lengths (tokens).
        shapes: keys of `SHAPES` for the load path.
        states: `cold` and/or `warm`.
        repeats: measurements per (shape, length, method, state).
        recompute_repeats: TTFT recompute measurements per length (None: `repeats`).
        parts: `load` (raw/mlx-lm/kvtool restore), `ttft` (real model), `writer`.
        out: run directory (default `results/restore/<timestamp>/`).
        work_dir: where the data files go (default `<out>/data`, removed at the end).
        drop: `fadvise` (per file, global drop as fallback) or `global`.
        kvtool_api: `auto` or `prefix` (see `restore_worker.resolve_api`).
        methods: load-path methods to run (drop `kvtool` to measure the baselines only).
        block_size: kvtool block size (None: kvtool's default).
        ttft_model: embedded preset for the TTFT part.
        ttft_kv: `prefill` (the prompt is prefilled once, kvtool's and mlx-lm's caches hold its
            real KV) or `synthetic` (both hold the same random KV, no prefill and no recompute
            row: for shapes whose prefill takes hours here, e.g. `qwen0.5b`).
        writer_mb: megabytes written per writer measurement.
        writer_shape: key of `SHAPES` for the writer.
        seed: synthetic KV and token-id seed.
        keep_data: keep `work_dir` after the run.
        note: free text shown at the top of report.md (e.g. what tree was measured).
    """

    lengths: tuple[int, ...] = DEFAULT_LENGTHS
    shapes: tuple[str, ...] = DEFAULT_SHAPES
    states: tuple[str, ...] = STATES
    repeats: int = DEFAULT_REPEATS
    recompute_repeats: int | None = None
    parts: tuple[str, ...] = PARTS
    out: Path | None = None
    work_dir: Path | None = None
    drop: str = "fadvise"
    kvtool_api: str = "auto"
    methods: tuple[str, ...] = ("raw-read", "mlx-lm", "kvtool")
    block_size: int | None = None
    ttft_model: str = "tiny"
    ttft_kv: str = "prefill"
    writer_mb: float = DEFAULT_WRITER_MB
    writer_shape: str = "qwen0.5b-f32"
    seed: int = 0
    keep_data: bool = False
    note: str = ""
    python: str = field(default_factory=lambda: sys.executable)

    def validate(self) -> None:
        """Raise ValueError naming the first bad field."""
        bad = [s for s in (*self.shapes, self.writer_shape) if s not in SHAPES]
        if bad:
            raise ValueError(f"unknown shape {bad[0]!r} (choose from: {', '.join(SHAPES)})")
        for name, values, allowed in (("states", self.states, STATES), ("parts", self.parts, PARTS),
                                      ("methods", self.methods, ("raw-read", "mlx-lm", "kvtool"))):
            if not values or any(v not in allowed for v in values):
                raise ValueError(f"{name} must be a non-empty subset of {', '.join(allowed)}, got {values}")
        if self.repeats < 1 or not self.lengths or min(self.lengths) < 2:
            raise ValueError("repeats must be >= 1 and every length >= 2")
        if self.recompute_repeats is not None and self.recompute_repeats < 1:
            raise ValueError("recompute repeats must be >= 1")
        if self.drop not in pagecache.DROP_METHODS:
            raise ValueError(f"drop must be one of {', '.join(pagecache.DROP_METHODS)}")
        resolve_api(self.kvtool_api)


class WorkerError(RuntimeError):
    """A measurement process failed; the message holds the tail of its stderr."""


def run_worker(python: str, mode: str, args: dict, timeout: float = DEFAULT_WORKER_TIMEOUT_S) -> dict:
    """Run one `restore_worker` measurement in a fresh process and return its JSON result."""
    proc = subprocess.run([python, "-m", "kvtool.bench.restore_worker", mode, json.dumps(args)],
                          capture_output=True, text=True, timeout=timeout, env=child_env())
    if proc.returncode != 0:
        raise WorkerError(f"worker {mode} exited {proc.returncode}: {proc.stderr.strip()[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def set_state(paths: list[Path], state: str, drop_method: str) -> tuple[float | None, str]:
    """Make `paths` cold (dropped) or warm (read through); returns (resident fraction, drop done)."""
    if state == "cold":
        done = pagecache.drop(paths, drop_method)
    else:
        pagecache.warm(paths)
        done = ""
    return pagecache.resident_fraction(pagecache.files_under(paths)), done


def make_row(section: str, shape: KVShape, n: int, method: str, state: str, rep: int, res: dict, **extra) -> dict:
    """One CSV row of `COLUMNS`; `gbps` = KV bytes / time (GB/s) and `peak_rss_ratio` = peak RSS / KV bytes."""
    kv_bytes = extra.pop("kv_bytes", n * shape.bytes_per_token())
    row: dict[str, Any] = {c: "" for c in COLUMNS}
    row.update(section=section, shape=shape.name, dtype=shape.dtype, prompt_tokens=n, kv_bytes=kv_bytes,
               method=method, cache_state=state, repeat=rep)
    row.update({k: v for k, v in res.items() if k in row and v is not None})
    row.update(extra)
    ms = res.get("ms")
    if ms and section != "ttft":
        row["gbps"] = kv_bytes / (ms * 1e-3) / 1e9
    if res.get("peak_rss_bytes") is not None:
        row["peak_rss_ratio"] = res["peak_rss_bytes"] / kv_bytes
    return row


class Recorder:
    """Collects rows, writes `measurements.csv` on every `save`, prints progress."""

    def __init__(self, out: Path, log: Callable[[str], None]):
        self.out, self.log = out, log
        self.rows: list[dict] = []

    def add(self, row: dict) -> None:
        self.rows.append(row)
        ms = row["ms"]
        ms_txt = f"{ms:9.1f} ms" if isinstance(ms, float) else f"{ms!s:>9} ms"
        self.log(f"  {row['shape']:>9} {row['dtype']:<8} {row['prompt_tokens']:>6} {row['method']:<22} "
                 f"{row['cache_state']:<4} #{row['repeat']} {ms_txt}")

    def save(self) -> None:
        restore_report.write_csv(self.out / "measurements.csv", self.rows, COLUMNS)


# ------------------------------------------------------------------ load path
def prepare_load(spec: RestoreSpec, shape: KVShape, n: int, d: Path) -> dict[str, Any]:
    """Write the same synthetic KV as a raw file, an mlx-lm prompt cache and kvtool blocks."""
    import mlx.core as mx

    d.mkdir(parents=True, exist_ok=True)
    ids = worker.token_ids(n, spec.seed)
    np.save(d / "ids.npy", ids)
    pairs = worker.synthetic_kv(shape, n, spec.seed)
    # a full hit may come back trimmed by one token (re-forward of the last one): both crcs known
    info: dict[str, Any] = {"ids": d / "ids.npy", "crc": {t: worker.kv_crc(pairs, t) for t in (n, n - 1)}}
    info["raw_bytes"] = worker.write_raw(d / "raw.bin", pairs)
    worker.save_mlxlm(d / "mlx-lm.safetensors", worker.make_cache(pairs), ids)
    if "kvtool" in spec.methods:
        worker.store_kv(d / "kvtool", shape, ids, worker.make_cache(pairs), block_size=spec.block_size)
    info["append_ref_ms"] = [worker.append_after_prefill_ms(pairs) for _ in range(spec.repeats)]
    del pairs
    gc.collect()
    mx.clear_cache()
    os.sync()
    return info


def measure_load(spec: RestoreSpec, shape: KVShape, n: int, d: Path, rec: Recorder) -> None:
    """Every load-path measurement of one (shape, length)."""
    info = prepare_load(spec, shape, n, d)
    for rep, ms in enumerate(info["append_ref_ms"]):
        rec.add(make_row("load", shape, n, "append-after-prefill", NO_STATE, rep, {"ms": ms, "first_append_ms": ms}))
    jobs = {
        "raw-read": ([d / "raw.bin"], "raw", {"path": str(d / "raw.bin"), "nbytes": info["raw_bytes"]}),
        "mlx-lm": ([d / "mlx-lm.safetensors"], "mlxlm",
                   {"path": str(d / "mlx-lm.safetensors"), "ids": str(info["ids"])}),
        "kvtool": ([d / "kvtool"], "kvtool", {"cache_dir": str(d / "kvtool"), "ids": str(info["ids"]),
                                             "shape": asdict(shape), "block_size": spec.block_size}),
    }
    for rep in range(spec.repeats):
        for state in spec.states:
            for method in rotated(spec.methods, rep):
                paths, mode, args = jobs[method]
                resident, dropped = set_state(paths, state, spec.drop)
                res = run_worker(spec.python, mode, args)
                got = res.get("cached_tokens", n)
                ok = got in info["crc"] and res.get("kv_crc") == info["crc"][got] and res.get("tokens_ok", True)
                rec.add(make_row("load", shape, n, method, state, rep, res, resident_before=resident,
                                 drop=dropped, kv_ok=bool(ok)))


# ------------------------------------------------------------------ TTFT (real model)
def prompt_ids(model_path: Path, n: int) -> tuple[np.ndarray, str]:
    """`n` token ids of Python's pydoc topics text that decode and re-encode to themselves."""
    import logging
    import pydoc_data.topics as topics

    from mlx_lm.tokenizer_utils import load as load_tokenizer

    logging.getLogger("transformers").setLevel(logging.ERROR)  # "longer than the maximum length"
    tok = load_tokenizer(Path(model_path))
    text = "\n\n".join(topics.topics[k] for k in sorted(topics.topics))
    while True:
        ids = tok.encode(text)
        if len(ids) >= n:
            break
        text = text + "\n\n" + text
    ids = ids[:n]
    again = tok.encode(tok.decode(ids))
    if again != ids:
        raise ValueError(f"a {n}-token prompt does not re-encode to itself; choose another length")
    return np.asarray(ids, dtype=np.int32), tok.decode(ids)


RAW_PROMPT_FLAG = "--ignore-chat-template"  # the prompt file holds the exact tokens: no chat template


def serve_once(spec: RestoreSpec, prompt_file: Path, cache_dir: Path, *extra: str) -> dict:
    """`kvtool serve-once --json --max-tokens 1 --ignore-chat-template` in a fresh process; its
    first request. Trees whose serve-once has no chat template (no such flag) run without it."""
    cmd = [*kvtool_cmd(spec), "serve-once", "--model", spec.ttft_model, "--json",
           "--max-tokens", "1", "--prompt-file", str(prompt_file), "--cache-dir", str(cache_dir), *extra]
    if spec.block_size:
        cmd += ["--block-size", str(spec.block_size)]
    proc = subprocess.run([*cmd, RAW_PROMPT_FLAG], capture_output=True, text=True,
                          timeout=DEFAULT_WORKER_TIMEOUT_S, env=child_env())
    if proc.returncode == 2 and f"no such option: {RAW_PROMPT_FLAG}" in proc.stderr.lower():
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=DEFAULT_WORKER_TIMEOUT_S, env=child_env())
    if proc.returncode != 0:
        raise WorkerError(f"serve-once exited {proc.returncode}: {proc.stderr.strip()[-2000:]}")
    return json.loads(proc.stdout)["requests"][0]


def kvtool_cmd(spec: RestoreSpec) -> list[str]:
    """The `kvtool` console script next to `spec.python`, else `python -m kvtool.cli.app`."""
    script = Path(spec.python).parent / "kvtool"
    return [str(script)] if script.is_file() else [spec.python, "-m", "kvtool.cli.app"]


def model_path(spec: RestoreSpec) -> Path:
    """`kvtool model path NAME` (builds the preset on first use)."""
    cmd = [*kvtool_cmd(spec), "model", "path", spec.ttft_model]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=child_env())
    return Path(out.stdout.strip().splitlines()[-1])


def measure_ttft(spec: RestoreSpec, n: int, d: Path, mpath: Path, shape: KVShape, rec: Recorder) -> None:
    """TTFT of an SSD hit, recompute and mlx-lm's prompt cache for one prompt length."""
    d.mkdir(parents=True, exist_ok=True)
    ids, text = prompt_ids(mpath, n)
    (d / "prompt.txt").write_text(text)
    np.save(d / "ids.npy", ids)
    kv_dir, mlx_file = d / "kvtool-cache", d / "mlx-lm.safetensors"
    if spec.ttft_kv == "synthetic":  # same random KV in both caches; the first SSD hit is the reference
        run_worker(spec.python, "ttft_seed_synthetic", {"model": spec.ttft_model, "ids": str(d / "ids.npy"),
                                                        "cache_dir": str(kv_dir), "path": str(mlx_file),
                                                        "block_size": spec.block_size})
        first = serve_once(spec, d / "prompt.txt", kv_dir)
        if first["cached_tokens"] != n - 1:
            raise WorkerError(f"the seeded kvtool cache served {first['cached_tokens']} of {n} tokens")
    else:
        first = serve_once(spec, d / "prompt.txt", kv_dir)  # cold prefill, writes the blocks
        run_worker(spec.python, "mlxlm_ttft_save", {"model_path": str(mpath), "ids": str(d / "ids.npy"),
                                                    "path": str(mlx_file)})
    if first["prompt_tokens"] != n:
        raise WorkerError(f"serve-once saw {first['prompt_tokens']} prompt tokens, expected {n}")
    os.sync()
    recompute = spec.repeats if spec.recompute_repeats is None else spec.recompute_repeats
    if spec.ttft_kv == "synthetic":
        recompute = 0  # a prefill is what synthetic KV avoids
    for rep in range(spec.repeats):
        if rep < recompute:
            r = serve_once(spec, d / "prompt.txt", d / "no-ssd", "--no-ssd")
            rec.add(make_row("ttft", shape, n, "recompute", NO_STATE, rep, _serve_res(r), kv_ok=True))
        for state in spec.states:
            for method in rotated(("kvtool-ssd-hit", "mlx-lm-load+last"), rep):
                kvtool = method == "kvtool-ssd-hit"
                resident, dropped = set_state([kv_dir if kvtool else mlx_file], state, spec.drop)
                if kvtool:
                    r = serve_once(spec, d / "prompt.txt", kv_dir)
                    res, ok = _serve_res(r), r["ssd_hit_tokens"] > 0 and r["token_ids"][:1] == first["token_ids"][:1]
                else:
                    res = run_worker(spec.python, "mlxlm_ttft", {"model_path": str(mpath), "ids": str(d / "ids.npy"),
                                                                 "path": str(mlx_file)})
                    ok = bool(res["tokens_ok"]) and [res["first_token"]] == first["token_ids"][:1]
                rec.add(make_row("ttft", shape, n, method, state, rep, res, resident_before=resident, drop=dropped,
                                 kv_ok=ok))


def rotated(methods, rep: int) -> tuple:
    """`methods` starting at position `rep` (mod their count): each method goes first in turn,
    so none always runs right after another's process (memory the VM's host has just reclaimed,
    page cache another method just filled)."""
    k = rep % len(methods) if methods else 0
    return tuple(methods[k:]) + tuple(methods[:k])


def ttft_shape(preset: str) -> KVShape:
    """The real KV layout of an embedded preset (all float32)."""
    from kvtool.models import embedded

    p = embedded.get_preset(preset)
    return KVShape(p.name, p.num_hidden_layers, p.num_key_value_heads, p.head_dim,
                   str(getattr(p, "dtype", "float32")))


def _serve_res(r: dict) -> dict:
    return {"ms": r["ttft_ms"], "ssd_load_ms": r["ssd_load_ms"], "ssd_hit_tokens": r["ssd_hit_tokens"],
            "cached_tokens": r["cached_tokens"], "bytes_io": r["ssd_bytes_read"],
            "first_token": (r["token_ids"] or [""])[0]}


# ------------------------------------------------------------------ writer
def measure_writer(spec: RestoreSpec, d: Path, rec: Recorder) -> None:
    """kvtool store + flush (best_effort, async writer) against dd and a Python write loop."""
    shape = SHAPES[spec.writer_shape]
    bs = spec.block_size or 64
    n = max(bs, round(spec.writer_mb * 1e6 / shape.bytes_per_token() / bs) * bs)
    kv_bytes = n * shape.bytes_per_token()
    d.mkdir(parents=True, exist_ok=True)
    dd_bs = pagecache.DD_BLOCK_BYTES if kv_bytes >= pagecache.DD_BLOCK_BYTES else 1 << 20
    count = max(1, -(-kv_bytes // dd_bs))
    for rep in range(spec.repeats):
        if "kvtool" in spec.methods:
            target = d / "kvtool-writer"
            shutil.rmtree(target, ignore_errors=True)
            pagecache.recycle_pages(d, kv_bytes)
            res = run_worker(spec.python, "writer", {"cache_dir": str(target), "shape": asdict(shape), "n_tokens": n,
                                                     "block_size": spec.block_size, "seed": spec.seed})
            for method, r in (("kvtool-writer", res), ("kvtool-writer-first", dict(res, ms=res["first_ms"])),
                              ("kvtool-writer+sync", dict(res, ms=res["ms"] + res["sync_ms"]))):
                rec.add(make_row("writer", shape, n, method, NO_STATE, rep, r, kv_bytes=kv_bytes))
            shutil.rmtree(target, ignore_errors=True)
        pagecache.recycle_pages(d, kv_bytes)
        rec.add(make_row("writer", shape, n, "dd-fdatasync", NO_STATE, rep, pagecache.dd_write(d / "dd.bin", dd_bs, count),
                         kv_bytes=count * dd_bs))
        pagecache.recycle_pages(d, kv_bytes)
        for method, r in zip(("python-write", "python-write+fdatasync"), pagecache.python_write(d / "py.bin", kv_bytes)):
            rec.add(make_row("writer", shape, n, method, NO_STATE, rep, r, kv_bytes=kv_bytes))


# ------------------------------------------------------------------ run
def run(spec: RestoreSpec, log: Callable[[str], None] = print, command: str | None = None) -> Path:
    """Run the benchmark; returns the run directory (CSV files, run.json, report.md).

    Args:
        spec: what to measure.
        log: progress lines.
        command: the command line, recorded in run.json and report.md.
    """
    spec.validate()
    out = Path(spec.out or DEFAULT_OUT_ROOT / datetime.now().strftime("%Y%m%d-%H%M%S"))
    out.mkdir(parents=True, exist_ok=True)
    work = Path(spec.work_dir or out / "data")
    work.mkdir(parents=True, exist_ok=True)
    started = time.time()
    doc: dict[str, Any] = {"command": command, "spec": asdict(spec), "kvtool_api": resolve_api(spec.kvtool_api),
           "started": datetime.now().astimezone().isoformat(), "git_commit": machine.git_commit(),
           "machine": machine.machine_info(work), "columns": COLUMNS,
           "drop_method": "posix_fadvise(DONTNEED) per file after fsync; drop_caches=3 if pages stay resident"
           if spec.drop == "fadvise" else "sync; echo 3 > /proc/sys/vm/drop_caches"}
    (out / "run.json").write_text(json.dumps(doc, indent=2, default=str))  # Paths as strings
    doc["load_average_start"] = machine.load_average(2)  # other work skews the timings
    rec = Recorder(out, log)
    try:
        if "load" in spec.parts:
            for key in spec.shapes:
                for n in spec.lengths:
                    log(f"load path: {key}, {n} tokens")
                    d = work / f"{key}-{n}"
                    measure_load(spec, SHAPES[key], n, d, rec)
                    shutil.rmtree(d, ignore_errors=True)
                    rec.save()
        if "ttft" in spec.parts:
            mpath = model_path(spec)
            shape = ttft_shape(spec.ttft_model)
            for n in spec.lengths:
                log(f"TTFT: {spec.ttft_model}, {n} tokens")
                measure_ttft(spec, n, work / f"ttft-{n}", mpath, shape, rec)
                rec.save()
        if "writer" in spec.parts:
            log(f"writer: {spec.writer_mb} MB")
            measure_writer(spec, work / "writer", rec)
    finally:
        rec.save()
        doc["duration_s"] = round(time.time() - started, 1)
        doc["load_average_end"] = machine.load_average(2)
        (out / "run.json").write_text(json.dumps(doc, indent=2, default=str))
        if not spec.keep_data:
            shutil.rmtree(work, ignore_errors=True)
    restore_report.write_outputs(out, rec.rows, doc)
    return out

