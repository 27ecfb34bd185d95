"""Rank functions for the CheckpointManager's multi-rank tests (tests/distributed/test_manager_dist.py).

``fsdp2_*`` run in the gloo pool (tests/support/dist.py); ``preemptible_rank`` is the body of a process
the preemption test launches itself, so that it can send it a real SIGTERM and see it exit.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

import bytecheckpoint as bcp
from tests.support.workloads import make_fsdp2, train_step


def _state(model: Any, optim: Any) -> dict[str, Any]:
    return {"model": model, "optimizer": optim, "rng": bcp.RNGState()}


def fsdp2_managed_train(root: str, steps: int, every: int) -> dict[str, Any]:
    """Train ``steps`` steps with the manager (async saves every ``every`` steps, the last step
    always, keep the last 2 plus every 6th), then one more step: the uninterrupted next loss."""
    model, optim = make_fsdp2(seed=0)
    rank = dist.get_rank()
    retention = bcp.KeepLast(2) | bcp.KeepEvery(6)
    with bcp.CheckpointManager(root, save_every_steps=every, last_step=steps, retention=retention) as mgr:
        start = mgr.restore(_state(model, optim)) or 0
        saved = []
        for step in range(start + 1, steps + 1):
            train_step(model, optim, step - 1, rank)
            if mgr.save(step, _state(model, optim)):
                saved.append(step)
    remaining = sorted(c.step for c in mgr.steps())
    return {"saved": saved, "remaining": remaining, "next_loss": train_step(model, optim, steps, rank)}


def fsdp2_managed_resume(root: str) -> dict[str, Any]:
    model, optim = make_fsdp2(seed=123, lr=5e-4)
    with bcp.CheckpointManager(root, save_every_steps=3) as mgr:
        step = mgr.restore(_state(model, optim))
    return {"step": step, "next_loss": train_step(model, optim, step, dist.get_rank())}


def fsdp2_late_preemption(root: str, signal_rank: int, fail_rank: int | None) -> dict[str, Any]:
    """Train 5 steps (saves every 3; the ranks' checks every 8 never come), then a real SIGTERM
    to ``signal_rank`` after its last save() call: too late for the loop. ``fail_rank`` raises
    inside the with block instead of ending it cleanly. Then the uninterrupted next loss."""
    model, optim = make_fsdp2(seed=0)
    rank = dist.get_rank()
    error = None
    try:
        with bcp.CheckpointManager(root, save_every_steps=3, preemption=True, check_every=8) as mgr:
            for step in range(1, 6):
                train_step(model, optim, step - 1, rank)
                mgr.save(step, _state(model, optim))
                assert not mgr.stop_requested
            if rank == signal_rank:
                os.kill(os.getpid(), signal.SIGTERM)
            ending = time.monotonic()
            if rank == fail_rank:
                raise RuntimeError("evaluation failed")
    except RuntimeError as exc:
        error = str(exc)
    return {"stopped": mgr.stop_requested, "steps": [c.step for c in mgr.steps()], "error": error,
            "close_s": time.monotonic() - ending, "next_loss": train_step(model, optim, 5, rank)}


# -- preemption: real processes ------------------------------------------------------------------

def rank_0_decision_fails(root: str) -> str:
    """Rank 0's part of a decision (naming the save) fails with an error that is no
    ``CheckpointError`` (an ``OSError`` listing the root); every rank gets an error at once."""
    mgr = bcp.CheckpointManager(root, async_save=False)
    if dist.get_rank() == 0:
        def unlistable(step: int) -> Any:
            raise OSError(5, "injected: the root cannot be listed")
        mgr._name_for = unlistable
    try:
        mgr.save(1, {"w": torch.zeros(2)}, force=True)
        return "saved"
    except Exception as exc:  # noqa: BLE001 - the test compares what each rank got
        return f"{type(exc).__name__}: {exc}"
    finally:
        mgr.close()


def _report(root: str, rank: int, kind: str, doc: dict[str, Any]) -> None:
    tmp = f"{root}/{kind}-rank{rank}.json.tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f)
    os.replace(tmp, f"{root}/{kind}-rank{rank}.json")


def preemptible_rank(rank: int, world: int, port: int, root: str, mode: str, max_steps: int) -> None:
    """``mode="train"``: train up to ``max_steps`` steps, saving on SIGTERM/SIGUSR1 (and every 5
    steps), report progress each step; ``"resume"``: restore, take one step, and compute the
    uninterrupted run's loss of that step from scratch."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    ckpt = f"{root}/ckpt"
    model, optim = make_fsdp2(seed=0)
    if mode == "train":
        mgr = bcp.CheckpointManager(ckpt, save_every_steps=5, preemption=True, check_every=4)
        saved, step = [], 0
        for step in range(1, max_steps + 1):
            train_step(model, optim, step - 1, rank)
            if mgr.save(step, _state(model, optim)):
                saved.append(step)
            _report(root, rank, "progress", {"step": step})
            if mgr.stop_requested:
                break
        mgr.close()
        _report(root, rank, "train", {"saved": saved, "stopped_at": step, "stopped": mgr.stop_requested})
    elif mode == "absent":
        _absent_peer(rank, ckpt, root, model, optim)
    else:
        with bcp.CheckpointManager(ckpt, preemption=True) as mgr:
            start = mgr.restore(_state(model, optim))
        resumed = train_step(model, optim, start, rank)
        ref_model, ref_optim = make_fsdp2(seed=0)
        for step in range(start + 1):
            reference = train_step(ref_model, ref_optim, step, rank)
        _report(root, rank, "resume", {"start": start, "loss": resumed, "reference": reference})
    dist.destroy_process_group()


def _absent_peer(rank: int, ckpt: str, root: str, model: Any, optim: Any) -> None:
    """Rank 0 is signalled too late for the loop and closes; rank 1 stays alive but never
    closes (stuck elsewhere). Rank 0 reports how long its close() took, then both leave
    without tearing the group down (its peer never will)."""
    from bytecheckpoint.manager import manager

    manager.CLOSE_VOTE_TIMEOUT_S = 3.0
    mgr = bcp.CheckpointManager(ckpt, preemption=True, check_every=8)
    for step in range(1, 4):
        train_step(model, optim, step - 1, rank)
        mgr.save(step, _state(model, optim))
    if rank == 1:
        time.sleep(8)
        os._exit(0)
    os.kill(os.getpid(), signal.SIGTERM)
    started = time.monotonic()
    mgr.close()
    _report(root, rank, "absent", {"close_s": time.monotonic() - started, "stopped": mgr.stop_requested})
    os._exit(0)


if __name__ == "__main__":
    preemptible_rank(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5],
                     int(sys.argv[6]))
