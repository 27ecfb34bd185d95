"""Keys of hand-sharded and plain state dicts: every leaf gets a checkpoint key of its own.

Leaves were named by joining their path's keys as text, so ``"a.b"`` beside ``{"a": {"b": ...}}``
(or ``1`` beside ``"1"``) got one key: one of them was dropped from the save, or left
unloaded, with no error. And an int-keyed dict got its loaded values back under string keys,
its own entries left as they were."""

from __future__ import annotations

import pytest
import torch

import bytecheckpoint as bcp
from bytecheckpoint.errors import UnsupportedStateError
from bytecheckpoint.state.tensor_shard import TensorShard


def shard(values: torch.Tensor) -> TensorShard:
    return TensorShard(values, (6,))


def test_int_keys_get_their_values_back_under_the_same_keys(tmp_path):
    bcp.save(str(tmp_path / "c"), {"m": {"w": shard(torch.arange(6.0)), "meta": {0: "A", 1: "B"},
                                         "steps": [{"n": 1}, {"n": 2}]}})
    state = {"m": {"w": shard(torch.zeros(6)), "meta": {0: "stale", 1: "stale"},
                   "steps": [{"n": 0}, {"n": 0}]}}
    bcp.load(str(tmp_path / "c"), state)
    assert state["m"]["meta"] == {0: "A", 1: "B"}
    assert state["m"]["steps"] == [{"n": 1}, {"n": 2}]
    assert torch.equal(state["m"]["w"].data, torch.arange(6.0))


@pytest.mark.parametrize("extra", [
    pytest.param({"a.b": torch.ones(3), "a": {"b": torch.full((3,), 2.0)}}, id="dotted-and-nested"),
    pytest.param({1: "int", "1": "text"}, id="int-and-text"),
    pytest.param({"x": [{"y": 1}], "x.0.y": 2}, id="list-index-and-dotted"),
])
def test_two_leaves_with_one_key_are_refused_before_anything_is_written(tmp_path, extra):
    with pytest.raises(UnsupportedStateError, match="would both be stored as"):
        bcp.save(str(tmp_path / "c"), {"m": {"w": shard(torch.arange(6.0)), **extra}})
    assert not (tmp_path / "c").exists()


def test_a_load_template_with_two_leaves_for_one_key_is_refused(tmp_path):
    bcp.save(str(tmp_path / "c"), {"model": torch.nn.Linear(2, 2)})
    template = {"weight": torch.zeros(2, 2), "bias": torch.zeros(2), "x": {"y": 1}, "x.y": 2}
    with pytest.raises(UnsupportedStateError, match="would both be stored as"):
        bcp.load(str(tmp_path / "c"), {"model": template}, strict=False)


def test_plain_values_of_a_sharded_dict_land_in_what_the_caller_holds(tmp_path):
    """Tensors in a list are filled in place (a model's buffers held there keep being the
    buffers), dicts inside a tuple are updated in place."""
    bcp.save(str(tmp_path / "c"), {"m": {"w": shard(torch.arange(6.0)),
                                         "bufs": [torch.full((2,), 3.0), torch.full((2,), 4.0)],
                                         "groups": ({"lr": 0.5},)}})
    b0, b1, group = torch.zeros(2), torch.zeros(2), {"lr": 0.0}
    state = {"m": {"w": shard(torch.zeros(6)), "bufs": [b0, b1], "groups": (group,)}}
    bcp.load(str(tmp_path / "c"), state)
    assert state["m"]["bufs"][0] is b0 and b0.tolist() == [3.0, 3.0] and b1.tolist() == [4.0, 4.0]
    assert state["m"]["groups"][0] is group and group == {"lr": 0.5}


def test_a_value_that_cannot_go_back_into_a_tuple_is_a_named_error(tmp_path):
    bcp.save(str(tmp_path / "c"), {"m": {"w": shard(torch.arange(6.0)), "t": ("saved", {"x": 1})}})
    with pytest.raises(UnsupportedStateError, match="tuple"):
        bcp.load(str(tmp_path / "c"), {"m": {"w": shard(torch.zeros(6)), "t": ("stale", {"x": 0})}})


def test_a_module_whose_names_collide_after_mapping_is_refused(tmp_path):
    """A non-injective fqn_map (a wrong pipeline offset) dropped one layer from the save."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    with pytest.raises(UnsupportedStateError, match="both map to"):
        bcp.save(str(tmp_path / "c"), {"model": model}, fqn_map=lambda n: n.replace("1.", "0."))
    assert not (tmp_path / "c").exists()
