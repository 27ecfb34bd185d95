"""Trainer integrations under failure and retention (review).

* Hugging Face Trainer with ``save_total_limit``: the Trainer deletes its older
  ``checkpoint-<N>`` folders while it saves, before the callback's ``on_save``. A save of the
  callback that failed (or was killed, or failed in the background) left the newest folder
  without our state and the older ones, which had it, deleted: nothing to resume from. The
  callback now rotates the folders itself once its save has committed. A train() that stopped
  on the callback's error no longer keeps the root from the process's next Trainer.
* Accelerate's ``load_state`` of a root read ``latest`` before the process's own async save
  in flight had committed: the checkpoint before it was restored. And a root holding only what
  a first save killed before its commit left (staging directory, lock) was refused as "not a
  checkpoint" instead of being a fresh start, on every relaunch.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from torch import nn  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments  # noqa: E402

from bytecheckpoint.errors import CheckpointError, NotACheckpointError  # noqa: E402
from bytecheckpoint.integrations.hf_trainer import BytecheckpointCallback  # noqa: E402
from bytecheckpoint.storage import faults  # noqa: E402


def _trainer(out: str, callback: BytecheckpointCallback, limit: int | None) -> Trainer:
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=40, n_positions=8, n_embd=16, n_layer=1, n_head=2)
    ids = torch.randint(0, 40, (6, 8), generator=torch.Generator().manual_seed(5))
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=2, max_steps=6, save_steps=2,
                             save_total_limit=limit, save_only_model=True, learning_rate=1e-2, report_to=[],
                             use_cpu=True, seed=0, disable_tqdm=True)
    return Trainer(model=GPT2LMHeadModel(config), args=args,
                   train_dataset=[{"input_ids": r, "labels": r} for r in ids], callbacks=[callback])


def _folders(out: str) -> list[str]:
    return sorted(n for n in os.listdir(out) if n.startswith("checkpoint-"))


def _fail_saving_step_4(out: str, async_save: bool, limit: int | None) -> Trainer:
    """A run whose callback's save of step 4 fails (in the background with ``async_save``)."""
    trainer = _trainer(out, BytecheckpointCallback(async_save=async_save), limit)
    faults.install("fail_every=1;permanent=1;ops=open_writer;path=.step_4.")
    try:
        with pytest.raises(CheckpointError):
            trainer.train()
    finally:
        faults.install(None)
    return trainer  # kept alive, as a notebook or a retry loop keeps it


@pytest.mark.parametrize("async_save", [False, True])
def test_hf_a_failed_save_keeps_the_trainer_folder_to_resume_from(tmp_path: os.PathLike,
                                                                  async_save: bool) -> None:
    out = str(tmp_path / "run")
    _fail_saving_step_4(out, async_save, limit=1)
    assert "checkpoint-2" in _folders(out)  # its state is committed: the Trainer must not delete it
    with pytest.raises(NotACheckpointError, match="resume_from_checkpoint=.*checkpoint-2"):
        _trainer(out, BytecheckpointCallback(), limit=1).train(resume_from_checkpoint=True)
    resumed = _trainer(out, BytecheckpointCallback(async_save=async_save), limit=1)
    resumed.train(resume_from_checkpoint=os.path.join(out, "checkpoint-2"))
    assert resumed.state.global_step == 6
    assert _folders(out) == ["checkpoint-6"]  # rotated once each save committed
    assert resumed.args.save_total_limit == 1  # given back to the Trainer


def test_hf_a_failed_train_frees_the_root_for_the_next_trainer(tmp_path: os.PathLike) -> None:
    """train() that stopped on the callback's error left its manager open: the next Trainer of
    the process on that root got ConcurrentSaveError."""
    out = str(tmp_path / "run")
    failed = _fail_saving_step_4(out, async_save=False, limit=None)
    resumed = _trainer(out, BytecheckpointCallback(), limit=None)
    resumed.train(resume_from_checkpoint=os.path.join(out, "checkpoint-2"))
    assert resumed.state.global_step == 6 and failed.callback_handler is not None


def _accelerator(seed: int) -> tuple[object, nn.Module]:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    acc, model = Accelerator(cpu=True), nn.Linear(4, 2)
    torch.nn.init.constant_(model.weight, seed)
    acc.prepare(model, torch.optim.AdamW(model.parameters()))
    return acc, model


def test_accelerate_load_state_waits_for_the_save_in_flight(tmp_path: os.PathLike) -> None:
    from bytecheckpoint.integrations.accelerate import load_state, save_state

    accelerator = _accelerator
    root = str(tmp_path / "ckpt")
    save_state(accelerator(1)[0], f"{root}/step_1", step=1)
    faults.install("latency_s=0.3;ops=write;path=step_2")
    try:
        save_state(accelerator(2)[0], f"{root}/step_2", step=2, async_save=True)
        acc, model = accelerator(0)
        assert load_state(acc, root) == 2  # not step 1, which 'latest' named while step 2 was writing
    finally:
        faults.install(None)
    assert torch.equal(model.weight, torch.full((2, 4), 2.0))


def test_accelerate_a_first_save_killed_before_its_commit_is_a_fresh_start(tmp_path: os.PathLike) -> None:
    from bytecheckpoint.integrations.accelerate import load_state, save_state

    root = tmp_path / "ckpt"
    (root / ".step_4.staging-4a824e88fac1").mkdir(parents=True)  # what a SIGKILL there leaves
    (root / ".step_4.staging-4a824e88fac1" / "model-00000.safetensors").write_bytes(b"partial")
    (root / ".step_4.lock").write_bytes(b"")
    acc, model = _accelerator(3)
    assert load_state(acc, str(root)) is None  # nothing committed: nothing loaded
    assert torch.equal(model.weight, torch.full((2, 4), 3.0))
    save_state(acc, str(root / "step_4"), step=4)
    assert load_state(_accelerator(0)[0], str(root)) == 4
