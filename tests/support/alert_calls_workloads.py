"""Real saves and loads of one path at one step, called more than once, whose telemetry goes to
a spool: the input of tests/integration/test_alert_calls_review.py (which call each alert is about).

Each function plays one rank of a two-rank job in this process (``set_context(rank=...,
world_size=2)`` around a real single-process save or load), so the test decides the order in
which the ranks' calls run; a rank killed mid-load is a child process:
``python -m tests.support.alert_calls_workloads URL SPOOL JOB RANK`` loads ``killfs://URL`` as
that rank and dies (``os._exit``) reading its first data file.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

import bytecheckpoint as bcp
import telemetry
from bytecheckpoint.storage import faults, register_backend
from telemetry import config
from telemetry.context import reset_context
from telemetry.sinks.spool import SpoolSink
from tests.support.telemetry_calls_workloads import KILLED, KILLED_EXIT, KilledStorage
from tests.support.telemetry_servers import ROOT
from tests.support.telemetry_truth_workloads import GATED, GatedStorage

STEP = 5
DATA_FILE = ".safetensors"


def _state() -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32)
    optim = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 64)).sum().backward()
    optim.step()
    return {"model": model, "optimizer": optim}


@contextmanager
def as_rank(spool: Path, job: str, rank: int) -> Iterator[None]:
    """Telemetry of this block to ``spool``, as ``rank`` of a two-rank job."""
    telemetry.configure(sink=SpoolSink(str(spool)))
    telemetry.set_context(job=job, run="r", rank=rank, world_size=2)
    try:
        yield
    finally:
        telemetry.flush(timeout=10)
        config.reset()
        reset_context()


@contextmanager
def storage_faults(spec: str | None) -> Iterator[None]:
    faults.install(spec)
    try:
        yield
    finally:
        faults.install(None)


def save(url: str, spool: Path, job: str, rank: int, *, slow_s: float = 0.0, fail: bool = False) -> None:
    """One save call of ``url`` at ``STEP`` as ``rank`` (overwriting what is there): its data
    file writes each ``slow_s`` late, or failing for good (the save raises, nothing commits)."""
    spec = None
    if slow_s:
        spec = f"ops=open_writer;path={DATA_FILE};latency_s={slow_s}"
    elif fail:
        spec = f"ops=write;path={DATA_FILE};fail_every=1;permanent=1"
    with as_rank(spool, job, rank), storage_faults(spec):
        try:
            bcp.save(url, _state(), step=STEP, overwrite=True)
        except bcp.CheckpointError:
            if not fail:
                raise


def warm_up(url: str) -> None:
    """A save with no telemetry of interest, so the first measured one pays no first-call costs."""
    bcp.save(url, _state(), step=STEP, overwrite=True)


def load(url: str, spool: Path, job: str, rank: int) -> None:
    """One load of ``killfs://url`` as ``rank``, through storage that kills nobody."""
    register_backend(KILLED, lambda: KilledStorage("\0never"), clobber=True)
    with as_rank(spool, job, rank):
        bcp.load(f"{KILLED}://{url}", _state())


def killed_load(url: str, spool: Path, job: str, rank: int) -> None:
    """A load of ``killfs://url`` as ``rank`` in a child process that dies reading its first
    data file (after the metadata: the call knows its step)."""
    proc = subprocess.run([sys.executable, "-m", "tests.support.alert_calls_workloads", url, str(spool), job,
                           str(rank)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    if proc.returncode != KILLED_EXIT:
        raise AssertionError(f"the load was to be killed, it exited {proc.returncode}: {proc.stderr}")


def stuck_save(url: str, spool: Path, job: str, rank: int) -> tuple[float, Callable[[], None]]:
    """An async save of ``gatedfs://url`` whose writes wait: returns when it started and a
    function that lets it finish (and waits for it). Its spans so far are flushed to ``spool``."""
    gate = threading.Event()
    register_backend(GATED, lambda: GatedStorage(gate), clobber=True)
    telemetry.configure(sink=SpoolSink(str(spool)))
    telemetry.set_context(job=job, run="r", rank=rank, world_size=2)
    started = time.time()
    handle = bcp.save(f"{GATED}://{url}", _state(), step=STEP, overwrite=True, async_save=True)
    telemetry.flush(timeout=10)

    def finish() -> None:
        gate.set()
        try:
            handle.wait()
        finally:
            telemetry.flush(timeout=10)
            config.reset()
            reset_context()
    return started, finish


def failed_gated_save(url: str, spool: Path, job: str, rank: int) -> float:
    """A save of ``gatedfs://url`` (gate open) whose data files fail to write; returns its start."""
    register_backend(GATED, lambda: GatedStorage(_OPEN), clobber=True)
    started = time.time()
    save(f"{GATED}://{url}", spool, job, rank, fail=True)
    return started


_OPEN = threading.Event()
_OPEN.set()


if __name__ == "__main__":
    url, spool, job, rank = sys.argv[1], Path(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    register_backend(KILLED, lambda: KilledStorage(DATA_FILE), clobber=True)
    with as_rank(spool, job, rank):
        bcp.load(f"{KILLED}://{url}", _state())
    sys.exit(0)  # not reached: the read ends the process
