"""Store schema and queries on a real chdb engine; alert rules on rows and through the store."""

from __future__ import annotations

import json
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

import pytest

from dashboard import queries as dq
from telemetry.alerts import (
    AllRule,
    AnyRule,
    Context,
    FailedOps,
    LowThroughput,
    SlowRank,
    Uncommitted,
    Window,
    evaluate,
    load_rules,
)
from telemetry.alerts.engine import RuleSet
from telemetry.store import StoreConfigError, connect, ensure_schema, insert_events
from telemetry.store.schema import SCHEMA_VERSION, VERSION_TABLE
from tests.support.telemetry_store_reads import event_counts


def _row(rank: int, phase: str, duration: float, **kw: Any) -> dict[str, Any]:
    return {"job": "j", "run": "r", "checkpoint": "/c/step_1", "op": "save", "rank": rank, "phase": phase,
            "step": 1, "spans": 1, "duration_s": duration, "bytes": 0, "errors": 0, "retries": 0,
            "start_ts": 1000.0, "end_ts": 1000.0 + duration, "sample_error": "", **kw}


def _event(rank: int, name: str, duration: float, **kw: Any) -> dict[str, Any]:
    return {"event_id": uuid.uuid4().hex, "name": name, "ts": time.time(), "duration_s": duration,
            "outcome": "ok", "job": "j", "run": "r", "rank": rank, "step": 1, "checkpoint": "/c/step_1",
            "checkpoint_op": "save", "attrs": {}, **kw}


# -- schema and queries --------------------------------------------------------------


def test_schema_is_created_once_and_a_newer_store_is_refused(store):
    assert ensure_schema(store) == SCHEMA_VERSION  # idempotent
    assert int(store.command(f"SELECT count() FROM {VERSION_TABLE}")) == SCHEMA_VERSION
    store.insert(VERSION_TABLE, [[SCHEMA_VERSION + 1, "from the future"]],
                 column_names=["version", "description"])
    with pytest.raises(StoreConfigError, match="upgrade"):
        ensure_schema(store)


def test_redelivered_events_count_once_and_io_ops_are_split_out(store):
    events = [_event(r, "save.write", 0.5, bytes=100) for r in range(4)]
    events += [_event(r, "storage.write", 0.2, bytes=100, op="write", backend="file", attempt=1)
               for r in range(4)]
    insert_events(store, events)
    insert_events(store, events)  # redelivery
    assert event_counts(store, job="j")["final_rows"] == 8
    rows = dq.rank_phases(store, job="j", run="r", checkpoint="/c/step_1", op="save").to_dict("records")
    assert {(r["rank"], r["phase"]) for r in rows} == {(r, "save.write") for r in range(4)}
    assert all(r["spans"] == 1 and r["bytes"] == 100 for r in rows)
    io = dq.io_latency(store, job="j").to_dict("records")
    assert [(r["backend"], r["op"], r["ops"], r["bytes"]) for r in io] == [("file", "write", 4, 400)]


def test_bad_dsns_say_what_to_do(tmp_path: Path):
    with pytest.raises(StoreConfigError, match="chdb:///"):
        connect("postgres://x/y")
    with pytest.raises(StoreConfigError, match="BCP_CLICKHOUSE_DSN"):
        connect("")


def test_unreachable_server_is_reported_as_unavailable():
    from telemetry.store import StoreUnavailableError
    from tests.support.dist import free_port

    with pytest.raises(StoreUnavailableError, match="cannot reach ClickHouse"):
        connect(f"http://default:secret@127.0.0.1:{free_port()}/default", connect_timeout=1)


# -- rules on rows ---------------------------------------------------------------------


