"""Collectives used for planning and commit, on a CPU (gloo) side channel.

Planning messages are small Python objects, so they go over gloo even when training uses
NCCL: no accelerator memory, no lazy NCCL channel setup (paper §5). Every collective step
carries either a value or an error, so one rank's failure reaches every rank as an
exception instead of leaving the others blocked in a collective until the timeout.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass
from typing import Any, TypeVar

import torch.distributed as dist

from .errors import CheckpointError, RankFailedError

T = TypeVar("T")
_GLOO_GROUPS: dict[Any, Any] = {}
_SAVE_GROUPS: dict[tuple[int, ...], Any] = {}


@dataclass(frozen=True)
class Outcome:
    """A rank's contribution to a checked collective: a value or an error description."""

    value: Any = None
    error: str | None = None
    error_type: str | None = None

    @classmethod
    def failure(cls, exc: BaseException) -> Outcome:
        detail = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        return cls(error=detail, error_type=type(exc).__name__)


def _control_group(group: Any) -> Any:
    """The gloo group to plan on: ``group`` itself when it is gloo, else a gloo twin."""
    backend = dist.get_backend(group)
    if backend == "gloo" or "cpu:gloo" in str(backend):
        return group
    key = group if group is not None else "default"
    if key not in _GLOO_GROUPS:
        ranks = None if group is None else dist.get_process_group_ranks(group)
        _GLOO_GROUPS[key] = dist.new_group(ranks=ranks, backend="gloo")
    return _GLOO_GROUPS[key]


def _save_group(group: Any) -> Any:
    """A gloo group of the same ranks used only by saves, created on the first save.

    An async save finishes its collectives on a background thread; on a group of their own
    they never interleave with the training thread's collectives. Saves run one at a time,
    so the group is never used by two threads at once."""
    ranks = tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
    if ranks not in _SAVE_GROUPS:
        # Only the member ranks take part in creating it (every one of them is saving).
        _SAVE_GROUPS[ranks] = dist.new_group(ranks=list(ranks), backend="gloo",
                                             use_local_synchronization=True)
    return _SAVE_GROUPS[ranks]


class Communicator:
    """Rank, world size and checked collectives over one process group (or none).

    ``dedicated=True`` runs them on the save group (see :func:`_save_group`) instead of the
    control group."""

    def __init__(self, group: Any = None, *, dedicated: bool = False) -> None:
        self.distributed = dist.is_available() and dist.is_initialized()
        if self.distributed:
            self.group = _save_group(group) if dedicated else _control_group(group)
            self.rank = dist.get_rank(self.group)
            self.world_size = dist.get_world_size(self.group)
            self.global_ranks = dist.get_process_group_ranks(self.group)
        else:
            self.group = None
            self.rank, self.world_size, self.global_ranks = 0, 1, [0]

    COORDINATOR = 0

    @property
    def is_coordinator(self) -> bool:
        return self.rank == self.COORDINATOR

    def _coordinator_global(self) -> int:
        return self.global_ranks[self.COORDINATOR]

    def gather(self, outcome: Outcome) -> list[Outcome] | None:
        """All outcomes on the coordinator (indexed by group rank), None elsewhere."""
        if not self.distributed:
            return [outcome]
        out: list[Any] | None = [None] * self.world_size if self.is_coordinator else None
        dist.gather_object(outcome, out, dst=self._coordinator_global(), group=self.group)
        return out

    def scatter(self, per_rank: list[Outcome] | None) -> Outcome:
        """Give rank ``i`` the coordinator's ``per_rank[i]``."""
        if not self.distributed:
            assert per_rank is not None
            return per_rank[0]
        received: list[Any] = [None]
        dist.scatter_object_list(
            received, per_rank if self.is_coordinator else None,
            src=self._coordinator_global(), group=self.group,
        )
        return received[0]

    def broadcast(self, outcome: Outcome | None) -> Outcome:
        """The coordinator's outcome on every rank."""
        if not self.distributed:
            assert outcome is not None
            return outcome
        box = [outcome]
        dist.broadcast_object_list(box, src=self._coordinator_global(), group=self.group)
        return box[0]

    def all_gather(self, outcome: Outcome) -> list[Outcome]:
        if not self.distributed:
            return [outcome]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, outcome, group=self.group)
        return out

    def check_all(self, local_error: BaseException | None, what: str) -> None:
        """Raise on every rank if any rank failed ``what``."""
        outcomes = self.all_gather(
            Outcome.failure(local_error) if local_error is not None else Outcome(value=True)
        )
        raise_failures(outcomes, what, local_error)


def summarize_failures(outcomes: list[Outcome]) -> Outcome | None:
    """One outcome naming every failed rank (``value``: rank -> error), or None."""
    bad = {i: o.error for i, o in enumerate(outcomes) if o.error is not None}
    if not bad:
        return None
    lines = "\n".join(f"  rank {r}: {msg}" for r, msg in sorted(bad.items()))
    return Outcome(value=bad, error=f"failed on {len(bad)} rank(s):\n{lines}")


def raise_failures(outcomes: list[Outcome], what: str, local_error: BaseException | None = None) -> None:
    """Raise one error naming every failed rank; re-raise the local error type when it is ours."""
    summary = summarize_failures(outcomes)
    if summary is None:
        return
    # A rank that failed itself raises its own, more specific error.
    if isinstance(local_error, CheckpointError):
        raise local_error
    error = RankFailedError(f"{what} {summary.error}", summary.value)
    if local_error is not None:
        raise error from local_error
    raise error
