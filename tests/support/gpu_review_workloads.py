"""Rank functions for tests/distributed/test_gpu_review_cpu.py (the CUDA paths' review)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import bytecheckpoint as bcp
from bytecheckpoint.state.tensor_shard import TensorShard

N = 16


def load_shards_on_an_nccl_group(root: str) -> dict[str, Any]:
    """Save ``TensorShard`` halves (FSDP1 and Megatron states flatten to these), then load
    them while the training group says it is NCCL: each rank asks its targets for a CUDA
    device to exchange on. Host targets have none, so the load must go over gloo."""
    rank, world = dist.get_rank(), dist.get_world_size()
    share = N // world
    full = torch.arange(float(N))

    def shard(data: torch.Tensor) -> TensorShard:
        return TensorShard(data, (N,), (rank * share,))

    bcp.save(root, {"model": {"w": shard(full[rank * share:(rank + 1) * share].clone())}},
             overwrite=True)
    into = torch.zeros(share)
    real = dist.get_backend
    dist.get_backend = lambda group=None: "nccl"  # type: ignore[assignment]
    try:
        result = bcp.load(root, {"model": {"w": shard(into)}})
    except Exception as exc:
        return {"raised": f"{type(exc).__name__}: {exc}"}
    finally:
        dist.get_backend = real  # type: ignore[assignment]
    return {"transport": result.transport,
            "exact": torch.equal(into, full[rank * share:(rank + 1) * share])}


# Run as ``python -c REPLICA_DEVICE_SCRIPT`` (a fresh process: nothing has touched GPU 0):
# replica samples of tensors on cuda:1 digested on a new thread (current device 0), as a
# save's worker does; their digests must match the host tensors' and GPU 0 get no context.
REPLICA_DEVICE_SCRIPT = """
import threading, torch
from bytecheckpoint.engine import replicas
dev = torch.device("cuda", 1)
torch.manual_seed(0)
host = [torch.randn(1000), torch.arange(8.0), torch.randn(3, 50).t()]
rows = [(0, [0, 1]), (1, [2])]
samples = replicas.take_samples([v.to(dev) for v in host], rows)
got = {}
thread = threading.Thread(target=lambda: got.update(replicas.replica_digests(samples)))
thread.start()
thread.join()
want = replicas.replica_digests(replicas.take_samples(host, rows))
print(f"exact={got == want and len(got) == 2} context-on-0={torch._C._cuda_hasPrimaryContext(0)}")
"""


def tensor_shards_swapped(root: str) -> dict[str, Any]:
    """Each rank saves its half of a tensor as a ``TensorShard`` on its device, then loads the
    other rank's half (its bytes come from the other rank's file): on GPUs over NCCL."""
    rank, world = dist.get_rank(), dist.get_world_size()
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    n = 1 << 16
    share = n // world
    full = torch.arange(n, dtype=torch.float32, device=dev)
    bcp.save(root, {"model": {"w": TensorShard(full[rank * share:(rank + 1) * share].clone(), (n,),
                                               (rank * share,))}})
    other = world - 1 - rank
    into = torch.zeros(share, device=dev)
    result = bcp.load(root, {"model": {"w": TensorShard(into, (n,), (other * share,))}})
    return {"transport": result.transport,
            "exact": bool(torch.equal(into, full[other * share:(other + 1) * share]))}
