"""Rank functions for tests/distributed/test_data_resume_review.py (see tests/support/dist.py)."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

import bytecheckpoint as bcp
from bytecheckpoint.data import TokenLoader
from tests.support.data_workloads import Consumed, consumed

KW = {"context": 5, "batch_size": 2, "workers": 2, "buffer_tokens": 12}


def _loader(sources: list[str]) -> TokenLoader:
    return TokenLoader(sources, dp_rank=dist.get_rank(), dp_size=dist.get_world_size(), **KW)


def _read(loader: TokenLoader, batches: int | None = None) -> Consumed:
    pieces: Consumed = []
    for i, batch in enumerate(loader):
        pieces += consumed(batch)
        if batches is not None and i + 1 == batches:
            break
    return pieces


def read_and_save(path: str, sources: list[str], batches: int | None) -> Consumed:
    """Read ``batches`` batches (None: until the data runs out), then save the loader."""
    loader = _loader(sources)
    pieces = _read(loader, batches)
    bcp.save(path, {"dataloader": loader})
    loader.close()
    return pieces


def resume_and_read(path: str, sources: list[str]) -> Consumed:
    loader = _loader(sources)
    bcp.load(path, {"dataloader": loader})
    pieces = _read(loader)
    loader.close()
    return pieces


def save_after_close(path: str, sources: list[str]) -> str:
    loader = _loader(sources)
    _read(loader, 2)
    loader.close()
    try:
        bcp.save(path, {"dataloader": loader})
    except bcp.errors.StagingError as exc:
        return f"StagingError: {exc}"
    return "saved"


def _sampled_loader(world: int, rank: int) -> Any:
    from torch.utils.data import DistributedSampler
    from torchdata.stateful_dataloader import StatefulDataLoader

    data = list(range(48))
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=1)
    return StatefulDataLoader(data, batch_size=2, sampler=sampler, num_workers=0)


def save_sampled_loader(path: str) -> list[int]:
    """A torchdata loader over a DistributedSampler after 3 batches: every rank's state is
    the same (3 batches of its own part), the samples are not."""
    loader = _sampled_loader(dist.get_world_size(), dist.get_rank())
    it = iter(loader)
    seen = [int(x) for _ in range(3) for x in next(it)]
    bcp.save(path, {"loader": loader})
    return seen


def load_sampled_loader(path: str) -> str:
    loader = _sampled_loader(dist.get_world_size(), dist.get_rank())
    try:
        bcp.load(path, {"loader": loader})
    except bcp.StateMismatchError as exc:
        return f"StateMismatchError: {exc}"
    return " ".join(str(int(x)) for batch in loader for x in batch)
