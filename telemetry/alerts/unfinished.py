"""Unfinished ranks: the ranks that started a save or load and never ended it, while the
other ranks ended theirs more than ``after_s`` ago (a dead or hung process).

A span is stored when it ends, so a rank still inside its save has no whole-call span yet;
what it did finish says where it was last seen. A save is over for a rank when its ``save``
span ended and, if the save is async (some rank stored a ``save.background`` span), when its
background write ended too. Nothing is raised while no rank has ended (a save in progress
everywhere: ``uncommitted`` covers a save that never ends), nor before ``after_s`` has passed
since the last other rank ended (an async write still running within the limit).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from telemetry.alerts.base import Alert, Context, Window, group_rows

# The spans that end a rank's part of a save or load, in the order they end.
ENDS: dict[str, tuple[str, ...]] = {"save": ("save", "save.background"), "load": ("load",)}


def _unfinished(group: list[dict[str, Any]], ends: tuple[str, ...], now: float,
                after_s: float) -> dict[Any, float]:
    """rank -> seconds since the other ranks ended, for each rank overdue at some end span."""
    ranks = {r["rank"] for r in group if r.get("rank") is not None}
    overdue: dict[Any, float] = {}
    started = ranks
    for name in ends:
        ended = {r["rank"]: float(r["end_ts"]) for r in group if r["phase"] == name}
        if not ended:
            break  # no rank has got this far: still running (or not an async save)
        waited = now - max(ended.values())
        if waited >= after_s:
            for rank in started - set(ended):
                overdue.setdefault(rank, waited)
        started = set(ended)
    return overdue


def _last_seen(group: list[dict[str, Any]], rank: Any) -> tuple[str, float]:
    """The span ``rank`` ended last in this save or load, and when (epoch s)."""
    mine = [r for r in group if r.get("rank") == rank]
    last = max(mine, key=lambda r: float(r.get("end_ts") or 0.0))
    return str(last["phase"]), float(last.get("end_ts") or 0.0)


@dataclass(frozen=True)
class UnfinishedRanks:
    after_s: float = 300.0
    severity: str = "error"
    name: ClassVar[str] = "unfinished_ranks"

    def evaluate(self, window: Window, *, context: Context) -> list[Alert]:
        rows = [r for r in window.rows if r.get("op") in ENDS and r.get("checkpoint")]
        alerts = []
        for (job, run, ckpt, op, step), group in group_rows(rows, "job", "run", "checkpoint", "op",
                                                              "step").items():
            overdue = _unfinished(group, ENDS[op], context.now, self.after_s)
            if not overdue:
                continue
            seen = {rank: _last_seen(group, rank) for rank in sorted(overdue)}
            where = "; ".join(f"rank {rank} last ended {phase} {context.now - at:.0f} s ago"
                              for rank, (phase, at) in seen.items())
            first = min(overdue)
            finished = len({r["rank"] for r in group if r.get("rank") is not None} - set(overdue))
            alerts.append(Alert(
                rule=self.name, severity=self.severity, job=job, run=run, checkpoint=ckpt,
                checkpoint_op=op, phase=seen[first][0], rank=first, step=step,
                value=max(overdue.values()), threshold=self.after_s, subject=(step,),
                message=(f"rank(s) {sorted(overdue)} did not finish the {op} of {ckpt} (step {step}) "
                         f"that {finished} other rank(s) finished {min(overdue.values()):.0f} s ago "
                         f"(limit {self.after_s:g} s): {where}; the process may be dead or hung"),
                details={"unfinished": {str(rank): {"last_phase": phase, "last_end_ts": at}
                                        for rank, (phase, at) in seen.items()}},
            ))
        return alerts
