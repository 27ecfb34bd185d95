"""Which CUDA device a piece of engine code runs on, and the test seam for the transport choice.

A CUDA call made on a thread that never set its device runs on cuda:0, whatever device the
tensors are on: a new thread starts on device 0, and so does every thread of a pool. Every
thread the engine starts that issues CUDA calls therefore enters ``on_device(dev)`` first
(``tests/distributed/test_gpu_logic_cpu.py`` checks this statically), with ``dev`` captured on the calling
thread by ``caller_device()``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch

# Test seam: a gloo rank that sets this treats itself as holding CUDA targets on an NCCL
# group when a load chooses its transport, with host memory as its "device". The choice and
# the batched exchange then run over gloo, so tests on CPU can check that every rank agrees.
PRETEND_CUDA = False
# Test seam: a rank that sets this places every box it loads as it would for CUDA targets:
# read into the load's (here unpinned) window arena, then copied out into the targets. That
# path is otherwise taken on GPUs only, and a CPU run would not see a fault in it.
PRETEND_CUDA_TARGETS = False


@contextlib.contextmanager
def on_device(device: torch.device | int | None) -> Iterator[None]:
    """Make ``device`` current for this thread when it is a CUDA device; otherwise nothing."""
    if device is None or (isinstance(device, torch.device) and device.type != "cuda"):
        yield
        return
    with torch.cuda.device(device):
        yield


def caller_device() -> torch.device | None:
    """The calling thread's current CUDA device, or None when CUDA is not in use here.

    Asks nothing of an uninitialised CUDA (no context is created for a CPU-only job)."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return torch.device("cuda", torch.cuda.current_device())


def cuda_devices(tensors: Iterable[torch.Tensor]) -> list[torch.device]:
    """The distinct CUDA devices of ``tensors``, in first-seen order."""
    seen: dict[torch.device, None] = {}
    for t in tensors:
        if t.is_cuda:
            seen.setdefault(t.device, None)
    return list(seen)


def exchange_device(tensors: Iterable[torch.Tensor], group: Any) -> torch.device | None:
    """The device this rank would exchange load buffers on over NCCL, or None when it cannot:
    ``group`` is not NCCL, or the rank holds no CUDA tensor and its group names no device.

    Only this rank's view; ``engine.transport`` makes every rank agree before anyone uses it."""
    import torch.distributed as dist

    if PRETEND_CUDA:
        return torch.device("cpu")
    if not (dist.is_available() and dist.is_initialized()) or dist.get_backend(group) != "nccl":
        return None
    found = cuda_devices(tensors)
    if found:
        return found[0]
    pg = group if group is not None else dist.group.WORLD
    bound = getattr(pg, "bound_device_id", None)  # init_process_group(device_id=...)
    return bound if isinstance(bound, torch.device) and bound.type == "cuda" else None
