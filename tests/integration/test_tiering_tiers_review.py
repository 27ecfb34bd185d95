"""Storage tiering when the cold tier misbehaves: unmounted, read-only, full; a journal written
by the previous release; two services started at once.

- A cooled checkpoint whose cold tier is unmounted is committed: ``bcp ls`` lists it as
  ``cold-unreachable`` with the missing path (it said "uncommitted"), a load, ``bcp verify`` and
  a manager's restore raise ``ColdTierUnavailableError`` (it was "not a checkpoint" or
  "corrupt"), and ``bcp gc --yes`` keeps it.
- A read-only cold tier (a real read-only bind mount, in a private mount namespace: the tests
  run as root, so chmod would not stop a write) fails the pass with a named ``StorageIOError``,
  at once, with every checkpoint in place and loadable.
- A full cold tier (a real 64 KiB tmpfs, and the storage fault seam for the second file of a
  move) leaves the hot copy, removes the partial cold copy and closes the journal record; a
  tier too full for the journal fails with a named error too.
- Move records of the previous release (no cold paths, no inodes) are recovered: remapped files
  rolled forward, unremapped ones left hot and loadable, their cold copies kept as reported
  orphans (nothing proves the move made them) until the operator deletes them.
- Two passes started against the same tiers at once: the second stops with status 3 and
  touches nothing, whichever path it is given to the cold tier; the first finishes.

Checkpoints are tiny (one tensor), saved and loaded by one process.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time

import pytest
import torch

import bytecheckpoint as bcp
from bytecheckpoint.cli import app as bcp_cli
from bytecheckpoint.errors import ColdTierUnavailableError
from bytecheckpoint.manage.journal import JOURNAL_FILE, LOCK_FILE, Journal
from bytecheckpoint.manager import CheckpointManager
from bytecheckpoint.storage import faults
from storage_tiering import load_config, run_once
from storage_tiering.mover import scratch_dir
from tests.integration.test_tiering import DAY, NOW, REPO, _age, _snapshot, _tiers


def _save(path: str, val: float, step: int, n: int = 4) -> None:
    bcp.save(path, {"w": torch.full((n,), float(val))}, step=step)


def _assert_holds(path: str, val: float, n: int = 4) -> None:
    """The checkpoint at ``path`` verifies and loads its own values, bit for bit."""
    assert bcp.verify(path) == []
    state = {"w": torch.zeros(n)}
    bcp.load(path, state)
    assert state["w"].numpy().tobytes() == torch.full((n,), float(val)).numpy().tobytes()


def _run_of(hot: str, steps: int, n: int = 4) -> str:
    run = f"{hot}/run"
    for s in range(1, steps + 1):
        _save(f"{run}/step_{s}", s, s, n)
        _age(f"{run}/step_{s}", 100 - s)
    return run


def _cold_files(cold: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, n), cold) for d, _, names in os.walk(cold) for n in names
                  if n not in (JOURNAL_FILE, LOCK_FILE))


def _bcp(capsys, *argv: str) -> tuple[int, str, str]:
    code = bcp_cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# -- 1. an unmounted cold tier ---------------------------------------------------------------

@pytest.fixture()
def unmounted(tmp_path):
    """run/step_1 and step_2 cooled, step_3 and step_4 hot (step_4 named by latest); step_2's
    metadata put back hot (a move killed between its data files and its metadata); then the cold
    disk goes away, leaving its mount point empty."""
    hot, cold = _tiers(tmp_path)
    run = _run_of(hot, 3)
    assert len(run_once(load_config(env={}, hot=hot, cold=cold, cool_after="1d", keep_newest=1),
                        now=NOW).cooled) == 2
    meta = f"{run}/step_2/metadata.msgpack"
    target = os.readlink(meta)
    os.unlink(meta)
    shutil.copy2(target, meta)
    _save(f"{run}/step_4", 4, 4)
    _age(f"{run}/step_4", 50)
    disk = str(tmp_path / "hdd-disk")
    os.rename(cold, disk)
    os.makedirs(cold)
    return hot, cold, run, disk


def test_ls_lists_a_checkpoint_whose_cold_tier_is_unmounted_as_committed_and_unreachable(unmounted, capsys):
    hot, cold, run, _ = unmounted
    for extra in ((), ("--cold", cold)):
        code, out, _ = _bcp(capsys, "ls", hot, "--json", *extra)
        assert code == 0
        rows = {r["name"]: r for r in json.loads(out)["checkpoints"]}
        for name, missing in (("step_1", f"{cold}/run/step_1/metadata.msgpack"),
                              ("step_2", f"{cold}/run/step_2/extra-00000.safetensors")):
            row = rows[name]
            # The old listing said committed: False, tier "uncommitted" for step_1, and "hot" for step_2.
            assert row["committed"] is True and row["tier"] == "cold-unreachable", row
            assert row["unreachable"] == missing and missing in row["problem"]
        assert rows["step_2"]["step"] == 2 and rows["step_2"]["framework"] == "single"
        assert rows["step_1"]["size"] is None  # its metadata is in the missing tier: unknown
        assert rows["step_3"]["tier"] == "hot" and rows["step_4"]["latest"]

    code, out, err = _bcp(capsys, "ls", hot)
    line = next(x for x in out.splitlines() if x.startswith("run/step_1"))
    assert "cold-unreachable" in line and "uncommitted" not in line and " yes " in line
    assert f"{cold}/run/step_1/metadata.msgpack is not there (is the cold disk mounted?)" in err

    # The checkpoint itself as ROOT: it was "no checkpoints under ...".
    code, out, _ = _bcp(capsys, "ls", f"{run}/step_1", "--json")
    rows = json.loads(out)["checkpoints"]
    assert [(r["name"], r["tier"]) for r in rows] == [("step_1", "cold-unreachable")]


def test_load_verify_and_restore_of_an_unmounted_checkpoint_name_the_missing_cold_tier(unmounted, capsys):
    hot, cold, run, disk = unmounted
    for name in ("step_1", "step_2"):
        with pytest.raises(ColdTierUnavailableError, match="cold tier that is not mounted") as err:
            bcp.load(f"{run}/{name}", {"w": torch.zeros(4)})
        assert err.value.missing.startswith(f"{cold}/run/{name}/")
        code, _, stderr = _bcp(capsys, "verify", f"{run}/{name}")
        assert code == 6 and "cold tier that is not mounted" in stderr  # not 3 (not a checkpoint) or 1 (bad)

    # The run's latest moved back to step_1 (a rollback): a resume says why it cannot load.
    os.replace(f"{run}/latest", f"{run}/latest.keep")
    with open(f"{run}/latest", "w") as f:
        json.dump({"checkpoint": "step_1", "step": 1, "time": NOW}, f)
    with pytest.raises(ColdTierUnavailableError, match="not mounted"):
        bcp.load(run, {"w": torch.zeros(4)})
    manager = CheckpointManager(run)
    try:
        with pytest.raises(ColdTierUnavailableError, match="is the cold disk mounted"):
            manager.restore({"w": torch.zeros(4)})
    finally:
        manager.close()
    os.replace(f"{run}/latest.keep", f"{run}/latest")

    # Mounted again: both load their own values.
    os.rmdir(cold)
    os.rename(disk, cold)
    _assert_holds(f"{run}/step_1", 1)
    _assert_holds(f"{run}/step_2", 2)


def test_gc_never_deletes_a_checkpoint_whose_cold_tier_is_unmounted(unmounted, capsys):
    hot, cold, run, disk = unmounted
    before = _snapshot(hot)
    # With --cold the empty mount point: refused by name, before the lock or a journal record
    # goes into it (hidden under the disk once it is mounted again).
    code, out, err = _bcp(capsys, "gc", hot, "--keep-last", "1", "--yes", "--cold", cold)
    assert code == 6 and "is the cold disk mounted? Nothing was deleted" in err, out + err
    assert _snapshot(hot) == before and os.listdir(cold) == []

    # Without it: the policy runs, and the unreachable checkpoints are kept (they were
    # "uncommitted" before, kept by luck of that rule).
    code, out, _ = _bcp(capsys, "gc", hot, "--keep-last", "1", "--yes")
    assert code == 0, out
    kept = {line.split()[1]: line for line in out.splitlines() if line.startswith("keep")}
    for name in ("run/step_1", "run/step_2"):
        assert "cold tier unreachable" in kept[name] and "uncommitted" not in kept[name]
    assert not os.path.exists(f"{run}/step_3")  # the hot one beyond --keep-last went
    mine = ("run/step_1", "run/step_2", "run/latest", "run/step_4")
    assert {k: v for k, v in _snapshot(hot).items() if k.startswith(mine)} == \
        {k: v for k, v in before.items() if k.startswith(mine)}
    os.rmdir(cold)
    os.rename(disk, cold)
    _assert_holds(f"{run}/step_1", 1)
    _assert_holds(f"{run}/step_2", 2)


# -- 2. and 4. a read-only or full cold tier, for real: mounts in a private mount namespace ---

def _in_namespace(script: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run a shell script as root in a mount namespace of its own: its mounts vanish with it,
    whatever happens to the test. Skips where mounting is not allowed (not root, a container
    without CAP_SYS_ADMIN): the fault-seam tests below cover the same code paths there."""
    probe = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c",
                            "mount -t tmpfs -o size=4k tmpfs /mnt"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount in a private namespace here: {probe.stderr.strip()[:200]}")
    env = {**os.environ, "PYTHONPATH": REPO}
    return subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-ec", script], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=timeout)


