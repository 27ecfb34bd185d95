"""Tensors and values whose bytes are not plainly their values: stored exactly, or refused by
name. Each of these raised a raw error from deep in a save (or, for a structured numpy array,
saved and then failed every load as "corrupt"), and a 0-d numpy array came back 1-d."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import bytecheckpoint as bcp
from bytecheckpoint.errors import UnsupportedStateError
from bytecheckpoint.state.tensor_shard import TensorShard

Z = torch.complex(torch.arange(6.0), torch.arange(6.0) + 0.5)


class Holder(torch.nn.Module):
    def __init__(self, value: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("b", value)


@pytest.mark.parametrize("view", [
    pytest.param(lambda: Z.conj(), id="conj"),
    pytest.param(lambda: torch._neg_view(torch.arange(3.0)), id="neg"),
    pytest.param(lambda: Z.conj().imag, id="conj-imag"),
])
def test_lazy_views_are_saved_as_their_values(tmp_path, view):
    value = view()
    want = value.resolve_conj().resolve_neg().clone()
    bcp.save(str(tmp_path / "c"), {"model": Holder(view()), "x": {"v": view()},
                                   "m": {"w": TensorShard(view(), tuple(value.shape))}})
    model, objects = Holder(torch.zeros_like(want)), {"v": None}
    shard = torch.zeros_like(want)
    target = TensorShard(shard, tuple(want.shape))
    bcp.load(str(tmp_path / "c"), {"model": model, "x": objects, "m": {"w": target}})
    assert torch.equal(model.b, want) and torch.equal(objects["v"], want) and torch.equal(shard, want)


def test_a_conjugate_view_as_a_load_target_gets_the_saved_values(tmp_path):
    bcp.save(str(tmp_path / "c"), {"m": {"w": TensorShard(Z.clone(), (6,))}})
    base = torch.zeros(6, dtype=Z.dtype)
    target = base.conj()
    bcp.load(str(tmp_path / "c"), {"m": {"w": TensorShard(target, (6,))}})
    assert torch.equal(target.resolve_conj(), Z) and torch.equal(base, Z.conj())


@pytest.mark.parametrize("state", [
    pytest.param(lambda: {"x": {"v": torch.eye(3).to_sparse()}}, id="sparse-object"),
    pytest.param(lambda: {"model": Holder(torch.eye(3).to_sparse())}, id="sparse-buffer"),
    pytest.param(lambda: {"x": {"v": torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])}},
                 id="nested"),
    pytest.param(lambda: {"x": {"v": "text \ud800"}}, id="lone-surrogate"),
    pytest.param(lambda: {"x": {"v": np.zeros(3, dtype=[("a", "i4"), ("b", "f4")])}}, id="structured"),
])
def test_values_without_plain_bytes_are_refused_by_name(tmp_path, state):
    with pytest.raises(UnsupportedStateError):
        bcp.save(str(tmp_path / "c"), state())
    assert not (tmp_path / "c").exists()


def test_a_zero_dimensional_numpy_array_keeps_its_shape(tmp_path):
    value = {"a": np.array(3.5), "b": np.array([1, 2], dtype=np.int16)}
    bcp.save(str(tmp_path / "c"), {"x": value})
    back: dict = {"x": None}
    bcp.load(str(tmp_path / "c"), back)
    assert back["x"]["a"].shape == () and back["x"]["a"] == 3.5
    assert back["x"]["b"].dtype == np.int16 and back["x"]["b"].tolist() == [1, 2]
