"""Failed and retried operations: any span that ended in an error, or a storage op retried."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from telemetry.alerts.base import Alert, Context, Window, group_rows


@dataclass(frozen=True)
class FailedOps:
    include_retries: bool = True
    min_retries: int = 1
    name: ClassVar[str] = "failed_ops"

    def evaluate(self, window: Window, *, context: Context) -> list[Alert]:
        alerts = []
        groups = group_rows(window.rows, "job", "run", "checkpoint", "op", "step", "phase")
        for (job, run, ckpt, op, step, phase), group in groups.items():
            errors = {r["rank"]: int(r.get("errors") or 0) for r in group if r.get("errors")}
            retries = {r["rank"]: int(r.get("retries") or 0) for r in group if r.get("retries")}
            where = f"{op} {ckpt}" if ckpt else "outside a checkpoint"
            if errors:
                sample = next((r.get("sample_error") for r in group if r.get("errors")), "")
                alerts.append(Alert(
                    rule=self.name, severity="error", job=job, run=run, checkpoint=ckpt or "",
                    checkpoint_op=op or "", phase=phase, rank=min(errors), value=sum(errors.values()),
                    step=step, threshold=0, subject=("error", step, phase),
                    message=(f"{sum(errors.values())} failed {phase} span(s) in {where} on ranks "
                             f"{sorted(errors)}: {sample}"),
                    details={"errors_by_rank": errors},
                ))
            total_retries = sum(retries.values())
            if self.include_retries and retries and total_retries >= self.min_retries:
                alerts.append(Alert(
                    rule=self.name, severity="warning", job=job, run=run, checkpoint=ckpt or "",
                    checkpoint_op=op or "", phase=phase, rank=min(retries), value=total_retries,
                    step=step, threshold=self.min_retries, subject=("retry", step, phase),
                    message=f"{total_retries} retried {phase} op(s) in {where} on ranks {sorted(retries)}",
                    details={"retries_by_rank": retries},
                ))
        return alerts
