"""Storage tiering: what the mover must never do, whatever it finds.

- A cold file it did not create is never replaced or deleted, by a move or by the recovery of
  one: an orphan (the cold copy of a checkpoint removed from the hot tier) may still be used by
  a copy kept outside the hot root.
- A journal record is a file like any other: recovery acts only on what a move of ours can
  have left, inside the tiers, and on the paths the move recorded, whatever hot root it is
  given now.
- A checkpoint that changed after the scan (saved over, now named by ``latest``) is not moved.

Checkpoints are tiny (one 4-element tensor), saved and loaded by one process.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch

import bytecheckpoint as bcp
from bytecheckpoint.manage.catalog import scan
from bytecheckpoint.manage.journal import JOURNAL_FILE, Journal
from storage_tiering import load_config, run_once
from storage_tiering.mover import MoveError, Mover, recover
from tests.integration.test_tiering import DAY, NOW, REPO, _age, _snapshot, _tiers


def _save(path: str, val: float, step: int, **kw) -> None:
    bcp.save(path, {"w": torch.full((4,), float(val))}, step=step, **kw)


def _assert_holds(path: str, val: float) -> None:
    """The checkpoint at ``path`` verifies and loads its own values, bit for bit."""
    assert bcp.verify(path) == []
    state = {"w": torch.zeros(4)}
    bcp.load(path, state)
    want = torch.full((4,), float(val))
    assert state["w"].dtype == want.dtype and state["w"].numpy().tobytes() == want.numpy().tobytes()


def _files(d: str) -> dict[str, bytes]:
    return {n: open(os.path.join(d, n), "rb").read() for n in sorted(os.listdir(d))}


def _links(d: str) -> list[str]:
    return [n for n in os.listdir(d) if os.path.islink(os.path.join(d, n))]


def _cooled_then_kept(tmp_path) -> tuple[str, str, str, str]:
    """step_1 cooled, then copied with its links (``cp -a``) outside the hot root and removed
    from the hot tier: its cold files are orphans the kept copy still uses."""
    hot, cold = _tiers(tmp_path)
    run, keep = f"{hot}/run", str(tmp_path / "keep")
    for s in (1, 2):
        _save(f"{run}/step_{s}", s, s)
        _age(f"{run}/step_{s}", 30)
    report = run_once(load_config(hot=hot, cold=cold, cool_after="1d", keep_newest=1), now=NOW)
    assert [os.path.basename(r.checkpoint) for r in report.cooled] == ["step_1"]
    os.makedirs(keep)
    subprocess.run(["cp", "-a", f"{run}/step_1", f"{keep}/step_1"], check=True)
    shutil.rmtree(f"{run}/step_1")
    assert sorted(_links(f"{keep}/step_1")) == sorted(os.listdir(f"{keep}/step_1"))
    _assert_holds(f"{keep}/step_1", 1)
    return hot, cold, run, f"{keep}/step_1"


def test_a_move_never_replaces_a_cold_file_it_did_not_create(tmp_path):
    hot, cold, run, kept = _cooled_then_kept(tmp_path)
    orphans = _files(f"{cold}/run/step_1")
    _save(f"{run}/step_1", 111, 1)  # a new save at the same path, old enough to be cooled
    _age(f"{run}/step_1", 30)
    config = load_config(hot=hot, cold=cold, cool_after="1d", keep_newest=1)

    report = run_once(config, now=NOW + DAY)

    error = report.failed[f"{run}/step_1"]
    assert error.startswith("MoveError") and "already in the cold tier" in error
    assert "not overwritten" in error
    assert f"{cold}/run/step_1/" in error and not report.cooled
    assert _files(f"{cold}/run/step_1") == orphans  # byte for byte, nothing added or removed
    _assert_holds(kept, 1)
    assert _links(f"{run}/step_1") == []  # the new save stays hot and whole
    _assert_holds(f"{run}/step_1", 111)
    assert sorted(report.orphans) == sorted(f"{cold}/run/step_1/{n}" for n in orphans)

    # What the message says to do: make the kept copy a real one, delete the orphans; then
    # the next pass cools the new checkpoint.
    real = str(tmp_path / "keep-real")
    subprocess.run(["cp", "-rL", kept, real], check=True)
    shutil.rmtree(f"{cold}/run/step_1")
    again = run_once(config, now=NOW + DAY)
    assert [os.path.basename(r.checkpoint) for r in again.cooled] == ["step_1"] and not again.failed
    _assert_holds(f"{run}/step_1", 111)
    _assert_holds(real, 1)


def test_recovery_never_deletes_a_cold_file_the_move_did_not_create(tmp_path):
    hot, cold, run, kept = _cooled_then_kept(tmp_path)
    orphans = _files(f"{cold}/run/step_1")
    _save(f"{run}/step_1", 111, 1)
    names = sorted(os.listdir(f"{run}/step_1"))
    journal = Journal(cold)
    # A move of the new step_1 interrupted before it placed any cold file (one whose
    # journaled inode is not the orphan's, as after a crash between journaling and placing).
    cold_files = [f"{cold}/run/step_1/{n}" for n in names]
    journal.append("0123456789ab", "move", "begin", checkpoint=f"{run}/step_1", files=names,
                   cold_files=cold_files)
    st = os.lstat(cold_files[0])
    journal.append("0123456789ab", "move", "placing", file=names[0], cold_file=cold_files[0],
                   dev=st.st_dev, ino=st.st_ino + 1, size=st.st_size)

    assert recover(hot, cold, journal) == 1

    assert not journal.unfinished()
    assert _files(f"{cold}/run/step_1") == orphans
    _assert_holds(kept, 1)
    _assert_holds(f"{run}/step_1", 111)


def test_hostile_move_records_touch_nothing_outside_the_tiers(tmp_path):
    hot, cold = _tiers(tmp_path)
    run = f"{hot}/run"
    _save(f"{run}/step_1", 1, 1)
    home = str(tmp_path / "home" / "user" / "project")
    os.makedirs(f"{home}/.thesis.tiering-0123456789ab/chapters")
    victims = {f"{home}/paper.tex": b"years of work", f"{home}/metadata.msgpack": b"not ours",
               f"{home}/.thesis.tiering-0123456789ab/chapters/ch1.tex": b"more work"}
    for p, data in victims.items():
        with open(p, "wb") as f:
            f.write(data)
    outside = os.lstat(f"{home}/metadata.msgpack")
    names = sorted(os.listdir(f"{run}/step_1"))
    records = [
        # A checkpoint outside the hot root; a file name that climbs out of it.
        dict(id="0123456789ab", checkpoint=f"{home}/thesis", files=["../paper.tex"]),
        dict(id="0a23456789ab", checkpoint=f"{home}/thesis", files=["paper.tex"]),
        # Inside the hot root by its text only.
        dict(id="1123456789ab", checkpoint=f"{run}/../../home/user/project/thesis", files=["ch1.tex"]),
        # A file name that climbs from a real checkpoint to the victim.
        dict(id="2123456789ab", checkpoint=f"{run}/step_1",
             files=[os.path.relpath(f"{home}/paper.tex", f"{run}/step_1")]),
        # An id that is a path.
        dict(id="../../../home/user/project/x", checkpoint=f"{run}/step_1", files=names),
        # Cold paths outside the cold root, with the victim's true inode journaled.
        dict(id="3123456789ab", checkpoint=f"{run}/step_1", files=["metadata.msgpack"],
             cold_files=[f"{home}/metadata.msgpack"]),
        dict(id="4123456789ab", checkpoint=f"{run}/step_1", files=["metadata.msgpack"],
             cold_files=[f"{cold}/../home/user/project/metadata.msgpack"]),
    ]
    with open(os.path.join(cold, JOURNAL_FILE), "w") as f:
        for r in records:
            f.write(json.dumps({"op": "move", "state": "begin", "time": 0, **r}) + "\n")
        for r in records[-2:]:
            f.write(json.dumps({"id": r["id"], "op": "move", "state": "placing", "file": "metadata.msgpack",
                                "cold_file": r["cold_files"][0], "dev": outside.st_dev,
                                "ino": outside.st_ino}) + "\n")
    hot_before = _snapshot(hot)

    report = run_once(load_config(hot=hot, cold=cold, cool_after="1d", keep_newest=1), now=NOW)

    for p, data in victims.items():
        with open(p, "rb") as f:
            assert f.read() == data, p
    assert os.path.isdir(f"{home}/.thesis.tiering-0123456789ab")
    assert report.recovered == 0 and not report.failed
    assert _snapshot(hot) == hot_before
    _assert_holds(f"{run}/step_1", 1)
    # Skipped, not marked resolved: a pass given the roots the move ran with would still act.
    assert len(Journal(cold).unfinished()) == len({r["id"] for r in records})


@pytest.mark.parametrize("given", ["the run directory", "a symlink to the hot root"])
def test_recovery_uses_the_recorded_paths_when_the_hot_root_given_changes(tmp_path, given):
    hot, cold = _tiers(tmp_path)
    run = f"{hot}/run"
    for s in (1, 2):
        _save(f"{run}/step_{s}", s, s)
    # The cold files of another checkpoint, removed from the hot tier but kept (linked) outside
    # it, at <cold>/step_1: where <cold>/<path relative to the run directory> leads.
    other, keep = str(tmp_path / "other"), str(tmp_path / "keep" / "step_1")
    _save(f"{other}/step_1", 7, 1)
    os.makedirs(f"{cold}/step_1"), os.makedirs(keep)
    for n in os.listdir(f"{other}/step_1"):
        shutil.move(f"{other}/step_1/{n}", f"{cold}/step_1/{n}")
        os.symlink(f"{cold}/step_1/{n}", f"{keep}/{n}")
    _assert_holds(keep, 7)
    kept_bytes = _files(f"{cold}/step_1")
    worker = [sys.executable, "-m", "tests.support.tiering_worker", "move", hot, cold, "verified"]
    proc = subprocess.run(worker, cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO), timeout=300)
    assert proc.returncode == -signal.SIGKILL
    assert sorted(os.listdir(f"{cold}/run/step_1")) == sorted(os.listdir(f"{run}/step_1"))  # copied
    if given == "the run directory":
        root = run
    else:
        root = str(tmp_path / "alias")
        os.symlink(hot, root)

    assert recover(root, cold, Journal(cold)) == 1

    assert _files(f"{cold}/step_1") == kept_bytes
    _assert_holds(keep, 7)
    assert _links(f"{run}/step_1") == [] and not [n for n in os.listdir(run) if ".tiering" in n]
    _assert_holds(f"{run}/step_1", 1)
    _assert_holds(f"{run}/step_2", 2)
    assert not any(files for _, _, files in os.walk(f"{cold}/run"))  # its copies rolled back


@pytest.fixture
def scanned(tmp_path):
    """Three month-old checkpoints and the scan a pass decided on."""
    hot, cold = _tiers(tmp_path)
    run = f"{hot}/run"
    for s in (1, 2, 3):
        _save(f"{run}/step_{s}", s, s)
        _age(f"{run}/step_{s}", 30)
    found = {c.name: c for c in scan(hot, cold)}
    assert all(c.committed and not c.latest for n, c in found.items() if n != "step_3")
    return hot, cold, run, found


def test_a_checkpoint_saved_over_after_the_scan_is_not_moved(scanned):
    hot, cold, run, found = scanned
    _save(f"{run}/step_1", 5, 5, overwrite=True)  # now the newest step: latest names it
    with open(f"{run}/latest") as f:
        assert json.load(f)["checkpoint"] == "step_1"
    _save(f"{run}/step_2", 22, 2, overwrite=True)  # saved over, not named by latest
    mover = Mover(hot, cold, Journal(cold))
    before = _snapshot(hot)

    with pytest.raises(MoveError, match="named by latest since the scan"):
        mover.cool(found["step_1"])
    with pytest.raises(MoveError, match="replaced by a new save since the scan"):
        mover.cool(found["step_2"])

    assert _snapshot(hot) == before
    assert not any(files for _, _, files in os.walk(cold))
    _assert_holds(f"{run}/step_1", 5)
    _assert_holds(f"{run}/step_2", 22)


def test_a_checkpoint_named_by_latest_after_the_scan_is_not_moved(scanned):
    hot, cold, run, found = scanned
    with open(f"{run}/latest", "w") as f:  # a rollback to step_2
        json.dump({"checkpoint": "step_2", "step": 2}, f)
    before = _snapshot(hot)
    with pytest.raises(MoveError, match="named by latest since the scan"):
        Mover(hot, cold, Journal(cold)).cool(found["step_2"])
    assert _snapshot(hot) == before and not any(files for _, _, files in os.walk(cold))
    _assert_holds(f"{run}/step_2", 2)
    # The one the scan saw unchanged and still movable is cooled as before.
    Mover(hot, cold, Journal(cold)).cool(found["step_1"])
    assert sorted(_links(f"{run}/step_1")) == sorted(os.listdir(f"{run}/step_1"))
    _assert_holds(f"{run}/step_1", 1)
