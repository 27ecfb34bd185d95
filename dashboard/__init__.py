"""Streamlit dashboard over the telemetry store: start it with ``python -m dashboard``.

Layers, each in its own module: ``queries`` (SQL -> DataFrame), ``frames`` (pure reshaping),
``figures`` (DataFrame -> plotly Figure), ``goodput`` (ETTR), ``store`` (the one shared
connection), ``ui`` (shared widgets), ``app_pages/`` (pages that only wire these together).
"""
