"""CheckpointManager's signal handlers in one process: what close() puts back, several managers,
signals that cannot be handled. (Preemption across ranks: tests/distributed/test_manager_dist.py.)"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import bytecheckpoint as bcp
from bytecheckpoint.errors import InvalidArgumentError

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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


def test_a_signal_the_loop_ended_before_acting_on_is_saved_at_close(tmp_path, sigterm_restored, caplog):
    # Was: silent (then only a warning); the job exited normally without its preemption checkpoint.
    mgr = bcp.CheckpointManager(str(tmp_path / "run"), preemption=True, check_every=8)
    state = {"w": torch.zeros(2)}
    for step in range(1, 4):
        state["w"] += 1
        mgr.save(step, state)
    os.kill(os.getpid(), signal.SIGTERM)  # after the last agreement; the loop ends at step 3
    assert not mgr.stop_requested
    with caplog.at_level(logging.WARNING, logger="bytecheckpoint"):
        mgr.close()
    assert mgr.stop_requested and mgr.latest_step() == 3
    assert "saved step 3 at close()" in caplog.text
    back = {"w": torch.zeros(2)}
    bcp.load(str(tmp_path / "run"), back)
    assert torch.equal(back["w"], torch.full((2,), 3.0))


def test_a_late_signal_makes_no_save_when_an_optimizer_stepped_after_the_last_save_call(
        tmp_path, sigterm_restored, caplog):
    """A loop that calls save(step) before training step ``step``: at close() the state is one
    optimizer step past what that call named. Saved under that step, a resume would train the
    step twice; nothing is saved, and the log says why."""
    root = str(tmp_path / "run")
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {"model": model, "optimizer": opt}
    mgr = bcp.CheckpointManager(root, preemption=True, check_every=8)
    for step in range(1, 4):
        mgr.save(step, state)
        model(torch.ones(1, 2)).sum().backward()
        opt.step()
    os.kill(os.getpid(), signal.SIGTERM)
    with caplog.at_level(logging.WARNING, logger="bytecheckpoint"):
        mgr.close()
    assert "stepped an optimizer after its last save() call" in caplog.text
    assert not mgr.stop_requested and not os.path.exists(f"{root}/latest")
    assert opt._optimizer_step_pre_hooks == {}  # close() leaves no hook on the user's optimizer


def test_a_late_signal_is_saved_when_the_optimizer_stepped_before_the_last_save_call(
        tmp_path, sigterm_restored):
    root = str(tmp_path / "run")
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with bcp.CheckpointManager(root, preemption=True, check_every=8) as mgr:
        for step in range(1, 4):
            model(torch.ones(1, 2)).sum().backward()
            opt.step()
            mgr.save(step, {"model": model, "optimizer": opt})
        os.kill(os.getpid(), signal.SIGTERM)
        expected = model.weight.detach().clone()
    assert mgr.stop_requested and mgr.latest_step() == 3
    back = torch.nn.Linear(2, 1)
    bcp.load(root, {"model": back})
    assert torch.equal(back.weight, expected)


def test_a_late_signal_makes_no_save_when_the_with_block_ends_with_an_error(tmp_path, sigterm_restored,
                                                                           caplog):
    """The state may be half-updated by whatever raised: nothing is saved, and the log says so."""
    root = str(tmp_path / "run")
    caplog.set_level(logging.WARNING, logger="bytecheckpoint")
    with pytest.raises(RuntimeError, match="diverged"), \
            bcp.CheckpointManager(root, preemption=True, check_every=8) as mgr:
        mgr.save(1, {"w": torch.zeros(2)})
        os.kill(os.getpid(), signal.SIGTERM)
        raise RuntimeError("loss diverged")
    assert "no preemption checkpoint was saved" in caplog.text and "ended with an error" in caplog.text
    assert not mgr.stop_requested and not os.path.exists(f"{root}/latest")


def test_a_late_signal_at_a_step_already_saved_saves_nothing_more(tmp_path, sigterm_restored, caplog):
    root = str(tmp_path / "run")
    with caplog.at_level(logging.WARNING, logger="bytecheckpoint"):
        with bcp.CheckpointManager(root, preemption=True, check_every=8, last_step=3) as mgr:
            for step in range(1, 4):
                mgr.save(step, {"w": torch.zeros(2)})  # step 3 is saved: the last step
            os.kill(os.getpid(), signal.SIGTERM)
    assert mgr.stop_requested and sorted(os.listdir(root)) == ["latest", "step_3"]
    assert "no preemption checkpoint" not in caplog.text


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


# -- the launcher's own handler: real signals sent to a real process --------------------------------

def _signalled_child(tmp_path: Path, mode: str, sig: signal.Signals) -> tuple[int, dict]:
    """Start tests/support/signal_child.py with the launcher's handler ``mode``, signal it once
    it trains, and return its exit code and report."""
    argv = [sys.executable, "-m", "tests.support.signal_child", str(tmp_path), mode, sig.name]
    proc = subprocess.Popen(argv, cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO))
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "ready").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the child never started training"
            time.sleep(0.02)
        proc.send_signal(sig)
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    report = json.loads((tmp_path / "report.json").read_text()) if code == 0 else {}
    return code, report


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_the_launchers_handler_runs_after_the_flag_and_the_preemption_save_is_made(tmp_path, sig):
    # Was: the manager replaced the launcher's handler for its lifetime; it never ran.
    code, report = _signalled_child(tmp_path, "handler", sig)
    assert code == 0
    assert report["calls"] == [{"signum": int(sig), "flag_set_first": True}]
    assert report["stopped"] and report["latest"] == report["stopped_at"] < 3000
    assert report["restored"]  # close() put the launcher's handler back


@pytest.mark.parametrize("mode", ["default", "ignore"])
def test_a_default_or_ignoring_disposition_neither_kills_the_job_nor_skips_its_save(tmp_path, mode):
    """SIG_DFL would end the process before its preemption save: the manager's handling stands
    in for it (a clean stop after the save). SIG_IGN: preemption=True asked for the signal."""
    code, report = _signalled_child(tmp_path, mode, signal.SIGTERM)
    assert code == 0, f"the child ended with {code} (-15: killed by the default action)"
    assert report["stopped"] and report["latest"] == report["stopped_at"] < 3000
    assert report["restored"]


def _sleep_forever() -> None:
    while True:
        time.sleep(0.05)


def test_a_child_forked_under_a_manager_still_ends_on_sigterm(tmp_path, sigterm_restored):
    # Was: the child (a DataLoader worker) inherited the manager's handler, which only sets a
    # flag nothing in the child reads: SIGTERM left it running, and an exit that waits hung.
    import multiprocessing

    mgr = bcp.CheckpointManager(str(tmp_path / "run"), preemption=True)
    try:
        child = multiprocessing.get_context("fork").Process(target=_sleep_forever)
        child.start()
        time.sleep(0.2)
        child.terminate()  # SIGTERM
        child.join(timeout=10)
        alive = child.is_alive()
        if alive:
            child.kill()
            child.join()
        assert not alive and child.exitcode == -signal.SIGTERM
        assert not mgr.stop_requested and not mgr.agreement.flags[0]  # the parent saw nothing
    finally:
        mgr.close()
