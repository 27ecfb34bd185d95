"""Ranks 1 and 2 of a 4-rank world make bytecheckpoint's groups on their own group after
rank 1 made a private group of its own (as ``integrations/lightning.py`` does, and any user
may): torch names a group made by its members alone by its ranks and the number of groups the
process has, which now differs between the two. Each function returns this rank's result and
ends with a group every rank makes together, which only works if nothing was left half-made.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch.distributed as dist

from bytecheckpoint.manager.agreement import Agreement
from bytecheckpoint.runtime.comm import Communicator, Outcome

MEMBERS = (1, 2)


def _sub_with_rank_1_ahead() -> Any:
    sub = dist.new_group(list(MEMBERS), backend="gloo", timeout=timedelta(seconds=30))
    if dist.get_rank() == 1:  # the user's own group: rank 1 now has one more than rank 2
        dist.new_group([1], backend="gloo", use_local_synchronization=True)
    return sub


def _together(value: Any) -> Any:
    everyone = dist.new_group(backend="gloo", timeout=timedelta(seconds=30))
    dist.barrier(group=everyone)
    return value


def control_twin_of_an_nccl_subgroup() -> list[int] | None:
    """Only the members plan on their (pretended NCCL-only) group: its gloo twin is made by
    them alone, under one name on both."""
    sub = _sub_with_rank_1_ahead()
    gathered = None
    if dist.get_rank() in MEMBERS:
        original = dist.get_backend

        def backend(group: Any = None) -> str:
            return "nccl" if group is sub else original(group)

        dist.get_backend = backend  # type: ignore[assignment]
        try:
            gathered = [o.value for o in Communicator(sub).all_gather(Outcome(value=dist.get_rank()))]
        finally:
            dist.get_backend = original  # type: ignore[assignment]
    return _together(gathered)


def agreement_on_a_subgroup() -> tuple[bool, bool] | None:
    """A manager's agreement on the members' group: rank 2's stop flag reaches rank 1."""
    sub = _sub_with_rank_1_ahead()
    agreed = None
    if dist.get_rank() in MEMBERS:
        agreement = Agreement(sub, check_every=1)
        agreement.flags[0] = int(dist.get_rank() == 2)
        result = agreement.now()
        agreed = (result.stop, result.save)
    return _together(agreed)
