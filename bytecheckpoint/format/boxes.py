"""Boxes: the regular n-D pieces a checkpoint is made of.

A box is ``(offsets, lengths)`` in the global coordinates of one tensor. Every saved
shard is one or more boxes; loading fills each target box from the saved boxes that
intersect it. All functions here are pure and work on plain tuples of ints.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, order=True)
class Box:
    """A regular n-D region ``[offsets, offsets + lengths)`` of a tensor of known shape."""

    offsets: tuple[int, ...]
    lengths: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.offsets) != len(self.lengths):
            raise ValueError(f"box rank mismatch: offsets {self.offsets}, lengths {self.lengths}")
        # min() of a short tuple runs in C: a load builds a box per saved piece it looks at.
        if self.offsets and (min(self.offsets) < 0 or min(self.lengths) < 0):
            raise ValueError(f"box has negative offsets or lengths: {self}")

    @property
    def ndim(self) -> int:
        return len(self.offsets)

    @property
    def numel(self) -> int:
        return math.prod(self.lengths)

    @property
    def ends(self) -> tuple[int, ...]:
        return tuple(o + n for o, n in zip(self.offsets, self.lengths))

    def is_empty(self) -> bool:
        return any(n == 0 for n in self.lengths)

    def within(self, shape: Sequence[int]) -> bool:
        return len(shape) == self.ndim and all(e <= s for e, s in zip(self.ends, shape))

    def intersect(self, other: Box) -> Box | None:
        """The common region of two boxes, or None when they do not overlap."""
        starts, lengths = [], []
        for a, n, b, m in zip(self.offsets, self.lengths, other.offsets, other.lengths):
            start, end = (a if a > b else b), min(a + n, b + m)
            if start >= end:  # disjoint in this dimension: stop at the first
                return None
            starts.append(start)
            lengths.append(end - start)
        return Box(tuple(starts), tuple(lengths))

    def relative_to(self, outer: Box) -> Box:
        """This box in the local coordinates of ``outer`` (which must contain it)."""
        return Box(tuple(a - b for a, b in zip(self.offsets, outer.offsets)), self.lengths)

    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(o, o + n) for o, n in zip(self.offsets, self.lengths))


def overlaps(offsets: Sequence[int], lengths: Sequence[int], box: Box) -> bool:
    """Whether ``[offsets, offsets + lengths)`` and ``box`` share an element (as
    ``Box(offsets, lengths).intersect(box)`` is a non-empty box), without building a box."""
    for a, n, b, m in zip(offsets, lengths, box.offsets, box.lengths):
        if (a if a > b else b) >= min(a + n, b + m):
            return False
    return True


def full_box(shape: Sequence[int]) -> Box:
    return Box((0,) * len(shape), tuple(int(s) for s in shape))


def row_major_strides(lengths: Sequence[int]) -> tuple[int, ...]:
    strides = [1] * len(lengths)
    for i in range(len(lengths) - 2, -1, -1):
        strides[i] = strides[i + 1] * lengths[i + 1]
    return tuple(strides)


def element_span(inner: Box, outer_lengths: Sequence[int]) -> tuple[int, int]:
    """Element range ``[first, last + 1)`` that ``inner`` occupies in a row-major box.

    ``inner`` is in the outer box's local coordinates. The range is what a ranged read
    must fetch; it is exact when ``inner`` spans whole trailing dimensions.
    """
    if inner.is_empty():
        return 0, 0
    strides = row_major_strides(outer_lengths)
    first = sum(o * s for o, s in zip(inner.offsets, strides))
    last = sum((o + n - 1) * s for o, n, s in zip(inner.offsets, inner.lengths, strides))
    return first, last + 1


def split_rows(box: Box, max_numel: int) -> list[Box]:
    """Split a box along dim 0 into pieces of at most ``max_numel`` elements (when possible).

    Pieces stay contiguous in row-major order, so each is one contiguous byte range.
    """
    if box.ndim == 0 or box.lengths[0] <= 1 or box.numel <= max_numel:
        return [box]
    row = box.numel // box.lengths[0]
    rows_per_piece = max(1, max_numel // max(row, 1))
    pieces = []
    for start in range(0, box.lengths[0], rows_per_piece):
        n = min(rows_per_piece, box.lengths[0] - start)
        pieces.append(Box((box.offsets[0] + start, *box.offsets[1:]), (n, *box.lengths[1:])))
    return pieces


def find_overlap(boxes: Iterable[Box]) -> tuple[Box, Box] | None:
    """Return a pair of overlapping boxes, or None.

    Sweep along dim 0: only boxes whose dim-0 ranges overlap are compared, so grid-like
    shardings (every real layout) cost O(n log n).
    """
    ordered = sorted((b for b in boxes if not b.is_empty()), key=lambda b: b.offsets[:1])
    active: list[Box] = []
    for box in ordered:
        if box.ndim == 0:
            if active:
                return active[0], box
            active.append(box)
            continue
        start = box.offsets[0]
        active = [a for a in active if a.ends[0] > start]
        for other in active:
            if other.intersect(box) is not None:
                return other, box
        active.append(box)
    return None


def coverage_problem(shape: Sequence[int], boxes: Sequence[Box]) -> str | None:
    """Describe why ``boxes`` do not tile ``shape`` exactly, or return None if they do."""
    for b in boxes:
        if not b.within(shape):
            return f"box offsets={b.offsets} lengths={b.lengths} lies outside shape {tuple(shape)}"
    pair = find_overlap(boxes)
    if pair is not None:
        a, b = pair
        return f"boxes overlap: {a.offsets}+{a.lengths} and {b.offsets}+{b.lengths}"
    total = math.prod(shape)
    covered = sum(b.numel for b in boxes)
    if covered != total:
        return f"boxes cover {covered} of {total} elements"
    return None


def flat_range_boxes(shape: Sequence[int], start: int, stop: int) -> list[Box]:
    """Decompose the row-major element range ``[start, stop)`` of ``shape`` into boxes.

    This is how irregular shards (FSDP flat parameters, a distributed optimizer's flat
    ranges) become regular boxes without moving data: the boxes are returned in element
    order, each is one contiguous run of the range, together they cover it exactly, and
    there are at most ``2 * ndim - 1`` of them (a ragged head, whole rows, a ragged tail,
    recursively).
    """
    total = math.prod(shape)
    if not 0 <= start <= stop <= total:
        raise ValueError(f"flat range [{start}, {stop}) lies outside a tensor of {total} elements")
    if start == stop:
        return []
    if len(shape) == 0:
        return [Box((), ())]
    if len(shape) == 1:
        return [Box((start,), (stop - start,))]
    inner_shape = tuple(shape[1:])
    inner = math.prod(inner_shape)
    row0, col0 = divmod(start, inner)
    row1, col1 = divmod(stop, inner)

    def in_row(row: int, lo: int, hi: int) -> list[Box]:
        return [Box((row, *b.offsets), (1, *b.lengths)) for b in flat_range_boxes(inner_shape, lo, hi)]

    if row0 == row1:
        return in_row(row0, col0, col1)
    boxes: list[Box] = []
    if col0:
        boxes += in_row(row0, col0, inner)
        row0 += 1
    if row1 > row0:
        boxes.append(Box((row0,) + (0,) * len(inner_shape), (row1 - row0, *inner_shape)))
    if col1:
        boxes += in_row(row1, 0, col1)
    return boxes


def untiled_tensors(shapes: Sequence[Sequence[int]], tensor: Sequence[int],
                    offsets: Sequence[Sequence[int]], lengths: Sequence[Sequence[int]]) -> set[int]:
    """Indices of the tensors whose boxes do not tile their shape exactly (vectorised).

    ``shapes[t]`` is tensor t's shape; box i belongs to tensor ``tensor[i]`` and has
    ``offsets[i]``/``lengths[i]``. Tensors with no elements are never reported. A tensor is
    tiled when its boxes lie inside it, cover as many elements as it has, and no two overlap.
    Overlap is tested between the boxes whose dim-0 ranges overlap, found for all tensors at
    once by sorting on (tensor, dim-0 start): O(n log n + p) for n boxes and p such pairs,
    which grid-like layouts keep near n (a row range is split over a few ranks at most).
    Use :func:`coverage_problem` on a reported tensor to describe what is wrong.
    """
    n_t = len(shapes)
    nd_t = np.array([len(s) for s in shapes], dtype=np.int64)
    dims = max([1, *nd_t.tolist()], default=1)
    # Boxes are padded to ``dims`` dimensions (offset 0, length 1 over a size-1 dimension),
    # so 0-d tensors are one element long.
    shape_arr = np.ones((n_t, dims), dtype=np.int64)
    for t, s in enumerate(shapes):
        shape_arr[t, : len(s)] = s
    numel_t = np.array([math.prod(s) for s in shapes], dtype=np.int64)
    bad = np.zeros(n_t, dtype=bool)
    covered = np.zeros(n_t, dtype=np.int64)
    n = len(tensor)
    if n:
        tix = np.asarray(tensor, dtype=np.int64)
        nd_b = np.fromiter((len(o) for o in offsets), dtype=np.int64, count=n)
        off = np.zeros((n, dims), dtype=np.int64)
        ln = np.ones((n, dims), dtype=np.int64)
        for d in range(1, dims + 1):  # fill boxes of each rank at once
            sel = np.nonzero(nd_b == d)[0]
            if len(sel):
                off[sel, :d] = np.array([offsets[i] for i in sel], dtype=np.int64).reshape(len(sel), d)
                ln[sel, :d] = np.array([lengths[i] for i in sel], dtype=np.int64).reshape(len(sel), d)
        wrong = (nd_b != nd_t[tix]) | np.any(off < 0, axis=1) | np.any(ln < 0, axis=1)
        wrong |= np.any(off + ln > shape_arr[tix], axis=1)
        bad[tix[wrong]] = True
        np.add.at(covered, tix, np.prod(ln, axis=1))
        # Overlap: lay every tensor's dim 0 end to end, sort boxes by start; box j can only
        # overlap the boxes that start inside its dim-0 range, a contiguous run after it.
        base = np.concatenate([[0], np.cumsum(shape_arr[:, 0])[:-1]])
        start = base[tix] + off[:, 0]
        order = np.argsort(start, kind="stable")
        start, end = start[order], start[order] + ln[order, 0]
        hi = np.searchsorted(start, end, side="left")
        counts = np.maximum(hi - np.arange(n) - 1, 0)
        if counts.sum():
            j = np.repeat(np.arange(n), counts)
            first = np.cumsum(counts) - counts
            i = np.arange(len(j)) - np.repeat(first, counts) + j + 1
            a, b = order[j], order[i]
            lo_ = np.maximum(off[a], off[b])
            hi_ = np.minimum(off[a] + ln[a], off[b] + ln[b])
            hit = np.all(lo_ < hi_, axis=1) & (tix[a] == tix[b])
            bad[tix[a[hit]]] = True
    bad |= covered != numel_t
    bad &= numel_t > 0
    return set(np.nonzero(bad)[0].tolist())


class TooIrregularError(ValueError):
    """An overlap check would compare more box pairs than its budget allows."""


def overlapping_tensors(tensor: np.ndarray, off: np.ndarray, ln: np.ndarray, n_tensors: int,
                        max_pairs: int) -> np.ndarray:
    """Per tensor: True when two of its boxes overlap (columnar and vectorised).

    Box i belongs to tensor ``tensor[i]`` (ascending) and is ``off[i] + ln[i]`` (int64 arrays of
    shape ``(n, dims)``, every box non-empty, ``off + ln`` without overflow, and the tensors'
    extents summed without overflow: the caller bounds them). A sweep along one dimension
    compares only the boxes whose ranges in it overlap: dim 0 for every tensor first (real
    layouts keep that near n pairs), else for each tensor the dimension with the fewest such
    pairs. Raises :class:`TooIrregularError` when even that exceeds ``max_pairs`` (a layout no
    planner makes: boxes that overlap in every single dimension's projection, by the thousand).
    """
    bad = np.zeros(n_tensors, dtype=bool)
    n, dims = off.shape
    if n < 2:
        return bad
    seg_start = np.flatnonzero(np.r_[True, tensor[1:] != tensor[:-1]])
    seg = np.repeat(np.arange(len(seg_start)), np.diff(np.r_[seg_start, n]))
    ext = np.maximum.reduceat(off + ln, seg_start, axis=0)

    def sweep(d: int, rows: np.ndarray, presorted: bool) -> tuple[np.ndarray, np.ndarray]:
        # Tensors laid end to end along dimension d, one apart, so ranges of different
        # tensors never meet.
        base = np.concatenate([[0], np.cumsum(ext[:, d] + 1)[:-1]])
        key = base[seg[rows]] + off[rows, d]
        order = rows if presorted else rows[np.argsort(key, kind="stable")]
        start = base[seg[order]] + off[order, d]
        hi = np.searchsorted(start, start + ln[order, d], side="left")
        return order, np.maximum(hi - np.arange(len(order)) - 1, 0)

    everything = np.arange(n)
    key0 = off[:, 0] + np.concatenate([[0], np.cumsum(ext[:, 0] + 1)[:-1]])[seg]
    order, counts = sweep(0, everything, bool(np.all(np.diff(key0) >= 0)))
    plans = [(order, counts)]
    if int(counts.sum()) > max_pairs:
        # Per tensor, the dimension with the fewest candidate pairs.
        per_dim = [np.bincount(seg[order], counts, minlength=len(seg_start))]
        sweeps = [(order, counts)]
        for d in range(1, dims):
            o, c = sweep(d, everything, False)
            sweeps.append((o, c))
            per_dim.append(np.bincount(seg[o], c, minlength=len(seg_start)))
        table = np.stack(per_dim)
        best = np.argmin(table, axis=0)
        if int(table.min(axis=0).sum()) > max_pairs:
            worst = int(tensor[seg_start[int(np.argmax(table.min(axis=0)))]])
            raise TooIrregularError(worst)
        plans = []
        for d in range(dims):
            rows = np.flatnonzero(best[seg] == d)
            if len(rows):
                plans.append(sweep(d, rows, False))
    for order, counts in plans:
        _mark_overlaps(order, counts, tensor, off, ln, bad)
    return bad


def _mark_overlaps(order: np.ndarray, counts: np.ndarray, tensor: np.ndarray, off: np.ndarray,
                   ln: np.ndarray, bad: np.ndarray, batch: int = 1 << 20) -> None:
    """Compare each box (in sweep ``order``) with the ``counts`` boxes after it, in batches of
    about ``batch`` pairs so memory stays bounded."""
    ends = np.cumsum(counts)
    lo = 0
    while lo < len(order):
        hi = int(np.searchsorted(ends, (ends[lo - 1] if lo else 0) + batch, side="right"))
        hi = max(hi, lo + 1)
        c = counts[lo:hi]
        if c.sum():
            j = np.repeat(np.arange(lo, hi), c)
            first = np.cumsum(c) - c
            i = np.arange(len(j)) - np.repeat(first, c) + j + 1
            a, b = order[j], order[i]
            hit = np.all(np.maximum(off[a], off[b]) < np.minimum(off[a] + ln[a], off[b] + ln[b]), axis=1)
            bad[tensor[a[hit]]] = True
        lo = hi
