"""Failed and retried operations: any span that ended in an error, or a storage op retried.

One failed save or load is one error alert: the error travels up through the storage op,
the phase, the background scope and the whole call, each of which ends in error, and one
alert per failed span told the same incident about five times. The alert names the
operation nearest the cause (a storage op before a phase, a phase before a whole call) and
lists every failed span by rank in ``details``. Errors outside a save or load (a tiering
move, say) still alert per operation. A save or load is one call: a retry of a failed save at
the same step that fails again is a second alert ("call 2"), not merged into the first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from telemetry.alerts.base import Alert, Context, Window, call_of, call_subject, call_text, group_rows
from telemetry.schema import IO_SPAN_PREFIX, SCOPE_SPANS

CHECKPOINT_OPS = frozenset(SCOPE_SPANS)


def _nearest_the_cause(phase: str) -> int:
    """Sort key: storage ops first, then phases, then scopes (``save.background``) and whole calls."""
    if phase.startswith(IO_SPAN_PREFIX):
        return 0
    if phase in SCOPE_SPANS or phase in ("save.background", "save.finish"):
        return 2
    return 1


@dataclass(frozen=True)
class FailedOps:
    include_retries: bool = True
    min_retries: int = 1
    name: ClassVar[str] = "failed_ops"

    def evaluate(self, window: Window, *, context: Context) -> list[Alert]:
        alerts = []
        rows = [{**r, "call": call_of(r)} for r in window.rows]
        groups = group_rows(rows, "job", "run", "checkpoint", "op", "step", "call", "phase")
        for (job, run, ckpt, op, step, call, phase), group in groups.items():
            retries = {r["rank"]: int(r.get("retries") or 0) for r in group if r.get("retries")}
            where = f"{op} {ckpt}{call_text(call)}" if ckpt else "outside a checkpoint"
            if not (ckpt and op in CHECKPOINT_OPS):
                alerts.extend(self._errors(job, run, ckpt, op, step, call, [phase], group,
                                           ("error", *call_subject(step, call, phase))))
            total_retries = sum(retries.values())
            if self.include_retries and retries and total_retries >= self.min_retries:
                alerts.append(Alert(
                    rule=self.name, severity="warning", job=job, run=run, checkpoint=ckpt or "",
                    checkpoint_op=op or "", phase=phase, rank=min(retries), value=total_retries,
                    step=step, call=call, threshold=self.min_retries,
                    subject=("retry", *call_subject(step, call, phase)),
                    message=f"{total_retries} retried {phase} op(s) in {where} on ranks {sorted(retries)}",
                    details={"retries_by_rank": retries},
                ))
        calls = [r for r in rows if r.get("checkpoint") and r.get("op") in CHECKPOINT_OPS]
        for (job, run, ckpt, op, step, call), group in group_rows(calls, "job", "run", "checkpoint", "op",
                                                                    "step", "call").items():
            ended: dict[str, float] = {}
            for r in group:
                if r.get("errors"):
                    end = float(r.get("end_ts") or 0.0)
                    ended[r["phase"]] = min(ended.get(r["phase"], end), end)
            phases = sorted(ended, key=lambda p: (_nearest_the_cause(p), ended[p], p))
            # The same id however many of its spans have reached the store yet.
            alerts.extend(self._errors(job, run, ckpt, op, step, call, phases, group,
                                       ("error", *call_subject(step, call))))
        return alerts

    def _errors(self, job: str, run: str, ckpt: str | None, op: str | None, step: Any, call: int,
                phases: list[str], group: list[dict[str, Any]], subject: tuple[Any, ...]) -> list[Alert]:
        """One error alert for the failed spans of ``phases`` in ``group`` (none if none failed)."""
        failed = [r for r in group if r.get("errors") and r["phase"] in phases]
        if not failed:
            return []
        errors: dict[Any, int] = {}
        for r in failed:
            errors[r["rank"]] = errors.get(r["rank"], 0) + int(r["errors"])
        first = phases[0]
        sample = next((r.get("sample_error") for r in failed if r["phase"] == first), "")
        where = f"{op} {ckpt} (step {step}{call_text(call)})" if ckpt else "outside a checkpoint"
        what = f"{sum(1 for r in failed if r['phase'] == first and r.get('errors'))} rank(s) failed {first}"
        if len(phases) > 1:
            what += f" (then {', '.join(phases[1:])})"
        by_phase = {p: sorted({r["rank"] for r in failed if r["phase"] == p}) for p in phases}
        return [Alert(
            rule=self.name, severity="error", job=job, run=run, checkpoint=ckpt or "",
            checkpoint_op=op or "", phase=first, rank=min(errors), value=sum(errors.values()),
            step=step, call=call, threshold=0, subject=subject,
            message=f"{what} in {where} on ranks {sorted(errors)}: {sample}",
            details={"errors_by_rank": errors, "failed_ranks_by_phase": by_phase},
        )]
