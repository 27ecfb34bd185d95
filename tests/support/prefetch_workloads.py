"""Rank functions for tests/distributed/test_load_prefetch.py (run by the gloo worker pool)."""

from __future__ import annotations

from bytecheckpoint.errors import CheckpointError
from tests.support import workloads as w


def fsdp2_load_outcome(root: str) -> str:
    """Load into FSDP2 on this world; the named error it raised, or "ok"."""
    try:
        w.fsdp2_load(root, with_extra=False)
    except CheckpointError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "ok"
