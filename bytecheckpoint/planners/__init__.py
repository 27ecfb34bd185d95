"""Framework planners, registered by name.

``framework=None`` picks one from the state: DTensors → ``fsdp2``; a process group of
more than one rank → ``ddp``; otherwise ``single``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch.distributed.tensor import DTensor

from ..errors import UnsupportedStateError
from .base import LocalShard, Planner
from .ddp import DDPPlanner
from .fsdp2 import DTensorPlanner, FSDP2Planner
from .single import SingleProcessPlanner

if TYPE_CHECKING:
    from ..comm import Communicator
    from ..state import FlatState

__all__ = ["LocalShard", "Planner", "get_planner", "register_planner", "planner_names"]

_PLANNERS: dict[str, type[Planner]] = {
    p.name: p for p in (DDPPlanner, DTensorPlanner, FSDP2Planner, SingleProcessPlanner)
}


def register_planner(cls: type[Planner], *, clobber: bool = False) -> None:
    if cls.name in _PLANNERS and not clobber:
        raise ValueError(f"a planner named {cls.name!r} is already registered")
    _PLANNERS[cls.name] = cls


def planner_names() -> list[str]:
    return sorted(_PLANNERS)


def get_planner(framework: str | None, flat: FlatState, comm: Communicator) -> Planner:
    if framework is None:
        if any(isinstance(t, DTensor) for t in flat.tensors.values()):
            framework = "fsdp2"
        elif comm.world_size > 1:
            framework = "ddp"
        else:
            framework = "single"
    cls = _PLANNERS.get(framework)
    if cls is None:
        raise UnsupportedStateError(
            f"unknown framework {framework!r}; known: {', '.join(planner_names())}"
        )
    planner = cls()
    planner.check(flat, comm)
    return planner
