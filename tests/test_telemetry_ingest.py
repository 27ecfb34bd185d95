"""The ingester against a real broker and a real chdb store: crashes, outages, restarts."""

from __future__ import annotations

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
from telemetry.store import queries as q
from tests.telemetry_servers import ROOT, run_ingester


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
        return q.event_counts(client, job="ingest", run=run)
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
