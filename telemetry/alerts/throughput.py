"""Low throughput: a rank moved its bytes in an I/O phase slower than a floor."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from telemetry.alerts.base import Alert, Context, Window, group_rows
from telemetry.schema import THROUGHPUT_PHASES

MB = 1_000_000


@dataclass(frozen=True)
class LowThroughput:
    min_mb_s: float = 50.0
    # Small transfers are latency-bound; their bytes/s says little about the storage.
    min_bytes: int = 64 * 1024 * 1024
    phases: tuple[str, ...] = THROUGHPUT_PHASES
    severity: str = "warning"
    name: ClassVar[str] = "low_throughput"

    def evaluate(self, window: Window, *, context: Context) -> list[Alert]:
        rows = [r for r in window.rows if r.get("phase") in self.phases
                and (r.get("bytes") or 0) >= self.min_bytes and (r.get("duration_s") or 0) > 0]
        alerts = []
        for (job, run, ckpt, op, phase), group in group_rows(
            rows, "job", "run", "checkpoint", "op", "phase"
        ).items():
            slow = sorted(((r["bytes"] / r["duration_s"] / MB, r["rank"], r) for r in group
                           if r["bytes"] / r["duration_s"] / MB < self.min_mb_s), key=lambda t: t[0])
            if not slow:
                continue
            rate, rank, row = slow[0]
            ranks = [r for _, r, _ in slow]
            alerts.append(Alert(
                rule=self.name, severity=self.severity, job=job, run=run, checkpoint=ckpt or "",
                checkpoint_op=op or "", phase=phase, rank=rank, step=row.get("step"), value=rate,
                threshold=self.min_mb_s, subject=(phase,),
                message=(f"{phase} of {op} {ckpt} ran at {rate:.1f} MB/s on rank {rank} (floor "
                         f"{self.min_mb_s:g} MB/s); ranks below the floor: {ranks}"),
                details={"ranks": {str(r): round(v, 3) for v, r, _ in slow}},
            ))
        return alerts
