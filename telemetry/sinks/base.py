"""Interface every telemetry sink implements."""

from __future__ import annotations

import abc
from typing import Any


class Sink(abc.ABC):
    """Destination for event batches.

    The emitter calls these methods from one thread at a time, so implementations
    need no locking of their own.
    """

    @abc.abstractmethod
    def emit(self, batch: list[dict[str, Any]]) -> None:
        """Persist or forward a batch of events; may raise (the emitter counts it)."""

    def flush(self) -> None:
        """Push buffered data to its destination."""
        return

    def poll(self) -> None:
        """Called by the writer thread when idle (about once a second): retry deferred work."""
        return

    def stats(self) -> dict[str, int]:
        """Sink counters, merged into telemetry.stats() with a ``sink_`` prefix."""
        return {}

    def close(self) -> None:
        """Release resources; the emitter may still call emit() afterwards."""
        return
