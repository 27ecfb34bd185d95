"""Review of ``shm://`` against another local user or a stale link: a directory swapped for a
symbolic link after the path was checked is never followed out of the root, and a root that
someone else owns or may write to is refused by name (a missing one is created 0700), and a
save to a name that reads as another save's leftover is refused.

``BCP_SHM_DIR`` points into ``tmp_path``: the handling is the same on any directory.
"""

from __future__ import annotations

import os
import shutil
import stat
import time

import pytest
import torch

import bytecheckpoint as bcp
from bytecheckpoint.commit import protocol, save_lock
from bytecheckpoint.errors import InvalidStorageURLError
from bytecheckpoint.storage import open_storage
from bytecheckpoint.storage.shm import SharedMemoryStorage


def test_a_directory_swapped_for_a_link_after_the_check_is_not_followed(tmp_path, monkeypatch):
    root, outside = tmp_path / "shm", tmp_path / "outside"
    (root / "run").mkdir(parents=True)
    (outside / "sub").mkdir(parents=True)
    (outside / "x").write_bytes(b"secret")
    (outside / "sub" / "f").write_bytes(b"f")
    monkeypatch.setenv("BCP_SHM_DIR", str(root))
    storage = SharedMemoryStorage()
    storage.check_path("run/x")
    checked = SharedMemoryStorage._os_path

    def then_swapped(self, path, **kw):  # the other side wins the race after every check
        full = checked(self, path, **kw)
        run = root / "run"
        if not run.is_symlink():
            shutil.rmtree(run)
            os.symlink(outside, run)
        return full

    monkeypatch.setattr(SharedMemoryStorage, "_os_path", then_swapped)

    def unswap() -> None:
        if (root / "run").is_symlink():
            os.unlink(root / "run")
            (root / "run").mkdir()
        (root / "run" / "x").write_bytes(b"mine!!")

    for name, act in [
        ("write", lambda: storage.write_bytes("run/x", b"pwned")),
        ("read", lambda: storage.read_into("run/x", 0, memoryview(bytearray(6)))),
        ("read_many", lambda: storage.read_into_many("run/x", 0, [memoryview(bytearray(6))])),
        ("delete", lambda: storage.delete("run/sub")),
        ("rename", lambda: storage.rename("run/x", "run/sub/moved")),
        ("makedirs", lambda: storage.makedirs("run/newdir")),
    ]:
        unswap()
        with pytest.raises(InvalidStorageURLError, match="symbolic link"):
            act()
        assert (outside / "x").read_bytes() == b"secret", name
        assert sorted(os.listdir(outside)) == ["sub", "x"], name
        assert os.listdir(outside / "sub") == ["f"], name


def test_a_file_is_never_written_through_a_link_at_its_name(tmp_path, monkeypatch):
    root = tmp_path / "shm"
    (root / "run").mkdir(parents=True)
    (root / "run" / "target").write_bytes(b"kept")
    os.symlink(root / "run" / "target", root / "run" / "x")
    monkeypatch.setenv("BCP_SHM_DIR", str(root))
    storage, _ = open_storage("shm://run/x")
    with pytest.raises(InvalidStorageURLError, match="symbolic link"):
        storage.write_bytes("run/x", b"new")
    assert (root / "run" / "target").read_bytes() == b"kept"
    assert bytes(storage.read("run/x")) == b"kept"  # reading through one inside the root is fine


def test_the_root_is_created_private(tmp_path, monkeypatch):
    monkeypatch.setenv("BCP_SHM_DIR", str(tmp_path / "fresh"))
    storage, path = open_storage("shm://run/f")
    assert stat.S_IMODE(os.stat(tmp_path / "fresh").st_mode) & 0o077 == 0
    storage.makedirs("run")
    storage.write_bytes(path, b"abc")
    assert bytes(storage.read(path)) == b"abc"


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o757])
def test_a_root_others_may_write_to_is_refused(tmp_path, monkeypatch, mode):
    root = tmp_path / "shm"
    root.mkdir()
    os.chmod(root, mode)
    monkeypatch.setenv("BCP_SHM_DIR", str(root))
    with pytest.raises(InvalidStorageURLError, match="writable by group or others.*chmod go-w"):
        open_storage("shm://run/ck")
    os.chmod(root, mode | stat.S_ISVTX)  # sticky, as /dev/shm itself: no one removes our entries
    open_storage("shm://run/ck")


