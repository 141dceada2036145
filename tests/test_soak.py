"""Soak test (docs/design.md#failure-isolation): concurrent serve-once, warm, prune and validate on one cache, SIGKILLs at
random moments, then: `validate` repairs and a second `validate` is clean, every prompt's output
equals its uncached output, and no file outside the cache was touched (a sibling directory is
watched). The test prints how many kills landed and in which command.

Bounded in time: `KVTOOL_SOAK_SECONDS` (default 30 s of churn here; `make soak` runs longer).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "kvtool" / "assets" / "demo_prompt.txt"
SOAK_SECONDS = float(os.environ.get("KVTOOL_SOAK_SECONDS", "30"))
MAX_PARALLEL = 4
BLOCK = "32"


def _cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvtool.cli.app", *args]


def _snapshot(root: Path) -> dict[str, str]:
    """Every entry under `root` (symlinks not followed): type, size and content digest."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        if p.is_symlink():
            out[rel] = "link:" + os.readlink(p)
        elif p.is_file():
            out[rel] = hashlib.blake2b(p.read_bytes(), digest_size=16).hexdigest()
        else:
            out[rel] = "dir"
    return out


def _prompts(tmp: Path) -> list[Path]:
    text = DEMO.read_text(encoding="utf-8")
    files = []
    for i, (a, b) in enumerate([(0, 1500), (0, 2200), (700, 2600)]):  # overlapping prefixes
        f = tmp / f"prompt{i}.txt"
        f.write_text(text[a:b], encoding="utf-8")
        files.append(f)
    return files


def _serve(prompt: Path, cache: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        _cmd("serve-once", "--json", "--prompt-file", str(prompt), "--max-tokens", "6", "--block-size", BLOCK,
             "--cache-dir", str(cache), *extra),
        capture_output=True, text=True, cwd=REPO, timeout=300,
    )


def _random_job(rng: random.Random, prompts: list[Path], cache: Path, warm_file: Path) -> tuple[str, list[str]]:
    kind = rng.choice(["serve", "serve", "warm", "prune", "validate"])
    if kind == "serve":
        return kind, _cmd("serve-once", "--json", "--prompt-file", str(rng.choice(prompts)), "--max-tokens", "4",
                          "--block-size", BLOCK, "--cache-dir", str(cache),
                          "--durability", rng.choice(["best_effort", "durable"]),
                          *(["--sync"] if rng.random() < 0.3 else []))
    if kind == "warm":
        return kind, _cmd("warm", "--json", "--whole", str(warm_file), "--block-size", BLOCK, "--cache-dir", str(cache))
    if kind == "prune":
        rule = rng.choice([["--max-bytes", f"{rng.randint(0, 400)}KiB"], ["--ttl", "0s"], ["--ttl", "1h"]])
        return kind, _cmd("prune", "--yes", "--json", "--cache-dir", str(cache), *rule)
    return kind, _cmd("validate", "--json", "--cache-dir", str(cache))


@pytest.mark.slow
def test_soak_concurrent_commands_with_sigkills(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)  # prune/validate may run before the first serve creates a namespace
    sibling = tmp_path / "sibling"  # must never change
    sibling.mkdir()
    (sibling / "model.safetensors").write_bytes(os.urandom(4096))
    (sibling / "notes.tmp").write_text("not kvtool's")
    (sibling / "00").mkdir()
    before = _snapshot(sibling)

    prompts = _prompts(tmp_path)
    reference = {}
    for p in prompts:  # uncached outputs, each in its own empty cache
        res = _serve(p, tmp_path / f"ref-{p.stem}", "--no-ssd")
        assert res.returncode == 0, res.stderr
        reference[p] = json.loads(res.stdout)["requests"][0]["token_ids"]
    warm_file = prompts[1]

    rng = random.Random(int(os.environ.get("KVTOOL_SOAK_SEED", "20261122")))
    running: list[tuple[str, subprocess.Popen, float, float | None]] = []
    kills: Counter = Counter()
    finished: Counter = Counter()
    failures: list[str] = []
    deadline = time.monotonic() + SOAK_SECONDS
    while time.monotonic() < deadline or running:
        while time.monotonic() < deadline and len(running) < MAX_PARALLEL:
            kind, cmd = _random_job(rng, prompts, cache, warm_file)
            proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            kill_at = time.monotonic() + rng.uniform(0.5, 6.0) if rng.random() < 0.5 else None
            running.append((kind, proc, time.monotonic(), kill_at))
        time.sleep(0.05)
        still = []
        for kind, proc, t0, kill_at in running:
            if proc.poll() is None:
                if kill_at is not None and time.monotonic() >= kill_at:
                    proc.send_signal(signal.SIGKILL)
                    proc.wait()
                    kills[f"{kind}@{time.monotonic() - t0:.0f}s"] += 1
                    kills[kind + " (total)"] += 1
                    continue
                if time.monotonic() - t0 > 240:
                    proc.kill()
                    failures.append(f"{kind} hung")
                    continue
                still.append((kind, proc, t0, kill_at))
                continue
            out, err = proc.communicate()
            finished[kind] += 1
            ok_codes = {"serve": (0,), "warm": (0,), "prune": (0, 3), "validate": (0, 1, 3)}[kind]
            if proc.returncode not in ok_codes:
                failures.append(f"{kind} exit {proc.returncode}: {err.strip()[-400:]}")
        running = still

    summary = {"kills": dict(kills), "finished": dict(finished), "failures": failures}
    print("soak summary:", json.dumps(summary, indent=1))
    assert not failures, summary
    assert sum(v for k, v in kills.items() if k.endswith("(total)")) > 0, summary

    first = subprocess.run(_cmd("validate", "--json", "--cache-dir", str(cache)), capture_output=True, text=True,
                           cwd=REPO, timeout=300)
    assert first.returncode in (0, 1), first.stderr
    second = subprocess.run(_cmd("validate", "--json", "--cache-dir", str(cache)), capture_output=True, text=True,
                            cwd=REPO, timeout=300)
    assert second.returncode == 0, second.stdout + second.stderr
    for p in prompts:
        res = _serve(p, cache)
        assert res.returncode == 0, res.stderr
        assert json.loads(res.stdout)["requests"][0]["token_ids"] == reference[p]
    assert _snapshot(sibling) == before
