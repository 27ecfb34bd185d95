from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

import telemetry
from telemetry import config
from telemetry.context import reset_context
from telemetry.emitter import DEFAULT_QUEUE_SIZE


@pytest.fixture
def spool(tmp_path: Path) -> Iterator[Path]:
    """Telemetry on, spooled to a fresh folder, with everything the environment could override
    pinned so the tests are deterministic; reset afterwards."""
    spool_dir = tmp_path / "spool"
    reset_context()
    telemetry.configure(spool_dir=spool_dir, enabled=True, queue_size=DEFAULT_QUEUE_SIZE)
    yield spool_dir
    telemetry.flush()
    config.reset()
    reset_context()
