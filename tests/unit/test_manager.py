"""CheckpointManager in one process: schedule, rollback and timelines, retention, bad input.

The multi-rank acceptance tests (FSDP2 retention and resume, preemption) are in
tests/distributed/test_manager_dist.py.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

import bytecheckpoint as bcp
from bytecheckpoint.commit.leases import pin
from bytecheckpoint.errors import ConcurrentSaveError, InvalidArgumentError, NotACheckpointError
from bytecheckpoint.manager import Context, KeepBest, KeepEvery, KeepLast, KeepNewerThan


def state(value: float) -> dict:
    return {"model": {"w": torch.full((4,), float(value))}}


def value_of(s: dict) -> float:
    return float(s["model"]["w"][0])


def steps_of(mgr: bcp.CheckpointManager) -> dict[int, str]:
    return {c.step: ("abandoned" if c.abandoned else "latest" if c.latest else "live") for c in mgr.steps()}


def test_rollback_moves_latest_to_the_new_timeline_and_keeps_the_abandoned_step(tmp_path):
    root = str(tmp_path / "run")
    with bcp.CheckpointManager(root, save_every_steps=10) as mgr:
        assert mgr.restore(state(0)) is None  # fresh start
        for step in (10, 20, 30):
            assert mgr.save(step, state(step))
        mgr.wait()
        assert mgr.latest_step() == 30
        s = state(-1)
        assert mgr.restore(s, step=20) == 20 and value_of(s) == 20
        assert mgr.save(25, state(25), force=True)
    with bcp.CheckpointManager(root) as mgr:
        assert mgr.latest_step() == 25
        assert steps_of(mgr) == {10: "live", 20: "live", 25: "latest", 30: "abandoned"}
        s = state(-1)
        assert mgr.restore(s) == 25 and value_of(s) == 25
        s = state(-1)
        assert mgr.restore(s, step=30) == 30 and value_of(s) == 30  # still loads when asked for
    # A plain load of the root follows the live timeline too (it read step 30 before).
    s = state(-1)
    assert bcp.load(root, s).step == 25 and value_of(s) == 25


def test_restoring_an_abandoned_step_makes_its_timeline_live_again(tmp_path):
    root = str(tmp_path / "run")
    with bcp.CheckpointManager(root, save_every_steps=10) as mgr:
        for step in (10, 20, 30):
            mgr.save(step, state(step))
        mgr.restore(state(-1), step=10)
        mgr.save(20, state(21), force=True)  # a new step 20 beside the abandoned one
        mgr.wait()
        by_name = {c.name: c for c in mgr.steps()}
        assert by_name["step_20"].abandoned and by_name["step_30"].abandoned
        assert not by_name["step_10"].abandoned and [c for c in mgr.steps() if c.latest][0].step == 20
        s = state(-1)
        assert mgr.restore(s) == 20 and value_of(s) == 21  # the live step 20, not the abandoned one
        mgr.restore(state(-1), step=30)  # back to the first timeline: 30 is its newest
        mgr.save(40, state(40), force=True)
        mgr.wait()
        live = {c.name for c in mgr.steps() if not c.abandoned}
        assert live == {"step_10", "step_20", "step_30", "step_40"}, live


def test_plain_saves_never_move_latest_back(tmp_path):
    """Without a manager's timeline record the old rule holds: latest only moves forward."""
    root = tmp_path / "run"
    bcp.save(str(root / "step_30"), state(30), step=30)
    bcp.save(str(root / "step_20"), state(20), step=20)
    assert bcp.load(str(root), state(-1)).step == 30


def test_retention_keeps_last_two_plus_every_sixth(tmp_path):
    root = str(tmp_path / "run")
    with bcp.CheckpointManager(root, save_every_steps=3, last_step=13,
                               retention=KeepLast(2) | KeepEvery(6)) as mgr:
        saved = [step for step in range(1, 14) if mgr.save(step, state(step))]
    assert saved == [3, 6, 9, 12, 13]
    assert sorted(os.listdir(root)) == ["latest", "step_12", "step_13", "step_6"]


def test_retention_never_counts_or_deletes_abandoned_pinned_or_latest(tmp_path):
    root = str(tmp_path / "run")
    with bcp.CheckpointManager(root, save_every_steps=1, retention=KeepLast(1)) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, state(step))
        mgr.wait()
        assert [c.step for c in mgr.steps()] == [3]
        pin(os.path.join(root, "step_3"))
        mgr.save(4, state(4))
        mgr.save(5, state(5))
        mgr.wait()
        assert [c.step for c in mgr.steps()] == [3, 5]  # 3 pinned, 4 beyond KeepLast(1)
        mgr.restore(state(-1), step=3)
        mgr.save(4, state(41))
        mgr.wait()
        # 5 is abandoned (kept, not counted); KeepLast(1) counts 4 of the live timeline.
        assert steps_of(mgr) == {3: "live", 4: "latest", 5: "abandoned"}


