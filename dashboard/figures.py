"""Figures: pure functions from a DataFrame (shaped by ``dashboard.frames``) to a plotly Figure.

No I/O and no Streamlit here, so each figure is unit-tested on a hand-made frame. Figures
that can hold thousands of points use one trace per series and WebGL-free primitives that
plotly serialises compactly (heatmap z grids, bars with ``base``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from dashboard import frames

_TEMPLATE = "plotly_white"
# Above the plot: below it, a horizontal legend collides with the x-axis title and ticks.
_LEGEND_TOP = {"legend": {"orientation": "h", "x": 0, "y": 1.0, "xanchor": "left", "yanchor": "bottom"},
               "margin": {"t": 100}}
_PALETTE = ("#4C78A8", "#F58518", "#54A24B", "#E45756", "#72B7B2", "#EECA3B", "#B279A2", "#FF9DA6",
            "#9D755D", "#BAB0AC", "#1F77B4", "#2CA02C")


def _empty(title: str, note: str) -> go.Figure:
    fig = go.Figure()
    fig.add_annotation(text=note, showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper")
    fig.update_layout(title=title, template=_TEMPLATE, xaxis_visible=False, yaxis_visible=False)
    return fig


def colour_map(names: Sequence[str]) -> dict[str, str]:
    """A stable colour per name (phases keep their colour across figures)."""
    return {name: _PALETTE[i % len(_PALETTE)] for i, name in enumerate(sorted(set(names)))}


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def topology_heatmap(cells: pd.DataFrame, *, title: str, colorbar: str,
                     flagged: Sequence[int] = (), reverse: bool = False) -> go.Figure:
    """One TP x DP heatmap per PP stage (paper Fig. 11): one cell per rank, coloured by ``value``.

    ``cells`` has rank, host, dp, tp, pp, value, breakdown (``frames.heatmap_cells`` after
    ``frames.layout_coords``; coordinates that would not fit a grid of about the ranks' size
    are laid out in rank order here too). Ranks in ``flagged`` get an X marker. ``reverse`` makes high
    values the good end of the scale (throughput).
    """
    if cells.empty:
        return _empty(title, "no ranks reported this checkpoint")
    if not frames.grid_fits(cells):
        cells = frames.by_position(cells)  # never allocate a grid far larger than the ranks
    stages = sorted(cells["pp"].unique())
    cols = min(len(stages), 4)
    rows = math.ceil(len(stages) / cols)
    fig = make_subplots(rows=rows, cols=cols, subplot_titles=[f"PP stage {s}" for s in stages],
                        horizontal_spacing=0.06,
                        # plotly refuses a spacing over 1 / (rows - 1)
                        vertical_spacing=min(0.12, 0.5 / (rows - 1)) if rows > 1 else 0.08)
    values = cells["value"].astype(float)
    finite = values[np.isfinite(values)]
    zmin, zmax = (float(finite.min()), float(finite.max())) if len(finite) else (0.0, 1.0)
    dp_n, tp_n = int(cells["dp"].max()) + 1, int(cells["tp"].max()) + 1
    flagged_set = {int(r) for r in flagged}
    for i, stage in enumerate(stages):
        r, c = i // cols + 1, i % cols + 1
        part = cells[cells["pp"] == stage]
        z = np.full((tp_n, dp_n), np.nan)
        text = np.full((tp_n, dp_n), "", dtype=object)
        tp_idx, dp_idx = part["tp"].to_numpy(int), part["dp"].to_numpy(int)
        z[tp_idx, dp_idx] = part["value"].to_numpy(float)
        text[tp_idx, dp_idx] = [
            f"<b>rank {rk}</b> · {host}<br>pp {stage} · tp {tp} · dp {dp}<br>value {v:.4g}"
            f"{' · <b>flagged slow</b>' if int(rk) in flagged_set else ''}<br>{bd}"
            for rk, host, tp, dp, v, bd in zip(part["rank"], part["host"], part["tp"], part["dp"],
                                               part["value"], part["breakdown"])
        ]
        fig.add_trace(go.Heatmap(
            z=z, x=list(range(dp_n)), y=list(range(tp_n)), text=text, hoverinfo="text",
            hovertemplate="%{text}<extra></extra>", zmin=zmin, zmax=zmax, coloraxis="coloraxis",
            xgap=1, ygap=1, name=f"pp {stage}",
        ), row=r, col=c)
        slow = part[part["rank"].astype(int).isin(flagged_set)]
        if not slow.empty:
            fig.add_trace(go.Scatter(
                x=slow["dp"], y=slow["tp"], mode="markers", name="slow rank (alert)",
                marker={"symbol": "x-thin-open", "size": 14, "color": "black", "line": {"width": 3}},
                hoverinfo="skip", showlegend=i == 0,
            ), row=r, col=c)
        # A tick per rank while they fit; beyond that plotly picks fewer.
        fig.update_xaxes(title_text="DP rank", row=r, col=c, dtick=1 if dp_n * cols <= 32 else None)
        fig.update_yaxes(title_text="TP rank" if c == 1 else None, row=r, col=c, autorange="reversed",
                         dtick=1 if tp_n * rows <= 32 else None)
    fig.update_layout(
        title=title, template=_TEMPLATE, height=max(360, 300 * rows),
        coloraxis={"colorscale": "Viridis" if reverse else "YlOrRd", "colorbar": {"title": colorbar}},
        legend={"orientation": "h", "y": -0.15}, margin={"t": 80},
    )
    return fig


def timeline(bars: pd.DataFrame, *, title: str) -> go.Figure:
    """Gantt of phases: one horizontal bar per (rank, phase), one trace per phase."""
    if bars.empty:
        return _empty(title, "no phase spans for these ranks")
    colours = colour_map(bars["phase"])
    fig = go.Figure()
    labels = bars["rank"].map(lambda r: f"rank {int(r)}")
    for phase in sorted(bars["phase"].unique(), key=lambda p: bars.loc[bars["phase"] == p, "start_s"].min()):
        part = bars[bars["phase"] == phase]
        fig.add_trace(go.Bar(
            y=labels[part.index], x=(part["end_s"] - part["start_s"]).clip(lower=1e-4), base=part["start_s"],
            orientation="h", name=phase, marker_color=colours[phase],
            customdata=np.stack([part["duration_s"], part["spans"], part["bytes"]], axis=1),
            hovertemplate=(f"<b>{phase}</b> %{{y}}<br>%{{base:.3f}} s → %{{x:.3f}} s wall"
                           "<br>busy %{customdata[0]:.3f} s in %{customdata[1]} span(s)"
                           "<br>%{customdata[2]:,} bytes<extra></extra>"),
        ))
    ranks = sorted(bars["rank"].unique())
    fig.update_layout(
        title=title, template=_TEMPLATE, barmode="overlay", xaxis_title="seconds since the first span",
        height=min(4000, max(320, 120 + 22 * len(ranks))), **_LEGEND_TOP,
        yaxis={"categoryorder": "array", "categoryarray": [f"rank {int(r)}" for r in reversed(ranks)]},
    )
    return fig


def rank_breakdown(breakdown: pd.DataFrame, *, rank: int, title: str) -> go.Figure:
    """One rank's busy seconds per phase beside the median rank (paper Fig. 12)."""
    if breakdown.empty:
        return _empty(title, f"rank {rank} reported no phases here")
    fig = go.Figure([
        go.Bar(x=breakdown["phase"], y=breakdown["duration_s"], name=f"rank {rank}",
               marker_color=_PALETTE[0], text=breakdown["duration_s"].map("{:.3f}".format),
               textposition="outside"),
        go.Bar(x=breakdown["phase"], y=breakdown["median_s"], name="median over ranks",
               marker_color=_PALETTE[9]),
    ])
    fig.update_layout(title=title, template=_TEMPLATE, barmode="group", yaxis_title="busy seconds",
                      **_LEGEND_TOP)
    return fig


