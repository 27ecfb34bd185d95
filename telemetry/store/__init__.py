"""The ClickHouse side: connection by DSN, the versioned schema, row mapping and the read queries.

``chdb:///path`` opens the embedded engine (one process per store directory); ``http://``
or ``https://`` DSNs reach a ClickHouse server. Nothing else differs between the two.
"""

from telemetry.store.client import (
    DSN_ENV,
    StoreConfigError,
    StoreError,
    StoreUnavailableError,
    connect,
    default_dsn,
)
from telemetry.store.schema import SCHEMA_VERSION, ensure_schema
from telemetry.store.writer import insert_alerts, insert_events

__all__ = [
    "DSN_ENV",
    "SCHEMA_VERSION",
    "StoreConfigError",
    "StoreError",
    "StoreUnavailableError",
    "connect",
    "default_dsn",
    "ensure_schema",
    "insert_alerts",
    "insert_events",
]
