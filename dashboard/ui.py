"""What every page shares: cached queries, store errors shown with what to do, the sidebar
filters and the checkpoint picker (kept in the URL, so alerts can link to a heatmap)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn
from urllib.parse import urlencode

import pandas as pd
import streamlit as st

from dashboard import frames, queries
from dashboard.store import configured_dsn, run_query
from telemetry.store import StoreConfigError, StoreError, StoreUnavailableError

CACHE_TTL_S = 15  # new telemetry shows up within this long; a rerun within it costs no query


@st.cache_data(ttl=CACHE_TTL_S, show_spinner=False, max_entries=256)
def _cached(name: str, dsn: str, params: tuple[tuple[str, Any], ...]) -> Any:
    fn: Callable[..., Any] = getattr(queries, name)
    return run_query(dsn, fn, **dict(params))


def query(name: str, **params: Any) -> Any:
    """``queries.<name>(client, **params)``, cached; a store error stops the page with advice."""
    dsn = dsn_or_stop()
    try:
        return _cached(name, dsn, tuple(sorted(params.items())))
    except StoreUnavailableError as exc:
        stop_with_error("The telemetry store cannot be reached.", exc, _unreachable_advice(dsn))
    except StoreConfigError as exc:
        stop_with_error("The telemetry store is misconfigured.", exc,
                        "Fix the DSN (`--dsn` or `BCP_CLICKHOUSE_DSN`) and reload.")
    except StoreError as exc:
        stop_with_error("The telemetry store failed.", exc, "Reload the page; check the server's logs.")
    except Exception as exc:  # noqa: BLE001 - a server error or a dropped connection, shown not raised
        stop_with_error("A query failed.", exc, _unreachable_advice(dsn))


def dsn_or_stop() -> str:
    try:
        return configured_dsn()
    except StoreConfigError as exc:
        stop_with_error("No usable telemetry store is configured.", exc,
                        "Start the dashboard with `python -m dashboard --dsn chdb:///ABS/PATH` "
                        "(embedded) or `--dsn http://user:pass@host:8123/db` (ClickHouse server).")


def _unreachable_advice(dsn: str) -> str:
    if dsn.startswith("chdb:"):
        return ("An embedded store can be open in one process only. If `python -m telemetry.ingest` "
                "or `python -m telemetry.alerts` is running on this store, wait for it to finish "
                "(or stop it), then reload. To ingest while the dashboard runs, start it with "
                "`python -m dashboard --spool DIR`, or use a ClickHouse server.")
    return "Check that the ClickHouse server is up and the DSN's host, port and credentials are right."


def stop_with_error(headline: str, exc: BaseException, advice: str) -> NoReturn:
    st.error(f"**{headline}** {advice}\n\n`{type(exc).__name__}: {exc}`")
    st.stop()


def empty_state(message: str) -> NoReturn:
    st.info(message)
    st.stop()


NO_DATA = ("No checkpoints in the telemetry store yet. Telemetry is spooled by every save and load "
           "(`BCP_TELEMETRY_DIR`); ingest it with `python -m telemetry.ingest --spool DIR --once "
           "--dsn DSN`, then reload. For a first look: `./scripts/demo.sh`, then the commands in the "
           "Dashboard page of the docs (docs/dashboard.md).")


def filters() -> tuple[str, str]:
    """Sidebar job and run pickers; "" means all. Seeded from the URL's ``job`` / ``run``."""
    jobs = query("jobs")
    if jobs.empty:
        return "", ""
    job_names = sorted(jobs["job"].unique())
    options = ["", *job_names]
    wanted = st.query_params.get("job", job_names[0] if len(job_names) == 1 else "")
    job = st.sidebar.selectbox("Job", options, index=options.index(wanted) if wanted in options else 0,
                               format_func=lambda j: j or "(all jobs)", key="job")
    runs = sorted(jobs.loc[jobs["job"] == job, "run"].unique()) if job else []
    run_options = ["", *runs]
    wanted_run = st.query_params.get("run", "")
    run = st.sidebar.selectbox("Run", run_options,
                               index=run_options.index(wanted_run) if wanted_run in run_options else 0,
                               format_func=lambda r: r or "(all runs)", key="run")
    st.sidebar.caption(f"Store: `{_redacted(dsn_or_stop())}`")
    return job, run


def _redacted(dsn: str) -> str:
    scheme, sep, rest = dsn.partition("://")
    userinfo, at, host = rest.rpartition("@")
    return f"{scheme}{sep}{userinfo.partition(':')[0]}:***@{host}" if at else dsn


def pick_checkpoint(ckpts: pd.DataFrame, *, ops: tuple[str, ...] = ("save", "load")) -> pd.Series:
    """A selectbox over ``ckpts`` (newest first); the choice is written to the URL."""
    rows = ckpts[ckpts["op"].isin(ops)].reset_index(drop=True)
    if rows.empty:
        empty_state(NO_DATA)
    labels = [frames.checkpoint_label(r) for _, r in rows.iterrows()]
    index = 0
    want = st.query_params.get("checkpoint")
    if want:
        match = (rows["checkpoint"] == want) & (rows["op"] == st.query_params.get("op", rows["op"].iloc[0]))
        # A path saved more than once: the call the URL names (its step and call number).
        for key in ("step", "call"):
            if key in st.query_params:
                match &= rows[key].map(lambda v: "" if pd.isna(v) else str(int(v))) == st.query_params[key]
        if match.any():
            index = int(rows.index[match][0])
    label = st.selectbox("Checkpoint", labels, index=index, key="checkpoint")
    row = rows.iloc[labels.index(label)]
    for key in ("step", "call"):
        st.query_params.pop(key, None)
    st.query_params.update(url_params(row))
    return row


def checkpoint_params(row: pd.Series) -> dict[str, Any]:
    """The query parameters of one save / load call (see ``queries.checkpoints``)."""
    step = row.get("step")
    return {"job": row["job"], "run": row["run"], "checkpoint": row["checkpoint"], "op": row["op"],
            "step": None if step is None or pd.isna(step) else int(step), "call": int(row.get("call", 0))}


def heatmap_link(row: pd.Series) -> str:
    """A relative link to the topology page for the checkpoint in ``row`` (job, run, checkpoint, op)."""
    return "/topology?" + urlencode(url_params(row))


def url_params(row: pd.Series) -> dict[str, str]:
    """``checkpoint_params`` for a URL: the step when known, the call when one is picked (an
    alert names a step, not a call: its link opens that step's newest call)."""
    params = checkpoint_params(row)
    step, call = params.pop("step"), params.pop("call")
    if step is not None:
        params["step"] = str(step)
    if call:
        params["call"] = str(call)
    return params
