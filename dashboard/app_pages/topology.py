"""Topology heatmap (paper Fig. 11): one cell per rank on its TP x DP grid, per PP stage."""

from __future__ import annotations

import streamlit as st

from dashboard import figures, frames, ui

st.title("Topology heatmap")
job, run = ui.filters()
ckpt = ui.pick_checkpoint(ui.query("checkpoints", job=job, run=run))
params = ui.checkpoint_params(ckpt)
phases = ui.query("rank_phases", **params)
if phases.empty:
    ui.empty_state("This checkpoint has no per-rank spans (were ranks' contexts set?).")

flagged = ui.query("checkpoint_alerts", **params)
slow_alerts = flagged[flagged["rule"] == "slow_rank"]
slow = sorted({int(r) for r in slow_alerts["rank"].dropna()})
options = frames.phase_options(phases)
# Open on the phase an alert named: every rank's whole call lasts as long as the slowest's.
first = options.index(slow_alerts["phase"].iloc[0]) if slow_alerts["phase"].isin(options).any() else 0
left, right = st.columns(2)
phase = left.selectbox("Phase", options, index=first, key="phase",
                       help="'whole call' is the save/load call each rank made")
metric = right.radio("Colour", frames.METRICS, horizontal=True, key="metric",
                     help="duration: busy seconds in the phase; throughput: its bytes per second")
cells, by_rank = frames.layout_coords(frames.heatmap_cells(phases, ckpt["op"], phase, metric))
unit = "seconds" if metric == "duration" else "bytes/s"
fig = figures.topology_heatmap(
    cells, title=f"{phase} {metric} per rank ({unit}) · {ckpt['op']} {ckpt['checkpoint']}",
    colorbar=unit, flagged=slow, reverse=metric == "throughput")
st.plotly_chart(fig, width="stretch", key="heatmap")
if by_rank:
    st.caption(f"Laid out in rank order, not by topology: {by_rank}.")
if slow:
    st.warning("Slow ranks flagged by the alert rules (marked X): "
               + "; ".join(slow_alerts["message"]))
missing = cells["value"].isna().sum()
if missing:
    st.caption(f"{missing} rank(s) have no `{phase}` span in this checkpoint (blank cells).")