def _tiering_cmd(hot: str, cold: str) -> str:
    return " ".join(shlex.quote(a) for a in (sys.executable, "-m", "storage_tiering", "--once", "--hot", hot,
                                              "--cold", cold, "--cool-after", "1d", "--keep-newest", "1"))


def test_a_read_only_cold_tier_fails_the_pass_by_name_and_moves_nothing(tmp_path):
    hot, cold = _tiers(tmp_path)
    run = _run_of(hot, 2)
    config = load_config(env={}, hot=hot, cold=cold, cool_after="1d", keep_newest=1)
    assert len(run_once(config, now=NOW).cooled) == 1  # step_1 cold: its bytes are in that tier
    _save(f"{run}/step_3", 3, 3)
    _age(f"{run}/step_3", 10)
    before_hot, before_cold = _snapshot(hot), _snapshot(cold)

    # The whole cold root read-only (remounted ro), then only the run's directory in it.
    started = time.monotonic()
    whole = _in_namespace(f"mount --bind {cold} {cold}; mount -o remount,bind,ro {cold}; "
                          f"{_tiering_cmd(hot, cold)} || echo exit=$?")
    assert "exit=1" in whole.stdout, whole.stdout + whole.stderr
    assert "Read-only file system (EROFS)" in whole.stderr and "must be writable" in whole.stderr
    assert "Traceback" not in whole.stderr
    part = _in_namespace(f"mount --bind {cold}/run {cold}/run; mount -o remount,bind,ro {cold}/run; "
                         f"{_tiering_cmd(hot, cold)} || echo exit=$?")
    assert "exit=1" in part.stdout, part.stdout + part.stderr
    assert f"FAILED {run}/step_2: StorageIOError" in part.stderr and "EROFS" in part.stderr
    assert time.monotonic() - started < 60  # no retrying forever

    assert _snapshot(hot) == before_hot
    cold_now = _snapshot(cold)
    assert {k: v for k, v in cold_now.items() if k != JOURNAL_FILE} == \
        {k: v for k, v in before_cold.items() if k != JOURNAL_FILE}
    journal = Journal(cold)
    assert not journal.unfinished()  # the failed move's record is closed: nothing to recover
    for s in (1, 2, 3):
        _assert_holds(f"{run}/step_{s}", s)
    # Writable again: the next pass cools what it could not.
    report = run_once(config, now=NOW)
    assert [os.path.basename(r.checkpoint) for r in report.cooled] == ["step_2"] and not report.failed
    _assert_holds(f"{run}/step_2", 2)


