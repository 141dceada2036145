"""`kvtool validate`'s second half: carry out a repair plan (`execute`) that
`kvtool.ops.validate.plan_repairs` made, namespace by namespace, each change a transaction and
every file removed confined (`kvtool.disk.confined`). The order and the re-checks that make it safe
beside live writers are in `kvtool.ops.validate`'s docstring.

This module never imports MLX.
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

from kvtool.disk.chains import build_forest, key_of_hex
from kvtool.disk.confined import ConfinedDir
from kvtool.disk.index import BlockIndex
from kvtool.disk.names import INDEX_FILENAME
from kvtool.disk.rowtable import load_rows
from kvtool.hashing import root_parent
from kvtool.ops.rebuild import execute_rebuild
from kvtool.ops.repairs import REPAIRS, NamespaceRepair, RepairPlan, unlink_counted


def execute(plan: RepairPlan) -> RepairPlan:
    """Carry out a repair plan (see the module docstring for the order). Never raises for I/O
    trouble: a namespace whose index cannot be written gets outcome 'failed' and a message."""
    root = Path(plan.cache_dir)
    for rep in plan.namespaces:
        if rep.outcome == "skipped" or not rep.actions.any():
            continue
        try:
            with ConfinedDir(root, rep.namespace) as cdir:
                if rep.actions.rebuild is not None:
                    execute_rebuild(root, cdir, rep.actions.rebuild, rep)
                else:
                    _execute_namespace(root / rep.namespace, cdir, rep)
        except (sqlite3.Error, OSError, ValueError) as exc:
            rep.outcome, rep.message = "failed", f"repair stopped: {exc}; nothing after that point was changed"
            continue
        repaired = any(getattr(rep, k) for k in REPAIRS) or rep.index_rebuilt or rep.duplicates_removed
        rep.outcome = "repaired" if repaired else ("problems" if rep.problems else "clean")
    plan.dry_run, plan.executed = False, True
    return plan


def _execute_namespace(ns_dir: Path, cdir: ConfinedDir, rep: NamespaceRepair) -> None:
    act = rep.actions
    for rel in act.temps:
        unlink_counted(rep, lambda: cdir.unlink_temp(rel), rel)  # noqa: B023  (called at once, inside the loop)
    index = BlockIndex(ns_dir / INDEX_FILENAME, create=False)
    try:
        if act.bad_rowids or act.bad_segment_rowids:
            index.delete_rowids(act.bad_rowids, act.bad_segment_rowids)
        if act.clamp:
            now = time.time()
            for h in act.clamp:
                index.touch(h, now)  # a touch lowers an access time beyond the skew allowance to `now`
            index.flush()
        for seg_row, rewrite, adopt in act.writes.values():
            if adopt:  # a live writer may have stored them meanwhile: never replace its rows
                present = index.present([r.hash for r in adopt])
                adopt = [r for r in adopt if r.hash not in present]
                if not adopt and not rewrite:
                    continue
            index.insert_segment(seg_row, rewrite + adopt)
        emptied = index.delete(act.drop)[1] if act.drop else []
        for rel in act.irregular:  # their rows are gone (dropped above, or rewritten to a copy)
            unlink_counted(rep, lambda: cdir.unlink_irregular(rel), rel)  # noqa: B023  (called at once, inside the loop)
        if act.broken:  # re-check on a fresh read: a live writer may have stored a missing parent
            act.broken = _still_unrooted(index, rep.namespace, act.broken)
            emptied += index.delete(act.broken)[1] if act.broken else []
        for name in emptied:
            unlink_counted(rep, lambda: cdir.unlink_segment(name), name)  # noqa: B023  (called at once, inside the loop)
        for name in act.remove_segments:
            if index.segment_rows(name):  # rows appeared meanwhile (a live writer): keep it
                continue
            index.delete_segments([name])
            unlink_counted(rep, lambda: cdir.unlink_segment(name), name)  # noqa: B023  (called at once, inside the loop)
        forget = list(act.forget_removals)
        for name in act.finish_removals:  # an interrupted removal, finished: its rows are long gone
            if index.segment_rows(name):
                forget.append(name)  # rows name it again: it is kept, the entry is stale
                continue
            failed = rep.unlink_failed
            unlink_counted(rep, lambda: cdir.unlink_segment(name), name)  # noqa: B023  (called at once, inside the loop)
            if rep.unlink_failed == failed:
                forget.append(name)
        if forget:
            index.forget_removals(forget)
    finally:
        index.close()


def _still_unrooted(index: BlockIndex, namespace: str, hashes: list[str]) -> list[str]:
    """Those of `hashes` whose rows a prefix lookup still cannot reach, on a fresh read."""
    with index.connection() as conn:
        t = load_rows(conn)
    root = key_of_hex(root_parent(namespace))
    forest = build_forest(t.parent_rows(), (t.parent == root).all(axis=1), None)
    rows = t.find(hashes)
    return [h for h, r in zip(hashes, rows.tolist()) if r >= 0 and not forest.rooted[r]]


__all__ = ["execute"]
