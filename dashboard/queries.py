"""Every query the dashboard runs: parameterized SQL in, pandas DataFrames out.

A checkpoint is identified by (job, run, checkpoint, op), the columns the events table is
ordered by, so the per-checkpoint queries read only that checkpoint's rows. Events are read
with FINAL so redelivered copies count once (see ``telemetry.store``).

One path can be saved (or loaded) many times: a "latest" checkpoint saved every step, an
overwrite. Each call is one row of ``checkpoints``, told apart by its ``step`` and ``call``
(1 for the first call of that step to that path, 2 for the next, ...). A rank's spans belong
to the call whose ``call_id`` they carry (made when its save / load starts, carried by an
async save's background work too; ``telemetry.schema``): the call's step is that of its first
span that names one, and its start its first span's. Events of earlier releases carry no
``call_id``: each of those spans is given to that rank's newest save / load call that started
before it (``_CALLS``), where a call a rank never ended (hung, killed) starts at its first
phase span (``CALL_BEGINS``). Ranks share no call id, so the calls of one collective save are
matched across ranks by (checkpoint, op, step, call): every rank numbers its own calls. That
SQL (``_CALLS``, ``CALL_BEGINS``) is in ``telemetry.store.queries``, which the alert rules'
query shares, so an alert's "call N" is the dashboard's call N.

Tiering (read by ``tiering_moves``): the cooling service's spans in the same events table.

- ``tiering.move``: one finished span per checkpoint moved hot -> cold, with ``checkpoint``,
  ``bytes`` (moved) and ``files``; ``outcome`` "error" is a failed or aborted move. A
  ``phase=`` field, when given, names the destination tier (default "cold").
- ``tiering.delete``: a checkpoint removed by retention (``checkpoint``, ``bytes``).
- ``tiering.scan``: one per pass; ``bytes`` is the hot tier's size, ``attrs`` hold
  ``checkpoints``, ``to_cool`` and ``to_delete``.
- ``tiering.begin`` (optional, not emitted by the service today): a move started; one with
  no later ``tiering.move`` for its checkpoint is shown as in progress.

A checkpoint's tier is the destination of its latest successful move, else "hot".
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from telemetry.schema import IO_SPAN_PREFIX, SCOPE_SPANS, THROUGHPUT_PHASES
from telemetry.store.queries import calls_sql as _calls
from telemetry.store.schema import ALERTS, EVENTS, IO_OPS

TIERING_PREFIX = "tiering."
ALL = ""  # an empty job / run filter matches everything

# Output columns reuse input names (duration_s, bytes, step); see telemetry.store.queries.
_SETTINGS = {"prefer_column_name_to_alias": 1}

_SCOPE = """job = {job:String} AND run = {run:String} AND checkpoint = {checkpoint:String}
        AND checkpoint_op = {op:String}"""
_FILTERS = """({job:String} = '' OR job = {job:String}) AND ({run:String} = '' OR run = {run:String})"""


def frame(client: Any, sql: str, parameters: dict[str, Any]) -> pd.DataFrame:
    """Run ``sql`` with ``parameters``; always a DataFrame, with the query's columns when empty."""
    result = client.query(sql, parameters=parameters, settings=_SETTINGS)
    columns = list(result.column_names)
    if not result.result_rows and not columns:
        # chdb returns no column names with an empty result; DESCRIBE gives them.
        described = client.query(f"DESCRIBE ({sql})", parameters=parameters, settings=_SETTINGS)
        columns = [row[0] for row in described.result_rows]
    return pd.DataFrame(result.result_rows, columns=columns)


def jobs(client: Any) -> pd.DataFrame:
    """Per (job, run): save and load calls (as ``checkpoints`` counts them: a "latest" path
    saved 100 times is 100 saves), ranks, first and last event."""
    calls = _calls("checkpoint != '' AND checkpoint_op IN ('save', 'load')")
    sql = f"""
    SELECT j.job AS job, j.run AS run, c.saves AS saves, c.loads AS loads, j.world_size AS world_size,
           j.first_ts AS first_ts, j.last_ts AS last_ts, j.errors AS errors
    FROM (
        SELECT job, run, max(world_size) AS world_size, min(toFloat64(ts)) AS first_ts,
               max(toFloat64(ts) + duration_s) AS last_ts, countIf(outcome = 'error') AS errors
        FROM {EVENTS} FINAL
        GROUP BY job, run
    ) AS j
    LEFT JOIN (
        SELECT job, run, uniqExactIf((checkpoint, call_step, call), checkpoint_op = 'save') AS saves,
               uniqExactIf((checkpoint, call_step, call), checkpoint_op = 'load') AS loads
        FROM {calls}
        GROUP BY job, run
    ) AS c ON j.job = c.job AND j.run = c.run
    ORDER BY last_ts DESC
    """
    return frame(client, sql, {})


