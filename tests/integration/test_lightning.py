"""PyTorch Lightning through ``BytecheckpointIO``: a 2-rank DDP run saves, a 1-device Trainer
resumes with ``ckpt_path="last"`` bit-exactly; bad paths and values get named errors."""

from __future__ import annotations

import collections
import os
import shutil

import pytest
import torch
from torch import nn

pytest.importorskip("lightning")

import bytecheckpoint as bcp  # noqa: E402
from bytecheckpoint.errors import (  # noqa: E402
    CorruptCheckpointError,
    InvalidArgumentError,
    NotACheckpointError,
    UnsupportedStateError,
)
from bytecheckpoint.integrations.lightning import BytecheckpointIO  # noqa: E402
from tests.integration.frameworks_support import assert_same, run_job  # noqa: E402


def test_ddp_save_resume_on_one_device_is_bit_exact(tmp_path: os.PathLike) -> None:
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    log = run_job("lightning_job", "ddp", str(ckpt), str(out / "ddp.pt"), "4")
    assert "unreadable latest pointer" not in log  # Lightning's names ("epoch=0-step=4.ckpt") are fine
    assert bcp.verify(str(ckpt / "last.ckpt")) == []
    shutil.copytree(ckpt, tmp_path / "ckpt_ddp")  # for the resume on 2 ranks below
    run_job("lightning_job", "resume", str(ckpt), str(out / "resume.pt"), "8")
    run_job("lightning_job", "full", str(tmp_path / "unused"), str(out / "full.pt"), "8")
    ddp, resumed, full = (torch.load(out / f"{m}.pt", weights_only=False) for m in ("ddp", "resume", "full"))
    # What the 1-device Trainer restored is what the 2-rank run held when it saved.
    assert resumed["restored"]["global_step"] == 4
    assert_same(resumed["restored"]["model"], ddp["model"], "restored model")
    assert_same(resumed["restored"]["optim"], ddp["optim"], "restored optimizer")
    # ... and it goes on as the uninterrupted run: same losses, same final state.
    assert_same(ddp["losses"], full["losses"][:4], "losses before the save")
    assert_same(resumed["losses"], full["losses"][4:], "losses after the resume")
    assert_same(resumed["model"], full["model"], "final model")
    assert_same(resumed["optim"], full["optim"], "final optimizer")
    # save_top_k=1: the resumed run removed the older checkpoint through the plugin
    assert sorted(p.name for p in ckpt.iterdir()) == ["epoch=1-step=8.ckpt", "last.ckpt", "latest"]
    # Resumed on 2 DDP ranks, each loading the checkpoint on its own: the same run again.
    run_job("lightning_job", "resume_ddp", str(tmp_path / "ckpt_ddp"), str(out / "resume_ddp.pt"), "8")
    resumed_ddp = torch.load(out / "resume_ddp.pt", weights_only=False)
    assert_same(resumed_ddp["losses"], full["losses"][4:], "losses after the resume on 2 ranks")
    assert_same(resumed_ddp["model"], full["model"], "final model, 2 ranks")


def _checkpoint() -> dict:
    g = torch.Generator().manual_seed(3)
    return {
        "epoch": 2, "global_step": 7, "pytorch-lightning_version": "2.6.6",
        "state_dict": collections.OrderedDict(
            [("net.0.weight", torch.randn(4, 3, generator=g)),
             ("net.0.bias", torch.randn(4, generator=g).to(torch.bfloat16)),
             ("empty", torch.zeros(0, 2))]),
        "optimizer_states": [{"state": {0: {"step": torch.tensor(7.0),
                                            "exp_avg": torch.randn(4, 3, generator=g)}},
                              "param_groups": [{"lr": 0.1, "betas": (0.9, 0.999), "params": [0]}]}],
        "lr_schedulers": [{"last_epoch": 7, "_last_lr": [0.1]}],
        "loops": {"fit_loop": {"a.b": torch.arange(3), "a": {"b": torch.arange(4)}}},
        "hparams": {"name": "tiny", "sizes": (1, 2), "none": None},
    }


