"""The dashboard's split of one path's saves and loads into calls when a rank never ended a call
(review of 2026-11-28): a rank hung in call 2 has no whole-call span for it, and its call-2
phases were counted in call 1 (call 2 showed one rank, call 1 that rank twice); a call that no
rank ended was missing from the checkpoints and jobs tables."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest
from streamlit.testing.v1 import AppTest

from dashboard import queries as dq
from dashboard import store
from telemetry.store import insert_events

PAGES = Path(__file__).resolve().parents[2] / "dashboard" / "app_pages"
T0 = 1_700_000_000.0
SAVE_PHASES = ("save.collect", "save.plan", "save.write", "save.commit")


def _event(rank: int, name: str, ts: float, duration: float, *, ckpt: str, op: str = "save",
           step: int | None = 5) -> dict[str, Any]:
    return {"event_id": uuid.uuid4().hex, "name": name, "ts": ts, "duration_s": duration, "outcome": "ok",
            "job": "j", "run": "r", "rank": rank, "world_size": 2, "step": step, "checkpoint": ckpt,
            "checkpoint_op": op, "host": "vm", "bytes": 10 if name in ("save.write", "load.read") else None,
            "attrs": {}}


def _save(rank: int, t: float, *, ckpt: str, step: int, ended: bool) -> list[dict[str, Any]]:
    """One rank's save call started at ``t``; a rank that never ended it got as far as its plan."""
    names = SAVE_PHASES if ended else SAVE_PHASES[:2]
    events = [_event(rank, name, t + 0.01 + 0.2 * i, 0.1, ckpt=ckpt, step=step)
              for i, name in enumerate(names)]
    return events + ([_event(rank, "save", t, 1.0, ckpt=ckpt, step=step)] if ended else [])


def _load(rank: int, t: float, *, ended: bool) -> list[dict[str, Any]]:
    # The read lease's check comes before the metadata names the step.
    events = [_event(rank, "storage.exists", t + 0.005, 0.001, ckpt="/c/latest", op="load", step=None),
              _event(rank, "load.metadata", t + 0.01, 0.1, ckpt="/c/latest", op="load"),
              _event(rank, "load.read", t + 0.2, 0.1, ckpt="/c/latest", op="load")]
    return events + ([_event(rank, "load", t, 1.0, ckpt="/c/latest", op="load")] if ended else [])


def _dataset() -> list[dict[str, Any]]:
    """/c/latest (step 5): saved twice, rank 1 hung in call 2; loaded twice, rank 1 hung in
    call 2. /c/other (step 7): call 1 ended everywhere, call 2 ended by no rank."""
    events = [e for r in (0, 1) for e in _save(r, T0, ckpt="/c/latest", step=5, ended=True)]
    events += [e for r in (0, 1) for e in _save(r, T0 + 100, ckpt="/c/latest", step=5, ended=r == 0)]
    events += [e for r in (0, 1) for e in _save(r, T0 + 200, ckpt="/c/other", step=7, ended=True)]
    events += [e for r in (0, 1) for e in _save(r, T0 + 300, ckpt="/c/other", step=7, ended=False)]
    events += [e for r in (0, 1) for e in _load(r, T0 + 400, ended=True)]
    events += [e for r in (0, 1) for e in _load(r, T0 + 500, ended=r == 0)]
    return events


@pytest.fixture(scope="module")
def dsn(tmp_path_factory) -> str:
    dsn = f"chdb://{tmp_path_factory.mktemp('calls') / 'store'}"
    store.run_query(dsn, insert_events, events=_dataset())
    yield dsn
    store.close()


def test_every_call_is_its_own_row_with_the_ranks_in_it(dsn):
    ckpts = store.run_query(dsn, dq.checkpoints)
    got = {(r.checkpoint, r.op, int(r.step), int(r.call)): (int(r.ranks), bool(r.committed))
           for r in ckpts.itertuples()}
    assert got == {
        ("/c/latest", "save", 5, 1): (2, True), ("/c/latest", "save", 5, 2): (2, True),
        ("/c/other", "save", 7, 1): (2, True), ("/c/other", "save", 7, 2): (2, False),
        ("/c/latest", "load", 5, 1): (2, False), ("/c/latest", "load", 5, 2): (2, False),
    }
    # Each call spans its own second, not up to the next call's hung phases.
    assert ckpts["e2e_s"].max() < 1.5
    jobs = store.run_query(dsn, dq.jobs).set_index("job")
    assert jobs.loc["j", ["saves", "loads"]].tolist() == [4, 2]


def test_a_calls_phases_are_its_own_and_not_the_previous_calls(dsn):
    def phases(ckpt: str, step: int, call: int, op: str = "save") -> dict[tuple[int, str], int]:
        df = store.run_query(dsn, dq.rank_phases, job="j", run="r", checkpoint=ckpt, op=op, step=step,
                             call=call)
        return {(int(r.rank), r.phase): int(r.spans) for r in df.itertuples()}

    first = phases("/c/latest", 5, 1)
    assert set(first.values()) == {1} and len(first) == 2 * (len(SAVE_PHASES) + 1)
    assert phases("/c/latest", 5, 2) == {**{(0, n): 1 for n in ("save", *SAVE_PHASES)},
                                         (1, "save.collect"): 1, (1, "save.plan"): 1}
    assert phases("/c/other", 7, 2) == {(r, n): 1 for r in (0, 1) for n in SAVE_PHASES[:2]}
    assert phases("/c/latest", 5, 2, "load") == {(0, "load"): 1, (0, "load.metadata"): 1, (0, "load.read"): 1,
                                                 (1, "load.metadata"): 1, (1, "load.read"): 1}


def test_the_pages_show_the_hung_call(dsn, monkeypatch):
    monkeypatch.setenv(store.DSN_ENV, dsn)
    at = AppTest.from_file(str(PAGES / "overview.py"), default_timeout=60).run()
    assert not at.exception, [e.value for e in at.exception]
    metrics = {m.label: m.value for m in at.metric}
    assert (metrics["Saves"], metrics["Loads"]) == ("4", "2")
    assert sorted(at.dataframe[1].value["ranks"]) == [2] * 6
    at = AppTest.from_file(str(PAGES / "timeline.py"), default_timeout=60)
    for key, value in {"job": "j", "run": "r", "checkpoint": "/c/latest", "op": "save", "step": "5",
                       "call": "2"}.items():
        at.query_params[key] = value
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    assert at.multiselect(key="ranks:save:j/r:/c/latest:5:2").value == [0, 1]
    spec = json.loads(next(c for c in at.get("plotly_chart") if "timeline" in c.proto.id).proto.spec)
    assert spec["data"]
