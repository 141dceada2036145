"""Burst probe: N cold prompts sent at once to servers running side by side, alternated.

Each server gets, per repeat, `--prompts` distinct chat prompts of about `--tokens` tokens (new
text every time: cold for every cache) sent at the same instant (one thread each, released by a
barrier), `max_tokens` small; the time from the release to each answer's end is measured. A
server that prefills the burst as one batch finishes all of them about when the first finishes;
one that admits them one by one finishes the last much later. Per server and repeat it prints the
first and last finish (s) and the last finish's ratio to the first variant's in the same repeat;
then the 1-minute load average before and after (the machine may be shared).

With `--system-tokens N` the prompts of a burst share one system message of about N tokens (new
for every burst: cold for every cache, shared within it), as agents' first turns do; with
`--busy K`, K busy-looping processes run beside the servers during the bursts (a loaded machine).
With `--waves W` each of the `--prompts` clients sends W cold prompts, the next one after its
answer to the previous ended (closed-loop clients: the later waves come back together), client i
`i x --stagger-ms` after its answer (clients that read their streams one after another, as one
async process does).

A variant is `kvtool`, `mlx-lm` or `kvtool@TREE` (another kvtool source tree, e.g. a worktree of
an older commit), optionally with `:FLAGS` (extra `kvtool serve` flags) and `|ENV=VALUE+ENV2=VALUE`
(environment variables for that server).

    .venv/bin/python bench_configs/serve_burst.py --model small --servers mlx-lm,kvtool --repeats 3
    .venv/bin/python bench_configs/serve_burst.py --prompts 16 --tokens 60 --system-tokens 1000 --busy 2
    .venv/bin/python bench_configs/serve_burst.py --prompts 4 --waves 2 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from kvtool.bench import loadserver  # noqa: E402
from kvtool.bench.loadserver import ManagedServer, ServerOptions  # noqa: E402
from kvtool.models.loader import resolve_spec  # noqa: E402

WORDS = ("harbour tide lantern copper meadow quarry saddle thistle orchard beacon ember glacier "
         "ledger marble nectar pylon raven summit tundra velvet willow yarrow zephyr anchor").split()


def prompt_text(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) + (str(rng.randrange(100)) if rng.random() < 0.3 else "")
                    for _ in range(n_words))


def words_for(model_path: str, tokens: int) -> int:
    """Words of `prompt_text` that make about `tokens` tokens with the model's tokenizer."""
    from mlx_lm.utils import load_tokenizer

    tok = load_tokenizer(Path(model_path))
    sample = prompt_text(random.Random(0), 500)
    return max(1, int(500 * tokens / len(tok.encode(sample))))


def post(url: str, body: dict) -> float:
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        json.loads(r.read())
    return time.perf_counter()


def burst(url: str, bodies: list[list[dict]], stagger_s: float = 0.0) -> list[float]:
    """Seconds from the release to each client's last answer's end (NaN: a request failed, e.g. a
    connection the server reset), sorted, the failed ones last. Client i sends `bodies[i]` one
    after another, each `i x stagger_s` after the previous answer ended."""
    gate = threading.Barrier(len(bodies) + 1)
    done: list[float] = [math.nan] * len(bodies)

    def one(i: int) -> None:
        gate.wait()
        try:
            for k, body in enumerate(bodies[i]):
                if k:
                    time.sleep(i * stagger_s)
                done[i] = post(url, body)
        except OSError as exc:  # urllib's errors are OSErrors
            done[i] = math.nan
            print(f"  a request failed: {type(exc).__name__}: {exc}", flush=True)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    gate.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    return sorted((d - t0 for d in done), key=lambda x: (math.isnan(x), x))


def prefill_steps(server: ManagedServer) -> tuple[int, list[list[int]]] | None:
    """(prefill steps so far, tokens per prompt of each recent step) of a kvtool server
    (`/kvtool/stats`); None otherwise."""
    stats = server.kvtool_stats()
    if not stats:
        return None
    doc = stats["server"]
    if "prefill_steps" not in doc:  # a kvtool without the record
        return None
    return doc["prefill_steps"], doc["prefill_steps_recent"]


