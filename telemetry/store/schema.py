"""The ClickHouse tables, created if missing and versioned by a migrations list.

Each migration runs once per store, in order, recorded in ``schema_version``; a store written
by a newer release is refused rather than half-understood. Events and I/O ops are
ReplacingMergeTree tables keyed on event_id, so a redelivered event collapses into one row
(queries read them with FINAL).
"""

from __future__ import annotations

import logging
from typing import Any

from telemetry.store.client import StoreConfigError

log = logging.getLogger("telemetry.store")

EVENTS = "events"
IO_OPS = "io_ops"
ALERTS = "alerts"
ALERT_OUTBOX = "alert_outbox"
QUARANTINE = "ingest_quarantine"
VERSION_TABLE = "schema_version"

_EVENTS_V1 = f"""
CREATE TABLE IF NOT EXISTS {EVENTS} (
    event_id String,
    name LowCardinality(String),
    ts DateTime64(6, 'UTC'),
    duration_s Float64,
    outcome LowCardinality(String),
    error String,
    parent_id String,
    checkpoint String,
    checkpoint_op LowCardinality(String),
    job LowCardinality(String),
    run String,
    step Nullable(Int64),
    rank Nullable(Int32),
    world_size Nullable(Int32),
    dp Nullable(Int32),
    tp Nullable(Int32),
    pp Nullable(Int32),
    host LowCardinality(String),
    pid UInt32,
    bytes Nullable(Int64),
    path String,
    backend LowCardinality(String),
    op LowCardinality(String),
    attempt Nullable(Int32),
    phase LowCardinality(String),
    attrs String,
    ingested_at DateTime64(3, 'UTC') DEFAULT now64(3)
) ENGINE = ReplacingMergeTree
PARTITION BY toDate(ts)
ORDER BY (job, run, checkpoint, name, event_id)
"""

_IO_OPS_V1 = f"""
CREATE TABLE IF NOT EXISTS {IO_OPS} (
    event_id String,
    ts DateTime64(6, 'UTC'),
    duration_s Float64,
    op LowCardinality(String),
    backend LowCardinality(String),
    path String,
    bytes Nullable(Int64),
    attempt Nullable(Int32),
    outcome LowCardinality(String),
    error String,
    checkpoint String,
    checkpoint_op LowCardinality(String),
    job LowCardinality(String),
    run String,
    step Nullable(Int64),
    rank Nullable(Int32),
    host LowCardinality(String),
    ingested_at DateTime64(3, 'UTC') DEFAULT now64(3)
) ENGINE = ReplacingMergeTree
PARTITION BY toDate(ts)
ORDER BY (job, backend, op, event_id)
"""

_ALERTS_V1 = f"""
CREATE TABLE IF NOT EXISTS {ALERTS} (
    alert_id String,
    rule LowCardinality(String),
    severity LowCardinality(String),
    job LowCardinality(String),
    run String,
    checkpoint String,
    checkpoint_op LowCardinality(String),
    step Nullable(Int64),
    phase String,
    rank Nullable(Int32),
    value Float64,
    threshold Float64,
    message String,
    details String,
    created_at DateTime64(3, 'UTC')
) ENGINE = ReplacingMergeTree
ORDER BY alert_id
"""

# One row per delivery attempt of an alert to the webhook; the row with the most attempts is
# the alert's state (ReplacingMergeTree keeps it). Posted until the receiver answers 2xx.
_ALERT_OUTBOX_V2 = f"""
CREATE TABLE IF NOT EXISTS {ALERT_OUTBOX} (
    alert_id String,
    body String,
    attempts UInt32,
    state LowCardinality(String),
    next_try DateTime64(3, 'UTC'),
    last_error String,
    updated_at DateTime64(3, 'UTC')
) ENGINE = ReplacingMergeTree(attempts)
ORDER BY alert_id
"""

# Records the ingester could not store, with why and where they came from (a dead-letter table).
_QUARANTINE_V2 = f"""
CREATE TABLE IF NOT EXISTS {QUARANTINE} (
    quarantined_at DateTime64(3, 'UTC'),
    source String,
    position String,
    reason String,
    record String,
    record_bytes UInt64
) ENGINE = MergeTree
ORDER BY quarantined_at
"""

# The save / load call of each span (``telemetry.schema``); rows of earlier releases get ''.
_EVENTS_CALL_ID_V3 = f"ALTER TABLE {EVENTS} ADD COLUMN IF NOT EXISTS call_id String DEFAULT ''"

# (version, description, statements). Append only: a released migration never changes.
MIGRATIONS: list[tuple[int, str, list[str]]] = [
    (1, "events, io_ops and alerts tables", [_EVENTS_V1, _IO_OPS_V1, _ALERTS_V1]),
    (2, "alert webhook outbox and ingest quarantine tables", [_ALERT_OUTBOX_V2, _QUARANTINE_V2]),
    (3, "events.call_id", [_EVENTS_CALL_ID_V3]),
]
SCHEMA_VERSION = MIGRATIONS[-1][0]


def current_version(client: Any) -> int:
    client.command(f"CREATE TABLE IF NOT EXISTS {VERSION_TABLE} (version UInt32, description String, "
                   "applied_at DateTime DEFAULT now()) ENGINE = MergeTree ORDER BY version")
    value = client.command(f"SELECT max(version) FROM {VERSION_TABLE}")
    return int(value or 0)


def ensure_schema(client: Any) -> int:
    """Create or upgrade the tables; return the schema version. Safe to call from many processes."""
    version = current_version(client)
    if version > SCHEMA_VERSION:
        raise StoreConfigError(f"the telemetry store has schema version {version}, newer than this "
                               f"release understands ({SCHEMA_VERSION}); upgrade bytecheckpoint")
    for number, description, statements in MIGRATIONS:
        if number <= version:
            continue
        for statement in statements:
            client.command(statement)
        client.insert(VERSION_TABLE, [[number, description]], column_names=["version", "description"])
        log.info("telemetry store: applied schema migration %d (%s)", number, description)
    return SCHEMA_VERSION
