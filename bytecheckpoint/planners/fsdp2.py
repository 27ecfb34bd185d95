"""FSDP2 (``fully_shard``) and any DTensor layout: Shard on any dim (uneven too),
Replicate, and n-D meshes.

A DTensor's local tensor is one box whose offsets DTensor itself computes; replicas of a
box on other mesh coordinates offer the same box and are deduplicated by global planning.
Plain tensors next to DTensors (e.g. Adam's ``step``) are replicated on every rank.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.tensor import DTensor, Partial
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from ..errors import UnsupportedStateError
from ..format.boxes import Box
from .base import LocalShard, Planner, replicated_full

if TYPE_CHECKING:
    from ..runtime.comm import Communicator
    from ..state.flatten import FlatState


@functools.lru_cache(maxsize=1 << 16)
def _box_of(shape: tuple[int, ...], mesh: Any, placements: tuple) -> Box:
    # A pure function of its arguments and this process's place in ``mesh``, which never
    # changes; cached because torch computes it in Python (about 0.1 ms per tensor, every save).
    lengths, offset = compute_local_shape_and_global_offset(shape, mesh, placements)
    return Box(tuple(int(o) for o in offset), tuple(int(s) for s in lengths))


def dtensor_box(tensor: DTensor) -> Box:
    return _box_of(tuple(tensor.shape), tensor.device_mesh, tuple(tensor.placements))


def local_tensor(tensor: DTensor) -> torch.Tensor:
    """The local shard, without ``to_local()``'s autograd node (a save never needs one)."""
    local = getattr(tensor, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else tensor.to_local()


class DTensorPlanner(Planner):
    name = "dtensor"

    def check(self, flat: FlatState, comm: Communicator) -> None:
        for key, tensor in flat.tensors.items():
            if isinstance(tensor, DTensor) and any(isinstance(p, Partial) for p in tensor.placements):
                raise UnsupportedStateError(
                    f"{key} has a Partial placement (pending reduction); call "
                    ".redistribute() to Replicate or Shard before checkpointing"
                )

    def local_shards(self, key: str, tensor: torch.Tensor) -> list[LocalShard]:
        if not isinstance(tensor, DTensor):
            return replicated_full(tensor)
        box = dtensor_box(tensor)
        local = local_tensor(tensor)
        if tuple(local.shape) != box.lengths and local.numel() == 0 == box.numel:
            # FSDP2 gives a rank that holds none of a tensor with a zero-size dimension (e.g. a
            # TP shard of 3 columns on 4 ranks) a (0, 0) local tensor: the same nothing.
            local = local.reshape(box.lengths)
        if tuple(local.shape) != box.lengths:
            raise UnsupportedStateError(
                f"{key}: local shard shape {tuple(local.shape)} does not match the box "
                f"{box.lengths} its placements {tensor.placements} describe"
            )
        return [LocalShard(box, local)]

    def layout(self, flat: FlatState, comm: Communicator) -> dict[str, Any]:
        out: dict[str, Any] = {"world_size": comm.world_size}
        for tensor in flat.tensors.values():
            if isinstance(tensor, DTensor):
                mesh = tensor.device_mesh
                out["mesh_shape"] = list(mesh.shape)
                out["mesh_dim_names"] = list(mesh.mesh_dim_names or [])
                break
        return out


class FSDP2Planner(DTensorPlanner):
    name = "fsdp2"
