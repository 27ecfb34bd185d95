"""Check one event against the column types of the events table before it is inserted.

A value is stored as it is, converted only where nothing is lost (an integral float to an
int, a number to a string column's text), or the event is refused with a reason: an integer
out of its ClickHouse type's range, a float that is not finite, a time outside DateTime64,
an over-long or non-UTF-8 string. The ingester quarantines refused events instead of letting
one of them fail a whole batch forever.
"""

from __future__ import annotations

import json
import math
from datetime import datetime, timezone
from typing import Any

# ClickHouse integer types of the events / io_ops columns.
_INT32 = (-(2**31), 2**31 - 1)
_INT64 = (-(2**63), 2**63 - 1)
INT_COLUMNS: dict[str, tuple[int, int]] = {
    "step": _INT64, "bytes": _INT64, "rank": _INT32, "world_size": _INT32, "dp": _INT32, "tp": _INT32,
    "pp": _INT32, "attempt": _INT32, "pid": (0, 2**32 - 1),
}
# String columns and their length limits (characters): ids, short labels, free text.
_ID, _LABEL, _TEXT = 256, 1024, 64 * 1024
STRING_COLUMNS: dict[str, int] = {
    "event_id": _ID, "parent_id": _ID, "call_id": _ID, "name": _LABEL, "outcome": _LABEL,
    "checkpoint_op": _LABEL, "job": _LABEL, "host": _LABEL, "backend": _LABEL, "op": _LABEL, "phase": _LABEL,
    "error": _TEXT, "checkpoint": _TEXT, "run": _TEXT, "path": _TEXT,
}
ATTRS_MAX_CHARS = 1024 * 1024
REQUIRED = ("event_id", "name")
# Where a record came from (e.g. "file:offset"), carried through cleaning for error reports.
POSITION_KEY = "_where"
# DateTime64's range in ClickHouse.
TS_MIN = datetime(1900, 1, 1, tzinfo=timezone.utc).timestamp()
TS_MAX = datetime(2299, 12, 31, 23, 59, 59, tzinfo=timezone.utc).timestamp()


class BadRecord(ValueError):
    """An event that cannot be stored as it is; the message says which field and why."""


def _int(column: str, value: Any) -> int | None:
    if value is None:
        return 0 if column == "pid" else None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadRecord(f"{column}: expected an integer, got {type(value).__name__} {_show(value)}")
    if isinstance(value, float):
        if not math.isfinite(value) or not value.is_integer():
            raise BadRecord(f"{column}: expected an integer, got {_show(value)}")
        value = int(value)
    low, high = INT_COLUMNS[column]
    if not low <= value <= high:
        raise BadRecord(f"{column}: {_show(value)} is outside its column's range [{low}, {high}]")
    return value


def _float(column: str, value: Any, default: float | None = None) -> float:
    if value is None and default is not None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadRecord(f"{column}: expected a number, got {type(value).__name__} {_show(value)}")
    try:
        number = float(value)
    except OverflowError:
        raise BadRecord(f"{column}: {_show(value)} is too large for a float") from None
    if not math.isfinite(number):
        raise BadRecord(f"{column}: {_show(value)} is not a finite number")
    return number


def _ts(value: Any) -> datetime:
    if value is None:
        raise BadRecord("ts: missing (seconds since the epoch)")
    seconds = _float("ts", value)
    if not TS_MIN <= seconds <= TS_MAX:
        raise BadRecord(f"ts: {_show(value)} is outside the storable years 1900-2299")
    return datetime.fromtimestamp(seconds, tz=timezone.utc)


def _str(column: str, value: Any, limit: int) -> str:
    if value is None:
        if column in REQUIRED:
            raise BadRecord(f"{column}: missing")
        return ""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str):
        raise BadRecord(f"{column}: expected a string, got {type(value).__name__}")
    if column in REQUIRED and not value:
        raise BadRecord(f"{column}: empty")
    if len(value) > limit:
        raise BadRecord(f"{column}: {len(value)} characters, over the limit of {limit}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise BadRecord(f"{column}: not valid UTF-8 (lone surrogate)") from None
    return value


def _attrs(value: Any) -> str:
    if value is None:
        return "{}"
    if not isinstance(value, dict):
        raise BadRecord(f"attrs: expected an object, got {type(value).__name__}")
    try:
        text = json.dumps(value, separators=(",", ":"), default=str, ensure_ascii=False)
        text.encode("utf-8")
    except (ValueError, TypeError, RecursionError, UnicodeEncodeError) as exc:
        raise BadRecord(f"attrs: cannot be stored as JSON ({type(exc).__name__})") from None
    if len(text) > ATTRS_MAX_CHARS:
        raise BadRecord(f"attrs: {len(text)} characters as JSON, over the limit of {ATTRS_MAX_CHARS}")
    return text


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def clean_event(event: Any) -> dict[str, Any]:
    """``event`` with every column typed for insertion; raises BadRecord saying what is wrong."""
    if not isinstance(event, dict):
        raise BadRecord(f"not a JSON object but {type(event).__name__}")
    out: dict[str, Any] = {"ts": _ts(event.get("ts")),
                           "duration_s": _float("duration_s", event.get("duration_s"), 0.0),
                           "attrs": _attrs(event.get("attrs"))}
    for column, limit in STRING_COLUMNS.items():
        out[column] = _str(column, event.get(column), limit)
    for column in INT_COLUMNS:
        out[column] = _int(column, event.get(column))
    if POSITION_KEY in event:
        out[POSITION_KEY] = event[POSITION_KEY]
    return out
