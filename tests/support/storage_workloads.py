"""Rank-side helpers for the storage tests (run through tests/support/dist.py pools)."""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist

import telemetry
from bytecheckpoint.storage import faults
from tests.support import workloads as w


def set_faults(spec: str | None, env: dict[str, str] | None = None) -> None:
    """Install a fault spec in this rank (None removes it) and set storage env settings."""
    for key, value in (env or {}).items():
        os.environ[key] = value
    faults.install(spec)


def injected() -> int:
    inj = faults.active()
    return inj.injected if inj is not None else 0


def save_reporting_error(root: str, steps: int) -> dict[str, Any]:
    """Like ``fsdp2_train_save`` but returns the error this rank saw instead of raising."""
    try:
        return {"ok": w.fsdp2_train_save(root, steps)}
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def flush_telemetry() -> int:
    telemetry.flush()
    return dist.get_rank()
