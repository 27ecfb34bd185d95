"""Real saves and loads whose spans go to a spool, for tests/integration/test_telemetry_ranks_review.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

import bytecheckpoint as bcp
import telemetry
from bytecheckpoint.storage import faults
from telemetry import config
from telemetry.context import reset_context
from telemetry.sinks.spool import SpoolSink, read_spool


def _spooled(spool: Path, work: Any) -> list[dict[str, Any]]:
    telemetry.configure(sink=SpoolSink(str(spool)))
    telemetry.set_context(job="ranks", run="r", rank=0, world_size=1)
    try:
        work()
    finally:
        telemetry.flush(timeout=10)
        config.reset()
        reset_context()
    return list(read_spool(spool))


def failed_save(root: Path, spool: Path) -> list[dict[str, Any]]:
    """Every event of a save at step 5 whose storage file write fails for good."""
    def work() -> None:
        faults.install("ops=write;path=.safetensors;fail_every=1;permanent=1")
        try:
            bcp.save(str(root / "step_5"), {"model": torch.nn.Linear(4, 4)}, step=5)
        except bcp.CheckpointError:
            pass
        finally:
            faults.install(None)
    return _spooled(spool, work)


def load_after_a_later_save(root: Path, spool: Path) -> list[dict[str, Any]]:
    """Saves at steps 5 and 9, then a load of step 5: the load's events."""
    model = torch.nn.Linear(4, 4)

    def work() -> None:
        bcp.save(str(root / "step_5"), {"model": model}, step=5)
        bcp.save(str(root / "step_9"), {"model": model}, step=9)
        bcp.load(str(root / "step_5"), {"model": model})
    return [e for e in _spooled(spool, work) if e.get("checkpoint_op") == "load"]
