"""Slow rank: a rank whose time in a phase of one checkpoint stands out from the other ranks.

Robust statistics, so one slow rank cannot hide itself by dragging the mean: the modified
z-score 0.6745 * (x - median) / MAD, with the MAD floored (absolute and relative to the
median) so identical ranks do not divide by zero. A rank must also be ``min_ratio`` times
the median and ``min_excess_s`` slower, so jitter on short phases stays quiet.

A group of fewer than ``small_group`` ranks has too few values for that: with two ranks the
median lies halfway between them and the MAD is half their gap, so one rank 10x slower than
the other scored 0.67 and was never flagged. There a rank is also compared with the median
of the *other* ranks: ``peer_ratio`` times it and ``min_excess_s`` more is slow, if the
phase also ended ``min_excess_s`` later than theirs did. (A rank waiting in a collective for
a slow peer spends long in that phase too, but ends it when the peer does.)

One alert per (checkpoint, step, call, rank) names the phase with the largest excess; the
others are in ``details``. Ranks are compared within one call: a path saved twice at one step
(a retry, an overwrite) summed each rank's two calls, so a rank slow in the first call and
another slow in the second had equal sums and neither was flagged.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, ClassVar

from telemetry.alerts.base import Alert, Context, Window, call_of, call_subject, call_text, group_rows
from telemetry.schema import SCOPE_SPANS


@dataclass(frozen=True)
class SlowRank:
    z: float = 3.5
    min_ratio: float = 1.5
    min_excess_s: float = 1.0
    mad_floor_s: float = 0.01
    mad_floor_frac: float = 0.05
    min_ranks: int = 2
    # Groups smaller than this also use the peer rule (see the module docs).
    small_group: int = 4
    peer_ratio: float = 3.0
    # Span names starting with these are phases; whole-call spans (save, load) are not,
    # since every rank's call lasts as long as the slowest rank's.
    phase_prefixes: tuple[str, ...] = ("save.", "load.")
    severity: str = "warning"
    name: ClassVar[str] = "slow_rank"

    def evaluate(self, window: Window, *, context: Context) -> list[Alert]:
        rows = [r for r in window.rows if r.get("checkpoint") and r.get("phase") not in SCOPE_SPANS
                and str(r.get("phase", "")).startswith(self.phase_prefixes)]
        rows = [{**r, "call": call_of(r)} for r in rows]
        flagged: dict[tuple, list[dict]] = {}
        for (job, run, ckpt, op, step, call, phase), group in group_rows(
            rows, "job", "run", "checkpoint", "op", "step", "call", "phase"
        ).items():
            by_rank = {r["rank"]: r for r in group if r.get("rank") is not None}
            per_rank = {rank: float(r["duration_s"]) for rank, r in by_rank.items()}
            if len(per_rank) < max(2, self.min_ranks):
                continue
            for rank, found in self._slow(per_rank, by_rank).items():
                flagged.setdefault((job, run, ckpt, op, step, call, rank), []).append(
                    {"phase": phase, "ranks": len(per_rank), "step": step, **found})
        alerts = []
        for key, phases in sorted(flagged.items(), key=lambda kv: str(kv[0])):
            alerts.append(self._alert(*key, phases))
        return alerts

    def _slow(self, per_rank: dict[Any, float], rows: dict[Any, dict[str, Any]]) -> dict[Any, dict[str, Any]]:
        """rank -> what makes it slow in one phase, for the ranks either rule flags."""
        values = list(per_rank.values())
        median = statistics.median(values)
        mad = statistics.median(abs(v - median) for v in values)
        scale = max(mad, self.mad_floor_s, self.mad_floor_frac * median)
        found: dict[Any, dict[str, Any]] = {}
        for rank, value in per_rank.items():
            score = 0.6745 * (value - median) / scale
            if (len(values) >= 3 and score > self.z and value >= self.min_ratio * median
                    and value - median >= self.min_excess_s):
                found[rank] = {"duration_s": value, "median_s": median, "z": score, "by": "median"}
            elif len(values) < self.small_group:
                peers = statistics.median(v for r, v in per_rank.items() if r != rank)
                if (value >= self.peer_ratio * peers and value - peers >= self.min_excess_s
                        and self._ends_late(rank, rows)):
                    found[rank] = {"duration_s": value, "median_s": peers, "z": score, "by": "peers"}
        return found

    def _ends_late(self, rank: Any, rows: dict[Any, dict[str, Any]]) -> bool:
        """Whether ``rank`` ended the phase ``min_excess_s`` after the other ranks' median end
        (True when the rows carry no end times)."""
        ends = {r: row.get("end_ts") for r, row in rows.items()}
        if any(end is None for end in ends.values()):
            return True
        peers = statistics.median(float(e) for r, e in ends.items() if r != rank)
        return float(ends[rank]) - peers >= self.min_excess_s

    def _alert(self, job: str, run: str, ckpt: str, op: str, step: Any, call: int, rank: Any,
               phases: list[dict[str, Any]]) -> Alert:
        worst = max(phases, key=lambda p: p["duration_s"] - p["median_s"])
        ratio = worst["duration_s"] / worst["median_s"] if worst["median_s"] > 0 else float("inf")
        if worst["by"] == "peers":
            against = (f"the other ranks' median {worst['median_s']:.3f} s ({worst['ranks']} ranks, "
                       f"{ratio:.1f}x)")
            value, threshold = ratio, self.peer_ratio
        else:
            against = (f"median {worst['median_s']:.3f} s over {worst['ranks']} ranks ({ratio:.1f}x, "
                       f"modified z {worst['z']:.1f})")
            value, threshold = worst["z"], self.z
        return Alert(
            rule=self.name, severity=self.severity, job=job, run=run, checkpoint=ckpt,
            checkpoint_op=op, phase=worst["phase"], rank=rank, step=worst["step"], call=call,
            value=value, threshold=threshold, subject=call_subject(step, call, rank),
            message=(f"rank {rank} is slow in {worst['phase']} of {op} {ckpt}{call_text(call)}: "
                     f"{worst['duration_s']:.3f} s vs {against}"),
            details={"phases": phases},
        )
