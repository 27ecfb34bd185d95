"""The dashboard's pages in Streamlit's AppTest harness, on a real 4-rank save / 2-rank load run."""

from __future__ import annotations

import base64
import json
import time
import uuid
from collections import defaultdict
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import numpy as np
import pytest
from streamlit.testing.v1 import AppTest

from dashboard import goodput, queries, store
from telemetry.sinks.spool import read_spool
from telemetry.store import insert_events
from tests.support.dashboard_fixtures import JOB, RUN_SAVE
from tests.support.dashboard_workloads import coords

PAGES = Path(__file__).resolve().parents[2] / "dashboard" / "app_pages"


@pytest.fixture
def dsn(dashboard_run, monkeypatch) -> str:
    monkeypatch.setenv(store.DSN_ENV, dashboard_run.dsn)
    yield dashboard_run.dsn
    store.close()  # chdb: one store directory per process, and other tests open theirs


def page(name: str, **query: str) -> AppTest:
    at = AppTest.from_file(str(PAGES / f"{name}.py"), default_timeout=60)
    for key, value in query.items():
        at.query_params[key] = value
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def figure(at: AppTest, key: str) -> dict:
    charts = [c for c in at.get("plotly_chart") if key in c.proto.id]
    assert charts, f"no plotly chart {key!r} on the page"
    return json.loads(charts[0].proto.spec)


def spans(spool: Path, checkpoint: str, op: str) -> list[dict]:
    """The spans of one checkpoint, read straight from the spool the ranks wrote."""
    return [e for e in read_spool(spool)
            if e.get("checkpoint") == checkpoint and e.get("checkpoint_op") == op]


def array(value) -> np.ndarray:
    """A plotly array from the chart spec: a plain list, or plotly's typed-array encoding."""
    if isinstance(value, dict) and "bdata" in value:
        data = np.frombuffer(base64.b64decode(value["bdata"]), dtype=value["dtype"])
        shape = [int(n) for n in str(value.get("shape", len(data))).split(",")]
        return data.reshape(shape)
    return np.asarray(value)


def heatmap_cells(spec: dict) -> dict[tuple[int, int, int], float]:
    """(pp stage, tp, dp) -> value for every filled cell of the heatmap."""
    cells = {}
    for trace in spec["data"]:
        if trace["type"] != "heatmap":
            continue
        stage = int(trace["name"].split()[-1])
        z = array(trace["z"]).astype(float)
        for (tp, dp), value in np.ndenumerate(z):
            if not np.isnan(value):
                cells[(stage, tp, dp)] = value
    return cells


def per_rank(events: list[dict], name: str) -> dict[int, float]:
    out: dict[int, float] = defaultdict(float)
    for e in events:
        if e["name"] == name:
            out[e["rank"]] += e["duration_s"]
    return dict(out)


def select_checkpoint(at: AppTest, checkpoint: str, op: str) -> AppTest:
    box = at.selectbox(key="checkpoint")
    [label] = [o for o in box.options if o.startswith(op) and f" · {checkpoint} · " in o]
    box.select(label).run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def test_every_page_renders_on_a_real_run(dsn, dashboard_run):
    at = AppTest.from_file(str(PAGES.parent / "app.py"), default_timeout=60)
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    assert at.title[0].value == "Checkpoints"  # the default page
    for name in ("overview", "topology", "timeline", "trends", "alerts", "goodput", "tiering"):
        at = page(name)
        assert at.title, name
        assert not at.error, (name, [e.value for e in at.error])


def test_overview_lists_every_checkpoint(dsn, dashboard_run):
    at = page("overview")
    table = at.dataframe[1].value
    assert sorted(table["op"]) == ["load", "save", "save"]
    saves = table[table["op"] == "save"].sort_values("step")
    assert list(saves["step"]) == [1, 2] and set(saves["status"]) == {"committed"}
    assert set(saves["tier"]) == {"hot"} and set(saves["ranks"]) == {4}
    assert int(table.loc[table["op"] == "load", "ranks"].iloc[0]) == 2
    assert any("1 alert" in w.value for w in at.warning)


