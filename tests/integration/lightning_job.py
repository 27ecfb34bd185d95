"""A tiny Lightning training run for tests/integration/test_lightning.py.

    python -m tests.integration.lightning_job MODE CKPT_DIR OUT_FILE [STEPS]

MODE ``ddp``: 2 CPU ranks, strategy="ddp", saving through BytecheckpointIO; ``resume``: 1
device, ``fit(ckpt_path="last")``; ``resume_ddp``: the same on 2 DDP ranks (each loads);
``full``: 1 device, uninterrupted. Every rank sees the same batches (no distributed
sampler), so a 2-rank DDP step equals a 1-device step bit for bit: the gradient average of
two equal gradients is that gradient exactly. Checkpoints are saved after the last batch of
an epoch (``every_n_train_steps``): one saved at ``on_train_epoch_end`` makes Lightning replay
a batch on resume, with its default ``TorchCheckpointIO`` too. Rank 0 writes losses and
states to OUT_FILE.
"""

from __future__ import annotations

import sys

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from bytecheckpoint.integrations.lightning import BytecheckpointIO

STEPS_PER_EPOCH = 4


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.losses: list[torch.Tensor] = []
        self.lrs: list[float] = []
        self.batches: list[int] = []
        self.restored: dict | None = None

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.detach().clone())
        self.lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])
        self.batches.append(int(_idx))
        return loss

    def on_train_start(self) -> None:  # after a resume restored everything
        opt = self.trainer.optimizers[0]
        self.restored = {"model": {k: v.clone() for k, v in self.state_dict().items()},
                         "optim": _clone(opt.state_dict()),
                         "lr": opt.param_groups[0]["lr"], "global_step": self.trainer.global_step}

    def configure_optimizers(self) -> dict:
        opt = torch.optim.Adam(self.parameters(), lr=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _clone(value: object) -> object:
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clone(v) for v in value]
    return value


def loader() -> DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2 * STEPS_PER_EPOCH, 8, generator=g)
    y = torch.randn(2 * STEPS_PER_EPOCH, 1, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=2, shuffle=False)


def main(mode: str, ckpt_dir: str, out: str, steps: int) -> None:
    torch.manual_seed(0)
    model = Tiny()
    common = dict(accelerator="cpu", max_steps=steps, logger=False, enable_progress_bar=False,
                  enable_model_summary=False, use_distributed_sampler=False, num_sanity_val_steps=0)
    callbacks = [ModelCheckpoint(dirpath=ckpt_dir, save_last=True, every_n_train_steps=STEPS_PER_EPOCH)]
    if mode == "ddp":
        trainer = L.Trainer(devices=2, strategy="ddp", plugins=[BytecheckpointIO()], callbacks=callbacks,
                            **common)
        trainer.fit(model, loader())
    elif mode in ("resume", "resume_ddp"):
        layout = dict(devices=1) if mode == "resume" else dict(devices=2, strategy="ddp")
        trainer = L.Trainer(plugins=[BytecheckpointIO()], callbacks=callbacks, **layout, **common)
        trainer.fit(model, loader(), ckpt_path="last")
    elif mode == "full":
        trainer = L.Trainer(devices=1, enable_checkpointing=False, **common)
        trainer.fit(model, loader())
    else:
        raise SystemExit(f"unknown mode {mode}")
    if trainer.is_global_zero:
        opt = trainer.optimizers[0]
        torch.save({"losses": model.losses, "lrs": model.lrs, "batches": model.batches,
                    "model": model.state_dict(), "optim": opt.state_dict(), "restored": model.restored,
                    "global_step": trainer.global_step}, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]) if len(sys.argv) > 4 else STEPS_PER_EPOCH)
