"""Rank functions for tests/distributed/test_reshard_review.py: targets that share memory
between keys, and tensor-parallel shards of zero columns (empty local shards FSDP2 reshapes)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import bytecheckpoint as bcp
from bytecheckpoint.errors import CheckpointError
from bytecheckpoint.planners.fsdp2 import dtensor_box, local_tensor
from tests.support.helpers import same_bits


def tied_module(fill: bool, tied: bool) -> nn.Module:
    """``dec`` is ``enc`` transposed: one memory when ``tied`` (a weight tied through
    ``.t()``); ``a`` and ``b`` are overlapping slices of one buffer when ``tied``."""
    g = torch.Generator().manual_seed(3)
    m = nn.Module()
    enc = torch.randn(4, 6, generator=g) if fill else torch.zeros(4, 6)
    m.enc = nn.Parameter(enc)
    m.dec = nn.Parameter(m.enc.detach().t() if tied else torch.randn(6, 4, generator=g))
    buf = torch.arange(12.0) if fill else torch.zeros(12)
    m.register_buffer("a", buf[:10] if tied else buf[:10].clone())
    m.register_buffer("b", buf[7:12] if tied else buf[:5].clone() + 100)
    return m


def load_shared_memory(root: str) -> dict[str, Any]:
    """Every rank (replicated targets, so reads are exchanged between ranks) loads a tied
    checkpoint into a tied module (exact) and an untied one into it (a named error)."""
    out: dict[str, Any] = {}
    for verify in (True, False):
        got = tied_module(fill=False, tied=True)
        bcp.load(f"{root}/tied", {"model": got}, verify=verify)
        ref = tied_module(fill=True, tied=True)
        out[f"tied verify={verify}"] = [k for k in ("enc", "dec", "a", "b")
                                        if not same_bits(getattr(got, k).detach(), getattr(ref, k).detach())]
        try:
            bcp.load(f"{root}/untied", {"model": tied_module(fill=False, tied=True)}, verify=verify)
            out[f"untied verify={verify}"] = "loaded"
        except CheckpointError as exc:
            out[f"untied verify={verify}"] = type(exc).__name__
    return out


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)  # column-parallel: 3 rows over up to 4 TP ranks
        self.out = nn.Linear(3, 2)  # row-parallel: 3 columns over 4 TP ranks leave one empty


def _tp_net(seed: int, dp: int, tp: int) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(seed)
    model = _Net()
    full = {k: v.detach().clone() for k, v in model.state_dict().items()}
    parallelize_module(model, mesh["tp"], {"fc": ColwiseParallel(), "out": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    return model, full


def tp_empty_shards(root: str, save: tuple[int, int], load: tuple[int, int]) -> list[str]:
    """Save in the (dp, tp) layout ``save``, load into ``load``; the keys whose local shard
    on this rank differs from the reference's box (empty shards compare as empty)."""
    model, ref = _tp_net(0, *save)
    bcp.save(root, {"model": model})
    dist.barrier()
    target, _ = _tp_net(1, *load)
    bcp.load(root, {"model": target})
    bad = []
    for key, value in target.state_dict().items():
        box, local = dtensor_box(value), local_tensor(value)
        if local.numel() == 0 == box.numel:
            continue
        if not same_bits(ref[key][box.slices()], local):
            bad.append(key)
    return bad
