"""Kafka source: a consumer group member that commits offsets only when told to."""

from __future__ import annotations

import logging
import time
from typing import Any

from telemetry.ingest.records import Reject, decode_lines
from telemetry.ingest.runner import Batch

log = logging.getLogger("telemetry.ingest")

DEFAULT_GROUP = "bcp-ingest"


def ensure_topic(bootstrap: str, topic: str, partitions: int = 1, timeout_s: float = 10.0) -> None:
    """Create ``topic`` if it does not exist (brokers that auto-create need nothing)."""
    from kafka import KafkaAdminClient
    from kafka.admin import NewTopic
    from kafka.errors import TopicAlreadyExistsError

    admin = KafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=int(timeout_s * 1000))
    try:
        admin.create_topics([NewTopic(topic, partitions, 1)])
    except TopicAlreadyExistsError:
        pass
    finally:
        admin.close()


class KafkaSource:
    """Reads event messages from ``topic`` as member of consumer group ``group``.

    A message's lines that cannot be stored (not JSON, fields out of range...) come back as
    rejects for the quarantine; the offset moves past them like past any other message.
    """

    name = "kafka"

    def __init__(self, bootstrap: str, topic: str, group: str = DEFAULT_GROUP,
                 consumer_config: dict[str, Any] | None = None) -> None:
        from kafka import KafkaConsumer

        self.topic = topic
        config = {
            "bootstrap_servers": bootstrap,
            "group_id": group,
            "enable_auto_commit": False,
            "auto_offset_reset": "earliest",
            # A short session makes the first group join quick (the default waits ~23 s on
            # tansu) and lets a restarted ingester take over a dead one's partitions quickly.
            "session_timeout_ms": 6000,
            "heartbeat_interval_ms": 1000,
            # Long enough to outwait a ClickHouse outage between polls without being evicted.
            "max_poll_interval_ms": 600_000,
            **(consumer_config or {}),
        }
        try:
            self._consumer = KafkaConsumer(topic, **config)
        except Exception as exc:  # noqa: BLE001 - NoBrokersAvailable, bad config
            raise ConnectionError(f"cannot reach Kafka at {bootstrap} ({type(exc).__name__}: {exc}); "
                                  "check --kafka / BCP_TELEMETRY_KAFKA and that the broker runs") from exc

    @property
    def assigned(self) -> bool:
        return bool(self._consumer.assignment())

    def poll(self, max_events: int, linger_s: float) -> Batch:
        """Messages for up to ``linger_s`` or ``max_events`` events, with the offsets past them."""
        events: list[dict[str, Any]] = []
        rejects: list[Reject] = []
        offsets: dict[Any, int] = {}
        deadline = time.monotonic() + linger_s
        while len(events) < max_events:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            # One message at a time (each holds many events), so a batch stops near max_events;
            # poll() serves later messages from its fetch buffer without a round trip.
            records = self._consumer.poll(timeout_ms=int(remaining * 1000) + 1, max_records=1)
            if not records and events:
                break
            for tp, messages in records.items():
                for message in messages:
                    label = f"{tp.topic}/{tp.partition}@{message.offset}"
                    value = message.value if isinstance(message.value, bytes) else b""
                    got, bad = decode_lines(value, label)
                    events.extend(got)
                    rejects.extend(bad)
                    offsets[tp] = message.offset + 1
        return Batch(events, offsets or None, rejects)

    def commit(self, position: Any) -> None:
        from kafka.structs import OffsetAndMetadata

        self._consumer.commit({tp: OffsetAndMetadata(offset, "", -1) for tp, offset in position.items()})

    def rewind(self, position: Any) -> None:
        """After a failed commit, re-read from the last committed offsets (dedup absorbs it)."""
        for tp in position:
            committed = self._consumer.committed(tp)
            self._consumer.seek(tp, committed or 0)

    def close(self) -> None:
        self._consumer.close(autocommit=False)
