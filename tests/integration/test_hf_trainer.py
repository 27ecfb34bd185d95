"""The Hugging Face Trainer with ``BytecheckpointCallback``: a run saves through bytecheckpoint
mid-epoch; a new Trainer resumes (``resume_from_checkpoint=True``) bit-exactly, dropout
included; a resume the callback has no checkpoint for is a named error."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments  # noqa: E402

import bytecheckpoint as bcp  # noqa: E402
from bytecheckpoint.errors import NotACheckpointError  # noqa: E402
from bytecheckpoint.integrations.hf_trainer import BytecheckpointCallback  # noqa: E402
from tests.integration.frameworks_support import assert_same  # noqa: E402


class Recording(Trainer):
    """Keeps every training step's loss, exactly."""

    losses: list[torch.Tensor]

    def training_step(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        loss = super().training_step(*args, **kwargs)
        self.losses.append(loss.detach().clone())
        return loss


def _trainer(out: str, seed: int, callback: BytecheckpointCallback | None) -> Recording:
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    torch.manual_seed(seed)  # the resumed model must get its weights from the checkpoint
    config = GPT2Config(vocab_size=40, n_positions=8, n_embd=16, n_layer=1, n_head=2,
                        resid_pdrop=0.2, embd_pdrop=0.2, attn_pdrop=0.2)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 40, (6, 8), generator=g)
    data = [{"input_ids": row, "labels": row} for row in ids]  # 3 steps per epoch
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=2, max_steps=6, save_steps=4,
                             save_only_model=True, learning_rate=1e-2, logging_steps=1, report_to=[],
                             use_cpu=True, seed=0, disable_tqdm=True)
    trainer = Recording(model=GPT2LMHeadModel(config), args=args, train_dataset=data,
                        callbacks=[callback] if callback else [])
    trainer.losses = []
    return trainer


def _state(trainer: Trainer) -> dict:
    return {"model": {k: v.clone() for k, v in trainer.model.state_dict().items()},
            "optim": trainer.optimizer.optimizer.state_dict(), "sched": trainer.lr_scheduler.state_dict()}


def test_resume_through_the_callback_is_bit_exact(tmp_path: os.PathLike) -> None:
    out = str(tmp_path / "run")
    full = _trainer(out, 0, BytecheckpointCallback())
    full.train()  # saves at step 4, mid-epoch 2, and at the end, step 6
    with bcp.CheckpointManager(os.path.join(out, "bytecheckpoint")) as mgr:
        assert [c.step for c in mgr.steps()] == [4, 6]
    assert not os.path.exists(os.path.join(out, "checkpoint-4", "optimizer.pt"))  # ours, not the Trainer's

    resumed = _trainer(out, 1, BytecheckpointCallback())
    resumed.train(resume_from_checkpoint=os.path.join(out, "checkpoint-4"))
    assert_same(resumed.losses, full.losses[4:], "losses after the resume")
    assert_same(_state(resumed), _state(full), "final state")


def test_resume_without_our_checkpoint_is_named(tmp_path: os.PathLike) -> None:
    out = str(tmp_path / "run")
    _trainer(out, 0, None).train()  # the Trainer's own checkpoints only
    with pytest.raises(NotACheckpointError, match="no bytecheckpoint checkpoint of that step"):
        trainer = _trainer(out, 1, BytecheckpointCallback())
        trainer.train(resume_from_checkpoint=os.path.join(out, "checkpoint-4"))
