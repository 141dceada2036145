"""The `agents` load workload: agent loops whose every turn carries the model's actual reply.

N agents share one long system prompt (`system_prompt`). Agent `a` starts from its own task (a
user message); each turn sends the whole transcript so far; after an answer the transcript grows
by the reply the server returned (an assistant message; `EMPTY_REPLY` for an empty one, which is
not valid Messages input) and a tool result (a user message, `AgentsPlan.user_text`). So a turn's
request exists only once the previous answer has come back: the requests are built while the
batch runs (`AgentsBatch`), not ahead of it like the other workloads'. A failed turn stops its agent.

The same conversation goes to both servers in their own API: `kvtool serve` gets Anthropic's
Messages API (`POST /v1/messages` through the `anthropic` SDK: one `system` string, user and
assistant messages of plain text, `temperature` 0 in the body), plain `mlx_lm.server` the
equivalent chat completions (`openai` SDK). Both stream; TTFT is the request sent -> the first
text delta (ms). Tokens: kvtool's `usage.cache_read_input_tokens` is the cached prompt and
`input_tokens + cache_read_input_tokens + cache_creation_input_tokens` the prompt (Anthropic's
accounting); mlx-lm's `usage.prompt_tokens_details.cached_tokens` and `usage.prompt_tokens`.

Mismatches: greedy decoding on the same model keeps the two servers' conversations identical;
when an output differs, that turn is an output mismatch (the kvtool cell fails) and the agent goes
on with each server's own reply, so its later turns differ too (compared, and listed when they
differ). `prompt_token_mismatches` checks the prompt tokens of the turns still identical.

`[serve_load]`'s `clients` caps the turns in flight (and sets the agent count when `agents` is
0); its `arrival`, `max_requests` and `max_tokens` do not apply (the workload's own `max_tokens` is
per turn); `max_wall_s` bounds each phase. With `restart = true` the servers are restarted before
turn T/2 (`kvtool.bench.loadcell.run_batch`) and the agents go on with their transcripts
(phases: `turn_phase`).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvtool.bench.loadgen import (
    WALL_LIMIT_ERROR,
    LoadRequest,
    LoadResult,
    LoadSpec,
    RequestRecord,
    check_loopback,
    connect_retrying,
    error_text,
    finish_record,
    openai_client,
    stream_chat,
)
from kvtool.bench.loadserver import KVTOOL, MLXLM_FLAGS

AGENTS_DEFAULTS: dict[str, Any] = {"agents": 0, "turns": 8, "system_tokens": 12_000, "tools": 8,
                                   "result_min_tokens": 300, "result_max_tokens": 800, "max_tokens": 256,
                                   "restart": False}
EMPTY_REPLY = "(no reply)"
STOP_REASONS = {"end_turn": "stop", "max_tokens": "length", "stop_sequence": "stop"}  # Messages -> chat names
_KEY = re.compile(r"a(\d+)t(\d+)$")


def agents_phases(p: dict[str, Any]) -> tuple[str, ...]:
    """The phases of a validated `agents` parameter set in order: `("turn",)`, or with `restart`
    `("before", "after", "rewarm")` (`turn_phase`; `rewarm` only with turns after turn T/2)."""
    return tuple(dict.fromkeys(turn_phase(p, t) for t in range(p["turns"])))


def turn_phase(p: dict[str, Any], turn: int) -> str:
    """The phase turn `turn` (0-based) belongs to: `turn` without a restart; with one `before`
    below T/2, `after` at T/2 (the first turn after the restart), `rewarm` after it."""
    if not p["restart"]:
        return "turn"
    half = p["turns"] // 2
    return "before" if turn < half else "after" if turn == half else "rewarm"


@dataclass
class AgentsPlan:
    """The fixed part of an `agents` workload: the shared system prompt and the tool results.

    Attributes:
        params: the validated parameters (`AGENTS_DEFAULTS` keys).
        system: the shared system prompt (about `system_tokens` tokens of text).
        src: a `kvtool.bench.loadworkloads.TextSource` (its `rng` is reseeded per text drawn).
        seed: the workload seed.
        kinds: server kind -> `"messages"` (Anthropic Messages API) or `"chat"` (chat completions).
    """

    params: dict[str, Any]
    system: str
    src: Any
    seed: int
    kinds: dict[str, str] = field(default_factory=lambda: {KVTOOL: "messages", **dict.fromkeys(MLXLM_FLAGS, "chat")})
    _texts: dict[tuple[int, int], str] = field(default_factory=dict)

    def agent_count(self, clients: int) -> int:
        """Agents of a cell: the `agents` parameter, or the cell's clients when it is 0."""
        return int(self.params["agents"]) or clients

    def user_text(self, agent: int, turn: int) -> str:
        """The user message that precedes turn `turn` of `agent`: its task (turn 0), else the
        result of the tool called in the previous turn, of `result_min_tokens`..`result_max_tokens`
        tokens (length and text drawn from `default_rng([seed, agent, turn])`)."""
        if (agent, turn) not in self._texts:
            self.src.rng = np.random.default_rng([self.seed, agent, turn])
            if turn == 0:
                text = f"Task of agent {agent}: " + self.src.text(48)
            else:
                lo, hi = self.params["result_min_tokens"], self.params["result_max_tokens"]
                head = f"Tool result (agent {agent}, call {turn}):\n"
                n = int(self.src.rng.integers(lo, hi + 1)) - len(self.src.tok.encode(head))
                text = head + self.src.text(max(1, n))
            self._texts[(agent, turn)] = text
        return self._texts[(agent, turn)]

    def placeholders(self) -> list[LoadRequest]:
        """One request per turn of one agent (keys `a0t<turn>`): the phases and their sizes as
        the static workload lists them; the real requests are built while the batch runs."""
        return [LoadRequest(f"a0t{t}", (), self.params["max_tokens"], turn_phase(self.params, t), "a0")
                for t in range(self.params["turns"])]

    def batch(self, server_kind: str, clients: int) -> AgentsBatch:
        """Fresh conversations for one batch on a server of kind `server_kind` (`kinds`); every user
        message is drawn here, before the batch, so that no server's timing pays for it."""
        agents = self.agent_count(clients)
        for a in range(agents):
            for t in range(self.params["turns"]):
                self.user_text(a, t)
        return AgentsBatch(self, self.kinds[server_kind], agents)