def test_a_read_only_cold_tier_from_python_is_a_storage_io_error(tmp_path):
    """The same through the fault seam, where mounting is not possible: a cold tier that refuses
    every write (EROFS) fails each move by name; one pass, one attempt per checkpoint."""
    hot, cold = _tiers(tmp_path)
    run = _run_of(hot, 3)
    before = _snapshot(hot)
    faults.install(f"fail_every=1;errno=EROFS;permanent=1;ops=makedirs,open_writer,write;path={cold}")
    try:
        report = run_once(load_config(env={}, hot=hot, cold=cold, cool_after="1d", keep_newest=1), now=NOW)
    finally:
        faults.install(None)
    assert sorted(report.failed) == [f"{run}/step_1", f"{run}/step_2"] and not report.cooled
    assert all(e.startswith("StorageIOError") and "read-only" in e for e in report.failed.values())
    assert _snapshot(hot) == before and _cold_files(cold) == [] and not Journal(cold).unfinished()
    for s in (1, 2, 3):
        _assert_holds(f"{run}/step_{s}", s)


def test_a_full_cold_tier_keeps_the_hot_copy_and_removes_the_partial_cold_copy(tmp_path):
    hot, cold = _tiers(tmp_path)
    run = _run_of(hot, 2, n=40_000)  # 160 KB of data per checkpoint: more than the 64 KiB tier holds
    before = _snapshot(hot)
    listing = f"echo COLD; find {cold} -type f ! -name {JOURNAL_FILE} ! -name {LOCK_FILE}; echo END"
    out = _in_namespace(f"mount -t tmpfs -o size=64k tmpfs {cold}; {_tiering_cmd(hot, cold)} || "
                        f"echo exit=$?; {listing}; tail -c 400 {cold}/{JOURNAL_FILE}")
    assert "exit=1" in out.stdout, out.stdout + out.stderr
    assert f"FAILED {run}/step_1: StorageIOError" in out.stderr and "ENOSPC" in out.stderr
    files = out.stdout.split("COLD\n")[1].split("END")[0].split()
    assert files == []  # the partial cold copy is gone
    assert '"state":"aborted"' in out.stdout  # and the record closed
    assert _snapshot(hot) == before
    _assert_holds(f"{run}/step_1", 1, n=40_000)
    before = _snapshot(hot)  # the load's read lease came and went in the run directory

    # A tier so full that not even the journal's first record fits: named, nothing moved.
    out = _in_namespace(f"mount -t tmpfs -o size=64k tmpfs {cold}; head -c 1M /dev/zero > {cold}/filler || "
                        f"true; {_tiering_cmd(hot, cold)} || echo exit=$?")
    assert "exit=1" in out.stdout, out.stdout + out.stderr
    assert "append to the journal" in out.stderr and "ENOSPC" in out.stderr and "Traceback" not in out.stderr
    assert _snapshot(hot) == before


