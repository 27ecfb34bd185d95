"""Telemetry sinks: where batches of events end up."""

from telemetry.sinks.base import Sink
from telemetry.sinks.spool import DEFAULT_MAX_BYTES, SpoolSink, read_spool

__all__ = ["DEFAULT_MAX_BYTES", "Sink", "SpoolSink", "read_spool"]
