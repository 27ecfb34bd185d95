"""Global save planning on the coordinator: dedup, balance, validate.

Input: every rank's local plan (the boxes it holds). Output: for every rank, the boxes it
must write. A box offered by several ranks (a replica) is written once. Replicated boxes are
first cut into row ranges no larger than a fraction of a rank's fair share, then placed
largest first on the least-loaded of their holders (worst-fit, paper §4.1), after the
boxes that only one rank holds. Coverage is checked for all tensors at once, vectorised
(``sharding.untiled_tensors``), and placement takes O(log h) per piece from a heap per holder
set, so planning is O(n log n) in boxes and ranks for grid-like layouts (``bench/scale_planning.py``
measures it at 16k simulated ranks).
"""

from __future__ import annotations

import heapq
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..errors import PlanningError
from ..format.boxes import Box, coverage_problem, split_rows, untiled_tensors
from ..format.dtypes import itemsize
from ..runtime.gc_pause import gc_paused


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


# A rank's part in the replica check: (replica set id, the rows of its local plan it holds of
# that set's boxes, in the set's order). The same boxes in the same order on every holder.
ReplicaRows = list[tuple[int, Sequence[int]]]


@dataclass
class GlobalSavePlan:
    assignments: list[list[WriteItem]]  # per rank, in write order
    tensors: dict[str, tuple[str, tuple[int, ...]]]  # key -> (dtype, shape)
    planned_bytes: list[int] = field(default_factory=list)
    shared_assignments: list[list[str]] = field(default_factory=list)  # per rank
    # Boxes several ranks offer, written once: per replica set id, the tensor key of each box
    # in the set's order (to name the one whose holders disagree), and each rank's rows.
    replica_keys: list[tuple[str, ...]] = field(default_factory=list)
    replica_rows: list[ReplicaRows] = field(default_factory=list)  # per rank


# Sampled digests per replica set and rank: one per bucket of the set's boxes (box i goes to
# bucket i % REPLICA_BUCKETS), so a mismatch names the boxes of its bucket, not the whole set.
REPLICA_BUCKETS = 16


def check_replicas(replica_keys: list[tuple[str, ...]],
                   digests_per_rank: list[dict[int, tuple[int, ...]]]) -> None:
    """Raise if holders of replicated boxes sampled different values. A box several ranks
    offer is written once (by one of them, or in row pieces by several), so replicas that
    differ would be saved as one rank's values or a mix of them; run on every save."""
    seen: dict[int, tuple[tuple[int, ...], int]] = {}
    last: dict[int, tuple[int, ...]] | None = None
    for rank, digests in enumerate(digests_per_rank):
        if digests == last:  # data-parallel neighbours: one C-level compare
            continue
        last = digests
        for set_id, buckets in digests.items():
            prev = seen.setdefault(set_id, (buckets, rank))
            if prev[0] != buckets:
                raise PlanningError(_replica_message(replica_keys[set_id], prev[0], buckets, prev[1], rank))


def _replica_message(keys: tuple[str, ...], a: tuple[int, ...], b: tuple[int, ...], ra: int, rb: int) -> str:
    bad = {i for i, (x, y) in enumerate(zip(a, b)) if x != y} if len(a) == len(b) else set(range(len(a)))
    names = sorted({k for i, k in enumerate(keys) if i % max(1, len(a)) in bad})
    shown = ", ".join(names[:4]) + (f" (or one of {len(names) - 4} more)" if len(names) > 4 else "")
    return (f"ranks {ra} and {rb} hold different values of {shown}, which both offer as the same "
            "replicated tensor: a replica is saved once, so the checkpoint would hold one rank's "
            "values (or a mix). Make replicas agree before saving (e.g. broadcast from one rank); "
            "give tensors that are not replicas distinct names (pipeline stages: "
            "fqn_map=bcp.pipeline_fqn_map(first_layer)); keep per-rank tensors (a local counter "
            "or RNG state) in a plain state entry, which is saved per rank. Where copies differ by "
            "design (BatchNorm running statistics under DDP without SyncBatchNorm), "
            "BCP_DIFFERING_REPLICAS=warn saves one rank's copy. Nothing was committed")


