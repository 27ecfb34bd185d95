"""A tiny Accelerate training run for tests/integration/test_accelerate.py, one process per rank
(the torch.distributed environment set as torchrun or ``accelerate launch`` sets it).

    python -m tests.integration.accelerate_job MODE ROOT OUT_DIR

MODE ``train``: 6 steps, with a ``save_state`` after step 4 (mid-epoch: 3 steps per epoch);
``resume``: a model of other weights, ``load_state``, skip the batches of the epoch already
seen, train to step 6. The model has dropout (RNG), the loader shuffles
(a seedable sampler: its order follows the restored epoch), an LR scheduler steps. Each rank
writes its losses and final state to OUT_DIR/MODE-RANK.pt.
"""

from __future__ import annotations

import sys

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from bytecheckpoint.integrations.accelerate import load_state, save_state, skip_first_batches

SAVE_AT, TOTAL = 4, 6


class Seen:
    """A user object given to ``register_for_checkpointing``."""

    def __init__(self) -> None:
        self.seen = 0

    def state_dict(self) -> dict:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict) -> None:
        self.seen = state["seen"]


def main(mode: str, root: str, out: str) -> None:
    acc = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    torch.manual_seed(0 if mode == "train" else 123)  # resume must get its weights from the checkpoint
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.2), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(12, 8, generator=g), torch.randn(12, 1, generator=g))
    loader = DataLoader(data, batch_size=2, shuffle=True)
    model, opt, sched, loader = acc.prepare(model, opt, sched, loader)
    counter = Seen()
    acc.register_for_checkpointing(counter)
    torch.manual_seed(7 + acc.process_index)  # per-rank dropout streams
    step = load_state(acc, root) if mode == "resume" else 0
    assert step is not None or mode != "resume", "nothing to resume from"
    losses = []
    while step < TOTAL:
        seen = step % len(loader)
        batches = skip_first_batches(acc, loader, seen) if seen else loader
        for x, y in batches:
            loss = nn.functional.mse_loss(model(x), y)
            acc.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad()
            losses.append(loss.detach().clone())
            counter.seen += 1
            step += 1
            if mode == "train" and step == SAVE_AT:
                save_state(acc, f"{root}/step_{step}", step=step)
            if step == TOTAL:
                break
    inner = acc.unwrap_model(model)
    torch.save({"losses": losses, "model": inner.state_dict(), "optim": opt.optimizer.state_dict(),
                "sched": sched.scheduler.state_dict(), "step": step, "acc_step": acc.step,
                "seen": counter.seen, "rng": torch.get_rng_state()}, f"{out}/{mode}-{acc.process_index}.pt")
    acc.end_training()


if __name__ == "__main__":
    main(*sys.argv[1:4])