def test_heatmap_has_one_cell_per_rank_with_the_spans_durations(dsn, dashboard_run):
    url = dashboard_run.saves[0]
    at = page("topology", job=JOB, run=RUN_SAVE, checkpoint=url, op="save")
    events = spans(dashboard_run.spool, url, "save")
    for phase, name in (("whole call", "save"), ("save.write", "save.write")):
        at.selectbox(key="phase").select(phase).run()
        cells = heatmap_cells(figure(at, "heatmap"))
        expected = {(c["pp"], c["tp"], c["dp"]): value
                    for rank, value in per_rank(events, name).items() for c in [coords(rank, 4)]}
        assert len(cells) == 4 and cells.keys() == expected.keys()
        for key, value in expected.items():
            assert cells[key] == pytest.approx(value, rel=1e-9), (phase, key)
    at.radio(key="metric").set_value("throughput").run()
    cells = heatmap_cells(figure(at, "heatmap"))
    written = defaultdict(int)
    first, last = defaultdict(lambda: float("inf")), defaultdict(float)
    for e in events:
        if e["name"] == "save.write":
            written[e["rank"]] += e["bytes"]
            first[e["rank"]] = min(first[e["rank"]], e["ts"])
            last[e["rank"]] = max(last[e["rank"]], e["ts"] + e["duration_s"])
    # A rank writes its files on several threads at once: wall time, not the summed spans.
    for rank, busy in per_rank(events, "save.write").items():
        c = coords(rank, 4)
        seconds = min(busy, last[rank] - first[rank])
        # rel: the store keeps start times to the microsecond
        assert cells[(c["pp"], c["tp"], c["dp"])] == pytest.approx(written[rank] / seconds, rel=1e-3)


def test_heatmap_marks_the_rank_the_alert_rules_flagged(dsn, dashboard_run):
    url = dashboard_run.saves[1]  # rank 2's storage was slowed by 0.8 s
    at = page("topology", job=JOB, run=RUN_SAVE, checkpoint=url, op="save")
    marks = [t for t in figure(at, "heatmap")["data"] if t["type"] == "scatter"]
    assert len(marks) == 1
    c = coords(2, 4)
    assert (list(array(marks[0]["x"])), list(array(marks[0]["y"]))) == ([c["dp"]], [c["tp"]])
    assert any("rank 2" in w.value for w in at.warning)
    at.selectbox(key="phase").select("save.write").run()  # every rank's whole call waits for the slowest
    slow = heatmap_cells(figure(at, "heatmap"))
    assert slow[(c["pp"], c["tp"], c["dp"])] == max(slow.values())


def test_timeline_has_one_bar_per_rank_and_phase(dsn, dashboard_run):
    url = dashboard_run.saves[1]
    at = page("timeline", job=JOB, run=RUN_SAVE, checkpoint=url, op="save")
    events = spans(dashboard_run.spool, url, "save")
    expected = {(e["rank"], e["name"]) for e in events
                if e["name"] != "save" and not e["name"].startswith("storage.")}
    bars = {(int(label.split()[-1]), trace["name"])
            for trace in figure(at, "timeline")["data"] for label in array(trace["y"])}
    count = sum(len(array(trace["y"])) for trace in figure(at, "timeline")["data"])
    assert bars == expected and count == len(expected)
    assert {r for r, _ in bars} == {0, 1, 2, 3}
    # The breakdown defaults to the rank that finished last: the slowed one.
    [breakdown_rank] = [b for b in at.selectbox if b.label == "Rank breakdown"]
    assert breakdown_rank.value == 2
    breakdown = figure(at, "breakdown")
    mine = dict(zip(breakdown["data"][0]["x"], array(breakdown["data"][0]["y"])))
    assert mine["save.write"] == pytest.approx(per_rank(events, "save.write")[2])

    # Its small files took no host write slot: the page says so instead of drawing a chart.
    commits = [e for e in events if e["name"] == "storage.commit"]
    assert commits and all(e["attrs"].get("slot_wait_s", 0) == 0 for e in commits)
    assert not [c for c in at.get("plotly_chart") if "slot_waits" in c.proto.id]
    assert any("waited for a host write slot" in c.value for c in at.caption)


