"""The whole pipeline with real parts: ranks -> Kafka sink -> tansu -> ingester -> chdb -> queries/alerts."""

from __future__ import annotations

import uuid
from pathlib import Path

from dashboard import queries as dq
from telemetry.alerts import SlowRank, evaluate
from telemetry.alerts.engine import RuleSet
from telemetry.store import connect
from tests.support import telemetry_workloads as tw
from tests.support.telemetry_servers import run_ingester
from tests.support.telemetry_store_reads import event_counts

SAVE_PHASES = {"save", "save.plan", "save.write", "save.commit"}
LOAD_PHASES = {"load", "load.metadata", "load.plan", "load.read", "load.apply", "load.barrier"}


def _ingest(broker, topic: str, dsn: str) -> str:
    proc = run_ingester("--kafka", broker.bootstrap, "--topic", topic, "--dsn", dsn, "--once",
                        "--idle-s", "2", "--group", f"g-{uuid.uuid4().hex[:8]}")
    return proc.stdout


def test_save_and_resharding_load_reach_clickhouse(world, kafka_broker, topic, chdb_dsn, tmp_path: Path):
    root, spool, run = str(tmp_path / "ckpt"), str(tmp_path / "spool"), f"e2e-{uuid.uuid4().hex[:6]}"
    kafka_broker.create_topic(topic)
    saved = world(4).run(tw.kafka_save, root, kafka_broker.bootstrap, topic, spool, "e2e", run)
    loaded = world(2).run(tw.kafka_load, root, kafka_broker.bootstrap, topic, spool, "e2e", run)
    assert all(s["stats"]["sink_send_failures"] == 0 for s in saved), "the broker was up: no send may fail"
    _ingest(kafka_broker, topic, chdb_dsn)

    client = connect(chdb_dsn)
    try:
        counts = event_counts(client, job="e2e", run=run)
        assert counts["final_rows"] == sum(s["events"] for s in saved) + sum(r["events"] for r in loaded)

        rows = dq.rank_phases(client, job="e2e", run=run, checkpoint=saved[0]["url"],
                              op="save").to_dict("records")
        got = {(r["rank"], r["phase"]) for r in rows}
        assert got >= {(rank, phase) for rank in range(4) for phase in SAVE_PHASES}
        assert all(r["duration_s"] > 0 for r in rows)
        write_bytes = sum(r["bytes"] for r in rows if r["phase"] == "save.write")
        files = sum(p.stat().st_size for p in Path(root, "step_1").glob("*.safetensors"))
        assert write_bytes == files == sum(s["bytes"] for s in saved)

        rows = dq.rank_phases(client, job="e2e", run=run, checkpoint=root, op="load").to_dict("records")
        got = {(r["rank"], r["phase"]) for r in rows}
        assert got >= {(rank, phase) for rank in range(2) for phase in LOAD_PHASES}
        # The whole-call span carries every byte the rank read; load.read spans cover the
        # tensor reads (packed objects are read inside load.apply today).
        per_rank = {r["rank"]: r["bytes"] for r in rows if r["phase"] == "load"}
        assert per_rank == {rank: r["bytes_read"] for rank, r in enumerate(loaded)}
        read_bytes = sum(r["bytes"] for r in rows if r["phase"] == "load.read")
        assert 0 < read_bytes <= sum(r["bytes_read"] for r in loaded)

        ckpts = {(c["checkpoint"], c["op"]): c
                 for c in dq.checkpoints(client, job="e2e", run=run).to_dict("records")}
        save_row = ckpts[(saved[0]["url"], "save")]
        assert save_row["committed"] and save_row["ranks"] == 4
        assert ckpts[(root, "load")]["ranks"] == 2
        trend = dq.step_phases(client, job="e2e", run=run).to_dict("records")
        assert {r["phase"] for r in trend if r["step"] == 1} >= {"save.plan", "save.write", "save.commit"}
        assert save_row["bytes"] == files  # bytes moved by the I/O phases
    finally:
        client.close()


def test_broker_down_during_save_loses_nothing(world, own_broker, topic, chdb_dsn, tmp_path: Path):
    root, spool, run = str(tmp_path / "ckpt"), str(tmp_path / "spool"), f"down-{uuid.uuid4().hex[:6]}"
    pool = world(4)
    own_broker.create_topic(topic)
    # Producers are live and have sent one event each; then the broker dies under them.
    pool.run(tw.connect_kafka, own_broker.bootstrap, topic, spool, "outage", "warmup")
    own_broker.stop()
    saved = pool.run(tw.kafka_save, root, own_broker.bootstrap, topic, spool, "outage", run,
                     keep_sink=True)
    assert all(s["bytes"] > 0 for s in saved), "training and the save must complete"
    assert sum(s["stats"]["sink_pending"] for s in saved) >= sum(s["events"] for s in saved)
    own_broker.start()  # memory storage: it comes back empty, so every saved event must be re-sent
    own_broker.create_topic(topic)
    drained = pool.run(tw.drain_spool)
    assert all(d["sink_pending_bytes"] == 0 and d["sink_dropped"] == 0 for d in drained), drained
    _ingest(own_broker, topic, chdb_dsn)

    client = connect(chdb_dsn)
    try:
        counts = event_counts(client, job="outage", run=run)
        assert counts["final_rows"] == counts["distinct_ids"] == sum(s["events"] for s in saved)
    finally:
        client.close()


def test_slow_rank_raises_exactly_one_alert(world, kafka_broker, topic, chdb_dsn, tmp_path: Path):
    spool, run = str(tmp_path / "spool"), f"slow-{uuid.uuid4().hex[:6]}"
    kafka_broker.create_topic(topic)
    pool = world(4)
    normal = pool.run(tw.kafka_save, str(tmp_path / "normal"), kafka_broker.bootstrap, topic, spool,
                      "slowjob", run)
    slow = pool.run(tw.kafka_save, str(tmp_path / "slow"), kafka_broker.bootstrap, topic, spool,
                    "slowjob", run, slow_rank=2, delay_s=0.8)
    _ingest(kafka_broker, topic, chdb_dsn)

    client = connect(chdb_dsn)
    try:
        ruleset = RuleSet(SlowRank())
        alerts = evaluate(client, ruleset)
        by_ckpt = {}
        for alert in alerts:
            by_ckpt.setdefault(alert.checkpoint, []).append(alert)
        assert normal[0]["url"] not in by_ckpt, [a.message for a in by_ckpt.get(normal[0]["url"], [])]
        [alert] = by_ckpt[slow[0]["url"]]
        assert (alert.rank, alert.phase, alert.rule) == (2, "save.write", "slow_rank"), alert.message
        assert "rank 2" in alert.message and "save.write" in alert.message
        assert evaluate(client, ruleset) == [], "a second evaluation must not repeat the alert"
        alerts = dq.alerts(client, job="slowjob").to_dict("records")
        [stored] = [a for a in alerts if a["rule"] == "slow_rank"]
        assert stored["rank"] == 2 and stored["phase"] == "save.write"
    finally:
        client.close()
