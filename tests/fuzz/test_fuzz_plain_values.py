"""Fuzzing plain values: random nested values of every kind a state holds besides its tensors.

Into a target of the same structure, a load gives back the value saved, with its type at every
level (the target's types, ``plain_types.like``); into a target of another structure, the
value as stored. Values the codec cannot store are refused at save by name
(UnsupportedStateError), never another exception. Most cases go through the codec and
``flatten.into`` directly (what a load does with a plain value, thousands a second); a few
through ``bcp.save`` / ``bcp.load``.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

import bytecheckpoint as bcp
from bytecheckpoint.errors import UnsupportedStateError
from bytecheckpoint.format import codec
from bytecheckpoint.state.flatten import into
from tests.fuzz.plain_values import Named, as_stored, refused_leaves, same, sibling, types_from, values
from tests.fuzz.strategies import fuzz_settings

pytestmark = pytest.mark.fuzz


def _load_into(target, value):
    return into(target, codec.decode(codec.encode(value)))


@fuzz_settings(300)
@given(values)
def test_a_value_loaded_into_a_target_of_its_structure_comes_back_with_its_types(value):
    got = _load_into(sibling(value), value)
    assert same(got, value), (value, got)


@fuzz_settings(300)
@given(values, values)
def test_a_value_loaded_into_another_structure_comes_back_as_stored(value, target):
    stored = codec.decode(codec.encode(value))
    got = _load_into(target, value)
    assert same(as_stored(got), as_stored(stored)), (value, target, got)
    assert types_from(got, stored, target) is None, (types_from(got, stored, target), value, target)


def _with(inner: st.SearchStrategy) -> st.SearchStrategy:
    """``inner`` somewhere inside a random supported value."""
    return st.recursive(inner, lambda s: st.one_of(st.lists(s, min_size=1, max_size=2), st.tuples(s, values),
                                                   st.dictionaries(st.text(max_size=2), s, min_size=1,
                                                                   max_size=1)), max_leaves=3)


@fuzz_settings(150)
@given(_with(refused_leaves))
def test_a_value_the_codec_cannot_store_is_refused_by_name(value):
    with pytest.raises(UnsupportedStateError):
        codec.encode(value)


@fuzz_settings(12)
@given(values, st.data())
def test_save_and_load_keep_plain_values_and_refuse_the_rest_by_name(tmp_path_factory, value, data):
    path = str(tmp_path_factory.mktemp("c") / "c")
    bad = data.draw(_with(refused_leaves))
    with pytest.raises(UnsupportedStateError):
        bcp.save(path, {"extra": {"ok": value, "bad": bad}})
    bcp.save(path, {"extra": {"ok": value}})
    state = {"extra": {"ok": sibling(value)}}
    bcp.load(path, state)
    assert same(state["extra"]["ok"], value), (value, state["extra"]["ok"])


# -- what the fuzzers found --------------------------------------------------------------------------


class _Id(int):
    def __repr__(self) -> str:
        return f"Id({int(self)})"


@pytest.mark.parametrize("value,want", [(Named.LOW, Named.LOW), (Named.HIGH, Named.HIGH), (_Id(7), 7),
                                        ([_Id(-(2**80))], [-(2**80)])], ids=repr)
def test_an_int_subclass_with_its_own_str_loads_as_its_value(tmp_path, value, want):
    """The codec stored ``str(x)`` of an int subclass (an IntEnum, whose ``str`` is its name
    where overridden and on Python 3.10; any subclass with its own ``__repr__``): the save
    committed and every load refused the checkpoint as damaged."""
    bcp.save(str(tmp_path / "c"), {"extra": {"v": value}})
    out = {"extra": {"v": sibling(value)}}
    bcp.load(str(tmp_path / "c"), out)
    assert same(out["extra"]["v"], want)


def test_an_int_too_long_to_write_in_decimal_is_refused_by_name(tmp_path):
    """Past Python's int/str digit limit the save failed with a raw ValueError."""
    with pytest.raises(UnsupportedStateError, match="digits"):
        bcp.save(str(tmp_path / "c"), {"extra": {"v": 10**5000}})
    assert not (tmp_path / "c").exists()


def test_a_list_that_holds_itself_inside_a_dict_is_refused_by_name(tmp_path):
    """Only a cycle at the top of an entry was named: one inside a dict ran the state walk into
    a raw RecursionError."""
    cycle: list = []
    cycle.append(cycle)
    deep: object = 0
    for _ in range(1100):
        deep = [deep]
    for bad in ({"bad": cycle}, {"a": {"b": [1, cycle]}}, {"bad": deep}):
        with pytest.raises(UnsupportedStateError, match="holds itself"):
            bcp.save(str(tmp_path / "c"), {"extra": bad})
    assert not (tmp_path / "c").exists()
