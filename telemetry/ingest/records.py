"""Turn raw JSON lines into events, setting aside (with a reason) what cannot be stored.

Nothing here raises on bad input: a line that is not JSON or not an object becomes a
``Reject`` that the ingester quarantines, and the lines after it flow on. Events keep where
they came from under WHERE_KEY, so one that fails the column checks later
(``telemetry.store.validate``) is quarantined with its position too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from telemetry.store.validate import POSITION_KEY as WHERE_KEY

# How much of a rejected record the quarantine keeps.
KEEP_BYTES = 64 * 1024


@dataclass(frozen=True)
class Reject:
    reason: str
    record: bytes  # the first KEEP_BYTES of it
    size: int  # its full size in bytes
    position: str  # e.g. "events-h-1-00000.jsonl:4096" or "topic/0@17"

    @classmethod
    def of(cls, raw: bytes, reason: str, position: str, size: int | None = None) -> Reject:
        return cls(reason, bytes(raw[:KEEP_BYTES]), len(raw) if size is None else size, position)

    @classmethod
    def of_event(cls, event: dict[str, Any], reason: str) -> Reject:
        data = {k: v for k, v in event.items() if k != WHERE_KEY}
        raw = json.dumps(data, default=str).encode("utf-8", "backslashreplace")
        return cls.of(raw, reason, str(event.get(WHERE_KEY, "")))


def decode_lines(data: bytes, label: str, base: int = 0) -> tuple[list[dict[str, Any]], list[Reject]]:
    """Events and rejects of the lines in ``data``, which starts at byte ``base`` of ``label``
    (callers cut off a torn last line first)."""
    events: list[dict[str, Any]] = []
    rejects: list[Reject] = []
    offset = 0
    for line in data.split(b"\n"):
        where = base + offset
        offset += len(line) + 1
        if not line.strip():
            continue
        try:
            raw = json.loads(line)
        except RecursionError:
            rejects.append(Reject.of(line, "JSON nested too deeply", f"{label}:{where}"))
            continue
        except ValueError as exc:  # includes UnicodeDecodeError
            rejects.append(Reject.of(line, f"not JSON ({str(exc)[:100]})", f"{label}:{where}"))
            continue
        if not isinstance(raw, dict):
            rejects.append(Reject.of(line, f"not a JSON object but {type(raw).__name__}", f"{label}:{where}"))
            continue
        raw[WHERE_KEY] = f"{label}:{where}"
        events.append(raw)
    return events, rejects
