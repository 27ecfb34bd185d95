"""Tiering: what is hot and cold, bytes moved, moves in progress or failed."""

from __future__ import annotations

import streamlit as st

from dashboard import figures, frames, ui

st.title("Storage tiering")
moves = ui.query("tiering_moves")
if moves.empty:
    ui.empty_state(
        "No tiering activity yet. The cooling service (`storage_tiering`) reports each pass as a "
        "`tiering.scan` span and each move as `tiering.move` (checkpoint, bytes, outcome); once it "
        "runs and its telemetry is ingested, this page shows what is hot and cold, bytes moved, "
        "and failed moves.")

state = frames.tiering_state(moves)
scan = frames.last_scan(moves)
cols = st.columns(5)
cols[0].metric("Checkpoints cooled", int((~state["tier"].isin(["hot", "deleted"])).sum()))
cols[1].metric("Bytes moved", figures.format_bytes(float(state["bytes_moved"].sum())))
if scan is not None:
    cols[2].metric("Hot tier (last scan)", figures.format_bytes(float(scan["bytes"])),
                   help=f"to cool: {scan['to_cool']}, to delete: {scan['to_delete']}")
else:
    cols[2].metric("Hot tier (last scan)", "—")
cols[3].metric("In progress", int(state["in_progress"].sum()),
               help="needs tiering.begin spans, which the service does not emit today")
cols[4].metric("Failed moves", int(state["failed"].sum()))
if state["failed"].any():
    st.error("Failed moves: " + ", ".join(state.loc[state["failed"] > 0, "checkpoint"]))
st.plotly_chart(figures.tiering_bytes(state, title="Checkpoints per tier"), width="stretch", key="tiers")
st.dataframe(state.assign(last=frames.utc_times(state["last_ts"])).drop(columns="last_ts"),
             hide_index=True, width="stretch")
