"""What the benchmarks share: the model sizes, the page-cache drop, and the small collectives
that turn per-rank figures into one (max or sum over ranks)."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from demo.model import GPT, GPTConfig
from tests.support.dist import free_port  # noqa: F401  (re-exported: the benches' one port finder)
from tests.support.helpers import env_set  # noqa: F401  (re-exported: the tests' own)

MODELS = {
    "small": GPTConfig(vocab_size=8003, context=32, dim=256, heads=4, layers=4, mlp_ratio=3),
    "medium": GPTConfig(vocab_size=16003, context=32, dim=512, heads=8, layers=8, mlp_ratio=3),
    # engine_vs_dcp's FULL with 4 layers: 107.6M parameters, 1.29 GB with AdamW
    "1.3gb": GPTConfig(vocab_size=32003, context=64, dim=1024, heads=16, layers=4, mlp_ratio=3),
    # engine_vs_dcp's FULL: 296.6M parameters, 3.56 GB with AdamW
    "3.56gb": GPTConfig(vocab_size=32003, context=64, dim=1024, heads=16, layers=22, mlp_ratio=3),
}
DROP_CACHES = "/proc/sys/vm/drop_caches"


def make_fsdp(cfg: GPTConfig, seed: int = 0, device: torch.device | None = None, lr: float = 1e-4
              ) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The benchmarks' workload: the GPT sharded with FSDP2 (each block, then the whole) over
    the world, on ``device`` (CPU by default), with AdamW."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    device = device or torch.device("cpu")
    torch.manual_seed(seed)
    model = GPT(cfg).to(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=lr)


def drop_caches() -> bool:
    """Write back, then drop the page cache (needs root); False where it is not allowed."""
    os.sync()
    try:
        with open(DROP_CACHES, "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def max_over_ranks(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def sum_over_ranks(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return float(t.item())


def gather(x: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, x)
    return out


def status_kb(field_name: str) -> int:
    """A ``/proc/self/status`` field in kB (VmRSS, VmHWM), 0 if absent."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    return 0
