"""A probe's verdict stored with its namespace: JSON under a key of the SSD index meta
(`StoredVerdict`: written with sorted keys, read back checked), and the meta read and write that
never fail a request (`read_meta_record`, `write_meta_record`). The self-check
(`kvtool.cache.selfcheck.Verdict`) and the reply probe (`kvtool.cache.reply.ReplyVerdict`) keep
theirs this way. MLX-free.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any, Self, get_type_hints

log = logging.getLogger("kvtool")


@dataclass
class StoredVerdict:
    """Base of a dataclass verdict kept as JSON: `to_json`, `from_json`. Its fields without a
    default are stored as they are, each of its annotated type (the verdict a bool, `reason` a
    string or None, ...); those with a default are numbers of their default's type; the default
    of its `version` field (the subclass's) is the current version.

    Attributes (every verdict's; keyword-only, after the subclass's own):
        reason: the first difference found, or why it was not measured (None: the verdict is yes).
        code: `kvtool.cache.selfcheck.code_digest` of the code measured.
        ms: wall time of the probe (milliseconds).
        checked: when it ran (Unix time, seconds).
    """

    reason: str | None = field(kw_only=True)
    code: str = field(kw_only=True)
    ms: float = field(default=0.0, kw_only=True)
    checked: float = field(default=0.0, kw_only=True)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | None) -> Self | None:
        """Parse a stored verdict; None for anything missing or malformed (a field without a
        default missing or not of its type, a number that does not convert) or of another
        `version` (then the probe runs again). A missing number is read as 0."""
        try:
            doc = json.loads(text or "")
            types = get_type_hints(cls)
            kept: dict[str, Any] = {}
            for f in fields(cls):
                if f.default is MISSING and not isinstance(doc[f.name], types[f.name]):
                    return None
                kept[f.name] = doc[f.name] if f.default is MISSING else type(f.default)(doc.get(f.name, 0))
        except (ValueError, TypeError, KeyError, AttributeError):
            return None
        current = next(f.default for f in fields(cls) if f.name == "version")
        return cls(**kept) if kept["version"] == current else None


def read_meta_record(ssd, key: str, parse: Callable[[str | None], Any], what: str) -> Any:
    """`parse` of the JSON text stored under `key` in an SSD namespace's index meta; None without
    an SSD tier or where the meta cannot be read or parsed (the caller measures again). `what`
    names the record in the debug line."""
    index = getattr(ssd, "index", None) if ssd is not None else None
    if index is None:
        return None
    try:
        return parse(index.get_meta().get(key))
    except Exception:  # noqa: BLE001 - an unreadable meta: measure again
        log.debug("%s: stored verdict unreadable", what, exc_info=True)
        return None


def write_meta_record(ssd, key: str, text: str, what: str) -> None:
    """Store `text` under `key` in an SSD namespace's index meta; nothing without an SSD tier or
    read-only; a failure is one warning (the next process measures again)."""
    index = getattr(ssd, "index", None) if ssd is not None else None
    if index is None or getattr(ssd, "read_only", False):
        return
    try:
        index.set_meta({key: text})
    except Exception:  # noqa: BLE001 - not stored: the next process measures again
        log.warning("kvtool: the %s verdict could not be stored", what, exc_info=True)


__all__ = ["StoredVerdict", "read_meta_record", "write_meta_record"]