def system_prompt(p: dict[str, Any], src: Any) -> str:
    """The shared system prompt: instructions, `tools` JSON tool definitions (at most one per 128
    tokens of the prompt; descriptions of corpus text, a quarter of the prompt in all), then corpus
    text up to about `system_tokens` tokens (tokens of the string)."""
    n_tools = min(p["tools"], max(1, p["system_tokens"] // 128))
    per_tool = max(8, p["system_tokens"] // (4 * max(1, n_tools)))
    tools = [{"name": f"tool_{i}", "description": src.text(per_tool),
              "input_schema": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}
             for i in range(n_tools)]
    head = ("[agents system prompt]\nYou are an agent. Call one of the tools below when you need data; "
            "its result comes back as the next user message.\n# Tools\n"
            + "\n".join(json.dumps(t, ensure_ascii=False) for t in tools) + "\n# Reference\n")
    rest = p["system_tokens"] - len(src.tok.encode(head))
    return head + (src.text(rest) if rest > 0 else "")


@dataclass
class AgentsBatch:
    """The conversations of one batch: `kind` `messages` or `chat`, `agents` transcripts."""

    plan: AgentsPlan
    kind: str
    agents: int
    transcripts: dict[int, list[dict[str, str]]] = field(default_factory=dict)
    stopped: set[int] = field(default_factory=set)
    index: int = 0

    def run_phase(self, base_url: str, phase: str, spec: LoadSpec,
                  on_progress: Callable[[int, int], None] | None = None) -> LoadResult:
        """Run every agent's turns of `phase` against the server at `base_url` (OpenAI base URL,
        with `/v1`; loopback only); at most `spec.clients` requests in flight, `spec.max_wall_s`
        for the phase (cut turns are recorded with `WALL_LIMIT_ERROR`).

        Returns:
            A `LoadResult` with one `RequestRecord` per turn sent (keys `a<agent>t<turn>`).

        Raises:
            ValueError: a non-loopback URL.
        """
        check_loopback(base_url)
        return asyncio.run(self._run(base_url, phase, spec, on_progress))

    async def _run(self, base_url: str, phase: str, spec: LoadSpec,
                   on_progress: Callable[[int, int], None] | None) -> LoadResult:
        turns = [t for t in range(self.plan.params["turns"]) if turn_phase(self.plan.params, t) == phase]
        client = _client(self.kind, base_url, spec.request_timeout_s)
        records: list[RequestRecord] = []
        slots, t0 = asyncio.Semaphore(spec.clients), time.perf_counter()
        total = len(turns) * self.agents

        async def agent(a: int) -> None:
            for t in turns:
                if a in self.stopped:
                    return
                rec = RequestRecord(index=self.index, key=f"a{a}t{t}", phase=phase, session=f"a{a}")
                self.index += 1
                records.append(rec)
                rec.scheduled_s = time.perf_counter() - t0
                async with slots:
                    await self._turn(client, a, t, rec, t0)
                if on_progress:
                    on_progress(len(records), total)

        task = asyncio.ensure_future(asyncio.gather(*(agent(a) for a in range(self.agents))))
        try:
            done, _ = await asyncio.wait({task}, timeout=spec.max_wall_s)
            if not done:
                task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        finally:
            await client.close()
        for rec in records:
            if rec.sent and rec.latency_ms != rec.latency_ms and not rec.error:
                rec.error = WALL_LIMIT_ERROR
        sent = [r for r in records if r.sent]
        ends = [r.sent_s + r.latency_ms / 1e3 for r in sent if r.latency_ms == r.latency_ms]
        wall = (max(ends) if ends else 0.0) - min((r.sent_s for r in sent), default=0.0)
        return LoadResult(sent, wall, total - len(sent), "done" if task.done() and not task.cancelled() else "wall",
                          spec)

    def messages(self, agent: int, turn: int) -> list[dict[str, str]]:
        """The transcript agent `agent` sends at turn `turn` (user/assistant messages, no system)."""
        history = self.transcripts.setdefault(agent, [])
        if len(history) < 2 * turn + 1:
            history.append({"role": "user", "content": self.plan.user_text(agent, turn)})
        return list(history)

    async def _turn(self, client: Any, agent: int, turn: int, rec: RequestRecord, t0: float) -> None:
        msgs = self.messages(agent, turn)
        rec.sent_s, rec.sent = time.perf_counter() - t0, True
        rec.queue_ms = (rec.sent_s - rec.scheduled_s) * 1e3
        try:
            if self.kind == "messages":
                await _stream_messages(client, self.plan.system, msgs, self.plan.params["max_tokens"], rec)
            else:  # chat completions: the system prompt as the first message
                await stream_chat(client, "default_model", [{"role": "system", "content": self.plan.system}, *msgs],
                                  self.plan.params["max_tokens"], rec)
        except asyncio.CancelledError:
            rec.error = WALL_LIMIT_ERROR
            self.stopped.add(agent)
            raise
        except Exception as exc:  # noqa: BLE001 - a failed turn is recorded and stops its agent
            rec.error = error_text(exc)
            self.stopped.add(agent)
            return
        self.transcripts[agent].append({"role": "assistant", "content": rec.text or EMPTY_REPLY})


def _client(kind: str, base_url: str, timeout_s: float) -> Any:
    if kind == "messages":
        from anthropic import AsyncAnthropic

        root = base_url.rstrip("/").removesuffix("/v1")  # the SDK adds /v1/messages
        return AsyncAnthropic(base_url=root, api_key="unused", max_retries=0, timeout=timeout_s)
    return openai_client(base_url, timeout_s)


async def _stream_messages(client: Any, system: str, msgs: list[dict[str, str]], max_tokens: int,
                           rec: RequestRecord) -> None:
    """One streamed Messages call; fills `rec` (TTFT at the first non-empty text delta)."""
    t0, first, parts = time.perf_counter(), None, []
    stream = await connect_retrying(lambda: client.messages.create(
        model="default_model", system=system, messages=msgs, max_tokens=max_tokens, stream=True,
        extra_body={"temperature": 0.0}))
    async for event in stream:
        if event.type == "content_block_delta" and getattr(event.delta, "text", ""):
            first = first or time.perf_counter()
            parts.append(event.delta.text)
        elif event.type == "message_delta":
            rec.finish_reason = STOP_REASONS.get(event.delta.stop_reason or "", event.delta.stop_reason)
            u = event.usage
            cached = int(u.cache_read_input_tokens or 0)
            rec.prompt_tokens = int(u.input_tokens or 0) + cached + int(u.cache_creation_input_tokens or 0)
            rec.completion_tokens, rec.cached_tokens = int(u.output_tokens or 0), cached
    finish_record(rec, t0, first, parts)


def prompt_token_mismatches(requests: Any) -> int:
    """Agent turns whose transcript was identical on both servers (every earlier output of the
    agent equal) but whose reported prompt tokens differ.

    Args:
        requests: a pandas frame of `requests.jsonl` rows (`workload`, `server`, `clients`,
            `repeat`, `key`, `text`, `prompt_tokens`, `error`).

    Returns:
        The count (0 when there is no `agents` row or only one server ran).
    """
    rows = requests[requests["workload"] == "agents"] if "workload" in requests else requests.iloc[0:0]
    by: dict[tuple[Any, ...], dict[str, Any]] = {}
    for r in rows.to_dict(orient="records"):
        m = _KEY.match(str(r["key"]))
        if m and not isinstance(r.get("error"), str):
            by.setdefault((r["clients"], r["repeat"], int(m[1]), int(m[2])), {})[r["server"]] = r
    bad, diverged = 0, set()
    for (clients, repeat, agent, _turn), pair in sorted(by.items()):
        if len(pair) != 2 or (clients, repeat, agent) in diverged:
            continue
        k, m = pair.values()
        bad += int(k["prompt_tokens"] != m["prompt_tokens"])
        if k["text"] != m["text"]:
            diverged.add((clients, repeat, agent))
    return bad


__all__ = ["AGENTS_DEFAULTS", "AgentsBatch", "AgentsPlan", "EMPTY_REPLY", "agents_phases", "prompt_token_mismatches",
           "system_prompt", "turn_phase"]
