"""Overview: jobs, recent checkpoints (step, size, save and load times, status, tier), health."""

from __future__ import annotations

import streamlit as st

from dashboard import frames, ui
from dashboard.figures import format_bytes

st.title("Checkpoints")
job, run = ui.filters()
ckpts = ui.query("checkpoints", job=job, run=run)
if ckpts.empty:
    ui.empty_state(ui.NO_DATA)
ckpts = frames.with_tiers(ckpts, ui.query("tiering_moves"))
alerts = ui.query("alerts", job=job, run=run)

saves, loads = ckpts[ckpts["op"] == "save"], ckpts[ckpts["op"] == "load"]
failed = int((saves["errors"] > 0).sum() + (loads["errors"] > 0).sum())
cols = st.columns(5)
cols[0].metric("Saves", len(saves), help="save calls (a path saved again counts again)")
cols[1].metric("Loads", len(loads))
cols[2].metric("Median save (blocking)", f"{saves['blocking_s'].median():.3f} s" if len(saves) else "—")
cols[3].metric("Median load", f"{loads['blocking_s'].median():.3f} s" if len(loads) else "—")
cols[4].metric("Alerts", len(alerts), delta=f"{failed} with errors" if failed else None,
               delta_color="inverse")
if failed or not alerts.empty:
    st.warning(f"{len(alerts)} alert(s) and {failed} checkpoint(s) with failed spans: see Alerts.")
else:
    st.success("No alerts and no failed spans.")

st.subheader("Jobs")
jobs = ui.query("jobs")
st.dataframe(jobs.assign(first=frames.utc_times(jobs["first_ts"]), last=frames.utc_times(jobs["last_ts"]))
             .drop(columns=["first_ts", "last_ts"]), hide_index=True, width="stretch")

st.subheader("Recent checkpoints")
table = ckpts.assign(
    size=ckpts["bytes"].map(format_bytes),
    status=[("committed" if c else "not committed") if op == "save" else ("ok" if not e else "errors")
            for c, op, e in zip(ckpts["committed"], ckpts["op"], ckpts["errors"])],
    heatmap=[ui.heatmap_link(r) for _, r in ckpts.iterrows()],
    started=frames.utc_times(ckpts["start_ts"]),
)
st.dataframe(
    table[["op", "step", "checkpoint", "started", "job", "run", "ranks", "size", "blocking_s", "e2e_s",
           "status", "tier", "errors", "heatmap"]],
    hide_index=True, width="stretch",
    column_config={
        "blocking_s": st.column_config.NumberColumn("blocking s", format="%.3f",
                                                    help="the slowest rank's whole save/load call"),
        "e2e_s": st.column_config.NumberColumn("end to end s", format="%.3f"),
        "heatmap": st.column_config.LinkColumn("heatmap", display_text="open"),
    },
)
