"""The Hugging Face Trainer with ``BytecheckpointCallback``: a run saves through bytecheckpoint
mid-epoch; a new Trainer resumes (``resume_from_checkpoint=True``) bit-exactly, dropout
included; a resume the callback has no checkpoint for is a named error."""

from __future__ import annotations

import os
import threading

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments  # noqa: E402

import bytecheckpoint as bcp  # noqa: E402
from bytecheckpoint.errors import ConcurrentSaveError, NotACheckpointError  # noqa: E402
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


class Crashing(Recording):
    """Fails in its 5th training step, after the callback saved step 4: outside the callback's
    hooks, so its on_train_end never comes."""

    def training_step(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        if self.state.global_step == 4:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return super().training_step(*args, **kwargs)


def test_a_train_that_crashed_outside_the_hooks_leaves_the_root_to_a_new_callback(tmp_path) -> None:
    # Was: the crashed Trainer (still referenced: a notebook's traceback, a retry loop) kept its
    # manager open, and the new callback's first save raised ConcurrentSaveError.
    out = str(tmp_path / "run")
    crashed = _trainer(out, 0, BytecheckpointCallback())
    crashed.__class__ = Crashing
    crashed.args.save_total_limit = 3
    with pytest.raises(RuntimeError, match="illegal memory access"):
        crashed.train()
    assert crashed.args.save_total_limit is None  # taken over by the callback, not given back yet
    retry = _trainer(out, 1, BytecheckpointCallback())
    retry.train(resume_from_checkpoint=os.path.join(out, "checkpoint-4"))
    with bcp.CheckpointManager(os.path.join(out, "bytecheckpoint")) as mgr:
        assert [c.step for c in mgr.steps()] == [4, 6]
    assert crashed.args.save_total_limit == 3  # the crashed run's setting is its own again


def test_a_train_still_running_on_another_thread_keeps_the_root(tmp_path) -> None:
    """The protection the fix must keep: two live train() calls on one root are refused."""
    from transformers import TrainerControl, TrainerState

    out = str(tmp_path / "run")
    opened, release = threading.Event(), threading.Event()
    running = BytecheckpointCallback()

    def train_elsewhere() -> None:  # what Trainer.train() calls, up to a save in flight
        args = TrainingArguments(output_dir=out, report_to=[], use_cpu=True)
        running.on_train_begin(args, TrainerState(), TrainerControl())
        running._manager(args)  # opened, as its first on_save does
        opened.set()
        release.wait(60)
        running.on_train_end(args, TrainerState(), TrainerControl())

    thread = threading.Thread(target=train_elsewhere)
    thread.start()
    try:
        assert opened.wait(60)
        second = _trainer(out, 1, BytecheckpointCallback())
        with pytest.raises(ConcurrentSaveError, match="another CheckpointManager"):
            second.train()
        assert running.manager is not None  # still open: not taken from the live train()
    finally:
        release.set()
        thread.join(60)