@pytest.mark.skipif(os.geteuid() != 0, reason="handing a directory to another user needs root")
def test_a_root_another_user_owns_is_refused(tmp_path, monkeypatch):
    root = tmp_path / "shm"
    root.mkdir(mode=0o700)
    os.chown(root, 4242, 4242)
    monkeypatch.setenv("BCP_SHM_DIR", str(root))
    with pytest.raises(InvalidStorageURLError, match="belongs to uid 4242.*BCP_SHM_DIR"):
        open_storage("shm://run/ck")
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    link = tmp_path / "link"
    os.symlink(mine, link)
    os.lchown(link, 4242, 4242)  # someone else's link chooses where checkpoints go
    monkeypatch.setenv("BCP_SHM_DIR", str(link))
    with pytest.raises(InvalidStorageURLError, match="belongs to uid 4242"):
        open_storage("shm://run/ck")
    assert os.listdir(mine) == []


@pytest.mark.parametrize("name", ["a.staging-b", "a.replaced-b"])
def test_a_save_to_a_name_that_reads_as_another_saves_leftover_is_refused(tmp_path, monkeypatch, name):
    # Its lock (".a.staging-b.lock") reads as a leftover of a save to "a", which would delete it
    # under a live save (letting a second one in), or the checkpoint it moved aside.
    monkeypatch.setenv("BCP_SHM_DIR", str(tmp_path / "shm"))
    with pytest.raises(bcp.NotACheckpointError, match="choose a name without it"):
        bcp.save(f"shm://run/{name}", {"w": torch.ones(2)})
    assert not (tmp_path / "shm" / "run").exists() or os.listdir(tmp_path / "shm" / "run") == []
    bcp.save("shm://run/a", {"w": torch.ones(2)})  # the plain name saves as before


# -- the save lock and the latest pointer's temporaries: the same footing -----------------------


def _swap(root, outside) -> None:
    """``root/run`` becomes a link to ``outside`` (the real one moves to ``run.real``)."""
    if not (root / "run").is_symlink():
        os.rename(root / "run", root / "run.real")
        os.symlink(outside, root / "run")


@pytest.fixture
def swap_dirs(tmp_path, monkeypatch):
    root, outside = tmp_path / "shm", tmp_path / "outside"
    (root / "run").mkdir(parents=True)
    outside.mkdir()
    monkeypatch.setenv("BCP_SHM_DIR", str(root))
    storage = SharedMemoryStorage()
    storage.check_path("run/ck")
    return storage, root, outside


def test_the_save_lock_is_never_taken_through_a_swapped_directory(swap_dirs, monkeypatch):
    storage, root, outside = swap_dirs
    (outside / ".ck.lock").write_bytes(b"someone's file")
    opening = save_lock._open_lock_file

    def swapped_first(*args):  # the other side wins the race: after every check, before the open
        _swap(root, outside)
        return opening(*args)

    monkeypatch.setattr(save_lock, "_open_lock_file", swapped_first)
    lock = save_lock.acquire(storage, "run/ck", "s1")
    assert (outside / ".ck.lock").read_bytes() == b"someone's file"  # not truncated, not locked
    assert os.listdir(outside) == [".ck.lock"]
    assert os.listdir(root / "run.real") == [".ck.lock"]  # taken in the directory it checked
    lock.release()
    assert os.listdir(root / "run.real") == []


def test_the_save_lock_is_released_where_it_was_taken(swap_dirs, monkeypatch):
    storage, root, outside = swap_dirs
    lock = save_lock.acquire(storage, "run/ck", "s1")
    os.rename(root / "run", root / "run.real")  # swapped while the lock is held
    os.symlink(outside, root / "run")
    (outside / ".ck.lock").write_bytes(b"someone's file")
    lock.release()
    assert (outside / ".ck.lock").read_bytes() == b"someone's file"
    assert os.listdir(root / "run.real") == []  # its own lock file went


def test_latest_pointer_temporaries_are_never_cleared_through_a_swapped_directory(swap_dirs, monkeypatch):
    storage, root, outside = swap_dirs
    stale = outside / ".latest.tmp-0123456789ab"  # looks like a crashed save's, old enough to go
    stale.write_text("{}")
    old = time.time() - 3600
    os.utime(stale, (old, old))
    listing = os.listdir

    def swapped_first(*args):  # the swap lands between the checks and the listing
        _swap(root, outside)
        return listing(*args)

    monkeypatch.setattr(os, "listdir", swapped_first)
    with pytest.raises(InvalidStorageURLError, match="symbolic link"):  # writing the new pointer
        protocol.update_latest(storage, "run/ck", 5, "s1")
    monkeypatch.undo()
    assert os.listdir(outside) == [stale.name]
