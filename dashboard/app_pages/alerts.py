"""Alerts: open and recent alerts, each linking to its checkpoint's heatmap."""

from __future__ import annotations

import streamlit as st

from dashboard import frames, ui

st.title("Alerts")
job, run = ui.filters()
alerts = ui.query("alerts", job=job, run=run)
if alerts.empty:
    ui.empty_state("No alerts. Rules run with `python -m telemetry.alerts --once --dsn DSN` (or "
                   "`--alerts RULES.yaml` on the ingester); slow ranks, low throughput, failed "
                   "operations and uncommitted saves show up here.")

counts = alerts.groupby(["rule", "severity"]).size().rename("alerts").reset_index()
cols = st.columns(max(1, len(counts)))
for col, (_, row) in zip(cols, counts.iterrows()):
    col.metric(f"{row['rule']} ({row['severity']})", int(row["alerts"]))

table = alerts.assign(
    created=frames.utc_times(alerts["created_ts"]),
    heatmap=[ui.heatmap_link(r) for _, r in alerts.iterrows()],
)
st.dataframe(
    table[["created", "rule", "severity", "message", "step", "rank", "phase", "checkpoint", "op", "heatmap"]],
    hide_index=True, width="stretch",
    column_config={"heatmap": st.column_config.LinkColumn("heatmap", display_text="open heatmap")},
)
