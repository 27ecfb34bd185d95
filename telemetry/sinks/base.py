"""Interface every telemetry sink implements."""

from __future__ import annotations

import abc
from typing import Any, ClassVar


class Sink(abc.ABC):
    """Destination for event batches.

    The emitter calls emit/flush/poll/close from one thread at a time, so implementations
    need no locking of their own for those.

    An ``inline`` sink is a write-ahead log: the emitter calls its ``append`` from the
    emitting thread (any thread, concurrently), so an event is accepted only once the OS
    has it; its writer thread then only calls ``poll`` (ship, fsync, prune).
    """

    inline: ClassVar[bool] = False

    @abc.abstractmethod
    def emit(self, batch: list[dict[str, Any]]) -> None:
        """Persist or forward a batch of events; may raise (the emitter counts it)."""

    def append(self, event: dict[str, Any]) -> None:
        """Inline sinks only: record one event durably to the OS; cheap, thread-safe, may raise."""
        raise NotImplementedError

    def flush(self) -> None:
        """Push buffered data to its destination."""
        return

    def poll(self) -> None:
        """Called by the writer thread when idle (about once a second) and after inline appends:
        retry deferred work."""
        return

    def stats(self) -> dict[str, int]:
        """Sink counters, merged into telemetry.stats() with a ``sink_`` prefix."""
        return {}

    def close(self) -> None:
        """Release resources; the emitter may still call emit() afterwards."""
        return
