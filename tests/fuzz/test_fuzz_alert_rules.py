"""Fuzzing the telemetry alert rules (slow_rank, unfinished_ranks, uncommitted, failed_ops).

The rules read the rows of ``telemetry.store.queries.rank_phases``: every column present, one
row per (job, run, checkpoint, op, step, rank, phase), ``rank`` never NULL, but times and
durations are the clients' own (a NaN or negative duration, so a NaN end; huge; skewed
between hosts; start times come from a DateTime64 column, so are finite). For any such
rows a rule never raises, and its alert ids do not depend on the order of the rows; for a
generated healthy save or load (every rank ends every phase within a jitter) none fires.
"""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from telemetry.alerts.base import Context, Window
from telemetry.alerts.failures import FailedOps
from telemetry.alerts.slow_rank import SlowRank
from telemetry.alerts.uncommitted import Uncommitted
from telemetry.alerts.unfinished import UnfinishedRanks
from telemetry.schema import COMMIT_SPAN
from tests.fuzz.strategies import fuzz_settings

pytestmark = pytest.mark.fuzz

RULES = (SlowRank(), UnfinishedRanks(), Uncommitted(), FailedOps())
PHASES = ("save", "load", "save.collect", "save.plan", "save.stage", "save.write", "save.background",
          COMMIT_SPAN, "save.finish", "load.plan", "load.read", "storage.write", "storage.read", "other")

_times = st.one_of(st.floats(1.7e9, 1.8e9), st.floats(-1e6, 1e6),
                   st.sampled_from((math.nan, math.inf, -math.inf, 0.0, 1e300)),
                   st.floats(allow_nan=True, allow_infinity=True))
# start_ts is min(toFloat64(ts)) of a DateTime64 column: finite, but any client's clock.
_starts = st.floats(1.7e9, 1.8e9) | st.floats(-1e6, 1e6) | st.floats(-1e12, 1e12) | st.just(0.0)
_durations = st.one_of(st.floats(0, 100), st.sampled_from((math.nan, -1.0, 0.0, 1e300, math.inf)),
                       st.floats(allow_nan=True, allow_infinity=True))
_counts = st.integers(0, 3) | st.sampled_from((2**31, 10**12))
_rows = st.fixed_dictionaries({
    "job": st.sampled_from(("j", "k")), "run": st.sampled_from(("r", "")),
    "checkpoint": st.sampled_from(("/c/a", "/c/b", "")), "op": st.sampled_from(("save", "load", "", "tier")),
    "rank": st.integers(0, 5) | st.sampled_from((-1, 2**31 - 1)), "phase": st.sampled_from(PHASES),
    "step": st.none() | st.integers(0, 3) | st.just(-(2**63)), "spans": _counts.map(lambda n: max(n, 1)),
    "duration_s": _durations, "bytes": _counts, "errors": _counts, "retries": _counts,
    "start_ts": _starts, "end_ts": _times, "sample_error": st.text(max_size=6),
    "world_size": st.none() | st.integers(-1, 8) | st.just(2**31 - 1),
})


def _unique(rows: list[dict]) -> list[dict]:
    """One row per key, as the query's GROUP BY gives."""
    keys = ("job", "run", "checkpoint", "op", "step", "rank", "phase")
    return list({tuple(r[k] for k in keys): r for r in rows}.values())


def _ids(rule, rows: list[dict], now: float) -> list[str]:
    return sorted(a.alert_id for a in rule.evaluate(Window(rows), context=Context(now=now)))


_HOSTILE = {
    "duration_s": _durations, "start_ts": _starts, "end_ts": _times,
    "spans": _counts.map(lambda n: max(n, 1)), "errors": _counts, "retries": _counts,
    "world_size": st.none() | st.integers(-1, 8),
    "step": st.none() | st.integers(0, 3), "phase": st.sampled_from(PHASES),
}


