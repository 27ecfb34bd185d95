"""Pure reshaping of query results into what one figure plots (DataFrame in, DataFrame out)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd

from telemetry.schema import SCOPE_SPANS

WHOLE_CALL = "whole call"  # the save / load span itself: what the training loop waits for
METRICS = ("duration", "throughput")


def utc_times(seconds: Any) -> pd.Series:
    """Seconds since the epoch as UTC times, kept to the microsecond.

    Never raises: the store holds years 1900-2299 and nanosecond pandas times end in 2262,
    so the times are microsecond ones; a value that is not a finite number, or is beyond
    even those, becomes NaT (shown blank).
    """
    series = seconds if isinstance(seconds, pd.Series) else pd.Series(seconds)
    number = pd.to_numeric(series, errors="coerce").astype(float)
    micros = (number * 1e6).round()
    micros = micros.where(np.isfinite(micros) & (micros.abs() < 2.0**62))
    return pd.to_datetime(micros.astype("Int64"), unit="us", utc=True, errors="coerce")


MAX_STAGES = 64  # PP stages drawn as separate grids; beyond that the ranks share one grid


def grid_cells(coords: pd.DataFrame) -> int:
    """Cells the heatmap allocates for ``coords`` (dp, tp, pp): stages x TP x DP."""
    if coords.empty:
        return 0
    return int(coords["pp"].nunique()) * (int(coords["tp"].max()) + 1) * (int(coords["dp"].max()) + 1)


def grid_fits(coords: pd.DataFrame) -> bool:
    """Whether ``coords`` can be drawn on their own grid: no negative coordinate, at most
    ``MAX_STAGES`` stages, and not far more cells than ranks (at most 4 per rank, plus 64)."""
    if coords.empty:
        return True
    if (coords[["dp", "tp", "pp"]] < 0).any(axis=None) or coords["pp"].nunique() > MAX_STAGES:
        return False
    # Python ints: stages x TP x DP of Int32 coordinates overflows int64.
    return grid_cells(coords) <= 4 * len(coords) + 64


def by_position(per_rank: pd.DataFrame) -> pd.DataFrame:
    """The ranks on one near-square grid in rank order (by position, not by rank number, so a
    huge rank number does not make a huge grid)."""
    out = per_rank.sort_values("rank", kind="stable").reset_index(drop=True)
    width = max(1, math.ceil(math.sqrt(len(out))))
    position = pd.Series(range(len(out)), index=out.index)
    out["pp"], out["tp"], out["dp"] = 0, position // width, position % width
    return out


def layout_coords(per_rank: pd.DataFrame) -> tuple[pd.DataFrame, str]:
    """Fill dp/tp/pp for the heatmap grid; returns (frame, why it is laid out in rank order).

    Missing coordinates count as 0. The reason is "" when the ranks' own coordinates are
    used. They are not (the ranks go on a near-square grid in rank order instead) when two
    ranks still share a cell (a job that never set its topology), or when the coordinates
    cannot make a grid: negative, or a grid far larger than the ranks (``grid_fits``).
    """
    out = per_rank.copy()
    for col in ("dp", "tp", "pp"):
        out[col] = pd.to_numeric(out[col], errors="coerce").fillna(0).astype("int64")
    if not grid_fits(out):
        return by_position(out), ("the ranks' topology coordinates are negative or would make a grid "
                                  "far larger than the number of ranks")
    if out.duplicated(["pp", "tp", "dp"]).any():
        return by_position(out), "these ranks share topology coordinates (or reported none)"
    return out, ""


def phase_options(phases: pd.DataFrame) -> list[str]:
    """Choices for the heatmap's colour: the whole call first, then the phases in the data."""
    names = sorted(p for p in phases["phase"].unique() if p not in SCOPE_SPANS)
    return [WHOLE_CALL, *names]


def heatmap_cells(phases: pd.DataFrame, op: str, phase: str, metric: str) -> pd.DataFrame:
    """One row per rank: rank, host, dp, tp, pp, value (seconds, or bytes/s) and a hover text
    with the rank's phase breakdown.

    ``phases`` is ``queries.rank_phases``; ``phase`` is ``WHOLE_CALL`` or a phase name.
    """
    if metric not in METRICS:
        raise ValueError(f"metric must be one of {METRICS}, not {metric!r}")
    name = op if phase == WHOLE_CALL else phase
    if phases.empty:
        return pd.DataFrame(columns=["rank", "host", "dp", "tp", "pp", "value", "breakdown"])
    ranks = phases.groupby("rank", as_index=False).agg(
        host=("host", "first"), dp=("dp", "first"), tp=("tp", "first"), pp=("pp", "first"))
    chosen = phases[phases["phase"] == name].set_index("rank")
    if metric == "duration":
        value = chosen["duration_s"]
    else:
        # Wall time, not summed busy time: a rank's files are written on several threads at once.
        seconds = chosen["duration_s"].clip(upper=chosen["end_ts"] - chosen["start_ts"])
        value = (chosen["bytes"] / seconds.where(seconds > 0)).astype(float)
    ranks["value"] = ranks["rank"].map(value).astype(float)
    ranks["breakdown"] = ranks["rank"].map(_breakdowns(phases)).fillna("")
    return ranks


def _breakdowns(phases: pd.DataFrame) -> pd.Series:
    # The whole call first, then the phases in the order they ran.
    ordered = (phases.assign(_phase=~phases["phase"].isin(SCOPE_SPANS))
               .sort_values(["rank", "_phase", "start_ts"]))
    lines = ordered["phase"] + " " + ordered["duration_s"].map("{:.3f} s".format)
    return lines.groupby(ordered["rank"]).agg("<br>".join)


