"""The environment variables the dashboard reads (see bytecheckpoint.settings). It also reads
telemetry's ``BCP_CLICKHOUSE_DSN`` and ``BCP_TELEMETRY_DIR``, which telemetry declares."""

from __future__ import annotations

from bytecheckpoint.settings import Setting, registry

REGISTRY = registry("dashboard", "Dashboard", (
    Setting("BCP_DASHBOARD_DSN", "dashboard/store.py", "BCP_CLICKHOUSE_DSN", "the dashboard's store"),
    Setting("BCP_DASHBOARD_SPOOL", "dashboard/app.py", "",
            "a spool directory the dashboard ingests itself"),
))