def slot_waits(waits: pd.DataFrame, *, title: str) -> go.Figure:
    """Seconds each rank's files waited for a host write slot (``queries.slot_waits``)."""
    if waits.empty or not (waits["wait_s"] > 0).any():
        return _empty(title, "no file of this save waited for a host write slot")
    labels = waits["rank"].map(lambda r: f"rank {int(r)}")
    fig = go.Figure(go.Bar(
        x=labels, y=waits["wait_s"], marker_color=_PALETTE[1],
        customdata=np.stack([waits["waited"], waits["commits"]], axis=1),
        hovertemplate="%{x}: waited %{y:.3f} s<br>%{customdata[0]} of %{customdata[1]} files waited"
                      "<extra></extra>",
    ))
    fig.update_layout(title=title, template=_TEMPLATE, yaxis_title="seconds waiting for a slot",
                      xaxis={"type": "category"})
    return fig


def step_durations(ckpts: pd.DataFrame, *, title: str) -> go.Figure:
    """Per step: blocking (slowest rank's call) and end-to-end seconds of saves and loads."""
    data = ckpts.dropna(subset=["step"]).sort_values("step")
    if data.empty:
        return _empty(title, "no checkpoints with a step yet")
    fig = go.Figure()
    for op, dash in (("save", "solid"), ("load", "dot")):
        part = data[data["op"] == op]
        if part.empty:
            continue
        for col, label in (("blocking_s", "blocking"), ("e2e_s", "end to end")):
            fig.add_trace(go.Scatter(x=part["step"], y=part[col], mode="lines+markers",
                                     name=f"{op} {label}", line={"dash": dash}))
    fig.update_layout(title=title, template=_TEMPLATE, xaxis_title="step", yaxis_title="seconds",
                      **_LEGEND_TOP)
    return fig


