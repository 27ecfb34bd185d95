"""The Kafka sink against a real tansu broker: batching, outages, re-sending, limits."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

import telemetry
from telemetry import config
from telemetry.context import reset_context
from telemetry.sinks.kafka import PENDING_DIR, KafkaSink, decode_message
from telemetry.sinks.spool import read_spool
from tests.support.dist import free_port
from tests.support.telemetry_servers import Broker


def _events(n: int) -> list[dict[str, Any]]:
    return [{"event_id": uuid.uuid4().hex, "name": "save.write", "ts": time.time(), "bytes": i,
             "attrs": {"pad": "x" * 200}} for i in range(n)]


def _consume(bootstrap: str, topic: str, expect: int, timeout: float = 20.0) -> tuple[int, list[dict]]:
    """(messages, events) on the topic, read by a fresh consumer group from the start."""
    from kafka import KafkaConsumer

    # tansu serves group members; a group-less assign()ed consumer receives nothing from it.
    consumer = KafkaConsumer(topic, bootstrap_servers=bootstrap, group_id=f"g-{uuid.uuid4().hex[:8]}",
                             enable_auto_commit=False, auto_offset_reset="earliest",
                             session_timeout_ms=6000, heartbeat_interval_ms=1000)
    messages, events = 0, []
    deadline = time.monotonic() + timeout
    while len(events) < expect and time.monotonic() < deadline:
        for records in consumer.poll(timeout_ms=500).values():
            for record in records:
                messages += 1
                events.extend(decode_message(record.value))
    consumer.close()
    return messages, events


def _fast(bootstrap: str, topic: str, spool: Path, **kw: Any) -> KafkaSink:
    return KafkaSink(bootstrap, topic, spool, send_timeout_s=1.0, retry_backoff_s=(0.1, 0.5), **kw)


def test_batches_many_events_per_message(kafka_broker, topic, tmp_path: Path):
    sink = _fast(kafka_broker.bootstrap, topic, tmp_path)
    events = _events(3000)
    sink.emit(events[:1500])
    sink.emit(events[1500:])
    sink.close()
    messages, got = _consume(kafka_broker.bootstrap, topic, len(events))
    assert [e["event_id"] for e in got] == [e["event_id"] for e in events]
    assert messages <= 10, "events must be packed many per message"
    assert sink.stats()["sent"] == 3000 and sink.stats()["pending"] == sink.stats()["send_failures"] == 0
    assert not list((tmp_path / PENDING_DIR).glob("*.jsonl")), "shipped segments are deleted at close"


def test_unreachable_broker_spools_then_resends_everything_once(topic, tmp_path: Path):
    broker = Broker(free_port())  # not started yet: nothing listens on its port
    sink = _fast(broker.bootstrap, topic, tmp_path)
    events = _events(500)
    start = time.monotonic()
    for i in range(0, 500, 100):
        sink.emit(events[i:i + 100])
    assert time.monotonic() - start < 10, "a dead broker must cost bounded time"
    assert sink.stats()["pending"] == 500 and sink.stats()["pending_bytes"] > 0
    assert list((tmp_path / PENDING_DIR).glob("*.jsonl"))
    broker.start()
    try:
        deadline = time.monotonic() + 30
        while sink.stats()["pending_bytes"] and time.monotonic() < deadline:
            time.sleep(0.2)
            sink.poll()  # what the emitter's writer thread does when idle
        assert sink.stats()["pending_bytes"] == 0 and sink.stats()["sent"] == 500
        _, got = _consume(broker.bootstrap, topic, 500)
        assert sorted(e["event_id"] for e in got) == sorted(e["event_id"] for e in events)
        sink.close()
        assert not list((tmp_path / PENDING_DIR).glob("*.jsonl"))
    finally:
        sink.close()
        broker.stop()


def test_full_spool_drops_oldest_first_and_counts(topic, tmp_path: Path):
    sink = _fast(f"127.0.0.1:{free_port()}", topic, tmp_path, spool_limit_bytes=20_000)
    events = _events(250)
    for i in range(0, 250, 50):
        sink.emit(events[i:i + 50])
    stats = sink.stats()
    kept = [e["event_id"] for e in read_spool(tmp_path / PENDING_DIR)]
    assert stats["dropped"] > 0 and stats["dropped"] + len(kept) == 250
    assert kept == [e["event_id"] for e in events[stats["dropped"]:]], "the oldest go first"
    assert stats["pending_bytes"] <= 20_000
    sink.close()


def test_spans_never_block_or_raise_with_a_dead_broker(topic, tmp_path: Path):
    reset_context()
    telemetry.configure(kafka=f"127.0.0.1:{free_port()}", topic=topic, spool_dir=tmp_path)
    try:
        start = time.perf_counter()
        for _ in range(2000):
            with telemetry.span("save.write", bytes=1):
                pass
        per_span = (time.perf_counter() - start) / 2000
        assert per_span < 200e-6, f"{per_span * 1e6:.0f} us per span"
        telemetry.flush(timeout=30)
        stats = telemetry.stats()
        assert stats["sink_pending"] == 2000 and stats["dropped"] == stats["sink_dropped"] == 0
    finally:
        config.reset()


def test_pending_files_of_a_dead_process_are_adopted(kafka_broker, topic, tmp_path: Path):
    # A process spools (its broker address is dead) and exits; a later sink re-sends its events.
    code = ("import sys; from telemetry.sinks.kafka import KafkaSink; "
            "from tests.integration.test_telemetry_kafka_sink import _events; "
            "s = KafkaSink(sys.argv[1], 't', sys.argv[2], send_timeout_s=0.5); "
            "s.emit(_events(40)); print(s.stats()['pending'])")
    out = subprocess.run([sys.executable, "-c", code, f"127.0.0.1:{free_port()}", str(tmp_path)],
                         cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=60,
                         env={**os.environ})
    assert out.stdout.strip() == "40", out.stderr
    sink = _fast(kafka_broker.bootstrap, topic, tmp_path)
    assert sink.stats()["pending_bytes"] > 0
    sink.poll()
    assert sink.stats()["resent"] == 40 and sink.stats()["pending_bytes"] == 0
    sink.close()
    _, got = _consume(kafka_broker.bootstrap, topic, 40)
    assert len(got) == 40


def test_configure_rejects_kafka_without_servers():
    with pytest.raises(ValueError, match="bootstrap"):
        telemetry.configure(sink="kafka", kafka="")
    with pytest.raises(ValueError, match="unknown telemetry sink"):
        telemetry.configure(sink="carrier-pigeon")
    config.reset()