def check_shared_objects(
    shared_per_rank: list[dict[str, tuple[int, int]]],
) -> dict[str, tuple[int, int, int]]:
    """Raise if holders of a shared object disagree on its value (by content hash); return
    ``key -> (size, digest, first holder)``. Also run on every save a cached plan serves."""
    seen: dict[str, tuple[int, int, int]] = {}
    last: dict[str, tuple[int, int]] | None = None
    for rank, shared in enumerate(shared_per_rank):
        # Neighbouring ranks (data-parallel replicas, one host) mostly hold the same objects:
        # a dict equal to the one just checked adds nothing (one C-level compare).
        if shared == last:
            continue
        last = shared
        for key, (size, digest) in shared.items():
            prev = seen.setdefault(key, (size, digest, rank))
            if prev[1] != digest:
                raise PlanningError(
                    f"{key}: ranks {prev[2]} and {rank} hold different values of this "
                    "object, which must be the same on every rank that has it (e.g. optimizer "
                    "hyperparameters); make them agree before saving"
                )
    return seen


class _LeastLoaded:
    """Worst-fit placement: the least-loaded rank (then the lowest) of a holder set.

    One heap of ``(load, rank)`` per distinct holder set, updated lazily: loads only grow, so
    an entry whose load is out of date is below the truth and is refreshed when it reaches
    the top. A pick costs O(log h) amortised instead of O(h): with thousands of replicas of
    every weight (data parallelism) the linear scan dominated planning."""

    def __init__(self, load: list[int]) -> None:
        self.load = load
        self._heaps: dict[int, list[tuple[int, int]]] = {}

    def pick(self, set_id: int, holders: list[int]) -> int:
        heap = self._heaps.get(set_id)
        if heap is None:
            heap = self._heaps[set_id] = [(self.load[r], r) for r in holders]
            heapq.heapify(heap)
        load = self.load
        while True:
            held, rank = heap[0]
            if held == load[rank]:
                return rank
            heapq.heapreplace(heap, (load[rank], rank))


def _holder_sets(groups: list[list[int]]) -> list[int]:
    """An id per holder list, equal for equal lists (so equal sets share one heap)."""
    ids: dict[tuple[int, ...], int] = {}
    return [ids.setdefault(tuple(g), len(ids)) for g in groups]


def _assign_shared(plans: list[LocalSavePlan], load: list[int]) -> list[list[str]]:
    """One writer per shared object: the least-loaded rank holding it. Holders must agree."""
    seen = check_shared_objects([plan.shared for plan in plans])
    holders: dict[str, list[int]] = defaultdict(list)
    for plan in plans:
        for key in plan.shared:
            holders[key].append(plan.rank)
    out: list[list[str]] = [[] for _ in plans]
    keys = sorted(holders, key=lambda k: (-seen[k][0], k))
    ids = _holder_sets([holders[k] for k in keys])
    placer = _LeastLoaded(load)
    for key, set_id in zip(keys, ids):
        target = placer.pick(set_id, holders[key])
        out[target].append(key)
        load[target] += seen[key][0]
    return out


def plan_save(plans: list[LocalSavePlan], *, split_fraction: int = 8,
              min_piece_bytes: int = 1 << 20) -> GlobalSavePlan:
    """Build the global plan. ``split_fraction``: replicated pieces stay below
    1/split_fraction of a rank's fair share of the replicated bytes.

    Cost: one pass over the offered boxes (dict dedup keyed on plain tuples), a vectorised
    coverage check (:func:`~bytecheckpoint.format.boxes.untiled_tensors`), a sort of the
    replicated pieces and O(log h) per placement: O(n log n) in boxes and ranks."""
    with gc_paused():
        return _plan_save(plans, split_fraction, min_piece_bytes)


