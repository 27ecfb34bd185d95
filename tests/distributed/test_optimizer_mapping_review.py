"""Saved optimizer state of FSDP2 (DTensor) parameters loads into every parameter that holds
some, or is named when nothing can take it; it was skipped silently. The functions without
``test_`` run on every rank."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import bytecheckpoint as bcp


def _make(amsgrad: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 4))
    fully_shard(model)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2, amsgrad=amsgrad)


def _train(model: torch.nn.Module, optim: torch.optim.Optimizer, seed: int) -> None:
    torch.manual_seed(seed + dist.get_rank())
    model(torch.randn(3, 4)).pow(2).sum().backward()
    optim.step()
    optim.zero_grad()


def _full_state(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        for k, v in optim.state.get(p, {}).items():
            out[f"{name}/{k}"] = v.full_tensor() if hasattr(v, "full_tensor") else v
    return out


def load_checks(root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    model, optim = _make(amsgrad=True)
    _train(model, optim, 0)
    bcp.save(f"{root}/c", {"model": model, "optim": optim})
    expected = _full_state(model, optim)

    # State only for the first layer so far (the second got no gradient): the second's
    # saved state is loaded too.
    fresh, fresh_optim = _make(amsgrad=True)
    _train(fresh, fresh_optim, 1)
    for p in fresh[1].parameters():
        del fresh_optim.state[p]
    bcp.load(f"{root}/c", {"model": fresh, "optim": fresh_optim})
    got = _full_state(fresh, fresh_optim)
    out["partial"] = sorted(set(expected) ^ set(got)) + sorted(
        k for k in expected if k in got and not torch.equal(expected[k], got[k]))

    # Built without amsgrad: its zero step makes no max_exp_avg_sq of DTensor parameters to
    # load into, so the saved ones are named, not dropped (the next step raised KeyError).
    fresh, fresh_optim = _make(amsgrad=False)
    try:
        bcp.load(f"{root}/c", {"model": fresh, "optim": fresh_optim})
        out["amsgrad"] = None
    except bcp.MissingKeysError as exc:
        out["amsgrad"] = str(exc)
    return out


def test_fsdp2_optimizer_state_is_loaded_or_named(world, tmp_path):
    for r in world(2).run(load_checks, str(tmp_path)):
        assert r["partial"] == []
        assert r["amsgrad"] is not None and "optim/state/0.weight/max_exp_avg_sq" in r["amsgrad"]
