"""Uncommitted checkpoints: a save whose first span is older than the deadline and that has
no successful commit span yet (stuck, crashed, or failed).

One path can be saved again at the same step (a retry, an overwrite): a commit of the first
call does not cover a later one. A rank whose newest plan ended after its last commit (on its
own clock) is in a call not yet committed, watched from that plan's end.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from telemetry.alerts.base import Alert, Context, Window, group_rows
from telemetry.schema import COMMIT_SPAN

# Spans each rank ends once per save call, before its commit.
CALL_SPANS = ("save.collect", "save.plan")


def _calls(group: list[dict[str, Any]]) -> int:
    """How many calls of this step the ranks started (the most plans one rank ended)."""
    return max((int(r.get("spans") or 1) for r in group if r["phase"] in CALL_SPANS), default=1)


def _newest_uncommitted(group: list[dict[str, Any]]) -> float | None:
    """When the newest call begun after a rank's last commit was last seen, if one was."""
    seen: dict[Any, float] = {}
    committed: dict[Any, float] = {}
    for r in group:
        end = float(r.get("end_ts") or 0.0)
        if r["phase"] in CALL_SPANS:
            seen[r["rank"]] = max(seen.get(r["rank"], end), end)
        elif r["phase"] == COMMIT_SPAN and int(r.get("spans") or 0) > int(r.get("errors") or 0):
            committed[r["rank"]] = end
    pending = [end for rank, end in seen.items() if rank in committed and end > committed[rank]]
    return max(pending, default=None)


@dataclass(frozen=True)
class Uncommitted:
    deadline_s: float = 900.0
    severity: str = "error"
    name: ClassVar[str] = "uncommitted"

    def evaluate(self, window: Window, *, context: Context) -> list[Alert]:
        rows = [r for r in window.rows if r.get("op") == "save" and r.get("checkpoint")]
        alerts = []
        # Per step: a save to a path that an earlier step's save committed to is still watched.
        for (job, run, ckpt, step), group in group_rows(rows, "job", "run", "checkpoint", "step").items():
            committed = any(r["phase"] == COMMIT_SPAN and int(r.get("spans") or 0) > int(r.get("errors") or 0)
                            for r in group)
            started = min(float(r["start_ts"]) for r in group)
            if committed:
                newest = _newest_uncommitted(group)
                if newest is None:
                    continue
                started = newest
            age = context.now - started
            if age < self.deadline_s:
                continue
            calls = _calls(group)
            call = "" if calls <= 1 else f", call {calls}"  # a later call's own incident
            alerts.append(Alert(
                rule=self.name, severity=self.severity, job=job, run=run, checkpoint=ckpt,
                checkpoint_op="save", phase=COMMIT_SPAN, rank=None, step=step, value=age,
                threshold=self.deadline_s, subject=(step,) if calls <= 1 else (step, calls),
                message=(f"checkpoint {ckpt} (step {step}{call}) started {age:.0f} s ago and is not "
                         f"committed (deadline {self.deadline_s:g} s)"),
                details={"ranks_seen": sorted({r["rank"] for r in group})},
            ))
        return alerts
