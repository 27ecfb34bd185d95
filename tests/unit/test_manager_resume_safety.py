"""CheckpointManager never resumes or saves on the wrong side of ``latest`` without saying so.

* A manager that did not restore() (a relaunched job, a second experiment on the same root)
  must not continue the live timeline below the step ``latest`` names: ``latest`` would stay on
  the old run, retention would delete the new checkpoints, the next restore() would resume the
  old run. And retention never deletes the checkpoint the save it follows just committed.
* restore() loads the checkpoint ``latest`` names or says why it cannot: it repairs what
  ``bcp.load`` repairs, and never falls back to an older step on its own.
"""

from __future__ import annotations

import json
import logging
import os
import shutil

import pytest
import torch

import bytecheckpoint as bcp
from bytecheckpoint.errors import CorruptCheckpointError, InvalidArgumentError, NotACheckpointError
from bytecheckpoint.manager import KeepLast


def state(value: float) -> dict:
    return {"w": torch.full((4,), float(value))}


def value_of(s: dict) -> float:
    return float(s["w"][0])


def latest_name(root: str) -> str:
    with open(os.path.join(root, "latest")) as f:
        return json.load(f)["checkpoint"]


def run(root: str, steps, **kw) -> None:
    with bcp.CheckpointManager(root, save_every_steps=1, async_save=False, **kw) as mgr:
        for step in steps:
            mgr.save(step, state(step))


