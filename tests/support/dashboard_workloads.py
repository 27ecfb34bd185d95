"""Rank-side functions that produce real save/load telemetry for the dashboard tests.

Each call points this rank's telemetry at a spool directory for its duration, with a
topology in the context (TP x DP on 4 ranks), then restores the session's sink.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

import bytecheckpoint as bcp
import telemetry
from bytecheckpoint.storage import register_backend
from telemetry import config
from telemetry.context import reset_context
from telemetry.sinks.spool import SpoolSink
from tests.support import workloads as w
from tests.support.telemetry_workloads import SlowStorage

TP = 2  # on 4 ranks: TP=2 x DP=2, one PP stage


def coords(rank: int, world: int) -> dict[str, int]:
    tp = TP if world % TP == 0 and world > TP else 1
    return {"tp": rank % tp, "dp": rank // tp, "pp": 0}


def _use_spool(spool_dir: str, job: str, run: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    telemetry.configure(sink=SpoolSink(spool_dir))
    telemetry.set_context(job=job, run=run, rank=rank, world_size=world, **coords(rank, world))


def _restore() -> None:
    telemetry.flush(timeout=10)
    config.reset()
    reset_context()


def save(root: str, step: int, spool_dir: str, job: str, run: str,
         slow_rank: int | None = None, delay_s: float = 0.0) -> dict[str, Any]:
    """One FSDP2 training step, then a save of model + optimizer at ``root/step_<step>``."""
    _use_spool(spool_dir, job, run)
    try:
        url = f"{root}/step_{step}"
        if slow_rank is not None:
            register_backend("slowfs", lambda: SlowStorage(slow_rank, delay_s), clobber=True)
            url = f"slowfs://{url}"
        model, optim = w.make_fsdp2(seed=step)
        w.train_step(model, optim, step, dist.get_rank())
        result = bcp.save(url, {"model": model, "optimizer": optim}, framework="fsdp2", step=step)
        return {"url": url, "bytes": result.bytes_written}
    finally:
        _restore()


def load(root: str, spool_dir: str, job: str, run: str) -> dict[str, Any]:
    """Load the newest checkpoint under ``root`` into this (smaller) world: a resharding load."""
    _use_spool(spool_dir, job, run)
    try:
        model, optim = w.make_fsdp2(seed=99)
        result = bcp.load(root, {"model": model, "optimizer": optim}, framework="fsdp2")
        return {"bytes_read": result.bytes_read}
    finally:
        _restore()
