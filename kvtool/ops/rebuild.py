"""`kvtool validate --rebuild-index`: rebuild a namespace's unreadable index from its segment files.

Every segment file carries, in its checksummed header, the namespace it belongs to, its KV
layout and per record the block hash, parent hash and length; each record has its own checksum.
So an index can be rebuilt from the files alone: every record that verifies becomes a row again
(`blocks_recovered`), the chains are re-linked, and files with nothing reachable are removed.

The meta (model id, block size...) is salvaged from the old index when it can still be read
and hashes to the namespace's name; otherwise the rebuilt index holds only what the files say
(layout key, KV layout) and no `format_version`: the next kvtool process that opens the
namespace with its model completes the meta (its layout key proves it is the right model), and
until then the namespace reads as `uninitialized`.

A file under a segment's name whose header does not verify is removed only when the salvaged meta
proves the directory a kvtool namespace; otherwise (the index is not a database, or has no kvtool
meta) it may be another program's file: it is left (`ignored_entries`, with a detail line), and a directory with
neither kvtool meta nor one verified segment file of its namespace is not rebuilt at all.

The new index is built under a temporary name and renamed into place only when complete; the old
one is kept as `index.sqlite.corrupt` (with its `-wal`), for inspection. Run it while no kvtool
process uses the namespace (one could not use the unreadable index anyway).
"""

from __future__ import annotations

import errno
import os
import sqlite3
import stat
import time
from collections import Counter
from pathlib import Path

from kvtool.disk.chains import build_chain_tree
from kvtool.disk.confined import ConfinedDir
from kvtool.disk.index import BlockIndex, index_uri
from kvtool.disk.kvlayout import KVLayout
from kvtool.disk.names import INDEX_FILENAME, SIDE_SUFFIXES, is_segment_name
from kvtool.disk.namespace_core import Expected
from kvtool.disk.rowtable import IndexRow, SegmentRow
from kvtool.disk.segment import FORMAT_VERSION, SegmentHeader
from kvtool.hashing import root_parent
from kvtool.ops.records import Record, SegmentPass, created_of
from kvtool.ops.repairs import NamespaceRepair, RebuildPlan, unlink_counted
from kvtool.ops.scan import CacheScan, NamespaceScan, meta_problem

BUILDING = INDEX_FILENAME + ".rebuilding"
CORRUPT = INDEX_FILENAME + ".corrupt"


def salvage_meta(db: Path) -> dict[str, str]:
    """The meta table of a damaged index, if it can still be read (read-only, no WAL), else {}."""
    rows = _salvage(db, "SELECT key, value FROM meta")
    return {str(k): str(v) for k, v in rows if k is not None and v is not None}


def salvage_removals(db: Path) -> set[str]:
    """The removal journal of a damaged index (`BlockIndex.removals`: segment files an interrupted
    prune or rm took the rows of), if it can still be read (read-only, no WAL), else empty."""
    return {n for (n,) in _salvage(db, "SELECT name FROM removals") if is_segment_name(n)}


def _salvage(db: Path, query: str) -> list[tuple]:
    """The rows of `query` on the damaged index `db` (a regular file, opened read-only with
    `immutable=1`: its -wal and -shm are neither read nor made); [] if it cannot be read."""
    try:
        if not stat.S_ISREG(os.lstat(db).st_mode):
            return []
        conn = sqlite3.connect(index_uri(db, immutable=True), uri=True)
    except (OSError, sqlite3.Error):
        return []
    try:
        return conn.execute(query).fetchall()
    except sqlite3.Error:
        return []
    finally:
        conn.close()


def plan_rebuild(scan: CacheScan, ns: NamespaceScan, rep: NamespaceRepair) -> RebuildPlan:
    """Verify every segment file of `ns` (headers and records) and plan its new index. A segment
    file the old index's removal journal still names (if that can be read) is removed, never
    recovered (`removals_finished`)."""
    salvaged = salvage_meta(ns.path / INDEX_FILENAME)
    journal = salvage_removals(ns.path / INDEX_FILENAME) & set(ns.files)
    complete = salvaged.get("format_version") == str(FORMAT_VERSION) and meta_problem(ns.name, salvaged) is None
    exp = Expected.from_meta(ns.name, salvaged) if complete else None
    recovered: dict[str, IndexRow] = {}
    segment_rows: dict[str, SegmentRow] = {}
    remove: list[str] = []
    with ConfinedDir(scan.cache_dir, ns.name) as cdir, SegmentPass(
        cdir, ns.name, exp.kv if exp else None, exp.block_size if exp else None
    ) as reader:
        for name in sorted(journal):
            remove.append(name)
            rep.removals_finished += 1
            rep.note("removal", name, "its blocks were removed (prune or rm interrupted before the unlink): removal finished")
        checks = {n: reader.open(n) for n in sorted(set(ns.files) - journal)}  # every header, verified
        headers = {n: c.header for n, c in checks.items() if c.header is not None}
        kv = exp.kv if exp else (Counter(h.kv for h in headers.values()).most_common(1)[0][0] if headers else None)
        if not complete and not headers and not journal:
            raise OSError(errno.EINVAL, "neither kvtool meta in its index nor a segment file of this namespace: "
                          "not a kvtool namespace? left untouched")  # fmt: skip
        for name in sorted(set(ns.files) - set(headers) - journal):
            if complete:  # a kvtool namespace (its meta says so): an unusable file under a segment's name goes
                remove.append(name)
                rep.note("unusable", name, checks[name].error or "")
            else:  # no meta to prove the directory kvtool's: a file that is no segment of it is never removed
                rep.ignored_entries += 1
                rep.note("left", name, f"not a segment file of this namespace ({checks[name].error or 'unusable'}): left alone")
        _recover(reader, headers, kv, scan.now, rep, remove, segment_rows, recovered)
    tree = build_chain_tree(((r.hash, r.parent, r.last_access) for r in recovered.values()), root_parent(ns.name), scan.now)
    by_segment: dict[str, list[IndexRow]] = {}
    for h, r in recovered.items():
        if tree.nodes[h].rooted:
            by_segment.setdefault(r.segment, []).append(r)
    plan = RebuildPlan(dict(salvaged) if complete else _partial_meta(ns.name, kv), complete)
    plan.segments = [(segment_rows[n], sorted(rows, key=lambda r: r.slot)) for n, rows in sorted(by_segment.items())]
    plan.remove = sorted(set(remove) | (set(segment_rows) - set(by_segment)))
    rep.index_rebuilt = True
    rep.blocks_recovered = sum(len(rows) for rows in by_segment.values())
    rep.orphans_removed = len(plan.remove) - len(journal)
    rep.bytes_freed = sum(ns.files[n].size for n in plan.remove)
    for n in sorted(set(segment_rows) - set(by_segment)):
        rep.note("orphan", n, "no reachable block")
    return plan


