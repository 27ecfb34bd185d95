"""Review of the in-memory backends (``mem://``, ``shm://``): nothing written or deleted outside
the shared-memory root, a bad ``BCP_SHM_DIR`` refused by name, and a ``mem://`` save that
separate rank processes cannot share refused instead of committing a checkpoint no one can load.

``BCP_SHM_DIR`` points into ``tmp_path`` here: the backend's path handling is the same on any
directory, and nothing is left in ``/dev/shm``.
"""

from __future__ import annotations

import os
import uuid

import pytest
import torch

import bytecheckpoint as bcp
from bytecheckpoint.errors import InvalidStorageURLError
from bytecheckpoint.storage import open_storage


@pytest.fixture
def shm_root(tmp_path, monkeypatch):
    root = tmp_path / "shm"
    root.mkdir()
    monkeypatch.setenv("BCP_SHM_DIR", str(root))
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim").write_bytes(b"precious")
    return root, outside


def test_shm_symlinks_inside_the_root_never_lead_outside_it(shm_root):
    root, outside = shm_root
    storage, _ = open_storage("shm://x")  # opened before the links are planted
    os.symlink(outside, root / "evil")
    (root / "run").mkdir()
    os.symlink(outside / "victim", root / "run" / "x")

    with pytest.raises(InvalidStorageURLError, match="symbolic link"):
        bcp.save("shm://evil/ckpt", {"w": torch.ones(2)})
    with pytest.raises(InvalidStorageURLError, match="symbolic link"):
        storage.write_bytes("run/x", b"pwned")
    with pytest.raises(InvalidStorageURLError, match="symbolic link"):
        storage.delete("evil/victim")
    assert sorted(os.listdir(outside)) == ["victim"] and (outside / "victim").read_bytes() == b"precious"

    storage.delete("evil")  # the link itself goes, never what it names
    assert not os.path.lexists(root / "evil") and (outside / "victim").read_bytes() == b"precious"
    with pytest.raises(InvalidStorageURLError, match="outside the shared-memory root"):
        bcp.save("shm://a/../../outside/ckpt", {"w": torch.ones(2)})


def test_a_save_never_writes_through_a_lock_file_link(shm_root):
    root, outside = shm_root
    (root / "run").mkdir()
    os.symlink(outside / "victim", root / "run" / ".ck.lock")
    with pytest.raises(bcp.CheckpointError, match="symbolic link, not a save lock"):
        bcp.save("shm://run/ck", {"w": torch.ones(2)})
    assert (outside / "victim").read_bytes() == b"precious"
    assert not (root / "run" / "ck").exists()


@pytest.mark.parametrize("kind", ["file", "under_a_file", "relative"])
def test_a_bad_shm_dir_is_refused_by_name(tmp_path, monkeypatch, kind):
    (tmp_path / "f").write_bytes(b"x")
    value = {"file": str(tmp_path / "f"), "under_a_file": str(tmp_path / "f" / "sub"),
             "relative": f"bcp-relative-{uuid.uuid4().hex[:8]}"}[kind]
    monkeypatch.setenv("BCP_SHM_DIR", value)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InvalidStorageURLError, match="BCP_SHM_DIR"):
        bcp.save("shm://run/s1", {"w": torch.ones(2)})
    with pytest.raises(InvalidStorageURLError, match="BCP_SHM_DIR"):
        bcp.load("shm://run/s1", {"w": torch.zeros(2)})
    assert sorted(os.listdir(tmp_path)) == ["f"] and (tmp_path / "f").read_bytes() == b"x"


def test_a_missing_mem_checkpoint_says_mem_is_per_process():
    with pytest.raises(bcp.NotACheckpointError, match="shm://"):
        bcp.load(f"mem://review-{uuid.uuid4().hex[:8]}/run", {"w": torch.zeros(2)})


def test_mem_paths_name_the_same_checkpoint_however_spelled():
    run = f"review-{uuid.uuid4().hex[:8]}"
    bcp.save(f"mem://{run}//step_1", {"w": torch.full((3,), 7.0)}, step=1)
    for url in (f"mem://{run}", f"mem://{run}/step_1", f"mem://{run}/x/../step_1", f"mem:///{run}/./step_1"):
        got = {"w": torch.zeros(3)}
        bcp.load(url, got)  # latest, written in the run's root, names the checkpoint it saved
        assert got["w"].tolist() == [7.0] * 3, url
    storage, _ = open_storage("mem://x")
    storage.delete(run)
    assert storage.list_dir(run) == []


def save_to_mem_on_every_rank(url: str) -> str:
    import torch.distributed as dist

    rank = dist.get_rank()
    try:
        bcp.save(url, {"w": {f"t{rank}": torch.full((4,), float(rank))}}, step=1)
    except bcp.CheckpointError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "saved"


def test_a_mem_save_across_rank_processes_is_refused(world):
    url = f"mem://review-{uuid.uuid4().hex[:8]}/run/step_1"
    for outcome in world(2).run(save_to_mem_on_every_rank, url):
        assert "in-memory storage of one process" in outcome, outcome