def timeline_bars(phases: pd.DataFrame, ranks: list[int] | None = None) -> pd.DataFrame:
    """One bar per (rank, phase): start and end in seconds since the checkpoint's first span.

    The whole save / load call is left out (it spans every phase); ``ranks`` picks a subset.
    """
    bars = phases[~phases["phase"].isin(SCOPE_SPANS)]
    if ranks is not None:
        bars = bars[bars["rank"].isin(ranks)]
    if bars.empty:
        return pd.DataFrame(columns=["rank", "phase", "start_s", "end_s", "duration_s", "spans", "bytes"])
    t0 = phases["start_ts"].min()
    out = bars[["rank", "phase", "duration_s", "spans", "bytes"]].copy()
    out["start_s"] = bars["start_ts"] - t0
    out["end_s"] = bars["end_ts"] - t0
    return out.sort_values(["rank", "start_s"]).reset_index(drop=True)


def slowest_ranks(phases: pd.DataFrame, n: int) -> list[int]:
    """The ``n`` stragglers, in rank order: ranks ordered by their largest excess over the
    median rank in any phase. (Ends are no use: every rank waits for the slowest at the
    commit or barrier, so the others' waiting phases grow while the straggler's work does.)"""
    body = phases[~phases["phase"].isin(SCOPE_SPANS)]
    if body.empty:
        return sorted(int(r) for r in phases["rank"].unique()[:n])
    excess = body["duration_s"] - body.groupby("phase")["duration_s"].transform("median")
    score = excess.groupby(body["rank"]).max().sort_values(ascending=False, kind="stable")
    return sorted(int(r) for r in score.index[:n])


def rank_breakdown(phases: pd.DataFrame, rank: int) -> pd.DataFrame:
    """One rank's busy seconds per phase beside the median over all ranks (paper Fig. 12)."""
    body = phases[~phases["phase"].isin(SCOPE_SPANS)]
    median = body.groupby("phase")["duration_s"].median()
    mine = body[body["rank"] == rank].set_index("phase")
    order = mine.sort_values("start_ts").index
    return pd.DataFrame({
        "phase": list(order),
        "duration_s": mine.loc[order, "duration_s"].to_numpy(),
        "median_s": median.reindex(order).to_numpy(),
        "spans": mine.loc[order, "spans"].to_numpy(),
        "bytes": mine.loc[order, "bytes"].to_numpy(),
    })


def checkpoint_label(row: pd.Series) -> str:
    """How a checkpoint is named in selectors: op, step, path, run; a path's second (third, ...)
    call at one step, an overwrite, says which call it is."""
    step = "" if pd.isna(row["step"]) else f" step {int(row['step'])}"
    call = row.get("call", 1)
    again = f" (call {int(call)})" if not pd.isna(call) and int(call) > 1 else ""
    return f"{row['op']}{step}{again} · {row['checkpoint']} · {row['job']}/{row['run']}"


def with_tiers(ckpts: pd.DataFrame, moves: pd.DataFrame) -> pd.DataFrame:
    """Add a ``tier`` column: the destination of the latest successful ``tiering.move``."""
    out = ckpts.copy()
    done = moves[(moves["name"] == "tiering.move") & (moves["outcome"] == "ok")] if not moves.empty else moves
    latest = done.sort_values("ts").groupby("checkpoint")["tier"].last() if not done.empty else {}
    out["tier"] = [latest.get(c, "hot") if op == "save" else ""
                   for c, op in zip(out["checkpoint"], out["op"])]
    return out


def tiering_state(moves: pd.DataFrame) -> pd.DataFrame:
    """Per checkpoint: current tier ("deleted" after retention), bytes moved, moves, failed
    moves, whether a move is open (only with ``tiering.begin`` spans), last event time."""
    cols = ["checkpoint", "tier", "bytes_moved", "moves", "failed", "in_progress", "last_ts"]
    events = moves[moves["name"].isin(["tiering.move", "tiering.begin", "tiering.delete"])] \
        if not moves.empty else moves
    if events.empty:
        return pd.DataFrame(columns=cols)
    rows = []
    for ckpt, group in events.sort_values("ts").groupby("checkpoint"):
        finished = group[group["name"] == "tiering.move"]
        ok = finished[finished["outcome"] == "ok"]
        begins = group[group["name"] == "tiering.begin"]
        deleted = group[(group["name"] == "tiering.delete") & (group["outcome"] == "ok")]
        last_end = finished["ts"].add(finished["duration_s"]).max() if not finished.empty else -1.0
        tier = ok["tier"].iloc[-1] if not ok.empty else "hot"
        if not deleted.empty and deleted["ts"].max() >= (ok["ts"].max() if not ok.empty else -1.0):
            tier = "deleted"
        rows.append({
            "checkpoint": ckpt, "tier": tier, "bytes_moved": int(ok["bytes"].sum()),
            "moves": len(finished), "failed": int((finished["outcome"] != "ok").sum()),
            "in_progress": bool(not begins.empty and begins["ts"].max() > last_end),
            "last_ts": float(group["ts"].max()),
        })
    return pd.DataFrame(rows, columns=cols)


def last_scan(moves: pd.DataFrame) -> pd.Series | None:
    """The newest ``tiering.scan``: hot tier bytes, checkpoints to cool and to delete."""
    scans = moves[moves["name"] == "tiering.scan"] if not moves.empty else moves
    return None if scans.empty else scans.sort_values("ts").iloc[-1]


def io_bucket_s(span_s: float, buckets: int = 120) -> int:
    """A round bucket width giving about ``buckets`` points over ``span_s`` seconds."""
    for width in (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 21600, 86400):
        if span_s / width <= buckets:
            return width
    return 86400
