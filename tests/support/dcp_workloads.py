"""Rank functions for the DCP interoperability tests: checkpoints written by PyTorch's own
``torch.distributed.checkpoint.save`` from ``get_state_dict``, loaded by bytecheckpoint (and
the reverse), with references gathered by DTensor itself (``tests.support.frameworks.canonical``)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import bytecheckpoint as bcp
from tests.support.frameworks import Canonical, canonical, make_tp_dp
from tests.support.workloads import make_fsdp2, make_plain, train_step


def dcp_fsdp2_save(path: str, steps: int = 2, extra: dict[str, Any] | None = None) -> Canonical:
    """Train FSDP2 + AdamW, save with DCP the way torchtitan-style trainers do."""
    model, optim = make_fsdp2(seed=0)
    for step in range(steps):
        train_step(model, optim, step, dist.get_rank())
    msd, osd = get_state_dict(model, optim)
    state: dict[str, Any] = {"model": msd, "optimizer": osd}
    if extra is not None:
        state["extra"] = extra
    dcp.save(state, checkpoint_id=path)
    return canonical(model, optim)


def bcp_fsdp2_load(path: str) -> Canonical:
    model, optim = make_fsdp2(seed=123, lr=5e-4)
    bcp.load(path, {"model": model, "optimizer": optim})
    return canonical(model, optim)


def bcp_plain_load(path: str, extra: bool = False) -> dict[str, Any]:
    model, optim = make_plain(seed=123, lr=5e-4)
    state: dict[str, Any] = {"model": model, "optimizer": optim}
    if extra:
        state["extra"] = {}
    result = bcp.load(path, state)
    return {"canonical": canonical(model, optim), "extra": state.get("extra"), "bytes": result.bytes_read}


def bcp_tp_load(path: str, tp: int) -> Canonical:
    model, optim = make_tp_dp(123, 1, tp, lr=5e-4)
    bcp.load(path, {"model": model, "optimizer": optim})
    return canonical(model, optim)


def bcp_ddp_load(path: str) -> Canonical:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from demo.model import GPT
    from tests.support.workloads import CFG

    torch.manual_seed(123)
    model = DDP(GPT(CFG))
    optim = torch.optim.AdamW(model.parameters(), lr=5e-4, weight_decay=0.1)
    bcp.load(path, {"model": model, "optimizer": optim})
    return canonical(model.module, optim)


def bcp_fsdp1_load(path: str) -> Canonical:
    """FSDP v1 with flat parameters: each rank holds a ragged 1-D slice of each flat tensor."""
    from tests.support.frameworks import canonical_fsdp1, make_fsdp1

    model, optim = make_fsdp1(123, use_orig_params=False, lr=5e-4)
    bcp.load(path, {"model": model, "optimizer": optim})
    return canonical_fsdp1(model, optim)


def bcp_pp_load(path: str, pp: int, dp: int) -> Canonical:
    """A pipeline split (stage-local layer numbers mapped to global ones), FSDP2 within a stage."""
    from tests.support.frameworks import pp_dp_load

    return pp_dp_load(path, pp, dp)


def dcp_fsdp2_load(path: str) -> Canonical:
    """PyTorch's own load of a DCP directory into FSDP2 (the --to dcp acceptance)."""
    model, optim = make_fsdp2(seed=123, lr=5e-4)
    msd, osd = get_state_dict(model, optim)
    state = {"model": msd, "optimizer": osd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    return canonical(model, optim)


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


__all__ = ["torch"]
