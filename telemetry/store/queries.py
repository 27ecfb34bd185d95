"""Read queries for the dashboard and the alert rules: parameterized SQL, rows as dicts.

Every function takes a clickhouse-connect client and returns ``list[dict]`` (column -> value),
so callers need no pandas. Events are read with FINAL so redelivered copies count once.
Optional filters left empty ("" / None) match everything.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from telemetry.schema import PHASES, THROUGHPUT_PHASES
from telemetry.store.schema import ALERTS, EVENTS, IO_OPS, QUARANTINE

_FILTERS = """
    ({job:String} = '' OR job = {job:String})
    AND ({run:String} = '' OR run = {run:String})
"""


# Output columns reuse input names (duration_s, bytes, step); without this setting ClickHouse
# would resolve e.g. ``max(duration_s)`` next to ``sum(duration_s) AS duration_s`` to the alias.
_SETTINGS = {"prefer_column_name_to_alias": 1}


def _rows(client: Any, sql: str, parameters: dict[str, Any]) -> list[dict[str, Any]]:
    return list(client.query(sql, parameters=parameters, settings=_SETTINGS).named_results())


def checkpoints(client: Any, *, job: str = "", run: str = "", limit: int = 200) -> list[dict[str, Any]]:
    """One row per (checkpoint, op): step, ranks seen, start/end, slowest rank, bytes, committed."""
    sql = f"""
    SELECT job, run, checkpoint, checkpoint_op AS op, max(step) AS step,
           uniqExact(rank) AS ranks,
           min(toFloat64(ts)) AS start_ts,
           max(toFloat64(ts) + duration_s) AS end_ts,
           maxIf(duration_s, name = checkpoint_op) AS duration_s,
           sumIf(ifNull(bytes, 0), has({{io:Array(String)}}, name)) AS bytes,
           countIf(name = 'save.commit' AND outcome = 'ok') > 0 AS committed,
           countIf(outcome = 'error') AS errors
    FROM {EVENTS} FINAL
    WHERE checkpoint != '' AND {_FILTERS}
    GROUP BY job, run, checkpoint, checkpoint_op
    ORDER BY start_ts DESC
    LIMIT {{limit:UInt32}}
    """
    return _rows(client, sql, {"job": job, "run": run, "io": list(THROUGHPUT_PHASES), "limit": limit})


def phase_durations(
    client: Any, checkpoint: str, *, op: str = "", job: str = "", run: str = "",
) -> list[dict[str, Any]]:
    """Per (rank, phase) of one checkpoint: spans, busy seconds (sum), longest span, wall
    seconds (first start to last end), bytes, errors. Includes the whole-call span ("save" /
    "load") and storage ops ("storage.*") as phases too; filter on ``phase`` as needed."""
    sql = f"""
    SELECT rank, name AS phase, count() AS spans,
           sum(duration_s) AS duration_s, max(duration_s) AS max_span_s,
           max(toFloat64(ts) + duration_s) - min(toFloat64(ts)) AS wall_s,
           sum(ifNull(bytes, 0)) AS bytes, countIf(outcome = 'error') AS errors,
           any(dp) AS dp, any(tp) AS tp, any(pp) AS pp, any(step) AS step
    FROM {EVENTS} FINAL
    WHERE checkpoint = {{checkpoint:String}}
      AND ({{op:String}} = '' OR checkpoint_op = {{op:String}})
      AND {_FILTERS}
    GROUP BY rank, name
    ORDER BY rank, name
    """
    return _rows(client, sql, {"checkpoint": checkpoint, "op": op, "job": job, "run": run})


def step_trends(
    client: Any, *, job: str = "", run: str = "", op: str = "save", phases: Sequence[str] = PHASES,
) -> list[dict[str, Any]]:
    """Per (step, phase): the slowest rank's and the median rank's busy seconds, and bytes."""
    sql = f"""
    SELECT step, phase, max(d) AS max_s, quantileExact(0.5)(d) AS median_s, sum(b) AS bytes,
           count() AS ranks
    FROM (
        SELECT step, rank, name AS phase, sum(duration_s) AS d, sum(ifNull(bytes, 0)) AS b
        FROM {EVENTS} FINAL
        WHERE step IS NOT NULL AND checkpoint_op = {{op:String}}
          AND has({{phases:Array(String)}}, name) AND {_FILTERS}
        GROUP BY step, rank, name
    )
    GROUP BY step, phase
    ORDER BY step, phase
    """
    return _rows(client, sql, {"job": job, "run": run, "op": op, "phases": list(phases)})


def throughput(client: Any, *, job: str = "", run: str = "", op: str = "") -> list[dict[str, Any]]:
    """Per checkpoint: bytes moved by the I/O phases over the slowest rank's whole call."""
    sql = f"""
    SELECT checkpoint, checkpoint_op AS op, max(step) AS step, min(toFloat64(ts)) AS start_ts,
           sumIf(ifNull(bytes, 0), has({{io:Array(String)}}, name)) AS bytes,
           maxIf(duration_s, name = checkpoint_op) AS duration_s,
           if(maxIf(duration_s, name = checkpoint_op) > 0,
              sumIf(ifNull(bytes, 0), has({{io:Array(String)}}, name))
                / maxIf(duration_s, name = checkpoint_op),
              0) AS bytes_per_s
    FROM {EVENTS} FINAL
    WHERE checkpoint != '' AND ({{op:String}} = '' OR checkpoint_op = {{op:String}}) AND {_FILTERS}
    GROUP BY checkpoint, checkpoint_op
    ORDER BY start_ts
    """
    return _rows(client, sql, {"job": job, "run": run, "op": op, "io": list(THROUGHPUT_PHASES)})


