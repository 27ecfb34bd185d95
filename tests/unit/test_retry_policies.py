"""The one retry policy (tenacity) as each user sees it: the ingester's waits double from the
first to the longest, stop at its deadline with a named error and end at once when asked to; the
Kafka sink never sleeps but spaces its reconnects the same way and starts over after a success."""

from __future__ import annotations

import logging
import re
import threading
import time
from pathlib import Path

import pytest

from telemetry.ingest.runner import Batch, Ingester
from telemetry.ingest.spool_source import SpoolSource
from telemetry.sinks.kafka import KafkaSink
from telemetry.store import StoreUnavailableError
from tests.support.dist import free_port

EVENT = {"event_id": "e1", "name": "save.write", "ts": 1.0}


def _ingester(tmp_path: Path, **kw) -> Ingester:
    # Nothing listens on this port: every connect is refused at once, as with a server down.
    return Ingester(SpoolSource(tmp_path), f"http://127.0.0.1:{free_port()}/bcp", **kw)


def test_ingester_backs_off_exponentially_then_gives_up_with_a_named_error(tmp_path, caplog):
    # 3 s leaves room for four waits (1.1 s) even when each refused connect is slow (a busy machine)
    ingester = _ingester(tmp_path, retry_s=(0.1, 0.4), retry_for_s=3.0)
    caplog.set_level(logging.WARNING, logger="telemetry.ingest")
    start = time.monotonic()
    with pytest.raises(StoreUnavailableError, match="stayed unreachable for 3s.*a rerun resumes there"):
        ingester.insert(Batch([dict(EVENT)], position=1), threading.Event())
    took = time.monotonic() - start
    waits = [float(w) for w in re.findall(r"retrying in ([0-9.]+)s", caplog.text)]
    assert waits[:4] == [0.1, 0.2, 0.4, 0.4], waits  # doubling from the first wait, capped
    assert all(w <= 0.4 for w in waits), waits  # the last one is cut to the deadline
    assert 3.0 <= took < 10, took
    assert ingester.stats.insert_failures == len(waits) + 1


def test_ingester_stops_waiting_when_asked(tmp_path):
    ingester = _ingester(tmp_path, retry_s=(5.0, 5.0), retry_for_s=60)
    stop = threading.Event()
    threading.Timer(0.3, stop.set).start()
    start = time.monotonic()
    assert ingester.insert(Batch([dict(EVENT)], position=1), stop) is False
    assert time.monotonic() - start < 3
    assert ingester.stats.insert_failures == 1, "no attempt after the stop"


def test_kafka_sink_spaces_reconnects_exponentially_and_resets_after_success(tmp_path, monkeypatch):
    import kafka
    from kafka.errors import KafkaConnectionError, KafkaTimeoutError

    tries: list[float] = []
    up = {"now": False}

    class Acked:
        is_done = True

        def succeeded(self) -> bool:
            return True

    class Broker:  # stands for the broker's answers; everything else is the sink's own code
        def __init__(self, **config):
            tries.append(time.monotonic())
            if not up["now"]:
                raise KafkaTimeoutError("no broker answered")

        def send(self, topic, value, key):
            if not up["now"]:
                raise KafkaConnectionError("broker went away")
            return Acked()

        def flush(self, timeout=None):
            pass

        def close(self, timeout=None):
            pass

    monkeypatch.setattr(kafka, "KafkaProducer", Broker)
    sink = KafkaSink("127.0.0.1:1", "t", tmp_path, retry_backoff_s=(0.1, 0.3))

    def emit_for(seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            sink.emit([dict(EVENT)])  # never waits for the broker
            time.sleep(0.005)

    emit_for(1.2)
    gaps = [b - a for a, b in zip(tries, tries[1:])]
    assert len(gaps) >= 4, gaps
    for gap, due in zip(gaps, [0.1, 0.2, 0.3, 0.3]):
        assert due <= gap < due + 0.5, gaps  # never early; late only by the scheduler's delay
    up["now"] = True
    time.sleep(0.35)
    sink.emit([dict(EVENT)])
    assert sink.stats()["sent"] > 0 and sink.stats()["pending_bytes"] == 0
    up["now"] = False
    # Read the clock before the failing send: the failure (and the backoff's start) comes
    # after it, so the retry can be no earlier than 0.1 s past this time.
    failed_at, before = time.monotonic(), len(tries)
    sink.emit([dict(EVENT)])  # the send fails: the broker is marked down
    emit_for(0.6)
    assert len(tries) > before, "it reconnects"
    # 0.1 s again, not the 0.3 s cap reached before: under 0.3 s tells the two apart
    assert 0.1 <= tries[before] - failed_at < 0.3, "the backoff starts over after a success"
    sink.close()
