"""Process-wide and per-task context fields stamped onto every telemetry event."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from typing import Any

# Fields every event carries at top level (None when unknown), in schema order.
CONTEXT_KEYS: tuple[str, ...] = (
    "job",
    "run",
    "step",
    "rank",
    "world_size",
    "dp",
    "tp",
    "pp",
    "host",
    "pid",
)

_lock = threading.Lock()
# Copy-on-write: writers publish fresh dicts so readers on the hot path need no lock.
_snapshot: dict[str, Any] = {}
# The snapshot pre-split into the fixed event columns and the extra fields, published
# together as one tuple so a reader never sees halves of two different updates.
_split: tuple[dict[str, Any], dict[str, Any]] = ({}, {})
_overrides: ContextVar[Mapping[str, Any] | None] = ContextVar(
    "bcp_telemetry_overrides", default=None
)


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        return int(raw)
    except ValueError:
        # A malformed launcher variable must not stop the training process.
        return None


def _defaults() -> dict[str, Any]:
    fields: dict[str, Any] = dict.fromkeys(CONTEXT_KEYS)
    fields["job"] = os.environ.get("BCP_JOB") or "default"
    fields["run"] = os.environ.get("BCP_RUN", "")
    fields["rank"] = _env_int("RANK")
    fields["world_size"] = _env_int("WORLD_SIZE")
    fields["host"] = socket.gethostname()
    fields["pid"] = os.getpid()
    return fields


def _validate(fields: Mapping[str, Any]) -> None:
    for key, value in fields.items():
        # Restrict to scalars so the context stays cheap to copy and trivially JSON-safe.
        if value is not None and not isinstance(value, (str, int)):
            raise TypeError(
                f"telemetry context field {key!r} must be str, int or None, "
                f"got {type(value).__name__}"
            )


def _split_fields(fields: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    columns = {key: fields.get(key) for key in CONTEXT_KEYS}
    extras = {key: value for key, value in fields.items() if key not in columns}
    return columns, extras


def _publish(fields: dict[str, Any]) -> None:
    global _snapshot, _split
    _snapshot = fields
    _split = _split_fields(fields)


def set_context(**fields: str | int | None) -> None:
    """Merge ``fields`` into the process-wide context; ``None`` unsets a field."""
    _validate(fields)
    with _lock:
        merged = dict(_snapshot)
        for key, value in fields.items():
            if value is None and key not in CONTEXT_KEYS:
                merged.pop(key, None)
            else:
                merged[key] = value
        _publish(merged)


def reset_context() -> None:
    """Restore the environment-derived defaults (drops everything set_context added)."""
    with _lock:
        _publish(_defaults())


def get_context() -> dict[str, Any]:
    """Return a copy of the process context with this thread/task's overrides applied."""
    merged = dict(_snapshot)
    overrides = _overrides.get()
    if overrides:
        merged.update(overrides)
    return merged


def event_context() -> tuple[dict[str, Any], dict[str, Any]]:
    """(fixed columns in CONTEXT_KEYS order, extra fields) for stamping an event.

    May return shared dicts: callers must copy rather than mutate them.
    """
    overrides = _overrides.get()
    if not overrides:
        return _split
    merged = dict(_snapshot)
    merged.update(overrides)
    return _split_fields(merged)


@contextlib.contextmanager
def context(**fields: str | int | None) -> Iterator[dict[str, Any]]:
    """Override context fields for the current thread/asyncio task until the block exits."""
    _validate(fields)
    current = _overrides.get()
    layered = dict(current) if current else {}
    layered.update(fields)
    token = _overrides.set(layered)
    try:
        yield get_context()
    finally:
        _overrides.reset(token)


def _after_fork_in_child() -> None:
    global _lock
    # The parent's lock may have been held at fork time; the child needs its own.
    _lock = threading.Lock()
    _publish({**_snapshot, "pid": os.getpid()})


_publish(_defaults())

if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
