"""The environment variables telemetry reads: the span emitter and its sinks in training
processes, then the store, the ingester and the alert evaluator (see bytecheckpoint.settings)."""

from __future__ import annotations

from bytecheckpoint.settings import Setting, registry

_TEL = "telemetry/config.py"

REGISTRY = registry("telemetry", "Telemetry: training processes, the ingester and the alert evaluator", (
    Setting("BCP_TELEMETRY", _TEL, "on", "off / 0 / false disables every event"),
    Setting("BCP_TELEMETRY_SINK", _TEL, "spool (kafka when BCP_TELEMETRY_KAFKA is set)", "spool or kafka"),
    Setting("BCP_TELEMETRY_DIR", _TEL, "./.bytecheckpoint/telemetry", "spool directory"),
    Setting("BCP_TELEMETRY_KAFKA", _TEL, "", "Kafka bootstrap servers, host:port[,host:port]"),
    Setting("BCP_TELEMETRY_TOPIC", _TEL, "bcp-telemetry", "Kafka topic of the events"),
    Setting("BCP_TELEMETRY_QUEUE", _TEL, "65536", "events buffered in memory before dropping"),
    Setting("BCP_TELEMETRY_SPOOL_MAX_BYTES", _TEL, "67108864", "size at which a spool file is rotated"),
    Setting("BCP_TELEMETRY_SPOOL_LIMIT_BYTES", _TEL, "1073741824",
            "spool bytes kept before the oldest are dropped (not yet ingested, or acknowledged by Kafka)"),
    Setting("BCP_TELEMETRY_FSYNC", _TEL, "interval", "spool fsync policy: interval, always or never"),
    Setting("BCP_JOB", "telemetry/context.py", "default", "job name on every event"),
    Setting("BCP_RUN", "telemetry/context.py", "", "run name on every event"),
    # the store, the ingester and the alert evaluator (not training processes)
    Setting("BCP_CLICKHOUSE_DSN", "telemetry/store/client.py", "chdb://<spool dir>/../store",
            "ClickHouse: http(s)://user:pass@host:8123/db, or chdb:///abs/path (embedded)"),
    Setting("BCP_INGEST_GROUP", "telemetry/ingest/__main__.py", "bcp-ingest",
            "Kafka consumer group of the ingester"),
    Setting("BCP_INGEST_KILL_AFTER_INSERTS", "telemetry/ingest/runner.py", "0",
            "crash test hook (never set in production)"),
))
