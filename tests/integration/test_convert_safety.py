"""``bcp convert --to dcp --overwrite`` replaces only a checkpoint: a DST that also holds the
user's own files is refused by name with nothing changed, and a plain overwrite replaces the
old checkpoint by renaming it aside (nothing left beside DST afterwards)."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

import bytecheckpoint as bcp
from bytecheckpoint.errors import CheckpointExistsError, NotACheckpointError
from bytecheckpoint.tools import convert

dcp = pytest.importorskip("torch.distributed.checkpoint")


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Linear(2, 2)


def _listing(root) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)


@pytest.fixture
def src(tmp_path):
    path = str(tmp_path / "src")
    bcp.save(path, {"model": _model(1)}, framework="single")
    return path


def _dcp_dst(tmp_path) -> str:
    dst = str(tmp_path / "dst")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": _model(0).state_dict()}, checkpoint_id=dst, no_dist=True)
    return dst


def _load_dcp(dst: str) -> dict[str, torch.Tensor]:
    out = {"model": {k: torch.zeros_like(v) for k, v in _model(0).state_dict().items()}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(out, checkpoint_id=dst, no_dist=True)
    return out["model"]


def test_overwrite_keeps_user_files_of_a_dcp_dst(tmp_path, src):
    dst = _dcp_dst(tmp_path)
    os.makedirs(os.path.join(dst, "eval_results"))
    with open(os.path.join(dst, "eval_results", "scores.json"), "w") as f:
        f.write("{}")
    with open(os.path.join(dst, "NOTES.md"), "w") as f:
        f.write("do not lose")
    before = _listing(dst)
    with pytest.raises(NotACheckpointError, match=r"'NOTES.md', 'eval_results'.*Move those out"):
        convert.to_dcp(src, dst, max_memory=1 << 20, overwrite=True)
    assert _listing(dst) == before
    assert open(os.path.join(dst, "NOTES.md")).read() == "do not lose"
    assert sorted(set(os.listdir(tmp_path)) - {"latest"}) == ["dst", "src"]  # no leftover temporary directory


def test_overwrite_keeps_user_files_of_a_bcp_dst(tmp_path, src):
    dst = str(tmp_path / "dst")
    bcp.save(dst, {"model": _model(0)}, framework="single")
    with open(os.path.join(dst, "NOTES.md"), "w") as f:
        f.write("do not lose")
    with pytest.raises(NotACheckpointError, match="NOTES.md"):
        convert.to_dcp(src, dst, max_memory=1 << 20, overwrite=True)
    assert open(os.path.join(dst, "NOTES.md")).read() == "do not lose"


def test_plain_overwrite_replaces_a_dcp_checkpoint(tmp_path, src):
    dst = _dcp_dst(tmp_path)
    with pytest.raises(CheckpointExistsError):
        convert.to_dcp(src, dst, max_memory=1 << 20)
    assert torch.equal(_load_dcp(dst)["weight"], _model(0).weight)
    convert.to_dcp(src, dst, max_memory=1 << 20, overwrite=True)
    assert torch.equal(_load_dcp(dst)["weight"], _model(1).weight)
    # the old one was renamed aside, then deleted
    assert sorted(set(os.listdir(tmp_path)) - {"latest"}) == ["dst", "src"]


def test_plain_overwrite_replaces_a_bcp_checkpoint(tmp_path, src):
    dst = str(tmp_path / "dst")
    bcp.save(dst, {"model": _model(0)}, framework="single")
    convert.to_dcp(src, dst, max_memory=1 << 20, overwrite=True)
    assert torch.equal(_load_dcp(dst)["weight"], _model(1).weight)


def test_overwrite_swaps_in_one_step_where_it_can(tmp_path, src, monkeypatch):
    """DST is never without a checkpoint: the old and the new one are exchanged in one
    ``renameat2`` (no rename aside that a crash could leave DST missing after); where the file
    system cannot, the two-step rename still replaces it."""
    dst = _dcp_dst(tmp_path)

    def no_two_step(a, b):
        raise AssertionError(f"renamed {a} -> {b}: DST was missing between two renames")

    replace = convert._replace_dir

    def replace_without_renames(*args):  # the swap alone, after DCP wrote the new one
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(convert.os, "rename", no_two_step)
            replace(*args)

    monkeypatch.setattr(convert, "_replace_dir", replace_without_renames)
    convert.to_dcp(src, dst, max_memory=1 << 20, overwrite=True)
    assert torch.equal(_load_dcp(dst)["weight"], _model(1).weight)
    assert sorted(set(os.listdir(tmp_path)) - {"latest"}) == ["dst", "src"]
    monkeypatch.undo()
    monkeypatch.setattr(convert, "exchange", lambda a, b: False)
    convert.to_dcp(str(tmp_path / "src"), dst, max_memory=1 << 20, overwrite=True)
    assert torch.equal(_load_dcp(dst)["weight"], _model(1).weight)
    assert sorted(set(os.listdir(tmp_path)) - {"latest"}) == ["dst", "src"]


def test_exchange_swaps_two_directories_and_refuses_a_null_byte(tmp_path):
    from bytecheckpoint.storage.libc import exchange

    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x").write_text("A")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "x").write_text("B")
    if exchange(str(tmp_path / "a"), str(tmp_path / "b")):
        assert (tmp_path / "a" / "x").read_text() == "B" and (tmp_path / "b" / "x").read_text() == "A"
    with pytest.raises(ValueError, match="null byte"):  # the C string would name another path
        exchange(f"{tmp_path}/a\0/b", str(tmp_path / "b"))
    with pytest.raises(FileNotFoundError):
        exchange(str(tmp_path / "a"), str(tmp_path / "missing"))
