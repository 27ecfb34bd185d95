"""Box geometry: intersections, byte spans, row splits, coverage checks (property tests)."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bytecheckpoint.format.boxes import Box, coverage_problem, element_span, full_box, split_rows


@st.composite
def shape_and_box(draw, max_ndim: int = 4):
    ndim = draw(st.integers(0, max_ndim))
    shape = tuple(draw(st.integers(1, 6)) for _ in range(ndim))
    offsets = tuple(draw(st.integers(0, s - 1)) for s in shape)
    lengths = tuple(draw(st.integers(1, s - o)) for s, o in zip(shape, offsets))
    return shape, Box(offsets, lengths)


@settings(max_examples=300, deadline=None)
@given(shape_and_box(), st.data())
def test_intersection_matches_masks(sb, data):
    shape, a = sb
    offsets = tuple(data.draw(st.integers(0, s - 1)) for s in shape)
    b = Box(offsets, tuple(data.draw(st.integers(1, s - o)) for s, o in zip(shape, offsets)))
    mask_a, mask_b = torch.zeros(shape, dtype=torch.bool), torch.zeros(shape, dtype=torch.bool)
    mask_a[a.slices()] = True
    mask_b[b.slices()] = True
    both = mask_a & mask_b
    inter = a.intersect(b)
    if inter is None:
        assert not both.any()
    else:
        expected = torch.zeros(shape, dtype=torch.bool)
        expected[inter.slices()] = True
        assert torch.equal(expected, both)


@settings(max_examples=300, deadline=None)
@given(shape_and_box())
def test_element_span_reads_the_sub_box_via_strides(sb):
    outer_shape, inner = sb
    values = torch.arange(math.prod(outer_shape)).reshape(outer_shape)
    first, end = element_span(inner, outer_shape)
    flat = values.reshape(-1)[first:end].clone()  # a fresh buffer, as a ranged read gives
    strides = values.stride() if outer_shape else ()
    view = flat.as_strided(inner.lengths, strides, 0)
    assert torch.equal(view, values[inner.slices()])
    # The span is exact when the inner box spans whole trailing dims.
    if all(n == s for n, s in zip(inner.lengths[1:], outer_shape[1:])):
        assert end - first == inner.numel


@settings(max_examples=200, deadline=None)
@given(shape_and_box(), st.integers(1, 50))
def test_split_rows_tiles_the_box(sb, max_numel):
    _, box = sb
    pieces = split_rows(box, max_numel)
    assert sum(p.numel for p in pieces) == box.numel
    assert all(box.intersect(p) == p for p in pieces)
    if box.ndim and box.numel // max(box.lengths[0], 1) <= max_numel:
        assert all(p.numel <= max_numel for p in pieces)
    assert coverage_problem(box.lengths, [p.relative_to(box) for p in pieces]) is None


def test_coverage_detects_gaps_overlaps_and_out_of_bounds():
    shape = (4, 6)
    halves = [Box((0, 0), (2, 6)), Box((2, 0), (2, 6))]
    assert coverage_problem(shape, halves) is None
    assert "cover 12 of 24" in coverage_problem(shape, halves[:1])
    assert "overlap" in coverage_problem(shape, [*halves, Box((1, 2), (2, 2))])
    assert "outside" in coverage_problem(shape, [Box((3, 0), (2, 6))])
    grid = [Box((r, c), (1, 3)) for r in range(4) for c in (0, 3)]
    assert coverage_problem(shape, grid) is None
    assert coverage_problem((), [full_box(())]) is None
