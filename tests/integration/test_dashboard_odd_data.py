"""The dashboard on odd data the store accepts, and its --spool ingest on records it cannot store.

Each test builds its own embedded store (no gloo pools: see tests/conftest.py on chdb and
the dashboard tests' order) and runs the pages in Streamlit's AppTest harness.
"""

from __future__ import annotations

import base64
import json
import os
import stat
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import pytest
from streamlit.testing.v1 import AppTest

from dashboard import store
from telemetry.store import insert_events
from telemetry.store.schema import EVENTS, QUARANTINE
from telemetry.store.writer import insert_alerts
from tests.support.telemetry_servers import run_ingester

PAGES = Path(__file__).resolve().parents[2] / "dashboard" / "app_pages"


def page(name: str, **query: str) -> AppTest:
    at = AppTest.from_file(str(PAGES / f"{name}.py"), default_timeout=60)
    for key, value in query.items():
        at.query_params[key] = value
    at.run()
    assert not at.exception, (name, [e.value for e in at.exception])
    assert not at.error, (name, [e.value for e in at.error])
    return at


def figure(at: AppTest, key: str) -> dict:
    charts = [c for c in at.get("plotly_chart") if key in c.proto.id]
    assert charts, f"no plotly chart {key!r} on the page"
    return json.loads(charts[0].proto.spec)


def array(value) -> np.ndarray:
    if isinstance(value, dict) and "bdata" in value:
        data = np.frombuffer(base64.b64decode(value["bdata"]), dtype=value["dtype"])
        shape = [int(n) for n in str(value.get("shape", len(data))).split(",")]
        return data.reshape(shape)
    return np.asarray(value, dtype=float)


def span(name: str, **fields) -> dict:
    event = {"event_id": uuid.uuid4().hex, "name": name, "ts": 1_700_000_000.25, "duration_s": 0.5,
             "outcome": "ok", "job": "j", "run": "r", "rank": 0, "world_size": 4, "host": "h", "pid": 1,
             "attrs": {}}
    event.update(fields)
    return event


@pytest.fixture
def odd_store(tmp_path, monkeypatch):
    """``fill(events)``: a fresh embedded store holding ``events``, which the pages read."""
    dsn = f"chdb://{tmp_path / 'store'}"
    monkeypatch.setenv(store.DSN_ENV, dsn)

    def fill(events: list[dict]) -> str:
        assert store.run_query(dsn, insert_events, events=events) == len(events)
        return dsn

    yield fill
    store.close()  # chdb: one store directory per process


# --- 1. the --spool ingest quarantines exactly what python -m telemetry.ingest does ---------------

def bad_spool(directory: Path) -> Path:
    """A sealed segment (read-only) of good, unstorable and undecodable lines and a torn tail."""
    directory.mkdir()
    now = time.time()

    def line(**fields) -> bytes:
        event = span("save.write", ts=now, checkpoint="/ck/1", checkpoint_op="save", step=1)
        return json.dumps({**event, **fields}).encode()

    good = line(rank=0)
    lines = [
        good, good,  # the same event twice: merged by event_id
        line(rank=1, bytes=100),
        line(rank="3"),  # wrong type
        line(rank=10**30),  # out of Int32
        line(ts=1e12),  # beyond the storable years
        line(attrs="notadict"),
        line(name=""),
        line(pid=-1),
        line(duration_s=-5.0, rank=2),  # odd but storable
        b'{"event_id":"x","name":"n","ts":1e400}',
        b"\xff\xfe{not utf-8}",
        b'{"event_id": "torn", "name": "sa',  # a torn line in the middle
        b"[1,2,3]",
        b"null",
        b'{"event_id": "long", "pad": "' + b"x" * (9 << 20) + b'"}',  # over the 8 MiB line limit
        line(rank=3),
    ]
    path = directory / "events-otherhost-1-00000.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n" + b'{"torn_tail":')
    os.chmod(path, stat.S_IRUSR)  # sealed: its torn tail will never be completed
    return path