def test_a_cold_tier_full_at_the_second_file_removes_the_first_and_keeps_the_hot_copy(tmp_path):
    hot, cold = _tiers(tmp_path)
    run = _run_of(hot, 2)
    before = _snapshot(hot)
    config = load_config(env={}, hot=hot, cold=cold, cool_after="1d", keep_newest=1)
    # The data file is copied and placed; the metadata's copy then meets a full disk.
    faults.install(f"fail_every=1;errno=ENOSPC;permanent=1;ops=write;path={cold}/run/step_1/.metadata")
    try:
        report = run_once(config, now=NOW)
    finally:
        faults.install(None)
    assert not report.cooled and "ENOSPC" in report.failed[f"{run}/step_1"]
    assert report.failed[f"{run}/step_1"].startswith("StorageIOError")
    assert _cold_files(cold) == [] and not report.orphans
    assert _snapshot(hot) == before and not Journal(cold).unfinished()
    _assert_holds(f"{run}/step_1", 1)
    again = run_once(config, now=NOW)
    assert [os.path.basename(r.checkpoint) for r in again.cooled] == ["step_1"] and not again.failed
    _assert_holds(f"{run}/step_1", 1)


# -- 3. a journal written by the previous release -------------------------------------------

def _old_release_crash(hot: str, cold: str, ckpt: str, remapped: list[str], move_id: str) -> list[str]:
    """What the previous release's mover left when killed: every file copied to its cold path
    (``os.replace`` over whatever was there), the files in ``remapped`` switched to links (their
    hot copies in the scratch directory), and journal records without cold paths or inodes."""
    names = sorted(os.listdir(ckpt), key=lambda n: n == "metadata.msgpack")  # the metadata last
    journal = Journal(cold)
    journal.append(move_id, "move", "begin", checkpoint=ckpt, files=names)
    for n in names:
        cold_file = os.path.join(cold, os.path.relpath(os.path.join(ckpt, n), hot))
        os.makedirs(os.path.dirname(cold_file), exist_ok=True)
        shutil.copy2(os.path.join(ckpt, n), cold_file)
    journal.append(move_id, "move", "copied")
    journal.append(move_id, "move", "verified")
    if remapped:
        os.makedirs(scratch_dir(ckpt, move_id))
    for n in remapped:
        os.link(os.path.join(ckpt, n), os.path.join(scratch_dir(ckpt, move_id), n))
        link = os.path.join(ckpt, f".{n}.tiering-link-{move_id}")
        os.symlink(os.path.join(cold, os.path.relpath(os.path.join(ckpt, n), hot)), link)
        os.replace(link, os.path.join(ckpt, n))
    if remapped == names:
        journal.append(move_id, "move", "remapped")
    return names


