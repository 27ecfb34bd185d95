"""Turn the catalog into decisions: cool, delete, or keep (with the reason), per checkpoint.

    cool    = older than cool_after, not among the newest N of its run, not untouchable,
              not already cold
    delete  = retention on (delete_after), older than it, not among the newest N, not a
              multiple of keep_every, not untouchable; wins over cool
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from bytecheckpoint.manage.catalog import CheckpointInfo, untouchable_reason

from .config import TieringConfig
from .policies import AllOf, Context, EveryKSteps, FullyCold, NewestPerRun, Not, OlderThan, Untouchable


@dataclass(frozen=True)
class Decision:
    checkpoint: CheckpointInfo
    action: str  # "cool" | "delete" | "keep"
    reason: str


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
    newest = NewestPerRun(config.keep_newest).select(checkpoints, context=ctx)
    old = OlderThan(config.cool_after).select(checkpoints, context=ctx)
    movable = AllOf((Not(Untouchable()), Not(NewestPerRun(config.keep_newest))))
    cool = AllOf((movable, OlderThan(config.cool_after), Not(FullyCold()))).select(checkpoints, context=ctx)
    if config.delete_after is not None:
        delete = AllOf((movable, OlderThan(config.delete_after), Not(EveryKSteps(config.keep_every))))
        doomed = delete.select(checkpoints, context=ctx)
    else:
        doomed = [False] * len(checkpoints)
    out = []
    for i, c in enumerate(checkpoints):
        if doomed[i]:
            out.append(Decision(c, "delete", "older than delete_after"))
        elif cool[i]:
            out.append(Decision(c, "cool", "older than cool_after" + (" (resuming)" if c.cold_files else "")))
        else:
            out.append(Decision(c, "keep", _why_kept(c, newest[i], old[i])))
    return out
