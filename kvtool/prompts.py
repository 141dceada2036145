"""Request inputs: plain prompts, chat message lists, and JSONL request files."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class RequestFileError(ValueError):
    """A request file that cannot be used; the message names the file (and line)."""


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


def read_text(path: Path) -> str:
    """The whole file as UTF-8 text.

    Raises:
        FileNotFoundError, IsADirectoryError, PermissionError: as `open`.
        RequestFileError: not UTF-8 text, or empty.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise RequestFileError(f"{path}: not UTF-8 text") from None
    if not text.strip():
        raise RequestFileError(f"{path}: empty prompt")
    return text


def load_messages(path: Path) -> list[dict[str, Any]]:
    """A chat JSON file: a list of `{"role", "content"}` (or `{"messages": [...]}`)."""
    try:
        doc = json.loads(read_text(path))
    except json.JSONDecodeError as exc:
        raise RequestFileError(f"{path}: invalid JSON: {exc}") from None
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
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
        raise RequestFileError(f"{where}: max_tokens must be a positive integer")
    if has_prompt:
        if not isinstance(obj["prompt"], str) or not obj["prompt"]:
            raise RequestFileError(f"{where}: prompt must be a non-empty string")
        return Request(prompt=obj["prompt"], max_tokens=max_tokens)
    return Request(messages=_check_messages(obj["messages"], where), max_tokens=max_tokens)


def load_requests_jsonl(path: Path) -> list[Request]:
    """One request per non-blank line.

    Raises:
        RequestFileError: invalid JSON or fields (message names the line), or no request.
    """
    requests = []
    for lineno, line in enumerate(read_text(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise RequestFileError(f"{path}:{lineno}: invalid JSON: {exc.msg}") from None
        requests.append(parse_request(obj, f"{path}:{lineno}"))
    if not requests:
        raise RequestFileError(f"{path}: no requests")
    return requests
