"""The policies the service composes (see :mod:`storage_tiering.plan`)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from bytecheckpoint.manage.catalog import CheckpointInfo, untouchable_reason

from .base import Context


@dataclass(frozen=True)
class OlderThan:
    """Last modified or committed at least ``seconds`` ago."""

    seconds: float

    def select(self, checkpoints: Sequence[CheckpointInfo], *, context: Context) -> list[bool]:
        return [context.now - c.modified >= self.seconds for c in checkpoints]


@dataclass(frozen=True)
class NewestPerRun:
    """The ``n`` newest committed checkpoints of each run (by step, then commit time). One that
    cannot be ordered (``problem``) takes no place among them: it is kept by ``Untouchable``."""

    n: int

    def select(self, checkpoints: Sequence[CheckpointInfo], *, context: Context) -> list[bool]:
        runs: dict[str, list[int]] = defaultdict(list)
        for i, c in enumerate(checkpoints):
            if c.committed and c.problem is None:
                runs[c.run].append(i)
        keep = set()
        for idx in runs.values():
            idx.sort(key=lambda i: (checkpoints[i].step if checkpoints[i].step is not None else -1,
                                    checkpoints[i].modified), reverse=True)
            keep.update(idx[: self.n])
        return [i in keep for i in range(len(checkpoints))]


@dataclass(frozen=True)
class EveryKSteps:
    """Checkpoints whose step is a multiple of ``k`` (none when ``k`` is 0)."""

    k: int

    def select(self, checkpoints: Sequence[CheckpointInfo], *, context: Context) -> list[bool]:
        return [bool(self.k) and isinstance(c.step, int) and c.step % self.k == 0 for c in checkpoints]


@dataclass(frozen=True)
class Untouchable:
    """Never moved or deleted: uncommitted (or a save under way), pinned, being read, named by
    the run's ``latest`` pointer, or impossible to classify safely (``problem``: an odd step,
    an unreadable ``latest``)."""

    def select(self, checkpoints: Sequence[CheckpointInfo], *, context: Context) -> list[bool]:
        return [untouchable_reason(c) is not None for c in checkpoints]


@dataclass(frozen=True)
class FullyCold:
    def select(self, checkpoints: Sequence[CheckpointInfo], *, context: Context) -> list[bool]:
        return [c.state == "cold" for c in checkpoints]