def test_keep_best_by_a_metric_recorded_at_save_time(tmp_path):
    root = str(tmp_path / "run")
    losses = {1: 5.0, 2: 1.0, 3: 4.0, 4: 2.0, 5: 3.0}
    with bcp.CheckpointManager(root, save_every_steps=1, retention=KeepBest(2, "loss", "min")) as mgr:
        for step, loss in losses.items():
            mgr.save(step, state(step), metrics={"loss": loss})
        mgr.wait()
        kept = {c.step: c.metrics for c in mgr.steps()}
    assert kept == {2: {"loss": 1.0}, 4: {"loss": 2.0}, 5: {"loss": 3.0}}  # 5: latest


def test_policies_are_pure_and_aligned_with_their_input():
    class C:
        def __init__(self, step, t, **metrics):
            self.step, self.time, self.metrics = step, t, metrics

    cs = [C(1, 100.0, acc=0.5), C(2, 200.0, acc=0.9), C(3, 300.0), C(4, 400.0, acc=0.7)]
    ctx = Context(now=450.0)
    assert KeepLast(2).select(cs, context=ctx) == [False, False, True, True]
    assert KeepEvery(2).select(cs, context=ctx) == [False, True, False, True]
    assert KeepBest(1, "acc", "max").select(cs, context=ctx) == [False, True, False, False]
    assert KeepNewerThan(200).select(cs, context=ctx) == [False, False, True, True]
    assert (KeepLast(1) | KeepEvery(2)).select(cs, context=ctx) == [False, True, False, True]
    assert (KeepLast(3) & KeepEvery(2)).select(cs, context=ctx) == [False, True, False, True]


def test_time_schedule_and_requests_save_once_agreed(tmp_path):
    root = str(tmp_path / "run")
    with bcp.CheckpointManager(root, save_every_seconds=0.2, check_every=2, async_save=False) as mgr:
        assert not mgr.save(1, state(1)) and not mgr.save(2, state(2))
        time.sleep(0.25)
        assert not mgr.save(3, state(3))  # not a check step
        assert mgr.save(4, state(4))
        mgr.request_save()
        assert not mgr.save(5, state(5)) and mgr.save(6, state(6))
        assert not mgr.save(8, state(8))
        assert [c.step for c in mgr.steps()] == [4, 6]


# -- bad input -----------------------------------------------------------------------------

def test_a_root_that_is_a_file_or_a_checkpoint_is_refused(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(NotACheckpointError, match="is a file"):
        bcp.CheckpointManager(str(f))
    bcp.save(str(tmp_path / "one"), state(1), step=1)
    with pytest.raises(NotACheckpointError, match="one checkpoint, not a root"):
        bcp.CheckpointManager(str(tmp_path / "one"))


@pytest.mark.parametrize("make", [lambda: KeepLast(0), lambda: KeepEvery(0), lambda: KeepBest(0, "loss"),
                                  lambda: KeepNewerThan(0), lambda: KeepBest(1, "loss", "median"),
                                  lambda: KeepLast(1) | "last"])
def test_policies_that_would_delete_everything_are_refused(make):
    with pytest.raises(InvalidArgumentError):
        make()


def test_a_policy_that_keeps_nothing_at_run_time_deletes_nothing(tmp_path, caplog):
    root = str(tmp_path / "run")
    with bcp.CheckpointManager(root, save_every_steps=1, retention=KeepLast(1) & KeepEvery(1000)) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, state(step))
        mgr.wait()
        assert [c.step for c in mgr.steps()] == [1, 2, 3]
    assert "would delete every one" in caplog.text


def test_two_managers_on_one_root_are_detected(tmp_path):
    root = str(tmp_path / "run")
    first = bcp.CheckpointManager(root)
    with pytest.raises(ConcurrentSaveError, match="another CheckpointManager"):
        bcp.CheckpointManager(root + "/")
    first.close()
    bcp.CheckpointManager(root).close()  # free again once closed


def test_restoring_a_missing_step_names_the_steps_there(tmp_path):
    root = str(tmp_path / "run")
    with bcp.CheckpointManager(root, save_every_steps=5) as mgr:
        for step in (5, 10):
            mgr.save(step, state(step))
        with pytest.raises(NotACheckpointError, match="step 7; the steps it holds: 5, 10"):
            mgr.restore(state(-1), step=7)


