"""Turn the catalog into decisions: cool, delete, or keep (with the reason), per checkpoint.

    cool    = older than cool_after, not among the newest N of its run's live timeline, not
              untouchable (bytecheckpoint.manage.protection), not already cold
    delete  = retention on (delete_after): what the core's plan_deletions deletes with
              KeepLast(N) | KeepEvery(k) | modified within delete_after, so never a protected
              checkpoint (untouchable, or abandoned by a rollback); wins over cool
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from bytecheckpoint.manage.protection import untouchable_reason
from bytecheckpoint.manage.records import CheckpointInfo
from bytecheckpoint.manage.retention import (
    Context,
    KeepEvery,
    KeepLast,
    Policy,
    any_of,
    kept_by,
    plan_deletions,
)

from .config import TieringConfig
from .policies import ModifiedWithin, OlderThan


@dataclass(frozen=True)
class Decision:
    checkpoint: CheckpointInfo
    action: str  # "cool" | "delete" | "keep"
    reason: str


def _retention(config: TieringConfig, delete_after: float) -> Policy:
    keep: list[Policy] = [ModifiedWithin(delete_after)]
    if config.keep_newest:
        keep.append(KeepLast(config.keep_newest))
    if config.keep_every:
        keep.append(KeepEvery(config.keep_every))
    return any_of(keep)


def _why_kept(c: CheckpointInfo, newest: bool, old: bool) -> str:
    why = untouchable_reason(c)
    if why is not None:
        return why
    if newest:
        return "among the newest of its run"
    if c.state == "cold":
        return "already cold"
    if not old:
        return "younger than cool_after"
    return "kept"


def decide(checkpoints: Sequence[CheckpointInfo], config: TieringConfig, *, now: float) -> list[Decision]:
    ctx = Context(now=now)
    newest = kept_by(checkpoints, KeepLast(config.keep_newest), context=ctx) if config.keep_newest \
        else [False] * len(checkpoints)
    old = OlderThan(config.cool_after).select(checkpoints, context=ctx)
    if config.delete_after is not None:
        retire = plan_deletions(checkpoints, _retention(config, config.delete_after), context=ctx,
                                refuse_empty=False)
        doomed = [d.delete for d in retire]
    else:
        doomed = [False] * len(checkpoints)
    out = []
    for i, c in enumerate(checkpoints):
        if doomed[i]:
            out.append(Decision(c, "delete", "older than delete_after"))
        elif untouchable_reason(c) is None and not newest[i] and old[i] and c.state != "cold":
            out.append(Decision(c, "cool", "older than cool_after" + (" (resuming)" if c.cold_files else "")))
        else:
            out.append(Decision(c, "keep", _why_kept(c, newest[i], old[i])))
    return out
