"""CheckpointManager on 2 gloo ranks: a time-based save is made once, and a save request that
came after the ranks' last agreement is made by close() on every rank, or by none.
(In one process: tests/unit/test_manager_schedule_review.py.)"""

from __future__ import annotations

import json

import pytest
import torch

import bytecheckpoint as bcp
from tests.support import manager_close_workloads as mcw


def _latest(root: str) -> int:
    with open(f"{root}/latest") as f:
        return json.load(f)["step"]


def test_a_due_time_makes_one_save_not_a_second_one_a_check_later(world, tmp_path):
    # Was: the clock flagged a save at every step until it was made, so the vote started at the
    # step of that save carried the flag again, and the ranks saved a second time one check later.
    root = str(tmp_path / "ckpt")
    ranks = world(2).run(mcw.time_based_saves, root, 1.0, 12)
    assert ranks == [[6], [6]]  # due before step 4's check, agreed at step 6's


@pytest.mark.parametrize("request_step, steps, in_loop, kept", [
    (9, 10, [], [10]),    # asked after the last check: never sent before close()
    (5, 10, [], [10]),    # sent at step 8's check, whose result the loop never reached
    (5, 14, [12], [12]),  # agreed at step 12 in the loop: nothing more at close()
])
def test_a_request_on_one_rank_is_saved_by_every_rank_in_the_loop_or_at_close(
        world, tmp_path, request_step, steps, in_loop, kept):
    # Was: a request the loop ended before acting on was dropped at close(), without a word.
    root = str(tmp_path / "ckpt")
    ranks = world(2).run(mcw.late_request, root, 1, request_step, steps)
    for r in ranks:
        assert r["saved"] == in_loop and r["steps"] == kept and r["latest"] == kept[-1], ranks
        assert r["error"] is None
    assert _latest(root) == kept[-1]
    back = {"w": torch.zeros(4)}
    bcp.load(root, back)
    assert torch.equal(back["w"], torch.full((4,), float(kept[-1])))


def test_a_late_request_is_saved_by_no_rank_when_another_ends_with_an_error(world, tmp_path):
    root = str(tmp_path / "ckpt")
    ranks = world(2).run(mcw.late_request, root, 1, 9, 10, 0)
    assert [r["error"] for r in ranks] == ["evaluation failed", None]
    assert all(r["steps"] == [] and r["latest"] is None for r in ranks), ranks
    assert all(r["close_s"] < 20 for r in ranks), ranks  # the vote's timeout (60 s) was not waited out


def test_a_rank_closing_with_an_error_does_not_wait_a_minute_for_the_vote(world, tmp_path):
    """Its vote can only be against the save: it waits 5 s for ranks already voting, then its
    error goes on; the late rank gives up after its own timeout (3 s here) and saves nothing."""
    root = str(tmp_path / "ckpt")
    failing, late = world(2).run(mcw.failing_rank_does_not_wait, root, 8.0, 3.0)
    assert failing["error"] == "evaluation failed" and failing["close_s"] < 7.5, failing
    assert late["error"] is None and late["close_s"] < 15, late
    assert failing["steps"] == late["steps"] == [], (failing, late)
