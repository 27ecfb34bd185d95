"""Unfinished ranks: the ranks that started a save or load and never ended it, while the
other ranks ended theirs more than ``after_s`` ago (a dead or hung process).

A span is stored when it ends, so a rank still inside its save has no whole-call span yet;
what it did finish says where it was last seen. A save is over for a rank when its ``save``
span ended and, if the save is async (some rank stored a ``save.background`` span), when its
background write ended too. Nothing is raised while no rank has ended (a save in progress
everywhere: ``uncommitted`` covers a save that never ends), nor before ``after_s`` has passed
since the last other rank ended (an async write still running within the limit).

One path can be saved (or loaded) again at the same step (a retry, an overwrite, a job
restarted from the same checkpoint): the rows say which call each span is in (``call``), and
each call is judged on its own. A rank killed in the first load of a restarted job is named
in that call; counted over the step's calls, it had ended one load and the others two, and
it was named again, "in call 2", once the reload had ended everywhere. Rows of spans with no
call id (earlier releases) merge the step's calls: there ranks are compared by how many calls
they ended (each call ends with one span per rank), and one that ended fewer than the others
is overdue in the newest call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

from telemetry.alerts.base import Alert, Context, Window, call_of, call_subject, call_text, group_rows

# The spans that end a rank's part of a save or load, in the order they end.
ENDS: dict[str, tuple[str, ...]] = {"save": ("save", "save.background"), "load": ("load",)}


def _calls_ended(group: list[dict[str, Any]], name: str) -> dict[Any, int]:
    """rank -> how many calls it ended with a ``name`` span (one span per call)."""
    ended: dict[Any, int] = {}
    for r in group:
        if r["phase"] == name and r.get("rank") is not None:
            ended[r["rank"]] = ended.get(r["rank"], 0) + int(r.get("spans") or 1)
    return ended


def _world_size(group: list[dict[str, Any]], name: str, ended: dict[Any, int], calls: int) -> int | None:
    """The world size of the newest call (of the ranks that ended it), if the rows carry one: a
    job restarted with fewer ranks and saving the same step again has no ranks above it."""
    sizes = [r.get("world_size") for r in group if r["phase"] == name and ended.get(r.get("rank")) == calls]
    known = [int(s) for s in sizes if isinstance(s, int) and s > 0]
    return max(known) if known else None


def _unfinished(group: list[dict[str, Any]], ends: tuple[str, ...], now: float,
                after_s: float) -> dict[Any, float]:
    """rank -> seconds since the other ranks ended, for each rank overdue at some end span."""
    started = {r["rank"] for r in group if r.get("rank") is not None}
    overdue: dict[Any, float] = {}
    counts = [_calls_ended(group, name) for name in ends]
    for earlier, later in zip(counts[-2::-1], counts[:0:-1]):
        # A rank that ended a call's background write ended the call, even if the save span
        # itself ended before the window began.
        for rank, n in later.items():
            earlier[rank] = max(earlier.get(rank, 0), n)
    for name, ended in zip(ends, counts):
        if not ended:
            break  # no rank has got this far: still running (or not an async save)
        calls = max(ended.values())
        # When the ranks that ended the newest call did: the latest end of this span.
        done = [float(r["end_ts"]) for r in group if r["phase"] == name]
        waited = now - max((t for t in done if math.isfinite(t)), default=now)
        if waited >= after_s:
            size = _world_size(group, name, ended, calls)
            for rank in started:
                if ended.get(rank, 0) < calls and (size is None or rank < size):
                    overdue.setdefault(rank, waited)
        started = {rank for rank in started if ended.get(rank, 0) == calls}
    return overdue


def _last_seen(group: list[dict[str, Any]], rank: Any) -> tuple[str, float]:
    """The span ``rank`` ended last in this save or load, and when (epoch s)."""
    mine = [r for r in group if r.get("rank") == rank]
    last = max(mine, key=lambda r: float(r.get("end_ts") or 0.0))
    return str(last["phase"]), float(last.get("end_ts") or 0.0)


_NAMED = 16  # ranks a message names; the alert's details hold every one


@dataclass(frozen=True)
class UnfinishedRanks:
    after_s: float = 300.0
    severity: str = "error"
    name: ClassVar[str] = "unfinished_ranks"

    def evaluate(self, window: Window, *, context: Context) -> list[Alert]:
        rows = [{**r, "call": call_of(r)} for r in window.rows if r.get("op") in ENDS and r.get("checkpoint")]
        alerts = []
        for (job, run, ckpt, op, step, numbered), group in group_rows(rows, "job", "run", "checkpoint", "op",
                                                                        "step", "call").items():
            overdue = _unfinished(group, ENDS[op], context.now, self.after_s)
            if not overdue:
                continue
            seen = {rank: _last_seen(group, rank) for rank in sorted(overdue)}
            # The message names the first few ranks (a webhook may cap its length); all are in details.
            shown = list(seen.items())[:_NAMED]
            where = "; ".join(f"rank {rank} last ended {phase} {context.now - at:.0f} s ago"
                              for rank, (phase, at) in shown)
            if len(seen) > _NAMED:
                where += f"; and {len(seen) - _NAMED} more rank(s)"
            ranks = sorted(overdue)
            named = f"{ranks[:_NAMED]}" + (f" and {len(ranks) - _NAMED} more" if len(ranks) > _NAMED else "")
            first = min(overdue)
            # A later call's hang is a new incident: its own alert id, and the call it is in.
            calls = numbered or max(_calls_ended(group, ENDS[op][0]).values(), default=1)
            subject, call = call_subject(step, calls), call_text(calls)
            finished = len({r["rank"] for r in group if r.get("rank") is not None} - set(overdue))
            alerts.append(Alert(
                rule=self.name, severity=self.severity, job=job, run=run, checkpoint=ckpt,
                checkpoint_op=op, phase=seen[first][0], rank=first, step=step, call=numbered,
                value=max(overdue.values()), threshold=self.after_s, subject=subject,
                message=(f"rank(s) {named} did not finish the {op} of {ckpt} (step {step}{call}) "
                         f"that {finished} other rank(s) finished {min(overdue.values()):.0f} s ago "
                         f"(limit {self.after_s:g} s): {where}; the process may be dead or hung"),
                details={"unfinished": {str(rank): {"last_phase": phase, "last_end_ts": at}
                                        for rank, (phase, at) in seen.items()}},
            ))
        return alerts
