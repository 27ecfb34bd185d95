"""Saves and loads of one path at one step called more than once (a retry, an overwrite), and
alert windows that begin in the middle of a call (review of 2026-11-28)."""

from __future__ import annotations

import time
import uuid
from typing import Any

from dashboard import queries as dq
from telemetry.alerts import Context, Uncommitted, UnfinishedRanks, Window, evaluate
from telemetry.alerts.engine import RuleSet
from telemetry.store import insert_events


def _event(rank: int, name: str, ts: float, duration: float, *, job: str = "j", step: int | None = 5,
           ckpt: str = "/c/latest", **kw: Any) -> dict[str, Any]:
    return {"event_id": uuid.uuid4().hex, "name": name, "ts": ts, "duration_s": duration, "outcome": "ok",
            "job": job, "run": "r", "rank": rank, "world_size": 2, "step": step, "checkpoint": ckpt,
            "checkpoint_op": "save", "attrs": {}, **kw}


def _call(rank: int, t: float, *, finished: bool = True, **kw: Any) -> list[dict[str, Any]]:
    """One rank's spans of one save call started at ``t``: its plan, then (if ``finished``)
    its commit and the whole call."""
    events = [_event(rank, "save.plan", t, 0.1, **kw)]
    if finished:
        events += [_event(rank, "save.commit", t + 0.5, 0.1, **kw), _event(rank, "save", t, 1.0, **kw)]
    return events


def _row(rank: int, phase: str, start: float, duration: float = 1.0, spans: int = 1) -> dict[str, Any]:
    return {"job": "j", "run": "r", "checkpoint": "/c/latest", "op": "save", "rank": rank, "phase": phase,
            "step": 5, "spans": spans, "duration_s": duration, "bytes": 0, "errors": 0, "retries": 0,
            "start_ts": start, "end_ts": start + duration, "sample_error": ""}


def test_a_rank_that_never_ended_a_repeated_call_of_one_step_is_named(store):
    """The rows of both calls were merged: rank 1's end span of the first call hid that it
    never ended the second (a retry, or an overwrite=True save of the same step)."""
    t = time.time() - 10_000
    rules = RuleSet(UnfinishedRanks(after_s=300))
    insert_events(store, [e for r in range(2) for e in _call(r, t)])
    second = _call(0, t + 100) + _call(1, t + 100, finished=False)
    insert_events(store, second)
    insert_events(store, second)  # delivered twice (at least once): still one span each
    [alert] = evaluate(store, rules, now=t + 1000)
    assert (alert.rank, alert.step, alert.phase) == (1, 5, "save.plan")
    assert "(step 5, call 2)" in alert.message and "1 other rank(s)" in alert.message
    assert evaluate(store, rules, now=t + 1100) == []  # one alert per incident
    # A third call that rank 1 never ends either is a new incident, not the same alert again.
    insert_events(store, _call(0, t + 2000))
    [third] = evaluate(store, rules, now=t + 3000)
    assert third.rank == 1 and third.alert_id != alert.alert_id and "call 3" in third.message
    # Both ended both calls: nothing, and a first call alone keeps its alert id.
    rows = [_row(r, "save", 1000.0, spans=2) for r in range(2)]
    assert UnfinishedRanks().evaluate(Window(rows), context=Context(now=9000)) == []
    once = UnfinishedRanks().evaluate(Window([_row(0, "save", 1000.0), _row(1, "save.plan", 1000.0)]),
                                      context=Context(now=9000))
    assert [a.subject for a in once] == [(5,)]


def test_a_repeated_call_that_never_commits_is_reported_despite_the_first_calls_commit(store):
    """The first call's commit hid a retry (or overwrite) of the same step that hung on every
    rank, or on the only one: no alert at all."""
    t = time.time() - 10_000
    rules = RuleSet(Uncommitted(deadline_s=900))
    insert_events(store, _call(0, t) + _call(0, t + 100, finished=False))
    assert evaluate(store, rules, now=t + 900) == []  # the retry's deadline has not passed
    [alert] = evaluate(store, rules, now=t + 1100)
    assert alert.step == 5 and "(step 5, call 2)" in alert.message
    # A retry that committed is fine.
    insert_events(store, _call(0, t, job="ok") + _call(0, t + 100, job="ok"))
    assert evaluate(store, rules, now=t + 5000, job="ok") == []