def step_text(step: list[int]) -> str:
    """A step's prompts and tokens: `8x1039` (8 prompts of 1,039 tokens), or `4x~58` when they differ."""
    lo, hi = min(step), max(step)
    return f"{len(step)}x{lo}" if lo == hi else f"{len(step)}x~{round(sum(step) / len(step))}"


def start(variant: str, i: int, model: str, model_path: str, work: Path) -> ManagedServer:
    head, _, env_part = variant.partition("|")
    head, _, flags = head.partition(":")
    kind, _, tree = head.partition("@")
    loadserver.REPO = Path(tree).resolve() if tree else REPO  # the tree `python -m kvtool...` runs from
    env = dict(kv.split("=", 1) for kv in env_part.split("+") if kv)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # child_env() copies os.environ
    try:
        opts = ServerOptions(kind, model, model_path, work / f"cache-{i}" if kind == "kvtool" else None,
                             tuple(flags.split()))
        return ManagedServer(opts, work / f"server-{i}.log")
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--servers", default="mlx-lm,kvtool")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--system-tokens", type=int, default=0, help="a system message of ~N tokens shared by each burst")
    ap.add_argument("--busy", type=int, default=0, help="busy-looping processes beside the servers")
    ap.add_argument("--waves", type=int, default=1, help="cold prompts per client, each sent after the previous answer")
    ap.add_argument("--stagger-ms", type=float, default=50.0, help="client i sends its next prompt i x this after its answer")
    a = ap.parse_args()
    model_path = str(resolve_spec(a.model)[0])
    n_words = words_for(model_path, a.tokens)
    sys_words = words_for(model_path, a.system_tokens) if a.system_tokens > 0 else 0
    variants = a.servers.split(",")
    work = Path(tempfile.mkdtemp(prefix="kvtool-serve-burst-"))
    rng = random.Random(1)
    load0 = os.getloadavg()[0]
    servers: list[ManagedServer] = []
    busy: list[subprocess.Popen] = []
    try:
        for i, v in enumerate(variants):
            servers.append(start(v, i, a.model, model_path, work))
        warm = {"model": "default_model", "max_tokens": 2, "temperature": 0.0,
                "messages": [{"role": "user", "content": "hello"}]}
        for s in servers:
            post(s.url, warm)
        busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(a.busy)]
        last: dict[str, list[float]] = {v: [] for v in variants}
        for r in range(a.repeats):
            order = list(range(len(servers)))
            for i in (order if r % 2 == 0 else order[::-1]):
                system = [{"role": "system", "content": prompt_text(rng, sys_words)}] if sys_words else []
                bodies = [[{"model": "default_model", "max_tokens": a.max_tokens, "temperature": 0.0,
                            "messages": [*system, {"role": "user", "content": prompt_text(rng, n_words)}]}
                           for _ in range(a.waves)] for _ in range(a.prompts)]
                n0 = prefill_steps(servers[i])
                times = burst(servers[i].url, bodies, a.stagger_ms / 1e3)
                ok = [t for t in times if not math.isnan(t)]
                failed = len(times) - len(ok)
                last[variants[i]].append(ok[-1] if not failed else math.nan)
                n1 = prefill_steps(servers[i])
                new = [] if n1 is None or n0 is None else n1[1][max(0, len(n1[1]) - (n1[0] - n0[0])):]
                steps = "" if n1 is None else f"  prefill steps [{', '.join(step_text(x) for x in new)}]"
                print(f"repeat {r} {variants[i]:40s} first {ok[0] if ok else math.nan:6.2f} s  "
                      f"last {ok[-1] if ok else math.nan:6.2f} s  load {os.getloadavg()[0]:.2f}{steps}"
                      + (f"  FAILED {failed} (the repeat's ratio is left out)" if failed else ""), flush=True)
        ref = last[variants[0]]
        for v in variants:
            ratios = " / ".join(f"{x / y:.2f}" for x, y in zip(last[v], ref))
            print(f"{v:40s} last finish / {variants[0]}: {ratios}", flush=True)
        print(f"load average (1 min): {load0:.2f} before, {os.getloadavg()[0]:.2f} after", flush=True)
    finally:
        for b in busy:
            b.kill()
        for s in servers:
            s.stop()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
