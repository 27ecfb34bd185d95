"""Before a load reads a byte: every element of every target is filled, exactly once.

The metadata's own checks (``metadata_checks``) already refuse a checkpoint whose boxes do not
tile their tensors; this is the load's side of the same promise, computed from what the load
will actually copy: the intersections of its targets with the saved boxes, after they were
keyed by where their bytes live. A target element no read fills would keep whatever the
tensor held before the load (silently wrong data), and one filled twice means two pieces
claim it. Per target: the sizes of its regions add up to its size, and no two regions overlap
(a sweep, O(k log k) for k regions).
"""

from __future__ import annotations

from collections.abc import Iterable

from ..errors import CorruptCheckpointError
from ..format.boxes import Box, find_overlap
from ..format.metadata import CheckpointMetadata
from ..planners import LocalShard
from .load_pipeline import BoxRead


def add_read(reads: dict[tuple[int, int], BoxRead], where: tuple[int, int], read: BoxRead,
             source: str) -> None:
    """Key ``read`` by (file index, byte offset); two pieces at one place are refused, never
    one dropped for the other."""
    other = reads.get(where)
    if other is not None:
        raise CorruptCheckpointError(
            f"{source}: {other.key!r} and {read.key!r} are both stored at byte {where[1]} of the "
            "same file; the checkpoint is damaged or hostile"
        )
    reads[where] = read


def check_coverage(targets: Iterable[tuple[str, LocalShard]], reads: Iterable[BoxRead], source: str) -> None:
    """Raise CorruptCheckpointError naming the first target tensor whose elements the reads do
    not fill exactly once."""
    regions: dict[int, list[Box]] = {}
    for read in reads:
        for c in read.copies:
            regions.setdefault(id(c.target), []).append(c.region)
    for key, target in targets:
        got = regions.get(id(target), [])
        filled = sum(r.numel for r in got)
        if filled != target.box.numel:
            raise CorruptCheckpointError(
                f"{source}: the checkpoint fills {filled} of the {target.box.numel} elements of "
                f"{key!r} {target.box.offsets}+{target.box.lengths} that this load needs; the "
                "checkpoint is damaged or hostile (part of the tensor was never saved)"
            )
        if len(got) > 1 and find_overlap(got) is not None:
            raise CorruptCheckpointError(
                f"{source}: two saved pieces of {key!r} fill the same elements; the checkpoint is "
                "damaged or hostile"
            )


def check_shared_objects(meta: CheckpointMetadata, wanted: Iterable[str], source: str) -> None:
    """A shared object this load wants and the checkpoint holds must be stored shared: one that
    only carries a rank is never read (the state keeps its old value, e.g. a one-parameter
    group's learning rate)."""
    have = {(o.key, o.rank) for o in meta.objects}
    for key in sorted(wanted):
        ranks = sorted(r for k, r in have if k == key and r is not None)
        if ranks and (key, None) not in have:
            raise CorruptCheckpointError(
                f"{source}: {key!r} is state shared by every rank, but the checkpoint stores it only "
                f"for rank(s) {ranks[:20]}; the checkpoint is damaged or hostile"
            )