@st.composite
def _damaged_calls(draw) -> list[dict]:
    """Healthy saves and loads, then rows dropped, fields made hostile, ranks' clocks skewed
    and phases made slow: rows the rules act on, not only ones they skip."""
    rows = []
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(("save", "load")))
        rows += _healthy(op, draw(st.integers(1, 6)), draw(st.integers(0, 2)), 1.7e9, 0.3,
                         draw(st.integers(0, 2**32)), op == "save" and draw(st.booleans()))
    for _ in range(draw(st.integers(0, 6))):
        i = draw(st.integers(0, len(rows) - 1))
        kind = draw(st.sampled_from(("drop", "field", "slow", "skew")))
        if kind == "drop" and len(rows) > 1:
            rows.pop(i)
        elif kind == "field":
            name = draw(st.sampled_from(sorted(_HOSTILE)))
            rows[i] = {**rows[i], name: draw(_HOSTILE[name])}
        elif kind == "slow":
            rows[i] = {**rows[i], "duration_s": rows[i]["duration_s"] * draw(st.floats(2, 1e4))}
        else:  # one rank's host clock is off
            rank, skew = rows[i]["rank"], draw(st.floats(-1e4, 1e4))
            rows = [{**r, "start_ts": r["start_ts"] + skew, "end_ts": r["end_ts"] + skew}
                    if r["rank"] == rank else r for r in rows]
    return _unique(rows)


@fuzz_settings(200)
@given(st.lists(_rows, max_size=24).map(_unique) | _damaged_calls(), _starts | st.floats(1.7e9, 1.7e9 + 1e4),
       st.randoms(use_true_random=False))
def test_rules_never_raise_and_their_alert_ids_do_not_depend_on_row_order(rows, now, rnd):
    shuffled = rows[:]
    rnd.shuffle(shuffled)
    for rule in RULES:
        alerts = rule.evaluate(Window(rows), context=Context(now=now))
        for a in alerts:
            a.to_row(1.7e9)  # what the engine stores: never raises either
        assert sorted(a.alert_id for a in alerts) == _ids(rule, shuffled, now), rule.name


def _healthy(op: str, world: int, step: int | None, t0: float, jitter: float, seed: int,
             background: bool = False, skew: float = 0.0) -> list[dict]:
    """Every rank ends every phase of one save or load within ``jitter`` s of the others; a
    ``background`` save ends its write after the call; each host's clock is off by up to
    ``skew`` s."""
    rng = random.Random(seed)
    phases = (("save.collect", 0.1), ("save.plan", 0.2), ("save.stage", 1.0)) if op == "save" else (
        ("load.plan", 0.2), ("load.read", 3.0))
    later = (("save.write", 2.0), (COMMIT_SPAN, 0.5)) if op == "save" else ()
    rows = []
    for rank in range(world):
        start = t = t0 + rng.uniform(0, jitter) + rng.uniform(-skew, skew)
        for phase, took in phases + (() if background else later):
            d = took + rng.uniform(0, jitter)
            rows.append(_row(op, rank, phase, step, t, d, world))
            t += d
        rows.append(_row(op, rank, op, step, start, t - start, world))
        if background:
            begun = t
            for phase, took in later:
                d = took + rng.uniform(0, jitter)
                rows.append(_row(op, rank, phase, step, t, d, world))
                t += d
            rows.append(_row(op, rank, "save.background", step, begun, t - begun, world))
    return rows


def _row(op: str, rank: int, phase: str, step: int | None, start: float, took: float, world: int) -> dict:
    return {"job": "j", "run": "r", "checkpoint": "/c/step", "op": op, "rank": rank, "phase": phase,
            "step": step, "spans": 1, "duration_s": took, "bytes": 100, "errors": 0, "retries": 0,
            "start_ts": start, "end_ts": start + took, "sample_error": "", "world_size": world}


@fuzz_settings(200)
@given(st.sampled_from(("save", "load")), st.integers(1, 40), st.none() | st.integers(0, 10**6),
       st.floats(1.6e9, 1.8e9), st.floats(0, 0.5), st.integers(0, 2**32), st.floats(0, 1e6), st.booleans(),
       st.floats(0, 60))
def test_a_healthy_save_or_load_raises_no_alert(op, world, step, t0, jitter, seed, after, background, skew):
    rows = _healthy(op, world, step, t0, jitter, seed, background and op == "save", skew)
    now = max(r["end_ts"] for r in rows) + after
    for rule in RULES:
        assert rule.evaluate(Window(rows), context=Context(now=now)) == [], rule.name
