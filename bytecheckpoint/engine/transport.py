"""Whether a load exchanges its units over NCCL or over the gloo control group.

Every rank of a load must post its point-to-point operations on the same group: a rank on
gloo and its peer on NCCL wait for each other forever. So no rank decides alone. Each rank
says whether it could exchange over NCCL (an NCCL training group and a CUDA device to hold
buffers on; ``devices.exchange_device``), that flag rides on the one all-gather the load
already makes, and every rank applies the same rule to the same flags.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Transport:
    kind: str  # "nccl" or "gloo"
    group: Any  # the group the units go over
    device: torch.device  # where this rank's exchanged buffers live

    @property
    def batched(self) -> bool:
        """NCCL runs a window's sends and receives as one batch (see ``load_pipeline``)."""
        return self.kind == "nccl"


def use_nccl(flags: list[bool]) -> bool:
    """The rule: NCCL only when every rank can use it. A rank with no CUDA tensor (an empty
    shard, objects only, CPU-offloaded state) and no device named by its group makes the
    whole load use gloo, rather than guess a device."""
    return bool(flags) and all(flags)


def choose(flags: list[bool], local_device: torch.device | None, training_group: Any,
           control_group: Any) -> Transport:
    """The transport of this rank, the same kind on every rank given the same ``flags``."""
    if use_nccl(flags):
        assert local_device is not None  # this rank's own flag is among ``flags``
        return Transport("nccl", training_group, local_device)
    return Transport("gloo", control_group, torch.device("cpu"))
