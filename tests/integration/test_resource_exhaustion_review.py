"""Resource exhaustion during saves, gc and tiering (review of 2026-11-28).

A full disk, a read-only one or no usable temporary directory must give the exact result or a
named error; never a raw ``OSError``, a path this process can no longer save to, litter no
pass removes, or a journal record silently lost. Most checks inject the failing system call
(no root needed); the ones that need the kernel's own behaviour mount a small tmpfs or a
read-only bind mount and are skipped where that is not possible.
"""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import bytecheckpoint as bcp
from bytecheckpoint.cli import app as cli
from bytecheckpoint.commit import save_lock
from bytecheckpoint.errors import CheckpointError, StorageIOError
from bytecheckpoint.manage import deletion
from bytecheckpoint.manage.journal import JOURNAL_FILE, Journal
from bytecheckpoint.storage import write_slots


def _state(value: float, n: int = 64) -> dict[str, Any]:
    return {"model": {"w": torch.full((n,), value), "b": torch.arange(4.0) + value}, "extra": {"v": value}}


def _loads_as(path: str, value: float, n: int = 64) -> None:
    target = _state(-1.0, n)
    bcp.load(path, target)
    expected = _state(value, n)
    assert torch.equal(target["model"]["w"], expected["model"]["w"]), path
    assert torch.equal(target["model"]["b"], expected["model"]["b"]), path
    assert target["extra"]["v"] == value, path


def _enospc(*_: Any, **__: Any) -> Any:
    raise OSError(errno.ENOSPC, "No space left on device")


