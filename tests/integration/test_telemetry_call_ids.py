"""Which save / load call each span belongs to: every span carries its call's ``call_id``
(review of 2026-11-29). The dashboard gave a rank's spans to its newest call that started
before them, which gave wrong per-call figures in two cases, silently: a rank killed in two
loads in a row, and an async save whose background spans ended after training moved on."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from collections import defaultdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from dashboard import queries as dq
from telemetry.alerts import Context, Uncommitted, Window
from telemetry.sinks.spool import read_spool
from telemetry.store import connect, ensure_schema, insert_events
from telemetry.store.queries import rank_phases
from telemetry.store.schema import EVENTS, MIGRATIONS, VERSION_TABLE
from tests.support import telemetry_calls_workloads as cw
from tests.support.telemetry_servers import ROOT, run_ingester

# ts is stored to the microsecond.
US = 2e-6


def _extent(events: list[dict[str, Any]]) -> float:
    """End-to-end seconds of these spans: first start to last end."""
    return max(e["ts"] + e["duration_s"] for e in events) - min(e["ts"] for e in events)


def _calls(dsn: str, job: str, run: str) -> dict[tuple[int | None, int], dict[str, Any]]:
    """``checkpoints`` rows by (step, call); step None for a call that never learned its step.
    The jobs table counts the same calls."""
    client = connect(dsn)
    try:
        rows = dq.checkpoints(client, job=job, run=run).to_dict("records")
        counted = dq.jobs(client).set_index(["job", "run"]).loc[(job, run)]
    finally:
        client.close()
    assert int(counted["saves"]) + int(counted["loads"]) == len(rows)
    return {(None if pd.isna(r["step"]) else int(r["step"]), int(r["call"])): r for r in rows}


def test_a_rank_killed_in_two_loads_in_a_row_shows_each_calls_own_time(chdb_dsn, tmp_path: Path):
    """Neither load has a whole-call span, and the second died reading the metadata (no
    ``load.metadata`` span either): its storage spans went to the first call, whose end-to-end
    time ran on to the second process's death."""
    spool, url = tmp_path / "spool", str(tmp_path / "ckpt")
    cw.save_plain(url, step=3)
    for suffix in (".safetensors", "metadata.msgpack"):
        proc = subprocess.run([sys.executable, "-m", "tests.support.telemetry_calls_workloads", url,
                               str(spool), "calls", "killed", suffix], cwd=ROOT, capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == cw.KILLED_EXIT, proc.stderr
    by_process: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for event in read_spool(spool):
        if event.get("checkpoint") == f"{cw.KILLED}://{url}":
            by_process[event["pid"]].append(event)
    first, second = sorted(by_process.values(), key=lambda events: min(e["ts"] for e in events))
    assert {"load.metadata", "load.plan"} <= {e["name"] for e in first}
    assert second and {e["name"] for e in second} <= {"storage.size", "storage.read"}  # died in there
    run_ingester("--spool", str(spool), "--dsn", chdb_dsn, "--once", "--idle-s", "0.5")
    calls = _calls(chdb_dsn, "calls", "killed")
    # The second call never read the step it loads: it has none.
    assert sorted(calls, key=str) == [(3, 1), (None, 1)]
    for call, events in zip(((3, 1), (None, 1)), (first, second)):
        row = calls[call]
        assert row["e2e_s"] == pytest.approx(_extent(events), abs=US), call
        assert row["start_ts"] == pytest.approx(min(e["ts"] for e in events), abs=US), call
        assert (int(row["ranks"]), bool(row["committed"]), row["blocking_s"]) == (1, False, 0.0), call


def test_an_async_saves_background_spans_stay_in_its_call_when_training_moves_on(chdb_dsn, tmp_path: Path):
    """An async save with no step= takes training's step, and its writes and commit, ended after
    training moved on, carried the next step: they went to the next save of that path (twice
    its bytes), and the async save showed no bytes and no commit."""
    spool, root = tmp_path / "spool", tmp_path / "ckpt"
    done = cw.async_save_then_save_again(root, spool, "calls", "async")
    mine = [e for e in read_spool(spool) if e.get("checkpoint") == done["url"]]
    first = [e for e in mine if e["ts"] < done["between"]]
    second = [e for e in mine if e["ts"] >= done["between"]]
    assert {"save.background", "save.write", "save.commit"} <= {e["name"] for e in first}
    assert any(e["step"] == 2 for e in first if e["name"] == "save.write")  # training moved on
    # The whole call with no step= carries training's step, as its phases do (it carried none).
    assert [e["step"] for e in mine if e["name"] == "save"] == [1, 2]
    run_ingester("--spool", str(spool), "--dsn", chdb_dsn, "--once", "--idle-s", "0.5")
    calls = _calls(chdb_dsn, "calls", "async")
    assert sorted(calls, key=str) == [(1, 1), (2, 1)]
    for call, events, size in zip(((1, 1), (2, 1)), (first, second), done["bytes"]):
        row = calls[call]
        assert (int(row["bytes"]), bool(row["committed"]), int(row["ranks"])) == (size, True, 1), call
        assert row["e2e_s"] == pytest.approx(_extent(events), abs=US), call
        assert row["blocking_s"] == pytest.approx(
            next(e["duration_s"] for e in events if e["name"] == "save"), abs=US), call
    # The alert rules count the writes and the commit at the save's step too: no step-1 save
    # that "never committed" an hour later, and each step's save wrote its own bytes.
    client = connect(chdb_dsn)
    try:
        rows = rank_phases(client, datetime.fromtimestamp(0, tz=timezone.utc), job="calls")
        trend = dq.step_phases(client, job="calls", run="async").to_dict("records")
    finally:
        client.close()
    # The trends page: each step's writes are its own save's.
    writes = {int(r["step"]): r["max_s"] for r in trend if r["phase"] == "save.write"}
    assert writes == {step: pytest.approx(sum(e["duration_s"] for e in events if e["name"] == "save.write"),
                                          abs=10 * US) for step, events in ((1, first), (2, second))}
    assert Uncommitted().evaluate(Window(rows), context=Context(now=time.time() + 3600)) == []
    written = {r["step"]: r["bytes"] for r in rows if r["phase"] == "save.write"}
    assert written == {1: done["bytes"][0], 2: done["bytes"][1]}


def _old_event(name: str, ts: float, duration: float, **kw: Any) -> dict[str, Any]:
    """An event as releases before call ids wrote it."""
    return {"event_id": uuid.uuid4().hex, "name": name, "ts": ts, "duration_s": duration, "outcome": "ok",
            "job": "old", "run": "r", "rank": 0, "world_size": 1, "step": 5, "checkpoint": "/c/latest",
            "checkpoint_op": "save", "attrs": {}, **kw}


def test_a_store_of_the_previous_release_gets_the_column_and_its_rows_keep_their_calls(chdb_dsn):
    """A store made before call ids (schema 2) is migrated when opened: its rows read as they
    did (by timing), and a newer call of the same path and step numbers after them."""
    client = connect(chdb_dsn)
    try:
        ensure_schema_v2(client)
        t = 1_700_000_000.0
        old = [_old_event("save", t, 1.0), _old_event("save.plan", t + 0.1, 0.1),
               _old_event("save.commit", t + 0.5, 0.1)]
        client.insert(EVENTS, [[e["event_id"], e["name"], datetime.fromtimestamp(e["ts"], tz=timezone.utc),
                                e["duration_s"], e["outcome"], e["job"],
                                e["run"], e["rank"], e["step"], e["checkpoint"], e["checkpoint_op"]]
                               for e in old],
                      column_names=["event_id", "name", "ts", "duration_s", "outcome", "job", "run", "rank",
                                    "step", "checkpoint", "checkpoint_op"])
        assert ensure_schema(client) == MIGRATIONS[-1][0]
        call = uuid.uuid4().hex
        # The newer release's call: one of its spans names no step (it reads by the call id).
        insert_events(client, [_old_event("save", t + 100, 1.0, call_id=call),
                               _old_event("save.commit", t + 100.5, 0.1, call_id=call, step=None),
                               _old_event("save.plan", t + 101.5, 2.0, call_id=call, step=9)])
        rows = dq.checkpoints(client, job="old").to_dict("records")
        got = {(int(r["step"]), int(r["call"])): (round(r["e2e_s"], 6), bool(r["committed"])) for r in rows}
        assert got == {(5, 1): (1.0, True), (5, 2): (3.5, True)}
    finally:
        client.close()


def ensure_schema_v2(client: Any) -> None:
    """The tables exactly as the release before call ids made them."""
    client.command(f"CREATE TABLE IF NOT EXISTS {VERSION_TABLE} (version UInt32, description String, "
                   "applied_at DateTime DEFAULT now()) ENGINE = MergeTree ORDER BY version")
    for number, description, statements in MIGRATIONS[:2]:
        for statement in statements:
            client.command(statement)
        client.insert(VERSION_TABLE, [[number, description]], column_names=["version", "description"])
