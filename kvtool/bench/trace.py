"""Mooncake request traces: reading, validating and finding them (`kvtool bench-plan`).

The format is the one Moonshot AI published with the Mooncake paper (FAST'25; the repository
kvcache-ai/Mooncake, directory `FAST25-release/`, Apache-2.0) and SGLang's serving benchmark reads
(dataset `mooncake`): JSONL, one request a line,
`{"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids": [id, ...]}`, where
`hash_ids` name the prompt's blocks of `TRACE_BLOCK_TOKENS` tokens (the last one partial) and equal
ids mean equal prefixes (each id is a chain hash: it names its block and every block before it).

A trace is given as a path, or by a name of `TRACE_FILES` looked up in a trace directory (a copy of
`FAST25-release/`, its `traces/` or `arxiv-trace/` subdirectory, or a flat directory); the default
directory is `$KVTOOL_TRACE_DIR`, else the samples shipped beside this module (`SAMPLES_DIR`: the
first 300 requests of each file we have, with their source and license in its README.md).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from kvtool.errors import KVToolError

TRACE_BLOCK_TOKENS = 512  # tokens per hash id in the Mooncake traces
TRACE_FILES = {
    "conversation": "conversation_trace.jsonl",
    "toolagent": "toolagent_trace.jsonl",
    "synthetic": "synthetic_trace.jsonl",
    "mooncake": "mooncake_trace.jsonl",  # the older arXiv trace
}
SUBDIRS = ("", "traces", "arxiv-trace")  # where a name is looked for inside a trace directory
SAMPLES_DIR = Path(__file__).resolve().parent / "traces"
TRACE_DIR_ENV = "KVTOOL_TRACE_DIR"


class TraceError(KVToolError):
    """A trace that cannot be found or read, or a malformed line (exit 2)."""


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace.

    Attributes:
        timestamp_ms: arrival, milliseconds from the trace's start.
        input_length: prompt tokens (>= 1).
        output_length: generated tokens (>= 0).
        hash_ids: the prompt's block ids, `ceil(input_length / TRACE_BLOCK_TOKENS)` of them.
    """

    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    def block_tokens(self, i: int) -> int:
        """Tokens of block `i` (`TRACE_BLOCK_TOKENS`, fewer for a partial last block)."""
        return min(TRACE_BLOCK_TOKENS, self.input_length - i * TRACE_BLOCK_TOKENS)


def _int_field(doc: dict, key: str, low: int) -> int:
    value = doc.get(key)
    if key not in doc:
        raise ValueError(f"missing field {key!r}")
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{key} must be an integer, got {value!r}")
    if value < low:
        raise ValueError(f"{key} must be >= {low}, got {value}")
    return value


def parse_request(line: str) -> TraceRequest:
    """One trace line as a `TraceRequest`.

    Raises:
        ValueError: not a JSON object, a field missing or of the wrong type, a negative value, an
            empty prompt, a negative or non-integer id, or a block count that does not match
            `input_length`.
    """
    try:
        doc = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON ({exc.msg})") from None
    if not isinstance(doc, dict):
        raise ValueError(f"not a JSON object: {line.strip()[:40]!r}")
    ts = _int_field(doc, "timestamp", 0)
    n_in = _int_field(doc, "input_length", 1)
    n_out = _int_field(doc, "output_length", 0)
    ids = doc.get("hash_ids")
    if not isinstance(ids, list):
        raise ValueError(f"hash_ids must be a list of integers, got {ids!r}" if "hash_ids" in doc else "missing field 'hash_ids'")
    for h in ids:
        if not isinstance(h, int) or isinstance(h, bool) or h < 0:
            raise ValueError(f"hash_ids must hold non-negative integers, got {h!r}")
    want = -(-n_in // TRACE_BLOCK_TOKENS)
    if len(ids) != want:
        raise ValueError(f"{len(ids)} hash_ids for input_length {n_in}: {want} blocks of {TRACE_BLOCK_TOKENS} tokens expected")
    return TraceRequest(ts, n_in, n_out, tuple(ids))


def read_trace(path: Path, limit: int | None = None) -> list[TraceRequest]:
    """The requests of a Mooncake trace file (blank lines skipped).

    Args:
        path: a JSONL trace.
        limit: read at most this many requests (None: all).

    Raises:
        TraceError: the file cannot be read, holds no request, or a line is malformed (the
            message names the file and the line number).
    """
    out: list[TraceRequest] = []
    try:
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if limit is not None and len(out) >= limit:
                    break
                if not line.strip():
                    continue
                try:
                    out.append(parse_request(line))
                except ValueError as exc:
                    raise TraceError(f"{path}:{lineno}: {exc}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceError(f"cannot read trace {path}: {exc}") from None
    if not out:
        raise TraceError(f"trace {path} holds no request")
    return out


def resolve_trace(spec: str, trace_dir: Path | None = None) -> Path:
    """The file a trace argument names: an existing path, or a name of `TRACE_FILES` looked up in
    `trace_dir` (default `$KVTOOL_TRACE_DIR`, else `SAMPLES_DIR`) and its `SUBDIRS`.

    Raises:
        TraceError: neither an existing file nor a known name found there.
    """
    path = Path(spec)
    if path.is_file():
        return path
    if spec not in TRACE_FILES:
        raise TraceError(f"trace {spec!r}: no such file, and not one of the names {', '.join(TRACE_FILES)}")
    env = os.environ.get(TRACE_DIR_ENV)
    root = trace_dir if trace_dir is not None else Path(env) if env else SAMPLES_DIR
    for sub in SUBDIRS:
        candidate = root / sub / TRACE_FILES[spec]
        if candidate.is_file():
            return candidate
    raise TraceError(f"trace {spec!r}: {TRACE_FILES[spec]} not found in {root}",
                     hint="give --trace-dir (a copy of Mooncake's FAST25-release/) or a path")  # fmt: skip


__all__ = ["SAMPLES_DIR", "TRACE_BLOCK_TOKENS", "TRACE_DIR_ENV", "TRACE_FILES", "TraceError", "TraceRequest",
           "parse_request", "read_trace", "resolve_trace"]
