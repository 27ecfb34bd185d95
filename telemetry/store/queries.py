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


# The step of each save / load call named by a call id (``telemetry.schema``): that of its
# first span naming one. A call's spans are counted at its step: an async save with no step=
# ends its writes and commit at whatever step training has moved on to, and a load's reads
# before its metadata name none. Spans of earlier releases (no call id) keep their own step.
_CALL_STEPS = f"""
SELECT job, run, checkpoint, checkpoint_op, rank, call_id, argMin(step, ts) AS call_step
FROM {EVENTS} FINAL
WHERE call_id != '' AND ts >= {{since:DateTime64(6)}} - INTERVAL 2 DAY AND rank IS NOT NULL AND {_FILTERS}
GROUP BY job, run, checkpoint, checkpoint_op, rank, call_id
"""


def rank_phases(client: Any, since: datetime, *, job: str = "", run: str = "") -> list[dict[str, Any]]:
    """Per (checkpoint, op, step, rank, phase span name) since ``since``: busy seconds, bytes,
    spans, errors, retries. The alert rules' input. The step keeps apart the saves of one path
    (a "latest" checkpoint overwritten every time), which summed together hid a slow rank of
    the newest save and, behind an earlier commit, a save that never committed; a span is
    counted at its call's step (``_CALL_STEPS``).

    A span is in the window when it ends after ``since`` (spans started up to a day earlier):
    by its start, the window's edge cut a call between ranks (one rank's save span out, its
    later inner spans in), and that rank looked as if it never ended the call."""
    sql = f"""
    SELECT job, run, checkpoint, checkpoint_op AS op, rank, name AS phase, step,
           count() AS spans, sum(duration_s) AS duration_s, sum(ifNull(bytes, 0)) AS bytes,
           countIf(outcome = 'error') AS errors, countIf(ifNull(attempt, 1) > 1) AS retries,
           min(toFloat64(ts)) AS start_ts, max(toFloat64(ts) + duration_s) AS end_ts,
           any(error) AS sample_error, argMax(world_size, ts) AS world_size
    FROM (
        SELECT e.job AS job, e.run AS run, e.checkpoint AS checkpoint, e.checkpoint_op AS checkpoint_op,
               e.rank AS rank, e.name AS name, e.duration_s AS duration_s, e.bytes AS bytes,
               e.outcome AS outcome, e.attempt AS attempt, e.ts AS ts, e.error AS error,
               e.world_size AS world_size, if(e.call_id = '', e.step, c.call_step) AS step
        FROM (
            SELECT * FROM {EVENTS} FINAL
            WHERE ts >= {{since:DateTime64(6)}} - INTERVAL 1 DAY
              AND toFloat64(ts) + duration_s >= toFloat64({{since:DateTime64(6)}})
              AND rank IS NOT NULL AND {_FILTERS}
        ) AS e
        LEFT JOIN ({_CALL_STEPS}) AS c
        ON e.job = c.job AND e.run = c.run AND e.checkpoint = c.checkpoint
           AND e.checkpoint_op = c.checkpoint_op AND e.rank = c.rank AND e.call_id = c.call_id
    )
    GROUP BY job, run, checkpoint, checkpoint_op, step, rank, name
    ORDER BY job, run, checkpoint, checkpoint_op, step, name, rank
    """
    return _rows(client, sql, {"since": since, "job": job, "run": run})


def alert_ids(client: Any, ids: Sequence[str]) -> set[str]:
    """Which of ``ids`` are already in the alerts table."""
    if not ids:
        return set()
    sql = f"SELECT alert_id FROM {ALERTS} WHERE has({{ids:Array(String)}}, alert_id)"
    return {row["alert_id"] for row in _rows(client, sql, {"ids": list(ids)})}

