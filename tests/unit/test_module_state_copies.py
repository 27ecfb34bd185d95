"""Modules whose ``state_dict()`` hands out copies rather than their own tensors still load.

A load fills the tensors ``state_dict()`` returned, in place. Where those are copies (a
``get_extra_state`` that returns a tensor, as TransformerEngine's fp8 scaling state; a
state_dict hook that splits a fused weight or casts it), filling them changed nothing and the
module silently kept its fresh values. Such entries now go back through the module's own
``load_state_dict`` (its hooks and ``set_extra_state``), as ``torch`` loads them.
"""

from __future__ import annotations

import pytest
import torch

import bytecheckpoint as bcp


class TensorExtraState(torch.nn.Module):
    """fp8-style scaling state kept as Python values, checkpointed as one tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)
        self.scale, self.history = 1.0, [0.0, 0.0, 0.0]

    def get_extra_state(self) -> torch.Tensor:
        return torch.tensor([self.scale, *self.history], dtype=torch.float64)

    def set_extra_state(self, state: torch.Tensor) -> None:
        self.scale, self.history = float(state[0]), state[1:].tolist()


class FusedQKV(torch.nn.Module):
    """Holds one fused weight; its state dict shows q, k and v (split on save, joined on load)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Parameter(torch.zeros(6, 2))
        self._register_state_dict_hook(FusedQKV._split)
        self._register_load_state_dict_pre_hook(FusedQKV._join, with_module=True)

    @staticmethod
    def _split(module, sd, prefix, _meta):
        fused = sd.pop(prefix + "qkv")
        for i, name in enumerate("qkv"):
            sd[prefix + name] = fused[2 * i : 2 * i + 2].clone()
        return sd

    def _join(self, sd, prefix, *_args):
        sd[prefix + "qkv"] = torch.cat([sd.pop(prefix + n) for n in "qkv"])


class CastOnSave(torch.nn.Module):
    """Saves its float32 weight as a bfloat16 copy."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(4))
        self._register_state_dict_hook(
            lambda m, sd, prefix, _meta: sd.__setitem__(prefix + "w", sd[prefix + "w"].to(torch.bfloat16)))


def _filled(module: torch.nn.Module) -> torch.nn.Module:
    with torch.no_grad():
        for i, p in enumerate(module.parameters()):
            p.copy_(torch.arange(p.numel(), dtype=p.dtype).reshape(p.shape) + 10 * i + 1)
    return module


def test_a_tensor_extra_state_is_restored(tmp_path):
    saved = TensorExtraState()
    saved.scale, saved.history = 0.125, [1.0, 2.0, 3.0]
    bcp.save(str(tmp_path / "c"), {"model": saved})
    fresh = TensorExtraState()
    bcp.load(str(tmp_path / "c"), {"model": fresh})
    assert (fresh.scale, fresh.history) == (0.125, [1.0, 2.0, 3.0])
    assert torch.equal(fresh.lin.weight, saved.lin.weight)


@pytest.mark.parametrize("cls", [FusedQKV, CastOnSave])
def test_hooked_state_dicts_load_into_the_module(tmp_path, cls):
    saved = _filled(cls())
    bcp.save(str(tmp_path / "c"), {"model": saved})
    fresh = cls()
    bcp.load(str(tmp_path / "c"), {"model": fresh})
    for a, b in zip(saved.parameters(), fresh.parameters()):
        assert torch.equal(a, b)


def test_a_module_s_own_tensors_are_still_filled_in_place(tmp_path):
    """The common case: no load_state_dict call, and the parameters keep their identity."""
    saved = _filled(torch.nn.Linear(3, 2))
    bcp.save(str(tmp_path / "c"), {"model": saved})
    fresh = torch.nn.Linear(3, 2)
    weight = fresh.weight
    calls = []
    fresh.register_load_state_dict_post_hook(lambda *a: calls.append(a))
    bcp.load(str(tmp_path / "c"), {"model": fresh})
    assert fresh.weight is weight and torch.equal(fresh.weight, saved.weight) and not calls
