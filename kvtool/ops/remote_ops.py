"""Operator functions for the remote tier (`kvtool remote inspect|validate|rm|prune`). MLX-free.

Safe beside live servers and live kvtool processes:
- keys are listed with SCAN (`COUNT 1000`, per node of a cluster), never KEYS; every listing
  stops at `max_keys` (reported as `truncated`); every command has a socket timeout and a
  whole-call deadline (`Connection.run`);
- sizes come from `MEMORY USAGE` and ages from `OBJECT IDLETIME`, which leave a key's LRU clock
  alone (`validate` reads values with GET, which counts as a use on Redis 6.2);
- removal is `UNLINK` (freed in the background): a kvtool process reading a value that is being
  removed gets a miss, never wrong KV (every value is verified), and a split value loses its
  manifest first, its parts after; a value key goes only if it still holds what was read of it
  (`kvtool.tiers.remote_cas`): one stored again meanwhile is newer and stays whole.

Errors that end an operation (unreachable, wrong password, TLS, an unknown namespace) raise a
`KVToolError` (`RemoteConnectError`, `RemoteOpsError`) with one line, the URL's password masked.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Sequence
from contextlib import suppress
from dataclasses import asdict, dataclass, field
from typing import Any

from kvtool.config.remote_url import RemoteConnectError, RemoteURL, describe_error, make_client, parse_remote_url
from kvtool.errors import KVToolError
from kvtool.hashing import blake2b_chain
from kvtool.tiers import remote_cas
from kvtool.tiers import remote_value as rv
from kvtool.tiers.call_deadline import WATCHDOG, Expiry, call_deadline_s, close_connections, failure_text
from kvtool.tiers.remote_read import empty_strings

DEFAULT_OPS_TIMEOUT_S = 5.0
DEFAULT_MAX_KEYS = 10_000_000
SCAN_COUNT = 1000
BATCH_KEYS = 500  # keys per pipelined round trip (metadata commands)
GET_BATCH_BYTES = 16 << 20  # validate: bytes of values per round trip (by MEMORY USAGE)
DEFAULT_VALIDATE_MAX_BYTES = 256 << 20  # validate: largest value (joined parts) it reads (bytes)


class RemoteOpsError(KVToolError):
    """An operator command that cannot run as asked (unknown or ambiguous namespace, ...)."""


@dataclass
class Connection:
    """A checked connection (PING answered): the parsed URL (`remote.masked` for messages), the
    redis-py client (`redis.Redis` or `RedisCluster`), the socket timeout of every command (s)."""

    remote: RemoteURL
    client: Any
    timeout_s: float

    def close(self) -> None:
        with suppress(Exception):  # closing: nothing to do about a failure
            self.client.close()

    def run(self, what: str | None, fn: Any, seconds: float | None = None) -> Any:
        """`fn(expiry)` under a whole-call deadline (`seconds`, default the serving tier's
        `call_deadline_s`, renewed by a long call's progress), a failure as one
        `RemoteConnectError` line (prefixed `what:`, the call that failed)."""
        expiry = Expiry()
        try:
            with WATCHDOG.deadline(seconds or call_deadline_s(self.timeout_s),
                                   lambda: close_connections(self.client)) as expiry:  # fmt: skip
                return fn(expiry)
        except KVToolError:
            raise
        except Exception as exc:  # noqa: BLE001 - redis-py, socket and TLS errors: one line
            why = failure_text(exc, expiry, self.remote, self.timeout_s)
            raise RemoteConnectError(f"{what}: {why}" if what else why) from None


def connect(url: str, *, cluster: bool | None = None, timeout_s: float = DEFAULT_OPS_TIMEOUT_S) -> Connection:
    """Connect and PING.

    Raises:
        RemoteURLError: malformed URL.
        RemoteConnectError: unreachable, refused, timed out, wrong password, TLS failure, not a
            cluster (for a cluster URL).
    """
    remote = parse_remote_url(url, cluster=cluster)
    try:
        conn = Connection(remote, make_client(remote, timeout_s), timeout_s)
    except Exception as exc:  # noqa: BLE001 - every failure is one line
        raise RemoteConnectError(describe_error(exc, remote, timeout_s)) from None
    conn.run(None, lambda _: conn.client.ping(), 2 * timeout_s)  # connect + one read, bounded
    return conn


def scan(conn: Connection, pattern: str, max_keys: int = DEFAULT_MAX_KEYS) -> tuple[list[str], bool]:
    """Keys matching `pattern` (SCAN, every primary of a cluster): `(keys, truncated)`."""
    keys: list[str] = []

    def run(expiry: Expiry) -> bool:
        for key in conn.client.scan_iter(match=pattern, count=SCAN_COUNT):
            expiry.renew()  # a SCAN of millions of keys is one call: bounded per page, not whole
            if len(keys) >= max_keys:
                return True
            keys.append(key.decode("utf-8", "replace") if isinstance(key, bytes) else str(key))
        return False

    truncated = conn.run("SCAN", run)
    return sorted(set(keys)), truncated


def _parse_keys(keys: Sequence[str]) -> tuple[dict[str, rv.KeyInfo | None], list[str], list[str]]:
    """`(key -> rv.parse_key(key), value keys, part keys)` of `keys` (keys of no known shape in neither list)."""
    infos = {k: rv.parse_key(k) for k in keys}
    values = [k for k, i in infos.items() if i is not None and i.part is None]
    return infos, values, [k for k, i in infos.items() if i is not None and i.part is not None]


def _pipelined(conn: Connection, what: str, keys: Sequence[Any], add: Any) -> list[Any]:
    """`add(pipe, key)` for each of `keys`, in pipelined round trips of `BATCH_KEYS`: the replies
    in order (per-key errors come back as exceptions); a server failure raises (`Connection.run`)."""
    out: list[Any] = []
    for at in range(0, len(keys), BATCH_KEYS):
        pipe = conn.client.pipeline(transaction=False)
        for key in keys[at : at + BATCH_KEYS]:
            add(pipe, key)
        out += conn.run(what, lambda _, pipe=pipe: pipe.execute(raise_on_error=False))
    return out


def _memory(conn: Connection, keys: Sequence[str]) -> dict[str, int]:
    """Key -> its server memory (MEMORY USAGE, bytes; 0 for a vanished key or a per-key error)."""
    sizes = _pipelined(conn, "memory", keys, lambda pipe, key: pipe.memory_usage(key, samples=0))
    return {k: s if isinstance(s, int) else 0 for k, s in zip(keys, sizes)}


def _resolve_namespace(conn: Connection, namespace: str | None, max_keys: int) -> str | None:
    """A namespace given in full or as a unique prefix (of this format's keys)."""
    if namespace is None or rv.is_hex32(namespace):
        return namespace
    if not namespace or not all(c in "0123456789abcdef" for c in namespace) or len(namespace) > 32:
        raise RemoteOpsError(f"namespace {namespace[:40]!r}: a layout key is 32 hex characters (or a unique prefix)")
    keys, _ = scan(conn, f"{rv.KEY_PREFIX}:{rv.VALUE_FORMAT}:{namespace}*", max_keys)
    found = {info.layout_key for info in map(rv.parse_key, keys) if info is not None}
    if not found:
        raise RemoteOpsError(f"no namespace starting with {namespace!r} on {conn.remote.masked}")
    if len(found) > 1:
        raise RemoteOpsError(f"namespace prefix {namespace!r} is ambiguous: {', '.join(sorted(found)[:5])}")
    return found.pop()


# ----------------------------------------------------------------------------- inspect
@dataclass
class NamespaceUsage:
    """One namespace on the server. `bytes` is server memory (MEMORY USAGE) of its keys."""

    namespace: str
    format: str
    blocks: int = 0
    split_values: int = 0
    parts: int = 0
    bytes: int = 0
    outdated: bool = False


class _Report:
    def to_dict(self) -> dict[str, Any]:  # the `--json` document
        return asdict(self)  # type: ignore[call-overload]


@dataclass
class InspectReport(_Report):
    url: str
    cluster: bool
    servers: list[dict[str, Any]]
    namespaces: list[NamespaceUsage]
    keys_scanned: int
    other_keys: int  # kvtool:* keys of no known shape
    truncated: bool


_INFO_FIELDS = ("redis_version", "valkey_version", "used_memory", "maxmemory", "maxmemory_policy", "evicted_keys",
                "expired_keys", "keyspace_hits", "keyspace_misses")  # fmt: skip


def server_info(conn: Connection) -> list[dict[str, Any]]:
    """Per server (each primary of a cluster): version, memory and eviction figures from INFO."""
    def run(_: Expiry) -> list[dict[str, Any]]:
        if conn.remote.cluster:
            from redis.cluster import RedisCluster

            items = sorted(conn.client.info(target_nodes=RedisCluster.PRIMARIES).items())
        else:
            items = [(conn.remote.endpoint, conn.client.info())]
        return [{"node": node, **{k: info[k] for k in _INFO_FIELDS if k in info}} for node, info in items]

    return conn.run("INFO", run)


def inspect(conn: Connection, namespace: str | None = None, max_keys: int = DEFAULT_MAX_KEYS) -> InspectReport:
    """What kvtool holds on the server: per namespace blocks, split values, parts and memory;
    the server's memory and eviction figures. Read-only.

    Raises:
        RemoteConnectError, RemoteOpsError: see the module docstring.
    """
    namespace = _resolve_namespace(conn, namespace, max_keys)
    keys, truncated = scan(conn, f"{rv.KEY_PREFIX}:*:{namespace}:*" if namespace else f"{rv.KEY_PREFIX}:*", max_keys)
    infos = [rv.parse_key(k) for k in keys]
    sizes = _memory(conn, keys)
    usage: dict[tuple[str, str], NamespaceUsage] = {}
    other = 0
    for key, info in zip(keys, infos):
        if info is None:
            other += 1
            continue
        ns = usage.setdefault((info.layout_key, info.format),
                              NamespaceUsage(info.layout_key, info.format, outdated=info.format != rv.VALUE_FORMAT))
        if info.part is None:
            ns.blocks += 1
        else:
            ns.parts += 1
        ns.bytes += sizes[key]
    present = {k for k, i in zip(keys, infos) if i is not None and i.part is None}
    split = {(i.layout_key, i.format, i.main_key) for i in infos if i is not None and i.part is not None and i.main_key in present}
    for layout, fmt, _ in split:  # values with parts, from key names alone (no read)
        usage[(layout, fmt)].split_values += 1
    namespaces = sorted(usage.values(), key=lambda n: (-n.bytes, n.namespace))
    return InspectReport(conn.remote.masked, conn.remote.cluster, server_info(conn), namespaces, len(keys), other, truncated)


def _heads(conn: Connection, keys: Sequence[str], n: int = 127) -> list[Any]:
    """The first `n + 1` bytes of each value (b"" for a vanished key; errors as exceptions)."""
    return _pipelined(conn, "GETRANGE", keys, lambda pipe, key: pipe.getrange(key, 0, n))


# ----------------------------------------------------------------------------- validate
@dataclass
class Problem:
    key: str
    kind: str
    message: str


@dataclass
class ValidateReport(_Report):
    url: str
    namespace: str | None
    dry_run: bool
    checked: int = 0
    ok: int = 0
    bytes_checked: int = 0
    vanished: int = 0  # removed, evicted or expired while validate ran: not a problem
    incomplete: int = 0  # split values missing a part (evicted, expired, removed): deleted, not a problem
    problems: list[Problem] = field(default_factory=list)
    orphan_parts: int = 0
    removed_keys: int = 0
    truncated: bool = False


def validate(conn: Connection, namespace: str | None = None, *, dry_run: bool = False,
             max_value_bytes: int = DEFAULT_VALIDATE_MAX_BYTES, max_keys: int = DEFAULT_MAX_KEYS) -> ValidateReport:  # fmt: skip
    """Read and verify every value of this format (of one namespace, or all): header, namespace
    against the key, slot hash against the key, record checksum, codec, and the chain hash of
    the record's parent and token ids. Failing values and orphan parts (no manifest names them)
    are deleted unless `dry_run`.

    Raises:
        RemoteConnectError, RemoteOpsError: see the module docstring.
    """
    namespace = _resolve_namespace(conn, namespace, max_keys)
    keys, truncated = scan(conn, rv.namespace_pattern(namespace), max_keys)
    report = ValidateReport(conn.remote.masked, namespace, dry_run, truncated=truncated)
    infos, values, parts = _parse_keys(keys)
    sizes = _memory(conn, values)
    doomed: list[remote_cas.Item] = []
    named_parts: set[str] = set()
    start = size = 0
    for i, key in enumerate(values):  # batches of GET_BATCH_BYTES or BATCH_KEYS, whichever comes first
        size += sizes[key]
        if i == len(values) - 1 or size >= GET_BATCH_BYTES or i + 1 - start >= BATCH_KEYS:
            _validate_batch(conn, values[start : i + 1], infos, max_value_bytes, report, doomed, named_parts)
            start, size = i + 1, 0
    orphans = _confirm_orphans(conn, [p for p in parts if p not in named_parts])
    report.orphan_parts = len(orphans)
    if not dry_run:
        report.removed_keys = unlink(conn, [*doomed, *orphans])
    return report


def _validate_batch(conn: Connection, batch: list[str], infos: dict[str, rv.KeyInfo | None], max_value_bytes: int,
                    report: ValidateReport, doomed: list[remote_cas.Item], named_parts: set[str]) -> None:  # fmt: skip
    heads = _heads(conn, batch, max_value_bytes)
    empty = [k for k, data in zip(batch, heads) if isinstance(data, bytes) and not data]
    present = set(conn.run("EXISTS", lambda _: empty_strings(conn.client, empty))) if empty else set()
    for key, data in zip(batch, heads):
        info = infos[key]
        assert info is not None
        if isinstance(data, bytes) and not data and key not in present:
            report.vanished += 1
            continue
        report.checked += 1
        guard = remote_cas.guard(data)  # removed only if it still holds this
        manifest: rv.Manifest | None = None  # (before any raise: the handler reads it)
        try:
            if not isinstance(data, bytes):
                raise rv.RemoteValueError("header", f"not a string value: {str(data)[:100]}")
            if not data:  # an empty string (a vanished key was counted above)
                raise rv.RemoteValueError("truncated", "an empty value")
            report.bytes_checked += len(data)
            if rv.is_manifest(data):
                manifest = rv.parse_manifest(data, max_value_bytes)
                part_keys = manifest.part_keys(key)
                named_parts.update(part_keys)
                parts = [r if isinstance(r, bytes) and r else None for r in _heads(conn, part_keys, manifest.part_bytes)]
                if any(p is None for p in parts):
                    report.incomplete += 1
                    doomed.extend([(key, guard), *part_keys])
                    continue
                data = rv.join_parts(manifest, parts)
            block = rv.decode_value(data, info.layout_key, None, None, info.chain_hash, None, max_bytes=max_value_bytes)
            if blake2b_chain(bytes.fromhex(block.parent_hash), block.token_ids) != block.block_hash:
                raise rv.RemoteValueError("tokens", "the chain hash of its parent and token ids is not its key's")
            report.ok += 1
        except rv.RemoteValueError as exc:
            report.problems.append(Problem(key, exc.kind, str(exc).partition(": ")[2][:300]))
            doomed.append((key, guard))
            if manifest is not None:
                doomed.extend(manifest.part_keys(key))
        except ValueError as exc:  # bytes.fromhex of a parent that is not hex
            report.problems.append(Problem(key, "header", str(exc)[:300]))
            doomed.append((key, guard))


def unlink(conn: Connection, keys: Sequence[remote_cas.Item]) -> int:
    """UNLINK `keys` (value keys before their parts; a `(value key, guard)` only if it still holds
    what was read: `remote_cas`) in pipelined batches: how many went. Raises `RemoteConnectError`."""
    return sum(r for r in remote_cas.unlink_all(functools.partial(_pipelined, conn, "UNLINK"), keys) if isinstance(r, int))


# ----------------------------------------------------------------------------- rm
@dataclass
class RemovalReport(_Report):
    """What `rm` / `prune` removed (or would, with `dry_run`)."""

    url: str
    namespace: str | None
    dry_run: bool
    values: int = 0  # value keys (blocks) selected
    keys: int = 0  # keys selected: values, their parts, orphan parts, outdated keys
    bytes: int = 0  # their server memory (MEMORY USAGE)
    removed_keys: int = 0
    kept_values: int = 0
    truncated: bool = False
    notes: list[str] = field(default_factory=list)
    per_namespace: dict[str, dict[str, int]] = field(default_factory=dict)


def rm(conn: Connection, namespace: str, hashes: Sequence[str] = (), *, dry_run: bool = False,
       max_keys: int = DEFAULT_MAX_KEYS) -> RemovalReport:  # fmt: skip
    """Remove a namespace (every key of it, any format), or the given chain hashes of it (with
    their parts).

    Raises:
        RemoteOpsError: no namespace given, a namespace prefix that matches none or several, a
            hash that is not 32 hex characters. RemoteConnectError: see the module docstring.
    """
    ns = _resolve_namespace(conn, namespace, max_keys)
    if ns is None:
        raise RemoteOpsError("give a namespace")
    report = RemovalReport(conn.remote.masked, ns, dry_run)
    if hashes:
        bad = [h for h in hashes if not rv.is_hex32(h)]
        if bad:
            raise RemoteOpsError(f"not a chain hash (32 hex characters): {bad[0][:40]!r}")
        values = [rv.value_key(ns, h) for h in dict.fromkeys(hashes)]
        keys: list[remote_cas.Item] = []
        for key, head in zip(values, _heads(conn, values)):
            if isinstance(head, bytes) and head:
                keys += [(key, remote_cas.guard(head)), *rv.manifest_part_keys(key, head)]
                report.values += 1
    else:
        names, report.truncated = scan(conn, f"{rv.KEY_PREFIX}:*:{ns}:*", max_keys)
        names.sort(key=lambda k: (rv.parse_key(k) or rv.KeyInfo("", "", "")).part is not None)  # values first
        values = [k for k in names if (i := rv.parse_key(k)) is not None and i.part is None]
        guards = {k: remote_cas.guard(head) for k, head in zip(values, _heads(conn, values))}
        keys = [(k, guards[k]) if k in guards else k for k in names]
        report.values = len(values)
    report.keys = len(keys)
    report.bytes = sum(_memory(conn, [k if isinstance(k, str) else k[0] for k in keys]).values())
    if not dry_run:
        report.removed_keys = unlink(conn, keys)
    return report


# ----------------------------------------------------------------------------- prune
@dataclass
class _Entry:
    layout: str
    idle: float
    bytes: int
    keys: list[str]  # the value key, then the parts its manifest names
    value: remote_cas.Item  # how the value key is removed: (key, the manifest read or b"": `remote_cas.guard`)


def prune(conn: Connection, *, idle_s: float | None = None, max_bytes: int | None = None, namespace: str | None = None,
          dry_run: bool = False, max_keys: int = DEFAULT_MAX_KEYS) -> RemovalReport:  # fmt: skip
    """Remove values unused for `idle_s` seconds (OBJECT IDLETIME), then the least recently used
    values of each namespace until it holds at most `max_bytes` (server memory, MEMORY USAGE; a
    value counts with its parts); outdated-format keys unused for `idle_s`; orphan parts always.

    Under an LFU `maxmemory-policy` the server tracks no idle time: the budget then removes the
    least frequently used first (OBJECT FREQ), and the idle rule is refused.

    Raises:
        RemoteOpsError: neither rule given, or `idle_s` under an LFU policy.
        RemoteConnectError: see the module docstring.
    """
    if idle_s is None and max_bytes is None:
        raise RemoteOpsError("give --idle, --max-bytes or both")
    ns = _resolve_namespace(conn, namespace, max_keys)
    keys, truncated = scan(conn, f"{rv.KEY_PREFIX}:*:{ns}:*" if ns else f"{rv.KEY_PREFIX}:*", max_keys)
    report = RemovalReport(conn.remote.masked, ns, dry_run, truncated=truncated)
    infos, values, parts = _parse_keys(keys)
    ages = _pipelined(conn, "idle", values, lambda pipe, key: pipe.object("idletime", key))  # seconds; errors as exceptions
    lfu = any(isinstance(a, Exception) and "lfu" in str(a).lower() for a in ages)
    if lfu:
        if idle_s is not None:
            raise RemoteOpsError("the server's maxmemory-policy is LFU: it tracks no idle time; use --max-bytes alone")
        freq = _pipelined(conn, "freq", values, lambda pipe, key: pipe.object("freq", key))
        ages = [-(f if isinstance(f, int) else 0) for f in freq]  # least used = "oldest"
        report.notes.append("LFU policy: the budget removes the least frequently used values first")
    sizes = _memory(conn, keys)
    entries = _entries(conn, values, ages, infos, sizes)
    named = {k for e in entries for k in e.keys[1:]}
    doomed = _choose(entries, None if lfu else idle_s, max_bytes)
    orphans = _confirm_orphans(conn, [p for p in parts if p not in named])
    for e in doomed:
        stat = report.per_namespace.setdefault(e.layout, {"values": 0, "bytes": 0})
        stat["values"] += 1
        stat["bytes"] += e.bytes
    victims: list[remote_cas.Item] = [*(k for e in doomed for k in (e.value, *e.keys[1:])), *orphans]
    report.values = len(doomed)
    report.keys = len(victims)
    report.bytes = sum(e.bytes for e in doomed) + sum(sizes.get(k, 0) for k in orphans)
    report.kept_values = len(entries) - len(doomed)
    if orphans:
        report.notes.append(f"{len(orphans)} orphan part(s) (no manifest names them)")
    if not dry_run:
        report.removed_keys = unlink(conn, victims)
    return report


def _entries(conn: Connection, values: Sequence[str], ages: Sequence[Any], infos: dict[str, rv.KeyInfo | None],
             sizes: dict[str, int]) -> list[_Entry]:  # fmt: skip
    """One `_Entry` per value key (its parts with it; `ages` in seconds, or minus the use frequency)."""
    with_parts = {i.main_key for i in infos.values() if i is not None and i.part is not None}
    listed = [k for k in values if k in with_parts]  # read; the others count as whole (guard b"")
    heads = dict(zip(listed, _heads(conn, listed)))
    entries: list[_Entry] = []
    for key, age in zip(values, ages):
        own = [key, *rv.manifest_part_keys(key, heads.get(key))]
        info = infos[key]
        assert info is not None
        nbytes = sum(sizes.get(k, 0) for k in own)
        entries.append(_Entry(info.layout_key, float(age) if isinstance(age, (int, float)) else 0.0, nbytes, own,
                              (key, remote_cas.guard(heads.get(key)))))  # fmt: skip
    return entries


def _choose(entries: list[_Entry], idle_s: float | None, max_bytes: int | None) -> list[_Entry]:
    """The entries to remove: idle for `idle_s` seconds or more, then per namespace the least recently
    used until it holds at most `max_bytes`."""
    doomed: list[_Entry] = []
    keep: dict[str, list[_Entry]] = defaultdict(list)
    for e in entries:
        if idle_s is not None and e.idle >= idle_s:
            doomed.append(e)
        else:
            keep[e.layout].append(e)
    if max_bytes is not None:
        for kept in keep.values():
            total = sum(e.bytes for e in kept)
            for e in sorted(kept, key=lambda e: -e.idle):
                if total <= max_bytes:
                    break
                doomed.append(e)
                total -= e.bytes
    return doomed


def _confirm_orphans(conn: Connection, candidates: Sequence[str]) -> list[str]:
    """The part keys of `candidates` that no manifest names, read again now (SCAN is no
    snapshot: a split value written during the listing may show its parts and not its
    manifest; it must not lose them)."""
    by_main: dict[str, list[str]] = defaultdict(list)
    for key in candidates:
        info = rv.parse_key(key)
        if info is not None:
            by_main[info.main_key].append(key)
    named = {k for main, head in zip(by_main, _heads(conn, list(by_main))) for k in rv.manifest_part_keys(main, head)}
    return [k for keys in by_main.values() for k in keys if k not in named]