def test_identical_ranks_raise_nothing_and_one_slow_rank_raises_one_alert():
    ctx = Context(now=2000.0)
    same = [_row(r, "save.write", 0.25) for r in range(8)]
    assert SlowRank().evaluate(Window(same), context=ctx) == []
    slow = [_row(r, "save.write", 3.0 if r == 2 else 0.25 + 0.01 * r) for r in range(8)]
    slow += [_row(r, "save.commit", 2.5 if r == 2 else 0.1) for r in range(8)]  # coupled phase
    [alert] = SlowRank().evaluate(Window(slow), context=ctx)
    assert (alert.rank, alert.phase) == (2, "save.write")
    assert {p["phase"] for p in alert.details["phases"]} == {"save.write", "save.commit"}


def test_jitter_below_the_floor_is_not_a_slow_rank():
    rows = [_row(r, "save.write", 0.05 if r else 0.4) for r in range(4)]  # 8x but only 0.35 s
    assert SlowRank().evaluate(Window(rows), context=Context(now=0)) == []


def test_low_throughput_failures_retries_and_uncommitted():
    ctx = Context(now=5000.0)
    mib = 1024 * 1024
    rows = [_row(r, "save.write", 10.0, bytes=100 * mib) for r in range(2)]  # 10.5 MB/s
    rows.append(_row(0, "storage.write", 1.0, retries=2))
    rows.append(_row(1, "save.plan", 1.0, errors=1, sample_error="PlanningError: boom"))
    [low] = LowThroughput().evaluate(Window(rows), context=ctx)
    assert low.phase == "save.write" and low.value < 50
    kinds = {(a.severity, a.phase) for a in FailedOps().evaluate(Window(rows), context=ctx)}
    assert kinds == {("warning", "storage.write"), ("error", "save.plan")}
    [stale] = Uncommitted(deadline_s=600).evaluate(Window(rows), context=ctx)
    assert stale.checkpoint == "/c/step_1"
    committed = [*rows, _row(0, "save.commit", 0.1)]
    assert Uncommitted(deadline_s=600).evaluate(Window(committed), context=ctx) == []


def test_combinators():
    ctx = Context(now=0)
    rows = [_row(r, "save.write", 5.0 if r == 1 else 0.1, bytes=200 * 1024 * 1024) for r in range(4)]
    both = AllRule((SlowRank(), LowThroughput(min_mb_s=100)))
    assert [a.rank for a in both.evaluate(Window(rows), context=ctx)] == [1]
    assert len(AnyRule((SlowRank(), LowThroughput(min_mb_s=100))).evaluate(Window(rows), context=ctx)) == 2


def test_rules_file(tmp_path: Path):
    path = tmp_path / "rules.yaml"
    path.write_text("window_s: 3600\nrules:\n  - {type: slow_rank, z: 5, phase_prefixes: [save.]}\n"
                    "  - {type: uncommitted, deadline_s: 60}\n")
    ruleset = load_rules(path)
    assert ruleset.window_s == 3600
    assert ruleset.rule.rules == (SlowRank(z=5, phase_prefixes=("save.",)), Uncommitted(deadline_s=60))
    path.write_text("rules:\n  - {type: slow_rank, zz: 5}\n")
    with pytest.raises(ValueError, match="zz"):
        load_rules(path)
    path.write_text("rules:\n  - {type: nope}\n")
    with pytest.raises(ValueError, match="unknown alert rule type"):
        load_rules(path)


# -- through the store -------------------------------------------------------------------


def test_evaluate_stores_dedups_and_posts_to_the_webhook(store):
    received: list[dict] = []

    class Hook(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server API
            received.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args):
            return

    server = HTTPServer(("127.0.0.1", 0), Hook)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        insert_events(store, [_event(r, "save.write", 4.0 if r == 3 else 0.2) for r in range(4)])
        ruleset = RuleSet(SlowRank(), webhook=f"http://127.0.0.1:{server.server_port}/hook")
        [alert] = evaluate(store, ruleset)
        assert alert.rank == 3
        assert evaluate(store, ruleset) == []  # already known
        assert len(received) == 1 and received[0]["alerts"][0]["rank"] == 3
        [row] = [a for a in dq.alerts(store).to_dict("records") if a["rule"] == "slow_rank"]
        assert row["alert_id"] == alert.alert_id and "rank 3" in row["message"]
    finally:
        server.shutdown()
