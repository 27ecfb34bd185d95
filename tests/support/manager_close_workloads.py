"""Rank functions for tests/distributed/test_manager_close_review.py, run in the gloo pool
(tests/support/dist.py): time-based saves and save requests agreed between ranks, in the loop
and at close()."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

import bytecheckpoint as bcp


def _state(step: int) -> dict[str, Any]:
    return {"w": torch.full((4,), float(step))}


def time_based_saves(root: str, interval: float, steps: int) -> list[int]:
    """Checks every 2 steps; the interval passes once, before step 3: the steps saved."""
    saved = []
    with bcp.CheckpointManager(root, save_every_seconds=interval, check_every=2, async_save=False) as mgr:
        for step in range(1, steps + 1):
            if step == 3:
                time.sleep(interval + 0.05)
            if mgr.save(step, _state(step)):
                saved.append(step)
    return saved


def late_request(root: str, request_rank: int, request_step: int, steps: int,
                 fail_rank: int | None = None) -> dict[str, Any]:
    """Checks every 4 steps, no schedule: ``request_rank`` calls request_save() after its save()
    call of ``request_step`` (of ``steps``); ``fail_rank`` ends its with block with an error."""
    rank = dist.get_rank()
    saved, error = [], None
    try:
        with bcp.CheckpointManager(root, check_every=4) as mgr:
            for step in range(1, steps + 1):
                if mgr.save(step, _state(step)):
                    saved.append(step)
                if rank == request_rank and step == request_step:
                    mgr.request_save()
            ending = time.monotonic()
            if rank == fail_rank:
                raise RuntimeError("evaluation failed")
    except RuntimeError as exc:
        error = str(exc)
    return {"saved": saved, "steps": [c.step for c in mgr.steps()], "latest": mgr.latest_step(),
            "error": error, "close_s": time.monotonic() - ending}


def failing_rank_does_not_wait(root: str, delay_s: float, peer_timeout_s: float) -> dict[str, Any]:
    """Rank 0 ends its with block with an error; rank 1, with a request made after the last
    check, reaches close() ``delay_s`` later (its vote's timeout ``peer_timeout_s``)."""
    from bytecheckpoint.manager import manager

    rank = dist.get_rank()
    before = manager.CLOSE_VOTE_TIMEOUT_S
    manager.CLOSE_VOTE_TIMEOUT_S = peer_timeout_s
    error = None
    try:
        with bcp.CheckpointManager(root, check_every=8) as mgr:
            for step in range(1, 4):
                mgr.save(step, _state(step))
            mgr.request_save()
            if rank == 1:
                time.sleep(delay_s)
            ending = time.monotonic()
            if rank == 0:
                raise RuntimeError("evaluation failed")
    except RuntimeError as exc:
        error = str(exc)
    finally:
        manager.CLOSE_VOTE_TIMEOUT_S = before  # the pool's process runs other tests next
    return {"error": error, "close_s": time.monotonic() - ending, "steps": [c.step for c in mgr.steps()]}
