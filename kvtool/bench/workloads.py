"""Benchmark workloads: deterministic request sequences built from local public-domain text.

Every workload is a fixed list of *steps* (requests, plus the actions `Restart` and
`DropPageCache`) computed once per sweep from the seed, so every cell of the sweep replays exactly
the same token ids. Sizes are given in tokens: the text of Python's own documentation
(`pydoc_data.topics`, shipped with CPython, available offline) is tokenized once with the model's
tokenizer into a token stream, and prompts are concatenations of slices of that stream. This gives
exact prompt lengths and exact shared prefixes whatever the tokenizer.

Shapes (see `WORKLOAD_DEFAULTS` for the parameters):
- `shared-prefix`: one long system prompt, many distinct user questions.
- `multi-turn`: conversations where each turn extends the previous one (vLLM multi-turn shape);
  the assistant turns are corpus text, not the model's answer, so all cells see the same ids.
- `long-doc-qa`: N documents, a warm-up pass, then repeated questions in random order
  (LMCache long_doc_qa shape); the report shows TTFT gain = warm-up TTFT / query TTFT.
- `restart`: populate, restart (fresh tier, empty RAM, page cache dropped), replay the same prompts.
- `ram-pressure`: a working set `working_set_factor` x the RAM budget, Zipf-sampled, so blocks are
  evicted from RAM and come back from SSD (LMCache kv-tier-pressure shape).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from pydantic import BaseModel, ValidationError

from kvtool.config import ConfigError
from kvtool.units import parse_size

Encode = Callable[[str], Sequence[int]]

# Parameters of each workload and their defaults (all sizes in tokens).
WORKLOAD_DEFAULTS: dict[str, dict[str, Any]] = {
    "shared-prefix": {"requests": 8, "system_tokens": 1024, "question_tokens": 32},
    "multi-turn": {"conversations": 2, "turns": 4, "system_tokens": 128, "user_tokens": 64, "assistant_tokens": 64},
    "long-doc-qa": {"documents": 4, "doc_tokens": 1024, "question_tokens": 16, "queries": 8},
    "restart": {"prompts": 4, "prompt_tokens": 1024, "question_tokens": 16},
    "ram-pressure": {
        "working_set_factor": 2.0,
        "doc_tokens": 512,
        "question_tokens": 16,
        "requests": 16,
        "zipf_s": 1.1,
        "max_documents": 64,
        "ram_bytes": 0,  # reference RAM budget (bytes); 0 = the sweep's [cache] ram_bytes
    },
}
WORKLOAD_NAMES = tuple(WORKLOAD_DEFAULTS)
# Phases whose requests a cell is judged on (TTFT percentiles, hit rates); others prepare state.
MEASURED_PHASES = {
    "shared-prefix": ("query",),
    "multi-turn": ("turn",),
    "long-doc-qa": ("query",),
    "restart": ("replay",),
    "ram-pressure": ("query",),
}
_FLOAT_PARAMS = {"working_set_factor", "zipf_s"}


@dataclass(frozen=True)
class Request:
    """One request of a workload.

    Attributes:
        ids: prompt token ids.
        phase: what the request is for (`warmup`, `populate`, `query`, `turn`, `replay`).
        group: the document / conversation it belongs to.
    """

    ids: tuple[int, ...]
    phase: str
    group: str


@dataclass(frozen=True)
class Restart:
    """Action: close the tier and reopen it with an empty RAM tier (the model stays resident)."""


@dataclass(frozen=True)
class DropPageCache:
    """Action: drop the OS page cache of the cell's block files (cold SSD reads follow)."""


Step = Request | Restart | DropPageCache


@dataclass(frozen=True)
class WorkloadContext:
    """Model and sweep facts a workload may size itself by.

    Attributes:
        kv_bytes_per_token: KV bytes of one token over all layers (keys + values).
        ram_bytes: reference RAM budget of the sweep (bytes).
    """

    kv_bytes_per_token: int
    ram_bytes: int


@dataclass(frozen=True)
class Workload:
    """A named, fully materialised sequence of steps."""

    name: str
    steps: tuple[Step, ...]
    params: dict[str, Any]

    @property
    def requests(self) -> list[Request]:
        """The requests only, in order."""
        return [s for s in self.steps if isinstance(s, Request)]

    @property
    def measured_phases(self) -> tuple[str, ...]:
        """Phases the cell metrics are computed on."""
        return MEASURED_PHASES[self.name]


def merge_params(table: dict[str, dict[str, Any]], name: str, params: dict[str, Any], where: str,
                 check: Callable[[str, Any, str], Any]) -> dict[str, Any]:
    """`params` over the defaults `table[name]`, each value as `check(key, value, field)` returns it.

    Raises:
        ConfigError: unknown workload or parameter (the error names the field); what `check` raises.
    """
    if name not in table:
        raise ConfigError(f"{where}.{name}", f"unknown workload; choose from {', '.join(table)}")
    merged = dict(table[name])
    for key, value in params.items():
        field = f"{where}.{name}.{key}"
        if key not in merged:
            raise ConfigError(field, f"unknown parameter; known: {', '.join(merged)}")
        merged[key] = check(key, value, field)
    return merged