def checkpoints(client: Any, *, job: str = ALL, run: str = ALL, limit: int = 500) -> pd.DataFrame:
    """One row per save or load call (job, run, checkpoint, op, step, call; see the module docs),
    newest first: ranks, blocking seconds (the slowest rank's whole save/load call),
    end-to-end seconds (first start to last end of any span), bytes moved by the I/O phases,
    committed, errors."""
    where = f"checkpoint != '' AND checkpoint_op IN ('save', 'load') AND {_FILTERS}"
    sql = f"""
    SELECT job, run, checkpoint, checkpoint_op AS op, call_step AS step, call, uniqExact(rank) AS ranks,
           min(toFloat64(ts)) AS start_ts, max(toFloat64(ts) + duration_s) AS end_ts,
           maxIf(duration_s, name = checkpoint_op) AS blocking_s,
           max(toFloat64(ts) + duration_s) - min(toFloat64(ts)) AS e2e_s,
           sumIf(ifNull(bytes, 0), has({{io:Array(String)}}, name)) AS bytes,
           countIf(name = 'save.commit' AND outcome = 'ok') > 0 AS committed,
           countIf(outcome = 'error') AS errors
    FROM {_calls(where)}
    GROUP BY job, run, checkpoint, checkpoint_op, call_step, call
    ORDER BY start_ts DESC
    LIMIT {{limit:UInt32}}
    """
    return frame(client, sql, {"job": job, "run": run, "io": list(THROUGHPUT_PHASES), "limit": limit})


# One call of a checkpoint (``checkpoints``' step and call), or all of them when call is 0.
_CALL = """({call:UInt32} = 0 OR (call = {call:UInt32}
            AND ifNull(call_step, -1) = ifNull({step:Nullable(Int64)}, -1)))"""


def rank_phases(client: Any, *, job: str, run: str, checkpoint: str, op: str, step: int | None = None,
                call: int = 0) -> pd.DataFrame:
    """Per (rank, phase) of one checkpoint call (``step`` and ``call`` as ``checkpoints`` gives
    them; call 0: every call to that path), storage ops left out: spans, busy seconds (sum),
    start and end (epoch s), bytes, errors, and the rank's coordinates and host."""
    sql = f"""
    SELECT rank, name AS phase, count() AS spans, sum(duration_s) AS duration_s,
           min(toFloat64(ts)) AS start_ts, max(toFloat64(ts) + duration_s) AS end_ts,
           sum(ifNull(bytes, 0)) AS bytes, countIf(outcome = 'error') AS errors,
           any(dp) AS dp, any(tp) AS tp, any(pp) AS pp, any(host) AS host, max(call_step) AS step
    FROM {_calls(_SCOPE)}
    WHERE rank IS NOT NULL AND NOT startsWith(name, {{io:String}}) AND {_CALL}
    GROUP BY rank, name
    ORDER BY rank, name
    """
    return frame(client, sql, {"job": job, "run": run, "checkpoint": checkpoint, "op": op,
                               "io": IO_SPAN_PREFIX, "step": _step(step), "call": int(call)})


def _step(step: Any) -> int | None:
    return None if step is None or pd.isna(step) else int(step)


def step_phases(client: Any, *, job: str = ALL, run: str = ALL, op: str = "save") -> pd.DataFrame:
    """Per (step, phase): the slowest rank's and the median rank's busy seconds, each span at
    its call's step (see the module docs)."""
    where = f"checkpoint_op = {{op:String}} AND {_FILTERS}"
    sql = f"""
    SELECT step, phase, max(d) AS max_s, quantileExact(0.5)(d) AS median_s, count() AS ranks
    FROM (
        SELECT call_step AS step, rank, name AS phase, sum(duration_s) AS d
        FROM {_calls(where)}
        WHERE call_step IS NOT NULL AND rank IS NOT NULL
          AND NOT startsWith(name, {{io:String}}) AND NOT has({{scopes:Array(String)}}, name)
        GROUP BY call_step, rank, name
    )
    GROUP BY step, phase
    ORDER BY step, phase
    """
    return frame(client, sql, {"job": job, "run": run, "op": op, "io": IO_SPAN_PREFIX,
                               "scopes": list(SCOPE_SPANS)})


def io_latency(client: Any, *, job: str = ALL, run: str = ALL) -> pd.DataFrame:
    """Per (backend, op): count, bytes and latency quantiles (for box plots without raw rows)."""
    sql = f"""
    SELECT backend, op, count() AS ops, sum(ifNull(bytes, 0)) AS bytes,
           min(duration_s) AS min_s, quantilesExact(0.25, 0.5, 0.75, 0.99)(duration_s) AS q,
           max(duration_s) AS max_s, countIf(outcome = 'error') AS errors
    FROM {IO_OPS} FINAL
    WHERE {_FILTERS}
    GROUP BY backend, op
    ORDER BY backend, op
    """
    df = frame(client, sql, {"job": job, "run": run})
    for i, name in enumerate(("p25_s", "p50_s", "p75_s", "p99_s")):
        df[name] = [q[i] for q in df["q"]] if len(df) else pd.Series(dtype=float)
    return df.drop(columns=["q"])


