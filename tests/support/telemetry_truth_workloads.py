"""Saves whose telemetry goes to a spool directory, for tests/integration/test_telemetry_truth_review.py:
the store's numbers are compared with what happened (file sizes, steps, commits)."""

from __future__ import annotations

import threading
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

GATED = "gatedfs"


class GatedStorage(LocalStorage):
    """Local disk whose writers wait for ``gate``: an async save's background write starts only
    once the test has moved on."""

    scheme = GATED

    def __init__(self, gate: threading.Event) -> None:
        super().__init__()
        self.gate = gate

    def open_writer(self, path: str):
        self.gate.wait(30)
        return super().open_writer(path)


def async_save_while_training_moves_on(root: Path, spool: Path, job: str, run: str) -> dict[str, Any]:
    """An async save at step 1 to ``gatedfs://root/step_1``; while it waits to write, training
    sets its step context to 100 and times a step of its own. Returns the url and bytes."""
    gate = threading.Event()
    register_backend(GATED, lambda: GatedStorage(gate), clobber=True)
    telemetry.configure(sink=SpoolSink(str(spool)))
    telemetry.set_context(job=job, run=run, rank=0, world_size=1)
    url = f"{GATED}://{root}/step_1"
    try:
        model = torch.nn.Linear(64, 32)
        optim = torch.optim.Adam(model.parameters())
        model(torch.ones(2, 64)).sum().backward()
        optim.step()
        handle = bcp.save(url, {"model": model, "optimizer": optim}, step=1, async_save=True)
        telemetry.set_context(step=100)
        gate.set()
        result = handle.wait()
        return {"url": url, "bytes": result.bytes_written}
    finally:
        gate.set()
        telemetry.flush(timeout=10)
        config.reset()
        reset_context()


def read_events(url: str, spool: Path, reads: list[tuple[str, int]]) -> list[dict[str, Any]]:
    """``storage.read`` events of reading each (file, buffer size) under ``url`` through the
    library's storage, a missing file included, spooled to ``spool`` and read back."""
    from bytecheckpoint.storage import open_storage
    from telemetry.sinks.spool import read_spool

    storage, path = open_storage(url)
    telemetry.configure(sink=SpoolSink(str(spool)))
    try:
        for name, size in reads:
            try:
                storage.read_into(storage.join(path, name), 0, memoryview(bytearray(size)))
            except FileNotFoundError:
                pass
    finally:
        telemetry.flush(timeout=10)
        config.reset()
        reset_context()
    return [e for e in read_spool(spool) if e["name"] == "storage.read"]