@pytest.mark.parametrize("remapped", [0, 1, 2], ids=["after-verify", "after-first-remap", "after-remap"])
def test_recovery_of_a_move_journaled_by_the_previous_release(tmp_path, remapped):
    hot, cold = _tiers(tmp_path)
    run = _run_of(hot, 2)
    ckpt = f"{run}/step_1"
    names = sorted(os.listdir(ckpt), key=lambda n: n == "metadata.msgpack")
    _old_release_crash(hot, cold, ckpt, names[:remapped], "0123456789ab")
    _assert_holds(ckpt, 1)  # right after the crash, before any recovery

    report = run_once(load_config(env={}, hot=hot, cold=cold, cool_after="1d", keep_newest=1), now=NOW)

    assert report.recovered == 1 and not Journal(cold).unfinished()
    assert not os.path.exists(scratch_dir(ckpt, "0123456789ab"))
    assert not any(".tiering-" in n for n in os.listdir(ckpt))
    _assert_holds(ckpt, 1)
    hot_left = [n for n in names if not os.path.islink(os.path.join(ckpt, n))]
    assert hot_left == names[remapped:]  # remapped files rolled forward, the rest stay hot
    # A copy of a file left hot: nothing proves the old move made it (no inode was journaled),
    # so it is kept and reported, and the checkpoint is not cooled over it.
    left = sorted(f"{cold}/run/step_1/{n}" for n in hot_left)
    assert sorted(report.orphans) == left
    if left:
        assert "already in the cold tier" in report.failed[ckpt]
        for f in left:  # what the error says to do, once nothing uses them
            os.unlink(f)
    again = run_once(load_config(env={}, hot=hot, cold=cold, cool_after="1d", keep_newest=1), now=NOW)
    assert not again.failed and not again.orphans
    assert all(os.path.islink(os.path.join(ckpt, n)) for n in names)
    _assert_holds(ckpt, 1)
    _assert_holds(f"{run}/step_2", 2)


# -- 5. two services at once -------------------------------------------------------------------

def test_two_passes_started_at_once_never_both_work_on_one_cold_tier(tmp_path):
    hot, cold = _tiers(tmp_path)
    run = _run_of(hot, 4)
    alias, flags = str(tmp_path / "hdd-alias"), str(tmp_path / "flags")
    os.symlink(cold, alias)  # one of the overlapping cron jobs names the same tier another way
    os.makedirs(flags)
    env = {**os.environ, "PYTHONPATH": REPO}
    first = subprocess.Popen([sys.executable, "-m", "tests.support.tiering_worker", "hold", hot, cold, flags],
                             env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(f"{flags}/holding"):  # mid-move: step_1 copied, not yet remapped
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()
            time.sleep(0.05)
        during = _snapshot(hot), _snapshot(cold)
        cmd = [sys.executable, "-m", "storage_tiering", "--once", "--hot", hot, "--cool-after", "1d",
               "--keep-newest", "1", "--cold"]
        others = [subprocess.Popen([*cmd, given], env=env, cwd=REPO, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True) for given in (cold, alias)]
        for other in others:
            _, err = other.communicate(timeout=120)
            assert other.returncode == 3, err
            assert "another tiering pass or bcp gc holds" in err
        assert (_snapshot(hot), _snapshot(cold)) == during  # the second passes touched nothing
        open(f"{flags}/release", "w").close()
        out, err = first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert first.returncode == 0 and "cooled=3 failed=0" in out, out + err
    journal = Journal(cold)
    assert not journal.unfinished()
    assert {r["id"] for r in journal.records() if r.get("state") == "begin"} == \
        {r["id"] for r in journal.records() if r.get("state") == "done"}
    for s in (1, 2, 3, 4):
        _assert_holds(f"{run}/step_{s}", s)
    report = run_once(load_config(env={}, hot=hot, cold=cold, cool_after="1d", keep_newest=1), now=NOW + DAY)
    assert not report.changed and not report.failed and not report.orphans
