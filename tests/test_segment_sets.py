"""kvtool.ops.segment_sets: sets of segment names as a mask over a row table's segments plus other
names behave as Python sets of the same names (hypothesis)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtool.disk.rowtable import RowTable
from kvtool.ops.segment_sets import SegmentSet

TABLE_NAMES = [f"{i:032x}" for i in range(0, 40, 3)]  # sorted, as a RowTable's segments are
OTHER_NAMES = [f"{i:032x}" for i in range(1, 40, 3)]
names = st.sets(st.sampled_from(TABLE_NAMES + OTHER_NAMES))


def table(seg: list[int]) -> RowTable:
    """A row table with rows in segments `seg` (numbers into `TABLE_NAMES`)."""
    n = len(seg)
    keys, ints = np.zeros((n, 2), np.uint64), np.zeros(n, np.int32)
    return RowTable(keys, keys, keys, np.array(seg, dtype=np.int32), list(TABLE_NAMES), ints, ints, ints,
                    np.zeros(n), np.zeros(n))  # fmt: skip


@settings(max_examples=200, deadline=None)
@given(a=names, b=names, probe=st.sampled_from(TABLE_NAMES + OTHER_NAMES))
def test_it_behaves_as_a_set_of_names(a, b, probe):
    t = table([0])
    sa, sb = SegmentSet(t).add(a), SegmentSet(t, names=b)
    assert sa.names() == sorted(a) and sb.names() == sorted(b) and len(sa) == len(a)
    assert (sa | sb).names() == sorted(a | b)
    assert (sa - sb).names() == sorted(a - b)
    assert (probe in sa) == (probe in a) and (probe in sa - sb) == (probe in a - b)
    assert 42 not in sa  # not a name


@settings(max_examples=100, deadline=None)
@given(seg=st.lists(st.integers(0, len(TABLE_NAMES) - 1), max_size=30), data=st.data())
def test_the_segments_of_rows(seg, data):
    t = table(seg)
    rows = np.array(data.draw(st.lists(st.booleans(), min_size=len(seg), max_size=len(seg))), dtype=bool)
    got = SegmentSet.of_rows(t, rows)
    assert got.names() == sorted({TABLE_NAMES[s] for s, r in zip(seg, rows.tolist()) if r})