def test_a_step_not_after_the_last_one_is_refused(tmp_path):
    with bcp.CheckpointManager(str(tmp_path / "run"), save_every_steps=1) as mgr:
        mgr.save(5, state(5))
        with pytest.raises(InvalidArgumentError, match="not after step 5"):
            mgr.save(5, state(5))
        with pytest.raises(InvalidArgumentError):
            mgr.save(6, state(6), metrics={"loss": "low"})


def test_bcp_ls_marks_abandoned_and_bcp_gc_neither_counts_nor_deletes_them(tmp_path, capsys):
    import json

    from bytecheckpoint.cli import app as cli
    root = str(tmp_path / "run")
    with bcp.CheckpointManager(root, save_every_steps=10) as mgr:
        for step in (10, 20, 30, 40):
            mgr.save(step, state(step))
        mgr.restore(state(-1), step=20)
        assert mgr.save(25, state(25), force=True)
    capsys.readouterr()
    assert cli.main(["ls", "--json", root]) == 0
    rows = {r["step"]: r for r in json.loads(capsys.readouterr().out)["checkpoints"]}
    abandoned = {s: r["abandoned"] for s, r in rows.items()}
    assert abandoned == {10: False, 20: False, 25: False, 30: True, 40: True}
    assert cli.main(["ls", root]) == 0
    assert "abandoned" in capsys.readouterr().out
    # Keep the newest 2 of the live timeline (20, 25): 10 goes; 30 and 40 are not counted as
    # the newest and are kept as abandoned.
    assert cli.main(["gc", "--keep-last", "2", "--yes", "--json", root]) == 0
    doc = {c["step"]: c for c in json.loads(capsys.readouterr().out)["checkpoints"]}
    assert {s: c["action"] for s, c in doc.items()} == {10: "delete", 20: "keep", 25: "keep", 30: "keep",
                                                         40: "keep"}
    assert doc[30]["reason"].startswith("abandoned")
    assert sorted(os.listdir(root)) == ["latest", "step_20", "step_25", "step_30", "step_40"]


def test_step_time_is_recorded_as_train_step_spans_when_asked(tmp_path):
    import json

    import telemetry

    spool = str(tmp_path / "spool")
    telemetry.configure(spool_dir=spool, enabled=True)  # its own spool, whatever tests before it set
    run = f"manager-steps-{os.getpid()}-{time.time_ns()}"
    with telemetry.context(run=run), bcp.CheckpointManager(str(tmp_path / "run"), save_every_steps=100,
                                                           record_step_time=True) as mgr:
        for step in range(1, 5):
            time.sleep(0.03)  # the "training step"
            mgr.save(step, state(step))
    telemetry.flush()
    durations = []
    for name in os.listdir(spool):
        with open(os.path.join(spool, name)) as f:
            durations += [e["duration_s"] for e in map(json.loads, f)
                          if e.get("name") == "train.step" and e.get("run") == run]
    assert len(durations) == 3 and all(0.025 < d < 1.0 for d in durations), durations


def test_one_checkpoint_is_found_by_reading_its_metadata_alone(tmp_path):
    """Lightning's save_top_k removes one checkpoint at a time: finding it must not read the
    metadata of every checkpoint beside it."""
    import torch

    import bytecheckpoint as bcp
    from bytecheckpoint.manage.catalog import RootListing
    from bytecheckpoint.storage.local import LocalStorage

    model = torch.nn.Linear(4, 4)
    for step in range(5):
        bcp.save(str(tmp_path / f"step_{step}"), {"model": model}, step=step)
    (tmp_path / "notes").mkdir()
    (tmp_path / "file").write_text("x")
    metadata_reads: list[str] = []

    class Counting(LocalStorage):
        def read(self, path, offset=0, length=None):
            metadata_reads.append(path)
            return super().read(path, offset, length)

        def read_into(self, path, offset, buffer):  # the metadata is read in bounded chunks
            if offset == 0:
                metadata_reads.append(path)
            return super().read_into(path, offset, buffer)

    listing = RootListing(Counting(), str(tmp_path))
    found = listing.find("step_3")
    assert found is not None and found.step == 3 and found.committed
    metadata_reads = [p for p in metadata_reads if not p.endswith("/latest")]  # the run's pointer
    assert len(metadata_reads) == 1 and "step_3" in metadata_reads[0]
    full = {c.name: c for c in RootListing(LocalStorage(), str(tmp_path)).list()}
    assert found == full["step_3"]
    for name in ("notes", "file", "missing", "..", "."):
        assert listing.find(name) is None, name
