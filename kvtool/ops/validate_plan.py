"""`validate`'s planner of one usable namespace (`RepairPlanner`): one pass over its segment
files (the clean ones in batches, `kvtool.ops.clean_segments`; the others the general way,
`kvtool.ops.records.SegmentPass`), then the decisions on one chain tree. The rules are
`kvtool.ops.validate`'s module docstring.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from kvtool.disk.chains import Forest, KeyIndex, build_forest, hex_of_keys, key_of_hex, keys_from_hex, rooted_nodes
from kvtool.disk.fsops import FileOps
from kvtool.disk.names import segment_relpath
from kvtool.disk.rowtable import IndexRow, RowTable, SegmentRow
from kvtool.disk.verify import slot_problem
from kvtool.hashing import root_parent
from kvtool.ops.clean_segments import CleanSegments, find_clean
from kvtool.ops.heap import release_free_heap
from kvtool.ops.records import Record, SegmentPass, created_of
from kvtool.ops.repairs import NamespaceRepair
from kvtool.ops.scan import NamespaceScan
from kvtool.ops.segment_sets import SegmentSet

ProgressFn = Callable[[str, int, int], None]  # progress(namespace, segments_done, segments_total)


class _Candidate:
    """A record that no kept row describes (in a segment of the row snapshot): adopted if a
    prefix lookup can reach it and it verifies."""

    __slots__ = ("segment", "slot", "hash", "parent", "record")

    def __init__(self, segment: str, slot: int, hash_: str, parent: str, record: Record | str):
        self.segment, self.slot, self.hash, self.parent, self.record = segment, slot, hash_, parent, record


class RepairPlanner:
    """Plans the repairs of one usable namespace: one pass over its segment files (`_visit`, in
    name order), then the decisions (`_resolve`, `_adopt_and_finish`) on one chain tree."""

    def __init__(self, now: float, ns: NamespaceScan, rep: NamespaceRepair, reader: SegmentPass, deep: bool,
                 journal: set[str] | frozenset[str] = frozenset()):  # fmt: skip
        self.now, self.ns, self.rep, self.reader, self.deep = now, ns, rep, reader, deep
        self.journal = journal  # segments of the removal journal (an interrupted prune or rm)
        self.act = rep.actions
        self.table: RowTable = ns.table if ns.table is not None else RowTable.empty()
        self.fail: dict[int, str] = {}  # row number -> why it does not match its record
        self.own: dict[int, Record] = {}  # row number -> its own record, verified (a failed row's)
        self.copies: dict[str, list[Record]] = {}  # hash -> verified records no row describes
        self.candidates: list[_Candidate] = []  # records of snapshot segments that may lack a row
        self.checked: dict[str, SegmentRow] = {}  # segment -> the row its verified header gives (general way; see `_info`)
        self.fast = CleanSegments.none(len(self.table.segments))  # the clean segments (`_clean`)
        self.count = np.zeros(len(self.table.segments), dtype=np.int64)  # rows per segment
        self.known = SegmentSet(self.table)  # segments of the row snapshot and orphans, with a file
        self.errors: dict[str, str] = {}  # segment -> why it is unusable
        self.rows = _SegmentRows(self.table)
        self.whole: np.ndarray | None = None  # `_whole_forest`: `[N]` bool, the rows a lookup can reach
        self.shown = 0  # segments reported done (`progress`)

    def run(self, progress: ProgressFn | None) -> None:
        ns, rep, act = self.ns, self.rep, self.act
        for rel in ns.irregular:
            if FileOps().is_dir(ns.path / rel):
                rep.note("irregular", rel, "a directory under a kvtool file name: left alone")
                continue
            act.irregular.append(rel)
            rep.irregular_removed += 1
            rep.note("irregular", rel, "not a regular file (FIFO, socket or device): never opened; removed")
        for t in ns.temps:
            if t.leftover:
                act.temps.append(t.relpath)
                rep.temp_removed += 1
                rep.bytes_freed += t.size
                rep.note("temp", t.relpath, "leftover of a writer that is gone")
        act.bad_rowids, act.bad_segment_rowids = list(ns.bad_rows), list(ns.bad_segment_rows)
        rep.bad_rows_dropped = len(ns.bad_rows)
        rep.segment_rows_fixed += len(ns.bad_segment_rows)
        for rowid in ns.bad_rows:
            rep.note("bad_row", f"rowid {rowid}", "NULL, wrongly typed or malformed value")
        act.clamp = list(ns.future_rows)
        rep.access_clamped = len(act.clamp)
        table = self.table
        numbers = table.segment_numbers
        finishing = self._journaled(numbers)
        unnamed = [name for name in ns.files if name not in numbers and name not in finishing]  # files no row names
        total = len(table.segments) + len(unnamed)
        self.shown = 0  # segments reported done (`progress`)
        self.fast = self._clean(progress, total)
        self.count = np.diff(table.by_segment[1])
        listed = self.fast.listed
        has_file = (listed >= 0 if listed is not None else
                    np.fromiter((name in ns.files for name in table.segments), dtype=bool, count=len(table.segments)))  # fmt: skip
        self.known = SegmentSet(table, has_file,
                                names=(name for name in ns.orphans if name in ns.files and name not in finishing))
        # the common case, a clean segment, keeps nothing per segment; the others, in name order:
        todo = sorted([table.segments[s] for s in np.flatnonzero(~self.fast.clean).tolist()] + unnamed)
        done = total - len(todo)
        for name in todo:
            s = numbers.get(name)
            self._visit(name, self.rows.of(s) if s is not None else ([],) * 7)
            done += 1
            self._progress(progress, done, total)
        self._progress(progress, total, total)
        self.reader.close()
        final, dropped = self._resolve()
        self._adopt_and_finish(final, dropped)

    def _journaled(self, numbers: dict[str, int]) -> set[str]:
        """Plan the end of interrupted removals: a segment file of the removal journal that no
        row names is removed (`removals_finished`), never adopted (the user asked for its blocks
        to go); entries without a file, or whose segment has rows again, are forgotten. Returns
        the files to remove."""
        act, rep, files = self.act, self.rep, self.ns.files
        finishing: set[str] = set()
        for name in sorted(self.journal):
            if name in numbers or name not in files:
                act.forget_removals.append(name)
                continue
            finishing.add(name)
            act.finish_removals.append(name)
            rep.removals_finished += 1
            rep.bytes_freed += files[name].size
            rep.note("removal", name, "its blocks were removed (prune or rm interrupted before the unlink): removal finished")
        return finishing

    # ------------------------------------------------------------------ the pass
    def _clean(self, progress: ProgressFn | None, total: int) -> CleanSegments:
        """Which segments with rows and a file are clean (`kvtool.ops.clean_segments`): checked
        in batches, over the CPUs for a large cache; progress is reported as it goes."""
        exp = self.ns.expected
        assert exp is not None
        report = (lambda done, _n: self._progress(progress, done, total)) if progress is not None else None
        clean = find_clean(self.reader.cdir, self.ns.name, exp.kv, exp.block_size, self.table, self.ns.files, self.deep,
                           progress=report, meanwhile=self._whole_forest)  # fmt: skip
        release_free_heap()  # its batches' memory, before the chain tree
        return clean

    def _progress(self, progress: ProgressFn | None, done: int, total: int) -> None:
        """Report `done` of `total` segments, never fewer than reported before, each count once."""
        if progress is not None and done > self.shown:
            self.shown = done
            progress(self.ns.name, done, total)

    def _visit(self, name: str, rows: tuple) -> None:
        """Check segment `name` (not clean) against its `rows` (`_SegmentRows.of`) the general
        way: one open, then its records in file order."""
        ns = self.ns
        rl, _, _, digests, slot_of, _, _ = rows
        if name not in ns.files:
            why = self._no_file(name)
            for r in rl:
                self.fail[r] = why
            return
        chk = self.reader.open(name)
        if chk.header is None:
            self.errors[name] = chk.error or "unusable"
            for r in rl:
                self.fail[r] = f"segment {name} unusable: {self.errors[name]}"
            return
        slots = chk.header.slots
        self.checked[name] = SegmentRow(name, chk.size, len(slots), created_of(chk.header))
        claimed, to_check = self._claim(name, slots, rows)
        unclaimed = [i for i in range(len(slots)) if i not in claimed]
        failed_own = [i for i, k in claimed.items() if rl[k] in self.fail]
        verify = set(range(len(slots))) if self.deep else {*unclaimed, *failed_own}
        self.reader.read(verify=verify, digest=[slot_of[k] for k in to_check if slot_of[k] not in verify])
        again = []
        for k in to_check:
            i, r = slot_of[k], rl[k]
            whole = i in verify or i in chk.records  # (a compressed record is always read whole)
            got = chk.records.get(i) if whole else chk.digests.get(i)
            if isinstance(got, str) and whole:
                self.fail[r] = f"record unusable: {got}"
                continue
            digest = got.tokens_digest if isinstance(got, Record) else got
            if digest != digests[k]:
                self.fail[r] = "tokens_digest differs from its record"
                if not whole:
                    again.append(i)
        if again:  # their own records, verified whole: they may rewrite their rows
            self.reader.read(verify=again)
        for i, k in claimed.items():
            r = rl[k]
            rec = chk.records.get(i)
            if r in self.fail and isinstance(rec, Record):
                self.own[r] = rec
        for i in unclaimed:
            rec = chk.records[i]
            if isinstance(rec, Record):
                self.copies.setdefault(rec.slot.block_hash, []).append(rec)
        if name in self.known:
            for i, sl in enumerate(slots):
                at = claimed.get(i)
                if at is None or rl[at] in self.fail:
                    self.candidates.append(_Candidate(name, i, sl.block_hash, sl.parent_hash, chk.records.get(i, "not read")))

    def _claim(self, name: str, slots: tuple, rows: tuple) -> tuple[dict[int, int], list[int]]:
        """Which slot of segment `name` each of its `rows` holds (`slot -> position in the rows`;
        a row whose slot holds another hash claims none), and the positions whose slot agrees
        with the row (`verify.slot_problem`): their records must match their token digests. The
        others fail here."""
        rl, hashes, parents, _, slot_of, n_tok, nbytes = rows
        claimed: dict[int, int] = {}
        to_check: list[int] = []
        for k, r in enumerate(rl):
            i = slot_of[k]
            if i >= len(slots):
                self.fail[r] = f"segment {name} has no slot {i}"
                continue
            sl = slots[i]
            if sl.block_hash != hashes[k]:
                self.fail[r] = f"slot {i} of {name} holds {sl.block_hash}"
                continue
            claimed[i] = k
            problem = slot_problem(sl, hashes[k], parents[k], n_tok[k], nbytes[k])
            if problem is not None:
                self.fail[r] = problem
            else:
                to_check.append(k)
        return claimed, to_check

    def _no_file(self, name: str) -> str:
        if segment_relpath(name) in self.ns.irregular:
            return f"segment {name} is not a regular file (never opened)"
        if segment_relpath(name) in self.ns.symlinks:
            return f"segment {name} is a symlink (never followed)"
        link = name[:2] in self.ns.symlinks
        return f"segment {name} " + ("is behind a symlinked directory (never followed)" if link else "has no file")

    # ------------------------------------------------------------------ decisions
    def _resolve(self) -> tuple[dict[int, IndexRow], np.ndarray]:
        """Failed rows: rewritten from a verified record of their hash (their own first, then one in
        their segment, then elsewhere), or dropped.

        Returns:
            `(row number -> rewritten row, dropped mask [N])`.
        """
        t, rep, act = self.table, self.rep, self.act
        rewritten: dict[int, IndexRow] = {}
        dropped = np.zeros(len(t), dtype=bool)
        for r in sorted(self.fail):  # row numbers follow the hashes' order
            row, why = t.row(r), self.fail[r]
            spots = [self.own[r]] if r in self.own else []
            others = self.copies.get(row.hash, [])
            spots += [c for c in others if c.segment == row.segment] + [c for c in others if c.segment != row.segment]
            if spots:
                rec = spots[0]
                new = rec.row(row.created, min(row.last_access, self.now))
                rewritten[r] = new
                act.write(self._segment_row(rec.segment), rewrite=[new])
                rep.rows_repaired += 1
                rep.note("repaired", row.hash, f"{why}; rewritten from its record in {rec.segment} slot {rec.slot.index}")
                continue
            dropped[r] = True
            act.drop.append(row.hash)
            if row.segment in self.ns.missing or self.errors.get(row.segment) == "missing":
                rep.missing_rows_dropped += 1
                rep.note("missing", row.hash, why)
            else:
                rep.corrupt_removed += 1
                rep.note("corrupt", row.hash, why)
        return rewritten, dropped

    def _info(self, name: str) -> SegmentRow | None:
        """The `segments` row segment `name`'s verified header gives (checked the general way, or
        clean: its file's size, slot count and creation time), or None: not verified."""
        info = self.checked.get(name)
        s = self.table.segment_numbers.get(name) if info is None else None
        if s is not None and self.fast.clean[s]:
            info = SegmentRow(name, int(self.fast.size[s]), int(self.count[s]), float(self.fast.created[s]))
        return info

    def _segment_row(self, name: str) -> SegmentRow:
        """The `segments` row a verified segment file should have."""
        info = self._info(name)
        assert info is not None  # only verified segments are written
        return info

    def _adopt_and_finish(self, rewritten: dict[int, IndexRow], dropped: np.ndarray) -> None:
        """One chain tree over the kept rows and the records no kept row describes: records a
        lookup can reach and that verify are adopted; kept rows it cannot reach are removed;
        orphans nothing came back from go; `segments` rows are fixed."""
        t, ns, rep, act = self.table, self.ns, self.rep, self.act
        keep = np.flatnonzero(~dropped) if dropped.any() else None  # None: every row (no copy of the table)
        spare, outside = self._spare(dropped)
        rooted, bad = self._rooted(keep, rewritten, spare)
        n = len(keep) if keep is not None else len(t)
        by_segment: dict[str, list[IndexRow]] = {}
        for j, c in enumerate(spare):
            if rooted[n + j] and isinstance(c.record, Record):
                info = self._info(c.segment)
                assert info is not None  # a candidate's segment was verified (`_visit`)
                when = min(info.created, self.now)
                by_segment.setdefault(c.segment, []).append(c.record.row(when, when))
        unrooted = np.flatnonzero(~rooted[:n])
        if keep is not None:
            unrooted = keep[unrooted]
        for r in unrooted.tolist():
            row = rewritten.get(r) or t.row(r)
            act.broken.append(row.hash)
            rep.broken_chain_removed += 1
            rep.note("broken_chain", row.hash, f"parent {row.parent} is not stored (or the chain loops)")
        plain = ~dropped
        plain[list(rewritten)] = False  # a rewritten row's segment is its record's
        referenced = SegmentSet.of_rows(t, plain).add(new.segment for new in rewritten.values())
        self._adopt_or_remove(by_segment, referenced, outside, bad)
        alive = ~dropped  # rows kept that a lookup can reach
        alive[alive] = rooted[:n]
        kept = self._kept_segments(alive, rewritten)
        self._segment_rows(kept)
        after = kept | SegmentSet(t, names=(name for name, (_, rw, ad) in act.writes.items() if rw or ad))
        rep.bytes_freed += sum(ns.files[name].size for name in (self.known - after).names())

    def _spare(self, dropped: np.ndarray) -> tuple[list[_Candidate], dict[str, int]]:
        """The candidates whose hash no kept row has, first copy of each hash (file order), and
        per segment how many of its candidates that is."""
        t = self.table
        found = t.index.find(keys_from_hex([c.hash for c in self.candidates])) if self.candidates else np.zeros(0, np.int64)
        in_final = found >= 0  # its hash has a row that is kept (an empty table: no row at all)
        if in_final.any():
            in_final[in_final] = ~dropped[found[in_final]]
        spare: list[_Candidate] = []
        seen: set[str] = set()
        outside: dict[str, int] = {}  # segment -> its records whose hash no kept row has
        for c, kept in zip(self.candidates, in_final.tolist()):
            if kept:
                continue
            outside[c.segment] = outside.get(c.segment, 0) + 1
            if c.hash not in seen:
                seen.add(c.hash)
                spare.append(c)
        return spare, outside

    def _rooted(self, keep: np.ndarray | None, rewritten: dict[int, IndexRow],
                spare: list[_Candidate]) -> tuple[np.ndarray, dict[str, int]]:  # fmt: skip
        """Which nodes a lookup can reach: `[n + len(spare)]` bool, the kept rows (`keep`, None: all;
        a rewritten row with its new parent) then `spare`; a spare record that does not verify
        unroots what hangs below it. Also segment -> its reachable records that do not verify."""
        t = self.table
        hashes = t.hash[keep] if keep is not None else t.hash
        parent = t.parent[keep] if keep is not None else (t.parent.copy() if rewritten else t.parent)
        for r, new in rewritten.items():
            parent[r if keep is None else int(np.searchsorted(keep, r))] = key_of_hex(new.parent)
        n = len(hashes)
        forest: Forest | None = None
        if not spare and keep is None and not rewritten and self.whole is not None:
            rooted = self.whole  # every row as read: found while the segment files were checked
        else:
            if spare:
                nodes = np.concatenate([hashes, keys_from_hex([c.hash for c in spare])])
                parents = np.concatenate([parent, keys_from_hex([c.parent for c in spare])])
                index = KeyIndex(nodes)
            else:  # the kept rows alone, still in hash order: no sort, no copy
                nodes, parents, index = hashes, parent, KeyIndex(hashes, is_sorted=True)
            forest = self._forest(index, parents)
            rooted = forest.rooted.copy()
            del index, nodes
        self.whole = None
        failed = [n + j for j, c in enumerate(spare) if rooted[n + j] and not isinstance(c.record, Record)]
        bad: dict[str, int] = {}
        for j in failed:  # a record that fails unroots what hangs below it
            bad[spare[j - n].segment] = bad.get(spare[j - n].segment, 0) + 1
        if failed:  # only with spare records: never on the whole forest's path
            assert forest is not None
            rooted &= ~forest.descendants(np.array(failed, dtype=np.int64))
        return rooted, bad

    def _adopt_or_remove(self, by_segment: dict[str, list[IndexRow]], referenced: SegmentSet, outside: dict[str, int],
                         bad: dict[str, int]) -> None:  # fmt: skip
        """Adopt the reachable verified records `by_segment`; remove the known segments no kept
        row (`referenced`) nor adoption holds (`outside`, `bad`: from `_spare`, `_rooted`)."""
        rep, act = self.rep, self.act
        for name, rows in sorted(by_segment.items()):
            act.write(self._segment_row(name), adopt=sorted(rows, key=lambda r: r.slot))
            rep.orphans_adopted += len(rows)
            what = "an orphan segment" if name not in referenced else "a segment whose rows lost them"
            rep.note("adopted", name, f"{len(rows)} verified record(s) of {what}")
        for name in (self.known - referenced).names():  # orphans nothing came back from
            if name in by_segment:
                continue
            act.remove_segments.append(name)
            verified = self._info(name) is not None
            if verified and not outside.get(name):
                rep.duplicates_removed += 1
                rep.note("orphan", name, "every record is stored in another segment")
                continue
            rep.orphans_removed += 1
            why = (f"unusable: {self.errors.get(name)}" if not verified else
                   f"{bad[name]} corrupt record(s)" if bad.get(name) else "no block a lookup can reach")  # fmt: skip
            rep.note("orphan", name, why)

    def _at_root(self, parents: np.ndarray) -> np.ndarray:
        """`[n]` bool: which of `parents` (`[n, 2]` keys) is the namespace's root parent."""
        return (parents == key_of_hex(root_parent(self.ns.name))).all(axis=1)

    def _forest(self, index: KeyIndex, parents: np.ndarray) -> Forest:
        """The chain forest of nodes `index` with `parents` (`[n, 2]` keys): reachability only."""
        return build_forest(index.find(parents), self._at_root(parents), None)

    def _whole_forest(self) -> None:
        """`self.whole`: which rows a lookup can reach, of every row as read (what
        `_adopt_and_finish` needs when no row is dropped, rewritten or adopted: a healthy cache),
        found while the segment files are checked (`chains.rooted_nodes`: reachability only)."""
        t = self.table
        self.whole = rooted_nodes(KeyIndex(t.hash, is_sorted=True).find(t.parent), self._at_root(t.parent))

    def _kept_segments(self, alive: np.ndarray, rewritten: dict[int, IndexRow]) -> SegmentSet:
        """Segments of the kept rows that a lookup can reach (`alive`, by row number; a rewritten
        row's segment is its record's)."""
        plain = alive.copy()
        plain[list(rewritten)] = False
        return SegmentSet.of_rows(self.table, plain).add(new.segment for r, new in rewritten.items() if alive[r])

    def _rows_agree(self) -> np.ndarray:
        """`[S]` bool by segment number: clean, with a `segments` row of its file's size and slot
        count (nothing to fix; compared as arrays)."""
        t, rows = self.table, self.ns.segment_rows
        nbytes, n_blocks = np.full(len(t.segments), -1, dtype=np.int64), np.full(len(t.segments), -1, dtype=np.int64)
        if [r.name for r in rows] == t.segments:  # the usual case: one row per segment, both in name order
            at = np.arange(len(rows))
        else:
            numbers = t.segment_numbers
            have = [(numbers[r.name], r) for r in rows if r.name in numbers]
            at, rows = np.array([s for s, _ in have], dtype=np.int64), tuple(r for _, r in have)
        if len(rows):
            nbytes[at] = [r.nbytes for r in rows]
            n_blocks[at] = [r.n_blocks for r in rows]
        return self.fast.clean & (nbytes == self.fast.size) & (n_blocks == self.count)

    def _segment_rows(self, kept: SegmentSet) -> None:
        """`segments` rows: rewrite wrong or missing ones of kept segments; drop ones without file."""
        seg_rows = {s.name: s for s in self.ns.segment_rows}
        for name in (kept - SegmentSet(self.table, self._rows_agree())).names():
            info = self._info(name)
            if info is None or name in self.act.writes:
                continue
            have = seg_rows.get(name)
            if have is None or (have.nbytes, have.n_blocks) != (info.nbytes, info.n_blocks):
                self.act.write(info)
                self.rep.segment_rows_fixed += 1
                self.rep.note("segment_row", name, "missing" if have is None else "size or block count differs from the file")
        named = self.table.segment_numbers
        for name in sorted(set(seg_rows) - set(self.ns.files)):
            if name not in self.act.remove_segments:
                self.act.remove_segments.append(name)
                if name not in named:  # else part of dropping the rows of a missing segment
                    self.rep.segment_rows_fixed += 1
                    self.rep.note("segment_row", name, "no file")


class _SegmentRows:
    """The rows of one segment as Python values (row numbers, hashes, parents, digests, slots,
    token counts, sizes), by slot: made only for the segments checked the general way."""

    def __init__(self, table: RowTable):
        self.t = table
        self.order, self.start = table.by_segment

    def of(self, s: int) -> tuple[list, ...]:
        t = self.t
        rows = self.order[int(self.start[s]) : int(self.start[s + 1])]
        return (rows.tolist(), hex_of_keys(t.hash[rows]), hex_of_keys(t.parent[rows]), hex_of_keys(t.digest[rows]),
                t.slot[rows].tolist(), t.num_tokens[rows].tolist(), t.nbytes[rows].tolist())  # fmt: skip


__all__ = ["RepairPlanner", "ProgressFn"]
