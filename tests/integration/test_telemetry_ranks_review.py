"""Do telemetry and alerts tell the truth about ranks? Slow ranks of small groups, ranks that
never finished a save, the step a load records, saves to one path kept apart on the dashboard,
and one alert per failed save (review of 2026-11-27)."""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

from dashboard import frames
from dashboard import queries as dq
from telemetry.alerts import Context, FailedOps, SlowRank, UnfinishedRanks, Window, evaluate
from telemetry.alerts.engine import RuleSet, rules_from_config
from telemetry.store import insert_events
from tests.support import telemetry_ranks_workloads as tw


def _row(rank: int, phase: str, duration: float, start: float = 1000.0, **kw: Any) -> dict[str, Any]:
    return {"job": "j", "run": "r", "checkpoint": "/c/step_1", "op": "save", "rank": rank, "phase": phase,
            "step": 1, "spans": 1, "duration_s": duration, "bytes": 0, "errors": 0, "retries": 0,
            "start_ts": start, "end_ts": start + duration, "sample_error": "", **kw}


def _event(rank: int, name: str, ts: float, duration: float, step: int, ckpt: str = "/c/step_1",
           **kw: Any) -> dict[str, Any]:
    return {"event_id": uuid.uuid4().hex, "name": name, "ts": ts, "duration_s": duration, "outcome": "ok",
            "job": "j", "run": "r", "rank": rank, "world_size": 4, "step": step, "checkpoint": ckpt,
            "checkpoint_op": "save", "attrs": {}, **kw}


def _slow(rows: list[dict[str, Any]]) -> list[tuple[Any, str]]:
    return [(a.rank, a.phase) for a in SlowRank().evaluate(Window(rows), context=Context(now=0))]


# -- a) a slow rank of two or three -----------------------------------------------------


def test_one_slow_rank_of_two_or_three_is_flagged_and_jitter_or_waiting_is_not():
    """With two ranks the median is halfway between them and the MAD half their gap: one rank
    10x slower than the other scored 0.67 and was never flagged; with three, one 20 s rank
    beside 1 s and 5 s ones neither."""
    assert _slow([_row(0, "save.write", 1.0), _row(1, "save.write", 10.0)]) == [(1, "save.write")]
    three = [_row(0, "save.write", 1.0), _row(1, "save.write", 5.0), _row(2, "save.write", 20.0)]
    assert _slow(three) == [(2, "save.write")]
    [alert] = SlowRank().evaluate(Window(three), context=Context(now=0))
    assert "other ranks' median 3.000 s" in alert.message
    # Jitter: 1.45x, or 8x but a third of a second.
    assert _slow([_row(0, "save.write", 2.0), _row(1, "save.write", 2.9)]) == []
    assert _slow([_row(0, "save.write", 0.05), _row(1, "save.write", 0.4)]) == []
    # Rank 0 waits in the commit for slow rank 1: long, but it ends when rank 1 does.
    waiting = [_row(0, "save.write", 1.0), _row(1, "save.write", 10.0),
               _row(0, "save.commit", 9.1, start=1001.0), _row(1, "save.commit", 0.1, start=1010.0)]
    assert _slow(waiting) == [(1, "save.write")]
    # A rules file that keeps two-rank groups out still can.
    rule = rules_from_config({"rules": [{"type": "slow_rank", "min_ranks": 3}]}).rule.rules[0]
    assert rule.evaluate(Window([_row(0, "save.write", 1.0), _row(1, "save.write", 10.0)]),
                         context=Context(now=0)) == []


# -- b) a rank that never finished -------------------------------------------------------


def _save(rank: int, t: float, *, finished: bool = True, background: bool | None = None) -> list[dict]:
    """One rank's events of a save of step 1 started at ``t``: collect and plan, then (if
    ``finished``) its write and the whole call; an async save (``background`` not None) also
    has its background scope, ended when ``background`` is True."""
    events = [_event(rank, "save.collect", t, 0.1, 1), _event(rank, "save.plan", t + 0.1, 0.2, 1)]
    if finished:
        events += [_event(rank, "save.stage", t + 0.3, 0.5, 1), _event(rank, "save", t, 1.0, 1)]
    if background:
        events += [_event(rank, "save.write", t + 1.0, 2.0, 1),
                   _event(rank, "save.background", t + 1.0, 2.5, 1)]
    return events


def test_a_rank_that_never_finished_a_save_is_named_with_where_it_was_last_seen(store):
    t = time.time() - 10_000
    rules = RuleSet(UnfinishedRanks(after_s=300))
    # Every rank still inside its save (no whole-call span yet): nothing, however long.
    insert_events(store, [e for r in range(4) for e in _save(r, t, finished=False)])
    assert evaluate(store, rules, now=t + 5000) == []
    # Ranks 0-2 end at t + 1; rank 3 was last seen ending its plan.
    insert_events(store, [e for r in range(3) for e in _save(r, t)])
    assert evaluate(store, rules, now=t + 200) == []  # within the limit
    [alert] = evaluate(store, rules, now=t + 400)
    assert (alert.rule, alert.rank, alert.step, alert.phase) == ("unfinished_ranks", 3, 1, "save.plan")
    assert "rank(s) [3] did not finish" in alert.message and "3 other rank(s)" in alert.message
    assert evaluate(store, rules, now=t + 500) == []  # one alert per incident
    assert "unfinished_ranks" in {type(r).name for r in rules_from_config(
        {"rules": [{"type": "unfinished_ranks", "after_s": 60}]}).rule.rules}


