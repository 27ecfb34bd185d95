"""An optimizer with no state for some parameters (no gradient yet: an unused branch, an
expert that got no tokens, a layer unfrozen later) loads back as it was saved.

The load creates every state tensor with one zero step so it can fill them in place. For a
parameter without saved state that left step 1 and zero moments: ``strict`` loads failed with
missing keys the checkpoint never had, and ``strict=False`` loads went on training with a bias
correction the run never had."""

from __future__ import annotations

import pytest
import torch

import bytecheckpoint as bcp


class TwoBranches(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        return self.b(self.a(x)) if use_b else self.a(x)


def train(model: TwoBranches, optim: torch.optim.Optimizer, use_b: bool, seed: int) -> None:
    torch.manual_seed(seed)
    for _ in range(2):
        optim.zero_grad()
        model(torch.randn(3, 4), use_b).pow(2).sum().backward()
        optim.step()


@pytest.mark.parametrize("make", [
    pytest.param(lambda ps: torch.optim.AdamW(ps, lr=1e-2), id="adamw"),
    pytest.param(lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9), id="sgd-momentum"),
])
@pytest.mark.parametrize("strict", [True, False])
def test_parameters_without_state_load_without_state_and_train_on_identically(tmp_path, make, strict):
    model = TwoBranches()
    optim = make(model.parameters())
    train(model, optim, use_b=False, seed=0)  # b gets no gradient: no state
    assert model.b.weight not in optim.state
    bcp.save(str(tmp_path / "c"), {"model": model, "optim": optim})

    fresh = TwoBranches()
    fresh_optim = make(fresh.parameters())
    bcp.load(str(tmp_path / "c"), {"model": fresh, "optim": fresh_optim}, strict=strict)
    assert fresh.b.weight not in fresh_optim.state and fresh.b.bias not in fresh_optim.state
    for p, q in zip(model.a.parameters(), fresh.a.parameters()):
        for name, value in optim.state[p].items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(fresh_optim.state[q][name]))

    train(model, optim, use_b=True, seed=1)
    train(fresh, fresh_optim, use_b=True, seed=1)
    for p, q in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(p, q)
