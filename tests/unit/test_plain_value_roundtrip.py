"""Plain values of the state come back as they were saved, or the save refuses them by name.

The codec stores plain values as msgpack, which has no ``OrderedDict``, namedtuple, numpy
scalar or ``IntEnum``: they came back as dict, tuple, float and int even when the load's
target held the original type there (``isinstance(x, OrderedDict)`` or ``state.field``
failed after resume; numpy arithmetic changed dtype). A load now rebuilds them with the
target's own classes where exact. Numpy scalars with no exact Python value (long double,
complex, datetime) failed the save with a raw ``TypeError`` or came back as a unitless int,
and tuples nested past the decoder's limit were committed and then refused by every load as
damaged: the save now refuses both by name."""

from __future__ import annotations

import collections
import enum

import numpy as np
import pytest
import torch

import bytecheckpoint as bcp
from bytecheckpoint.errors import UnsupportedStateError
from bytecheckpoint.format import codec

Point = collections.namedtuple("Point", "x y")


class Mode(enum.IntEnum):
    TRAIN = 1
    EVAL = 2


def _values(n: int) -> dict:
    return {
        "od": collections.OrderedDict([("b", n), ("a", collections.OrderedDict(z=n))]),
        "dd": collections.defaultdict(list, {"k": [n]}),
        "point": Point(n, (2.5 + n, "s")),
        "points": [Point(0, n), Point(3, 4)],
        "f64": np.float64(0.1 + n), "f32": np.float32(0.1 + n), "f16": np.float16(0.3 + n),
        "i8": np.int8(-5 + n), "u64": np.uint64(2**64 - 1 - n), "b": np.bool_(n % 2),
        "s": np.str_(f"hey{n}"), "size": torch.Size([2, n]), "mode": Mode(1 + n % 2),
        "buf": bytearray(bytes([0, n])),
        "nested": {"t": (np.float32(1.5 + n), Point(np.int64(7 + n), collections.OrderedDict(q=n)))},
    }


def _assert_same(got, want) -> None:
    assert type(got) is type(want), (got, want)
    if isinstance(want, dict):
        assert list(got) == list(want)
        for k in want:
            _assert_same(got[k], want[k])
    elif isinstance(want, list | tuple):
        assert len(got) == len(want)
        for a, b in zip(got, want):
            _assert_same(a, b)
    else:
        assert got == want
    if isinstance(want, collections.defaultdict):
        assert got.default_factory is want.default_factory


def test_plain_values_come_back_with_the_types_the_target_holds(tmp_path):
    bcp.save(str(tmp_path / "c"), {"extra": _values(1)})
    target = _values(0)  # other values of the same types
    state = {"extra": target}
    bcp.load(str(tmp_path / "c"), state)
    assert state["extra"] is target
    _assert_same(target, _values(1))
    assert (target["f32"] * np.float32(3)).dtype == np.float32  # arithmetic keeps its dtype
    # a target type that cannot hold the saved value exactly does not change it
    bcp.save(str(tmp_path / "d"), {"extra": {"a": 0.1, "b": 300, "c": (1, 2, 3), "d": 7, "e": True}})
    target = {"a": np.float32(0), "b": np.int8(0), "c": Point(0, 0), "d": Mode.TRAIN, "e": np.int64(0)}
    bcp.load(str(tmp_path / "d"), {"extra": target})
    _assert_same(target, {"a": 0.1, "b": 300, "c": (1, 2, 3), "d": 7, "e": True})


class _Sched:
    """A Stateful object (an LR scheduler, a sampler) whose state holds such types."""

    def __init__(self, step: int) -> None:
        self.state = {"last": Point(step, np.float64(step / 10)), "hist": collections.OrderedDict(a=step)}
        self.loaded = None

    def state_dict(self) -> dict:
        return dict(self.state)

    def load_state_dict(self, sd: dict) -> None:
        self.loaded = sd