def phase_trends(steps: pd.DataFrame, *, title: str) -> go.Figure:
    """Per step and phase: the slowest rank (solid) and the median rank (dotted)."""
    if steps.empty:
        return _empty(title, "no phase spans with a step yet")
    colours = colour_map(steps["phase"])
    fig = go.Figure()
    for phase, part in steps.sort_values("step").groupby("phase"):
        fig.add_trace(go.Scatter(x=part["step"], y=part["max_s"], mode="lines+markers", name=phase,
                                 legendgroup=phase, line={"color": colours[phase]}))
        fig.add_trace(go.Scatter(x=part["step"], y=part["median_s"], mode="lines", name=f"{phase} median",
                                 legendgroup=phase, showlegend=False,
                                 line={"color": colours[phase], "dash": "dot"}))
    fig.update_layout(title=title, template=_TEMPLATE, xaxis_title="step",
                      yaxis_title="busy seconds (solid: slowest rank, dotted: median)")
    return fig


def io_latency(latency: pd.DataFrame, *, title: str) -> go.Figure:
    """Latency distribution per (backend, op) as box plots drawn from stored quantiles
    (whiskers: min and p99; the max is a separate marker)."""
    if latency.empty:
        return _empty(title, "no storage operations recorded")
    fig = go.Figure()
    for backend, part in latency.groupby("backend"):
        names = part["op"].tolist()
        fig.add_trace(go.Box(
            name=backend or "(unknown)", x=names, q1=part["p25_s"], median=part["p50_s"], q3=part["p75_s"],
            lowerfence=part["min_s"], upperfence=part["p99_s"], boxpoints=False,
        ))
        fig.add_trace(go.Scatter(x=names, y=part["max_s"], mode="markers", name=f"{backend} max",
                                 marker={"symbol": "diamond-open"}, showlegend=False,
                                 hovertemplate="max %{y:.4f} s<extra></extra>"))
    fig.update_layout(title=title, template=_TEMPLATE, boxmode="group", yaxis_type="log",
                      yaxis_title="seconds (log)", xaxis_title="operation")
    return fig


def io_throughput(io: pd.DataFrame, *, title: str, bucket_s: int) -> go.Figure:
    """Bytes per second over time, one line per (backend, op) that moved bytes."""
    data = io[io["bytes"] > 0]
    if data.empty:
        return _empty(title, "no storage operation moved bytes")
    fig = go.Figure()
    for (backend, op), part in data.groupby(["backend", "op"]):
        fig.add_trace(go.Scatter(
            x=frames.utc_times(part["bucket_ts"]), y=part["bytes_per_s"] / 1e6,
            mode="lines+markers", name=f"{backend} {op}",
        ))
    fig.update_layout(title=title, template=_TEMPLATE, yaxis_title=f"MB/s (per {bucket_s} s bucket)",
                      xaxis_title="time (UTC)", **_LEGEND_TOP)
    return fig


def ettr_curve(whatif: pd.DataFrame, *, current_n: int | None, title: str) -> go.Figure:
    """ETTR against the checkpoint interval, with the measured interval marked."""
    fig = go.Figure(go.Scatter(x=whatif["interval"], y=whatif["ettr"], mode="lines", name="ETTR",
                               hovertemplate="every %{x} steps: ETTR %{y:.3f}<extra></extra>"))
    if current_n is not None:
        row = whatif[whatif["interval"] == current_n]
        if not row.empty:
            fig.add_trace(go.Scatter(x=row["interval"], y=row["ettr"], mode="markers+text",
                                     name="current interval", text=[f"now: {row['ettr'].iloc[0]:.3f}"],
                                     textposition="top center", marker={"size": 12}))
    fig.update_layout(title=title, template=_TEMPLATE, xaxis_title="checkpoint interval N (steps)",
                      yaxis_title="average ETTR", yaxis_range=[0, 1])
    return fig


def tiering_bytes(state: pd.DataFrame, *, title: str) -> go.Figure:
    """Checkpoints and bytes per tier."""
    if state.empty:
        return _empty(title, "no tiering moves recorded")
    per_tier = state.groupby("tier").agg(checkpoints=("checkpoint", "count"), bytes=("bytes_moved", "sum"))
    fig = go.Figure(go.Bar(x=per_tier.index, y=per_tier["checkpoints"],
                           text=[format_bytes(b) + " moved" for b in per_tier["bytes"]],
                           textposition="outside", marker_color=_PALETTE[0]))
    fig.update_layout(title=title, template=_TEMPLATE, xaxis_title="tier", yaxis_title="checkpoints")
    return fig
