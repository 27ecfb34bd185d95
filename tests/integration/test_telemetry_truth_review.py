"""Do the telemetry's numbers and alerts tell the truth? Real saves compared with the store,
and the alert rules' configuration and throughput arithmetic (review of 2026-11-27)."""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from dashboard import frames
from dashboard import queries as dq
from telemetry.alerts import AnyRule, Context, LowThroughput, SlowRank, Uncommitted, Window, evaluate
from telemetry.alerts.engine import RuleSet, rules_from_config
from telemetry.store import connect, ensure_schema, insert_events
from telemetry.store.queries import rank_phases
from tests.support import telemetry_truth_workloads as tt
from tests.support.telemetry_servers import run_ingester


def test_an_async_saves_background_phases_belong_to_its_checkpoint_and_step(chdb_dsn, tmp_path: Path):
    """The writes and the commit of an async save run after save() returned, on other threads:
    they were stored with no checkpoint and training's current step, so the checkpoint showed
    0 bytes, never committed (an `uncommitted` error alert after 15 minutes for every async
    save) and its slow writers were never compared."""
    spool, root = tmp_path / "spool", tmp_path / "ckpt"
    done = tt.async_save_while_training_moves_on(root, spool, "truth", "async")
    run_ingester("--spool", str(spool), "--dsn", chdb_dsn, "--once", "--idle-s", "0.5")
    client = connect(chdb_dsn)
    try:
        [row] = dq.checkpoints(client, job="truth", run="async").to_dict("records")
        files = sum(p.stat().st_size for p in (root / "step_1").glob("*.safetensors"))
        assert (row["checkpoint"], row["op"], row["step"]) == (done["url"], "save", 1)
        assert row["committed"] and row["bytes"] == files == done["bytes"]
        phases = dq.rank_phases(client, job="truth", run="async", checkpoint=done["url"], op="save")
        by_phase = phases.set_index("phase")
        assert {"save.write", "save.commit", "save.background"} <= set(by_phase.index)
        assert set(phases["step"]) == {1}
        rows = rank_phases(client, pd.Timestamp(0, tz="UTC").to_pydatetime(), job="truth")
        assert Uncommitted().evaluate(Window(rows), context=Context(now=time.time() + 3600)) == []
    finally:
        client.close()


@pytest.mark.parametrize(("spec", "setting"), [
    ({"type": "slow_rank", "z": "3.5"}, "z"),  # quoted in YAML: every evaluation raised TypeError
    ({"type": "slow_rank", "z": float("nan")}, "z"),  # never alerted
    ({"type": "slow_rank", "min_ratio": -1}, "min_ratio"),
    ({"type": "low_throughput", "min_mb_s": "fast"}, "min_mb_s"),
    ({"type": "uncommitted", "deadline_s": None}, "deadline_s"),
    ({"type": "failed_ops", "include_retries": "no"}, "include_retries"),  # a truthy string
    ({"type": "slow_rank", "min_ranks": 2.5}, "min_ranks"),
    ({"type": "any", "rules": "slow_rank"}, "rules"),
])
def test_a_bad_rule_setting_is_a_named_error_when_the_rules_are_loaded(spec: dict[str, Any], setting: str):
    with pytest.raises(ValueError, match=setting) as caught:
        rules_from_config({"rules": [spec]})
    assert type(caught.value).__name__ == "AlertConfigError"


@pytest.mark.parametrize("config", [{"window_s": -5}, {"window_s": "day"}, {"webhook_timeout_s": 0}])
def test_a_bad_evaluation_setting_is_a_named_error(config: dict[str, Any]):
    with pytest.raises(ValueError, match=next(iter(config))) as caught:
        rules_from_config({**config, "rules": []})
    assert type(caught.value).__name__ == "AlertConfigError"


def test_a_one_name_list_setting_is_not_split_into_characters():
    # "save.write" as a plain string: `phase in "save.write"` matched "save" and "write".
    rule = rules_from_config({"rules": [{"type": "low_throughput", "phases": "save.write"}]}).rule.rules[0]
    assert rule.phases == ("save.write",)


def test_the_ingester_refuses_a_bad_rules_file_instead_of_failing_every_evaluation(chdb_dsn, tmp_path: Path):
    rules = tmp_path / "rules.yaml"
    rules.write_text('rules:\n  - {type: slow_rank, z: "3.5"}\n')
    (tmp_path / "spool").mkdir()
    args = ("--spool", str(tmp_path / "spool"), "--dsn", chdb_dsn, "--once", "--idle-s", "0.2")
    proc = run_ingester(*args, "--alerts", str(rules), check=False)
    assert proc.returncode == 2 and "z must be a number" in proc.stderr and "Traceback" not in proc.stderr
    proc = run_ingester(*args, "--alerts", str(tmp_path / "missing.yaml"), check=False)
    assert proc.returncode == 2 and "missing.yaml" in proc.stderr and "Traceback" not in proc.stderr


