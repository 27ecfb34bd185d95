"""Uncommitted checkpoints: a save whose first span is older than the deadline and that has
no successful commit span yet (stuck, crashed, or failed).

One path can be saved again at the same step (a retry, an overwrite): each call is judged on
its own (the rows' ``call``). A call is watched while it is the newest of its path and step: one
that committed, or that a later call of the path and step followed within the deadline (a
failed save retried at once), is not reported; the retry is, from its own start, if it does
not commit. (Judged from the step's first span, a retry begun a second ago was reported as
old as the failed call before it.)

Rows of spans with no call id (earlier releases) merge the step's calls: a commit of the first
call does not cover a later one, and a rank whose newest plan ended after its last commit (on
its own clock) is in a call not yet committed, watched from that plan's end.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from telemetry.alerts.base import Alert, Context, Window, call_of, call_subject, call_text, group_rows
from telemetry.schema import COMMIT_SPAN

# Spans each rank ends once per save call, before its commit.
CALL_SPANS = ("save.collect", "save.plan")


def _calls(group: list[dict[str, Any]]) -> int:
    """How many calls of this step the ranks started (the most plans one rank ended)."""
    return max((int(r.get("spans") or 1) for r in group if r["phase"] in CALL_SPANS), default=1)


def _committed(group: list[dict[str, Any]]) -> bool:
    return any(r["phase"] == COMMIT_SPAN and int(r.get("spans") or 0) > int(r.get("errors") or 0)
               for r in group)


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


def _started(group: list[dict[str, Any]]) -> float:
    return min(float(r["start_ts"]) for r in group)


def _merged_age(group: list[dict[str, Any]], now: float) -> tuple[int, float] | None:
    """(calls, seconds) of the newest uncommitted call among rows with no call id, if one."""
    started = _started(group)
    if _committed(group):
        newest = _newest_uncommitted(group)
        if newest is None:
            return None
        started = newest
    return _calls(group), now - started


def _numbered_ages(group: list[dict[str, Any]], now: float) -> list[tuple[int, float, bool]]:
    """(call, seconds it stayed the newest call uncommitted, whether a later call followed) for
    each uncommitted call of rows numbered by call id."""
    by_call = group_rows(group, "call")
    starts = {call: _started(rows) for (call,), rows in by_call.items()}
    order = sorted(starts)
    ages = []
    for i, call in enumerate(order):
        if _committed(by_call[(call,)]):
            continue
        later = order[i + 1:]
        # Watched until the next call began (on the ranks' clocks), or now.
        until = min(now, min(starts[c] for c in later)) if later else now
        ages.append((call, until - starts[call], bool(later)))
    return ages


@dataclass(frozen=True)
class Uncommitted:
    deadline_s: float = 900.0
    severity: str = "error"
    name: ClassVar[str] = "uncommitted"

    def evaluate(self, window: Window, *, context: Context) -> list[Alert]:
        rows = [{**r, "call": call_of(r)} for r in window.rows
                if r.get("op") == "save" and r.get("checkpoint")]
        alerts = []
        # Per step: a save to a path that an earlier step's save committed to is still watched.
        for (job, run, ckpt, step), group in group_rows(rows, "job", "run", "checkpoint", "step").items():
            merged = [r for r in group if r["call"] == 0]
            pending = _merged_age(merged, context.now) if merged else None
            if pending is not None and pending[1] >= self.deadline_s:
                alerts.append(self._alert(job, run, ckpt, step, merged, pending[0], pending[1]))
            numbered = [r for r in group if r["call"] > 0]
            for call, age, followed in _numbered_ages(numbered, context.now):
                if age >= self.deadline_s:
                    mine = [r for r in numbered if r["call"] == call]
                    alerts.append(self._alert(job, run, ckpt, step, mine, call, age, followed, numbered=True))
        return alerts

    def _alert(self, job: str, run: str, ckpt: str, step: Any, rows: list[dict[str, Any]], call: int,
               age: float, followed: bool = False, *, numbered: bool = False) -> Alert:
        what = (f"stayed uncommitted for {age:.0f} s before the next save of the path at that step "
                f"began" if followed else f"started {age:.0f} s ago and is not committed")
        return Alert(
            rule=self.name, severity=self.severity, job=job, run=run, checkpoint=ckpt,
            checkpoint_op="save", phase=COMMIT_SPAN, rank=None, step=step, call=call if numbered else 0,
            value=age, threshold=self.deadline_s, subject=call_subject(step, call),
            message=(f"checkpoint {ckpt} (step {step}{call_text(call)}) {what} "
                     f"(deadline {self.deadline_s:g} s)"),
            details={"ranks_seen": sorted({r["rank"] for r in rows})},
        )
