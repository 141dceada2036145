"""Request inputs: plain prompts, chat message lists, and JSONL request files.

Every prompt source (a file, stdin, a JSONL request file, a `kvtool warm` source) is read with a
size limit, `MAX_PROMPT_BYTES` unless the command's `--max-prompt-bytes` says otherwise: a larger
source (or an endless one such as /dev/zero) is refused after reading at most the limit plus one
byte, instead of filling memory.
"""

from __future__ import annotations

import json
import os
import stat
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from kvtool.units import format_bytes

MAX_PROMPT_BYTES = 64 << 20  # default limit of one prompt source (bytes): 64 MiB
MAX_PROMPT_BYTES_OPTION = "--max-prompt-bytes"  # the CLI option that changes it


class RequestFileError(ValueError):
    """A request file that cannot be used; the message names the file (and line)."""


class PromptSourceTooLarge(RequestFileError):
    """A prompt source holds more bytes than the limit (`MAX_PROMPT_BYTES` or the option's)."""


@dataclass
class Request:
    """One request: exactly one of `prompt` / `messages`; optional per-request `max_tokens`."""

    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    max_tokens: int | None = None


def _check_messages(value: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value
    ):
        raise RequestFileError(f"{where}: messages must be a non-empty list of {{'role': str, 'content': str}}")
    return value


def _too_large(name: str, max_bytes: int) -> PromptSourceTooLarge:
    return PromptSourceTooLarge(f"{name}: larger than {format_bytes(max_bytes)}, the limit for a prompt source "
                            f"({MAX_PROMPT_BYTES_OPTION})")


def read_bounded(stream: IO[bytes], name: str, max_bytes: int = MAX_PROMPT_BYTES) -> bytes:
    """At most `max_bytes` bytes of `stream`, read to its end.

    Raises:
        PromptSourceTooLarge: the stream holds more than `max_bytes` bytes (at most
            `max_bytes + 1` were read).
    """
    chunks, total = [], 0
    while total <= max_bytes:
        chunk = stream.read(min(1 << 20, max_bytes + 1 - total))
        if not chunk:
            break
        chunks.append(chunk)
        total += len(chunk)
    if total > max_bytes:
        raise _too_large(name, max_bytes)
    return b"".join(chunks)


def _decode(data: bytes, name: str) -> str:
    """UTF-8 text with universal newlines (as a file or stdin opened in text mode reads it)."""
    try:
        text = data.decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")
    except UnicodeDecodeError:
        raise RequestFileError(f"{name}: not UTF-8 text") from None
    if not text.strip():
        raise RequestFileError(f"{name}: empty prompt")
    return text


def read_text(path: Path, max_bytes: int = MAX_PROMPT_BYTES) -> str:
    """The whole file as UTF-8 text, at most `max_bytes` bytes (a larger regular file is refused
    from its size, without reading it; a device or pipe after `max_bytes + 1` bytes).

    Raises:
        FileNotFoundError, IsADirectoryError, PermissionError: as `open`.
        RequestFileError: larger than `max_bytes`, not UTF-8 text, or empty.
    """
    with open(path, "rb") as fh:
        info = os.fstat(fh.fileno())
        if stat.S_ISREG(info.st_mode) and info.st_size > max_bytes:
            raise _too_large(str(path), max_bytes)
        data = read_bounded(fh, str(path), max_bytes)
    return _decode(data, str(path))


def read_stdin(max_bytes: int = MAX_PROMPT_BYTES, name: str = "stdin") -> str:
    """Standard input as UTF-8 text, at most `max_bytes` bytes.

    Raises:
        RequestFileError: larger than `max_bytes`, not UTF-8 text, or empty.
    """
    stream = getattr(sys.stdin, "buffer", None)
    if stream is None:  # a text-only stdin (replaced in-process)
        text = sys.stdin.read(max_bytes + 1)
        if len(text) > max_bytes:
            raise _too_large(name, max_bytes)
        return _decode(text.encode("utf-8"), name)
    return _decode(read_bounded(stream, name, max_bytes), name)


def _json_loads(text: str, where: str, position: bool = True) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise RequestFileError(f"{where}: invalid JSON: {exc if position else exc.msg}") from None
    except RecursionError:
        raise RequestFileError(f"{where}: invalid JSON: nested too deeply") from None
    except ValueError as exc:  # e.g. an integer of more than 4300 digits
        raise RequestFileError(f"{where}: invalid JSON: {exc}") from None


def load_messages(path: Path, max_bytes: int = MAX_PROMPT_BYTES) -> list[dict[str, Any]]:
    """A chat JSON file: a list of `{"role", "content"}` (or `{"messages": [...]}`), at most
    `max_bytes` bytes.

    Raises:
        RequestFileError: too large, not UTF-8, invalid JSON, or not a message list.
    """
    doc = _json_loads(read_text(path, max_bytes), str(path))
    if isinstance(doc, dict) and "messages" in doc:
        doc = doc["messages"]
    return _check_messages(doc, str(path))


def parse_request(obj: Any, where: str) -> Request:
    """One JSONL object: `{"prompt": str}` or `{"messages": [...]}`, optional `max_tokens`."""
    if not isinstance(obj, dict):
        raise RequestFileError(f"{where}: expected a JSON object")
    has_prompt, has_messages = "prompt" in obj, "messages" in obj
    if has_prompt == has_messages:
        raise RequestFileError(f"{where}: give exactly one of 'prompt' or 'messages'")
    max_tokens = obj.get("max_tokens")
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1):
        raise RequestFileError(f"{where}: max_tokens must be a positive integer")
    if has_prompt:
        if not isinstance(obj["prompt"], str) or not obj["prompt"]:
            raise RequestFileError(f"{where}: prompt must be a non-empty string")
        return Request(prompt=obj["prompt"], max_tokens=max_tokens)
    return Request(messages=_check_messages(obj["messages"], where), max_tokens=max_tokens)


def load_requests_jsonl(path: Path, max_bytes: int = MAX_PROMPT_BYTES) -> list[Request]:
    """One request per non-blank line; the file at most `max_bytes` bytes.

    Raises:
        RequestFileError: too large, invalid JSON or fields (message names the line), or no request.
    """
    return parse_requests_jsonl(read_text(path, max_bytes), str(path))


def parse_requests_jsonl(text: str, name: str) -> list[Request]:
    """The requests of a JSONL text (`load_requests_jsonl`); `name` prefixes error messages."""
    requests = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        obj = _json_loads(line, f"{name}:{lineno}", position=False)
        requests.append(parse_request(obj, f"{name}:{lineno}"))
    if not requests:
        raise RequestFileError(f"{name}: no requests")
    return requests