def _write_row(rank: int, busy_s: float, wall_s: float, nbytes: int) -> dict[str, Any]:
    return {"job": "j", "run": "r", "checkpoint": "/c/step_1", "op": "save", "rank": rank,
            "phase": "save.write", "step": 1, "spans": 3, "duration_s": busy_s, "bytes": nbytes,
            "errors": 0, "retries": 0,
            "start_ts": 1000.0, "end_ts": 1000.0 + wall_s, "sample_error": "", "host": "h", "dp": rank,
            "tp": 0, "pp": 0}


def test_throughput_counts_wall_time_not_the_sum_of_concurrent_writes():
    """A rank writes its model, optimizer and extra files on three threads at once: 300 MB in
    1 s of wall time is 300 MB/s, not 100 MB/s (3 s of summed span time)."""
    mb = 1_000_000
    rows = [_write_row(r, busy_s=3.0, wall_s=1.0, nbytes=300 * mb) for r in range(2)]
    assert LowThroughput(min_mb_s=150, min_bytes=0).evaluate(Window(rows), context=Context(now=0)) == []
    # Sequential writes with a gap between them: the busy time is the right one.
    gappy = [_write_row(0, busy_s=1.0, wall_s=5.0, nbytes=100 * mb)]
    [alert] = LowThroughput(min_mb_s=150, min_bytes=0).evaluate(Window(gappy), context=Context(now=0))
    assert alert.value == pytest.approx(100.0)
    cells = frames.heatmap_cells(pd.DataFrame(rows), "save", "save.write", "throughput")
    assert cells["value"].tolist() == pytest.approx([300.0 * mb, 300.0 * mb])


def _event(rank: int, name: str, duration: float, step: int, ts: float) -> dict[str, Any]:
    return {"event_id": uuid.uuid4().hex, "name": name, "ts": ts, "duration_s": duration, "outcome": "ok",
            "job": "j", "run": "r", "rank": rank, "step": step, "checkpoint": "/c/latest",
            "checkpoint_op": "save", "attrs": {}}


def test_saves_to_one_path_at_different_steps_are_separate_incidents(chdb_dsn):
    """A "latest" checkpoint overwritten every save: the saves' times were summed per rank, so a
    slow rank of the newest save was hidden (and an alert on an earlier one suppressed its
    alerts for good), and a newer save that never committed hid behind the earlier commit."""
    client = connect(chdb_dsn)
    ensure_schema(client)
    try:
        now = time.time()
        rules = RuleSet(AnyRule((SlowRank(), Uncommitted(deadline_s=60))))
        first = [_event(r, "save.write", 10.0 if r == 3 else 1.0, 1, now - 3000) for r in range(4)]
        first += [_event(r, "save.commit", 0.1, 1, now - 2990) for r in range(4)]
        insert_events(client, first)
        assert [(a.rule, a.rank, a.step) for a in evaluate(client, rules, now=now - 2900)] == [
            ("slow_rank", 3, 1)]
        # Step 2 to the same path: rank 1 is slow this time, and the save hangs before its commit.
        insert_events(client, [_event(r, "save.write", 10.0 if r == 1 else 1.0, 2, now - 2000)
                               for r in range(4)])
        new = sorted((a.rule, a.rank, a.step) for a in evaluate(client, rules, now=now))
        assert new == [("slow_rank", 1, 2), ("uncommitted", None, 2)]
        assert evaluate(client, rules, now=now + 10) == []  # one alert per incident
    finally:
        client.close()


def test_a_storage_read_counts_the_bytes_it_got_not_its_buffer(tmp_path: Path):
    """Each save reads its root's `latest` pointer into a 64 KiB + 1 buffer; a missing one was
    stored as 65,537 bytes read, and every short read as its buffer's size."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "ten").write_bytes(b"0123456789")
    events = tt.read_events(str(tmp_path / "data"), tmp_path / "spool", [("missing", 65537), ("ten", 100)])
    assert [(e["path"].rsplit("/", 1)[-1], e["bytes"], e["attrs"].get("found", True)) for e in events] == [
        ("missing", 0, False), ("ten", 10, True)]
