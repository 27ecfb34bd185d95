"""Rank functions for tests/distributed/test_save_consistency_review.py: saves whose ranks
offer the same tensor with different values (see tests/support/dist.py)."""

from __future__ import annotations

import functools
import os
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate

import bytecheckpoint as bcp


class Buffers(nn.Module):
    """A module of named buffers (a per-rank counter, a large replicated weight)."""

    def __init__(self, **tensors: torch.Tensor) -> None:
        super().__init__()
        for name, t in tensors.items():
            self.register_buffer(name, t)


def _outcome(fn: Any) -> str:
    try:
        out = fn()
        if isinstance(out, bcp.SaveHandle):
            out.wait()
        return "committed"
    except bcp.CheckpointError as exc:
        return f"{type(exc).__name__}: {exc}"


def _left(root: str) -> list[str]:
    """What a refused save left under ``root`` (nothing, or only the lock file)."""
    return sorted(n for n in os.listdir(root) if not n.endswith(".lock"))


def diverged_replicas(root: str) -> dict[str, Any]:
    """Every way a rank offers a replicated box with values of its own, then a save whose
    replicas agree (it must still commit and load back exactly)."""
    rank = dist.get_rank()
    out: dict[str, Any] = {}
    torch.manual_seed(rank)  # DDP replicas out of sync
    out["ddp"] = _outcome(lambda: bcp.save(f"{root}/ddp", {"model": nn.Linear(4, 3)}))
    # 2 MiB, saved in row pieces by both ranks: a mix of the two copies before the fix.
    big = Buffers(w=torch.full((512, 1024), float(rank)))
    out["split"] = _outcome(lambda: bcp.save(f"{root}/split", {"model": big}))
    shard = bcp.TensorShard(torch.full((2, 3), float(rank)), (2, 3), replica_id=rank)
    out["tensor_shard"] = _outcome(lambda: bcp.save(f"{root}/ts", {"m": {"w": shard}}))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    rep = DTensor.from_local(torch.full((2, 3), float(rank)), mesh, [Replicate()], run_check=False)
    out["dtensor"] = _outcome(lambda: bcp.save(f"{root}/dt", {"model": Buffers(w=rep)}))
    out["async"] = _outcome(lambda: bcp.save(f"{root}/async", {"model": Buffers(c=torch.tensor([rank]))},
                                             async_save=True))
    out["overlapped"] = _outcome(lambda: bcp.save(f"{root}/ov", {"model": Buffers(c=torch.tensor([rank]))},
                                                  async_save=True, snapshot="overlapped"))
    out["host_files"] = _outcome(lambda: bcp.save(f"{root}/host", {"model": Buffers(c=torch.tensor([rank]))},
                                                  files_per="host", host_size=2))

    # Replicas that agree (bit for bit: NaN and -0.0 too) commit; under the cached plan a
    # per-rank counter that diverged is refused by name.
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    # ``lay``: the same values in another memory layout on rank 0 (a transposed copy).
    lay = torch.arange(128.0).reshape(16, 8)
    buffers = Buffers(step=torch.tensor([5]), odd=torch.tensor([float("nan"), -0.0, 1.0]),
                      lay=lay.t().contiguous().t() if rank == 0 else lay)
    state = {"model": model, "buffers": buffers}
    held = {k: v.clone() for k, v in model.state_dict().items()}
    out["agree"] = _outcome(lambda: bcp.save(f"{root}/agree", state))
    fresh = {"model": nn.Linear(4, 3),
             "buffers": Buffers(step=torch.tensor([0]), odd=torch.zeros(3), lay=torch.zeros(16, 8))}
    bcp.load(f"{root}/agree", fresh)
    out["agree_exact"] = (all(torch.equal(held[k], v) for k, v in fresh["model"].state_dict().items())
                          and fresh["buffers"].step.item() == 5 and torch.equal(fresh["buffers"].lay, lay)
                          and torch.equal(fresh["buffers"].odd.view(torch.int32),
                                          buffers.odd.view(torch.int32)))
    out["agree_cached"] = bcp.save(f"{root}/agree2", state).cached_plan  # the next save hits too
    buffers.step += rank
    out["cached"] = _outcome(lambda: bcp.save(f"{root}/cached", state))
    buffers.step -= rank
    again = bcp.save(f"{root}/after", state)
    out["cached_after"] = again.cached_plan
    out["left"] = _left(root)
    return out


def pipeline_stages(root: str) -> dict[str, Any]:
    """Stages that number their layers from 0: without ``fqn_map`` both offer ``0.weight``
    (refused); with it each stage's layers are saved once under global names, and load back
    into the same split and into another one (rank 0 holds both layers, rank 1 the second)."""
    rank = dist.get_rank()
    torch.manual_seed(10 + rank)
    stage = nn.Sequential(nn.Linear(2, 2))
    out: dict[str, Any] = {"no_map": _outcome(lambda: bcp.save(f"{root}/nomap", {"model": stage}))}
    held = {f"{rank}.{k.split('.', 1)[1]}": v.clone() for k, v in stage.state_dict().items()}
    bcp.save(f"{root}/pp", {"model": stage}, fqn_map=bcp.pipeline_fqn_map(rank, prefix=""))
    everything: list[dict[str, torch.Tensor]] = [{}, {}]
    dist.all_gather_object(everything, held)
    every = {k: v for part in everything for k, v in part.items()}
    same = nn.Sequential(nn.Linear(2, 2))
    bcp.load(f"{root}/pp", {"model": same}, fqn_map=bcp.pipeline_fqn_map(rank, prefix=""))
    out["same_split"] = all(torch.equal(every[f"{rank}.{k.split('.', 1)[1]}"], v)
                            for k, v in same.state_dict().items())
    other = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)) if rank == 0 else nn.Sequential(nn.Linear(2, 2))
    bcp.load(f"{root}/pp", {"model": other}, fqn_map=bcp.pipeline_fqn_map(0 if rank == 0 else 1, prefix=""))
    first = 0 if rank == 0 else 1
    out["other_split"] = all(
        torch.equal(every[f"{int(k.split('.', 1)[0]) + first}.{k.split('.', 1)[1]}"], v)
        for k, v in other.state_dict().items())
    return out


def replica_settings(root: str) -> dict[str, Any]:
    """``BCP_DIFFERING_REPLICAS``: ``warn`` saves one copy and warns on the coordinator, ``off``
    saves it silently, a bad value is refused by name; and the samples are those of ``save()``
    time: a replica changed in place right after an async save returned is not a difference."""
    rank = dist.get_rank()
    out: dict[str, Any] = {}
    for mode in ("warn", "off", "maybe"):
        os.environ["BCP_DIFFERING_REPLICAS"] = mode
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                state = {"model": Buffers(c=torch.tensor([rank]))}
                out[mode] = _outcome(functools.partial(bcp.save, f"{root}/{mode}", state))
            out[f"{mode}_warned"] = any("BCP_DIFFERING_REPLICAS=warn" in str(w.message)
                                        and "model/c" in str(w.message) for w in caught)
        finally:
            del os.environ["BCP_DIFFERING_REPLICAS"]
    if out["warn"] == "committed":
        back = Buffers(c=torch.tensor([7]))
        bcp.load(f"{root}/warn", {"model": back})
        out["warn_loaded"] = back.c.item()
    same = Buffers(c=torch.tensor([3]))
    handle = bcp.save(f"{root}/later", {"model": same}, async_save=True)
    if rank == 1:
        same.c.add_(1)  # allowed once an async save (blocking snapshot) has returned
    out["later"] = _outcome(lambda: handle)
    return out
