"""Average effective training time ratio (ETTR), as in the ByteCheckpoint paper's appendix.

A failure is assumed to land uniformly within a checkpoint interval of N iterations. At best
it lands just after a checkpoint's end-to-end save finished, at worst just before, so on
average it wastes half of (N·T_iter + T_save), plus the time to load the last checkpoint:

    T_wasted = (N·T_iter + T_save) / 2 + T_load
    ETTR     = N·T_iter / (N·T_iter + T_wasted)
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd


@dataclass(frozen=True, kw_only=True)
class GoodputInputs:
    iteration_s: float  # T_iter
    interval: int  # N, steps between checkpoints
    save_s: float  # T_save, end-to-end
    load_s: float  # T_load

    def __post_init__(self) -> None:
        if self.iteration_s <= 0 or self.interval <= 0:
            raise ValueError("iteration time and checkpoint interval must be positive")
        if self.save_s < 0 or self.load_s < 0:
            raise ValueError("save and load times cannot be negative")


def wasted_s(g: GoodputInputs) -> float:
    return (g.interval * g.iteration_s + g.save_s) / 2 + g.load_s


def ettr(g: GoodputInputs) -> float:
    useful = g.interval * g.iteration_s
    return useful / (useful + wasted_s(g))


def what_if(g: GoodputInputs, intervals: range | list[int]) -> pd.DataFrame:
    """ETTR and wasted seconds for each interval, the other inputs unchanged."""
    rows = []
    for n in intervals:
        other = GoodputInputs(iteration_s=g.iteration_s, interval=int(n), save_s=g.save_s, load_s=g.load_s)
        rows.append({"interval": int(n), "ettr": ettr(other), "wasted_s": wasted_s(other)})
    return pd.DataFrame(rows, columns=["interval", "ettr", "wasted_s"])


def measured_interval(steps: pd.Series) -> int | None:
    """The median gap between consecutive saved steps."""
    uniq = pd.Series(sorted(pd.to_numeric(steps, errors="coerce").dropna().unique()))
    gaps = uniq.diff().dropna()
    gaps = gaps[gaps > 0]
    return int(gaps.median()) if not gaps.empty else None


def estimated_iteration_s(saves: pd.DataFrame) -> float | None:
    """Without ``train.step`` spans: wall time between consecutive saves, less the earlier save's
    blocking time, per step in between (median over pairs)."""
    data = saves.dropna(subset=["step"]).sort_values("step")
    if len(data) < 2:
        return None
    steps = data["step"].to_numpy(float)
    starts = data["start_ts"].to_numpy(float)
    blocking = data["blocking_s"].to_numpy(float)
    per_step = [(starts[i + 1] - starts[i] - blocking[i]) / (steps[i + 1] - steps[i])
                for i in range(len(data) - 1) if steps[i + 1] > steps[i]]
    per_step = [v for v in per_step if v > 0]
    return float(pd.Series(per_step).median()) if per_step else None
