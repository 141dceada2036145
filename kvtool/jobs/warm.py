"""`kvtool warm`: prefill prompts into the SSD tier ahead of time (no decode).

Sources (`load_sources`):
- a text file: one prompt per non-blank line, or the whole file as one prompt (`whole=True`);
- a JSONL file (`.jsonl`): one `{"prompt": ...}` or `{"messages": [...]}` object per line;
- a directory: every `.txt` / `.md` file below it (sorted, hidden entries skipped), one prompt each.

Each prompt goes through `Engine.prefill`: a prompt whose full blocks are all on SSD already is
skipped by hashing alone (the model does not run), otherwise its missing blocks are computed and
written through to SSD whatever the policy. `warm` flushes the engine at the end so every block
has reached SSD (under the configured async/durability settings) before it returns; the caller
closes the engine.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from kvtool.jobs.ssd_writes import ssd_write_problem, stats_delta, write_counts
from kvtool.models.limits import TokenLimitError, TokenLimits
from kvtool.prompts import (
    MAX_PROMPT_BYTES,
    PromptSourceTooLarge,
    Request,
    RequestFileError,
    parse_requests_jsonl,
    read_text,
)
from kvtool.units import format_bytes

if TYPE_CHECKING:
    from kvtool.engine import Engine  # (MLX: for annotations only)

SOURCE_SUFFIXES = (".txt", ".md")  # files taken from a directory source
JSONL_SUFFIXES = (".jsonl",)
MAX_DETAILS = 1000  # per-prompt results kept in the report

# progress(event) after each prompt; `event` is the running `WarmReport`
ProgressFn = Callable[["WarmReport"], None]


class WarmError(Exception):
    """Warm cannot run: unusable source, uncacheable model, or SSD tier unavailable."""


@dataclass
class WarmPrompt:
    """One prompt to warm and where it came from (`file`, `file:line` or `file:line` of a JSONL)."""

    request: Request
    source: str


@dataclass
class PromptResult:
    """What warming one prompt did. Token counts in tokens, time in ms.

    Attributes:
        source: where the prompt came from.
        status: 'skipped' (every block and the tail entry already on SSD, model not run),
            'too_short' (a single token: a replay re-forwards it anyway, nothing to cache, model
            not run) or 'prefilled'. A prompt shorter than one block is cached as a tail entry.
        prompt_tokens: tokens in the prompt.
        cached_tokens: leading tokens already cached (not recomputed).
        prefill_tokens: tokens run through the model.
        blocks_queued: new blocks handed to the SSD writer.
        prefill_ms: model time.
    """

    source: str
    status: str
    prompt_tokens: int
    cached_tokens: int
    prefill_tokens: int
    blocks_queued: int
    prefill_ms: float


@dataclass
class WarmReport:
    """Outcome of one warm run (also the running state passed to `progress`).

    Attributes:
        layout_key: the namespace written (None: the model runs uncached, nothing is written).
        namespace_dir: its directory.
        prompts_total: prompts given.
        prompts_done: prompts processed (less than total if interrupted).
        prompts_skipped, prompts_too_short, prompts_prefilled: by status.
        tokens: prompt tokens processed; tokens_prefilled: of which run through the model.
        blocks_written, bytes_written, blocks_dedup, blocks_failed, blocks_over_budget: what the
            SSD writer did (`kvtool.jobs.ssd_writes.WriteCounts`).
        blocks_evicted, bytes_evicted: blocks (and bytes) the byte budget evicted to make room.
        blocks_resident, bytes_resident: what the namespace holds on SSD at the end (set by the
            caller after the engine is closed; None: not counted).
        elapsed_s: wall time (seconds).
        flushed: every accepted write was attempted before return.
        interrupted: the signal name if stopped early, else None.
        prompts: per-prompt results (first `MAX_DETAILS`).
    """

    layout_key: str | None
    namespace_dir: str
    prompts_total: int
    prompts_done: int = 0
    prompts_skipped: int = 0
    prompts_too_short: int = 0
    prompts_prefilled: int = 0
    tokens: int = 0
    tokens_prefilled: int = 0
    blocks_written: int = 0
    bytes_written: int = 0
    blocks_dedup: int = 0
    blocks_failed: int = 0
    blocks_over_budget: int = 0
    blocks_evicted: int = 0
    bytes_evicted: int = 0
    blocks_resident: int | None = None
    bytes_resident: int | None = None
    elapsed_s: float = 0.0
    flushed: bool = True
    interrupted: str | None = None
    prompts: list[PromptResult] = field(default_factory=list)

    def to_dict(self) -> dict:
        """JSON-ready document (docs/commands.md#kvtool-warm)."""
        return asdict(self)


# ----------------------------------------------------------------------------- sources
def load_sources(paths: Sequence[Path], whole: bool = False, max_bytes: int = MAX_PROMPT_BYTES) -> list[WarmPrompt]:
    """Read every source into prompts, in the order given.

    Args:
        paths: text files, `.jsonl` files or directories.
        whole: a text file is one prompt (default: one prompt per non-blank line).
            Files found in a directory are always whole prompts.
        max_bytes: the most bytes read from all sources together (a file, device or pipe
            beyond it is refused after reading at most the remaining budget plus one byte).

    Returns:
        The prompts (at least one).

    Raises:
        WarmError: a source is missing, unreadable, not UTF-8, empty, an invalid JSONL (the
            message names the file and line), or the sources hold more than `max_bytes` bytes.
    """
    if not paths:
        raise WarmError("no source given")
    prompts: list[WarmPrompt] = []
    budget = _Budget(max_bytes)
    for path in map(Path, paths):
        try:
            prompts.extend(_load_one(path, whole, budget))
        except RequestFileError as exc:
            raise WarmError(str(exc)) from None
        except OSError as exc:
            raise WarmError(f"cannot read {exc.filename or path}: {exc.strerror or exc}") from None
    return prompts


class _Budget:
    """Bytes left to read from the sources of one `load_sources` call."""

    def __init__(self, total: int):
        self.total = total
        self.left = total

    def read(self, path: Path) -> str:
        """`read_text` within what is left (spent by the file's UTF-8 size).

        Raises:
            WarmError: the sources read so far and this file hold more than `total` bytes.
        """
        try:
            text = read_text(path, self.left)
        except PromptSourceTooLarge:
            raise WarmError(f"{path}: the sources hold more than {format_bytes(self.total)}, the limit for "
                            "warm sources in all (--max-prompt-bytes)") from None
        self.left -= len(text.encode("utf-8"))
        return text


def _load_one(path: Path, whole: bool, budget: _Budget) -> list[WarmPrompt]:
    if path.is_dir():
        files = sorted(
            p for p in path.rglob("*")
            if p.is_file() and p.suffix.lower() in SOURCE_SUFFIXES
            and not any(part.startswith(".") for part in p.relative_to(path).parts)
        )  # fmt: skip
        if not files:
            raise WarmError(f"{path}: no {'/'.join(SOURCE_SUFFIXES)} files in this directory")
        return [WarmPrompt(Request(prompt=budget.read(f)), str(f)) for f in files]
    if not path.exists():
        raise WarmError(f"source not found: {path}")
    if path.suffix.lower() in JSONL_SUFFIXES:
        requests = parse_requests_jsonl(budget.read(path), str(path))
        return [WarmPrompt(r, f"{path}:{i}") for i, r in enumerate(requests, start=1)]
    text = budget.read(path)
    if whole:
        return [WarmPrompt(Request(prompt=text), str(path))]
    return [
        WarmPrompt(Request(prompt=line), f"{path}:{n}")
        for n, line in enumerate(text.splitlines(), start=1)
        if line.strip()
    ]


# ----------------------------------------------------------------------------- warm
def check_engine(engine: Engine) -> None:
    """Make sure `engine` can write blocks to SSD.

    Raises:
        WarmError: the model runs uncached, or the SSD tier is off or disabled.
    """
    problem = ssd_write_problem(engine, "warm")
    if problem is not None:
        raise WarmError(problem)


def warm(
    engine,
    prompts: Sequence[WarmPrompt],
    progress: ProgressFn | None = None,
    interrupts: tuple[type[BaseException], ...] = (KeyboardInterrupt,),
    *,
    chat_template: bool = False,
    system_prompt: str | None = None,
    limits: TokenLimits | None = None,
) -> WarmReport:
    """Prefill `prompts` through `engine` and make sure their blocks reach SSD.

    An exception of a type in `interrupts` (Ctrl-C, or the CLI's signal exception) stops the
    run cleanly: the engine is flushed, so every block already queued is written, and the
    report comes back with `interrupted` set. Any other exception also flushes, then propagates.
    The caller closes the engine.

    Args:
        engine: a `kvtool.engine.Engine` with an SSD tier.
        prompts: from `load_sources`.
        progress: called with the running report after each prompt.
        interrupts: exception types that mean "stop now" rather than "failed".
        chat_template, system_prompt: as `Engine.encode` for plain prompts (the CLI applies the
            chat template by default, like `serve-once`, so warmed prompts hit).
        limits: a prompt of more than `limits.max_prompt_tokens` tokens is refused before it is
            prefilled (`kvtool.models.limits`, the rule of `kvtool serve`); None: no limit.

    Returns:
        The report; block and byte counts are exact (taken after the flush).

    Raises:
        WarmError: the engine cannot write to SSD (see `check_engine`), a prompt cannot be
            encoded (e.g. chat messages for a tokenizer without a chat template), or a prompt is
            longer than `limits.max_prompt_tokens` (the prompts before it stay warmed).
    """
    check_engine(engine)
    report = WarmReport(engine.layout_key, str(engine.namespace_dir), len(prompts))
    base = engine.stats()
    t0 = time.perf_counter()
    try:
        for item in prompts:
            _warm_one(engine, item, report, chat_template, system_prompt, limits)
            update_counts(report, base, engine.stats())
            if progress is not None:
                progress(report)
    except interrupts as exc:
        report.interrupted = str(exc) or type(exc).__name__
    finally:
        report.flushed = engine.flush()
        update_counts(report, base, engine.stats())
        report.elapsed_s = time.perf_counter() - t0
    return report


def _warm_one(engine: Engine, item: WarmPrompt, report: WarmReport, chat_template: bool = False,
              system_prompt: str | None = None, limits: TokenLimits | None = None) -> None:
    req = item.request
    try:
        ids = engine.encode(prompt=req.prompt, messages=req.messages, chat_template=chat_template,
                            system_prompt=system_prompt)
    except ValueError as exc:
        raise WarmError(f"{item.source}: {exc}") from None
    if not ids:
        raise WarmError(f"{item.source}: the prompt has no tokens")
    if limits is not None:
        try:
            limits.check_prompt(len(ids), item.source)
        except TokenLimitError as exc:
            raise WarmError(str(exc)) from None
    if len(ids) < 2:
        from kvtool.engine import RequestResult  # the engine (and MLX) is loaded already

        res = RequestResult(prompt_tokens=len(ids), prefill_tokens=0, finish_reason="too_short")
        status = "too_short"
    else:
        res = engine.prefill(ids)
        status = "skipped" if res.finish_reason == "skipped" else "prefilled"
    report.prompts_done += 1
    report.prompts_skipped += status == "skipped"
    report.prompts_too_short += status == "too_short"
    report.prompts_prefilled += status == "prefilled"
    report.tokens += res.prompt_tokens
    report.tokens_prefilled += res.prefill_tokens if status == "prefilled" else 0
    if len(report.prompts) < MAX_DETAILS:
        report.prompts.append(
            PromptResult(item.source, status, res.prompt_tokens, res.cached_tokens,
                         res.prefill_tokens if status == "prefilled" else 0, res.blocks_written,
                         round(res.prefill_ms, 3))
        )  # fmt: skip


def update_counts(report: WarmReport, base: dict, now: dict) -> None:
    """Set `report`'s SSD counts (blocks, bytes, dedup, failed, over budget, evicted) to what the
    writer did between the `Engine.stats()` snapshots `base` and `now`: after the engine is
    closed, `now` is what reached the disk once the writer drained. Raises nothing."""
    write_counts(base, now).set_on(report)
    report.blocks_evicted, report.bytes_evicted = stats_delta(base, now, "ssd_budget_evicted_blocks",
                                                              "ssd_budget_evicted_bytes")


__all__ = ["warm", "load_sources", "check_engine", "update_counts", "WarmReport", "PromptResult", "WarmPrompt", "WarmError"]
