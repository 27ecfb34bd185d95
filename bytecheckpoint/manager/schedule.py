"""When to save: every N steps, every T seconds of wall time, at the last step, on request.

Step rules are decided by each rank alone (every rank sees the same step). Time and requests
differ between ranks (each has its own clock, a request may reach one rank only), so they
become a save only once the ranks agree on them (:mod:`.agreement`), at a step every rank
reaches alike.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ..errors import InvalidArgumentError


def _positive(name: str, value: object, kind: type | tuple[type, ...]) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, kind) or not value > 0):
        raise InvalidArgumentError(f"{name}={value!r}: give a number > 0, or None for never")


@dataclass
class Schedule:
    every_steps: int | None = None
    every_seconds: float | None = None
    last_step: int | None = None  # the loop's final step: always saved

    def __post_init__(self) -> None:
        _positive("save_every_steps", self.every_steps, int)
        _positive("save_every_seconds", self.every_seconds, (int, float))
        last = self.last_step
        if last is not None and (isinstance(last, bool) or not isinstance(last, int) or last < 0):
            raise InvalidArgumentError(f"last_step={self.last_step!r}: give a whole number >= 0, or None")
        self._last_save = time.monotonic()
        self._before = self._last_save  # before the last saved(): where a failed save leaves it

    def step_due(self, step: int) -> bool:
        """Due by the step alone: the same answer on every rank."""
        return bool(self.every_steps and step % self.every_steps == 0) or step == self.last_step

    def time_due(self, now: float | None = None) -> bool:
        """This rank's clock says a save is due (the ranks agree on it before saving)."""
        if self.every_seconds is None:
            return False
        return (time.monotonic() if now is None else now) - self._last_save >= self.every_seconds

    def saved(self, now: float | None = None) -> None:
        """A save started: the interval runs from now."""
        self._before = self._last_save
        self._last_save = time.monotonic() if now is None else now

    def save_failed(self) -> None:
        """The save last counted by :meth:`saved` failed: it was no save, so the interval runs
        from the save before it (a time-based save is due again as it was, not an interval
        late)."""
        self._last_save = self._before