@pytest.mark.parametrize("async_save", [False, True])
def test_checkpoint_dict_round_trips_exactly(tmp_path: os.PathLike, async_save: bool) -> None:
    io = BytecheckpointIO(async_save=async_save)
    saved = _checkpoint()
    io.save_checkpoint(saved, tmp_path / "epoch=2-step=7.ckpt")
    io.teardown()
    loaded = io.load_checkpoint(tmp_path / "epoch=2-step=7.ckpt")
    assert_same(loaded, _checkpoint())
    # the root's latest pointer names it, so the root loads too
    assert_same(io.load_checkpoint(tmp_path), _checkpoint())
    # overwriting last.ckpt (Lightning saves it again at every save)
    io.save_checkpoint(saved, tmp_path / "last.ckpt")
    saved["global_step"] = 8
    io.save_checkpoint(saved, tmp_path / "last.ckpt")
    assert io.load_checkpoint(tmp_path / "last.ckpt")["global_step"] == 8


def test_bad_paths_and_values_get_named_errors(tmp_path: os.PathLike) -> None:
    io = BytecheckpointIO()
    torch_file = tmp_path / "old.ckpt"
    torch_file.write_bytes(b"PK\x03\x04 a torch.save zip")
    with pytest.raises(NotACheckpointError, match="TorchCheckpointIO"):
        io.load_checkpoint(torch_file)
    with pytest.raises(NotACheckpointError):
        io.load_checkpoint(tmp_path / "missing.ckpt")
    # a bytecheckpoint checkpoint that no trainer saved
    bcp.save(str(tmp_path / "plain"), {"model": nn.Linear(2, 2)})
    with pytest.raises(NotACheckpointError, match="bcp.load"):
        io.load_checkpoint(tmp_path / "plain")
    # a directory that is not a checkpoint is never removed
    mine = tmp_path / "mine.ckpt"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    with pytest.raises(NotACheckpointError, match="refusing to remove"):
        io.remove_checkpoint(mine)
    assert (mine / "notes.txt").read_text() == "keep"
    io.remove_checkpoint(torch_file)  # a file an earlier run wrote without the plugin: Lightning's to remove
    assert not torch_file.exists()
    with pytest.raises(InvalidArgumentError, match="storage_options"):
        io.save_checkpoint(_checkpoint(), tmp_path / "x.ckpt", storage_options={"a": 1})
    with pytest.raises(InvalidArgumentError, match="map_location"):
        io.load_checkpoint(tmp_path / "plain", map_location=3.5)
    with pytest.raises(UnsupportedStateError, match="cannot store a value of type"):
        io.save_checkpoint({"hparams": {"opt": object()}}, tmp_path / "y.ckpt")
    assert not (tmp_path / "y.ckpt" / "metadata.msgpack").exists()


def test_hostile_placeholder_is_refused(tmp_path: os.PathLike) -> None:
    bcp.save(str(tmp_path / "bad"), {"tree": {"w": ("__bcp_tensor__", "w", "float32", [10**12])}})
    with pytest.raises(CorruptCheckpointError, match="placeholder"):
        BytecheckpointIO().load_checkpoint(tmp_path / "bad")


def test_remove_checkpoint_keeps_pinned_ones_and_works_on_any_storage(tmp_path: os.PathLike) -> None:
    """save_top_k removes through the library's deletion: a pin is honoured (kept, with a
    warning, training goes on), and a checkpoint on an object store by URL is removed too."""
    from bytecheckpoint.commit.leases import pin

    io = BytecheckpointIO()
    for name in ("a.ckpt", "b.ckpt"):
        io.save_checkpoint(_checkpoint(), tmp_path / name)
    io.remove_checkpoint(tmp_path / "a.ckpt")
    assert not (tmp_path / "a.ckpt").exists()
    pin(str(tmp_path / "b.ckpt"), reason="the best one")
    with pytest.warns(RuntimeWarning, match="kept: .*pinned"):
        io.remove_checkpoint(tmp_path / "b.ckpt")
    assert io.load_checkpoint(tmp_path / "b.ckpt")["global_step"] == 7
    io.remove_checkpoint(tmp_path / "never-saved.ckpt")  # nothing there: nothing to do
    url = f"mem://lightning-{os.getpid()}/run/c.ckpt"
    io.save_checkpoint(_checkpoint(), url)
    assert io.load_checkpoint(url)["global_step"] == 7
    io.remove_checkpoint(url)
    with pytest.raises(NotACheckpointError):
        io.load_checkpoint(url)
