"""Storage tiering as an unlucky operator runs it: tiers that overlap through a symlink, a cold
tier that is unmounted (its mount point left empty), two services given different cold tiers.

- A cold root that is the hot root, or inside it, through a symlink is refused: the scan took
  the cold copies for a run of checkpoints, and retention deleted a pinned checkpoint's cold
  files (the old code checked the paths as given only).
- A pass refuses to run while hot links point at missing cold files: it cooled new checkpoints
  into the empty mount point, where the remounted disk hid them (those checkpoints were lost).
  Loads and ``bcp verify`` of such a checkpoint say that its cold tier is not mounted
  (``ColdTierUnavailableError``).
- A file cooled into another cold tier is not copied again by a second service.
- A move killed between making the remap's temporary link and renaming it over the hot file
  is rolled back without leaving an orphan that blocks the checkpoint's next move.

Checkpoints are tiny (one 4-element tensor), saved and loaded by one process.
"""

from __future__ import annotations

import os
import stat

import pytest
import torch

import bytecheckpoint as bcp
from bytecheckpoint.errors import ColdTierUnavailableError
from bytecheckpoint.manage.journal import JOURNAL_FILE, LOCK_FILE
from storage_tiering import ConfigError, load_config, run_once
from storage_tiering.__main__ import main as cli
from tests.integration.test_tiering import DAY, NOW, _age, _snapshot, _tiers
from tests.integration.test_tiering_mover_safety import _assert_holds, _save


def _run_of(hot: str, steps: int) -> str:
    run = f"{hot}/run"
    for s in range(1, steps + 1):
        _save(f"{run}/step_{s}", s, s)
        _age(f"{run}/step_{s}", 100 - s)
    return run


def _cold_files(cold: str) -> list[str]:
    return sorted(os.path.join(d, n) for d, _, names in os.walk(cold) for n in names
                  if n not in (JOURNAL_FILE, LOCK_FILE))


def test_tiers_that_overlap_through_a_symlink_are_refused(tmp_path):
    hot, cold = _tiers(tmp_path)
    os.makedirs(f"{hot}/cold")
    os.symlink(f"{hot}/cold", f"{tmp_path}/cold-inside")  # the cold root, inside the hot one
    os.symlink(hot, f"{tmp_path}/hot-alias")  # the hot root itself
    os.symlink(f"{cold}", f"{tmp_path}/cold-alias")
    os.makedirs(f"{cold}/hot")
    for hot_given, cold_given in ((hot, f"{tmp_path}/cold-inside"), (hot, f"{tmp_path}/hot-alias"),
                                  (f"{tmp_path}/cold-alias/hot", cold)):
        with pytest.raises(ConfigError, match="must not contain each other"):
            load_config(env={}, hot=hot_given, cold=cold_given)
    with pytest.raises(ConfigError, match="interval"):
        load_config(env={}, hot=hot, cold=cold, interval="0")  # --loop would never pause

    # The same checked again by each pass: a link swapped after the settings were read.
    config = load_config(env={}, hot=hot, cold=f"{tmp_path}/cold-alias", cool_after="1d", keep_newest=1)
    os.unlink(f"{tmp_path}/cold-alias")
    os.symlink(f"{hot}/cold", f"{tmp_path}/cold-alias")
    with pytest.raises(ConfigError, match="must not contain each other"):
        run_once(config, now=NOW)


@pytest.fixture()
def unmounted(tmp_path):
    """step_1 and step_2 cooled; then the cold disk goes away and leaves its mount point empty;
    step_3 and step_4 are saved since, old enough to cool."""
    hot, cold = _tiers(tmp_path)
    run = _run_of(hot, 3)
    config = load_config(env={}, hot=hot, cold=cold, cool_after="1d", keep_newest=1)
    assert len(run_once(config, now=NOW).cooled) == 2
    disk = str(tmp_path / "hdd-disk")
    os.rename(cold, disk)
    os.makedirs(cold)
    _save(f"{run}/step_4", 4, 4)
    _age(f"{run}/step_4", 50)
    return hot, cold, run, disk, config


def test_a_pass_refuses_a_cold_tier_whose_files_are_missing_and_cools_nothing(unmounted, capsys):
    hot, cold, run, disk, config = unmounted
    before = _snapshot(hot)

    with pytest.raises(ConfigError, match="is the disk mounted") as err:
        run_once(config, now=NOW + DAY)
    assert f"{cold}/run/step_" in str(err.value)
    assert _snapshot(hot) == before and _cold_files(cold) == []
    assert cli(["--once", "--hot", hot, "--cold", cold, "--cool-after", "1d", "--keep-newest", "1"]) == 2
    assert "is the disk mounted" in capsys.readouterr().err
    assert _snapshot(hot) == before and _cold_files(cold) == []

    # A deletion's trash with dangling links is resolved by recovery, not counted as missing.
    os.makedirs(f"{run}/.step_9.deleting-0123456789ab")
    os.symlink(f"{cold}/run/step_9/x.safetensors", f"{run}/.step_9.deleting-0123456789ab/x.safetensors")

    # Mounted again: the pass runs, and every checkpoint loads its own values.
    os.rename(cold, f"{cold}-mountpoint")
    os.rename(disk, cold)
    report = run_once(config, now=NOW + DAY)
    assert [os.path.basename(r.checkpoint) for r in report.cooled] == ["step_3"] and not report.failed
    for s in (1, 2, 3, 4):
        _assert_holds(f"{run}/step_{s}", s)


