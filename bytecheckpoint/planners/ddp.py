"""DDP (and any replicated data parallelism): every rank holds every tensor in full.

Each rank offers full boxes; global planning keeps one copy of each and spreads the
writing over all ranks, so no rank writes more than its share.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.distributed.tensor import DTensor

from ..errors import UnsupportedStateError
from .base import LocalShard, Planner, replicated_full

if TYPE_CHECKING:
    from ..runtime.comm import Communicator
    from ..state.flatten import FlatState


class DDPPlanner(Planner):
    name = "ddp"

    def check(self, flat: FlatState, comm: Communicator) -> None:
        for key, tensor in flat.tensors.items():
            if isinstance(tensor, DTensor):
                raise UnsupportedStateError(
                    f"{key} is a DTensor, but framework='ddp' expects full tensors on every "
                    "rank; use framework='fsdp2' (or 'dtensor')"
                )

    def local_shards(self, key: str, tensor: torch.Tensor) -> list[LocalShard]:
        return replicated_full(tensor)
