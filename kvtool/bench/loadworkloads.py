"""Workloads of the load benchmark: chat requests generated deterministically from a seed.

Text comes from `kvtool/assets/demo_prompt.txt`, tokenized once with the model's own tokenizer
(`TextSource`). Every system prompt / document starts with a unique header, so no two share a first
block by accident. Sizes are in tokens of the message content; the chat template adds a few tokens
per message.

Workloads (parameters and defaults in `LOAD_WORKLOAD_DEFAULTS`):
- `shared-prefix`: `groups` system prompts of `system_tokens` each, `prompts_per_group` requests
  per group with a distinct user question of `question_tokens`; requests in a seeded shuffled order;
  with `prime` > 0, each group's system prompt is first sent that many times in an unmeasured
  `prime` phase (a warm server that has seen its system prompts; 0 also measures the cold burst).
- `multi-turn`: `conversations` chats of `turns` user turns (`user_tokens` each) after a system
  prompt (the opening) of `system_tokens`, or with `system_tokens_max` > 0 of a seeded length per
  conversation (`opening_tokens`); the assistant turns of the history are corpus text of
  `assistant_tokens` (not the model's reply, so every server gets the same requests); turns are
  interleaved round-robin over the conversations, and a turn is sent only once the previous
  turn of its conversation finished. `conversations = 0` sizes the working set
  (`multi_turn_conversations`) so that the conversations' KV does not fit in `ram_bytes`, the
  RAM budget the kvtool server runs with. With `restart_after` = R > 0 (1 <= R < `turns`) the
  servers are restarted before turn R+1 and the turns are split into the phases of
  `multi_turn_phase`, all measured and reported apart.
- `cold-burst`: distinct cold prompts of `prompt_tokens` (corpus text at a seeded offset, no
  header: no two share a first block) arriving together: a cell of C clients sends the first
  C x `prompts_per_client` of them, closed loop, so the first C are sent at the same instant
  (phase `burst`).
- `long-doc-qa`: `documents` documents of `doc_tokens`; a `warmup` phase asks one question per
  document (not measured), then `queries` questions on documents drawn uniformly (seeded).
- `restart`: `prompts` documents of `prompt_tokens` with a question each (`before`), then the
  server is restarted (SIGTERM, same cache directory) and each document gets a new question in a
  shuffled order (`after`, the measured half). mlx-lm is restarted too (its cache is in memory).
- `trace`: replay of a JSONL file (`path`, relative to the config file): prompt lines
  (`load_trace`) or a Mooncake trace (`kvtool.bench.trace_replay`, which also defines the window
  every trace takes); `format = "auto"` tells them apart by the first line. A request is sent at
  `t` / `speedup` x `time_scale`.
- `agents`: agent loops on one shared system prompt whose turns carry the server's actual reply,
  built while the batch runs (`kvtool.bench.loadagents`).

A config may run a workload more than once under the names `<workload>@<label>` (e.g.
`multi-turn@8`, `multi-turn@32`): each is validated and built as `<workload>` with its own
parameters and reported under its whole name (`workload_kind` splits it).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from kvtool.bench.loadagents import AGENTS_DEFAULTS, AgentsPlan, agents_phases, system_prompt
from kvtool.bench.loadgen import LoadRequest
from kvtool.bench.trace_replay import (
    MOONCAKE_ONLY,
    TRACE_FORMATS,
    TRACE_REPLAY_DEFAULTS,
    mooncake_requests,
    trace_format,
    window_prompts,
)
from kvtool.bench.workloads import count, merge_params, positive_number, size_field
from kvtool.config import ConfigError
from kvtool.models.limits import kv_bytes_per_token

CORPUS = Path(__file__).resolve().parent.parent / "assets" / "demo_prompt.txt"

LOAD_WORKLOAD_DEFAULTS: dict[str, dict[str, Any]] = {
    "shared-prefix": {"groups": 1, "prompts_per_group": 8, "system_tokens": 1024, "question_tokens": 32, "prime": 0},
    "multi-turn": {"conversations": 0, "turns": 4, "system_tokens": 256, "system_tokens_max": 0, "user_tokens": 64,
                   "assistant_tokens": 64, "working_set_factor": 2.0, "max_conversations": 64,
                   "ram_bytes": 1 << 20, "restart_after": 0},
    "long-doc-qa": {"documents": 4, "doc_tokens": 1024, "question_tokens": 16, "queries": 16},
    "restart": {"prompts": 8, "prompt_tokens": 1024, "question_tokens": 16},
    "trace": {"path": "", "time_scale": 1.0, **TRACE_REPLAY_DEFAULTS},
    "agents": AGENTS_DEFAULTS,
    "cold-burst": {"prompts_per_client": 2, "prompt_tokens": 2000},
}
LOAD_WORKLOADS = tuple(LOAD_WORKLOAD_DEFAULTS)
MEASURED = {"shared-prefix": ("query",), "multi-turn": ("turn",), "long-doc-qa": ("query",),
            "restart": ("after",), "trace": ("trace",),
            "agents": ("turn", "after", "rewarm"), "cold-burst": ("burst",)}
RESTART_BEFORE = {"restart": "after", "agents": "after"}  # workload -> the phase the servers are restarted before
RESTART_PHASE = "after"  # multi-turn with restart_after: the first turn after the restart
REWARM_PHASE = "rewarm"  # ... and the later ones
_FLOATS = {"working_set_factor", "time_scale", "speedup", "output_scale"}
_SECONDS = {"start_s", "end_s"}  # numbers >= 0
_STRINGS = {"path", "format"}
_ZERO_OK = {"conversations", "agents", "tools", "start", "end", "requests", "max_output_tokens", "shared_prefix_blocks",
            "system_tokens_max", "restart_after"}


@dataclass(frozen=True)
class LoadWorkload:
    """A materialised workload.

    Attributes:
        name: workload name.
        requests: all requests, phases in order.
        phases: phase names in order of appearance.
        measured: phases the cell's figures are computed on.
        restart_before: phase before which the servers are restarted (None: no restart).
        params: the parameters used (with derived ones, e.g. `conversations`).
        kvtool_ram_bytes: the RAM budget the kvtool server must run with for this workload
            (bytes; None: the config's).
        agents: the `agents` workload's plan (its requests are built while a batch runs;
            `requests` then holds one agent's turns as placeholders); None for the others.
        per_client: `cold-burst`: requests per client of the cell (0: every request, whatever
            the clients).
    """

    name: str
    requests: tuple[LoadRequest, ...]
    phases: tuple[str, ...]
    measured: tuple[str, ...]
    restart_before: str | None
    params: dict[str, Any]
    kvtool_ram_bytes: int | None = None
    agents: AgentsPlan | None = None
    per_client: int = 0

    def phase_requests(self, phase: str, clients: int = 0) -> list[LoadRequest]:
        """The requests of one phase, `after` indices renumbered within the phase; with
        `per_client` and `clients` > 0, only the first `clients` x `per_client` of them."""
        chosen = [(i, r) for i, r in enumerate(self.requests) if r.phase == phase]
        if self.per_client and clients:
            chosen = chosen[:clients * self.per_client]
        new_index = {old: new for new, (old, _) in enumerate(chosen)}
        return [replace(r, after=new_index.get(r.after) if r.after is not None else None) for _, r in chosen]


def validate_load_params(name: str, params: dict[str, Any], where: str = "serve_load.workloads") -> dict[str, Any]:
    """Merge `params` over the defaults of `name` (`<workload>@<label>`: of `<workload>`) and check them.

    Raises:
        ConfigError: unknown workload or parameter, or a bad value (the error names the field).
    """
    def check(key: str, value: Any, field: str) -> Any:
        if key in _FLOATS:
            return positive_number(value, field)
        if key == "restart":
            if not isinstance(value, bool):
                raise ConfigError(field, f"must be true or false, got {value!r}")
            return value
        if key == "ram_bytes":
            value = size_field(field, value)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(field, f"must be a size > 0 (bytes or e.g. '1MiB'), got {value!r}")
            return value
        if key in _SECONDS:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
                raise ConfigError(field, f"must be a number of seconds >= 0, got {value!r}")
            return float(value)
        if key in _STRINGS:
            if not isinstance(value, str) or (key == "format" and value not in TRACE_FORMATS):
                raise ConfigError(field, f"must be {'one of ' + ', '.join(TRACE_FORMATS) if key == 'format' else 'a string'}"
                                         f", got {value!r}")
            return value
        return count(value, field, zero_ok=key in _ZERO_OK)

    kind = workload_kind(name)
    table = {name: LOAD_WORKLOAD_DEFAULTS[kind]} if kind in LOAD_WORKLOAD_DEFAULTS else LOAD_WORKLOAD_DEFAULTS
    merged = merge_params(table, name, params, where, check)
    if kind == "multi-turn":
        _check_multi_turn(merged, f"{where}.{name}")
    if kind == "trace" and not merged["path"]:
        raise ConfigError(f"{where}.{name}.path", "required: a JSONL file of {\"t\", \"prompt\"|\"messages\"} lines "
                                                  "or a Mooncake trace")
    if kind == "agents" and merged["result_max_tokens"] < merged["result_min_tokens"]:
        raise ConfigError(f"{where}.{name}.result_max_tokens", "must be >= result_min_tokens")
    if kind == "agents" and merged["restart"] and merged["turns"] < 2:
        raise ConfigError(f"{where}.{name}.restart", "needs turns >= 2 (the servers restart before turn turns/2)")
    if kind == "trace" and merged["end"] and merged["end"] <= merged["start"]:
        raise ConfigError(f"{where}.{name}.end", f"must be 0 (to the end) or > start ({merged['start']})")
    return merged


def workload_kind(name: str) -> str:
    """The workload a config name runs: `multi-turn@16` -> `multi-turn` (a name without `@`: itself)."""
    return name.partition("@")[0]


def _check_multi_turn(p: dict[str, Any], where: str) -> None:
    if p["system_tokens_max"] and p["system_tokens_max"] < p["system_tokens"]:
        raise ConfigError(f"{where}.system_tokens_max", f"must be 0 (every opening is system_tokens) or >= "
                                                        f"system_tokens ({p['system_tokens']})")
    if p["restart_after"] >= p["turns"]:
        raise ConfigError(f"{where}.restart_after", f"must be 0 (no restart) or a turn < turns ({p['turns']})")


class TextSource:
    """Deterministic text of a given token length, from the demo corpus and a tokenizer.

    Args:
        tokenizer: anything with `encode(text) -> list[int]` and `decode(ids) -> str` (the
            model's tokenizer, e.g. `mlx_lm.utils.load_tokenizer(path)`).
        rng: the seeded generator offsets are drawn from.
    """

    def __init__(self, tokenizer: Any, rng: np.random.Generator, corpus: str | None = None):
        self.tok, self.rng = tokenizer, rng
        self.ids = list(tokenizer.encode(corpus if corpus is not None else CORPUS.read_text()))
        if not self.ids:
            raise ValueError("empty corpus")

    def text(self, n: int, start: int | None = None) -> str:
        """About `n` tokens (n >= 1) of corpus text at a random offset, or at token `start`: the
        decoded window of `n` corpus tokens (wrapping around), re-encoded and cut to `n` tokens (± a
        few at the window's edges, where byte-level merges can differ)."""
        start = int(self.rng.integers(0, len(self.ids))) if start is None else start % len(self.ids)
        window = [self.ids[(start + k) % len(self.ids)] for k in range(n)]
        text = self.tok.decode(window)
        again = list(self.tok.encode(text))
        return self.tok.decode(again[:n]) if len(again) > n else text

    def document(self, n: int, label: str) -> str:
        """A unique header (`[label]`) followed by text, about `n` tokens in all."""
        header = f"[{label}]\n"
        return header + self.text(max(1, n - len(self.tok.encode(header))))


def _kv_bytes_per_token(model_dir: Path | None) -> int:
    """`kvtool.models.limits.kv_bytes_per_token`, 0 where there is no model directory or its
    config.json gives no KV geometry (the sizes that use it are then left to the config)."""
    try:
        return kv_bytes_per_token(model_dir) if model_dir is not None else 0
    except (OSError, ValueError):
        return 0


def build_load_workload(name: str, params: dict[str, Any], tokenizer: Any, seed: int, max_tokens: int,
                        *, model_dir: Path | None = None, base_dir: Path | None = None,
                        max_clients: int = 1) -> LoadWorkload:
    """Materialise one workload.

    Args:
        name: workload name (`LOAD_WORKLOADS`), or `<workload>@<label>` (`workload_kind`).
        params: its parameters (validated here).
        tokenizer: the model's tokenizer (see `TextSource`).
        seed: the same seed gives the same requests.
        max_tokens: tokens generated per request (tokens; a prompt trace line's own value, or a Mooncake trace's output length, wins).
        model_dir: the model directory (for `multi-turn`'s KV size per token).
        base_dir: where a relative trace `path` is resolved (the config file's directory).
        max_clients: the largest client count of the run (`cold-burst` builds prompts for it).

    Raises:
        ConfigError: a bad parameter (names the field).
    """
    p = validate_load_params(name, params)
    kind = workload_kind(name)
    rng = np.random.default_rng([seed, LOAD_WORKLOADS.index(kind)])
    if kind == "trace":
        return _trace(name, p, tokenizer, max_tokens, base_dir)
    src = TextSource(tokenizer, rng)
    if kind == "agents":
        plan = AgentsPlan(p, system_prompt(p, src), src, seed)
        return LoadWorkload(name, tuple(plan.placeholders()), agents_phases(p), MEASURED[kind],
                            RESTART_BEFORE[kind], p, agents=plan)
    ram, measured, restart = None, MEASURED[kind], RESTART_BEFORE.get(kind)
    if kind == "shared-prefix":
        reqs = _shared_prefix(p, src, rng, max_tokens)
    elif kind == "multi-turn":
        per_token = _kv_bytes_per_token(model_dir)
        if not p["conversations"]:
            p["conversations"] = multi_turn_conversations(p, per_token)
        p["working_set_bytes"] = multi_turn_working_set(p, per_token)
        ram = int(p["ram_bytes"])
        reqs = _multi_turn(p, src, max_tokens, seed)
        if p["restart_after"]:
            measured, restart = tuple(dict.fromkeys(r.phase for r in reqs)), RESTART_PHASE
    elif kind == "long-doc-qa":
        reqs = _long_doc_qa(p, src, rng, max_tokens)
    elif kind == "cold-burst":
        reqs = _cold_burst(p, src, rng, max_tokens, p["prompts_per_client"] * max_clients)
    else:
        reqs = _restart(p, src, rng, max_tokens)
    phases = tuple(dict.fromkeys(r.phase for r in reqs))
    return LoadWorkload(name, tuple(reqs), phases, measured, restart, p, ram,
                        per_client=p["prompts_per_client"] if kind == "cold-burst" else 0)


def _trace(name: str, p: dict[str, Any], tokenizer: Any, max_tokens: int, base_dir: Path | None) -> LoadWorkload:
    path = Path(p["path"]).expanduser()
    if not path.is_absolute() and base_dir is not None:
        path = base_dir / path
    p["format"] = trace_format(path, p["format"])
    if p["format"] == "mooncake":
        reqs = mooncake_requests(path, p, tokenizer)
    else:
        moved = [k for k in MOONCAKE_ONLY if p[k] != TRACE_REPLAY_DEFAULTS[k]]
        if moved:
            raise ConfigError(f"serve_load.workloads.{name}.{moved[0]}", "applies to Mooncake traces only")
        reqs = window_prompts(load_trace(path, max_tokens), p)
    return LoadWorkload(name, tuple(reqs), ("trace",), MEASURED["trace"], None, {**p, "path": str(path)})


def _msgs(*pairs: tuple[str, str]) -> tuple[dict[str, str], ...]:
    return tuple({"role": role, "content": content} for role, content in pairs)


def _shared_prefix(p: dict, src: TextSource, rng: np.random.Generator, max_tokens: int) -> list[LoadRequest]:
    systems = [src.document(p["system_tokens"], f"system prompt {g}") for g in range(p["groups"])]
    reqs = [LoadRequest(f"g{g}q{i}", _msgs(("system", systems[g]),
                                           ("user", f"Question {i}: " + src.text(p["question_tokens"]))),
                        max_tokens, "query", f"g{g}")
            for g in range(p["groups"]) for i in range(p["prompts_per_group"])]
    primes = [LoadRequest(f"g{g}p{i}", _msgs(("system", systems[g]), ("user", f"Hello {i}: " + src.text(8))),
                          max_tokens, "prime", f"g{g}")
              for g in range(p["groups"]) for i in range(p["prime"])]  # unmeasured: the server has seen each prompt
    return primes + [reqs[i] for i in rng.permutation(len(reqs))]


def multi_turn_working_set(p: dict[str, Any], kv_per_token: int) -> int:
    """KV bytes of all conversations at their last turn (bytes; content tokens, no template; the
    longest opening, `system_tokens_max`, when set)."""
    per_conv = max(p["system_tokens"], p["system_tokens_max"]) + p["turns"] * p["user_tokens"] + (p["turns"] - 1) * p["assistant_tokens"]
    return int(p["conversations"] * per_conv * kv_per_token)


def multi_turn_conversations(p: dict[str, Any], kv_per_token: int) -> int:
    """`ceil(working_set_factor x ram_bytes / KV bytes of one whole conversation)`, in
    2 .. `max_conversations`."""
    one = multi_turn_working_set({**p, "conversations": 1}, kv_per_token)
    if one <= 0:
        return 2
    return max(2, min(p["max_conversations"], math.ceil(p["working_set_factor"] * p["ram_bytes"] / one)))


def multi_turn_phase(p: dict[str, Any], turn: int) -> str:
    """The phase of turn `turn` (0-based) of a validated `multi-turn` parameter set: `turn`, or
    with `restart_after` = R: `cold` (turn 0), `warm` (turns 1..R-1), `after` (turn R, the first
    after the restart) and `rewarm` (the later ones, warm again on every server)."""
    if not p["restart_after"]:
        return "turn"
    if turn == 0:
        return "cold"
    return "warm" if turn < p["restart_after"] else RESTART_PHASE if turn == p["restart_after"] else REWARM_PHASE


def opening_tokens(p: dict[str, Any], seed: int, conversation: int) -> int:
    """The opening (system prompt) length of one conversation (tokens): `system_tokens`, or drawn
    uniformly in `system_tokens`..`system_tokens_max` from `default_rng([seed, conversation])`."""
    if not p["system_tokens_max"]:
        return int(p["system_tokens"])
    return int(np.random.default_rng([seed, conversation]).integers(p["system_tokens"], p["system_tokens_max"] + 1))


def _multi_turn(p: dict, src: TextSource, max_tokens: int, seed: int) -> list[LoadRequest]:
    history = {c: [("system", src.document(opening_tokens(p, seed, c), f"conversation {c}"))]
               for c in range(p["conversations"])}
    last: dict[int, int] = {}
    reqs: list[LoadRequest] = []
    for turn in range(p["turns"]):
        phase = multi_turn_phase(p, turn)
        for c in range(p["conversations"]):
            if turn:
                history[c].append(("assistant", src.text(p["assistant_tokens"])))
            history[c].append(("user", f"Turn {turn + 1}: " + src.text(p["user_tokens"])))
            reqs.append(LoadRequest(f"c{c}t{turn}", _msgs(*history[c]), max_tokens, phase, f"c{c}", last.get(c)))
            last[c] = len(reqs) - 1
    return reqs


def _cold_burst(p: dict, src: TextSource, rng: np.random.Generator, max_tokens: int, n: int) -> list[LoadRequest]:
    """`n` prompts at distinct corpus offsets (drawn without replacement while the corpus has
    enough tokens): no two start with the same token."""
    starts = rng.choice(len(src.ids), size=n, replace=n > len(src.ids))
    return [LoadRequest(f"b{i}", _msgs(("user", src.text(p["prompt_tokens"], int(start)))), max_tokens, "burst",
                        f"b{i}") for i, start in enumerate(starts)]


def _long_doc_qa(p: dict, src: TextSource, rng: np.random.Generator, max_tokens: int) -> list[LoadRequest]:
    docs = [src.document(p["doc_tokens"], f"document {d}") for d in range(p["documents"])]

    def ask(d: int, key: str, phase: str) -> LoadRequest:
        question = f"Question about document {d}: " + src.text(p["question_tokens"])
        return LoadRequest(key, _msgs(("system", docs[d]), ("user", question)), max_tokens, phase, f"d{d}")

    reqs = [ask(d, f"w{d}", "warmup") for d in range(len(docs))]
    reqs += [ask(int(d), f"q{i}", "query") for i, d in enumerate(rng.integers(0, len(docs), size=p["queries"]))]
    return reqs


def _restart(p: dict, src: TextSource, rng: np.random.Generator, max_tokens: int) -> list[LoadRequest]:
    docs = [src.document(p["prompt_tokens"], f"prompt {i}") for i in range(p["prompts"])]

    def ask(i: int, phase: str) -> LoadRequest:
        question = f"Question ({phase}): " + src.text(p["question_tokens"])
        return LoadRequest(f"{phase}{i}", _msgs(("system", docs[i]), ("user", question)), max_tokens, phase, f"p{i}")

    return [ask(i, "before") for i in range(len(docs))] + [ask(int(i), "after") for i in rng.permutation(len(docs))]


def load_trace(path: Path, max_tokens: int) -> list[LoadRequest]:
    """Read a JSONL trace: one `{"t": s, "prompt": str | "messages": [...], "max_tokens": n}` per
    non-blank line (`t` >= 0 seconds since the start; lines may come in any order and are sorted
    by `t`, stable; `prompt` becomes one user message; `max_tokens` defaults to `max_tokens`).

    Raises:
        ConfigError: missing file, bad JSON or a bad field (names the line).
    """
    field = "serve_load.workloads.trace.path"
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise ConfigError(field, f"cannot read trace {path}: {exc.strerror or exc}") from None
    out: list[tuple[float, int, LoadRequest]] = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            doc = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(field, f"{where}: invalid JSON: {exc.msg}") from None
        if not isinstance(doc, dict):
            raise ConfigError(field, f"{where}: a line must be a JSON object")
        t = doc.get("t")
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t < math.inf:
            raise ConfigError(field, f"{where}: 't' must be a number of seconds >= 0, got {t!r}")
        messages = _trace_messages(doc, where, field)
        mt = doc.get("max_tokens", max_tokens)
        if isinstance(mt, bool) or not isinstance(mt, int) or mt < 1:
            raise ConfigError(field, f"{where}: 'max_tokens' must be an integer >= 1, got {mt!r}")
        out.append((float(t), n, LoadRequest(f"l{n}", messages, mt, "trace", f"l{n}", None, float(t))))
    if not out:
        raise ConfigError(field, f"{path}: no requests")
    return [r for _, _, r in sorted(out, key=lambda x: (x[0], x[1]))]


def _trace_messages(doc: dict[str, Any], where: str, field: str) -> tuple[dict[str, str], ...]:
    if ("prompt" in doc) == ("messages" in doc):
        raise ConfigError(field, f"{where}: exactly one of 'prompt' and 'messages' is required")
    if "prompt" in doc:
        if not isinstance(doc["prompt"], str):
            raise ConfigError(field, f"{where}: 'prompt' must be a string")
        return _msgs(("user", doc["prompt"]))
    messages: Sequence[Any] = doc["messages"]
    ok = isinstance(messages, list) and messages and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages)
    if not ok:
        raise ConfigError(field, f"{where}: 'messages' must be a non-empty list of {{role, content}} strings")
    return tuple({"role": m["role"], "content": m["content"]} for m in messages)


__all__ = ["LOAD_WORKLOADS", "LOAD_WORKLOAD_DEFAULTS", "LoadWorkload", "TextSource", "build_load_workload",
           "kv_bytes_per_token", "load_trace", "multi_turn_conversations", "multi_turn_phase", "multi_turn_working_set",
           "opening_tokens", "validate_load_params", "workload_kind"]
