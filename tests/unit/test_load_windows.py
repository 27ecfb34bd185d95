"""The load's windows keep every reader busy: each window holds a share of every reader's
bytes, so no rank waits at a window's agreement while another reads alone (issue 21)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from bytecheckpoint.engine.load_pipeline import balanced_windows
from bytecheckpoint.engine.read_plan import Need, ReadUnit, plan_reads

MB = 1 << 20


def _same_layout(ranks: int, boxes: int, box_bytes: int) -> list[ReadUnit]:
    """Each rank needs (and reads) the boxes of its own file, as in a load into the layout
    that saved it."""
    needs = [[Need(r, b * box_bytes, box_bytes, 0, box_bytes) for b in range(boxes)] for r in range(ranks)]
    return plan_reads(needs)


def test_every_reader_reads_in_every_window_of_a_same_layout_load():
    units = _same_layout(ranks=4, boxes=20, box_bytes=4 * MB)
    groups = balanced_windows(units, limit=32 * MB)
    assert len(groups) == 10
    for window in groups:
        assert {u.reader for u in window} == {0, 1, 2, 3}
        assert sum(u.nbytes for u in window) == 32 * MB


@st.composite
def _plans(draw: st.DrawFn) -> list[ReadUnit]:
    ranks = draw(st.integers(1, 5))
    needs: list[list[Need]] = [[] for _ in range(ranks)]
    for f in range(draw(st.integers(1, 4))):
        offset = 0
        for _ in range(draw(st.integers(1, 6))):
            length = draw(st.integers(1, 64)) * 1024
            for r in draw(st.sets(st.integers(0, ranks - 1), min_size=1)):
                start = draw(st.integers(0, length - 1))
                needs[r].append(Need(f, offset, length, start, draw(st.integers(start + 1, length))))
            offset += length
    return plan_reads(needs)


@settings(max_examples=150, deadline=None)
@given(_plans(), st.integers(1, 300_000))
def test_windows_cover_every_unit_once_keep_boxes_whole_and_file_order(units, limit):
    groups = balanced_windows(units, limit)
    flat = [u for w in groups for u in w]
    assert sorted(flat, key=repr) == sorted(units, key=repr)  # each unit exactly once
    window_of = {}
    for i, window in enumerate(groups):
        assert window, "no empty window"
        keys = [(u.file, u.box_offset, u.start) for u in window]
        assert keys == sorted(keys)  # sequential reads within a window
        for u in window:
            assert window_of.setdefault(u.box, i) == i  # a box's units land together
    # identical on every rank: a pure function of the units
    assert balanced_windows(list(units), limit) == groups
