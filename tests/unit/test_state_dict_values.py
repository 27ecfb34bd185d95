"""A plain value in the state (a dict such as ``model.state_dict()``, a list, a tensor) is
packed per rank; a load lands it in what the caller passed: tensors of the same shape and
dtype are copied into in place (so a state dict updates the model it aliases, as DCP's
in-place load does), containers keep their identity, anything else is replaced."""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import bytecheckpoint as bcp
from bytecheckpoint.state.flatten import into
from tests.support.helpers import same_bits


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.LayerNorm(4))


def test_loading_into_a_state_dict_updates_the_model_it_aliases(tmp_path):
    saved = _model(0)
    bcp.save(str(tmp_path / "c"), {"model": saved.state_dict(), "extra": {"step": 3}})
    model = _model(1)
    sd = model.state_dict()
    extra: dict = {}
    bcp.load(str(tmp_path / "c"), {"model": sd, "extra": extra})
    for k, v in saved.state_dict().items():
        assert same_bits(model.state_dict()[k], v), k  # the model itself, not only the dict
        assert sd[k].data_ptr() == model.state_dict()[k].data_ptr()
    assert extra == {"step": 3}


def test_what_does_not_match_is_replaced_and_containers_keep_their_identity(tmp_path):
    state = {"extra": {"a": torch.arange(4.0), "b": torch.zeros(3), "c": [torch.ones(2), 5],
                       "d": torch.zeros(2, dtype=torch.int64), "gone": 1}}
    bcp.save(str(tmp_path / "c"), state)
    a, b = torch.full((4,), 9.0), torch.zeros(7)  # b: another shape
    c_list = [torch.zeros(2), 0]
    d = torch.zeros(2, dtype=torch.float32)  # another dtype
    target = {"a": a, "b": b, "c": c_list, "d": d, "new": 2}
    live = {"extra": target}
    bcp.load(str(tmp_path / "c"), live)
    assert live["extra"] is target and target["a"] is a and target["c"] is c_list
    assert same_bits(a, torch.arange(4.0)) and same_bits(c_list[0], torch.ones(2)) and c_list[1] == 5
    assert target["b"] is not b and same_bits(target["b"], torch.zeros(3))  # replaced, b untouched
    assert same_bits(b, torch.zeros(7))
    assert target["d"].dtype == torch.int64 and same_bits(d, torch.zeros(2))
    assert "new" not in target and target["gone"] == 1  # the saved dict, as before


def test_a_tensor_that_cannot_be_written_in_place_is_replaced():
    expanded = torch.zeros(1).expand(3)  # one element seen three times: copy_ refuses
    got = into(expanded, torch.arange(3.0))
    assert same_bits(got, torch.arange(3.0)) and same_bits(expanded, torch.zeros(3))
    with torch.inference_mode():
        frozen = torch.zeros(3)
    got = into(frozen, torch.ones(3))
    assert same_bits(got, torch.ones(3)) and same_bits(frozen, torch.zeros(3))


_tensors = st.builds(lambda n, k: torch.full((n,), float(k)), st.integers(0, 3), st.integers(0, 9))
_values = st.recursive(
    st.integers(-5, 5) | _tensors,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from("abc"), inner, max_size=3),
    max_leaves=8)


def _equal(x, y) -> bool:
    if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
        return isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and same_bits(x, y)
    if isinstance(x, dict) or isinstance(y, dict):
        return isinstance(x, dict) and isinstance(y, dict) and x.keys() == y.keys() and all(
            _equal(x[k], y[k]) for k in x)
    if isinstance(x, list) or isinstance(y, list):
        return isinstance(x, list) and isinstance(y, list) and len(x) == len(y) and all(
            _equal(a, b) for a, b in zip(x, y))
    return x == y


@settings(max_examples=200, deadline=None)
@given(old=_values, new=_values)
def test_into_always_yields_the_loaded_value(old, new):
    """Whatever the caller passed, what it holds afterwards equals what was loaded."""
    assert _equal(into(old, new), new)


def test_a_large_plain_value_is_saved_with_a_warning_naming_the_better_way(tmp_path):
    big = {"w": torch.zeros(17 << 20, dtype=torch.uint8), "v": torch.zeros(48 << 20, dtype=torch.uint8)}
    with pytest.warns(RuntimeWarning, match=r"state\['weights'\] is saved per rank .*'model': model"):
        bcp.save(str(tmp_path / "a"), {"weights": big})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once per key
        bcp.save(str(tmp_path / "b"), {"weights": big})
    out: dict = {"weights": {}}
    bcp.load(str(tmp_path / "b"), out)
    assert same_bits(out["weights"]["v"], big["v"])


def test_an_index_keyed_optimizer_state_dict_as_a_load_target_is_refused_by_name(tmp_path):
    """optimizer.state_dict() keys state by parameter index, which the checkpoint does not
    know: the load names the two forms that work instead of failing on missing keys."""
    model = torch.nn.Linear(8, 8)
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 8)).sum().backward()
    optim.step()
    bcp.save(str(tmp_path / "c"), {"model": model, "optimizer": optim})
    with pytest.raises(bcp.UnsupportedStateError, match="get_state_dict"):
        bcp.load(str(tmp_path / "c"), {"model": model, "optimizer": optim.state_dict()})
