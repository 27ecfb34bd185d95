"""The plan-cache-hit path of a save (issue 21, return time): what a hit reuses (where each
assigned piece lies in the rank's shards, the packed hyperparameters) never carries stale
data into a checkpoint. The functions without ``test_`` run on every rank of a gloo group."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import bytecheckpoint as bcp
from bytecheckpoint.planning import plan_cache
from tests.support.helpers import same_bits


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(96, 64), torch.nn.ReLU(), torch.nn.Linear(64, 96))


def _step(model: torch.nn.Module, optim: torch.optim.Optimizer, lr: float) -> None:
    for g in optim.param_groups:
        g["lr"] = lr
    model(torch.randn(4, 96)).square().mean().backward()
    optim.step()
    optim.zero_grad()


def _snapshot(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    out = {f"m/{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for i, p in enumerate(model.parameters()):
        for k, v in optim.state[p].items():
            out[f"o/{i}/{k}"] = v.clone()
    out["lr"] = optim.param_groups[0]["lr"]
    return out


def _loaded(path: str) -> dict[str, Any]:
    model = DDP(_model())
    optim = torch.optim.AdamW(model.parameters(), lr=0.5)
    _step(model, optim, 0.5)
    bcp.load(path, {"model": model, "optimizer": optim})
    return _snapshot(model.module, optim)


def _differs(ref: dict[str, Any], got: dict[str, Any]) -> list[str]:
    return [k for k, v in ref.items()
            if not (same_bits(v, got[k]) if isinstance(v, torch.Tensor) else v == got[k])]


def hits_follow_the_live_state(root: str, snapshot: str) -> dict[str, Any]:
    """Saves 2 and 3 hit the plan cache: after in-place training, after a parameter is
    replaced by a new tensor of the same shape, and with a new learning rate."""
    plan_cache.clear()  # the pool's processes ran other saves before
    model = DDP(_model())
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = {"model": model, "optimizer": optim}
    out: dict[str, Any] = {"hits": [], "differs": []}
    for k in range(3):
        _step(model, optim, 1e-2 * (k + 1))
        if k == 2:  # same structure, a different tensor object behind the name
            old = model.module[0].weight
            new = torch.nn.Parameter(old.detach() * 3 + dist.get_rank() * 0)
            model.module[0].weight = new
            optim.state[new] = optim.state.pop(old)
            optim.param_groups[0]["params"][0] = new
        ref = _snapshot(model.module, optim)
        handle = bcp.save(f"{root}/s{k}", state, async_save=True, snapshot=snapshot)
        _step(model, optim, 0.25)  # the live state moves on at once
        result = handle.wait(timeout=120)
        out["hits"].append(result.cached_plan)
        out["differs"].append(_differs(ref, _loaded(f"{root}/s{k}")))
    return out


def test_cache_hits_save_the_live_tensors_and_hyperparameters(world, tmp_path):
    for snapshot in ("blocking", "overlapped"):
        for r in world(2).run(hits_follow_the_live_state, str(tmp_path / snapshot), snapshot):
            assert r["hits"] == [False, True, True]
            assert r["differs"] == [[], [], []]


def test_changed_shape_plans_again_and_saves_the_new_tensor(tmp_path):
    """A tensor whose shape changed is a new structure: the save plans, and never reads the
    new tensor through the old plan's pieces."""
    plan_cache.clear()
    model = torch.nn.Linear(64, 32)
    r0 = bcp.save(str(tmp_path / "a"), {"model": model})
    r1 = bcp.save(str(tmp_path / "b"), {"model": model})
    model.weight = torch.nn.Parameter(torch.randn(48, 64))
    model.bias = torch.nn.Parameter(torch.randn(48))
    r2 = bcp.save(str(tmp_path / "c"), {"model": model})
    assert (r0.cached_plan, r1.cached_plan, r2.cached_plan) == (False, True, False)
    fresh = torch.nn.Linear(64, 48)
    bcp.load(str(tmp_path / "c"), {"model": fresh})
    assert same_bits(fresh.weight, model.weight) and same_bits(fresh.bias, model.bias)
