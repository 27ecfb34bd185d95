"""The alert rules' read queries: parameterized SQL, rows as dicts.

Every function takes a clickhouse-connect client and returns ``list[dict]`` (column -> value),
so the alert evaluator needs no pandas. Events are read with FINAL so redelivered copies count
once. Optional filters left empty ("" / None) match everything. The dashboard's queries are in
``dashboard/queries.py`` (DataFrames); these are the only others.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from telemetry.store.schema import ALERTS, EVENTS

_FILTERS = """
    ({job:String} = '' OR job = {job:String})
    AND ({run:String} = '' OR run = {run:String})
"""


# Output columns reuse input names (duration_s, bytes, step); without this setting ClickHouse
# would resolve e.g. ``max(duration_s)`` next to ``sum(duration_s) AS duration_s`` to the alias.
_SETTINGS = {"prefer_column_name_to_alias": 1}


def _rows(client: Any, sql: str, parameters: dict[str, Any]) -> list[dict[str, Any]]:
    return list(client.query(sql, parameters=parameters, settings=_SETTINGS).named_results())


# Which save / load call each span belongs to, shared with the dashboard (``dashboard/queries.py``
# explains the rules): a span with a call id is in that call; one of an earlier release (none)
# in its rank's newest call started before it. Calls are numbered per rank and step in start
# order ("call N"), and matched across ranks by (checkpoint, op, step, call).
# The first phase span of every save / load call (``bytecheckpoint/engine``): a rank's call
# that never ended has no whole-call span, and its phases begin that call instead.
CALL_BEGINS: dict[str, str] = {"save": "save.collect", "load": "load.metadata"}

# Every rank's ended calls without a call id (events of earlier releases): their whole-call
# spans, from start to end.
_ENDS = """
SELECT job, run, checkpoint, checkpoint_op, ifNull(rank, -1) AS rank_key, ts AS call_ts, step, event_id,
       toFloat64(ts) + duration_s AS end_ts,
       ts + toIntervalMicrosecond(toInt64(ceil(duration_s * 1e6))) AS end_at, toUInt8(1) AS ended
FROM {events} FINAL WHERE name = checkpoint_op AND call_id = '' AND {where}
"""

# Where those calls start: every whole-call span, and every first phase span outside the
# rank's ended calls (a call it never ended: hung, or killed). A load does nothing after
# its call ends, so an unended load right after an ended one starts where that one ended: its
# spans before its metadata (the read lease's checks) are its own, not the ended call's.
_TIMED_STARTS = """
SELECT job, run, checkpoint, checkpoint_op, rank_key, '' AS call_id, call_ts, step, event_id FROM ({ends})
UNION ALL
SELECT job, run, checkpoint, checkpoint_op, rank_key, '',
       if(checkpoint_op = 'load' AND ended = 1 AND prev_ts < ended_call_ts, end_at, ts), step, event_id
FROM (
    SELECT b.*, w.ended AS ended, w.call_ts AS ended_call_ts, w.end_at AS end_at,
           lagInFrame(b.ts, 1, toDateTime64(0, 6, 'UTC')) OVER (
               PARTITION BY b.job, b.run, b.checkpoint, b.checkpoint_op, b.rank_key
               ORDER BY b.ts, b.event_id ROWS BETWEEN 1 PRECEDING AND CURRENT ROW) AS prev_ts
    FROM (
        SELECT job, run, checkpoint, checkpoint_op, ifNull(rank, -1) AS rank_key, ts, step, event_id
        FROM {events} FINAL WHERE name = {begins} AND call_id = '' AND {where}
    ) AS b
    ASOF LEFT JOIN ({ends}) AS w
    ON b.job = w.job AND b.run = w.run AND b.checkpoint = w.checkpoint
       AND b.checkpoint_op = w.checkpoint_op AND b.rank_key = w.rank_key AND b.ts >= w.call_ts
    WHERE w.ended = 0 OR toFloat64(b.ts) > w.end_ts
)
"""

# Calls named by their spans' call id: they start at their first span, and their step is the
# first one a span names (a load's reads before its metadata name none; an async save's
# background spans, with no step= of the save's, may carry the step training moved on to).
_ID_STARTS = """
SELECT job, run, checkpoint, checkpoint_op, ifNull(rank, -1) AS rank_key, call_id, min(ts) AS call_ts,
       argMin(step, ts) AS id_step, min(event_id) AS first_id
FROM {events} FINAL WHERE call_id != '' AND {where}
GROUP BY job, run, checkpoint, checkpoint_op, rank_key, call_id
"""

# Every call of every rank, numbered per rank and step in start order: the dashboard's and the
# alert rules' "call N".
_STARTS = """
SELECT job, run, checkpoint, checkpoint_op, rank_key, call_id, call_ts, step,
       toUInt32(row_number() OVER (PARTITION BY job, run, checkpoint, checkpoint_op, rank_key, step
                                   ORDER BY call_ts, event_id)) AS call
