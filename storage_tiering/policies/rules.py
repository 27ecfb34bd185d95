"""Age by last modification: what the tiering service cools and retires by.

Shaped like the core's retention policies (one ``select`` per policy, output aligned with
input, the clock in the context), so they combine with ``KeepLast`` and ``KeepEvery`` with ``|``
and go through the same :func:`~bytecheckpoint.manage.retention.plan_deletions`. The manager
ages a checkpoint by when it was saved; a tier by when its files last changed (DESIGN.md §7).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from bytecheckpoint.manage.records import CheckpointInfo
from bytecheckpoint.manage.retention import Context, Policy


@dataclass(frozen=True)
class OlderThan(Policy):
    """Last modified or committed at least ``seconds`` ago."""

    seconds: float

    def select(self, checkpoints: Sequence[CheckpointInfo], *, context: Context) -> list[bool]:
        return [context.now - c.modified >= self.seconds for c in checkpoints]


@dataclass(frozen=True)
class ModifiedWithin(Policy):
    """Last modified or committed less than ``seconds`` ago (none when ``seconds`` is 0)."""

    seconds: float

    def select(self, checkpoints: Sequence[CheckpointInfo], *, context: Context) -> list[bool]:
        return [context.now - c.modified < self.seconds for c in checkpoints]
