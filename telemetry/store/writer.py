"""Turn events and alerts into rows and insert them, one insert per table per batch."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime, timezone
from typing import Any

from telemetry.schema import is_io_event
from telemetry.store.schema import ALERTS, EVENTS, IO_OPS, QUARANTINE
from telemetry.store.validate import BadRecord, clean_event

EVENT_COLUMNS = (
    "event_id", "name", "ts", "duration_s", "outcome", "error", "parent_id", "checkpoint",
    "checkpoint_op", "job", "run", "step", "rank", "world_size", "dp", "tp", "pp", "host", "pid",
    "bytes", "path", "backend", "op", "attempt", "phase", "attrs", "call_id",
)
IO_COLUMNS = (
    "event_id", "ts", "duration_s", "op", "backend", "path", "bytes", "attempt", "outcome", "error",
    "checkpoint", "checkpoint_op", "job", "run", "step", "rank", "host",
)
ALERT_COLUMNS = (
    "alert_id", "rule", "severity", "job", "run", "checkpoint", "checkpoint_op", "step", "phase",
    "rank", "value", "threshold", "message", "details", "created_at",
)


def event_rows(events: Iterable[dict[str, Any]], columns: tuple[str, ...] = EVENT_COLUMNS) -> list[list[Any]]:
    """Rows of already cleaned events (``clean_event``) in ``columns`` order."""
    return [[e[c] for c in columns] for e in events]


def insert_clean(client: Any, cleaned: list[dict[str, Any]]) -> int:
    """Insert cleaned events into events (and the storage ones into io_ops); return rows inserted.

    Retrying the same batch after a failure is safe: both tables deduplicate on event_id.
    """
    if not cleaned:
        return 0
    client.insert(EVENTS, event_rows(cleaned), column_names=list(EVENT_COLUMNS))
    io = [e for e in cleaned if is_io_event(e)]
    if io:
        client.insert(IO_OPS, event_rows(io, IO_COLUMNS), column_names=list(IO_COLUMNS))
    return len(cleaned)


def split_events(events: Iterable[Any]) -> tuple[list[dict[str, Any]], list[tuple[Any, str]]]:
    """(cleaned events, [(event, reason)] for those that cannot be stored)."""
    good: list[dict[str, Any]] = []
    bad: list[tuple[Any, str]] = []
    for event in events:
        try:
            good.append(clean_event(event))
        except BadRecord as exc:
            bad.append((event, str(exc)))
    return good, bad


def insert_events(client: Any, events: list[dict[str, Any]]) -> int:
    """Insert the storable ``events``; return rows inserted. Events that cannot be stored are
    skipped here; the ingester quarantines them instead (``split_events``)."""
    good, _ = split_events(events)
    return insert_clean(client, good)


def insert_alerts(client: Any, alerts: list[dict[str, Any]]) -> None:
    if not alerts:
        return
    rows = [[a.get(c) for c in ALERT_COLUMNS] for a in alerts]
    client.insert(ALERTS, rows, column_names=list(ALERT_COLUMNS))


QUARANTINE_COLUMNS = ("quarantined_at", "source", "position", "reason", "record", "record_bytes")


def insert_quarantine(client: Any, source: str, rejects: Iterable[Any]) -> int:
    """Keep records that could not be stored (``telemetry.ingest.records.Reject``) with the reason."""
    now = datetime.now(timezone.utc)
    rows = [[now, source, r.position, r.reason, r.record.decode("utf-8", "backslashreplace"), r.size]
            for r in rejects]
    if rows:
        client.insert(QUARANTINE, rows, column_names=list(QUARANTINE_COLUMNS))
    return len(rows)