def _failing_for(suffix: str, real: Callable[..., int]) -> Callable[..., int]:
    """``os.write`` into files whose name ends in ``suffix`` as a nearly full disk does it: the
    first call writes half and returns short, every later one fails with ENOSPC; ``real``
    elsewhere."""
    calls = {"n": 0}

    def write(fd: int, data: Any) -> int:
        try:
            name = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            name = ""
        if not name.endswith(suffix):
            return real(fd, data)
        calls["n"] += 1
        if calls["n"] == 1:
            return real(fd, memoryview(data)[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    return write


# -- the save lock on a full disk --------------------------------------------------------------

def test_a_lock_record_that_hits_a_full_disk_neither_fails_raw_nor_blocks_later_saves(tmp_path, monkeypatch):
    """Writing the owner record into ``.<name>.lock`` failed with ENOSPC: the save raised a raw
    OSError and kept the lock's descriptor, so every later save of this process to that path
    got ConcurrentSaveError ("owner unknown") until it exited. The flock is the lock: the save
    now goes on without the record."""
    root = tmp_path / "run"
    bcp.save(f"{root}/step1", _state(1.0), step=1)
    with monkeypatch.context() as m:
        m.setattr(save_lock.os, "pwrite", _enospc)
        try:
            bcp.save(f"{root}/step2", _state(2.0), step=2)
        except CheckpointError:
            pass  # a named error is allowed too; a raw OSError is not
    bcp.save(f"{root}/step2", _state(3.0), step=2, overwrite=os.path.isdir(root / "step2"))
    _loads_as(f"{root}/step2", 3.0)
    _loads_as(f"{root}/step1", 1.0)
    _loads_as(str(root), 3.0)
    assert not [n for n in os.listdir(root) if n.endswith(".lock")]


def test_gc_deletes_when_the_lock_record_cannot_be_written(tmp_path, monkeypatch, capsys):
    """On a full disk `bcp gc` refused every checkpoint with "a save, deletion or repair holds
    its path" (a lie: its own lock record had failed), so the tool that frees space freed none."""
    root = tmp_path / "run"
    for s in (1, 2, 3):
        bcp.save(f"{root}/step{s}", _state(float(s)), step=s)
    with monkeypatch.context() as m:
        m.setattr(save_lock.os, "pwrite", _enospc)
        code = cli.main(["gc", str(tmp_path), "--keep-last", "1", "--yes", "-q"])
    out, err = capsys.readouterr()
    assert code == 0, out + err
    assert sorted(n for n in os.listdir(root) if not n.startswith(".")) == ["latest", "step3"]
    _loads_as(str(root), 3.0)


def test_a_deletion_record_cut_short_by_a_full_disk_is_not_left_behind(tmp_path, monkeypatch, capsys):
    """`bcp gc` writes ``.<name>.deleting-<id>.record`` before renaming the checkpoint aside. A
    nearly full disk wrote half of it: the short write passed as a whole one and the deletion
    went on with a record no recovery could read (had it failed instead, the record was left,
    proving nothing, and no later pass removed it). Now the record is removed, and the
    checkpoint deleted in place (a full disk is when gc must free space)."""
    root = tmp_path / "run"
    for s in (1, 2):
        bcp.save(f"{root}/step{s}", _state(float(s)), step=s)
    with monkeypatch.context() as m:
        m.setattr(deletion.os, "write", _failing_for(".record", os.write))
        code = cli.main(["gc", str(tmp_path), "--keep-last", "1", "--yes", "-q"])
    out, err = capsys.readouterr()
    assert code == 0, out + err
    assert sorted(os.listdir(root)) == ["latest", "step2"]  # deleted, and nothing beside
    _loads_as(str(root), 2.0)


def test_a_journal_record_cut_short_by_a_full_disk_loses_no_later_record(tmp_path, monkeypatch):
    """A nearly full cold tier wrote part of a journal line and then failed (or, on a short
    write, returned as if it had written it all): the fragment stayed, and the next record,
    appended to it, was unreadable too (a move's ``begin`` or ``done`` silently lost)."""
    journal = Journal(str(tmp_path))
    journal.append("m1", "move", "begin", files=["a"])
    with monkeypatch.context() as m:
        m.setattr(os, "write", _failing_for(JOURNAL_FILE, os.write))
        with pytest.raises(OSError):
            journal.append("m2", "move", "begin", files=["b"])
    journal.append("m1", "move", "done")
    assert [(r["id"], r["state"]) for r in journal.records()] == [("m1", "begin"), ("m1", "done")]


# -- no usable temporary directory ---------------------------------------------------------------

def test_a_large_save_with_no_usable_temporary_directory_writes_without_a_slot(tmp_path, monkeypatch):
    """The host write slots live in the temporary directory. When Python finds none usable
    (/tmp full, or no descriptors left) ``tempfile.gettempdir`` raises FileNotFoundError, and a
    save of any file over 8 MiB failed with it, raw, though slots are only a courtesy."""
    monkeypatch.delenv(write_slots.SLOTS_DIR_ENV, raising=False)

    def no_temp_dir() -> str:
        raise FileNotFoundError(errno.ENOENT, "No usable temporary directory found")

    monkeypatch.setattr(write_slots.tempfile, "gettempdir", no_temp_dir)
    n = (9 << 20) // 4
    bcp.save(f"{tmp_path}/run/step1", _state(5.0, n), step=1)
    monkeypatch.undo()
    _loads_as(f"{tmp_path}/run/step1", 5.0, n)


# -- the kernel's own behaviour (root: tmpfs and bind mounts) ------------------------------------

def _mount(args: list[str], target: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("mounting a file system needs root")
    target.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(["mount", *args, str(target)], capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount here: {proc.stderr.strip()}")


def _umount(target: Path) -> None:
    subprocess.run(["umount", "-l", str(target)], capture_output=True, timeout=30)


@pytest.fixture
def small_tmpfs(tmp_path) -> Iterator[Path]:
    mnt = tmp_path / "tmpfs"
    _mount(["-t", "tmpfs", "-o", "size=4m", "tmpfs"], mnt)
    try:
        yield mnt
    finally:
        _umount(mnt)


def _fill(mnt: Path, leave: int) -> Path:
    st = os.statvfs(mnt)
    filler = mnt / "filler"
    with open(filler, "wb") as f:
        try:
            f.write(b"\0" * max(0, st.f_bavail * st.f_frsize - leave))
        except OSError:
            pass
    return filler


@pytest.mark.parametrize("async_save", [False, True])
def test_a_save_into_a_full_tmpfs_fails_by_name_and_the_next_one_succeeds(small_tmpfs, async_save):
    """Full to the last page: the lock record is the first write (it gave a raw OSError and
    blocked the path). Half full: the data write fails with a named ENOSPC. Either way the
    last committed checkpoint loads exactly and, once space is freed, saving again works."""
    root = small_tmpfs / "run"
    n = 20_000
    bcp.save(f"{root}/step1", _state(1.0, n), step=1)
    for leave in (0, 40_960):
        filler = _fill(small_tmpfs, leave)
        with pytest.raises(CheckpointError, match="ENOSPC") as info:
            result = bcp.save(f"{root}/step2", _state(2.0, n), step=2, async_save=async_save)
            if async_save:
                result.wait()
        assert "full" in str(info.value)
        _loads_as(str(root), 1.0, n)
        assert sorted(os.listdir(root)) == ["latest", "step1"], leave
        filler.unlink()
    result = bcp.save(f"{root}/step2", _state(2.0, n), step=2, async_save=async_save)
    if async_save:
        result.wait()
    _loads_as(str(root), 2.0, n)
    _loads_as(f"{root}/step1", 1.0, n)


def test_gc_on_a_disk_with_no_byte_free_deletes_what_the_policy_says(small_tmpfs, capsys):
    """Deleting needs no space, but gc first wrote a deletion record beside each checkpoint: on
    a full disk that failed, every checkpoint was kept ("FAILED ... No space left") and the disk
    stayed full. Now one whose record cannot be written is deleted in place, metadata first."""
    root = small_tmpfs / "run"
    for s in (1, 2, 3):
        bcp.save(f"{root}/step{s}", _state(float(s), 20_000), step=s)
    filler = _fill(small_tmpfs, 0)
    assert os.statvfs(small_tmpfs).f_bavail == 0
    code = cli.main(["gc", str(small_tmpfs), "--keep-last", "1", "--yes", "-q"])
    out, err = capsys.readouterr()
    assert code == 0 and "FAILED" not in out, out + err
    assert sorted(os.listdir(root)) == ["latest", "step3"]  # no record, no trash left
    _loads_as(str(root), 3.0, 20_000)
    assert os.statvfs(small_tmpfs).f_bavail > 0
    filler.unlink()


@pytest.mark.parametrize("async_save", [False, True])
def test_a_manager_save_on_a_full_disk_names_the_room_retention_needs_and_can_be_retried(small_tmpfs,
                                                                                        async_save):
    """The error said only "the device is full", though retention keeps its checkpoints beside
    each new one; and after an async save failed, saving the same step again was refused as
    "not after step N, the last one saved" (it never was)."""
    root = str(small_tmpfs / "run")
    n = 20_000
    with bcp.CheckpointManager(root, retention=bcp.KeepLast(2), async_save=async_save) as mgr:
        for s in (1, 2, 3):
            mgr.save(s, _state(float(s), n), force=True)
        mgr.wait()
        filler = _fill(small_tmpfs, 0)
        with pytest.raises(StorageIOError, match="step 4 was not saved") as info:
            mgr.save(4, _state(4.0, n), force=True)
            mgr.wait()
        assert info.value.errno == errno.ENOSPC
        assert "KeepLast(k=2) keeps 2 checkpoint(s)" in str(info.value)
        assert "room for one checkpoint more than retention keeps" in str(info.value)
        assert sorted(os.listdir(root)) == ["latest", "step_2", "step_3"]
        _loads_as(root, 3.0, n)
        filler.unlink()
        assert mgr.save(4, _state(4.0, n), force=True)  # the same step, once there is room
    assert sorted(os.listdir(root)) == ["latest", "step_3", "step_4"]
    _loads_as(root, 4.0, n)


def test_keeping_fewer_on_a_full_disk_frees_the_room_at_the_failed_save(small_tmpfs):
    """The advice is to keep fewer; but retention ran only after a save committed, which the
    full disk never let happen. Now the failed save applies the (new) policy first."""
    root = str(small_tmpfs / "run")
    n = 20_000
    with bcp.CheckpointManager(root, retention=bcp.KeepLast(3), async_save=False) as mgr:
        for s in (1, 2, 3):
            mgr.save(s, _state(float(s), n), force=True)
    _fill(small_tmpfs, 0)
    with bcp.CheckpointManager(root, retention=bcp.KeepLast(1), async_save=False) as mgr:
        assert mgr.restore(_state(0.0, n)) == 3
        with pytest.raises(StorageIOError, match="after deleting 2 now"):
            mgr.save(4, _state(4.0, n), force=True)
        assert mgr.save(4, _state(4.0, n), force=True)
    assert sorted(os.listdir(root)) == ["latest", "step_4"]
    _loads_as(root, 4.0, n)


def test_a_save_or_gc_on_a_read_only_file_system_fails_by_name(tmp_path, capsys):
    """A read-only root gave a raw OSError from the save lock, and `bcp gc` said "a save,
    deletion or repair holds its path" of every checkpoint; now both name EROFS and what to
    do. Loads from it still work."""
    src, ro = tmp_path / "rw", tmp_path / "ro"
    bcp.save(f"{src}/run/step0", _state(0.0), step=0)
    bcp.save(f"{src}/run/step1", _state(1.0), step=1)
    _mount(["--bind", str(src)], ro)
    try:
        proc = subprocess.run(["mount", "-o", "remount,bind,ro", str(ro)], capture_output=True, timeout=30)
        if proc.returncode != 0:
            pytest.skip("cannot remount read-only here")
        for overwrite, name in ((False, "step2"), (True, "step1")):
            with pytest.raises(CheckpointError, match="EROFS") as info:
                bcp.save(f"{ro}/run/{name}", _state(2.0), step=2, overwrite=overwrite)
            assert "read-only" in str(info.value)
        _loads_as(f"{ro}/run", 1.0)
        capsys.readouterr()
        assert cli.main(["gc", str(ro), "--keep-last", "1", "--yes", "-q"]) == 1
        out, err = capsys.readouterr()
        assert "EROFS" in out + err and "holds its path" not in out + err, out + err
        assert sorted(os.listdir(ro / "run")) == ["latest", "step0", "step1"]
    finally:
        _umount(ro)


# -- the latest pointer ------------------------------------------------------------------------

@pytest.mark.parametrize("op", ["commit", "rename"])
def test_a_latest_pointer_that_cannot_be_made_durable_leaves_no_temp_file(tmp_path, op):
    """The new checkpoint is committed, then the pointer's temp file fails its fsync or rename
    (a full disk): the save says so by name, but the ``.latest.tmp-*`` file stayed in the
    root for a whole save lease (300 s) until a later save cleared it."""
    from bytecheckpoint.storage import faults

    root = tmp_path / "run"
    bcp.save(f"{root}/step1", _state(1.0), step=1)
    faults.install(f"errno=ENOSPC;ops={op};path=.latest.tmp-;fail_call=1")
    try:
        with pytest.raises(CheckpointError, match="latest pointer"):
            bcp.save(f"{root}/step2", _state(2.0), step=2)
    finally:
        faults.install(None)
    assert sorted(os.listdir(root)) == ["latest", "step1", "step2"]
    _loads_as(f"{root}/step2", 2.0)
    _loads_as(str(root), 1.0)  # the pointer was not moved, as the error said
    bcp.save(f"{root}/step3", _state(3.0), step=3)
    _loads_as(str(root), 3.0)


# -- reading when descriptors or memory run out ------------------------------------------------

@pytest.mark.parametrize("code", ["EMFILE", "ENOMEM"])
def test_a_header_read_that_runs_out_of_descriptors_is_not_called_corruption(tmp_path, code):
    """A load (and ``bcp verify``) checks each storage file's safetensors header first. Too many
    open files there came out as CorruptCheckpointError ("cannot read its safetensors
    header"), and verify listed the intact file as bad; it is a StorageIOError naming the
    errno, and the same checks pass once descriptors are back."""
    from bytecheckpoint.commit import integrity
    from bytecheckpoint.storage import faults

    url = f"{tmp_path}/run/step1"
    bcp.save(url, _state(1.0), step=1)

    def check_headers() -> None:
        storage, path = integrity.resolve(url)  # opened under the faults installed
        meta = integrity.read_metadata(storage, path)
        integrity.check_file_sizes(storage, path, meta, {f.name for f in meta.files}, headers=True)

    for check in (check_headers, lambda: integrity.verify_files(url)):
        faults.install(f"errno={code};ops=read_into;path=.safetensors;fail_call=1")
        try:
            with pytest.raises(StorageIOError, match=code):
                check()
        finally:
            faults.install(None)
    check_headers()
    assert integrity.verify_files(url)[1] == []
    _loads_as(f"{tmp_path}/run", 1.0)