def io_throughput(client: Any, *, job: str = ALL, run: str = ALL, bucket_s: int = 60) -> pd.DataFrame:
    """Storage ops per time bucket, backend and op: count, bytes, bytes per second, errors."""
    # Buckets as float seconds: toStartOfInterval gives a DateTime, which ends in 2106 (ts: 2299).
    sql = f"""
    SELECT floor(toFloat64(ts) / {{bucket:UInt32}}) * {{bucket:UInt32}} AS bucket_ts,
           backend, op, count() AS ops, sum(ifNull(bytes, 0)) AS bytes,
           sum(ifNull(bytes, 0)) / {{bucket:UInt32}} AS bytes_per_s,
           countIf(outcome = 'error') AS errors, countIf(ifNull(attempt, 1) > 1) AS retries
    FROM {IO_OPS} FINAL
    WHERE {_FILTERS}
    GROUP BY bucket_ts, backend, op
    ORDER BY bucket_ts, backend, op
    """
    return frame(client, sql, {"job": job, "run": run, "bucket": max(1, int(bucket_s))})


def io_time_range(client: Any, *, job: str = ALL, run: str = ALL) -> tuple[float, float] | None:
    sql = f"SELECT min(toFloat64(ts)) AS lo, max(toFloat64(ts)) AS hi, count() AS n FROM {IO_OPS} " \
          f"WHERE {_FILTERS}"
    df = frame(client, sql, {"job": job, "run": run})
    if df.empty or int(df["n"].iloc[0]) == 0:
        return None
    return float(df["lo"].iloc[0]), float(df["hi"].iloc[0])


def alerts(client: Any, *, job: str = ALL, run: str = ALL, limit: int = 500) -> pd.DataFrame:
    """Recent alerts, newest first."""
    sql = f"""
    SELECT alert_id, rule, severity, job, run, checkpoint, checkpoint_op AS op, step, phase, rank,
           value, threshold, message, toFloat64(created_at) AS created_ts
    FROM {ALERTS} FINAL
    WHERE {_FILTERS}
    ORDER BY created_at DESC
    LIMIT {{limit:UInt32}}
    """
    return frame(client, sql, {"job": job, "run": run, "limit": limit})


def checkpoint_alerts(client: Any, *, job: str, run: str, checkpoint: str, op: str, step: int | None = None,
                      call: int = 0) -> pd.DataFrame:
    """Alerts raised on one checkpoint (the heatmap marks their ranks); with a call (see
    ``checkpoints``), only those of its step."""
    sql = f"""
    SELECT rule, rank, phase, message FROM {ALERTS} FINAL
    WHERE {_SCOPE} AND ({{call:UInt32}} = 0 OR ifNull(step, -1) = ifNull({{step:Nullable(Int64)}}, -1))
    """
    return frame(client, sql, {"job": job, "run": run, "checkpoint": checkpoint, "op": op,
                               "step": _step(step), "call": int(call)})


def iteration_time(client: Any, *, job: str = ALL, run: str = ALL) -> float | None:
    """Median ``train.step`` span, when the training loop reports one."""
    sql = f"""
    SELECT quantileExact(0.5)(duration_s) AS t, count() AS n FROM {EVENTS} FINAL
    WHERE name = 'train.step' AND {_FILTERS}
    """
    df = frame(client, sql, {"job": job, "run": run})
    if df.empty or int(df["n"].iloc[0]) == 0:
        return None
    return float(df["t"].iloc[0])


def tiering_moves(client: Any, *, job: str = ALL, run: str = ALL) -> pd.DataFrame:
    """Every ``tiering.*`` event (see the module docs), oldest first."""
    sql = f"""
    SELECT name, checkpoint, if(phase != '', phase, 'cold') AS tier, ifNull(bytes, 0) AS bytes,
           JSONExtractInt(attrs, 'files') AS files, JSONExtractInt(attrs, 'to_cool') AS to_cool,
           JSONExtractInt(attrs, 'to_delete') AS to_delete, outcome, error, toFloat64(ts) AS ts, duration_s
    FROM {EVENTS} FINAL
    WHERE startsWith(name, {{prefix:String}}) AND {_FILTERS}
    ORDER BY ts
    """
    return frame(client, sql, {"job": job, "run": run, "prefix": TIERING_PREFIX})


def slot_waits(client: Any, *, job: str, run: str, checkpoint: str, op: str, step: int | None = None,
               call: int = 0) -> pd.DataFrame:
    """Per rank of one checkpoint call (as ``rank_phases``): files committed
    (``storage.commit``), how many of them waited for a host write slot, and the seconds they
    waited (``slot_wait_s``; see ``bytecheckpoint.storage.write_slots``)."""
    sql = f"""
    SELECT rank, count() AS commits,
           countIf(JSONExtractFloat(attrs, 'slot_wait_s') > 0) AS waited,
           sum(JSONExtractFloat(attrs, 'slot_wait_s')) AS wait_s
    FROM {_calls(_SCOPE)}
    WHERE rank IS NOT NULL AND name = 'storage.commit' AND {_CALL}
    GROUP BY rank
    ORDER BY rank
    """
    return frame(client, sql, {"job": job, "run": run, "checkpoint": checkpoint, "op": op,
                               "step": _step(step), "call": int(call)})
