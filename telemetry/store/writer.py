"""Turn events and alerts into rows and insert them, one insert per table per batch."""

from __future__ import annotations

import json
from collections.abc import Iterable
from datetime import datetime, timezone
from typing import Any

from telemetry.schema import is_io_event
from telemetry.store.schema import ALERTS, EVENTS, IO_OPS

EVENT_COLUMNS = (
    "event_id", "name", "ts", "duration_s", "outcome", "error", "parent_id", "checkpoint",
    "checkpoint_op", "job", "run", "step", "rank", "world_size", "dp", "tp", "pp", "host", "pid",
    "bytes", "path", "backend", "op", "attempt", "phase", "attrs",
)
IO_COLUMNS = (
    "event_id", "ts", "duration_s", "op", "backend", "path", "bytes", "attempt", "outcome", "error",
    "checkpoint", "checkpoint_op", "job", "run", "step", "rank", "host",
)
ALERT_COLUMNS = (
    "alert_id", "rule", "severity", "job", "run", "checkpoint", "checkpoint_op", "step", "phase",
    "rank", "value", "threshold", "message", "details", "created_at",
)
_STRINGS = frozenset({"name", "outcome", "error", "parent_id", "checkpoint", "checkpoint_op", "job",
                      "run", "host", "path", "backend", "op", "phase"})
_INTS = frozenset({"step", "rank", "world_size", "dp", "tp", "pp", "bytes", "attempt"})
_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


def _ts(value: Any) -> datetime:
    try:
        return datetime.fromtimestamp(float(value), tz=timezone.utc)
    except (TypeError, ValueError, OverflowError, OSError):
        return _EPOCH


def _int(value: Any) -> int | None:
    if value is None or isinstance(value, bool):
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _cell(event: dict[str, Any], column: str) -> Any:
    value = event.get(column)
    if column == "ts":
        return _ts(value)
    if column == "duration_s":
        try:
            return float(value)
        except (TypeError, ValueError):
            return 0.0
    if column == "pid":
        return _int(value) or 0
    if column == "attrs":
        return json.dumps(value if isinstance(value, dict) else {}, separators=(",", ":"), default=str)
    if column in _INTS:
        return _int(value)
    if column in _STRINGS:
        return "" if value is None else str(value)
    return value


def valid(event: Any) -> bool:
    """Events without an id or a name cannot be deduplicated or read: they are skipped."""
    return isinstance(event, dict) and bool(event.get("event_id")) and bool(event.get("name"))


def event_rows(events: Iterable[dict[str, Any]], columns: tuple[str, ...] = EVENT_COLUMNS) -> list[list[Any]]:
    return [[_cell(e, c) for c in columns] for e in events]


def insert_events(client: Any, events: list[dict[str, Any]]) -> int:
    """Insert ``events`` into events (and the storage ones into io_ops); return rows inserted.

    Retrying the same batch after a failure is safe: both tables deduplicate on event_id.
    """
    good = [e for e in events if valid(e)]
    if not good:
        return 0
    client.insert(EVENTS, event_rows(good), column_names=list(EVENT_COLUMNS))
    io = [e for e in good if is_io_event(e)]
    if io:
        client.insert(IO_OPS, event_rows(io, IO_COLUMNS), column_names=list(IO_COLUMNS))
    return len(good)


def insert_alerts(client: Any, alerts: list[dict[str, Any]]) -> None:
    if not alerts:
        return
    rows = [[a.get(c) for c in ALERT_COLUMNS] for a in alerts]
    client.insert(ALERTS, rows, column_names=list(ALERT_COLUMNS))
