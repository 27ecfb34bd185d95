"""What telemetry accepted survives: SIGKILL, exit with Kafka down, settings made after import,
and a spool that stays bounded (shipped / ingested segments deleted, a size cap)."""

from __future__ import annotations

import logging
import os
import signal
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
from telemetry.sinks.kafka import PENDING_DIR, KafkaSink
from telemetry.sinks.spool import read_spool
from tests.integration.test_telemetry_kafka_sink import _consume, _events
from tests.support.dist import free_port
from tests.support.telemetry_servers import ROOT, run_ingester

# Emits N spans through the environment's settings, prints their ids, then dies or exits.
EMITTER = r"""
import os, signal, sys
import telemetry
ids = []
for i in range(int(sys.argv[1])):
    with telemetry.span("durable.step", i=i) as s:
        pass
    ids.append(s.event_id)
print(" ".join(ids), flush=True)
if sys.argv[2] == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
"""


def _python(code: str, *args: str, env: dict[str, str], cwd: Path = ROOT,
            timeout: float = 60) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    return subprocess.run([sys.executable, "-c", code, *args], cwd=cwd, env=full, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.parametrize("end", ["kill", "exit"])
def test_events_outlive_sigkill_and_exit_while_kafka_is_down(end, kafka_broker, topic, tmp_path: Path):
    spool = tmp_path / "spool"
    dead = {"BCP_TELEMETRY_SINK": "kafka", "BCP_TELEMETRY_KAFKA": f"127.0.0.1:{free_port()}",
            "BCP_TELEMETRY_DIR": str(spool), "BCP_TELEMETRY_TOPIC": topic}
    first = _python(EMITTER, "300", end, env=dead)
    assert first.returncode == (-signal.SIGKILL if end == "kill" else 0), first.stderr
    emitted = first.stdout.split()
    assert len(emitted) == 300
    # On disk, nothing sent: every accepted event is in the write-ahead spool.
    assert sorted(e["event_id"] for e in read_spool(spool / PENDING_DIR)) == sorted(emitted)

    # The next process on this spool directory, with the broker up, ships them (and its own).
    up = {**dead, "BCP_TELEMETRY_KAFKA": kafka_broker.bootstrap}
    second = _python(EMITTER, "1", "exit", env=up)
    assert second.returncode == 0, second.stderr
    expected = set(emitted) | set(second.stdout.split())
    _, got = _consume(kafka_broker.bootstrap, topic, len(expected))
    assert {e["event_id"] for e in got} == expected
    assert not list((spool / PENDING_DIR).glob("*.jsonl")), "acknowledged segments are deleted"


def test_settings_made_after_import_are_honoured(tmp_path: Path):
    code = ("import os, sys, telemetry, bytecheckpoint\n"
            "os.environ['BCP_TELEMETRY_DIR'] = sys.argv[1]\n"
            "with telemetry.span('late.settings'):\n    pass\n")
    target = tmp_path / "runs" / "telemetry"
    proc = _python(code, str(target), env={"BCP_TELEMETRY_DIR": ""}, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert [e["name"] for e in read_spool(target)] == ["late.settings"]
    assert not (tmp_path / ".bytecheckpoint").exists(), "nothing may land in the import-time default"


def test_configure_reads_the_environment_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    reset_context()
    first, second = tmp_path / "first", tmp_path / "second"
    monkeypatch.setenv("BCP_TELEMETRY_DIR", str(first))
    config.reset()
    try:
        with telemetry.span("one"):
            pass
        monkeypatch.setenv("BCP_TELEMETRY_DIR", str(second))
        telemetry.configure(enabled=True)
        with telemetry.span("two"):
            pass
        assert telemetry.flush()
        assert [e["name"] for e in read_spool(first)] == ["one"]
        assert [e["name"] for e in read_spool(second)] == ["two"]
    finally:
        config.reset()


def test_spool_cap_drops_the_oldest_with_a_counted_warning(tmp_path: Path, caplog):
    reset_context()
    spool = tmp_path / "spool"
    telemetry.configure(spool_dir=spool, spool_limit_bytes=40_000, spool_max_bytes=8_000)
    try:
        before = telemetry.stats()
        with caplog.at_level(logging.WARNING, logger="telemetry.spool"):
            for i in range(600):
                with telemetry.span("capped", i=i):
                    pass
            assert telemetry.flush()
        stats = telemetry.stats()
        dropped = stats["sink_dropped"]
        kept = sorted(e["attrs"]["i"] for e in read_spool(spool))
        assert dropped > 0 and dropped + len(kept) == 600
        assert kept == list(range(dropped, 600)), "the oldest events go first"
        assert sum(p.stat().st_size for p in spool.glob("*.jsonl")) <= 40_000 + 8_000
        assert stats["emitted"] - before["emitted"] == 600
        assert any("dropping the oldest" in r.getMessage() for r in caplog.records)
    finally:
        config.reset()


def test_kafka_shipper_deletes_acknowledged_segments_as_it_goes(kafka_broker, topic, tmp_path: Path):
    sink = KafkaSink(kafka_broker.bootstrap, topic, tmp_path, spool_file_bytes=20_000, send_timeout_s=2.0)
    events = _events(400)  # ~100 KB: several segments
    for i in range(0, 400, 50):
        sink.emit(events[i:i + 50])
    left = list((tmp_path / PENDING_DIR).glob("*.jsonl"))
    assert len(left) <= 1, left  # only the open segment; every sealed one was shipped and deleted
    assert sink.stats()["sent"] == 400 and sink.stats()["pending_bytes"] == 0
    sink.close()
    assert not list((tmp_path / PENDING_DIR).iterdir())
    _, got = _consume(kafka_broker.bootstrap, topic, 400)
    assert sorted(e["event_id"] for e in got) == sorted(e["event_id"] for e in events)


def _spool_events(n: int, run: str) -> list[dict[str, Any]]:
    now = time.time()
    return [{"event_id": uuid.uuid4().hex, "name": "save.write", "ts": now + i * 1e-3, "duration_s": 0.01,
             "outcome": "ok", "job": "durable", "run": run, "rank": 0, "step": 1, "attrs": {}}
            for i in range(n)]


def test_ingester_deletes_what_it_stored_and_keeps_live_segments(chdb_dsn, tmp_path: Path):
    from telemetry.sinks.spool import SpoolSink
    from telemetry.store import connect
    from tests.support.telemetry_store_reads import event_counts

    spool, run = tmp_path / "spool", uuid.uuid4().hex[:8]
    sink = SpoolSink(spool, max_bytes=10_000)
    events = _spool_events(300, run)
    sink.emit(events)
    sink.flush()  # seals the rotated segments
    live = sink.current_path
    assert live is not None and len(list(spool.glob("*.jsonl"))) > 2
    run_ingester("--spool", str(spool), "--dsn", chdb_dsn, "--once", "--idle-s", "0.5")
    assert [p.name for p in spool.glob("*.jsonl")] == [live.name], "stored sealed segments are deleted"
    more = _spool_events(5, run)
    sink.emit(more)
    sink.close()  # seals the last one
    run_ingester("--spool", str(spool), "--dsn", chdb_dsn, "--once", "--idle-s", "0.5")
    assert not list(spool.glob("*.jsonl"))
    client = connect(chdb_dsn)
    try:
        counts = event_counts(client, job="durable", run=run)
    finally:
        client.close()
    assert counts["distinct_ids"] == counts["final_rows"] == 305


def test_fsync_policy_is_a_setting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    reset_context()
    with pytest.raises(ValueError, match="interval, always, never"):
        telemetry.configure(fsync="sometimes")
    monkeypatch.setenv("BCP_TELEMETRY_FSYNC", "always")
    monkeypatch.setenv("BCP_TELEMETRY_DIR", str(tmp_path))
    config.reset()
    try:
        with telemetry.span("synced"):
            pass
        assert config.settings.fsync == "always"
        assert [e["name"] for e in read_spool(tmp_path)] == ["synced"]  # on disk before any flush
        monkeypatch.setenv("BCP_TELEMETRY_FSYNC", "bogus")  # a typo must not take the job down
        config.reset()
        with telemetry.span("default"):
            pass
        assert config.settings.fsync == "interval"
    finally:
        config.reset()


def test_empty_and_torn_sealed_segments_do_not_linger(chdb_dsn, tmp_path: Path):
    spool = tmp_path / "spool"
    spool.mkdir()
    empty, torn = spool / "events-elsewhere-1-00000.jsonl", spool / "events-elsewhere-1-00001.jsonl"
    empty.write_bytes(b"")
    torn.write_bytes(b'{"event_id": "half')
    for path in (empty, torn):
        path.chmod(0o444)
    proc = run_ingester("--spool", str(spool), "--dsn", chdb_dsn, "--once", "--idle-s", "0.5", check=False)
    assert proc.returncode == 3 and "quarantined 1 records" in proc.stdout, proc.stderr
    assert not list(spool.glob("*.jsonl"))
