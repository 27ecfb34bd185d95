"""CheckpointManager's schedule in one process: a failed save is no save (the clock is not reset
by it), and a save request or a due time that came after the ranks' last agreement is made by
close(), under the rules of a late preemption signal. (On 2 gloo ranks:
tests/distributed/test_manager_close_review.py.)"""

from __future__ import annotations

import logging
import os
import time

import pytest
import torch

import bytecheckpoint as bcp
from bytecheckpoint.errors import PermanentStorageError
from bytecheckpoint.storage import faults

INTERVAL = 0.3
FAIL_WRITES = "permanent=1;ops=open_writer;fail_every=1"


@pytest.fixture
def failing_storage():
    """``fail()`` makes every file a save opens fail with a permanent error until the test ends."""
    yield lambda: faults.install(FAIL_WRITES)
    faults.install(None)


def _state(value: float) -> dict:
    return {"w": torch.full((4,), float(value))}


def _value(root: str) -> float:
    back = _state(0)
    bcp.load(root, back)
    return float(back["w"][0])


# -- 1. a failed save does not reset the clock ----------------------------------------------------

def test_a_failed_sync_save_leaves_the_time_based_save_due(tmp_path, failing_storage):
    root = str(tmp_path / "run")
    with bcp.CheckpointManager(root, save_every_seconds=INTERVAL, check_every=1, async_save=False) as mgr:
        assert mgr.save(1, _state(1), force=True)
        time.sleep(INTERVAL + 0.05)
        failing_storage()
        with pytest.raises(PermanentStorageError, match="injected fault"):
            mgr.save(2, _state(2))
        faults.install(None)
        assert mgr.save(3, _state(3))  # still due: the failed save was no save
        assert not mgr.save(4, _state(4))  # the save of step 3 restarted the clock
    assert [c.step for c in mgr.steps()] == [1, 3]


def test_a_failed_async_save_leaves_the_time_based_save_due_after_wait(tmp_path, failing_storage):
    # Was: save() reset the clock as the async save started; once it failed, the next
    # time-based save came a whole interval later, as if the failed one had saved.
    root = str(tmp_path / "run")
    with bcp.CheckpointManager(root, save_every_seconds=INTERVAL, check_every=1) as mgr:
        assert mgr.save(1, _state(1), force=True)
        time.sleep(INTERVAL + 0.05)
        failing_storage()
        assert mgr.save(2, _state(2))  # started in the background
        with pytest.raises(PermanentStorageError, match="injected fault"):
            mgr.wait()
        faults.install(None)
        assert mgr.save(3, _state(3))
        mgr.wait()
        assert not mgr.save(4, _state(4))
    assert [c.step for c in mgr.steps()] == [1, 3] and _value(root) == 3


def test_a_failed_async_save_is_reported_at_the_next_step_not_an_interval_later(tmp_path, failing_storage):
    root = str(tmp_path / "run")
    with bcp.CheckpointManager(root, save_every_seconds=INTERVAL, check_every=1) as mgr:
        assert mgr.save(1, _state(1), force=True)
        time.sleep(INTERVAL + 0.05)
        failing_storage()
        assert mgr.save(2, _state(2))
        deadline = time.monotonic() + 30
        while not mgr._handle.done():  # the background save has failed (white box: no public poll)
            assert time.monotonic() < deadline
            time.sleep(0.01)
        faults.install(None)
        # The next step votes for the save still due, whose wait() names the failure.
        with pytest.raises(PermanentStorageError, match="injected fault"):
            mgr.save(3, _state(3))
        assert mgr.save(4, _state(4))
    assert [c.step for c in mgr.steps()] == [1, 4] and _value(root) == 4


# -- 2. a late save request or due time is saved by close() ----------------------------------------

def test_a_request_after_the_last_agreement_is_saved_at_close(tmp_path, caplog):
    # Was: dropped without a word; only a preemption signal got close()'s last vote.
    root = str(tmp_path / "run")
    mgr = bcp.CheckpointManager(root, check_every=8)
    for step in range(1, 4):
        assert not mgr.save(step, _state(step))
    mgr.request_save()
    with caplog.at_level(logging.WARNING, logger="bytecheckpoint"):
        mgr.close()
    assert "save request" in caplog.text and "saved step 3 at close()" in caplog.text
    assert mgr.latest_step() == 3 and _value(root) == 3
    assert not mgr.stop_requested  # a request is no preemption: nothing says stop


def test_a_time_based_save_due_after_the_last_agreement_is_saved_at_close(tmp_path):
    root = str(tmp_path / "run")
    with bcp.CheckpointManager(root, save_every_seconds=INTERVAL, check_every=8) as mgr:
        assert not mgr.save(1, _state(1))
        time.sleep(INTERVAL + 0.05)
        assert not mgr.save(2, _state(2))  # due, but no agreement before the loop ends
    assert mgr.latest_step() == 2 and _value(root) == 2


def test_a_late_request_makes_no_save_when_an_optimizer_stepped_after_the_last_save_call(tmp_path, caplog):
    root = str(tmp_path / "run")
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mgr = bcp.CheckpointManager(root, check_every=8)
    for step in range(1, 4):
        mgr.save(step, {"model": model, "optimizer": opt})
        model(torch.ones(1, 2)).sum().backward()
        opt.step()
    mgr.request_save()
    with caplog.at_level(logging.WARNING, logger="bytecheckpoint"):
        mgr.close()
    assert "no checkpoint was saved at close()" in caplog.text
    assert "stepped an optimizer after its last save() call" in caplog.text
    assert not os.path.exists(f"{root}/latest")
    assert opt._optimizer_step_pre_hooks == {}  # close() leaves no hook on the user's optimizer


def test_a_late_request_makes_no_save_when_the_with_block_ends_with_an_error(tmp_path, caplog):
    root = str(tmp_path / "run")
    caplog.set_level(logging.WARNING, logger="bytecheckpoint")
    with pytest.raises(RuntimeError, match="diverged"), bcp.CheckpointManager(root, check_every=8) as mgr:
        mgr.save(1, _state(1))
        mgr.request_save()
        raise RuntimeError("loss diverged")
    assert "ended with an error" in caplog.text and not os.path.exists(f"{root}/latest")


def test_a_request_met_by_a_save_is_not_saved_again_at_close(tmp_path):
    root = str(tmp_path / "run")
    with bcp.CheckpointManager(root, save_every_steps=3, check_every=8) as mgr:
        for step in range(1, 4):
            if step == 2:
                mgr.request_save()
            mgr.save(step, _state(step))  # step 3 saves by the step: the request is met
    assert sorted(os.listdir(root)) == ["latest", "step_3"]
