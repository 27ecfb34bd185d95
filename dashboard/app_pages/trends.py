"""Trends: save/load duration and blocking time per step; storage I/O latency and throughput."""

from __future__ import annotations

import streamlit as st

from dashboard import figures, frames, ui

st.title("Trends and I/O")
job, run = ui.filters()
ckpts = ui.query("checkpoints", job=job, run=run)
if ckpts.empty:
    ui.empty_state(ui.NO_DATA)

st.plotly_chart(figures.step_durations(ckpts, title="Saves and loads per step (slowest rank)"),
                width="stretch", key="steps")
op = st.radio("Phases of", ["save", "load"], horizontal=True, key="trend_op")
st.plotly_chart(figures.phase_trends(ui.query("step_phases", job=job, run=run, op=op),
                                     title=f"{op} phases per step"), width="stretch", key="phases")

st.subheader("Storage I/O")
span = ui.query("io_time_range", job=job, run=run)
if span is None:
    ui.empty_state("No storage operations recorded for this selection.")
bucket = frames.io_bucket_s(span[1] - span[0])
left, right = st.columns(2)
left.plotly_chart(figures.io_latency(ui.query("io_latency", job=job, run=run),
                                     title="Latency by backend and operation"),
                  width="stretch", key="latency")
right.plotly_chart(figures.io_throughput(ui.query("io_throughput", job=job, run=run, bucket_s=bucket),
                                         title="Throughput over time", bucket_s=bucket),
                   width="stretch", key="throughput")
