"""Read-phase floor of a restore by file layout, in fresh processes (docs/design.md, "Where a
restore's time goes", item 8).

Each measurement runs in a new process: it allocates unfilled MLX buffers the way a restore does
(`kvbuffers._blank_arrays`, `[1, H, T, D]` per K/V tensor), then two threads read the KV from a
scratch file in the page cache into them, with the cyclic GC off:

- `record`: today's segment layout. Per record (one block of every layer) one `preadv` of one
  piece per (tensor, head), then xxh3 over those pieces (the record checksum).
- `head`: a head-major layout. Per segment one `preadv` of one piece per (tensor, head) holding
  that head's rows of all the segment's records, then xxh3 per piece (chunk checksums).
- `mlx-lm`: `mx.load` of a safetensors file of the same tensors, as `load_prompt_cache` does.

Methods alternate within each repeat; medians and ranges are printed (ms). Bytes read are the
same for every method; the file contents are random (timing only).

Example:
    .venv/bin/python bench_configs/restore_layout.py --tokens 32768 --dtype bfloat16 --repeats 6
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child(args: argparse.Namespace) -> None:
    """One measurement in this (fresh) process; prints the elapsed ms."""
    import gc
    from collections import deque
    from concurrent.futures import ThreadPoolExecutor

    import mlx.core as mx
    import xxhash

    sys.path.insert(0, str(ROOT))
    from kvtool.kv.buffers import _blank_arrays, _host_view

    dtype = {"float32": mx.float32, "bfloat16": mx.bfloat16}[args.dtype]
    row = args.head_dim * dtype.size
    n_rec = args.tokens // args.block
    mx.eval(mx.zeros((4,)))
    if args.method == "mlx-lm":
        t0 = time.perf_counter()
        loaded = mx.load(str(Path(args.work) / "kv.safetensors"))
        mx.eval(list(loaded.values()))
        print(json.dumps({"ms": (time.perf_counter() - t0) * 1e3}))
        return
    gc.disable()
    fd = os.open(Path(args.work) / "kv.bin", os.O_RDONLY)
    shape = (1, args.heads, args.tokens + 256, args.head_dim)
    t0 = time.perf_counter()
    arrays = _blank_arrays([(shape, dtype)] * (2 * args.layers))
    heads = [v[0, h].data.cast("B") for v in map(_host_view, arrays) for h in range(args.heads)]
    piece = args.block * row

    def by_record(recs: range) -> None:
        for r in recs:
            iov = [mv[r * piece : (r + 1) * piece] for mv in heads]
            os.preadv(fd, iov, r * piece * len(heads))
            h = xxhash.xxh3_128()
            deque(map(h.update, iov), maxlen=0)
            h.hexdigest()

    def by_head(segs: range) -> None:
        for s in segs:
            lo, hi = s * args.segment * piece, (s + 1) * args.segment * piece
            iov = [mv[lo:hi] for mv in heads]
            os.preadv(fd, iov, lo * len(heads))
            for p in iov:
                xxhash.xxh3_128(p).hexdigest()

    n = n_rec if args.method == "record" else n_rec // args.segment
    work = by_record if args.method == "record" else by_head
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(work, [range(0, n // 2), range(n // 2, n)]))
    print(json.dumps({"ms": (time.perf_counter() - t0) * 1e3}))


def prepare(args: argparse.Namespace, work: Path) -> None:
    """Scratch files: raw KV bytes, and a safetensors file of the same tensors for mlx-lm."""
    import mlx.core as mx
    import numpy as np

    dtype = {"float32": mx.float32, "bfloat16": mx.bfloat16}[args.dtype]
    nbytes = 2 * args.layers * args.heads * args.tokens * args.head_dim * dtype.size
    rng = np.random.default_rng(0)
    with open(work / "kv.bin", "wb") as f:
        for _ in range(0, nbytes, 64 << 20):
            f.write(rng.integers(0, 255, size=min(64 << 20, nbytes - f.tell()), dtype=np.uint8).tobytes())
    shape = (1, args.heads, args.tokens, args.head_dim)
    tensors = {f"{i}": mx.random.normal(shape).astype(dtype) for i in range(2 * args.layers)}
    mx.save_safetensors(str(work / "kv.safetensors"), tensors)
    for name in ("kv.bin", "kv.safetensors"):  # into the page cache
        with open(work / name, "rb") as f:
            while f.read(64 << 20):
                pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--layers", type=int, default=24, help="default: qwen0.5b's 24")
    ap.add_argument("--heads", type=int, default=2, help="KV heads (default 2)")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    ap.add_argument("--block", type=int, default=64, help="tokens per record (kvtool's block size)")
    ap.add_argument("--segment", type=int, default=64, help="records per segment (head-major layout)")
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--methods", default="record,head,mlx-lm")
    ap.add_argument("--child", choices=["record", "head", "mlx-lm"], help=argparse.SUPPRESS, dest="method")
    ap.add_argument("--work", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.method:
        child(args)
        return
    if args.tokens % (args.block * args.segment * 2):
        ap.error("--tokens must be a multiple of 2 x block x segment")
    methods = args.methods.split(",")
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as tmp:
        work = Path(tmp)
        prepare(args, work)
        base = [sys.executable, __file__, "--work", str(work)] + [
            f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
            if k in ("tokens", "layers", "heads", "head_dim", "dtype", "block", "segment")]
        times: dict[str, list[float]] = {m: [] for m in methods}
        for rep in range(args.repeats):
            for m in methods[rep % len(methods):] + methods[: rep % len(methods)]:
                out = subprocess.run([*base, "--child", m], check=True, capture_output=True, text=True).stdout
                times[m].append(json.loads(out.strip().splitlines()[-1])["ms"])
    for m, xs in times.items():
        print(f"{m:8s} median {statistics.median(xs):7.1f} ms  range {min(xs):.1f}-{max(xs):.1f}  n={len(xs)}")


if __name__ == "__main__":
    main()