def test_load_and_verify_of_a_checkpoint_whose_cold_tier_is_missing_say_so(unmounted):
    hot, cold, run, disk, config = unmounted
    for call in (bcp.verify, lambda p: bcp.load(p, {"w": torch.zeros(4)})):
        with pytest.raises(ColdTierUnavailableError, match="cold tier that is not mounted") as err:
            call(f"{run}/step_1")
        assert f"{cold}/run/step_1/metadata" in str(err.value)


def _entries(root: str) -> dict[str, tuple]:
    """What _snapshot says, but a directory's mtime: the save's lock file, made and removed in
    the run directory, changes that and nothing else."""
    return {p: (None if stat.S_ISDIR(v[0]) else v) for p, v in _snapshot(root).items()}


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_save_over_a_checkpoint_whose_cold_tier_is_missing_says_so_and_changes_nothing(
        unmounted, overwrite):
    # Was: NotACheckpointError / CheckpointExistsError "exists and is a directory holding
    # 'metadata.msgpack', ..., not a checkpoint": it is one, committed and intact.
    hot, cold, run, disk, config = unmounted
    before = _entries(hot)
    with pytest.raises(ColdTierUnavailableError, match="cold tier that is not mounted") as err:
        _save(f"{run}/step_1", 9, 9, overwrite=overwrite)
    assert err.value.missing == f"{cold}/run/step_1/metadata.msgpack"
    assert err.value.missing in str(err.value) and "Nothing was saved" in str(err.value)
    assert _entries(hot) == before and _cold_files(cold) == []

    # Mounted again: it is there as it was, and overwrite=True replaces it.
    os.rename(cold, f"{cold}-mountpoint")
    os.rename(disk, cold)
    _assert_holds(f"{run}/step_1", 1)
    _save(f"{run}/step_1", 9, 9, overwrite=True)
    _assert_holds(f"{run}/step_1", 9)


def test_a_checkpoint_cooled_into_another_cold_tier_is_not_copied_again(tmp_path):
    hot, cold_a = _tiers(tmp_path)
    cold_b = str(tmp_path / "hdd-b")
    os.makedirs(cold_b)
    run = _run_of(hot, 2)
    first = run_once(load_config(env={}, hot=hot, cold=cold_a, cool_after="1d", keep_newest=1), now=NOW)
    assert [os.path.basename(r.checkpoint) for r in first.cooled] == ["step_1"]

    other = load_config(env={}, hot=hot, cold=cold_b, cool_after="1d", keep_newest=1)
    report = run_once(other, now=NOW)

    error = report.failed[f"{run}/step_1"]
    assert error.startswith("MoveError") and f"outside the cold root {cold_b}" in error
    assert _cold_files(cold_b) == []  # nothing copied (the old code copied it all, then failed)
    _assert_holds(f"{run}/step_1", 1)
    assert run_once(other, now=NOW).recovered == 0


class _Killed(BaseException):
    """Stands for SIGKILL: nothing of the mover's error handling runs."""


def test_a_move_killed_between_the_remap_link_and_its_rename_is_cooled_next(tmp_path, monkeypatch):
    hot, cold = _tiers(tmp_path)
    run = _run_of(hot, 2)
    config = load_config(env={}, hot=hot, cold=cold, cool_after="1d", keep_newest=1)
    real_replace = os.replace

    def replace(src, dst, **kw):
        if "tiering-link-" in str(src):
            raise _Killed  # the temporary link is made, the hot file not yet replaced
        return real_replace(src, dst, **kw)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(_Killed):
        run_once(config, now=NOW)
    monkeypatch.setattr(os, "replace", real_replace)
    _assert_holds(f"{run}/step_1", 1)

    report = run_once(config, now=NOW)

    # The old recovery counted the temporary link as a user of the cold copy and kept it: an
    # orphan that refused every later move of the checkpoint ("already in the cold tier").
    assert report.recovered == 1 and not report.failed and not report.orphans
    assert [os.path.basename(r.checkpoint) for r in report.cooled] == ["step_1"]
    _assert_holds(f"{run}/step_1", 1)
