"""Telemetry events name the rank that emitted them, however the processes were started.

The telemetry context takes ``rank`` and ``world_size`` from ``RANK`` / ``WORLD_SIZE``, which
torchrun sets. A job started otherwise (``mp.spawn``, ``init_process_group(rank=...)``) has
neither, and its events carried no rank: the per-rank heatmap left them out and the
slow-rank rule could not name the slow rank. Saves, loads and the manager stamp the process
group's global rank instead, which is also the rank a checkpoint's files are named by.
"""

from __future__ import annotations

import torch.distributed as dist

from telemetry import get_context, set_context


def stamp_rank() -> None:
    """Put this process's global rank and world size on its telemetry events, from the
    default process group when there is one (a launcher's ``RANK`` that disagrees with it
    is overridden: the group is what the checkpoint's ranks are)."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    rank, world = dist.get_rank(), dist.get_world_size()
    context = get_context()
    if context.get("rank") != rank or context.get("world_size") != world:
        set_context(rank=rank, world_size=world)
