"""CheckpointManager acceptance on gloo ranks: FSDP2 retention and resharded resume, and
preemption by a SIGTERM sent to one of 4 real processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from tests.support import manager_workloads as mw
from tests.support.dist import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_fsdp2_on_4_ranks_keeps_the_policy_steps_and_resumes_on_2_bit_exactly(world, tmp_path):
    root = str(tmp_path / "ckpt")
    trained = world(4).run(mw.fsdp2_managed_train, root, 13, 3)
    assert {tuple(r["saved"]) for r in trained} == {(3, 6, 9, 12, 13)}
    # Keep the last 2 (12, 13) plus every 6th (6, 12): 3 and 9 are gone.
    assert trained[0]["remaining"] == [6, 12, 13]
    assert sorted(os.listdir(root)) == ["latest", "step_12", "step_13", "step_6"]
    resumed = world(2).run(mw.fsdp2_managed_resume, root)
    for rank, r in enumerate(resumed):
        assert r["step"] == 13
        # Same weights, same batch: the loss of step 14 is the uninterrupted run's, bit for bit.
        assert r["next_loss"] == trained[rank]["next_loss"], rank


def test_a_decision_that_fails_on_rank_0_without_a_checkpoint_error_reaches_every_rank(world, tmp_path):
    # Was: rank 0 raised its OSError, and the others waited in the broadcast until the timeout.
    got = world(2).run(mw.rank_0_decision_fails, str(tmp_path / "root"))
    assert got[0].startswith("OSError: [Errno 5] injected"), got
    assert got[1].startswith("RankFailedError: ") and "rank 0 failed deciding" in got[1], got
    assert "injected: the root cannot be listed" in got[1], got


def _launch(root: str, mode: str, world: int, max_steps: int) -> list[subprocess.Popen]:
    port = free_port()
    env = dict(os.environ, PYTHONPATH=ROOT)
    return [subprocess.Popen([sys.executable, "-m", "tests.support.manager_workloads", str(r), str(world),
                              str(port), root, mode, str(max_steps)], cwd=ROOT, env=env)
            for r in range(world)]


def _wait(procs: list[subprocess.Popen], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    return codes


def _read(root: str, kind: str, world: int) -> list[dict]:
    out = []
    for r in range(world):
        with open(f"{root}/{kind}-rank{r}.json") as f:
            out.append(json.load(f))
    return out


def test_sigterm_to_one_of_4_ranks_saves_the_same_step_everywhere_and_resumes_bit_exactly(tmp_path):
    root = str(tmp_path)
    procs = _launch(root, "train", 4, max_steps=400)
    progress = f"{root}/progress-rank2.json"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:  # mid-training: rank 2 has done a few steps
        try:
            with open(progress) as f:
                if json.load(f)["step"] >= 6:
                    break
        except (OSError, ValueError):
            pass
        assert all(p.poll() is None for p in procs), "a rank ended before the signal"
        time.sleep(0.05)
    procs[2].send_signal(signal.SIGTERM)
    assert _wait(procs, 240) == [0, 0, 0, 0]
    reports = _read(root, "train", 4)
    stop = reports[0]["stopped_at"]
    assert all(r["stopped"] and r["stopped_at"] == stop for r in reports), reports
    assert all(r["saved"][-1] == stop for r in reports) and stop < 400
    with open(f"{root}/ckpt/latest") as f:
        assert json.load(f)["step"] == stop

    procs = _launch(root, "resume", 4, max_steps=0)
    assert _wait(procs, 240) == [0, 0, 0, 0]
    for r in _read(root, "resume", 4):
        assert r["start"] == stop
        assert r["loss"] == r["reference"]  # the uninterrupted run's loss of the next step


def test_a_sigterm_after_the_last_agreement_is_saved_by_close_on_every_rank(world, tmp_path):
    # Was: the loop ended before the ranks' next agreement; close() only warned, and the job
    # exited as if preempted cleanly with its newest 2 steps unsaved.
    root = str(tmp_path / "ckpt")
    ranks = world(2).run(mw.fsdp2_late_preemption, root, 1, None)
    assert all(r["stopped"] and r["steps"] == [3, 5] and r["error"] is None for r in ranks), ranks
    with open(f"{root}/latest") as f:
        assert json.load(f)["step"] == 5
    for rank, r in enumerate(world(2).run(mw.fsdp2_managed_resume, root)):
        assert r["step"] == 5
        assert r["next_loss"] == ranks[rank]["next_loss"], rank  # the state of step 5, bit for bit


def test_a_late_sigterm_is_not_saved_when_another_rank_ends_with_an_error(world, tmp_path):
    """That rank's state may be half-updated: no rank saves, and none waits for the others."""
    root = str(tmp_path / "ckpt")
    ranks = world(2).run(mw.fsdp2_late_preemption, root, 0, 1)
    # The failing rank voted too: nobody waited out the vote's timeout (60 s).
    assert all(r["close_s"] < 20 for r in ranks), ranks
    assert [r["error"] for r in ranks] == [None, "evaluation failed"]
    assert all(not r["stopped"] and r["steps"] == [3] for r in ranks), ranks


def test_close_does_not_wait_past_its_timeout_for_a_rank_that_never_closes(tmp_path):
    """A rank stuck elsewhere never votes: the signalled rank's close() gives up after the
    vote's timeout (3 s here), saves nothing, and the job can exit."""
    root = str(tmp_path)
    procs = _launch(root, "absent", 2, max_steps=0)
    assert _wait(procs, 120) == [0, 0]
    (report,) = _read(root, "absent", 1)
    assert 2.5 < report["close_s"] < 12 and not report["stopped"], report
    assert not os.path.exists(f"{root}/ckpt/latest")