def _plan_save(plans: list[LocalSavePlan], split_fraction: int, min_piece_bytes: int) -> GlobalSavePlan:
    world = len(plans)
    # One pass: every rank agrees on each tensor's dtype and shape; each distinct box once.
    seen: dict[str, tuple[str, tuple[int, ...], int]] = {}
    holders: dict[tuple[str, tuple[int, ...], tuple[int, ...]], list[int]] = {}
    rows: dict[tuple[str, tuple[int, ...], tuple[int, ...]], list[int]] = {}  # each holder's row
    items_by_key: dict[tuple[str, tuple[int, ...], tuple[int, ...]], WriteItem] = {}
    for plan in plans:
        rank = plan.rank
        for row, item in enumerate(plan.items):
            key = item.key
            prev = seen.get(key)
            if prev is None:
                seen[key] = (item.dtype, item.shape, rank)
            elif prev[0] != item.dtype or prev[1] != item.shape:
                raise PlanningError(
                    f"{key}: rank {prev[2]} has dtype {prev[0]} shape {prev[1]}, rank "
                    f"{rank} has dtype {item.dtype} shape {item.shape}; every rank must "
                    "agree on a tensor's global dtype and shape"
                )
            box = item.box
            if 0 in box.lengths:
                continue
            k = (key, box.offsets, box.lengths)
            ranks = holders.get(k)
            if ranks is None:
                holders[k] = [rank]
                rows[k] = [row]
                items_by_key[k] = item
            else:
                ranks.append(rank)
                rows[k].append(row)
    tensors = {k: v[:2] for k, v in seen.items()}

    index = {k: i for i, k in enumerate(tensors)}
    bad = untiled_tensors([shape for _, shape in tensors.values()], [index[k[0]] for k in holders],
                          [k[1] for k in holders], [k[2] for k in holders])
    if bad:  # describe the first bad tensor, in the order the ranks offered them
        boxes_per_tensor: dict[str, list[Box]] = defaultdict(list)
        for key, offsets, lengths in holders:
            boxes_per_tensor[key].append(Box(offsets, lengths))
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
    replicated_rows: list[list[int]] = []
    for k, ranks in holders.items():
        item = items_by_key[k]
        if len(ranks) == 1:
            assignments[ranks[0]].append(item)
            load[ranks[0]] += item.nbytes
        else:
            replicated.append((item, ranks))
            replicated_rows.append(rows[k])

    replicated_bytes = sum(item.nbytes for item, _ in replicated)
    max_piece = max(min_piece_bytes, replicated_bytes // max(1, world * split_fraction))
    set_ids = _holder_sets([ranks for _, ranks in replicated])
    pieces: list[tuple[int, str, tuple[int, ...], tuple[int, ...], WriteItem, int, list[int]]] = []
    for (item, ranks), set_id in zip(replicated, set_ids):
        per_elem = itemsize(item.dtype)
        boxes = split_rows(item.box, max(1, max_piece // per_elem))
        for box in boxes:
            piece = item if len(boxes) == 1 else WriteItem(item.key, item.dtype, item.shape, box)
            pieces.append((-box.numel * per_elem, item.key, box.offsets, box.lengths, piece, set_id,
                           ranks))
    pieces.sort(key=lambda p: p[:4])  # largest first, then by key and box (deterministic)

    placer = _LeastLoaded(load)
    for neg_bytes, _, _, _, piece, set_id, ranks in pieces:
        target = placer.pick(set_id, ranks)
        assignments[target].append(piece)
        load[target] -= neg_bytes

    for items in assignments:
        items.sort(key=lambda it: (it.key, it.box.offsets, it.box.lengths))
    replica_keys, replica_rows = _replica_sets(world, replicated, replicated_rows, set_ids)
    return GlobalSavePlan(assignments, tensors, load, shared_assignments, replica_keys, replica_rows)


def _replica_sets(world: int, replicated: list[tuple[WriteItem, list[int]]], rows: list[list[int]],
                  set_ids: list[int]) -> tuple[list[tuple[str, ...]], list[ReplicaRows]]:
    """Per replica set, its boxes' keys; per rank, its rows of each set it belongs to, in the
    same order on every holder (the order of ``replicated``)."""
    keys: dict[int, list[str]] = defaultdict(list)
    per_rank: list[dict[int, list[int]]] = [defaultdict(list) for _ in range(world)]
    for (item, ranks), held, set_id in zip(replicated, rows, set_ids):
        keys[set_id].append(item.key)
        for rank, row in zip(ranks, held):
            per_rank[rank][set_id].append(row)
    replica_keys = [tuple(keys[i]) for i in range(len(keys))]
    return replica_keys, [[(i, _compact(r)) for i, r in sorted(mine.items())] for mine in per_rank]


def _compact(rows: list[int]) -> Sequence[int]:
    """A run of consecutive rows as a ``range`` (a DDP rank's whole plan): a few bytes to send."""
    if rows and rows[-1] - rows[0] == len(rows) - 1 and rows == list(range(rows[0], rows[-1] + 1)):
        return range(rows[0], rows[-1] + 1)
    return tuple(rows)
