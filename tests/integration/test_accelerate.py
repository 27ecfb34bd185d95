"""Hugging Face Accelerate through bytecheckpoint: a 2-process CPU run saves mid-epoch and a
relaunch resumes bit-exactly (model, optimizer, scheduler, RNG, data order, registered
objects); bad input gets named errors."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

pytest.importorskip("accelerate")

from accelerate import Accelerator  # noqa: E402

import bytecheckpoint as bcp  # noqa: E402
from bytecheckpoint.errors import InvalidArgumentError, MissingKeysError, NotACheckpointError  # noqa: E402
from bytecheckpoint.integrations.accelerate import load_state, save_state  # noqa: E402
from tests.integration.frameworks_support import assert_same, run_ranks  # noqa: E402


def test_two_processes_save_and_resume_bit_exactly(tmp_path: os.PathLike) -> None:
    root, out = str(tmp_path / "ckpt"), str(tmp_path)
    run_ranks("accelerate_job", 2, "train", root, out)
    assert sorted(os.listdir(root)) == ["latest", "step_4"]
    assert bcp.verify(os.path.join(root, "step_4")) == []
    run_ranks("accelerate_job", 2, "resume", root, out)
    for rank in (0, 1):
        full = torch.load(f"{out}/train-{rank}.pt", weights_only=False)
        resumed = torch.load(f"{out}/resume-{rank}.pt", weights_only=False)
        where = f"rank {rank}"
        assert_same(resumed["losses"], full["losses"][4:], f"{where} losses after the resume")
        for key in ("model", "optim", "sched", "rng", "step", "acc_step", "seen"):
            assert_same(resumed[key], full[key], f"{where} {key}")


@pytest.fixture
def accelerator() -> Accelerator:
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    return Accelerator(cpu=True)


def test_fresh_start_and_bad_input(tmp_path: os.PathLike, accelerator: Accelerator) -> None:
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = accelerator.prepare(model, opt)
    assert load_state(accelerator, str(tmp_path / "nothing-yet")) is None  # a fresh start
    (tmp_path / "empty").mkdir()
    assert load_state(accelerator, str(tmp_path / "empty")) is None
    save_state(accelerator, str(tmp_path / "ck" / "step_3"), step=3)
    assert load_state(accelerator, str(tmp_path / "ck")) == 3  # a root: its latest checkpoint
    with pytest.raises(InvalidArgumentError, match="Accelerator itself"):
        save_state(model, str(tmp_path / "x"))
    (tmp_path / "file").write_text("not a checkpoint")
    with pytest.raises(NotACheckpointError):
        load_state(accelerator, str(tmp_path / "file"))
    # a second prepared model the checkpoint does not hold: named, not silently skipped
    other = accelerator.prepare(nn.Linear(2, 2))
    with pytest.raises(MissingKeysError, match="model_1"):
        load_state(accelerator, str(tmp_path / "ck"))
    assert other.weight.shape == (2, 2)


def _stateful_run(tmp_path: os.PathLike, resume: bool, seedable: bool = True) -> list[list[int]]:
    """3 batches, a save, then 3 more (or, with ``resume``, a fresh Accelerator that loads the
    save and takes 3): a loader with ``use_stateful_dataloader=True`` resumes mid-epoch."""
    from accelerate.state import AcceleratorState
    from accelerate.utils import DataLoaderConfiguration

    AcceleratorState._reset_state(reset_partial_state=True)
    config = DataLoaderConfiguration(use_stateful_dataloader=True, use_seedable_sampler=seedable)
    acc = Accelerator(cpu=True, dataloader_config=config)
    torch.manual_seed(0)
    loader = acc.prepare(torch.utils.data.DataLoader(list(range(40)), batch_size=4, shuffle=True))
    path = str(tmp_path / "ck" / "step_3")
    if resume:
        assert load_state(acc, path) == 3
        batches = iter(loader)
    else:
        batches = iter(loader)
        for _ in range(3):
            next(batches)
        save_state(acc, path, step=3)
    return [next(batches).tolist() for _ in range(3)]


def test_a_stateful_data_loader_resumes_mid_epoch(tmp_path: os.PathLike) -> None:
    pytest.importorskip("torchdata")
    straight = _stateful_run(tmp_path, resume=False)
    resumed = _stateful_run(tmp_path, resume=True)
    assert resumed == straight  # the batches after the save, not the epoch's first ones


def test_an_unseeded_shuffling_stateful_loader_is_warned_about(tmp_path: os.PathLike) -> None:
    """Its epoch order cannot be drawn again after a restart: said at the save, with the fix."""
    pytest.importorskip("torchdata")
    with pytest.warns(RuntimeWarning, match="use_seedable_sampler=True"):
        _stateful_run(tmp_path, resume=False, seedable=False)
