"""Every saved optimizer state tensor loads into its own parameter, by name, bit for bit.

The load fills state tensors in place, and made them with one zero step only when the
optimizer had no state at all. Saved state of a parameter without state yet (a frozen one,
one that had no gradient since the process started) and saved state tensors that a zero
step does not create (LBFGS's, ``max_exp_avg_sq`` saved with amsgrad=True) were skipped
silently, even by strict loads: training went on with fresh moments, or failed at its next
step (``KeyError``, ``TypeError``)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import pytest
import torch

import bytecheckpoint as bcp


class Net(torch.nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


Make = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]


def train(model: Net, optim: torch.optim.Optimizer, seed: int, steps: int = 2) -> None:
    torch.manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(3, 4)

        def closure(x: torch.Tensor = x) -> torch.Tensor:
            optim.zero_grad()
            loss = model(x).pow(2).sum()
            loss.backward()
            return loss

        optim.step(closure)


def by_name(model: Net, optim: torch.optim.Optimizer) -> dict[str, dict[str, object]]:
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: dict(s) for p, s in optim.state.items()}


def same(a: object, b: object) -> bool:
    """Equal values, tensors of the same dtype and bits (LBFGS holds lists of them)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def assert_same_state(expected: dict[str, dict[str, object]], got: dict[str, dict[str, object]]) -> None:
    assert expected.keys() == got.keys()
    for fqn, entries in expected.items():
        assert entries.keys() == got[fqn].keys(), fqn
        for name, value in entries.items():
            assert same(value, got[fqn][name]), (fqn, name)


def saved(tmp_path, make: Make) -> tuple[str, Net, torch.optim.Optimizer]:
    model = Net(0)
    optim = make(model.parameters())
    train(model, optim, seed=1)
    path = str(tmp_path / "c")
    bcp.save(path, {"model": model, "optim": optim})
    return path, model, optim


def adam(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-2)


def test_parameters_without_state_yet_get_their_saved_state(tmp_path):
    path, model, optim = saved(tmp_path, adam)
    fresh = Net(5)
    fresh_optim = adam(fresh.parameters())
    fresh.b.requires_grad_(False)  # b gets no gradient: a has state, b none
    train(fresh, fresh_optim, seed=7, steps=1)
    fresh.b.requires_grad_(True)
    assert fresh.b.weight not in fresh_optim.state and fresh.a.weight in fresh_optim.state
    bcp.load(path, {"model": fresh, "optim": fresh_optim})
    assert_same_state(by_name(model, optim), by_name(fresh, fresh_optim))


def test_a_frozen_parameter_of_the_optimizer_gets_its_saved_state(tmp_path):
    path, model, optim = saved(tmp_path, adam)
    fresh = Net(5)
    fresh.a.weight.requires_grad_(False)
    fresh_optim = adam(fresh.parameters())
    bcp.load(path, {"model": fresh, "optim": fresh_optim})
    assert_same_state(by_name(model, optim), by_name(fresh, fresh_optim))


@pytest.mark.parametrize(("save_with", "load_with"), [
    pytest.param(lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True), adam, id="amsgrad-into-adam"),
    pytest.param(lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
                 lambda ps: torch.optim.SGD(ps, lr=1e-2), id="momentum-into-sgd"),
    pytest.param(lambda ps: torch.optim.LBFGS(ps, lr=0.1, history_size=3, max_iter=3),
                 lambda ps: torch.optim.LBFGS(ps, lr=0.1, history_size=3, max_iter=3), id="lbfgs"),
])
def test_saved_state_that_a_zero_step_does_not_create_loads_and_trains_on_identically(
        tmp_path, save_with: Make, load_with: Make):
    path, model, optim = saved(tmp_path, save_with)
    fresh = Net(5)
    fresh_optim = load_with(fresh.parameters())
    bcp.load(path, {"model": fresh, "optim": fresh_optim})
    assert_same_state(by_name(model, optim), by_name(fresh, fresh_optim))
    assert fresh_optim.state_dict()["param_groups"] == optim.state_dict()["param_groups"]
    train(model, optim, seed=9)
    train(fresh, fresh_optim, seed=9)
    for p, q in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(p, q)


def test_sparse_adam_whose_step_refuses_dense_zero_gradients_round_trips(tmp_path):
    def make(seed: int) -> tuple[torch.nn.Embedding, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        emb = torch.nn.Embedding(10, 4, sparse=True)
        return emb, torch.optim.SparseAdam(emb.parameters(), lr=0.1)

    emb, optim = make(0)
    for _ in range(2):
        optim.zero_grad()
        emb(torch.tensor([1, 2, 3])).sum().backward()
        optim.step()
    bcp.save(str(tmp_path / "c"), {"model": emb, "optim": optim})
    fresh, fresh_optim = make(5)
    bcp.load(str(tmp_path / "c"), {"model": fresh, "optim": fresh_optim})
    assert_same_state({"weight": optim.state[emb.weight]}, {"weight": fresh_optim.state[fresh.weight]})


def test_a_scheduler_saved_for_groups_in_another_order_is_refused(tmp_path):
    """Groups load by parameter name, a scheduler's ``base_lrs`` by group position: with the
    groups built in another order each group was scheduled from the other's rate, silently."""
    def make(order: str) -> tuple[Net, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
        model = Net(0)
        groups = {"w": {"params": [model.a.weight, model.b.weight], "lr": 0.1},
                  "b": {"params": [model.a.bias, model.b.bias], "lr": 0.01}}
        optim = torch.optim.SGD([groups[k] for k in order], lr=0.1)
        return model, optim, torch.optim.lr_scheduler.LambdaLR(optim, lambda epoch: 0.5 ** epoch)

    model, optim, sched = make("wb")
    train(model, optim, seed=1)
    sched.step()
    bcp.save(str(tmp_path / "c"), {"model": model, "optim": optim, "sched": sched})
    model, optim, sched = make("wb")
    bcp.load(str(tmp_path / "c"), {"model": model, "optim": optim, "sched": sched})
    assert sched.base_lrs == [0.1, 0.01]
    model, optim, sched = make("bw")
    with pytest.raises(bcp.StateMismatchError, match="another order or number"):
        bcp.load(str(tmp_path / "c"), {"model": model, "optim": optim, "sched": sched})