def test_an_async_saves_background_write_is_waited_for_until_the_limit():
    t = 1000.0
    rows = [*(_row(r, "save", 1.0, start=t) for r in range(3)),
            *(_row(r, "save.background", 2.5, start=t + 1.0) for r in range(3))]
    rule = UnfinishedRanks(after_s=300)
    # All ranks writing in the background, none done: still in progress (uncommitted covers it).
    assert rule.evaluate(Window(rows[:3]), context=Context(now=t + 5000)) == []
    # Ranks 0 and 1 done at t + 3.5, rank 2 still writing.
    done = [r for r in rows if not (r["phase"] == "save.background" and r["rank"] == 2)]
    assert rule.evaluate(Window(done), context=Context(now=t + 200)) == []
    [alert] = rule.evaluate(Window(done), context=Context(now=t + 400))
    assert (alert.rank, alert.phase) == (2, "save")
    assert rule.evaluate(Window(rows), context=Context(now=t + 5000)) == []  # all ended


# -- c) the step a load records --------------------------------------------------------


def test_a_load_records_the_step_of_the_checkpoint_it_loads(tmp_path: Path):
    """A load's spans carried the process's step (the last save's, 9), not the step of the
    checkpoint loaded (5)."""
    events = tw.load_after_a_later_save(tmp_path / "ckpt", tmp_path / "spool")
    steps = {(e["name"], e["step"]) for e in events if e["name"].startswith("load")}
    assert {"load", "load.metadata", "load.plan", "load.apply"} <= {name for name, _ in steps}
    assert {step for _, step in steps} == {5}
    # Storage ops before the metadata names the step carry none rather than step 9.
    assert {e["step"] for e in events} <= {5, None}


# -- d) saves to one path on the dashboard --------------------------------------------


def test_saves_to_one_path_are_separate_rows_on_the_dashboard(store):
    """A "latest" path saved at steps 1 and 2 and overwritten at step 2 was one row: bytes
    summed over the three saves, the newest step, committed because an earlier save was."""
    t = time.time() - 1000
    events = []
    for step, start in ((1, t), (2, t + 10), (2, t + 20)):
        for r in range(2):
            events += [_event(r, "save", start, 2.0, step, "/c/latest"),
                       _event(r, "save.write", start + 0.5, 1.0, step, "/c/latest", bytes=100),
                       _event(r, "save.commit", start + 1.6, 0.1, step, "/c/latest")]
    # Step 3: rank 0 hung after its plan (no whole-call span), rank 1 has not reported yet.
    events.append(_event(0, "save.plan", t + 30, 0.1, 3, "/c/latest"))
    insert_events(store, events)
    rows = dq.checkpoints(store, job="j").sort_values("start_ts")
    assert rows[["step", "call", "ranks", "bytes", "committed"]].values.tolist() == [
        [1, 1, 2, 200, 1], [2, 1, 2, 200, 1], [2, 2, 2, 200, 1], [3, 1, 1, 0, 0]]
    labels = [frames.checkpoint_label(r) for _, r in rows.iterrows()]
    assert len(set(labels)) == 4 and "save step 2 (call 2) · /c/latest · j/r" in labels
    overwrite = dq.rank_phases(store, job="j", run="r", checkpoint="/c/latest", op="save", step=2, call=2)
    # Stored to the microsecond: t + 20 may come back a hair below it.
    assert set(overwrite["spans"]) == {1} and overwrite["start_ts"].min() >= t + 20 - 1e-5
    hung = dq.rank_phases(store, job="j", run="r", checkpoint="/c/latest", op="save", step=3, call=1)
    assert hung[["rank", "phase"]].values.tolist() == [[0, "save.plan"]]


# -- e) one alert per failed save -----------------------------------------------------


def test_a_failed_save_raises_one_alert_that_names_the_failed_operation(store, tmp_path: Path):
    """A write that fails for good fails its storage op, the phase, the finish and the whole
    call: four `failed_ops` alerts for one incident."""
    events = tw.failed_save(tmp_path / "ckpt", tmp_path / "spool")
    failed = [e for e in events if e["outcome"] == "error"]
    assert {e["name"] for e in failed} >= {"storage.write", "save.write", "save"}
    rules = RuleSet(FailedOps())
    # The storage op's span reaches the store first, the rest later: still one alert.
    insert_events(store, [e for e in events if e["name"] == "storage.write"])
    [alert] = evaluate(store, rules)
    insert_events(store, events)
    assert evaluate(store, rules) == []
    assert (alert.phase, alert.step, alert.rank) == ("storage.write", 5, 0)
    assert "injected fault" in alert.message
    # Evaluated on everything at once, it names every failed span after the cause.
    rows = [{"job": "ranks", "run": "r", "checkpoint": e["checkpoint"], "op": e["checkpoint_op"],
             "rank": 0, "phase": e["name"], "step": 5, "errors": 1, "retries": 0,
             "start_ts": e["ts"], "end_ts": e["ts"] + e["duration_s"], "sample_error": e["error"]}
            for e in failed]
    [again] = FailedOps().evaluate(Window(rows), context=Context(now=0))
    assert again.phase == "storage.write" and "then save.write" in again.message
    assert set(again.details["failed_ranks_by_phase"]) == {e["name"] for e in failed}
    assert again.alert_id == alert.alert_id