def test_a_job_restarted_with_fewer_ranks_that_saves_the_step_again_is_not_reported():
    """Ranks 2 and 3 ended one call, ranks 0 and 1 two: those above the newest call's world
    size were not in it."""
    rows = [{**_row(r, "save", 1000.0, spans=2 if r < 2 else 1), "world_size": 2 if r < 2 else 4}
            for r in range(4)]
    assert UnfinishedRanks().evaluate(Window(rows), context=Context(now=9000)) == []
    rows[1] = {**rows[1], "spans": 1, "world_size": 4}  # rank 1 of the smaller job never ended
    [alert] = UnfinishedRanks().evaluate(Window(rows), context=Context(now=9000))
    assert "rank(s) [1] did not finish" in alert.message


def test_a_repeated_async_call_waits_for_every_ranks_background_write():
    rows = [_row(r, "save", 1000.0, spans=2) for r in range(2)]
    rows += [_row(0, "save.background", 1001.0, 2.5, spans=2), _row(1, "save.background", 1001.0, 2.5)]
    [alert] = UnfinishedRanks(after_s=300).evaluate(Window(rows), context=Context(now=2000))
    assert alert.rank == 1 and "call 2" in alert.message
    # A rank with a background span ended that call's save span, even one the window cut off.
    cut = [_row(0, "save", 1000.0), _row(0, "save.background", 1001.0), _row(1, "save.background", 1001.0)]
    assert UnfinishedRanks(after_s=300).evaluate(Window(cut), context=Context(now=2000)) == []


def test_a_call_cut_by_the_windows_start_is_not_reported_unfinished(store):
    """Rows were in the window by their start: rank 1's save span began half a second before
    the window, its plan after, and a save finished on every rank a day ago was reported as
    never finished by rank 1."""
    now = time.time()
    since = now - 86_400
    insert_events(store, [_event(0, "save", since + 0.5, 3.0), _event(0, "save.plan", since + 0.6, 0.1),
                          _event(1, "save", since - 0.5, 4.0), _event(1, "save.plan", since + 0.6, 0.1)])
    assert evaluate(store, RuleSet(UnfinishedRanks(), window_s=86_400), now=now) == []


def test_the_jobs_table_counts_calls_not_paths(store):
    """A "latest" path saved three times counted as one save."""
    t = time.time() - 1000
    events = [e for k, step in enumerate((1, 2, 2)) for r in range(2)
              for e in _call(r, t + 10 * k, step=step)]
    events += [_event(r, "load", t + 40 + k, 1.0, ckpt="/c/latest", checkpoint_op="load", step=2)
               for k in range(2) for r in range(2)]
    events += [_event(0, "train.step", t, 1.0, job="k", ckpt="", checkpoint_op="", step=None)]
    insert_events(store, events)
    jobs = dq.jobs(store).set_index("job")
    assert jobs.loc["j", ["saves", "loads"]].tolist() == [3, 2]
    assert jobs.loc["k", ["saves", "loads"]].tolist() == [0, 0]
    assert len(dq.checkpoints(store, job="j")) == 5


def test_a_thousand_hung_ranks_make_a_message_of_bounded_length():
    t0 = 1_000_000.0
    rows = [{"job": "j", "run": "r", "checkpoint": "/c/5", "op": "save", "step": 5, "rank": rank,
             "phase": phase, "start_ts": t0, "end_ts": t0 + 1, "duration_s": 1.0, "spans": 1,
             "errors": 0, "world_size": 1001}
            for rank in range(1001) for phase in (("save.plan", "save") if rank == 0 else ("save.plan",))]
    alerts = UnfinishedRanks(after_s=10).evaluate(Window(rows), context=Context(now=t0 + 100))
    assert len(alerts) == 1
    assert len(alerts[0].message) < 2000 and "and 984 more" in alerts[0].message
    assert len(alerts[0].details["unfinished"]) == 1000
