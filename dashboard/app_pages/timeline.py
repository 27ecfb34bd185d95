"""Timeline: a Gantt of every rank's phases for one checkpoint, one rank's breakdown (Fig. 12),
and, for a save, how long each rank's files waited for a host write slot."""

from __future__ import annotations

import streamlit as st

from dashboard import figures, frames, ui

MAX_DEFAULT_RANKS = 64  # beyond this the chart shows the stragglers unless ranks are chosen

st.title("Timeline")
job, run = ui.filters()
ckpt = ui.pick_checkpoint(ui.query("checkpoints", job=job, run=run))
phases = ui.query("rank_phases", **ui.checkpoint_params(ckpt))
if phases.empty:
    ui.empty_state("This checkpoint has no per-rank spans.")

# Widgets keyed by checkpoint: another checkpoint has other ranks, and starts from its own defaults.
params = ui.checkpoint_params(ckpt)
scope = f"{ckpt['op']}:{ckpt['job']}/{ckpt['run']}:{ckpt['checkpoint']}:{params['step']}:{params['call']}"
all_ranks = sorted(int(r) for r in phases["rank"].unique())
default = all_ranks if len(all_ranks) <= MAX_DEFAULT_RANKS else frames.slowest_ranks(phases, 32)
chosen = st.multiselect("Ranks", all_ranks, default=default, key=f"ranks:{scope}",
                        help=f"more than {MAX_DEFAULT_RANKS} ranks: the 32 that finished last are shown")
bars = frames.timeline_bars(phases, chosen or all_ranks)
st.plotly_chart(figures.timeline(bars, title=f"{ckpt['op']} {ckpt['checkpoint']}: phases per rank"),
                width="stretch", key="timeline")

rank = st.selectbox("Rank breakdown", all_ranks, key=f"rank:{scope}",
                    index=all_ranks.index(frames.slowest_ranks(phases, 1)[0]))
st.plotly_chart(figures.rank_breakdown(frames.rank_breakdown(phases, rank), rank=rank,
                                       title=f"rank {rank}: busy seconds per phase vs the median rank"),
                width="stretch", key="breakdown")

if ckpt["op"] == "save":
    # Sync saves to a local disk take one of a host's write slots per large file
    # (BCP_STORAGE_HOST_WRITERS); a rank that waited long for one is slow for that reason.
    waits = ui.query("slot_waits", **ui.checkpoint_params(ckpt))
    if not waits.empty and (waits["wait_s"] > 0).any():
        title = "seconds each rank's files waited for a host write slot"
        st.plotly_chart(figures.slot_waits(waits, title=title), width="stretch", key="slot_waits")
    elif not waits.empty:
        st.caption("No file of this save waited for a host write slot.")
