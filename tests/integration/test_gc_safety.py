"""What ``bcp gc`` and the tiering service may delete: only files proved to belong to the
checkpoint removed and to no kept one, inside the hot or the cold root (real paths). A link
whose text starts with the cold root but resolves elsewhere, cold files a ``cp -a`` copy still
uses, checkpoints that cannot be classified (odd step, unreadable ``latest``), a save running
meanwhile: none of them loses a byte."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

import bytecheckpoint as bcp
from bytecheckpoint.cli import app as cli
from bytecheckpoint.format.metadata import METADATA_FILE, pack_document, unpack_document
from bytecheckpoint.manage.catalog import scan
from storage_tiering import load_config, run_once

DAY = 86400.0
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _state(step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.arange(64, dtype=torch.float32) * step, "b": torch.full((8,), float(step))}


def _save(path: str, step: int, data: int | None = None) -> None:
    bcp.save(path, {"model": _state(step if data is None else data)}, step=step)


def _loads_as(path: str, step: int) -> None:
    target = {"model": {k: torch.zeros_like(v) for k, v in _state(step).items()}}
    bcp.load(path, target)
    for k, v in _state(step).items():
        assert torch.equal(target["model"][k], v), f"{path}: {k} differs"


def _run(root: str, steps: range) -> None:
    for s in steps:
        _save(f"{root}/step_{s}", s)


def _gc(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(["gc", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def _data_file(ckpt: str) -> str:
    names = [n for n in sorted(os.listdir(ckpt)) if n.endswith(".safetensors")]
    assert names, ckpt
    return os.path.join(ckpt, names[0])


def _cool(hot: str, cold: str) -> None:
    """Cool everything but the newest checkpoint of each run and the ones latest names."""
    config = load_config(hot=hot, cold=cold, cool_after="1d", keep_newest=1)
    report = run_once(config, now=time.time() + 2 * DAY)
    assert report.cooled and not report.failed, report.failed


def _cooled_run_copied(tmp_path: Path) -> tuple[Path, Path]:
    """hot/run1 with steps 1-3, all but the newest cooled, and run2/step_1 a ``cp -a`` copy of
    run1/step_1: its links point at the same cold files."""
    hot, cold = tmp_path / "hot", tmp_path / "cold"
    cold.mkdir()
    _run(f"{hot}/run1", range(1, 4))
    _cool(str(hot), str(cold))
    os.makedirs(f"{hot}/run2")
    subprocess.run(["cp", "-a", f"{hot}/run1/step_1", f"{hot}/run2/step_1"], check=True)
    return hot, cold


def test_a_link_that_resolves_outside_the_cold_root_is_not_deleted(capsys, tmp_path):
    hot, cold, victim = tmp_path / "hot", tmp_path / "cold", tmp_path / "victim"
    cold.mkdir(), victim.mkdir()
    _run(f"{hot}/run", range(1, 4))
    # step_1's data file replaced by a link whose text starts with the cold root.
    data = _data_file(f"{hot}/run/step_1")
    precious = victim / os.path.basename(data)
    os.replace(data, precious)
    os.symlink(f"{cold}/../victim/{precious.name}", data)
    code, _, err = _gc(capsys, str(hot), "--keep-last", "1", "--cold", str(cold), "--yes")
    assert code == 0, err
    assert not os.path.exists(f"{hot}/run/step_1")  # the checkpoint went
    assert precious.exists()  # the file outside both tiers did not


def test_gc_keeps_cold_files_a_cp_a_copy_still_links_to(capsys, tmp_path):
    hot, cold = _cooled_run_copied(tmp_path)
    assert {c.name: c.state for c in scan(str(hot), str(cold))}["step_1"] == "cold"
    code, out, err = _gc(capsys, str(hot), "--keep-last", "1", "--cold", str(cold), "--yes")
    assert code == 0, err
    assert not os.path.exists(f"{hot}/run1/step_1") and os.path.exists(f"{hot}/run2/step_1"), out
    _loads_as(f"{hot}/run2/step_1", 1)  # bit-exact: its cold files are still there
    # step_2, which nothing else links to, went with its cold copy and emptied directory.
    assert not os.path.exists(f"{hot}/run1/step_2") and not os.path.exists(f"{cold}/run1/step_2")
    assert os.listdir(f"{cold}/run1/step_1")


def test_tiering_retention_keeps_cold_files_a_copy_uses(tmp_path):
    hot, cold = _cooled_run_copied(tmp_path)
    config = load_config(hot=str(hot), cold=str(cold), cool_after="1d", delete_after="2d", keep_newest=1)
    report = run_once(config, now=time.time() + 3 * DAY)
    assert f"{hot}/run1/step_1" in report.deleted and not report.failed, report.failed
    _loads_as(f"{hot}/run2/step_1", 1)


def test_cooling_never_overwrites_a_cold_file_a_copy_links_to(tmp_path):
    hot, cold = _cooled_run_copied(tmp_path)
    # The original is removed by hand and a different checkpoint saved at its path.
    subprocess.run(["rm", "-r", f"{hot}/run1/step_1"], check=True)
    _save(f"{hot}/run1/step_1", 0, data=7)  # an older step: latest stays on step_3
    report = run_once(load_config(hot=str(hot), cold=str(cold), cool_after="1d", keep_newest=1),
                      now=time.time() + 2 * DAY)
    assert f"{hot}/run1/step_1" in report.failed and "links to it" in report.failed[f"{hot}/run1/step_1"]
    _loads_as(f"{hot}/run2/step_1", 1)  # the copy's data was not replaced
    _loads_as(f"{hot}/run1/step_1", 7)  # and the new checkpoint stayed hot and whole


def _rewrite_step(ckpt: str, step: object) -> None:
    """What an older release (which took ``step="init"``) or a hostile writer leaves."""
    path = os.path.join(ckpt, METADATA_FILE)
    with open(path, "rb") as f:
        doc = unpack_document(f.read())
    doc["step"] = step
    with open(path, "wb") as f:
        f.write(pack_document(doc))


def test_an_odd_step_is_listed_and_kept_by_ls_gc_and_tiering(capsys, tmp_path):
    hot, cold = tmp_path / "hot", tmp_path / "cold"
    cold.mkdir()
    _run(f"{hot}/run", range(1, 5))
    _rewrite_step(f"{hot}/run/step_1", "init")
    _rewrite_step(f"{hot}/run/step_2", -5.5)
    assert cli.main(["ls", str(hot)]) == 0
    assert cli.main(["ls", str(hot), "--json"]) == 0
    out = capsys.readouterr().out
    assert "step_1" in out and "step_2" in out
    code, out, err = _gc(capsys, str(hot), "--keep-last", "1", "--yes")
    assert code == 0, err
    assert os.path.isdir(f"{hot}/run/step_1") and os.path.isdir(f"{hot}/run/step_2")  # not classified
    assert not os.path.exists(f"{hot}/run/step_3") and os.path.isdir(f"{hot}/run/step_4")
    report = run_once(load_config(hot=str(hot), cold=str(cold), cool_after="1d", delete_after="2d",
                                  keep_newest=1), now=time.time() + 3 * DAY)
    assert not report.failed and not report.deleted and not report.cooled
    reasons = {d.checkpoint.name: d.reason for d in report.decisions}
    assert reasons["step_1"].startswith("cannot be classified") and "step_4" in reasons


def test_an_unreadable_latest_protects_the_whole_run(capsys, tmp_path):
    hot = tmp_path / "hot"
    _run(f"{hot}/run", range(1, 5))
    _run(f"{hot}/other", range(1, 3))
    # latest named step_2 (a rollback) and was then damaged: which one it protects is unknown.
    for bad in ('{"checkpoint": "step_2", "st', '{"checkpoint": "../other/step_1"}', "[]", ""):
        with open(f"{hot}/run/latest", "w") as f:
            f.write(bad)
        assert cli.main(["ls", str(hot)]) == 0
        assert "run/step_2" in capsys.readouterr().out
        code, out, err = _gc(capsys, str(hot), "--keep-last", "1", "--yes", "--json")
        assert code == 0, err
        doc = json.loads(out)
        kept = {os.path.basename(c["path"]): c["reason"] for c in doc["checkpoints"] if "/run/" in c["path"]}
        assert set(kept) == {"step_1", "step_2", "step_3", "step_4"}
        assert all("latest" in r for n, r in kept.items() if n != "step_4"), kept
        assert all(os.path.isdir(f"{hot}/run/step_{s}") for s in range(1, 5))
    assert not os.path.exists(f"{hot}/other/step_1")  # the other run, with a good latest, is collected


def test_gc_of_a_single_checkpoint_root_deletes_nothing(capsys, tmp_path):
    _run(f"{tmp_path}/run", range(1, 3))
    code, _, err = _gc(capsys, f"{tmp_path}/run/step_1", "--keep-last", "1", "--yes")
    assert code == 0, err
    assert os.path.isdir(f"{tmp_path}/run/step_1") and os.path.isdir(f"{tmp_path}/run/step_2")


SAVER = """
import sys, torch, bytecheckpoint as bcp
root, n = sys.argv[1], int(sys.argv[2])
for s in range(1, n + 1):
    state = {"w": torch.arange(64, dtype=torch.float32) * s, "b": torch.full((8,), float(s))}
    bcp.save(f"{root}/step_{s}", {"model": state}, step=s)
    print(s, flush=True)
