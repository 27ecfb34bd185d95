"""Framework planners, registered by name.

``framework=None`` picks one from the state: FSDP v1 modules → ``fsdp``; DTensors →
``fsdp2``; hand-described shards → ``manual``; a process group of more than one rank →
``ddp``; otherwise ``single``. Importing this package registers the FSDP v1 module adapter.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch.distributed.tensor import DTensor

from ..errors import UnsupportedStateError
from .base import LocalShard, Planner
from .ddp import DDPPlanner
from .fsdp import FSDPPlanner
from .fsdp2 import DTensorPlanner, FSDP2Planner
from .manual import ManualPlanner
from .single import SingleProcessPlanner

if TYPE_CHECKING:
    from ..runtime.comm import Communicator
    from ..state.flatten import FlatState

__all__ = ["LocalShard", "Planner", "get_planner", "register_planner", "planner_names"]

_PLANNERS: dict[str, type[Planner]] = {
    p.name: p for p in (DDPPlanner, DTensorPlanner, FSDPPlanner, FSDP2Planner, ManualPlanner,
                        SingleProcessPlanner)
}
_ALIASES = {"megatron": "manual", "tp": "dtensor"}


def register_planner(cls: type[Planner], *, clobber: bool = False) -> None:
    if cls.name in _PLANNERS and not clobber:
        raise ValueError(f"a planner named {cls.name!r} is already registered")
    _PLANNERS[cls.name] = cls


def planner_names() -> list[str]:
    return sorted(_PLANNERS)


def get_planner(framework: str | None, flat: FlatState, comm: Communicator) -> Planner:
    framework = _ALIASES.get(framework or "", framework)
    if framework is None:
        if "fsdp" in flat.adapters:
            framework = "fsdp"
        elif any(isinstance(t, DTensor) for t in flat.tensors.values()):
            framework = "fsdp2"
        elif "manual" in flat.adapters:
            framework = "manual"
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
