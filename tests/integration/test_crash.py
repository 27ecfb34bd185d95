"""A process killed (SIGKILL) in the middle of a save (synchronous, or in the background of
an async save): the last committed checkpoint stays loadable and bit-exact, the interrupted
one is refused, and ``latest`` is unchanged."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import bytecheckpoint as bcp
from tests.support import workloads as w
from tests.support.dist import free_port
from tests.support.helpers import same_bits

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _start_job(root: str, moment: str) -> list[subprocess.Popen]:
    port = free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), PYTHONPATH=REPO)
        procs.append(subprocess.Popen([sys.executable, "-m", "tests.support.crash_worker", root, moment],
                                      cwd=REPO, env=env))
    return procs


@pytest.mark.parametrize("moment", ["write", "async", "commit"])
def test_sigkill_mid_save_keeps_previous_checkpoint(tmp_path, moment):
    root = str(tmp_path)
    procs = _start_job(root, moment)
    marker = tmp_path / f"stalled-{moment}"
    deadline = time.time() + 240
    try:
        while not marker.exists():
            assert time.time() < deadline, "the job never reached the moment to kill"
            assert all(p.poll() is None for p in procs), "a rank exited early"
            time.sleep(0.1)
        victim = procs[0] if moment == "commit" else procs[1]
        victim.send_signal(signal.SIGKILL)
        victim.wait(30)
        assert victim.returncode == -signal.SIGKILL
    finally:
        for p in procs:  # the job dies with its rank, as a launcher would make it
            if p.poll() is None:
                p.kill()
                p.wait(30)

    # The interrupted save left a staging directory, never a checkpoint.
    assert not (tmp_path / "step_2").exists()
    assert any(n.startswith(".step_2.staging-") for n in os.listdir(root))
    with pytest.raises(bcp.NotACheckpointError, match="never committed"):
        bcp.load(f"{root}/step_2", {"model": w.make_plain(seed=1)[0]})

    # The previous checkpoint is intact: latest still names it, every checksum holds, and
    # it loads bit-exactly (here into one process without a process group).
    assert bcp.verify(root) == []
    model, optim = w.make_plain(seed=1)
    result = bcp.load(root, {"model": model, "optimizer": optim})
    assert result.step == 1
    ref = torch.load(f"{root}/ref.pt", weights_only=True)
    got = w.full_state(model, optim)
    assert sorted(ref) == sorted(k for k, v in got.items() if isinstance(v, torch.Tensor))
    for key, value in ref.items():
        assert same_bits(value, got[key]), key