def io_summary(
    client: Any, *, job: str = "", run: str = "", bucket_s: int = 60, since: datetime | None = None,
) -> list[dict[str, Any]]:
    """Storage operations per time bucket, backend and op: count, bytes, latency quantiles,
    errors and retries (attempt > 1)."""
    sql = f"""
    SELECT toStartOfInterval(ts, toIntervalSecond({{bucket:UInt32}})) AS bucket, backend, op,
           count() AS ops, sum(ifNull(bytes, 0)) AS bytes, sum(duration_s) AS busy_s,
           quantileExact(0.5)(duration_s) AS p50_s, quantileExact(0.99)(duration_s) AS p99_s,
           countIf(outcome = 'error') AS errors, countIf(ifNull(attempt, 1) > 1) AS retries
    FROM {IO_OPS} FINAL
    WHERE ts >= {{since:DateTime64(6)}} AND {_FILTERS}
    GROUP BY bucket, backend, op
    ORDER BY bucket, backend, op
    """
    return _rows(client, sql, {"job": job, "run": run, "bucket": bucket_s,
                               "since": since or datetime(1970, 1, 2)})


def rank_phases(client: Any, since: datetime, *, job: str = "", run: str = "") -> list[dict[str, Any]]:
    """Per (checkpoint, op, rank, phase span name) since ``since``: busy seconds, bytes, spans,
    errors, retries. The alert rules' input."""
    sql = f"""
    SELECT job, run, checkpoint, checkpoint_op AS op, rank, name AS phase, max(step) AS step,
           count() AS spans, sum(duration_s) AS duration_s, sum(ifNull(bytes, 0)) AS bytes,
           countIf(outcome = 'error') AS errors, countIf(ifNull(attempt, 1) > 1) AS retries,
           min(toFloat64(ts)) AS start_ts, max(toFloat64(ts) + duration_s) AS end_ts,
           any(error) AS sample_error
    FROM {EVENTS} FINAL
    WHERE ts >= {{since:DateTime64(6)}} AND rank IS NOT NULL AND {_FILTERS}
    GROUP BY job, run, checkpoint, checkpoint_op, rank, name
    ORDER BY job, run, checkpoint, checkpoint_op, name, rank
    """
    return _rows(client, sql, {"since": since, "job": job, "run": run})


def alerts(
    client: Any, *, job: str = "", run: str = "", rule: str = "", limit: int = 500,
) -> list[dict[str, Any]]:
    sql = f"""
    SELECT * FROM {ALERTS} FINAL
    WHERE ({{rule:String}} = '' OR rule = {{rule:String}}) AND {_FILTERS}
    ORDER BY created_at DESC
    LIMIT {{limit:UInt32}}
    """
    return _rows(client, sql, {"job": job, "run": run, "rule": rule, "limit": limit})


def alert_ids(client: Any, ids: Sequence[str]) -> set[str]:
    """Which of ``ids`` are already in the alerts table."""
    if not ids:
        return set()
    sql = f"SELECT alert_id FROM {ALERTS} WHERE has({{ids:Array(String)}}, alert_id)"
    return {row["alert_id"] for row in _rows(client, sql, {"ids": list(ids)})}


def event_counts(client: Any, *, job: str = "", run: str = "") -> dict[str, int]:
    """Rows as stored and distinct event ids (equal once duplicates are merged away)."""
    sql = f"""
    SELECT count() AS stored, uniqExact(event_id) AS distinct_ids,
           (SELECT count() FROM {EVENTS} FINAL WHERE {_FILTERS}) AS final_rows
    FROM {EVENTS} WHERE {_FILTERS}
    """
    row = _rows(client, sql, {"job": job, "run": run})[0]
    return {key: int(value) for key, value in row.items()}


def quarantined(client: Any, *, limit: int = 500) -> list[dict[str, Any]]:
    """Records the ingester could not store, newest first: when, source, position, reason,
    record (truncated) and its full size."""
    sql = f"""
    SELECT quarantined_at, source, position, reason, record, record_bytes FROM {QUARANTINE}
    ORDER BY quarantined_at DESC
    LIMIT {{limit:UInt32}}
    """
    return _rows(client, sql, {"limit": limit})