class _WithExtra(torch.nn.Linear):
    """A module whose ``get_extra_state`` is a namedtuple (set_extra_state gets it back)."""

    def __init__(self, step: int) -> None:
        super().__init__(2, 2)
        self.extra = Point(step, collections.OrderedDict(s=np.int32(step)))

    def get_extra_state(self) -> Point:
        return self.extra

    def set_extra_state(self, state: Point) -> None:
        self.extra = state


def test_stateful_objects_and_module_extra_state_get_their_own_types(tmp_path):
    bcp.save(str(tmp_path / "c"), {"sched": _Sched(3), "model": _WithExtra(3)})
    sched, model = _Sched(0), _WithExtra(0)
    bcp.load(str(tmp_path / "c"), {"sched": sched, "model": model})
    _assert_same(sched.loaded, _Sched(3).state)
    assert sched.loaded["last"].x == 3  # state.field works after resume
    _assert_same(model.extra, _WithExtra(3).extra)


def test_optimizer_hyperparameters_keep_their_numpy_types(tmp_path):
    def make() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model = torch.nn.Linear(2, 2)
        return model, torch.optim.SGD(model.parameters(), lr=np.float64(0.25), momentum=np.float32(0.5))
    model, optim = make()
    bcp.save(str(tmp_path / "c"), {"model": model, "optim": optim})
    model, optim = make()
    optim.param_groups[0]["lr"] = np.float64(9.0)
    bcp.load(str(tmp_path / "c"), {"model": model, "optim": optim})
    _assert_same(optim.param_groups[0]["lr"], np.float64(0.25))
    _assert_same(optim.param_groups[0]["momentum"], np.float32(0.5))


@pytest.mark.parametrize("value", [
    pytest.param(np.longdouble(1) / 3, id="longdouble"),
    pytest.param(np.complex128(1 + 2j), id="complex"),
    pytest.param(np.datetime64("2020-01-01T00:00:00.000000001", "ns"), id="datetime64-ns"),
    pytest.param(np.datetime64("2020-01-01", "D"), id="datetime64-day"),
    pytest.param(np.timedelta64(5, "s"), id="timedelta64"),
])
def test_numpy_scalars_without_an_exact_plain_value_are_refused_at_save(tmp_path, value):
    with pytest.raises(UnsupportedStateError, match=r"numpy\.asarray"):
        bcp.save(str(tmp_path / "c"), {"extra": {"v": value}})
    bcp.save(str(tmp_path / "d"), {"extra": {"v": np.asarray(value)}})  # the way it names
    out: dict = {"extra": {}}
    bcp.load(str(tmp_path / "d"), out)
    assert out["extra"]["v"].dtype == value.dtype and out["extra"]["v"] == value


def _nest(depth: int, wrap) -> object:
    value: object = 0
    for _ in range(depth):
        value = wrap(value)
    return value


def test_nesting_that_no_load_could_read_is_refused_at_save(tmp_path):
    """Past the decoder's depth limit the checkpoint was committed and every load refused it
    as damaged; cycles and very deep lists gave msgpack's raw ValueError."""
    ok = _nest(codec.MAX_DEPTH, lambda v: (v,))
    bcp.save(str(tmp_path / "ok"), {"extra": ok})
    out: dict = {"extra": None}
    bcp.load(str(tmp_path / "ok"), out)
    assert out["extra"] == ok
    for deep in (_nest(codec.MAX_DEPTH + 1, lambda v: (v,)),
                 _nest(codec.MAX_DEPTH, lambda v: collections.OrderedDict(a=v))
                 | {"t": _nest(codec.MAX_DEPTH, lambda v: (v,))}):
        with pytest.raises(UnsupportedStateError, match="nests more than"):
            bcp.save(str(tmp_path / "deep"), {"extra": deep})
    cycle: list = []
    cycle.append(cycle)
    for bad in (cycle, _nest(1100, lambda v: [v])):
        with pytest.raises(UnsupportedStateError, match="nests too deeply"):
            bcp.save(str(tmp_path / "cycle"), {"extra": bad})
    assert not (tmp_path / "deep").exists() and not (tmp_path / "cycle").exists()