def positive_number(value: Any, field: str) -> float:
    """`value` as a float > 0. Raises ConfigError naming `field` (a bool, NaN or <= 0 too)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(field, f"must be a number > 0, got {value!r}")
    return float(value)


def size_field(field: str, value: Any) -> Any:
    """A byte size written as a string (`"4MiB"`, `"1GB"`) in bytes; anything else as it is (left
    to the caller's check). Raises ConfigError naming `field` for a string that is not a size."""
    if not isinstance(value, str):
        return value
    try:
        return parse_size(value)
    except ValueError as exc:
        raise ConfigError(field, str(exc)) from None


def count(value: Any, field: str, zero_ok: bool = False) -> int:
    """`value` as an integer >= 1 (>= 0 with `zero_ok`). Raises ConfigError naming `field`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < (0 if zero_ok else 1):
        raise ConfigError(field, f"must be a positive integer, got {value!r}")
    return value


def config_error(exc: ValidationError, where: str, tables: dict[str, type[BaseModel]]) -> ConfigError:
    """A bench config's pydantic error as a `ConfigError` naming `<where>.<key path>` (list indices
    and union branches left out): the first unknown key (with the keys its table knows:
    `tables` maps a key path's first key, "" for the top, to its model), else the deepest error."""
    err = max(exc.errors(include_url=False), key=lambda e: (e["type"] == "extra_forbidden", len(e["loc"])))
    loc = [str(p) for p in err["loc"] if not isinstance(p, int) and not str(p).startswith(("literal[", "constrained-"))]
    name = ".".join([where, *loc]) if where else ".".join(loc)
    if err["type"] == "extra_forbidden":
        table = tables.get(loc[0] if len(loc) > 1 else "", tables[""])
        return ConfigError(name, f"unknown key; known: {', '.join(sorted(f.alias or n for n, f in table.model_fields.items()))}")
    reason = err["msg"].removeprefix("Value error, ")
    return ConfigError(name, reason + ("" if repr(err["input"]) in reason else f", got {err['input']!r}"))


def validate_params(name: str, params: dict[str, Any], where: str = "workloads") -> dict[str, Any]:
    """The complete parameters of workload `name`: `params` (from the sweep TOML) over its
    `WORKLOAD_DEFAULTS`, checked.

    Raises:
        ConfigError: unknown workload, unknown parameter or invalid value (names the field,
            prefixed with `where`).
    """
    def check(key: str, value: Any, field: str) -> Any:
        return positive_number(value, field) if key in _FLOAT_PARAMS else count(value, field, zero_ok=key == "ram_bytes")

    merged = merge_params(WORKLOAD_DEFAULTS, name, params, where, check)
    if name == "multi-turn" and merged["system_tokens"] < 1:
        raise ConfigError(f"{where}.{name}.system_tokens", "must be >= 1")
    return merged


class TokenPool:
    """A deterministic stream of corpus tokens, handed out in disjoint slices.

    The corpus is the text of `pydoc_data.topics`, topics in an order drawn from `seed`, tokenized
    lazily with `encode` (text -> token ids: the model's tokenizer, raw text, no chat template).
    Special tokens the tokenizer adds around any text (e.g. BOS) are detected once and kept apart
    as `head`, which starts every prompt.
    """

    def __init__(self, encode: Encode, seed: int):
        self._encode = encode
        self.head, self._tail = _special_tokens(encode)
        self._topics = _corpus_topics(seed)
        self._buffer: list[int] = []
        self._next_topic = 0
        self._documents = 0

    def _content(self, text: str) -> list[int]:
        ids = list(self._encode(text))
        return ids[len(self.head) : len(ids) - self._tail]

    def take(self, n: int) -> tuple[int, ...]:
        """The next `n` tokens of the corpus stream (no special tokens)."""
        while len(self._buffer) < n:
            topic = self._topics[self._next_topic % len(self._topics)]
            self._next_topic += 1
            self._buffer.extend(self._content(topic + "\n\n"))
        out, self._buffer = self._buffer[:n], self._buffer[n:]
        return tuple(out)

    def document(self, n: int, label: str) -> tuple[int, ...]:
        """`n` tokens starting with a unique header, so no two documents share a first block
        (even if the corpus stream wraps around)."""
        self._documents += 1
        header = self._content(f"[{self._documents}: {label}]\n")[:n]
        return tuple(header) + self.take(n - len(header))


def _special_tokens(encode: Encode) -> tuple[tuple[int, ...], int]:
    """(leading special ids, number of trailing special ids) that `encode` adds to any text."""
    a, b = list(encode("alpha")), list(encode("omega"))
    head = 0
    while head < min(len(a), len(b)) and a[head] == b[head]:
        head += 1
    tail = 0
    while tail < min(len(a), len(b)) - head and a[-1 - tail] == b[-1 - tail]:
        tail += 1
    return tuple(a[:head]), tail


def _corpus_topics(seed: int) -> list[str]:
    from pydoc_data.topics import topics

    keys = sorted(topics)
    order = np.random.default_rng(seed).permutation(len(keys))
    return [topics[keys[i]] for i in order]


def build_workload(
    name: str, params: dict[str, Any], encode: Encode, seed: int, ctx: WorkloadContext
) -> Workload:
    """Materialise one workload with all its steps: `params` are validated here
    (`validate_params`), `encode` is text -> token ids, the same `seed` gives the same token ids,
    `ctx` sizes `ram-pressure`."""
    p = validate_params(name, params)
    pool = TokenPool(encode, seed)
    rng = np.random.default_rng([seed, WORKLOAD_NAMES.index(name)])
    steps = list(_BUILDERS[name](p, pool, rng, ctx))
    return Workload(name=name, steps=tuple(steps), params=p)


def _shared_prefix(p: dict, pool: TokenPool, rng: np.random.Generator, ctx: WorkloadContext) -> Iterator[Step]:
    system = pool.head + pool.document(p["system_tokens"], "system")
    for i in range(p["requests"]):
        yield Request(system + pool.take(p["question_tokens"]), "query", f"q{i}")


def _multi_turn(p: dict, pool: TokenPool, rng: np.random.Generator, ctx: WorkloadContext) -> Iterator[Step]:
    history = {c: pool.head + pool.document(p["system_tokens"], "conversation") for c in range(p["conversations"])}
    for _turn in range(p["turns"]):  # conversations interleaved round-robin, as concurrent users would be
        for c in range(p["conversations"]):
            history[c] += pool.take(p["user_tokens"])
            yield Request(history[c], "turn", f"conv{c}")
            history[c] += pool.take(p["assistant_tokens"])


def _long_doc_qa(p: dict, pool: TokenPool, rng: np.random.Generator, ctx: WorkloadContext) -> Iterator[Step]:
    docs = [pool.head + pool.document(p["doc_tokens"], "document") for _ in range(p["documents"])]
    for d, doc in enumerate(docs):
        yield Request(doc + pool.take(p["question_tokens"]), "warmup", f"doc{d}")
    for d in rng.integers(0, len(docs), size=p["queries"]):
        yield Request(docs[d] + pool.take(p["question_tokens"]), "query", f"doc{d}")


def _restart(p: dict, pool: TokenPool, rng: np.random.Generator, ctx: WorkloadContext) -> Iterator[Step]:
    prompts = [pool.head + pool.document(p["prompt_tokens"], "prompt") + pool.take(p["question_tokens"])
               for _ in range(p["prompts"])]
    for i, ids in enumerate(prompts):
        yield Request(ids, "populate", f"p{i}")
    yield Restart()
    yield DropPageCache()
    for i in rng.permutation(len(prompts)):
        yield Request(prompts[i], "replay", f"p{i}")


def ram_pressure_documents(p: dict[str, Any], ctx: WorkloadContext) -> int:
    """Number of documents whose KV is `working_set_factor` x the reference RAM budget (2 ..
    `max_documents`)."""
    budget = p["ram_bytes"] or ctx.ram_bytes
    doc_bytes = max(1, p["doc_tokens"] * ctx.kv_bytes_per_token)
    return max(2, min(p["max_documents"], math.ceil(p["working_set_factor"] * budget / doc_bytes)))


def _ram_pressure(p: dict, pool: TokenPool, rng: np.random.Generator, ctx: WorkloadContext) -> Iterator[Step]:
    n = ram_pressure_documents(p, ctx)
    docs = [pool.head + pool.document(p["doc_tokens"], "document") for _ in range(n)]
    for d, doc in enumerate(docs):
        yield Request(doc + pool.take(p["question_tokens"]), "populate", f"doc{d}")
    yield DropPageCache()
    weights = 1.0 / np.arange(1, n + 1) ** p["zipf_s"]
    rank_to_doc = rng.permutation(n)  # popularity is not tied to population order
    for rank in rng.choice(n, size=p["requests"], p=weights / weights.sum()):
        d = int(rank_to_doc[rank])
        yield Request(docs[d] + pool.take(p["question_tokens"]), "query", f"doc{d}")


_BUILDERS = {
    "shared-prefix": _shared_prefix,
    "multi-turn": _multi_turn,
    "long-doc-qa": _long_doc_qa,
    "restart": _restart,
    "ram-pressure": _ram_pressure,
}
