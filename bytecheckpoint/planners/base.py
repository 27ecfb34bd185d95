"""The planner interface: how a framework's tensors map to boxes in global coordinates.

Call order, on every rank, for a save:
  1. ``check(flat, comm)``           refuse state this framework cannot describe
  2. ``pieces(key, value)``          for each tensor: the boxes this rank holds, with views
  3. ``layout(flat, comm)``          a description of the parallel layout for the metadata
For a load, 1 and 2 run on the *target* state; the returned views are the destinations the
engine copies into. Hand-described shards (:class:`~bytecheckpoint.state.tensor_shard.TensorShard`: FSDP
flat parameters, Megatron-style layouts) are understood by every planner; a planner only
says how its framework's own tensors map to boxes (``local_shards``).
Planners hold no state between calls; the engine, global planning and
storage know nothing about frameworks, so adding a framework is adding a module here.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from ..format.boxes import Box, full_box
from ..state.tensor_shard import ShardSet, TensorShard

if TYPE_CHECKING:
    from ..runtime.comm import Communicator
    from ..state.flatten import FlatState


@dataclass(frozen=True)
class LocalShard:
    """One box of a tensor held by this rank; ``data`` is a view with shape ``box.lengths``."""

    box: Box
    data: torch.Tensor


class Planner(abc.ABC):
    name: ClassVar[str]

    def check(self, flat: FlatState, comm: Communicator) -> None:
        """Raise UnsupportedStateError for state this planner cannot handle."""

    @abc.abstractmethod
    def local_shards(self, key: str, tensor: torch.Tensor) -> list[LocalShard]: ...

    def pieces(self, key: str, value: torch.Tensor | TensorShard | ShardSet) -> list[LocalShard]:
        """The boxes this rank holds of ``key``, each with a view of its data."""
        if isinstance(value, TensorShard | ShardSet):
            return [LocalShard(box, view) for box, view in value.pieces()]
        return self.local_shards(key, value)

    def global_shape(self, value: torch.Tensor | TensorShard | ShardSet) -> tuple[int, ...]:
        if isinstance(value, TensorShard | ShardSet):
            return value.global_shape
        return tuple(value.shape)

    def layout(self, flat: FlatState, comm: Communicator) -> dict[str, Any]:
        return {"world_size": comm.world_size}


def replicated_full(tensor: torch.Tensor) -> list[LocalShard]:
    """A tensor every rank holds in full: one box covering it (dedup picks the writer)."""
    return [LocalShard(full_box(tensor.shape), tensor)]
