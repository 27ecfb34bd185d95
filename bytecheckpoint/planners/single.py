"""One process, no process group: every tensor is whole and local."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.distributed.tensor import DTensor

from ..errors import UnsupportedStateError
from .base import LocalShard, Planner, replicated_full

if TYPE_CHECKING:
    from ..runtime.comm import Communicator
    from ..state.flatten import FlatState


class SingleProcessPlanner(Planner):
    name = "single"

    def check(self, flat: FlatState, comm: Communicator) -> None:
        if comm.world_size > 1:
            raise UnsupportedStateError(
                f"framework='single' but the process group has {comm.world_size} ranks; "
                "use 'ddp' for replicated state or 'fsdp2'/'dtensor' for sharded state"
            )
        for key, tensor in flat.tensors.items():
            if isinstance(tensor, DTensor):
                raise UnsupportedStateError(f"{key} is a DTensor; use framework='dtensor'")

    def local_shards(self, key: str, tensor: torch.Tensor) -> list[LocalShard]:
        return replicated_full(tensor)