def flip_a_bit(path: str) -> None:
    with open(path, "rb") as f:
        b = bytearray(f.read())
    b[len(b) // 2] ^= 1
    with open(path, "wb") as f:
        f.write(bytes(b))


# -- saving below latest -------------------------------------------------------------------------

def test_a_manager_that_did_not_restore_refuses_to_save_below_latest(tmp_path):
    root = str(tmp_path / "run")
    run(root, (100, 200, 300), retention=KeepLast(2))
    before = sorted(os.listdir(root))
    with bcp.CheckpointManager(root, save_every_steps=100, retention=KeepLast(2), async_save=False) as mgr:
        for step in (100, 300):  # below, and equal to, the step latest names
            with pytest.raises(InvalidArgumentError,
                               match=rf"step {step} is not after step 300.*step_300.*restore\(state\) first"):
                mgr.save(step, state(-step))
            assert sorted(os.listdir(root)) == before and latest_name(root) == "step_300"
        assert mgr.save(400, state(400))  # after it: continues the run, as before
    assert latest_name(root) == "step_400" and sorted(os.listdir(root)) == ["latest", "step_300", "step_400"]
    s = state(-1)
    with bcp.CheckpointManager(root) as mgr:
        assert mgr.restore(s) == 400 and value_of(s) == 400


def test_restoring_first_still_resumes_or_rolls_back(tmp_path):
    root = str(tmp_path / "run")
    run(root, (10, 20, 30))
    with bcp.CheckpointManager(root, save_every_steps=10, async_save=False) as mgr:
        assert mgr.restore(state(-1)) == 30
        assert mgr.save(40, state(40))
    with bcp.CheckpointManager(root, save_every_steps=10, async_save=False) as mgr:
        assert mgr.restore(state(-1), step=20) == 20  # a rollback: a new timeline, below latest
        assert mgr.save(30, state(31)) and mgr.latest_step() == 30
        assert latest_name(root).startswith("step_30-")
    s = state(-1)
    assert bcp.load(root, s).step == 30 and value_of(s) == 31


def test_a_run_that_fell_behind_latest_refuses_to_save_below_it(tmp_path):
    """A manager that restored, then another run saved further on the same timeline."""
    from bytecheckpoint.commit.timeline import MANAGER_KEY

    root = str(tmp_path / "run")
    run(root, (1, 2))
    with bcp.CheckpointManager(root, save_every_steps=1, async_save=False) as mgr:
        assert mgr.restore(state(-1)) == 2
        record = {MANAGER_KEY: mgr._timeline.record()}  # another writer on this run's timeline
        bcp.save(os.path.join(root, "step_5"), state(5), step=5, user_metadata=record)
        assert latest_name(root) == "step_5"
        with pytest.raises(InvalidArgumentError, match="step 3 is not after step 5"):
            mgr.save(3, state(3))
        assert sorted(os.listdir(root)) == ["latest", "step_1", "step_2", "step_5"]


def test_retention_never_deletes_the_checkpoint_just_saved(tmp_path, monkeypatch, caplog):
    """Another run on the same timeline moves latest past a save while it is being written: the
    save is not the newest any more, but it is never deleted right after it committed."""
    from bytecheckpoint.manager import manager as manager_module

    root = str(tmp_path / "run")
    real_save = manager_module._save

    def racing_save(url, st, *, step, user_metadata, **kw):
        if step == 2:  # another writer got to step 9 of this timeline meanwhile
            bcp.save(os.path.join(root, "step_9"), state(9), step=9, user_metadata=user_metadata)
        return real_save(url, st, step=step, user_metadata=user_metadata, **kw)

    monkeypatch.setattr(manager_module, "_save", racing_save)
    with caplog.at_level(logging.WARNING), bcp.CheckpointManager(
            root, save_every_steps=1, retention=KeepLast(1), async_save=False) as mgr:
        mgr.save(1, state(1))
        mgr.save(2, state(2))
    assert sorted(os.listdir(root)) == ["latest", "step_2", "step_9"]
    assert latest_name(root) == "step_9"
    assert "this save just committed" in caplog.text


# -- restoring what latest names ---------------------------------------------------------------

def test_restore_refuses_a_damaged_latest_instead_of_resuming_an_older_step(tmp_path):
    root = str(tmp_path / "run")
    run(root, (1, 2, 3))
    flip_a_bit(os.path.join(root, "step_3", "metadata.msgpack"))
    s = state(-1)
    with bcp.CheckpointManager(root, save_every_steps=1, async_save=False) as mgr:
        with pytest.raises(CorruptCheckpointError,
                           match=r"'latest' names step_3 \(step 3\), which cannot be loaded.*"
                                 r"restore\(state, step=N\).*\(1, 2\)"):
            mgr.restore(s)
        assert value_of(s) == -1  # nothing loaded
        assert mgr.latest_step() == 3  # what latest names, not the older step 2
        with pytest.raises(InvalidArgumentError, match="step 3 is not after step 3"):
            mgr.save(3, state(3))  # not restored: it would continue below the damaged latest
        # Falling back is explicit: restore an older step, which starts a new timeline.
        assert mgr.restore(s, step=2) == 2 and value_of(s) == 2
        assert mgr.save(3, state(33))
    s = state(-1)
    with bcp.CheckpointManager(root) as mgr:
        assert mgr.restore(s) == 3 and value_of(s) == 33
    assert os.path.exists(os.path.join(root, "step_3", "metadata.msgpack"))  # the damaged one is kept


def test_a_rollback_below_a_damaged_latest_is_refused_since_latest_would_not_move(tmp_path):
    root = str(tmp_path / "run")
    run(root, (1, 2, 3))
    flip_a_bit(os.path.join(root, "step_3", "metadata.msgpack"))
    with bcp.CheckpointManager(root, save_every_steps=1, async_save=False) as mgr:
        assert mgr.restore(state(-1), step=1) == 1
        with pytest.raises(CorruptCheckpointError, match="would not move 'latest' past it"):
            mgr.save(2, state(22))
    assert sorted(os.listdir(root)) == ["latest", "step_1", "step_2", "step_3"]


def test_restore_refuses_a_latest_that_is_missing(tmp_path):
    root = str(tmp_path / "run")
    run(root, (1, 2, 3))
    shutil.rmtree(os.path.join(root, "step_3"))
    s = state(-1)
    with bcp.CheckpointManager(root) as mgr:
        with pytest.raises(NotACheckpointError, match=r"'latest' names step_3 \(step 3\), which holds no "
                                                      r"committed checkpoint.*step=N"):
            mgr.restore(s)
        assert value_of(s) == -1 and mgr.latest_step() == 3


def test_restore_puts_back_what_a_crashed_overwrite_moved_aside(tmp_path):
    """A commit that died between its two renames left ``.step_3.replaced-<id>``; bcp.load
    puts it back, and so does restore()."""
    root = str(tmp_path / "run")
    for step in (1, 2, 3):
        bcp.save(os.path.join(root, f"step_{step}"), state(step), step=step)
    os.rename(os.path.join(root, "step_3"), os.path.join(root, ".step_3.replaced-deadbeef"))
    s = state(-1)
    with bcp.CheckpointManager(root) as mgr:
        assert mgr.latest_step() == 3
        assert mgr.restore(s) == 3 and value_of(s) == 3
    assert "step_3" in os.listdir(root) and ".step_3.replaced-deadbeef" not in os.listdir(root)


def test_latest_step_of_an_unreadable_pointer_is_an_error_not_a_guess(tmp_path):
    root = str(tmp_path / "run")
    run(root, (1, 2, 3))
    with open(os.path.join(root, "latest"), "w") as f:
        f.write("{not json")
    with bcp.CheckpointManager(root) as mgr:
        with pytest.raises(CorruptCheckpointError, match="unreadable latest pointer"):
            mgr.latest_step()
        with pytest.raises(NotACheckpointError, match="pointer is unreadable"):
            mgr.restore(state(-1))  # as before: nothing can be restored until it is fixed
