"""Which save / load call an alert is about, when one path is saved or loaded more than once at
one step (a retry after a failure, an overwrite, a job restarted from the same checkpoint):
the rules merged every call of a (checkpoint, step) and told them apart by counting each
rank's end spans (review of 2026-12-08). Real saves and loads, spooled and stored in chdb; two
ranks played in turn by this process (``tests/support/alert_calls_workloads.py``)."""

from __future__ import annotations

import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from telemetry.alerts import (
    AnyRule,
    Context,
    FailedOps,
    LowThroughput,
    SlowRank,
    Uncommitted,
    UnfinishedRanks,
    Window,
    evaluate,
)
from telemetry.alerts.engine import RuleSet
from telemetry.sinks.spool import read_spool
from telemetry.store import insert_events
from telemetry.store.queries import rank_phases
from tests.support import alert_calls_workloads as ac

STEP = ac.STEP


def _ingest(store: Any, spool: Path) -> float:
    """Store every spooled event (again: a redelivered one counts once); the newest span end."""
    events = list(read_spool(spool))
    insert_events(store, events)
    return max(e["ts"] + e["duration_s"] for e in events)


def _rows(store: Any, job: str) -> list[dict[str, Any]]:
    return rank_phases(store, datetime.fromtimestamp(0, tz=timezone.utc), job=job)


def _every_rule(**slow: float) -> AnyRule:
    return AnyRule((SlowRank(**slow), LowThroughput(), FailedOps(), Uncommitted(), UnfinishedRanks()))


def test_each_calls_slow_rank_is_flagged_not_their_sums(store, tmp_path: Path):
    """Rank 1 was slow writing in the first save of the path, rank 0 in its overwrite: each
    rank's two calls were summed, the sums were equal, and neither slow rank was flagged."""
    spool, url = tmp_path / "spool", str(tmp_path / "ckpt" / "current")
    ac.warm_up(url)
    ac.save(url, spool, "slow", 0)
    ac.save(url, spool, "slow", 1, slow_s=0.5)
    ac.save(url, spool, "slow", 1)
    ac.save(url, spool, "slow", 0, slow_s=0.5)
    end = _ingest(store, spool)
    rules = RuleSet(_every_rule(min_excess_s=0.3))
    found = evaluate(store, rules, now=end + 1)
    got = sorted((a.rule, a.rank, a.step, a.phase, a.subject) for a in found)
    assert got == [("slow_rank", 0, STEP, "save.write", (STEP, 2, 0)),
                   ("slow_rank", 1, STEP, "save.write", (STEP, 1))]
    second = next(a for a in found if a.rank == 0)
    assert "call 2" in second.message and second.details["phases"][0]["duration_s"] >= 0.5
    # The same alerts, the same ids, on every later run: nothing new.
    assert evaluate(store, rules, now=end + 60) == []
    # A window that begins after the first calls still numbers the overwrite call 2 (numbered
    # within the window, it was call 1, and took the first call's alert id).
    starts = sorted(min(e["ts"] for e in read_spool(spool) if e.get("call_id") == call)
                    for call in {e.get("call_id") for e in read_spool(spool)} - {None})
    since = datetime.fromtimestamp(starts[2], tz=timezone.utc)  # rank 1's overwrite
    late = rank_phases(store, since, job="slow")
    assert {r["call"] for r in late} == {2}
    [again] = SlowRank(min_excess_s=0.3).evaluate(Window(late), context=Context(now=end + 60))
    assert again.alert_id == second.alert_id


