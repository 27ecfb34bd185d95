"""Resume exactness through the integrations (review of what a resumed run silently lost).

* The Hugging Face Trainer's GradScaler (fp16) goes through ``BytecheckpointCallback``: the
  Trainer's own ``scaler.pt`` is not written with ``save_only_model=True``, so a resumed run
  restarted from the initial loss scale. A checkpoint saved without it resumes with a warning.
* Accelerate's ``load_state`` refuses a checkpoint holding objects (a scheduler, a registered
  object, a data loader) that the resuming accelerator did not prepare, instead of leaving
  them out; and ``skip_first_batches`` warns where the epoch's shuffling order was not saved.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

pytest.importorskip("accelerate")

from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState  # noqa: E402

from bytecheckpoint.errors import MissingKeysError  # noqa: E402
from bytecheckpoint.integrations.accelerate import load_state, save_state, skip_first_batches  # noqa: E402

from .accelerate_job import Seen  # noqa: E402


def _accelerator() -> Accelerator:
    AcceleratorState._reset_state(reset_partial_state=True)
    return Accelerator(cpu=True)


# -- Hugging Face Trainer: the GradScaler ----------------------------------------------------------

def _trainer(out: str, seed: int, scaler: bool):  # type: ignore[no-untyped-def]
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from bytecheckpoint.integrations.hf_trainer import BytecheckpointCallback

    AcceleratorState._reset_state(reset_partial_state=True)
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=40, n_positions=8, n_embd=16, n_layer=1, n_head=2)
    ids = torch.randint(0, 40, (6, 8), generator=torch.Generator().manual_seed(5))
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=2, max_steps=6, save_steps=4,
                             save_only_model=True, learning_rate=1e-2, report_to=[], use_cpu=True, seed=0,
                             disable_tqdm=True)
    trainer = Trainer(model=GPT2LMHeadModel(config), args=args,
                      train_dataset=[{"input_ids": r, "labels": r} for r in ids],
                      callbacks=[BytecheckpointCallback()])
    if scaler:  # what fp16 on a GPU makes; on the CPU, Accelerate makes none, so put one in
        trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=4.0, growth_interval=1)
    return trainer


def test_hf_trainer_resume_restores_the_grad_scaler(tmp_path: os.PathLike) -> None:
    pytest.importorskip("transformers")
    out = str(tmp_path / "run")
    full = _trainer(out, 0, scaler=True)
    full.train()  # saves at step 4 and 6
    resumed = _trainer(out, 1, scaler=True)
    resumed.train(resume_from_checkpoint=os.path.join(out, "checkpoint-4"))
    assert resumed.accelerator.scaler.state_dict() == full.accelerator.scaler.state_dict()
    for k, v in full.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[k], v), k


def test_hf_trainer_checkpoint_without_a_scaler_resumes_with_a_warning(tmp_path: os.PathLike) -> None:
    pytest.importorskip("transformers")
    out = str(tmp_path / "run")
    _trainer(out, 0, scaler=False).train()  # as the callback saved before it kept the scaler
    resumed = _trainer(out, 1, scaler=True)
    with pytest.warns(RuntimeWarning, match="holds no GradScaler state"):
        resumed.train(resume_from_checkpoint=os.path.join(out, "checkpoint-4"))
    assert resumed.state.global_step == 6


# -- Accelerate ------------------------------------------------------------------------------------

def _prepared(acc: Accelerator, *, scheduler: bool = True, custom: bool = True,
              loader: bool = True) -> nn.Module:
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    objs: list = [model, opt] + ([torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)] if scheduler else [])
    prepared = acc.prepare(*objs)
    if custom:
        acc.register_for_checkpointing(Seen())
    if loader:
        acc.prepare(torch.utils.data.DataLoader(list(range(8)), batch_size=2))
    return prepared[0]


@pytest.mark.parametrize("left_out", ["scheduler", "custom", "dataloader"])
def test_accelerate_refuses_a_checkpoint_holding_objects_not_prepared(tmp_path: os.PathLike,
                                                                      left_out: str) -> None:
    saving = _accelerator()
    _prepared(saving)
    root = str(tmp_path / "ck")
    save_state(saving, f"{root}/step_1", step=1)
    acc = _accelerator()
    model = _prepared(acc, **{"loader" if left_out == "dataloader" else left_out: False})
    before = model.weight.detach().clone()
    with pytest.raises(MissingKeysError, match=f"holds {left_out}, which this accelerator has not prepared"):
        load_state(acc, root)
    assert torch.equal(model.weight, before)  # refused before anything was loaded
    assert load_state(acc, root, strict=False) == 1  # asked for: what they share
    same = _accelerator()
    _prepared(same)  # the objects that were saved: loads (the root: its latest)
    assert load_state(same, root) == 1


def _order(tmp_path: os.PathLike, resume: bool) -> list[list[int]]:
    """5 batches an epoch; the run saves after 3 and takes 2 more; a resume skips 3."""
    acc = _accelerator()
    torch.manual_seed(0)
    loader = acc.prepare(torch.utils.data.DataLoader(list(range(10)), batch_size=2, shuffle=True))
    path = str(tmp_path / "ck" / "step_3")
    if not resume:
        batches = iter(loader)
        for _ in range(3):
            next(batches)
        torch.rand(4)  # training draws from the RNG
        save_state(acc, path, step=3)
        return [b.tolist() for b in batches]
    assert load_state(acc, path) == 3
    return [b.tolist() for b in skip_first_batches(acc, loader, 3)]


def test_accelerate_skipping_into_an_unseeded_shuffled_epoch_is_warned_about(tmp_path: os.PathLike) -> None:
    _order(tmp_path, resume=False)
    with pytest.warns(RuntimeWarning, match="use_seedable_sampler=True"):
        _order(tmp_path, resume=True)


def _run(root: str, load_from: int | None, saves: tuple[int, ...] = ()) -> list[list[int]]:
    """The documented loop on a seedable shuffled loader of 4 batches an epoch, to step 12,
    saving at ``saves``; or from the checkpoint of step ``load_from``, skipping into its epoch."""
    from accelerate.utils import DataLoaderConfiguration

    AcceleratorState._reset_state(reset_partial_state=True)
    acc = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    torch.manual_seed(0)
    loader = acc.prepare(torch.utils.data.DataLoader(list(range(8)), batch_size=2, shuffle=True))
    step = load_state(acc, f"{root}/step_{load_from}") if load_from else 0
    seen: list[list[int]] = []
    while step < 12:
        k = step % len(loader)
        for batch in skip_first_batches(acc, loader, k) if k else loader:
            seen.append(batch.tolist())
            step += 1
            if step in saves:
                save_state(acc, f"{root}/step_{step}", step=step, overwrite=True)
            if step == 12:
                break
    return seen


def test_accelerate_resume_goes_on_with_each_epoch_s_own_order(tmp_path: os.PathLike) -> None:
    """Mid-epoch (step 2) the epoch read through skip_first_batches is counted on the loader,
    so the next epoch is not a repeat of it; at an epoch's end (step 4, 8: saved during the
    last batch, before the loader counts the epoch) the resume starts the next epoch; and so
    does a checkpoint the resumed run saves at the end of the epoch it skipped into."""
    root = str(tmp_path / "ck")
    straight = _run(root, None, saves=(2, 4, 8))
    assert straight[4:8] != straight[:4]  # each epoch its own order
    for step in (2, 4, 8):
        assert _run(root, step) == straight[step:], f"resumed from step {step}"
    assert _run(root, 2, saves=(4,)) == straight[2:]
    assert _run(root, 4) == straight[4:], "resumed from the step 4 a resumed run saved"


def _loader_run(root: str, batch_size: int, resume: bool) -> None:
    acc = _accelerator()
    acc.prepare(torch.utils.data.DataLoader(list(range(8)), batch_size=batch_size, shuffle=True))
    if resume:
        load_state(acc, root)
    else:
        save_state(acc, f"{root}/step_3", step=3)


def test_accelerate_resume_with_another_batch_size_is_warned_about(tmp_path: os.PathLike) -> None:
    """The restored step and epoch count the saving run's batches: skipping into the epoch by
    another number of batches an epoch would continue at another sample, without a word."""
    import warnings

    root = str(tmp_path / "ck")
    _loader_run(root, 2, resume=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        _loader_run(root, 2, resume=True)  # the same loader: nothing to say
    with pytest.warns(RuntimeWarning, match="had 4 batches an epoch, this one has 2"):
        _loader_run(root, 4, resume=True)