def stored(dsn: str) -> tuple[list[tuple], list[tuple]]:
    def read(client):
        events = client.query(f"SELECT event_id, name, toFloat64(ts), duration_s, rank, attrs "
                              f"FROM {EVENTS} FINAL ORDER BY event_id").result_rows
        quarantine = client.query(f"SELECT source, position, reason, record, record_bytes FROM {QUARANTINE} "
                                  "ORDER BY position, reason").result_rows
        return [tuple(r) for r in events], [tuple(r) for r in quarantine]

    try:
        return store.run_query(dsn, read)
    finally:
        store.close()


def test_spool_mode_quarantines_what_the_cli_ingester_quarantines(tmp_path, monkeypatch):
    spool = tmp_path / "spool"
    segment = bad_spool(spool)
    cli_dsn, dash_dsn = f"chdb://{tmp_path / 'cli'}", f"chdb://{tmp_path / 'dash'}"
    cli = run_ingester("--spool", str(spool), "--dsn", cli_dsn, "--once", "--idle-s", "0.5", "--keep-spool",
                       check=False)
    assert cli.returncode == 3, cli.stderr  # done, some records quarantined

    monkeypatch.setenv(store.DSN_ENV, dash_dsn)
    store.start_spool_ingest(dash_dsn, str(spool), every_s=0.2)
    try:
        deadline = time.monotonic() + 30
        size = segment.stat().st_size
        while time.monotonic() < deadline:
            states = list(spool.glob(".ingest-state-dashboard-*.json"))
            if states and json.loads(states[0].read_text()).get(segment.name) == size:
                break
            time.sleep(0.2)
        at = page("overview")
        assert list(at.dataframe[1].value["checkpoint"]) == ["/ck/1"]
    finally:
        store.stop_spool_ingest()
        store.close()

    cli_events, cli_quarantine = stored(cli_dsn)
    dash_events, dash_quarantine = stored(dash_dsn)
    assert len(cli_events) == 4 and len(cli_quarantine) == 13
    assert dash_events == cli_events
    assert dash_quarantine == cli_quarantine
    reasons = " | ".join(r[2] for r in dash_quarantine)
    for why in ("rank: expected an integer", "not JSON", "torn write", "outside the storable years"):
        assert why in reasons


# --- 2. topology: coordinates that cannot make a grid of about the ranks' size ---------------------

def heatmap_cells(spec: dict) -> tuple[int, int]:
    """(grid cells allocated, cells holding a value) over every heatmap trace."""
    grids = [array(t["z"]).astype(float) for t in spec["data"] if t["type"] == "heatmap"]
    return sum(z.size for z in grids), sum(int((~np.isnan(z)).sum()) for z in grids)


@pytest.mark.parametrize("ranks", [
    pytest.param({0: (-5, 0, 0), 1: (0, 0, 0), 2: (1, 0, 0)}, id="negative-dp"),
    pytest.param({0: (0, 0, 0), 1: (2**31 - 1, 2**31 - 1, 0)}, id="largest-int32-coords"),
    pytest.param({0: (None, None, None), 1: (None, None, None), 400_000: (None, None, None)},
                 id="huge-rank-without-coords"),
    pytest.param({r: (0, 0, r) for r in range(70)}, id="more-stages-than-drawn"),
])
def test_topology_lays_out_ranks_whose_coordinates_make_no_grid(odd_store, ranks):
    events = []
    for rank, (dp, tp, pp) in ranks.items():
        for name in ("save", "save.write"):
            events.append(span(name, rank=rank, dp=dp, tp=tp, pp=pp, checkpoint="/ck/odd",
                               checkpoint_op="save", step=1, bytes=100))
    odd_store(events)
    at = page("topology", job="j", run="r", checkpoint="/ck/odd", op="save")
    allocated, filled = heatmap_cells(figure(at, "heatmap"))
    assert filled == len(ranks)
    assert allocated <= 4 * len(ranks) + 64
    assert any("rank order" in c.value for c in at.caption), [c.value for c in at.caption]


def test_topology_draws_many_pp_stages(odd_store):
    # 40 stages of one rank each: 10 rows of grids (plotly's default spacing allowed 9).
    odd_store([span(name, rank=r, tp=0, dp=0, pp=r, checkpoint="/ck/pp", checkpoint_op="save", step=1)
               for r in range(40) for name in ("save", "save.write")])
    at = page("topology", job="j", run="r", checkpoint="/ck/pp", op="save")
    assert heatmap_cells(figure(at, "heatmap")) == (40, 40)
    assert not any("rank order" in c.value for c in at.caption)


