"""Rank functions for the data loader tests (see tests/support/dist.py)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import bytecheckpoint as bcp
from bytecheckpoint.data import TokenLoader
from tests.support.workloads import CFG, make_fsdp2

Consumed = list[tuple[int, int, int]]  # (sample id, first token, tokens)
LOADER = {"context": CFG.context, "batch_size": 3, "workers": 2, "buffer_tokens": 256}


def consumed(batch: Any) -> Consumed:
    return [(int(i), int(s), int(n)) for p in batch.pieces
            for i, s, n in zip(p.ids, p.starts, p.lengths)]


def make_loader(sources: list[str], dp_rank: int, dp_size: int, **kw: Any) -> TokenLoader:
    return TokenLoader(sources, [3.0, 1.0], dp_rank=dp_rank, dp_size=dp_size, **{**LOADER, **kw})


def run_loader(loader: TokenLoader, batches: int | None = None) -> tuple[Consumed, list[np.ndarray]]:
    pieces: Consumed = []
    tokens: list[np.ndarray] = []
    for i, batch in enumerate(loader):
        pieces += consumed(batch)
        tokens.append(batch.tokens.numpy())
        if batches is not None and i + 1 == batches:
            break
    return pieces, tokens


def loader_save(path: str, sources: list[str], tp: int, batches: int) -> dict[str, Any]:
    """DP = world / tp; consume ``batches`` batches, save the loader, return what was read."""
    rank, world = dist.get_rank(), dist.get_world_size()
    loader = make_loader(sources, rank // tp, world // tp)
    pieces, tokens = run_loader(loader, batches)
    bcp.save(path, {"dataloader": loader})
    loader.close()
    return {"pieces": pieces, "tokens": tokens, "dp_rank": rank // tp}


def loader_resume(path: str, sources: list[str], tp: int) -> dict[str, Any]:
    """Load the loader under DP = world / tp and read to the end of the data."""
    rank, world = dist.get_rank(), dist.get_world_size()
    loader = make_loader(sources, rank // tp, world // tp)
    bcp.load(path, {"dataloader": loader})
    pieces, tokens = run_loader(loader)
    loader.close()
    return {"pieces": pieces, "tokens": tokens, "dp_rank": rank // tp}


def _train_loss(model: torch.nn.Module, optim: torch.optim.Optimizer, batch: Any) -> float:
    logits = model(batch.inputs)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             batch.targets.reshape(-1))
    loss.backward()
    optim.step()
    optim.zero_grad()
    return float(loss.item())


def train_with_loader(path: str, sources: list[str], steps: int, save_at: int | None,
                      resume: bool) -> dict[str, list[float]]:
    """FSDP2 training fed by the token loader (2 readers per rank, with RNG state).

    ``resume``: load ``path`` first and train the remaining steps; ``save_at``: save the
    model, optimizer, loader and RNGs after that many steps and stop.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    model, optim = make_fsdp2(seed=0)
    loader = make_loader(sources, rank, world, checkpoint_every=save_at)
    state = {"model": model, "optimizer": optim, "dataloader": loader, "rng": bcp.RNGState()}
    torch.manual_seed(1234 + rank)
    start = 0
    if resume:
        torch.manual_seed(999)  # must be overwritten by the restored RNG state
        result = bcp.load(path, state)
        start = int(result.step or 0)
    losses, draws = [], []
    for step in range(start, steps):
        batch = next(loader)
        draws.append(torch.rand(()).item())  # the restored RNG state must continue exactly
        losses.append(_train_loss(model, optim, batch))
        if save_at is not None and step + 1 == save_at:
            bcp.save(path, state, step=save_at)
            break
    loader.close()
    return {"losses": losses, "draws": draws}


class PerRankCounter:
    """A stateful object whose state differs per rank and that cannot reshard."""

    def __init__(self, value: int) -> None:
        self.value = value

    def state_dict(self) -> dict[str, int]:
        return {"value": self.value}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.value = sd["value"]


def per_rank_save(path: str, differ: bool) -> None:
    value = dist.get_rank() if differ else 7
    bcp.save(path, {"counter": PerRankCounter(value)})


def per_rank_load(path: str) -> str:
    counter = PerRankCounter(-1)
    try:
        bcp.load(path, {"counter": counter})
    except bcp.StateMismatchError as exc:
        return f"error: {exc}"
    return f"value {counter.value}"
