"""Global save planning on the coordinator: dedup, balance, validate.

Input: every rank's local plan (the boxes it holds). Output: for every rank, the boxes it
must write. A box offered by several ranks (a replica) is written once. Replicated boxes are
first cut into row ranges no larger than a fraction of a rank's fair share, then placed
largest first on the least-loaded of their holders (worst-fit, paper §4.1), after the
boxes that only one rank holds. Coverage is checked per tensor with a sweep, so planning is
O(n log n) in the number of boxes for grid-like layouts.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

from .dtypes import itemsize
from .errors import PlanningError
from .sharding import Box, coverage_problem, split_rows


@dataclass(frozen=True)
class WriteItem:
    """A box of tensor ``key`` (dtype, global ``shape``) held or to be written by a rank."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    box: Box

    @property
    def nbytes(self) -> int:
        return self.box.numel * itemsize(self.dtype)


@dataclass(frozen=True)
class LocalSavePlan:
    rank: int
    items: list[WriteItem]
    object_bytes: int = 0  # this rank's own (per-rank) objects
    # Objects saved once by one of their holders: key -> (encoded size, content hash).
    shared: dict[str, tuple[int, int]] = field(default_factory=dict)


@dataclass
class GlobalSavePlan:
    assignments: list[list[WriteItem]]  # per rank, in write order
    tensors: dict[str, tuple[str, tuple[int, ...]]]  # key -> (dtype, shape)
    planned_bytes: list[int] = field(default_factory=list)
    shared_assignments: list[list[str]] = field(default_factory=list)  # per rank


def check_shared_objects(
    shared_per_rank: list[dict[str, tuple[int, int]]],
) -> dict[str, tuple[int, int, int]]:
    """Raise if holders of a shared object disagree on its value (by content hash); return
    ``key -> (size, digest, first holder)``. Also run on every save a cached plan serves."""
    seen: dict[str, tuple[int, int, int]] = {}
    for rank, shared in enumerate(shared_per_rank):
        for key, (size, digest) in shared.items():
            prev = seen.setdefault(key, (size, digest, rank))
            if prev[1] != digest:
                raise PlanningError(
                    f"{key}: ranks {prev[2]} and {rank} hold different values of this "
                    "object, which must be the same on every rank that has it (e.g. optimizer "
                    "hyperparameters); make them agree before saving"
                )
    return seen


def _assign_shared(plans: list[LocalSavePlan], load: list[int]) -> list[list[str]]:
    """One writer per shared object: the least-loaded rank holding it. Holders must agree."""
    seen = check_shared_objects([plan.shared for plan in plans])
    holders: dict[str, list[int]] = defaultdict(list)
    for plan in plans:
        for key in plan.shared:
            holders[key].append(plan.rank)
    out: list[list[str]] = [[] for _ in plans]
    for key in sorted(holders, key=lambda k: (-seen[k][0], k)):
        target = min(holders[key], key=lambda r: (load[r], r))
        out[target].append(key)
        load[target] += seen[key][0]
    return out


def _check_consistent(plans: list[LocalSavePlan]) -> dict[str, tuple[str, tuple[int, ...]]]:
    seen: dict[str, tuple[str, tuple[int, ...], int]] = {}
    for plan in plans:
        for item in plan.items:
            prev = seen.get(item.key)
            if prev is None:
                seen[item.key] = (item.dtype, item.shape, plan.rank)
            elif prev[:2] != (item.dtype, item.shape):
                raise PlanningError(
                    f"{item.key}: rank {prev[2]} has dtype {prev[0]} shape {prev[1]}, rank "
                    f"{plan.rank} has dtype {item.dtype} shape {item.shape}; every rank must "
                    "agree on a tensor's global dtype and shape"
                )
    return {k: v[:2] for k, v in seen.items()}


def plan_save(plans: list[LocalSavePlan], *, split_fraction: int = 8,
              min_piece_bytes: int = 1 << 20) -> GlobalSavePlan:
    """Build the global plan. ``split_fraction``: replicated pieces stay below
    1/split_fraction of a rank's fair share of the replicated bytes."""
    world = len(plans)
    tensors = _check_consistent(plans)

    holders: dict[tuple[str, Box], list[int]] = defaultdict(list)
    items_by_key: dict[tuple[str, Box], WriteItem] = {}
    for plan in plans:
        for item in plan.items:
            if item.box.is_empty():
                continue
            k = (item.key, item.box)
            holders[k].append(plan.rank)
            items_by_key[k] = item

    boxes_per_tensor: dict[str, list[Box]] = defaultdict(list)
    for key, box in holders:
        boxes_per_tensor[key].append(box)
    for key, (_, shape) in tensors.items():
        problem = coverage_problem(shape, boxes_per_tensor.get(key, []))
        if problem is not None and math.prod(shape) > 0:
            raise PlanningError(
                f"{key}: the ranks' shards do not tile the global shape {shape}: {problem}. "
                "Every rank of the process group must call save() with its part of the state"
            )

    load = [plan.object_bytes for plan in plans]
    shared_assignments = _assign_shared(plans, load)
    assignments: list[list[WriteItem]] = [[] for _ in range(world)]
    replicated: list[tuple[WriteItem, list[int]]] = []
    for k, ranks in holders.items():
        item = items_by_key[k]
        if len(ranks) == 1:
            assignments[ranks[0]].append(item)
            load[ranks[0]] += item.nbytes
        else:
            replicated.append((item, ranks))

    replicated_bytes = sum(item.nbytes for item, _ in replicated)
    max_piece = max(min_piece_bytes, replicated_bytes // max(1, world * split_fraction))
    pieces: list[tuple[int, WriteItem, list[int]]] = []
    for item, ranks in replicated:
        per_elem = itemsize(item.dtype)
        for box in split_rows(item.box, max(1, max_piece // per_elem)):
            piece = WriteItem(item.key, item.dtype, item.shape, box)
            pieces.append((piece.nbytes, piece, ranks))
    pieces.sort(key=lambda p: (-p[0], p[1].key, p[1].box))

    for nbytes, piece, ranks in pieces:
        target = min(ranks, key=lambda r: (load[r], r))
        assignments[target].append(piece)
        load[target] += nbytes

    for items in assignments:
        items.sort(key=lambda it: (it.key, it.box))
    return GlobalSavePlan(assignments, tensors, load, shared_assignments)

