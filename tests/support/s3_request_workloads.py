"""Rank functions for tests/distributed/test_s3_manager_requests.py."""

from __future__ import annotations

import torch.distributed as dist

import bytecheckpoint as bcp


def latest_step_on_rank_0_alone(root: str) -> int | None:
    """Rank 0 alone asks ``latest_step()`` (as a job logs it); rank 1 goes straight on to the
    barrier. A collective ``latest_step`` would leave both waiting until the group's timeout."""
    with bcp.CheckpointManager(root, async_save=False) as mgr:
        step = mgr.latest_step() if dist.get_rank() == 0 else None
        dist.barrier()
    return step