def test_timeline_shows_how_long_each_rank_waited_for_a_write_slot(tmp_path, monkeypatch):
    # A 2-rank save whose rank 1 waited for slots on two of its three files, stored by the
    # ingester's own writer; the page sums the waits per rank from the commits' attributes.
    ckpt = "/ckpt/step_7"

    def span(name: str, rank: int, ts: float, **attrs) -> dict:
        return {"event_id": uuid.uuid4().hex, "name": name, "ts": ts, "duration_s": 0.5, "outcome": "ok",
                "job": "slots", "run": "r1", "checkpoint": ckpt, "checkpoint_op": "save", "step": 7,
                "rank": rank, "world_size": 2, "host": "vm", "attrs": attrs}

    waits = {0: [0.0, 0.0, 0.0], 1: [0.75, 0.0, 0.5]}
    events = [span(name, r, 100.0) for r in (0, 1) for name in ("save", "save.write")]
    events += [span("storage.commit", r, 100.1 + i, slot_wait_s=w) for r, ws in waits.items()
               for i, w in enumerate(ws)]
    # A record whose wait is not a number counts as no wait, not as an error on the page.
    events.append(span("storage.commit", 0, 104.0, slot_wait_s="soon"))
    dsn = f"chdb://{tmp_path / 'slots'}"
    monkeypatch.setenv(store.DSN_ENV, dsn)
    try:
        store.run_query(dsn, insert_events, events=events)
        at = page("timeline", job="slots", run="r1", checkpoint=ckpt, op="save")
        [bar] = figure(at, "slot_waits")["data"]
        assert list(bar["x"]) == ["rank 0", "rank 1"]
        assert list(array(bar["y"])) == pytest.approx([0.0, 1.25])
        assert array(bar["customdata"]).tolist() == [[0, 4], [2, 3]]
    finally:
        store.close()


def test_selecting_a_checkpoint_changes_the_figures(dsn, dashboard_run):
    at = page("topology", job=JOB)
    before = figure(at, "heatmap")
    select_checkpoint(at, dashboard_run.root, "load")
    load = figure(at, "heatmap")
    assert len(heatmap_cells(load)) == 2  # the 2-rank load
    select_checkpoint(at, dashboard_run.saves[0], "save")
    save = figure(at, "heatmap")
    assert len(heatmap_cells(save)) == 4 and save != load
    assert len(heatmap_cells(before)) == 2, "the newest checkpoint (the load) comes first"
    assert at.query_params["checkpoint"] == dashboard_run.saves[0]  # the URL follows the choice

    at = page("timeline", job=JOB)
    select_checkpoint(at, dashboard_run.root, "load")
    load_ranks = {label for t in figure(at, "timeline")["data"] for label in array(t["y"])}
    select_checkpoint(at, dashboard_run.saves[0], "save")
    save_ranks = {label for t in figure(at, "timeline")["data"] for label in array(t["y"])}
    assert load_ranks == {"rank 0", "rank 1"} and len(save_ranks) == 4


def test_trends_alerts_goodput_and_tiering_show_the_run(dsn, dashboard_run):
    at = page("trends", job=JOB)
    steps = figure(at, "steps")
    assert {t["name"] for t in steps["data"]} >= {"save blocking", "save end to end"}
    assert sorted(array(steps["data"][0]["x"])) == [1, 2]
    latency = figure(at, "latency")
    assert any("write" in list(array(t["x"])) for t in latency["data"] if t["type"] == "box")
    assert figure(at, "throughput")["data"], "bytes were written, so throughput has a line"

    at = page("alerts", job=JOB)
    table = at.dataframe[0].value
    assert list(table["rule"]) == ["slow_rank"] and list(table["rank"]) == [2]
    link = urlparse(table["heatmap"].iloc[0])
    assert link.path == "/topology" and parse_qs(link.query) == {
        "job": [JOB], "run": [RUN_SAVE], "checkpoint": [dashboard_run.saves[1]], "op": ["save"],
        "step": ["2"]}

    at = page("goodput", job=JOB, run=RUN_SAVE)
    inputs = goodput.GoodputInputs(iteration_s=at.number_input(key="t_iter").value,
                                   interval=at.number_input(key="interval").value,
                                   save_s=at.number_input(key="t_save").value,
                                   load_s=at.number_input(key="t_load").value)
    assert inputs.interval == 1  # saves at steps 1 and 2
    assert at.metric[0].value == f"{goodput.ettr(inputs):.4f}"
    at.number_input(key="interval").set_value(10).run()
    assert at.metric[0].value != f"{goodput.ettr(inputs):.4f}"

    at = page("tiering")
    assert "No tiering activity yet" in at.info[0].value