FROM ({timed} UNION ALL {named})
"""

# Every event of the selected checkpoint paths with the call it belongs to: call_step and call.
# A span with a call id is in that call. One without (an earlier release's) is in that rank's
# newest call that started at or before it (an async save's background spans come after its
# call ends), if the span carries that call's step or none (a load's reads before its metadata
# named the step); else the span's own step, call 1.
_CALLS = """
SELECT e.*, if(matched, c.step, e.step) AS call_step, if(matched, c.call, 1) AS call
FROM (
    SELECT *, ifNull(rank, -1) AS rank_key FROM {events} FINAL WHERE {where}
) AS e
ASOF LEFT JOIN ({starts}) AS c
ON e.job = c.job AND e.run = c.run AND e.checkpoint = c.checkpoint AND e.checkpoint_op = c.checkpoint_op
   AND e.rank_key = c.rank_key AND e.call_id = c.call_id AND e.ts >= c.call_ts
"""
_MATCHED = "c.call > 0 AND (e.call_id != '' OR e.step IS NULL OR e.step = c.step)"


def calls_sql(where: str, starts_where: str | None = None) -> str:
    """``_CALLS`` over the events that ``where`` selects, their calls numbered among the events
    that ``starts_where`` selects (default: the same; a wider set keeps a call's number when the
    earlier calls of its path are outside ``where``). Both may use query parameters."""
    starts_where = where if starts_where is None else starts_where
    cases = ", ".join(f"checkpoint_op = '{op}', '{name}'" for op, name in CALL_BEGINS.items())
    begins = f"multiIf({cases}, '')"
    ends = _ENDS.format(events=EVENTS, where=starts_where)
    timed = _TIMED_STARTS.format(events=EVENTS, where=starts_where, ends=ends, begins=begins)
    named = _ID_STARTS.format(events=EVENTS, where=starts_where)
    starts = _STARTS.format(timed=timed, named=named)
    body = _CALLS.format(events=EVENTS, where=where, starts=starts).replace("if(matched", f"if({_MATCHED}")
    return f"({body})"


# The alert rules' window: spans that end after ``since`` (started up to a day earlier).
_WINDOW = """ts >= {since:DateTime64(6)} - INTERVAL 1 DAY
    AND toFloat64(ts) + duration_s >= toFloat64({since:DateTime64(6)})
    AND rank IS NOT NULL AND """ + _FILTERS

# The calls are numbered among every event of the paths with spans in the window, however
# old: numbered within the window, a call would be renumbered (and its alerts get a new id,
# or an older call's) once the path's earlier calls left it.
_WINDOW_PATHS = f"""checkpoint != '' AND checkpoint_op IN ('save', 'load') AND {_FILTERS}
    AND (job, run, checkpoint, checkpoint_op) IN (
        SELECT job, run, checkpoint, checkpoint_op FROM {EVENTS} WHERE checkpoint != '' AND {_WINDOW})"""


def rank_phases(client: Any, since: datetime, *, job: str = "", run: str = "") -> list[dict[str, Any]]:
    """Per (checkpoint, op, step, call, rank, phase span name) since ``since``: busy seconds,
    bytes, spans, errors, retries. The alert rules' input.

    ``step`` and ``call`` say which save / load call of the path the span belongs to, as the
    dashboard numbers them (``calls_sql``): a rank's spans with a call id are its call's, at the
    call's step (an async save's writes and commit ended after training moved on; a load's reads
    before its metadata name none), and ``call`` numbers a rank's calls of that path and step
    in start order (1, 2, ... for a retry, an overwrite, a job restarted from the same
    checkpoint). Spans of earlier releases (no call id) keep their own step and have ``call``
    0: the rules count their calls as before, by each rank's end spans.

    A span is in the window when it ends after ``since`` (spans started up to a day earlier):
    by its start, the window's edge cut a call between ranks (one rank's save span out, its
    later inner spans in), and that rank looked as if it never ended the call."""
    sql = f"""
    SELECT job, run, checkpoint, checkpoint_op AS op, rank, name AS phase, step, call,
           count() AS spans, sum(duration_s) AS duration_s, sum(ifNull(bytes, 0)) AS bytes,
           countIf(outcome = 'error') AS errors, countIf(ifNull(attempt, 1) > 1) AS retries,
           min(toFloat64(ts)) AS start_ts, max(toFloat64(ts) + duration_s) AS end_ts,
           any(error) AS sample_error, argMax(world_size, ts) AS world_size
    FROM (
        SELECT job, run, checkpoint, checkpoint_op, rank, name, duration_s, bytes, outcome, attempt, ts,
               error, world_size, if(call_id = '', step, call_step) AS step,
               toUInt32(if(call_id = '', 0, call)) AS call
        FROM {calls_sql(_WINDOW, _WINDOW_PATHS)}
    )
    GROUP BY job, run, checkpoint, checkpoint_op, step, call, rank, name
    ORDER BY job, run, checkpoint, checkpoint_op, step, call, name, rank
    """
    return _rows(client, sql, {"since": since, "job": job, "run": run})


def alert_ids(client: Any, ids: Sequence[str]) -> set[str]:
    """Which of ``ids`` are already in the alerts table."""
    if not ids:
        return set()
    sql = f"SELECT alert_id FROM {ALERTS} WHERE has({{ids:Array(String)}}, alert_id)"
    return {row["alert_id"] for row in _rows(client, sql, {"ids": list(ids)})}

