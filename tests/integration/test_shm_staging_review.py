"""Staging left in RAM by a killed ``shm://`` save is reclaimed by the next save to the same
root and by ``bcp gc``, never while its writer lives.

A save killed with SIGKILL keeps its staging directory (``.<name>.staging-<id>``) and its lock
file in ``/dev/shm``; the save lock's ``flock`` died with it. Each test kills one real saver
and keeps another, stalled at the same moment (its staging full, its lock held), alive.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
import torch

import bytecheckpoint as bcp
from bytecheckpoint.cli import app as cli

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def shm_root(tmp_path, monkeypatch) -> Iterator[str]:
    root = tmp_path / "shm"
    monkeypatch.setenv("BCP_SHM_DIR", str(root))
    yield str(root)


@pytest.fixture
def savers(tmp_path) -> Iterator[list[subprocess.Popen]]:
    procs: list[subprocess.Popen] = []
    yield procs
    for p in procs:  # the live saver: ended here, by its own pid
        if p.poll() is None:
            p.kill()
            p.wait()


def _stalled_savers(procs: list[subprocess.Popen], paths: list[str], tmp: str) -> None:
    """Savers of ``shm://path``, started together, each stalled just before its commit (its
    lock held, its staging full) when this returns."""
    markers = {}
    for i, path in enumerate(paths):
        markers[path] = f"{tmp}/stalled-{i}"
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "tests.support.shm_workers", path, markers[path]],
            cwd=REPO, env={**os.environ, "PYTHONPATH": REPO}, stdin=subprocess.DEVNULL))
    end = time.monotonic() + 120
    for proc, (path, marker) in zip(procs[-len(paths):], markers.items()):
        while not os.path.exists(marker):
            assert proc.poll() is None, f"saver of {path} exited with {proc.returncode}"
            assert time.monotonic() < end, f"saver of {path} never reached its commit"
            time.sleep(0.05)


def _kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def _leftovers(run: str, name: str) -> list[str]:
    return sorted(n for n in os.listdir(run) if n.startswith(f".{name}."))


def _two_savers(shm_root: str, tmp_path, procs: list[subprocess.Popen]) -> str:
    """step_1's saver killed, step_2's alive: returns the run directory."""
    _stalled_savers(procs, ["run/step_1", "run/step_2"], str(tmp_path))
    _kill(procs[0])
    run = os.path.join(shm_root, "run")
    assert any(".staging-" in n for n in _leftovers(run, "step_1"))  # what the kill left in RAM
    return run


def test_the_next_save_to_the_root_reclaims_a_killed_saves_staging(shm_root, tmp_path, savers):
    run = _two_savers(shm_root, tmp_path, savers)
    live = _leftovers(run, "step_2")
    bcp.save("shm://run/step_3", {"model": {"w": torch.ones(8)}}, step=3)
    assert _leftovers(run, "step_1") == []  # its staging and its lock file
    assert _leftovers(run, "step_2") == live  # a live writer's staging is never touched
    assert "step_3" in os.listdir(run)


def test_gc_reclaims_a_killed_saves_staging(shm_root, tmp_path, savers, capsys):
    bcp.save("shm://run/step_0", {"model": {"w": torch.ones(8)}}, step=0)
    run = _two_savers(shm_root, tmp_path, savers)
    live = _leftovers(run, "step_2")
    assert cli.main(["gc", "shm://run", "--keep-last", "1"]) == 0  # a dry run changes nothing
    assert any(".staging-" in n for n in _leftovers(run, "step_1"))
    out = capsys.readouterr().out
    assert "step_1.staging-" in out and "gc --yes deletes it if that save is dead" in out, out
    assert cli.main(["gc", "shm://run", "--keep-last", "1", "--yes", "-q"]) == 0
    out = capsys.readouterr().out
    assert _leftovers(run, "step_1") == [], out
    assert _leftovers(run, "step_2") == live
    assert "reclaimed" in out and "step_1" in out, out
    assert "step_0" in os.listdir(run)


def test_gc_reclaims_staging_on_local_disk_too(tmp_path, savers, capsys, monkeypatch):
    # The same lock and staging on a local root: gc given a plain directory.
    monkeypatch.setenv("BCP_SHM_DIR", str(tmp_path / "shm"))
    run = _two_savers(str(tmp_path / "shm"), tmp_path, savers)
    assert cli.main(["gc", run, "--keep-last", "1", "--yes", "-q", "--json"]) == 0
    assert _leftovers(run, "step_1") == [], capsys.readouterr().out
    assert any(".staging-" in n for n in _leftovers(run, "step_2"))


@pytest.mark.parametrize("scheme", ["shm", "local"])
def test_gc_reclaims_a_killed_saves_staging_in_a_nested_run_with_nothing_committed(
        shm_root, tmp_path, savers, capsys, scheme):
    # Was: gc looked in ROOT and in the runs of its committed checkpoints only: a run below it
    # holding nothing but a killed save's staging kept that staging (RAM, on shm://) for good.
    _stalled_savers(savers, ["team/run1/step_1", "team/run2/step_1"], str(tmp_path))
    _kill(savers[0])
    run1, run2 = (os.path.join(shm_root, "team", r) for r in ("run1", "run2"))
    killed, live = _leftovers(run1, "step_1"), _leftovers(run2, "step_1")
    assert any(".staging-" in n for n in killed) and any(".staging-" in n for n in live)
    root = "shm://" if scheme == "shm" else shm_root
    assert cli.main(["gc", root, "--keep-last", "1", "-q"]) == 0  # a dry run lists both, deletes none
    out = capsys.readouterr().out
    assert out.count("gc --yes deletes it if that save is dead") == 2, out
    assert _leftovers(run1, "step_1") == killed
    assert cli.main(["gc", root, "--keep-last", "1", "--yes", "-q"]) == 0
    out = capsys.readouterr().out
    assert _leftovers(run1, "step_1") == [], out  # its staging and its lock file
    assert _leftovers(run2, "step_1") == live  # the live save's: untouched
    assert "reclaimed" in out and "team/run1/.step_1.staging-" in out, out
    savers[1].kill()
    savers[1].wait()
    assert cli.main(["gc", root, "--keep-last", "1", "--yes", "-q"]) == 0  # now dead too: reclaimed
    assert _leftovers(run2, "step_1") == []


_BRIEF_HOLDER = """
import fcntl, json, os, socket, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
doc = {"save_id": sys.argv[2], "host": socket.gethostname(), "pid": os.getpid()}
os.pwrite(fd, json.dumps(doc).encode(), 0)
open(sys.argv[3], "w").close()
time.sleep(float(sys.argv[4]))
"""


@pytest.mark.parametrize("holder, waits", [("brief-0123abcd", True), ("0123456789ab", False)])
def test_a_save_waits_out_a_reclaimer_holding_its_path_but_not_a_save(shm_root, tmp_path, holder, waits):
    # gc or another save reclaiming a dead save's staging holds the path's lock for
    # milliseconds: a save starting then waits for it; a real save holding it is refused at once.
    run = os.path.join(shm_root, "run")
    os.makedirs(run, mode=0o700)
    marker = f"{tmp_path}/locked"
    proc = subprocess.Popen([sys.executable, "-c", _BRIEF_HOLDER, f"{run}/.step_1.lock", holder, marker,
                             "0.5"], stdin=subprocess.DEVNULL)
    try:
        while not os.path.exists(marker):
            assert proc.poll() is None
            time.sleep(0.01)
        if waits:
            bcp.save("shm://run/step_1", {"model": {"w": torch.ones(8)}}, step=1)
            assert "step_1" in os.listdir(run)
        else:
            t = time.monotonic()
            with pytest.raises(bcp.ConcurrentSaveError, match="another save"):
                bcp.save("shm://run/step_1", {"model": {"w": torch.ones(8)}}, step=1)
            assert time.monotonic() - t < 0.4
    finally:
        proc.wait()
