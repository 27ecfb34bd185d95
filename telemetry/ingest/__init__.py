"""Ingester: telemetry events from Kafka (or spool files) into ClickHouse, at least once.

A source hands out a batch plus an opaque position; the runner inserts the batch and only
then commits the position. A crash between the two redelivers the batch, which the tables
deduplicate on event_id. Run it with ``python -m telemetry.ingest --help``.
"""

from telemetry.ingest.runner import Batch, Ingester, Source

__all__ = ["Batch", "Ingester", "Source"]
