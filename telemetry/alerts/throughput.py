"""Low throughput: a rank moved its bytes in an I/O phase slower than a floor, in one save or
load call (a fast first call of a path and step no longer averages out a slow retry)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from telemetry.alerts.base import Alert, Context, Window, call_of, call_subject, call_text, group_rows
from telemetry.schema import THROUGHPUT_PHASES

MB = 1_000_000


def io_seconds(row: dict[str, Any]) -> float:
    """Wall seconds a rank spent in an I/O phase: its spans' summed time, but no more than its
    first start to last end, since a rank writes its files (and reads its ranges) on several
    threads at once and the sum would count overlapping time twice."""
    busy = float(row.get("duration_s") or 0.0)
    start, end = row.get("start_ts"), row.get("end_ts")
    if start is None or end is None:
        return busy
    return min(busy, max(0.0, float(end) - float(start)))


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
                and (r.get("bytes") or 0) >= self.min_bytes and io_seconds(r) > 0]
        rows = [{**r, "call": call_of(r)} for r in rows]
        alerts = []
        for (job, run, ckpt, op, step, call, phase), group in group_rows(
            rows, "job", "run", "checkpoint", "op", "step", "call", "phase"
        ).items():
            rates = ((r["bytes"] / io_seconds(r) / MB, r["rank"], r) for r in group)
            slow = sorted((t for t in rates if t[0] < self.min_mb_s), key=lambda t: t[0])
            if not slow:
                continue
            rate, rank, row = slow[0]
            ranks = [r for _, r, _ in slow]
            alerts.append(Alert(
                rule=self.name, severity=self.severity, job=job, run=run, checkpoint=ckpt or "",
                checkpoint_op=op or "", phase=phase, rank=rank, step=step, call=call, value=rate,
                threshold=self.min_mb_s, subject=call_subject(step, call, phase),
                message=(f"{phase} of {op} {ckpt}{call_text(call)} ran at {rate:.1f} MB/s on rank {rank} "
                         f"(floor {self.min_mb_s:g} MB/s); ranks below the floor: {ranks}"),
                details={"ranks": {str(r): round(v, 3) for v, r, _ in slow}},
            ))
        return alerts
