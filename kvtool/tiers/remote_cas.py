"""Compare-and-delete of remote values: a value key is deleted only if it still holds what its
deleter read of it (docs/design.md, "Remote tier store").

Why: between a deleter's read and its UNLINK, another deleter may remove the value and a writer
store it again; for a split value that is a new manifest naming new parts (a new nonce). An
unconditional UNLINK would remove the new manifest and orphan its parts.

The guard (`guard`) is what the deleter read:
- a manifest-like value (it starts with `MANIFEST_PREFIX` and is under `GUARD_BYTES` bytes): the
  key is deleted only if it holds exactly these bytes (a rewrite never holds the same nonce);
- anything else: b"", and the key is deleted unless it holds a manifest-like value now. A damaged
  whole value replaced meanwhile by a good whole value is deleted with it: comparing whole values
  would mean sending them back (megabytes), while a manifest, whose parts would be orphaned, is
  never taken.
The parts a manifest names may always be deleted by whoever read the manifest: their keys carry
that manifest's nonce.

One Lua script per key (EVAL): GETRANGE, compare, UNLINK at one instant, where WATCH / MULTI would
need a round trip per key and a retry. It names one key, so it runs on a cluster too. These
deletes are rare (bad, evicted or pruned values), never on a hit. A server that refuses the script
(an ACL user without `@scripting`) gets a plain UNLINK instead (`unlink_all`, logged once).
MLX-free.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from kvtool.tiers.remote_value import MANIFEST_PREFIX

logger = logging.getLogger(__name__)
Item = str | tuple[str, bytes]  # a key to UNLINK as it is, or (value key, guard)

GUARD_BYTES = 128  # a manifest is at most ~70 bytes; a value this long or longer is no manifest

# KEYS[1]: the value key; ARGV[1]: the guard. Returns what UNLINK returns (1 deleted), else 0.
SCRIPT = f"""
local head = redis.pcall('GETRANGE', KEYS[1], 0, {GUARD_BYTES - 1})
local manifest = type(head) == 'string' and #head < {GUARD_BYTES}
  and string.sub(head, 1, {len(MANIFEST_PREFIX)}) == '{MANIFEST_PREFIX.decode()}'
if (ARGV[1] == '' and manifest) or (ARGV[1] ~= '' and head ~= ARGV[1]) then
  return 0
end
return redis.call('UNLINK', KEYS[1])
"""


def guard(head: object) -> bytes:
    """The guard of a value read as `head` (the GETRANGE reply of at least its first
    `GUARD_BYTES` bytes, or the whole value; None or an exception for a key absent or of another
    type): the bytes themselves if they look like a manifest, else b"" (see the module docstring)."""
    if isinstance(head, (bytes, bytearray)) and len(head) < GUARD_BYTES and bytes(head).startswith(MANIFEST_PREFIX):
        return bytes(head)
    return b""


def queue_unlink(pipe: Any, item: Item) -> None:
    """Queue a deletion on a redis-py pipeline: `item` a key name, a plain UNLINK (a part key, a
    key of no known shape); `(value key, guard)`, the value's deletion if it still holds what was
    read (`guard`, see the module docstring). The reply is 1 if the key was deleted, else 0 (or
    the server's error, as the pipeline returns it)."""
    if isinstance(item, str):
        pipe.unlink(item)
    else:  # EVAL by name: a cluster pipeline routes it by its key (it has no `eval`, and refuses EVALSHA)
        pipe.execute_command("EVAL", SCRIPT, 1, *item)


_warned = False


def unlink_all(run: Callable[[list[Item], Callable[[Any, Item], None]], list[Any]], items: Sequence[Item]) -> list[Any]:
    """Delete `items` (each as `queue_unlink` says) with `run(items, queue_unlink)`, one pipelined
    call that returns the replies in order; a compare-and-delete the server refused (an error
    reply) is sent again as a plain UNLINK (see the module docstring).

    Returns:
        The replies in order: 1 deleted, 0 not (absent, or rewritten since it was read), or the
        server's error for that key.

    Raises:
        Whatever `run` raises (a connection-level failure).
    """
    global _warned
    results = run(list(items), queue_unlink)
    refused = [i for i, (item, r) in enumerate(zip(items, results)) if not isinstance(item, str) and isinstance(r, Exception)]
    if refused:
        if not _warned:
            _warned = True
            logger.warning("remote server refused the compare-and-delete script (%s); plain UNLINK instead",
                           str(results[refused[0]])[:200])  # fmt: skip
        for i, r in zip(refused, run([items[i][0] for i in refused], queue_unlink)):
            results[i] = r
    return results
