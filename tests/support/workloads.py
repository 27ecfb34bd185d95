"""Functions that run on every rank of a test process group (see tests/support/dist.py).

Each returns plain data (full tensors on CPU, numbers) for the test to compare.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.nn.parallel import DistributedDataParallel as DDP

import bytecheckpoint as bcp
from bytecheckpoint.state.flatten import clean_fqn
from demo.model import GPT, GPTConfig, batch, loss_fn

# context=30 puts FSDP v1 rank boundaries in the middle of rows (ragged flat shards)
CFG = GPTConfig(context=30)


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu().clone()


def full_state(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """Every tensor of model and optimizer, gathered whole, keyed like the checkpoint."""
    out: dict[str, Any] = {}
    for name, t in model.state_dict().items():
        out[f"model/{clean_fqn(name)}"] = _full(t)
    names = {id(p): clean_fqn(n) for n, p in model.named_parameters()}
    for group in optim.param_groups:
        for p in group["params"]:
            for k, v in optim.state.get(p, {}).items():
                out[f"optimizer/state/{names[id(p)]}/{k}"] = _full(v) if isinstance(v, torch.Tensor) else v
    out["param_groups"] = [
        {k: v for k, v in g.items() if k != "params"} | {"params": [names[id(p)] for p in g["params"]]}
        for g in optim.param_groups
    ]
    return out


def make_fsdp2(seed: int, lr: float = 1e-2, cfg: GPTConfig = CFG, weight_decay: float = 0.1
               ) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = GPT(cfg)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)


def make_plain(seed: int, lr: float = 1e-2) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = GPT(CFG)
    return model, torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)


def train_step(model: nn.Module, optim: torch.optim.Optimizer, step: int, dp_rank: int) -> float:
    inputs, targets = batch(CFG, step, dp_rank)
    loss = loss_fn(model, inputs, targets)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss.item()


def fsdp2_train_save(root: str, steps: int) -> dict[str, Any]:
    """Train FSDP2 for ``steps`` steps, save, then take one more step (for continuation)."""
    model, optim = make_fsdp2(seed=0)
    rank = dist.get_rank()
    for step in range(steps):
        train_step(model, optim, step, rank)
    result = bcp.save(f"{root}/step_{steps}", {"model": model, "optimizer": optim,
                                                 "extra_state": {"step": steps, "rank": rank}},
                      framework="fsdp2", step=steps)
    ref = full_state(model, optim)
    next_loss = train_step(model, optim, steps, rank)
    return {"ref": ref, "next_loss": next_loss, "bytes": result.bytes_written,
            "total": result.total_bytes}


def fsdp2_load(root: str, next_step: int | None = None, with_extra: bool = True) -> dict[str, Any]:
    """Load into a differently initialised FSDP2 model on this world size."""
    model, optim = make_fsdp2(seed=123, lr=5e-4)
    extra: dict[str, Any] = {}
    state: dict[str, Any] = {"model": model, "optimizer": optim}
    if with_extra:
        state["extra_state"] = extra
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = bcp.load(root, state, framework="fsdp2")
    out = {"state": full_state(model, optim), "extra": dict(extra), "bytes_read": result.bytes_read,
           "warnings": [str(c.message) for c in caught if c.category is RuntimeWarning]}
    if next_step is not None:
        out["next_loss"] = train_step(model, optim, next_step, dist.get_rank())
    return out


def ddp_train_save(root: str, steps: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = DDP(GPT(CFG))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(steps):
        train_step(model, optim, step, dist.get_rank())
    result = bcp.save(f"{root}/step_{steps}", {"model": model, "optimizer": optim}, framework="ddp",
                      step=steps)
    return {"ref": full_state(model.module, optim) if dist.get_rank() == 0 else None,
            "bytes": result.bytes_written}


def dtensor_save(root: str) -> None:
    """Save DTensors with assorted placements on a 2x2 mesh (uneven shapes included)."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    module = nn.Module()
    for name, shape, placements in DTENSOR_CASES:
        full = reference_tensor(name, shape)
        module.register_parameter(name, nn.Parameter(distribute_tensor(full, mesh, placements)))
    bcp.save(f"{root}/dtensor", {"model": module}, framework="dtensor")


def dtensor_load(root: str, layout: str) -> dict[str, torch.Tensor]:
    """Load the DTensor checkpoint into other placements; return full tensors."""
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    module = nn.Module()
    for i, (name, shape, _) in enumerate(DTENSOR_CASES):
        if layout == "shard_last":
            placement = Shard(len(shape) - 1)
        elif layout == "mixed":
            placement = [Shard(0), Replicate(), Shard(len(shape) - 1)][i % 3]
        else:
            placement = Replicate()
        empty = torch.full(shape, -1.0)
        module.register_parameter(name, nn.Parameter(distribute_tensor(empty, mesh, [placement])))
    bcp.load(f"{root}/dtensor", {"model": module}, framework="dtensor")
    return {name: _full(p) for name, p in module.named_parameters()}


DTENSOR_CASES = [
    ("rows", (10, 6), [Shard(0), Shard(1)]),
    ("cols_uneven", (5, 7), [Replicate(), Shard(1)]),
    ("nested", (9, 4), [Shard(0), Shard(0)]),
    ("replicated", (3, 3), [Replicate(), Replicate()]),
    ("cube", (3, 5, 6), [Shard(2), Shard(1)]),
]


def reference_tensor(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    return torch.randn(shape, generator=g)


def env_rank() -> int:
    return int(os.environ["RANK"])


def mismatched_save(root: str) -> str:
    """Rank 1 offers a tensor with another shape: every rank must get the error, none hang."""
    module = nn.Linear(4, 4 if dist.get_rank() == 0 else 5)
    try:
        bcp.save(f"{root}/bad", {"model": module}, framework="ddp")
    except bcp.CheckpointError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "saved"


def failing_object_save(root: str) -> str:
    """Rank 1 cannot pack its extra state: the rank's own error on rank 1, a summary elsewhere."""
    extra = {"ok": 1} if dist.get_rank() == 0 else {"bad": object()}
    try:
        bcp.save(f"{root}/bad2", {"model": nn.Linear(2, 2), "extra": extra}, framework="ddp")
    except bcp.CheckpointError as exc:
        return type(exc).__name__
    return "saved"


def ddp_load(root: str) -> dict[str, Any]:
    """Load into a DDP model on every rank (each rank needs every byte of the checkpoint)."""
    torch.manual_seed(99)
    model = DDP(GPT(CFG))
    optim = torch.optim.AdamW(model.parameters(), lr=5e-4)
    result = bcp.load(root, {"model": model, "optimizer": optim}, framework="ddp")
    return {"state": full_state(model.module, optim), "bytes_read": result.bytes_read}


def clobber(model: torch.nn.Module, optim: torch.optim.Optimizer) -> None:
    """Training goes on: change every tensor a save holds."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
        for s in optim.state.values():
            for v in s.values():
                if isinstance(v, torch.Tensor):
                    v.add_(1.0)
