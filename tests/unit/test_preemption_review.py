"""CheckpointManager's signal handlers in one process: what close() puts back, several managers,
signals that cannot be handled. (Preemption across ranks: tests/distributed/test_manager_dist.py.)"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Iterator

import pytest
import torch

import bytecheckpoint as bcp
from bytecheckpoint.errors import InvalidArgumentError


@pytest.fixture
def sigterm_restored() -> Iterator[None]:
    before = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, before)


def _user_handler(signum: int, frame: object) -> None:
    pass


def test_close_leaves_a_handler_installed_after_the_manager_in_place(tmp_path, sigterm_restored):
    mgr = bcp.CheckpointManager(str(tmp_path / "run"), preemption=True)
    signal.signal(signal.SIGTERM, _user_handler)  # the user's own, installed later
    mgr.close()
    assert signal.getsignal(signal.SIGTERM) is _user_handler  # not replaced by the default (death)


def test_two_managers_closed_in_opening_order_keep_the_open_one_handling(tmp_path, sigterm_restored):
    signal.signal(signal.SIGTERM, _user_handler)
    first = bcp.CheckpointManager(str(tmp_path / "a"), preemption=True)
    second = bcp.CheckpointManager(str(tmp_path / "b"), preemption=True, check_every=1)
    first.close()
    os.kill(os.getpid(), signal.SIGTERM)  # the default action would end this process here
    assert second.save(1, {"w": torch.ones(2)})  # the signal is acted on: saved, stop
    assert second.stop_requested and second.latest_step() == 1
    second.close()
    assert signal.getsignal(signal.SIGTERM) is _user_handler  # not a closed manager's handler


@pytest.mark.parametrize("signals", [[signal.SIGTERM, signal.SIGKILL], [signal.SIGTERM, 999], ["TERM"],
                                     signal.SIGTERM])
def test_a_signal_that_cannot_be_handled_is_named_and_leaves_nothing_behind(tmp_path, sigterm_restored,
                                                                            signals):
    signal.signal(signal.SIGTERM, _user_handler)
    root = str(tmp_path / "run")
    with pytest.raises(InvalidArgumentError, match="cannot be handled"):
        bcp.CheckpointManager(root, preemption=signals)
    assert signal.getsignal(signal.SIGTERM) is _user_handler
    bcp.CheckpointManager(root).close()  # the root is free again


def test_a_signal_the_loop_ended_before_acting_on_is_reported_at_close(tmp_path, sigterm_restored, caplog):
    # Was: silent; the job exited normally as if its preemption checkpoint had been made.
    mgr = bcp.CheckpointManager(str(tmp_path / "run"), preemption=True, check_every=8)
    state = {"w": torch.zeros(2)}
    for step in range(1, 4):
        mgr.save(step, state)
    os.kill(os.getpid(), signal.SIGTERM)  # after the last agreement; the loop ends at step 3
    assert not mgr.stop_requested
    with caplog.at_level(logging.WARNING, logger="bytecheckpoint"):
        mgr.close()
    assert "no preemption checkpoint was saved" in caplog.text


def test_a_signal_acted_on_is_not_reported_again_at_close(tmp_path, sigterm_restored, caplog):
    mgr = bcp.CheckpointManager(str(tmp_path / "run"), preemption=True, check_every=1)
    state = {"w": torch.zeros(2)}
    os.kill(os.getpid(), signal.SIGTERM)
    for step in range(1, 4):
        mgr.save(step, state)
        if mgr.stop_requested:
            break
    assert mgr.stop_requested
    with caplog.at_level(logging.WARNING, logger="bytecheckpoint"):
        mgr.close()
    assert "no preemption checkpoint" not in caplog.text
