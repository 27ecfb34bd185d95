"""Real saves and loads whose telemetry goes to a spool, for tests/integration/test_telemetry_call_ids.py:
which save / load call each span belongs to (``call_id``), checked against what happened.

``python -m tests.support.telemetry_calls_workloads URL SPOOL JOB RUN FILE`` loads the
checkpoint at ``killfs://URL`` and dies (``os._exit``) when it reads a file whose name ends
with FILE, as a killed rank does: no whole-call span, and none of the spans still open.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

import bytecheckpoint as bcp
import telemetry
from bytecheckpoint.storage import register_backend
from bytecheckpoint.storage.local import LocalStorage
from telemetry import config
from telemetry.context import reset_context
from telemetry.sinks.spool import SpoolSink
from tests.support.telemetry_truth_workloads import GATED, GatedStorage

KILLED = "killfs"
KILLED_EXIT = 9


class KilledStorage(LocalStorage):
    """Local disk where reading a file named ``...<suffix>`` ends the process, its telemetry
    flushed first."""

    scheme = KILLED

    def __init__(self, suffix: str) -> None:
        super().__init__()
        self.suffix = suffix

    def _maybe_die(self, path: str) -> None:
        if path.endswith(self.suffix):
            telemetry.flush(timeout=10)
            os._exit(KILLED_EXIT)

    def read_into(self, path: str, offset: int, buffer: memoryview) -> int:
        self._maybe_die(path)
        return super().read_into(path, offset, buffer)

    def read_into_many(self, path: str, offset: int, buffers: list[memoryview]) -> int:
        self._maybe_die(path)
        return super().read_into_many(path, offset, buffers)


def _state(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(64, 32)
    optim = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 64)).sum().backward()
    optim.step()
    return {"model": model, "optimizer": optim}


def _use_spool(spool: Path, job: str, run: str, **context: Any) -> None:
    telemetry.configure(sink=SpoolSink(str(spool)))
    telemetry.set_context(job=job, run=run, rank=0, world_size=1, **context)


def _restore() -> None:
    telemetry.flush(timeout=10)
    config.reset()
    reset_context()


def save_plain(url: str, step: int) -> int:
    """A save with no telemetry of interest (the session's spool), for the loads to read."""
    return bcp.save(url, _state(0), step=step).bytes_written


def async_save_then_save_again(root: Path, spool: Path, job: str, run: str) -> dict[str, Any]:
    """Training at step 1 saves ``gatedfs://root/current`` asynchronously, with no ``step=``
    (its events take training's step); while the save waits to write, training moves on to
    step 2, and then saves the same path again (overwrite). Returns the url, each save's
    bytes, and the time between the two saves (every span of the first ended before it)."""
    gate = threading.Event()
    register_backend(GATED, lambda: GatedStorage(gate), clobber=True)
    _use_spool(spool, job, run, step=1)
    url = f"{GATED}://{root}/current"
    try:
        handle = bcp.save(url, _state(1), async_save=True)
        telemetry.set_context(step=2)
        gate.set()
        first = handle.wait().bytes_written
        between = time.time()
        second = bcp.save(url, _state(2), overwrite=True).bytes_written
        return {"url": url, "bytes": [first, second], "between": between}
    finally:
        gate.set()
        _restore()


def _die_loading(url: str, spool: Path, job: str, run: str, suffix: str) -> None:
    register_backend(KILLED, lambda: KilledStorage(suffix), clobber=True)
    _use_spool(spool, job, run)
    bcp.load(f"{KILLED}://{url}", _state(7))
    _restore()  # not reached: the read ends the process
    sys.exit(0)


if __name__ == "__main__":
    _die_loading(sys.argv[1], Path(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5])