def test_topology_keeps_a_real_grid(odd_store):
    # A TP=2 x DP=2 job with one rank missing: its own coordinates, a blank cell, no caption.
    odd_store([span(name, rank=r, tp=r % 2, dp=r // 2, pp=0, checkpoint="/ck/ok", checkpoint_op="save",
                    step=1) for r in range(3) for name in ("save", "save.write")])
    at = page("topology", job="j", run="r", checkpoint="/ck/ok", op="save")
    assert heatmap_cells(figure(at, "heatmap")) == (4, 3)
    assert not any("rank order" in c.value for c in at.caption)


# --- 3. goodput: measured values outside the inputs' ranges ----------------------------------------

def test_goodput_clamps_measured_values_into_its_inputs(odd_store):
    # A toy loop: train.step spans of 2 us; a load whose duration came from a broken clock.
    t0 = 1_700_000_000.0
    events = [span("train.step", step=s, ts=t0 + s * 1e-5, duration_s=2.33e-6) for s in range(1, 201)]
    events += [span("save", checkpoint=f"/ck/{s}", checkpoint_op="save", step=s, ts=t0 + s * 1e-5)
               for s in (100, 200)]
    events.append(span("load", checkpoint="/ck/200", checkpoint_op="load", duration_s=-3.0, ts=t0 + 1))
    odd_store(events)
    at = page("goodput", job="j", run="r")
    assert at.number_input(key="t_iter").value == pytest.approx(2.33e-6)
    assert at.number_input(key="interval").value == 100
    assert at.number_input(key="t_load").value == 0.0  # -3 s measured: clamped to the range
    assert any("clamped" in c.value and "T_load -3" in c.value for c in at.caption)
    assert float(at.metric[0].value) > 0


def test_goodput_what_if_curve_stays_small_for_a_huge_interval(odd_store):
    odd_store([span("save", checkpoint=f"/ck/{s}", checkpoint_op="save", step=s, ts=1_700_000_000.0 + i)
               for i, s in enumerate((1, 2**62))])
    at = page("goodput", job="j", run="r")
    assert at.number_input(key="interval").value == 10**9
    [curve, *_] = figure(at, "ettr")["data"]
    assert len(array(curve["x"])) <= 401


# --- 4. times past pandas' nanosecond range (2262) that the store holds -----------------------------

def test_pages_show_times_after_2262(odd_store):
    ts = 9_468_000_000.25  # 2270, fractional like every real ts
    dsn = odd_store([
        *[span(n, ts=ts, checkpoint="/ck/f", checkpoint_op="save", step=1) for n in ("save", "save.write")],
        span("storage.write", ts=ts, checkpoint="/ck/f", checkpoint_op="save", step=1, bytes=1 << 20,
             backend="file", op="write"),
        span("tiering.move", ts=ts, checkpoint="/ck/f", path="/ck/f", bytes=1 << 20, attrs={"files": 1}),
    ])
    created = datetime.fromtimestamp(ts, tz=timezone.utc)
    store.run_query(dsn, insert_alerts, alerts=[{
        "alert_id": "a1", "rule": "slow_rank", "severity": "warning", "job": "j", "run": "r",
        "checkpoint": "/ck/f", "checkpoint_op": "save", "step": 1, "phase": "save.write", "rank": 0,
        "value": 1.0, "threshold": 0.5, "message": "slow", "details": "{}", "created_at": created}])
    at = page("overview")
    assert at.dataframe[0].value["last"].iloc[0].year == 2270
    at = page("alerts")
    assert at.dataframe[0].value["created"].iloc[0].year == 2270
    at = page("tiering")
    assert at.dataframe[0].value["last"].iloc[0].year == 2270
    at = page("trends")
    [line] = figure(at, "throughput")["data"]
    assert str(line["x"][0]).startswith("2270-01-11")
    for name in ("topology", "timeline", "goodput"):
        page(name)
