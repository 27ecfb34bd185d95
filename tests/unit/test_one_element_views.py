"""A tensor of one element counts as contiguous whatever its stride (``x[::2]`` of two
elements, a column of a one-row batch), and viewing its bytes raised a raw ``RuntimeError``
in saves and loads. Each path now saves and loads such a tensor exactly."""

from __future__ import annotations

import torch

import bytecheckpoint as bcp
from bytecheckpoint.state.tensor_shard import TensorShard, flat_shard


def strided_one() -> torch.Tensor:
    return torch.tensor([3.5, 4.0])[::2]  # one element, stride 2


class Holder(torch.nn.Module):
    def __init__(self, value: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("b", value)


def test_saved_from_a_module_a_shard_and_an_object(tmp_path):
    column = torch.arange(6.0).reshape(3, 2)[:1, 1]  # one row's column: stride 2
    bcp.save(str(tmp_path / "c"), {"model": Holder(strided_one()),
                                   "m": {"w": TensorShard(strided_one(), (1,))},
                                   "x": {"v": strided_one(), "col": column}})
    model, shard, objects = Holder(torch.zeros(1)), torch.zeros(1), {"v": None, "col": None}
    bcp.load(str(tmp_path / "c"), {"model": model, "m": {"w": TensorShard(shard, (1,))}, "x": objects})
    assert model.b.tolist() == [3.5] and shard.tolist() == [3.5]
    assert objects["v"].tolist() == [3.5] and objects["col"].tolist() == [1.0]


def test_loaded_into_one_element_strided_targets(tmp_path):
    full = torch.arange(6.0).reshape(2, 3)
    bcp.save(str(tmp_path / "flat"), {"m": {"w": [flat_shard(full.reshape(-1)[a:b].clone(), (2, 3), a, b)
                                                  for a, b in [(0, 1), (1, 6)]]}})
    transposed = torch.zeros(3, 2).t()  # its first element's box is one element with stride 2
    bcp.load(str(tmp_path / "flat"), {"m": {"w": TensorShard(transposed, (2, 3))}})
    assert torch.equal(transposed, full)
    bcp.save(str(tmp_path / "one"), {"m": {"w": TensorShard(torch.tensor([5.0]), (1,))}})
    target = torch.zeros(2)[::2]
    bcp.load(str(tmp_path / "one"), {"m": {"w": TensorShard(target, (1,))}})
    assert target.tolist() == [5.0]
