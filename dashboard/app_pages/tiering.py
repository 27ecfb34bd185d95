"""Tiering: what is hot and cold, bytes moved, moves in progress or failed."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from dashboard import figures, frames, ui

st.title("Storage tiering")
moves = ui.query("tiering_moves")
if moves.empty:
    ui.empty_state(
        "No tiering activity yet. The cooling service reports each move as a `tiering.move` span "
        "(checkpoint, bytes, destination tier, outcome) and its start as `tiering.begin`; once it "
        "runs and its telemetry is ingested, this page shows what is hot and cold, bytes moved, "
        "and moves in progress or failed.")

state = frames.tiering_state(moves)
cols = st.columns(4)
cols[0].metric("Checkpoints cooled", int((state["tier"] != "hot").sum()))
cols[1].metric("Bytes moved", figures.format_bytes(float(state["bytes_moved"].sum())))
cols[2].metric("In progress", int(state["in_progress"].sum()))
cols[3].metric("Failed moves", int(state["failed"].sum()))
if state["failed"].any():
    st.error("Failed moves: " + ", ".join(state.loc[state["failed"] > 0, "checkpoint"]))
st.plotly_chart(figures.tiering_bytes(state, title="Checkpoints per tier"), width="stretch", key="tiers")
st.dataframe(state.assign(last=pd.to_datetime(state["last_ts"], unit="s", utc=True)).drop(columns="last_ts"),
             hide_index=True, width="stretch")