"""


def test_a_save_running_while_gc_runs_loses_nothing(capsys, tmp_path):
    root = str(tmp_path / "run")
    n = 25
    saver = subprocess.Popen([sys.executable, "-c", SAVER, root, str(n)], cwd=REPO,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    passes = 0
    while saver.poll() is None:
        if os.path.isdir(root):
            code, _, err = _gc(capsys, root, "--keep-last", "2", "--yes", "-q")
            assert code in (0, 1), err  # 1: a checkpoint became untouchable meanwhile, and was kept
            passes += 1
        time.sleep(0.05)
    out, err = saver.communicate()
    assert saver.returncode == 0, err  # no save lost its staging directory or its commit
    assert out.split() == [str(s) for s in range(1, n + 1)]
    assert passes > 0
    _gc(capsys, root, "--keep-last", "2", "--yes")
    assert sorted(os.listdir(root)) == ["latest", f"step_{n - 1}", f"step_{n}"]
    _loads_as(root, n)  # through latest
    _loads_as(f"{root}/step_{n - 1}", n - 1)


def _aged(root: str, names: list[str], days: float) -> None:
    t = time.time() - days * DAY
    for name in names:
        for n in os.listdir(f"{root}/{name}"):
            os.utime(f"{root}/{name}/{n}", (t, t))


def test_a_checkpoint_saved_again_after_the_scan_is_not_deleted(tmp_path):
    """Retention decides on the scan, then deletes, minutes later on real sizes (the pass
    cools others first). A save that put a new checkpoint at the path meanwhile
    (``overwrite=True``) must not be deleted on the old one's age, by the local tier's
    deletion nor through the storage layer."""
    from bytecheckpoint.manage.deletion import DeletionRefusedError, delete_checkpoint, delete_on_storage
    from bytecheckpoint.storage import open_storage

    hot = str(tmp_path / "hot")
    _run(f"{hot}/run", range(1, 5))
    scanned = {c.name: c for c in scan(hot)}
    bcp.save(f"{hot}/run/step_2", {"model": _state(20)}, step=2, overwrite=True)  # same sizes
    refused = []
    for delete in (lambda c: delete_checkpoint(c, hot, None, None),
                   lambda c: delete_on_storage(open_storage(hot)[0], c)):
        try:
            delete(scanned["step_2"])
        except DeletionRefusedError as exc:
            refused.append(str(exc))
    assert len(refused) == 2 and all("replaced by a new save" in r for r in refused), refused
    target = {"model": {k: torch.zeros_like(v) for k, v in _state(20).items()}}
    bcp.load(f"{hot}/run/step_2", target)
    assert all(torch.equal(target["model"][k], v) for k, v in _state(20).items())
    delete_checkpoint(scanned["step_1"], hot, None, None)  # unchanged: deleted as decided
    assert sorted(os.listdir(f"{hot}/run")) == ["latest", "step_2", "step_3", "step_4"]
    rescanned = {c.name: c for c in scan(hot)}
    assert rescanned["step_2"].identity != scanned["step_2"].identity


def test_files_of_someone_elses_in_a_checkpoint_keep_it(capsys, tmp_path):
    """Notes or an evaluation's output kept inside a checkpoint directory are not ours: gc, the
    manager's retention and the tiering service keep the checkpoint (overwrite refuses it too)
    and say why, and delete it once they are moved out."""
    from bytecheckpoint import CheckpointManager, KeepLast

    root = f"{tmp_path}/run"
    _run(root, range(1, 4))
    Path(f"{root}/step_1/NOTES.txt").write_text("lr sweep 3")
    os.makedirs(f"{root}/step_1/eval")
    Path(f"{root}/step_1/eval/results.json").write_text("{}")
    code, out, err = _gc(capsys, root, "--keep-last", "1", "--yes")
    assert code == 1 and "'NOTES.txt', 'eval'" in err and "not part of the checkpoint" in err, (out, err)
    assert Path(f"{root}/step_1/eval/results.json").read_text() == "{}"
    assert not os.path.exists(f"{root}/step_2")  # the others went as decided
    _loads_as(f"{root}/step_1", 1)

    hot = f"{tmp_path}/hot"
    _run(f"{hot}/run", range(1, 4))
    Path(f"{hot}/run/step_1/NOTES.txt").write_text("keep me")
    _aged(f"{hot}/run", ["step_1", "step_2"], 100)
    os.makedirs(f"{tmp_path}/cold")
    report = run_once(load_config(hot=hot, cold=f"{tmp_path}/cold", keep_newest=1, cool_after="30d",
                                  delete_after="60d", env={}))
    assert [os.path.basename(p) for p in report.deleted] == ["step_2"]
    assert any("NOTES.txt" in why for why in report.failed.values()), report.failed
    assert Path(f"{hot}/run/step_1/NOTES.txt").read_text() == "keep me"

    mroot = f"{tmp_path}/managed"
    manager = CheckpointManager(mroot, retention=KeepLast(1), async_save=False)
    manager.save(1, {"model": _state(1)}, force=True)
    Path(f"{mroot}/step_1/NOTES.txt").write_text("mine")
    manager.save(2, {"model": _state(2)}, force=True)
    assert Path(f"{mroot}/step_1/NOTES.txt").read_text() == "mine"
    os.unlink(f"{mroot}/step_1/NOTES.txt")
    manager.save(3, {"model": _state(3)}, force=True)
    manager.close()
    assert sorted(os.listdir(mroot)) == ["latest", "step_3"]


def test_a_checkpoint_saved_without_a_step_is_ordered_by_time(capsys, tmp_path):
    """``save()`` without ``step=``: retention used to count such a checkpoint as the oldest of
    its run whatever its age, so ``--keep-last 2`` deleted a ``final`` saved after step 3. A run
    with one orders by time; ``--keep-every`` cannot judge it, so keeps it."""
    root = f"{tmp_path}/run"
    _run(root, range(1, 4))
    bcp.save(f"{root}/final", {"model": _state(7)})
    for n, age in (("step_1", 4), ("step_2", 3), ("step_3", 2), ("final", 1)):
        _aged(root, [n], age)
    code, out, err = _gc(capsys, root, "--keep-last", "2", "--yes")
    assert code == 0, err
    assert sorted(os.listdir(root)) == ["final", "latest", "step_3"], out
    _loads_as(f"{root}/final", 7)
    bcp.save(f"{root}/step_4", {"model": _state(4)}, step=4)
    code, out, err = _gc(capsys, root, "--keep-last", "1", "--keep-every", "100", "--yes")
    assert code == 0, err
    assert sorted(os.listdir(root)) == ["final", "latest", "step_4"], out  # step_4: latest


def test_tiering_refuses_retention_that_keeps_no_newest(tmp_path):
    from storage_tiering.config import ConfigError

    hot, cold = f"{tmp_path}/hot", f"{tmp_path}/cold"
    os.makedirs(hot)
    os.makedirs(cold)
    try:
        load_config(hot=hot, cold=cold, keep_newest=0, delete_after="60d", env={})
    except ConfigError as exc:
        assert "keep_newest" in str(exc)
    else:
        raise AssertionError("keep_newest=0 with delete_after was accepted")
    assert load_config(hot=hot, cold=cold, keep_newest=0, env={}).keep_newest == 0


def test_a_deletion_cut_short_after_its_rename_is_finished_but_never_takes_foreign_files(tmp_path):
    """A crash after a deletion renamed the checkpoint aside: the next pass finishes it from
    the journal; if a file that is not the checkpoint's is in the renamed directory, it is put
    back instead, with that file."""
    from bytecheckpoint.manage.deletion import recover_deletions
    from bytecheckpoint.manage.journal import Journal

    hot, cold = f"{tmp_path}/hot", f"{tmp_path}/cold"
    _run(f"{hot}/run", range(1, 4))
    os.makedirs(cold)
    journal = Journal(cold)
    for step, extra in ((1, None), (2, "NOTES.txt")):
        path = f"{hot}/run/step_{step}"
        trash = f"{hot}/run/.step_{step}.deleting-00000000000{step}"
        journal.append(f"00000000000{step}", "delete", "begin", checkpoint=path, trash=trash, cold_dir=None)
        os.rename(path, trash)  # the crash comes here
        if extra:
            Path(f"{trash}/{extra}").write_text("mine")
    assert recover_deletions(hot, cold, journal) == 2
    assert sorted(os.listdir(f"{hot}/run")) == ["latest", "step_2", "step_3"]
    assert Path(f"{hot}/run/step_2/NOTES.txt").read_text() == "mine"
    _loads_as(f"{hot}/run/step_2", 2)


def test_journal_lines_that_are_not_records_are_skipped(tmp_path):
    """A journal line that is JSON but not one of our records (a list, a string, no id, a
    numeric id) was a KeyError or a TypeError in every later pass."""
    from bytecheckpoint.manage.journal import Journal

    journal = Journal(str(tmp_path))
    journal.append("aaaaaaaaaaaa", "delete", "begin", trash="x")
    with open(journal.path, "ab") as f:
        f.write(b'[1,2]\n"text"\n{"op":"delete","state":"begin"}\n{"id":5,"state":"begin"}\n{"id":"b\n')
    assert [r["id"] for r in journal.unfinished()] == ["aaaaaaaaaaaa"]