def test_spool_mode_ingests_while_the_dashboard_owns_the_store(dashboard_run, tmp_path, monkeypatch):
    spool = tmp_path / "spool"
    spool.mkdir()
    for path in dashboard_run.spool.glob("*.jsonl"):
        (spool / path.name).write_bytes(path.read_bytes())
    dsn = f"chdb://{tmp_path / 'live'}"
    monkeypatch.setenv(store.DSN_ENV, dsn)
    store.start_spool_ingest(dsn, str(spool), every_s=0.2)
    try:
        deadline = time.monotonic() + 60
        while len(store.run_query(dsn, queries.checkpoints)) < 3:
            assert time.monotonic() < deadline, "the spool was not ingested within 60 s"
            time.sleep(0.2)
        at = page("overview")
        assert sorted(at.dataframe[1].value["op"]) == ["load", "save", "save"]
    finally:
        store.stop_spool_ingest()
        store.close()


# Last in this module: it loads chdb in this process without the run's pools (see conftest).
def test_empty_store_and_unreachable_store_say_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setenv(store.DSN_ENV, f"chdb://{tmp_path / 'empty'}")
    try:
        for name in ("overview", "topology", "timeline", "trends", "goodput"):
            at = page(name)
            assert "No checkpoints in the telemetry store yet" in at.info[0].value, name
            assert "python -m telemetry.ingest" in at.info[0].value
    finally:
        store.close()
    from tests.support.dist import free_port

    monkeypatch.setenv(store.DSN_ENV, f"http://127.0.0.1:{free_port()}/bcp")
    at = page("overview")
    [error] = at.error
    assert "cannot be reached" in error.value and "server is up" in error.value


def test_tiering_page_reads_the_cooling_services_spans(tmp_path, monkeypatch):
    # Spans shaped as storage_tiering emits them (rank 0 of a one-rank world), stored by the
    # same writer the ingester uses.
    def span(name: str, ts: float, **fields) -> dict:
        attrs = {k: fields.pop(k) for k in ("files", "move_id", "checkpoints", "to_cool", "to_delete")
                 if k in fields}
        return {"event_id": uuid.uuid4().hex, "name": name, "ts": ts, "duration_s": 0.5, "outcome": "ok",
                "job": "tiering", "run": "", "rank": 0, "world_size": 1, "host": "vm", "attrs": attrs,
                **fields}

    events = [
        span("tiering.scan", 100.0, path="/hot", bytes=3 << 20, checkpoints=3, to_cool=2, to_delete=0),
        span("tiering.move", 101.0, checkpoint="/hot/ckpt/step_4", path="/hot/ckpt/step_4", bytes=2 << 20,
             files=12, move_id="m1"),
        span("tiering.move", 102.0, checkpoint="/hot/ckpt/step_8", path="/hot/ckpt/step_8", files=12,
             move_id="m2", outcome="error", error="MoveError: pinned or being read since the scan"),
    ]
    dsn = f"chdb://{tmp_path / 'tiering'}"
    monkeypatch.setenv(store.DSN_ENV, dsn)
    try:
        store.run_query(dsn, insert_events, events=events)
        at = page("tiering")
        metrics = {m.label: m.value for m in at.metric}
        assert metrics["Checkpoints cooled"] == "1" and metrics["Failed moves"] == "1"
        assert metrics["Bytes moved"] == "2.0 MiB" and metrics["Hot tier (last scan)"] == "3.0 MiB"
        assert "/hot/ckpt/step_8" in at.error[0].value
        table = at.dataframe[0].value.set_index("checkpoint")
        assert list(table.loc[["/hot/ckpt/step_4", "/hot/ckpt/step_8"], "tier"]) == ["cold", "hot"]
    finally:
        store.close()
