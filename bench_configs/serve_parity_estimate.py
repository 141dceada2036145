"""Run-time estimate of a `[serve_load]` config: the prompt tokens each server must prefill.

Builds the config's workloads (the model's tokenizer, the chat template) and counts, per
workload x clients x server, the prompt tokens not covered by that server's prefix cache under a
simple model: a session's previous prompt is cached (kvtool: always, also across a restart, its
cache is on disk; `mlx-lm-1000`: until a restart; `mlx-lm`: until a restart and only for its 10
most recent sessions of a `multi-turn` workload, its default `--prompt-cache-size`); a
`shared-prefix` request reuses the shared system prompt, a `long-doc-qa` question its document.
Time = tokens / RATE + server starts x START_S. The model ignores decode, batching and the
server-side overheads: it is for sizing a config, not for results.

    .venv/bin/python bench_configs/serve_parity_estimate.py bench_configs/serve_parity.toml 1000 4
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from kvtool.bench.loadcell import build_workloads  # noqa: E402
from kvtool.bench.loadconfig import load_serve_load  # noqa: E402
from kvtool.bench.loadgen import LoadRequest  # noqa: E402
from kvtool.bench.loadparity import DEFAULT_CACHE_ENTRIES  # noqa: E402
from kvtool.bench.loadworkloads import LoadWorkload, workload_kind  # noqa: E402
from kvtool.models.loader import resolve_spec  # noqa: E402


def prefill_tokens(w: LoadWorkload, clients: int, server: str, count: Callable[[LoadRequest], int]) -> int:
    """Prompt tokens `server` prefills for workload `w` at `clients` (see the module docstring)."""
    kind = workload_kind(w.name)
    cached: dict[str, int] = {}
    recent: list[str] = []
    total = 0
    for phase in w.phases:
        if phase == w.restart_before and server != "kvtool":
            cached, recent = {}, []
        for r in w.phase_requests(phase, clients):
            n = count(r)
            if kind == "shared-prefix":
                hit = max(cached.values()) - 40 if cached else 0
            elif kind == "long-doc-qa":
                hit = cached[r.session] - 20 if r.session in cached else 0
            else:
                hit = cached.get(r.session, 0)
            total += max(0, n - max(0, hit))
            cached[r.session] = n
            if server == "mlx-lm" and kind == "multi-turn":
                recent = [s for s in recent if s != r.session] + [r.session]
                while len(recent) > DEFAULT_CACHE_ENTRIES:
                    cached.pop(recent.pop(0), None)
    return total


def main() -> int:
    path, rate, start_s = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
    from mlx_lm.utils import load_tokenizer

    spec = load_serve_load(path)
    model_path = resolve_spec(spec.model)[0]
    tok = load_tokenizer(model_path)

    def count(r: LoadRequest) -> int:
        return len(tok.apply_chat_template(list(r.messages), tokenize=True, add_generation_prompt=True))

    tokens = starts = 0
    for w in build_workloads(spec, str(model_path)):
        for clients in spec.clients_of(w.name):
            per = {s: prefill_tokens(w, clients, s, count) for s in spec.servers}
            tokens += sum(per.values())
            starts += len(spec.servers) * (2 if w.restart_before else 1)
            print(f"{w.name:15s} {clients:3d} client(s)  " + "  ".join(f"{s} {t / 1e3:6.0f}k" for s, t in per.items()))
    minutes = (tokens / rate + starts * start_s) / 60
    print(f"total {tokens / 1e6:.2f} M prompt tokens, {starts} server starts: ~{minutes:.0f} min at {rate:.0f} "
          f"tokens/s and {start_s:.0f} s per start")
    return 0


if __name__ == "__main__":
    sys.exit(main())
