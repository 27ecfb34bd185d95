"""The Streamlit entry point: ``streamlit run dashboard/app.py`` (or ``python -m dashboard``)."""

from __future__ import annotations

import os
from pathlib import Path

import streamlit as st

from dashboard.store import SPOOL_ENV, configured_dsn, start_spool_ingest

HERE = Path(__file__).parent / "app_pages"

st.set_page_config(page_title="bytecheckpoint", page_icon=":floppy_disk:", layout="wide")

PAGES = [
    st.Page(HERE / "overview.py", title="Overview", icon=":material/dashboard:", default=True),
    st.Page(HERE / "topology.py", title="Topology heatmap", icon=":material/grid_on:"),
    st.Page(HERE / "timeline.py", title="Timeline", icon=":material/view_timeline:"),
    st.Page(HERE / "trends.py", title="Trends and I/O", icon=":material/show_chart:"),
    st.Page(HERE / "alerts.py", title="Alerts", icon=":material/notifications:"),
    st.Page(HERE / "goodput.py", title="Goodput", icon=":material/speed:"),
    st.Page(HERE / "tiering.py", title="Tiering", icon=":material/ac_unit:"),
]

spool = os.environ.get(SPOOL_ENV, "").strip()
if spool:
    start_spool_ingest(configured_dsn(), spool)

st.navigation(PAGES).run()
