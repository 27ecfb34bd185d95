"""Hand-described shards: how frameworks that are neither DDP nor DTensor say what they hold.

A :class:`TensorShard` is one rank's piece of a global tensor: a regular box (global offset,
local shape) or a flattened range of such a box (a distributed optimizer's flat buffer, an
FSDP flat parameter), plus a replica id. Megatron-LM's ``ShardedTensor`` and veScale-like
custom layouts map onto it one to one. The library turns every piece into regular boxes of
the global tensor (:func:`~bytecheckpoint.format.boxes.flat_range_boxes`) without moving data,
so saving needs no communication beyond planning and loads can land in any other layout.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import UnsupportedStateError
from ..format.boxes import Box, flat_range_boxes, row_major_strides

ReplicaId = int | tuple[int, ...]


@dataclass(frozen=True)
class TensorShard:
    """A rank's piece of a global tensor.

    Args:
        data: the local values: shape ``local_shape``, or, with ``flat_range``, a contiguous
            1-D tensor holding elements ``[start, stop)`` of the row-major flattening of the
            local box. Loads write into it in place.
        global_shape: the shape of the whole tensor.
        global_offset: where the local box starts in the global tensor (default: origin).
        local_shape: the local box's shape (default: ``data.shape``; required with
            ``flat_range``).
        flat_range: ``(start, stop)`` within the flattened local box, or None for the whole box.
        replica_id: which copy this is when several ranks hold the same piece (0 = primary).
            Replicas are deduplicated either way; the writer is picked to balance load.
    """

    data: torch.Tensor
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...] | None = None
    local_shape: tuple[int, ...] | None = None
    flat_range: tuple[int, int] | None = None
    replica_id: ReplicaId = 0

    def __post_init__(self) -> None:
        gshape = tuple(int(s) for s in self.global_shape)
        object.__setattr__(self, "global_shape", gshape)
        if self.local_shape is None:
            if self.flat_range is not None:
                raise UnsupportedStateError("TensorShard with flat_range needs local_shape")
            object.__setattr__(self, "local_shape", tuple(self.data.shape))
        local = tuple(int(s) for s in self.local_shape)
        object.__setattr__(self, "local_shape", local)
        offset = tuple(int(o) for o in (self.global_offset or (0,) * len(gshape)))
        object.__setattr__(self, "global_offset", offset)
        box = Box(offset, local)
        if len(local) != len(gshape) or not box.within(gshape):
            raise UnsupportedStateError(
                f"TensorShard box offset={offset} shape={local} does not fit global shape {gshape}"
            )
        if self.flat_range is None:
            if tuple(self.data.shape) != local:
                raise UnsupportedStateError(
                    f"TensorShard data shape {tuple(self.data.shape)} differs from local_shape {local}"
                )
            return
        start, stop = (int(x) for x in self.flat_range)
        object.__setattr__(self, "flat_range", (start, stop))
        if not 0 <= start <= stop <= math.prod(local):
            raise UnsupportedStateError(
                f"TensorShard flat_range {self.flat_range} lies outside a local box of "
                f"{math.prod(local)} elements"
            )
        if self.data.numel() != stop - start:
            raise UnsupportedStateError(
                f"TensorShard data has {self.data.numel()} elements, its flat_range "
                f"{self.flat_range} has {stop - start}"
            )
        if self.data.numel() and not self.data.is_contiguous():
            raise UnsupportedStateError(
                "TensorShard data with a flat_range must be contiguous (loads write into it "
                "through views)"
            )

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def box(self) -> Box:
        assert self.global_offset is not None and self.local_shape is not None
        return Box(self.global_offset, self.local_shape)

    def pieces(self) -> list[tuple[Box, torch.Tensor]]:
        """Regular boxes in global coordinates, each with a view of ``data`` shaped like it."""
        box = self.box
        if self.flat_range is None:
            return [(box, self.data)] if not box.is_empty() else []
        start, stop = self.flat_range
        flat = self.data.reshape(-1)
        strides = row_major_strides(box.lengths)
        out = []
        for piece in flat_range_boxes(box.lengths, start, stop):
            first = sum(o * s for o, s in zip(piece.offsets, strides)) - start
            view = flat[first : first + piece.numel].view(piece.lengths)
            glob = Box(tuple(a + b for a, b in zip(piece.offsets, box.offsets)), piece.lengths)
            out.append((glob, view))
        return out


@dataclass(frozen=True)
class ShardSet:
    """Several pieces of one global tensor held by the same rank (e.g. one per layer of a
    stacked tensor, as Megatron keys every layer's shard of ``decoder.layers.*`` alike)."""

    shards: tuple[TensorShard, ...]

    def __post_init__(self) -> None:
        first = self.shards[0]
        for other in self.shards[1:]:
            if other.global_shape != first.global_shape or other.dtype != first.dtype:
                raise UnsupportedStateError(
                    f"pieces of one tensor disagree: global shape {first.global_shape} "
                    f"{first.dtype} vs {other.global_shape} {other.dtype}"
                )

    @property
    def dtype(self) -> torch.dtype:
        return self.shards[0].dtype

    @property
    def global_shape(self) -> tuple[int, ...]:
        return self.shards[0].global_shape

    def pieces(self) -> list[tuple[Box, torch.Tensor]]:
        return [piece for shard in self.shards for piece in shard.pieces()]


def add_shard(existing: TensorShard | ShardSet | None, shard: TensorShard) -> TensorShard | ShardSet:
    if existing is None:
        return shard
    held = existing.shards if isinstance(existing, ShardSet) else (existing,)
    return ShardSet((*held, shard))


def is_megatron_sharded_tensor(value: Any) -> bool:
    """Megatron-core's ``ShardedTensor``, recognised without importing megatron."""
    return type(value).__name__ == "ShardedTensor" and all(
        hasattr(value, a) for a in ("key", "data", "global_shape", "global_offset", "local_shape",
                                    "prepend_axis_num", "replica_id")
    )


def is_megatron_unsupported(value: Any) -> bool:
    return type(value).__name__ in {"ShardedObject", "ShardedTensorFactory"} and hasattr(value, "key")


def from_megatron(st: Any) -> TensorShard:
    """Convert a megatron-core ``ShardedTensor`` (prepended axes, flattened range included)."""
    if st.data is None:
        raise UnsupportedStateError(f"megatron ShardedTensor {st.key!r} has no data")
    prepend = int(st.prepend_axis_num)
    local = (1,) * prepend + tuple(int(s) for s in st.local_shape)
    rng = getattr(st, "flattened_range", None)
    if rng is None:
        data = st.data.reshape(local) if prepend else st.data
        return TensorShard(data, tuple(st.global_shape), tuple(st.global_offset), local,
                           None, st.replica_id)
    return TensorShard(st.data, tuple(st.global_shape), tuple(st.global_offset), local,
                       (int(rng.start), int(rng.stop)), st.replica_id)


def shard_of(value: Any) -> TensorShard | None:
    if isinstance(value, TensorShard):
        return value
    if is_megatron_sharded_tensor(value):
        return from_megatron(value)
    return None


def flat_shard(data: torch.Tensor, shape: Sequence[int], start: int, stop: int) -> TensorShard:
    """The elements ``[start, stop)`` of a whole tensor of ``shape``, held as 1-D ``data``."""
    shape = tuple(int(s) for s in shape)
    return TensorShard(data, shape, (0,) * len(shape), shape, (start, stop))