def _recover(reader: SegmentPass, headers: dict[str, SegmentHeader], kv: KVLayout | None, now: float,
             rep: NamespaceRepair, remove: list[str], segment_rows: dict[str, SegmentRow],
             recovered: dict[str, IndexRow]) -> None:  # fmt: skip
    """Every verified record of the segments `headers` (newest segment first: its copy of a block
    wins) into `recovered` (hash -> row), their `segments` rows into `segment_rows`; a segment
    of another KV layout than `kv`, or changed since its header was read, into `remove`."""
    for name, header in sorted(headers.items(), key=lambda kv_: (-created_of(kv_[1]), kv_[0])):  # newest copy wins
        if header.kv != kv:
            remove.append(name)
            rep.note("unusable", name, "KV layout differs from the namespace's other segments")
            continue
        chk = reader.open(name)
        seg_row = chk.segment_row()
        if seg_row is None or chk.header != header:  # changed since its header was read
            remove.append(name)
            rep.note("unusable", name, chk.error or "changed while it was read")
            continue
        segment_rows[name] = seg_row
        t = min(created_of(header), now)
        reader.read(verify=[s.index for s in header.slots if s.block_hash not in recovered])
        for s in header.slots:
            rec = chk.records.get(s.index) if s.block_hash not in recovered else None
            if isinstance(rec, Record):
                recovered[s.block_hash] = rec.row(t, t)


def _partial_meta(name: str, kv) -> dict[str, str]:
    meta = {"layout_key": name, "rebuilt": repr(time.time())}
    if kv is not None:
        meta.update(kv_layers=kv.spec, kv_dtype=kv.dtype)
    return meta


def execute_rebuild(root: Path, cdir: ConfinedDir, plan: RebuildPlan, rep: NamespaceRepair) -> None:
    """Build the new index aside, keep the old one as `index.sqlite.corrupt`, rename the new one
    into place, then remove the files with nothing recoverable.

    Raises:
        sqlite3.Error, OSError: the new index could not be built (the old one is left in place).
    """
    ns_dir = root / cdir.namespace
    for suffix in SIDE_SUFFIXES:  # an earlier, interrupted rebuild
        _remove_regular(cdir, BUILDING + suffix)
    with BlockIndex(ns_dir / BUILDING, initial_meta=plan.meta if plan.complete_meta else None) as index:
        if not plan.complete_meta:
            index.set_meta({**plan.meta, "rebuilt": repr(time.time())})
        for seg_row, rows in plan.segments:
            index.insert_segment(seg_row, rows)
        with index.connection() as conn:  # one self-contained file (no -wal to carry along); the next open switches back to WAL
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            conn.execute("PRAGMA journal_mode=DELETE")
    for suffix in ("", "-wal"):
        _replace_regular(cdir, INDEX_FILENAME + suffix, CORRUPT + suffix)
    _remove_regular(cdir, INDEX_FILENAME + "-shm")
    _replace_regular(cdir, BUILDING, INDEX_FILENAME)
    for name in plan.remove:
        unlink_counted(rep, lambda: cdir.unlink_segment(name), name)  # noqa: B023  (called at once, inside the loop)


def _check_regular(cdir: ConfinedDir, name: str) -> bool:
    try:
        st = os.stat(name, dir_fd=cdir.fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    if not stat.S_ISREG(st.st_mode):
        raise OSError(errno.ELOOP, f"{name} is not a regular file (symlink?): never followed")
    return True


def _remove_regular(cdir: ConfinedDir, name: str) -> None:
    if _check_regular(cdir, name):
        os.unlink(name, dir_fd=cdir.fd)


def _replace_regular(cdir: ConfinedDir, src: str, dst: str) -> None:
    if _check_regular(cdir, src):
        os.replace(src, dst, src_dir_fd=cdir.fd, dst_dir_fd=cdir.fd)


__all__ = ["RebuildPlan", "plan_rebuild", "execute_rebuild", "salvage_meta", "salvage_removals"]
