"""Operator commands at a million blocks: `validate`, `validate --deep`, `inspect`, `prune
--dry-run` and `rm NAMESPACE` timed in fresh processes, with their peak RSS, against the floor of
the same cache (`find | wc -l`, `du -s`, SQLite `count(*)`, one sequential read of the segment files, and
one of the segment files and the index),
at each size given (default 100k and 1M blocks), and the growth exponent between them.

The cache is built synthetically, no model: small records by default (block_size 16, one layer,
one KV head of 8 dims, float32: 1,088 bytes a record), since the cost under test is per block and
per segment; `--record tiny` builds records of a real block instead (the `tiny` preset at the
default block size 64: two layers of two KV heads of 32 dims, float32: 65,792 bytes a record,
~6.6 GB at 100k blocks), where the bytes weigh as in a real cache. Prompts are chains of 16 blocks from the namespace root, one segment each (as a
request's write batch); every fourth prompt continues an earlier one (chains to depth 64).
Segments are written with the real `segment.encode` and the index rows with the real
`BlockIndex`, a thousand segments per transaction.

    .venv/bin/python bench_configs/million_blocks.py                      # 100k and 1M blocks
    .venv/bin/python bench_configs/million_blocks.py --sizes 20000 --out /tmp/mb   # a quick look
    .venv/bin/python bench_configs/million_blocks.py --sizes 30000,100000 --record tiny   # real block size

Output: `<out>/million_blocks.json` (every measurement) and `<out>/report.md` (the table), by
default under `results/summaries/<date>-million-blocks[-<record>]-<commit>/`. The caches are
built under `--root` (default: a temporary directory) and deleted afterwards (the last command
timed, `rm`, removes the namespace; the directory goes after it; then each cache is built once
more for the floor of `rm`, `rm -rf` of the same files). Page cache: warm (the cache was just written; the floor's read
is warm too); dirty pages are synced before every timed command. kvtool's bytecode is compiled first
in each tree timed (`compileall`), as a pip install compiles it: with `PYTHONDONTWRITEBYTECODE=1`
in the environment (as on the machine this was written on) every command would otherwise compile its
~50 modules from source, ~0.1 s, in each run.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from kvtool.disk import segment as seg  # noqa: E402
from kvtool.disk.hostblock import HostBlock  # noqa: E402
from kvtool.disk.index import _COLUMNS, _SEG_COLUMNS, BlockIndex  # noqa: E402
from kvtool.disk.kvlayout import KVLayout  # noqa: E402
from kvtool.disk.names import INDEX_FILENAME, segment_relpath  # noqa: E402
from kvtool.disk.namespace import SSDStore  # noqa: E402
from kvtool.hashing import chain_hashes, layout_key, root_parent  # noqa: E402

PER_PROMPT = 16  # blocks per prompt = per segment
DTYPE = "float32"
# Record geometries: (tokens per block, layers, KV heads, head dim), float32.
RECORDS = {
    "small": (16, 1, 1, 8),  # 1,088 bytes a record: the per-block and per-segment cost, with little data
    "tiny": (64, 2, 2, 32),  # 65,792 bytes: a block of the `tiny` preset at the default block size (64)
}
BLOCK, _LAYERS, _HEADS, _DIM = RECORDS["small"]
KV = KVLayout.uniform(_LAYERS, _HEADS, _DIM, DTYPE)


def use_record(name: str) -> None:
    """Switch the record geometry the caches are built with (`RECORDS`)."""
    global BLOCK, KV, _LAYERS, _HEADS, _DIM
    BLOCK, _LAYERS, _HEADS, _DIM = RECORDS[name]
    KV = KVLayout.uniform(_LAYERS, _HEADS, _DIM, DTYPE)
MODEL_ID = "million-blocks-bench"
SEGMENTS_PER_TXN = 1000
# the targets at 1M blocks (docs/operations.md): seconds; `validate --deep` against one sequential read; peak RSS (MB)
TARGETS = {"validate": 10.0, "inspect": 10.0, "prune --dry-run": 10.0, "rm": 10.0}
DEEP_VS_READ = 3.0
RSS_MB = 400.0
EXPONENT = 1.05
KVTOOL = [sys.executable, "-m", "kvtool.cli.app"]


def build(cache_dir: Path, n_blocks: int, seed: int = 0) -> dict:
    """A namespace of `n_blocks` blocks under `cache_dir`; returns its name and sizes."""
    layout = layout_key(MODEL_ID, KV.spec, DTYPE, BLOCK, format_version=seg.FORMAT_VERSION)
    meta = {"model_id": MODEL_ID, "model_name": "million-blocks", "kv_dtype": DTYPE, "block_size": str(BLOCK),
            "kv_layers": KV.spec}  # fmt: skip
    SSDStore(cache_dir, layout, meta).close()  # the namespace and its meta, as a real process makes them
    ns_dir = cache_dir / layout
    root = root_parent(layout)
    rng = np.random.default_rng(seed)
    pool = [[rng.standard_normal((1, _HEADS, BLOCK, _DIM)).astype(np.float32) for _ in range(_LAYERS)]
            for _ in range(64)]  # KV bytes, per layer (content is not under test)  # fmt: skip
    index = BlockIndex(ns_dir / INDEX_FILENAME)
    made: set[str] = set()
    prompts: list[np.ndarray] = []  # token ids of each prompt so far (continuations extend one)
    t0 = time.perf_counter()
    pending_segments: list[tuple] = []
    pending_rows: list[tuple] = []
    written = files_bytes = 0
    now = time.time()
    while written < n_blocks:
        p = len(prompts)
        n = min(PER_PROMPT, n_blocks - written)
        new = rng.integers(0, 1 << 30, size=n * BLOCK, dtype=np.int32)
        base = prompts[p // 2] if p % 4 == 3 and prompts[p // 2].size <= 48 * BLOCK else np.zeros(0, np.int32)
        ids = np.concatenate([base, new])
        hashes = chain_hashes(ids, BLOCK, layout)
        first = base.size // BLOCK
        parents = [hashes[first - 1] if first else root, *hashes[first:-1]]
        blocks = [HostBlock(h, par, ids[(first + i) * BLOCK : (first + i + 1) * BLOCK], pool[(p + i) % 64],
                            pool[(p + i + 7) % 64], DTYPE) for i, (h, par) in enumerate(zip(hashes[first:], parents))]  # fmt: skip
        prompts.append(ids)
        buffers, slots = seg.encode(blocks, layout, KV, now)
        name = f"{rng.integers(0, 1 << 63):016x}{rng.integers(0, 1 << 63):016x}"
        path = ns_dir / segment_relpath(name)
        sub = path.parent.name
        if sub not in made:
            path.parent.mkdir(mode=0o700, exist_ok=True)
            made.add(sub)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.writev(fd, buffers)
        finally:
            os.close(fd)
        size = sum(b.nbytes for b in buffers)
        files_bytes += size
        pending_segments.append((name, size, len(blocks), now))  # a SegmentRow's columns
        ages = rng.uniform(0, 30 * 86400, size=len(blocks)).tolist()  # last uses spread over a month
        pending_rows += [(b.block_hash, b.parent_hash, name, s.index, s.n_tokens, s.nbytes, seg.tokens_digest(b.token_ids),
                          now, now - age) for b, s, age in zip(blocks, slots, ages)]  # an IndexRow's columns  # fmt: skip
        written += len(blocks)
        if len(pending_segments) >= SEGMENTS_PER_TXN or written >= n_blocks:
            with index.write_transaction() as cur:  # big transactions of the real index
                cur.executemany(f"INSERT INTO segments({_SEG_COLUMNS}) VALUES (?,?,?,?)", pending_segments)
                cur.executemany(f"INSERT INTO blocks({_COLUMNS}) VALUES (?,?,?,?,?,?,?,?,?)", pending_rows)
            pending_segments, pending_rows = [], []
    index.close()
    with sqlite3.connect(ns_dir / INDEX_FILENAME) as conn:  # as a server leaves it: checkpointed
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    return {"namespace": layout, "blocks": written, "segments": len(prompts), "segment_bytes": files_bytes,
            "build_s": round(time.perf_counter() - t0, 1)}  # fmt: skip


def repeated(fn, repeats: int) -> dict:
    """`fn()` (a `run`) `repeats` times: the median run, with every time (`runs_s`) and the
    spread (`min_s`, `max_s`); peak RSS the largest."""
    got = [fn() for _ in range(max(1, repeats))]
    times = sorted(g["s"] for g in got)
    mid = sorted(got, key=lambda g: g["s"])[len(got) // 2]
    return {**mid, "runs_s": [g["s"] for g in got], "min_s": times[0], "max_s": times[-1],
            "peak_rss_mb": max(g["peak_rss_mb"] for g in got)}  # fmt: skip


def run(cmd: list[str] | str, shell: bool = False, tree: Path = REPO) -> dict:
    """Run a command in a fresh process: wall seconds, the peak RSS of exactly that process
    (`wait4`: MB; for a shell pipeline this is the forked benchmark's own size, not a
    measurement), exit code and the ends of its output. Dirty pages are written back first
    (`sync`), so no command pays for the writes of the one before."""
    os.sync()
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, shell=shell, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tree,
                            env={**os.environ, "PYTHONPATH": str(tree)})  # fmt: skip
    out = proc.stdout.read() if proc.stdout else b""
    err = proc.stderr.read() if proc.stderr else b""
    _, status, ru = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    return {"s": round(wall, 3), "rc": proc.returncode, "peak_rss_mb": round(ru.ru_maxrss / 1024, 1),
            "stdout_all": out.decode(errors="replace"), "stderr_tail": err.decode(errors="replace")[-600:]}  # fmt: skip


def floor(cache: Path, ns: str, repeats: int = 1) -> dict:
    db = cache / ns / INDEX_FILENAME
    out = {
        "find | wc -l": repeated(lambda: run(f"find {cache} | wc -l", shell=True), repeats),
        "du -s": repeated(lambda: run(["du", "-s", str(cache)]), repeats),
        "sqlite count(*)": repeated(lambda: run(["sqlite3", str(db), "SELECT count(*) FROM blocks"]), repeats),
        "sequential read": repeated(lambda: run(f"find {cache}/{ns} -name '*.safetensors' -print0 | xargs -0 cat > /dev/null",
                                                shell=True), repeats),  # fmt: skip
        # the cache's bytes in full: the segment files and the index (which `validate` reads too)
        "sequential read + index": repeated(lambda: run(f"find {cache}/{ns} -type f -print0 | xargs -0 cat > /dev/null",
                                                        shell=True), repeats),  # fmt: skip
    }
    for r in out.values():
        r["stdout_tail"] = r.pop("stdout_all")[-200:]
    return out


def commands(cache: Path, ns: str, budget: int, repeats: int = 1, compare: Path | None = None) -> dict:
    """Every command (`rm` once, last: it removes the namespace; the others `repeats` times);
    with `compare` (another checkout, e.g. a worktree of an earlier commit) each of those also
    runs from it, alternating with this one, as `<command> @compare`."""
    c = str(cache)
    argv = {
        "validate": ["validate", "--cache-dir", c, "--json"],
        "validate --deep": ["validate", "--deep", "--cache-dir", c, "--json"],
        "inspect": ["inspect", "--cache-dir", c, "--json"],
        "prune --dry-run": ["prune", "--dry-run", "--ttl", "none", "--max-bytes", str(budget), "--cache-dir", c, "--json"],
    }
    out: dict = {}
    runs: dict[str, list[dict]] = {}
    for _ in range(max(1, repeats)):  # interleaved: this checkout, then the other, command by command
        for name, args in argv.items():
            runs.setdefault(name, []).append(run([*KVTOOL, *args]))
            if compare is not None:
                runs.setdefault(f"{name} @compare", []).append(run([*KVTOOL, *args], tree=compare))
    for name, got in runs.items():
        it = iter(got)
        out[name] = repeated(lambda it=it: next(it), len(got))
    out["rm"] = run([*KVTOOL, "rm", ns[:12], "--yes", "--cache-dir", c, "--json"])  # last: it removes the namespace
    for r in out.values():  # what each found: a clean cache must stay clean
        try:
            doc = json.loads(r.pop("stdout_all"))
        except ValueError:
            continue
        r["found"] = {k: doc[k] for k in ("problems", "clean", "totals") if k in doc}
    return out


def syscalls(cache: Path) -> dict:
    """openat / preadv / pread64 counts of one `validate` (strace -c; Python's imports included),
    where strace exists."""
    if shutil.which("strace") is None:
        return {}
    res = subprocess.run(["strace", "-f", "-c", "-e", "trace=openat,preadv,preadv2,pread64", "-o", "/dev/stdout", *KVTOOL,
                          "validate", "--cache-dir", str(cache), "--json"], capture_output=True, text=True, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO)})  # fmt: skip
    counts = {}
    for line in res.stdout.splitlines():
        parts = line.split()
        if parts and parts[-1] in ("openat", "preadv", "preadv2", "pread64") and len(parts) >= 4:
            counts[parts[-1]] = int(parts[3]) if parts[3].isdigit() else int(parts[2])
    return counts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="100000,1000000", help="block counts, comma-separated")
    ap.add_argument("--root", type=Path, default=None, help="where the caches are built (default: a temp dir)")
    ap.add_argument("--out", type=Path, default=None, help="report directory")
    ap.add_argument("--no-rm-floor", action="store_true", help="skip building each cache twice for `rm -rf`'s time")
    ap.add_argument("--repeats", type=int, default=1, help="runs of each floor and read-only command (median, spread)")
    ap.add_argument("--compare", type=Path, default=None,
                    help="another checkout (a worktree of an earlier commit): its read-only commands too, interleaved")
    ap.add_argument("--record", choices=sorted(RECORDS), default="small",
                    help="record geometry: small (1,088 B, the default) or tiny (65,792 B, a real tiny-preset block)")  # fmt: skip
    args = ap.parse_args()
    use_record(args.record)
    sizes = [int(x) for x in args.sizes.split(",")]
    tag = "" if args.record == "small" else f"-{args.record}"
    out = args.out or REPO / "results" / "summaries" / f"{dt.date.today():%Y%m%d}-million-blocks{tag}-{_commit()}"
    out.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="kvtool-million-", dir=args.root))
    doc: dict = {"sizes": sizes, "record": args.record, "record_bytes": KV.record_nbytes(BLOCK), "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                 "load_before": os.getloadavg()}, "commit": _commit(), "repeats": args.repeats,
                 "compare": _commit(args.compare) if args.compare else None, "runs": []}  # fmt: skip
    for tree in (REPO, args.compare) if args.compare else (REPO,):
        compile_bytecode(tree)
    try:
        for n in sizes:
            cache = root / f"cache-{n}"
            built = build(cache, n)
            print(f"{n:,} blocks: built in {built['build_s']} s ({built['segments']:,} segments)", flush=True)
            ns = built["namespace"]
            run_doc = {"blocks": n, "built": built, "floor": floor(cache, ns, args.repeats),
                       "syscalls": syscalls(cache) if n == sizes[0] else {}}  # fmt: skip
            run_doc["commands"] = commands(cache, ns, built["segment_bytes"] // 2, args.repeats, args.compare)
            if not args.no_rm_floor:  # the floor of `rm`: `rm -rf` of an identical namespace
                shutil.rmtree(cache, ignore_errors=True)
                build(cache, n)
                run_doc["floor"]["rm -rf (a second copy)"] = run(["rm", "-rf", str(cache / ns)])
            run_doc["load_after"] = os.getloadavg()
            doc["runs"].append(run_doc)
            for name, r in {**run_doc["floor"], **run_doc["commands"]}.items():
                print(f"  {name:18s} {r['s']:8.2f} s  {r['peak_rss_mb']:7.1f} MB  rc={r['rc']}", flush=True)
            shutil.rmtree(cache, ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    doc["verdict"] = verdict(doc)
    (out / "million_blocks.json").write_text(json.dumps(doc, indent=2) + "\n")
    (out / "report.md").write_text(report(doc))
    print((out / "report.md").read_text())
    return 0


def compile_bytecode(tree: Path) -> None:
    """Write the bytecode of `tree`'s kvtool package (`__pycache__`, ignored by git), as a pip
    install does: the timed commands then load it instead of compiling their modules."""
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(tree / "kvtool")], check=True)


def verdict(doc: dict) -> dict:
    runs = {r["blocks"]: r for r in doc["runs"]}
    big = runs[max(runs)]
    v: dict = {}
    for name, limit in TARGETS.items():
        v[name] = {"s": big["commands"][name]["s"], "target_s": limit, "met": big["commands"][name]["s"] <= limit}
    deep, read = big["commands"]["validate --deep"]["s"], big["floor"]["sequential read"]["s"]
    extra = deep - big["commands"]["validate"]["s"]  # what reading and hashing every record adds
    with_index = big["floor"].get("sequential read + index", {}).get("s")
    v["validate --deep"] = {"s": deep, "ratio_to_read": round(deep / read, 2), "target_ratio": DEEP_VS_READ,
                            "ratio_to_read_with_index": round(deep / with_index, 2) if with_index else None,
                            "met": deep <= DEEP_VS_READ * read, "extra_over_validate_s": round(extra, 2),
                            "extra_ratio_to_read": round(extra / read, 2)}  # fmt: skip
    rss = {k: c["peak_rss_mb"] for k, c in big["commands"].items() if not k.endswith("@compare")}
    v["peak_rss_mb"] = {"max": max(rss.values()), "target": RSS_MB, "met": max(rss.values()) <= RSS_MB, "by_command": rss}
    if len(runs) >= 2:
        lo, hi = min(runs), max(runs)
        exps = {k: round(math.log(runs[hi]["commands"][k]["s"] / max(runs[lo]["commands"][k]["s"], 1e-3)) / math.log(hi / lo), 3)
                for k in runs[hi]["commands"] if not k.endswith("@compare")}  # fmt: skip
        v["exponent"] = {"by_command": exps, "target": EXPONENT, "met": max(exps.values()) <= EXPONENT}
    return v


def report(doc: dict) -> str:
    record = doc.get("record", "small")
    lines = ["# Operator commands at a million blocks", "",
             f"`.venv/bin/python bench_configs/million_blocks.py --sizes {','.join(map(str, doc['sizes']))}"
             + (f" --record {record}" if record != "small" else "") + "` "
             f"(commit {doc['commit']}, {doc['machine']['cpus']} CPUs, load {doc['machine']['load_before'][0]:.1f} before). "
             f"Records of {doc.get('record_bytes', 1088):,} bytes ({record}), 16 blocks a segment. "
             "Fresh process per command, warm page cache, peak RSS of the process (`wait4`)."
             + (f" Each floor and read-only command run {doc['repeats']} times: median (min-max)." if doc.get("repeats", 1) > 1 else "")
             + (f" `@compare`: the same command from commit {doc['compare']}, interleaved." if doc.get("compare") else ""),
             ""]  # fmt: skip
    names = list(doc["runs"][0]["floor"]) + sorted(doc["runs"][0]["commands"], key=lambda k: (k == "rm", k.removesuffix(" @compare"), k))
    floor_rm = [r["floor"].get("rm -rf (a second copy)") for r in doc["runs"]]
    head = "| command | " + " | ".join(f"{r['blocks']:,} blocks: s / MB" for r in doc["runs"]) + " |"
    lines += [head, "|---|" + "---:|" * len(doc["runs"])]
    for name in names:
        cells = []
        for r in doc["runs"]:
            m = r["floor"].get(name) or r["commands"][name]
            spread = f" ({m['min_s']:.2f}-{m['max_s']:.2f})" if len(m.get("runs_s", ())) > 1 else ""
            cells.append(f"{m['s']:.2f}{spread} / {m['peak_rss_mb']:.0f}" + ("" if m["rc"] == 0 else f" (rc {m['rc']})"))
        lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
    v = doc["verdict"]
    lines += ["", "Targets at the largest size:", ""]
    for name in TARGETS:
        lines.append(f"- `{name}` {v[name]['s']:.2f} s, target <= {v[name]['target_s']:.0f} s: {'met' if v[name]['met'] else 'NOT met'}")
    if floor_rm[-1] is not None:
        lines.append(f"  (`rm -rf` of an identical namespace: {floor_rm[-1]['s']:.2f} s)")
    d = v["validate --deep"]
    lines.append(f"- `validate --deep` {d['s']:.2f} s = {d['ratio_to_read']}x one sequential read, target <= {DEEP_VS_READ}x: "
                 f"{'met' if d['met'] else 'NOT met'}; of it, over plain `validate`: {d['extra_over_validate_s']:.2f} s = "
                 f"{d['extra_ratio_to_read']}x the read"
                 + (f"; {d['ratio_to_read_with_index']}x a read of the segment files and the index"
                    if d.get("ratio_to_read_with_index") else ""))  # fmt: skip
    r = v["peak_rss_mb"]
    lines.append(f"- peak RSS {r['max']:.0f} MB (worst command), target <= {RSS_MB:.0f} MB: {'met' if r['met'] else 'NOT met'}")
    if "exponent" in v:
        e = v["exponent"]
        worst = max(e["by_command"], key=e["by_command"].get)
        lines.append(f"- growth exponent {min(doc['sizes']):,} -> {max(doc['sizes']):,}: worst {e['by_command'][worst]} "
                     f"(`{worst}`), target <= {EXPONENT}: {'met' if e['met'] else 'NOT met'}; all: "
                     + ", ".join(f"`{k}` {x}" for k, x in e["by_command"].items()))  # fmt: skip
    for r_ in doc["runs"]:
        if r_.get("syscalls"):
            lines.append(f"- `validate` system calls at {r_['blocks']:,} blocks (strace -c): {r_['syscalls']}")
    return "\n".join(lines) + "\n"


def _commit(tree: Path | None = None) -> str:
    if tree is None and os.environ.get("KVTOOL_BENCH_COMMIT"):  # run from an exported tree (no .git)
        return os.environ["KVTOOL_BENCH_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=tree or REPO).stdout.strip()  # fmt: skip
    except OSError:
        return "unknown"


if __name__ == "__main__":
    raise SystemExit(main())
