"""Uncommitted checkpoints: a save whose first span is older than the deadline and that has
no successful commit span yet (stuck, crashed, or failed)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from telemetry.alerts.base import Alert, Context, Window, group_rows
from telemetry.schema import COMMIT_SPAN


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
            if committed:
                continue
            started = min(float(r["start_ts"]) for r in group)
            age = context.now - started
            if age < self.deadline_s:
                continue
            alerts.append(Alert(
                rule=self.name, severity=self.severity, job=job, run=run, checkpoint=ckpt,
                checkpoint_op="save", phase=COMMIT_SPAN, rank=None, step=step, value=age,
                threshold=self.deadline_s, subject=(step,),
                message=(f"checkpoint {ckpt} (step {step}) started {age:.0f} s ago and is not committed "
                         f"(deadline {self.deadline_s:g} s)"),
                details={"ranks_seen": sorted({r["rank"] for r in group})},
            ))
        return alerts
