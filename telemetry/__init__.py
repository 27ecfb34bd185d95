"""Span-based telemetry for bytecheckpoint.

Every instrumented phase runs inside ``span(name, **fields)``; on exit the span becomes
one flat JSON event queued without blocking and written by a background thread to the
configured sink (JSON-lines spool files by default).
"""

from telemetry.config import configure
from telemetry.context import context, get_context, set_context
from telemetry.emitter import flush, shutdown, stats
from telemetry.spans import PENDING_STEP, scope_step, span, timed

__all__ = [
    "PENDING_STEP",
    "configure",
    "context",
    "flush",
    "get_context",
    "scope_step",
    "set_context",
    "shutdown",
    "span",
    "stats",
    "timed",
]