def test_a_rank_killed_in_a_load_is_reported_for_that_call_not_again_after_the_reload(store, tmp_path: Path):
    """Rank 1 was killed in the first load, and the job restarted and loaded the same checkpoint
    again on both ranks: rank 1 had then ended one load, rank 0 two, and rank 1 was reported a
    second time, for the reload that every rank finished ("call 2")."""
    spool, url = tmp_path / "spool", str(tmp_path / "ckpt" / "current")
    ac.warm_up(url)
    ac.load(url, spool, "killed", 0)
    ac.killed_load(url, spool, "killed", 1)
    end = _ingest(store, spool)
    rules = RuleSet(UnfinishedRanks(after_s=300))
    [first] = evaluate(store, rules, now=end + 400)
    assert (first.rank, first.step, first.subject) == (1, STEP, (STEP,))
    # Seen last in the load it died in (ending its plan, or sizing the file it was to read).
    assert "call" not in first.message
    assert first.details["unfinished"]["1"]["last_phase"] in ("load.plan", "storage.size")
    ac.load(url, spool, "killed", 0)
    ac.load(url, spool, "killed", 1)
    end = _ingest(store, spool)
    assert evaluate(store, rules, now=end + 400) == []
    # Read afresh, the killed call is still the one reported, under the same id.
    rows = _rows(store, "killed")
    again = UnfinishedRanks(after_s=300).evaluate(Window(rows), context=Context(now=end + 400))
    assert [a.alert_id for a in again] == [first.alert_id]


def test_a_retry_in_progress_is_not_reported_for_the_failed_calls_age(store, tmp_path: Path):
    """A save failed, and its retry began a second later and was still writing: the retry was
    reported uncommitted ("call 2") as old as the failed call, before its own deadline."""
    spool, url = tmp_path / "spool", str(tmp_path / "ckpt" / "current")
    rules = RuleSet(Uncommitted(deadline_s=2.0))
    ac.failed_gated_save(url, spool, "retry", 0)
    time.sleep(1.0)
    started, finish = ac.stuck_save(url, spool, "retry", 0)
    try:
        _ingest(store, spool)
        assert evaluate(store, rules, now=started + 1.5) == []
        # The retry itself past its deadline is reported, as call 2.
        [late] = evaluate(store, rules, now=started + 2.5)
        assert late.subject == (STEP, 2) and "call 2" in late.message
    finally:
        finish()
    _ingest(store, spool)
    assert evaluate(store, rules, now=started + 3600) == []  # committed: nothing more
    # With a deadline shorter than the wait before the retry, the failed call was overdue while
    # it was the newest: it alone is reported, for as long as it stayed so, however late.
    rows = _rows(store, "retry")
    [failed] = Uncommitted(deadline_s=0.5).evaluate(Window(rows), context=Context(now=started + 3600))
    assert (failed.subject, failed.call) == ((STEP,), 1) and 1.0 <= failed.value < 3.0
    assert "before the next save of the path at that step began" in failed.message


def test_a_second_failure_of_one_step_is_its_own_alert(store, tmp_path: Path):
    """A save failed, and its retry failed too: the second failure was merged into the first's
    alert (the same id), so it was never raised."""
    spool, url = tmp_path / "spool", str(tmp_path / "ckpt" / "current")
    rules = RuleSet(FailedOps())
    ac.save(url, spool, "fail", 0, fail=True)
    end = _ingest(store, spool)
    [first] = [a for a in evaluate(store, rules, now=end + 1) if a.severity == "error"]
    assert first.subject == ("error", STEP)
    ac.save(url, spool, "fail", 0, fail=True)
    end = _ingest(store, spool)
    [second] = [a for a in evaluate(store, rules, now=end + 1) if a.severity == "error"]
    assert second.subject == ("error", STEP, 2) and second.alert_id != first.alert_id
    assert f"(step {STEP}) on ranks" in first.message
    assert f"(step {STEP}, call 2) on ranks" in second.message


def test_a_successful_overwrite_raises_no_failure_alert(store, tmp_path: Path):
    """Saving over a checkpoint probes its path with a size() that answers "a directory": the
    storage event ended in error, and every successful overwrite raised a failed_ops error."""
    spool, url = tmp_path / "spool", str(tmp_path / "ckpt" / "current")
    ac.warm_up(url)
    ac.save(url, spool, "over", 0)
    end = _ingest(store, spool)
    assert evaluate(store, RuleSet(FailedOps()), now=end + 1) == []
    [probe] = [e for e in read_spool(spool) if e["name"] == "storage.size" and e["path"] == url]
    assert (probe["outcome"], probe["attrs"]["answer"]) == ("ok", "IsADirectoryError")
