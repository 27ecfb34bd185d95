"""The ingester against a real broker and a real chdb store: crashes, outages, restarts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from telemetry.ingest.runner import KILL_AFTER_INSERTS_ENV
from telemetry.sinks.kafka import KafkaSink
from telemetry.sinks.spool import SpoolSink
from telemetry.store import connect
from tests.support.telemetry_servers import ROOT, run_ingester
from tests.support.telemetry_store_reads import event_counts, quarantined


def _events(n: int, run: str) -> list[dict[str, Any]]:
    now = time.time()
    return [{"event_id": uuid.uuid4().hex, "name": "save.write", "ts": now + i * 1e-3, "duration_s": 0.01,
             "outcome": "ok", "job": "ingest", "run": run, "rank": i % 4, "step": 1, "bytes": 100,
             "checkpoint": "/c/step_1", "checkpoint_op": "save", "attrs": {}} for i in range(n)]


def _produce(bootstrap: str, topic: str, events: list[dict[str, Any]], tmp: Path, per_message: int) -> None:
    sink = KafkaSink(bootstrap, topic, tmp / "unsent")
    for start in range(0, len(events), per_message):
        sink.emit(events[start:start + per_message])
    sink.close()
    assert sink.stats()["sent"] == len(events)


def _counts(dsn: str, run: str) -> dict[str, int]:
    client = connect(dsn)
    try:
        return event_counts(client, job="ingest", run=run)
    finally:
        client.close()


def test_ingester_killed_between_insert_and_commit_loses_and_duplicates_nothing(
        kafka_broker, topic, chdb_dsn, tmp_path: Path):
    run, group = uuid.uuid4().hex[:8], f"g-{uuid.uuid4().hex[:8]}"
    events = _events(1200, run)
    _produce(kafka_broker.bootstrap, topic, events, tmp_path, per_message=100)
    args = ("--kafka", kafka_broker.bootstrap, "--topic", topic, "--dsn", chdb_dsn, "--group", group,
            "--once", "--idle-s", "2", "--batch-events", "300", "--linger-s", "0.2")
    crashed = run_ingester(*args, env={KILL_AFTER_INSERTS_ENV: "2"}, check=False)
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr
    partial = _counts(chdb_dsn, run)
    assert 0 < partial["distinct_ids"] < len(events)  # it died mid-stream, after inserting
    run_ingester(*args)  # restart: resumes from the committed offsets, re-reads the last batch
    counts = _counts(chdb_dsn, run)
    assert counts["distinct_ids"] == counts["final_rows"] == len(events)


def test_ingester_waits_for_the_store_and_loses_nothing(kafka_broker, topic, chdb_dsn, tmp_path: Path):
    run = uuid.uuid4().hex[:8]
    events = _events(500, run)
    _produce(kafka_broker.bootstrap, topic, events, tmp_path, per_message=50)
    holder = connect(chdb_dsn)  # chdb lets one process open a store: the ingester sees it down
    proc = subprocess.Popen(
        [sys.executable, "-m", "telemetry.ingest", "--kafka", kafka_broker.bootstrap, "--topic", topic,
         "--dsn", chdb_dsn, "--group", f"g-{uuid.uuid4().hex[:8]}", "--once", "--idle-s", "2"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(8)
        assert proc.poll() is None, "the ingester must wait, not give up"
    finally:
        holder.close()
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "insert failed" in err and "retrying" in err
    counts = _counts(chdb_dsn, run)
    assert counts["distinct_ids"] == counts["final_rows"] == len(events)


def test_spool_mode_tails_files_and_resumes(chdb_dsn, tmp_path: Path):
    spool = tmp_path / "spool"
    run = uuid.uuid4().hex[:8]
    sink = SpoolSink(spool)
    first = _events(300, run)
    sink.emit(first)
    run_ingester("--spool", str(spool), "--dsn", chdb_dsn, "--once", "--idle-s", "0.5")
    assert _counts(chdb_dsn, run)["final_rows"] == 300
    second = _events(200, run)
    sink.emit(second)
    with open(sink.current_path, "ab") as handle:
        handle.write(b'{"event_id": "torn')  # a write in progress is not read yet
    out = run_ingester("--spool", str(spool), "--dsn", chdb_dsn, "--once", "--idle-s", "0.5").stdout
    assert "ingested 200 events" in out
    counts = _counts(chdb_dsn, run)
    assert counts["final_rows"] == counts["stored"] == 500


def test_ingester_reports_bad_dsn_and_missing_source(tmp_path: Path):
    proc = run_ingester("--spool", str(tmp_path), "--dsn", "mysql://x", "--once", check=False)
    assert proc.returncode == 2 and "unsupported ClickHouse DSN" in proc.stderr
    proc = run_ingester("--dsn", f"chdb://{tmp_path}/s", "--once", check=False,
                        env={"BCP_TELEMETRY_KAFKA": ""})
    assert proc.returncode == 2 and "--kafka" in proc.stderr


@pytest.fixture(autouse=True)
def _no_stray_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(KILL_AFTER_INSERTS_ENV, raising=False)
    os.environ.pop("BCP_CLICKHOUSE_DSN", None)


# -- records that cannot be stored ---------------------------------------------------------


def _line(event: dict[str, Any]) -> bytes:
    return json.dumps(event).encode() + b"\n"


def _sealed_segment(spool: Path, body: bytes) -> Path:
    """A segment another (finished) writer left: complete and read-only."""
    spool.mkdir(parents=True, exist_ok=True)
    path = spool / "events-elsewhere-1-00000.jsonl"
    path.write_bytes(body)
    path.chmod(0o444)
    return path


def _stored_ids(dsn: str, run: str) -> list[str]:
    client = connect(dsn)
    try:
        rows = client.query("SELECT DISTINCT event_id FROM events WHERE run = {run:String}",
                            parameters={"run": run}).result_rows
        return sorted(r[0] for r in rows)
    finally:
        client.close()


def _quarantine(dsn: str) -> list[dict[str, Any]]:
    client = connect(dsn)
    try:
        return quarantined(client)
    finally:
        client.close()


def test_poison_spool_records_are_quarantined_and_the_rest_flows(chdb_dsn, tmp_path: Path):
    run = uuid.uuid4().hex[:8]
    good = _events(40, run)
    bad = [
        {**_events(1, run)[0], "step": float("inf")},  # json.dumps writes Infinity
        {**_events(1, run)[0], "step": 10**30},
        {**_events(1, run)[0], "pid": -1},
        {**_events(1, run)[0], "ts": 1e300},
        {**_events(1, run)[0], "run": "\ud800"},
        {**_events(1, run)[0], "event_id": None},
    ]
    body = b"".join(map(_line, good[:20])) + b"".join(map(_line, bad)) + b"not json {\n[1, 2]\n"
    body += b'{"event_id": "' + b"x" * (9 << 20) + b'"}\n'  # a line over the 8 MiB read window
    body += b"".join(map(_line, good[20:]))
    segment = _sealed_segment(tmp_path / "spool", body)
    proc = run_ingester("--spool", str(segment.parent), "--dsn", chdb_dsn, "--once", "--idle-s", "0.5",
                        check=False, timeout=180)
    assert proc.returncode == 3, proc.stderr
    assert "ingested 40 events" in proc.stdout and "quarantined 9 records" in proc.stdout
    assert _stored_ids(chdb_dsn, run) == sorted(e["event_id"] for e in good)
    reasons = [r["reason"] for r in _quarantine(chdb_dsn)]
    assert len(reasons) == 9
    for needle in ("step: expected an integer, got inf", "step: 10000", "pid: -1 is outside", "ts: 1e+300",
                   "run: not valid UTF-8", "event_id: missing", "not JSON", "not a JSON object",
                   "over the 8388608-byte limit"):
        assert any(needle in reason for reason in reasons), (needle, reasons)
    assert not segment.exists(), "a sealed segment read to its end is deleted"


def test_a_batch_the_store_refuses_is_bisected_to_the_refused_records(chdb_dsn, tmp_path: Path):
    from telemetry.store import ensure_schema

    client = connect(chdb_dsn)
    try:  # a store that refuses what passes the column checks: an operator's constraint
        ensure_schema(client)
        client.command("ALTER TABLE events ADD CONSTRAINT small_rank CHECK ifNull(rank, 0) < 100")
    finally:
        client.close()
    run = uuid.uuid4().hex[:8]
    events = _events(60, run)
    for i in (7, 41):
        events[i]["rank"] = 500
    segment = _sealed_segment(tmp_path / "spool", b"".join(map(_line, events)))
    proc = run_ingester("--spool", str(segment.parent), "--dsn", chdb_dsn, "--once", "--idle-s", "0.5",
                        check=False)
    assert proc.returncode == 3, proc.stderr
    assert "ingested 58 events" in proc.stdout
    kept = [e["event_id"] for i, e in enumerate(events) if i not in (7, 41)]
    assert _stored_ids(chdb_dsn, run) == sorted(kept)
    rows = _quarantine(chdb_dsn)
    assert sorted(json.loads(r["record"])["event_id"] for r in rows) == sorted(
        events[i]["event_id"] for i in (7, 41))
    assert all("refused" in r["reason"] and "small_rank" in r["reason"] for r in rows)


def test_poison_kafka_messages_are_quarantined(kafka_broker, topic, chdb_dsn, tmp_path: Path):
    from kafka import KafkaProducer

    run = uuid.uuid4().hex[:8]
    good = _events(30, run)
    kafka_broker.create_topic(topic)
    producer = KafkaProducer(bootstrap_servers=kafka_broker.bootstrap)
    producer.send(topic, b"\n".join(json.dumps(e).encode() for e in good[:10]))
    producer.send(topic, b"\xff\xfe\x00 binary garbage")
    producer.send(topic, json.dumps({**good[10], "event_id": "nan-step", "step": float("nan")}).encode()
                  + b"\n" + json.dumps(good[10]).encode())
    producer.send(topic, b"\n".join(json.dumps(e).encode() for e in good[11:]))
    producer.flush()
    producer.close()
    proc = run_ingester("--kafka", kafka_broker.bootstrap, "--topic", topic, "--dsn", chdb_dsn,
                        "--group", f"g-{uuid.uuid4().hex[:8]}", "--once", "--idle-s", "2", check=False)
    assert proc.returncode == 3, proc.stderr
    assert "ingested 30 events" in proc.stdout and "quarantined 2 records" in proc.stdout
    assert _stored_ids(chdb_dsn, run) == sorted(e["event_id"] for e in good)
    positions = sorted(r["position"] for r in _quarantine(chdb_dsn))
    assert positions == [f"{topic}/0@1:0", f"{topic}/0@2:0"]


def test_an_unreachable_store_is_retried_for_a_bounded_time(chdb_dsn, tmp_path: Path):
    run = uuid.uuid4().hex[:8]
    events = _events(20, run)
    segment = _sealed_segment(tmp_path / "spool", b"".join(map(_line, events)))
    args = ("--spool", str(segment.parent), "--dsn", chdb_dsn, "--once", "--idle-s", "0.5")
    holder = connect(chdb_dsn)  # chdb lets one process open a store: the ingester finds it down
    try:
        start = time.monotonic()
        proc = run_ingester(*args, "--retry-for", "3", check=False)
        assert proc.returncode == 1 and "unreachable" in proc.stderr, proc.stderr
        assert time.monotonic() - start < 60
    finally:
        holder.close()
    assert segment.exists(), "nothing was stored, so nothing may be deleted"
    assert "ingested 20 events" in run_ingester(*args).stdout
    assert _stored_ids(chdb_dsn, run) == sorted(e["event_id"] for e in events)
