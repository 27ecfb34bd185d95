"""Slow rank: a rank whose time in a phase of one checkpoint stands out from the other ranks.

Robust statistics, so one slow rank cannot hide itself by dragging the mean: the modified
z-score 0.6745 * (x - median) / MAD, with the MAD floored (absolute and relative to the
median) so identical ranks do not divide by zero. A rank must also be ``min_ratio`` times
the median and ``min_excess_s`` slower, so jitter on short phases stays quiet. One alert per
(checkpoint, rank) names the phase with the largest excess; the others are in ``details``.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import ClassVar

from telemetry.alerts.base import Alert, Context, Window, group_rows
from telemetry.schema import SCOPE_SPANS


@dataclass(frozen=True)
class SlowRank:
    z: float = 3.5
    min_ratio: float = 1.5
    min_excess_s: float = 1.0
    mad_floor_s: float = 0.01
    mad_floor_frac: float = 0.05
    min_ranks: int = 3
    # Span names starting with these are phases; whole-call spans (save, load) are not,
    # since every rank's call lasts as long as the slowest rank's.
    phase_prefixes: tuple[str, ...] = ("save.", "load.")
    severity: str = "warning"
    name: ClassVar[str] = "slow_rank"

    def evaluate(self, window: Window, *, context: Context) -> list[Alert]:
        rows = [r for r in window.rows if r.get("checkpoint") and r.get("phase") not in SCOPE_SPANS
                and str(r.get("phase", "")).startswith(self.phase_prefixes)]
        flagged: dict[tuple, list[dict]] = {}
        for (job, run, ckpt, op, step, phase), group in group_rows(
            rows, "job", "run", "checkpoint", "op", "step", "phase"
        ).items():
            per_rank = {r["rank"]: float(r["duration_s"]) for r in group if r.get("rank") is not None}
            if len(per_rank) < self.min_ranks:
                continue
            values = list(per_rank.values())
            median = statistics.median(values)
            mad = statistics.median(abs(v - median) for v in values)
            scale = max(mad, self.mad_floor_s, self.mad_floor_frac * median)
            for rank, value in per_rank.items():
                score = 0.6745 * (value - median) / scale
                if (score > self.z and value >= self.min_ratio * median
                        and value - median >= self.min_excess_s):
                    flagged.setdefault((job, run, ckpt, op, step, rank), []).append(
                        {"phase": phase, "duration_s": value, "median_s": median, "z": score,
                         "ranks": len(per_rank), "step": step})
        alerts = []
        for (job, run, ckpt, op, step, rank), phases in sorted(flagged.items(), key=lambda kv: str(kv[0])):
            worst = max(phases, key=lambda p: p["duration_s"] - p["median_s"])
            ratio = worst["duration_s"] / worst["median_s"] if worst["median_s"] > 0 else float("inf")
            alerts.append(Alert(
                rule=self.name, severity=self.severity, job=job, run=run, checkpoint=ckpt,
                checkpoint_op=op, phase=worst["phase"], rank=rank, step=worst["step"],
                value=worst["z"], threshold=self.z, subject=(step, rank),
                message=(f"rank {rank} is slow in {worst['phase']} of {op} {ckpt}: "
                         f"{worst['duration_s']:.3f} s vs median {worst['median_s']:.3f} s over "
                         f"{worst['ranks']} ranks ({ratio:.1f}x, modified z {worst['z']:.1f})"),
                details={"phases": phases},
            ))
        return alerts
