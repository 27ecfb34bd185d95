"""Plain values of a state (``bytecheckpoint.format.codec`` + ``state.plain_types.like``).

Strategies for nested values of every kind a state holds besides its tensors (the types the
codec stores and the ones a load rebuilds from the target: OrderedDict, defaultdict,
namedtuple, torch.Size, IntEnum, bytearray, exact numpy scalars), and the oracles:

- ``sibling(v)``: a target of the same structure and types holding other values;
- ``same(a, b)``: equal value and type at every level, bit for bit (NaN, -0.0, tensor bytes);
- ``as_stored(v)``: the plain value the codec keeps (what a load into another structure gives);
- ``types_from(result, stored, target)``: each place has the stored type or the target's.
"""

from __future__ import annotations

import collections
import enum
import struct
from typing import Any

import numpy as np
import torch
from hypothesis import strategies as st
from torch import nn

Pair = collections.namedtuple("Pair", "a b")


class Mode(enum.IntEnum):
    TRAIN = 1
    EVAL = 2


class Named(enum.IntEnum):
    """An IntEnum whose ``str()`` is its name (a common override; Python 3.10's default)."""

    LOW = -3
    HIGH = 2**70

    def __str__(self) -> str:
        return self.name


_NUMPY_SCALARS = (np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32,
                  np.uint64, np.float16, np.float32, np.float64)
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int8, torch.uint8, torch.bool,
           torch.complex64)


def _numpy_scalar(kind: type, seed: int) -> np.generic:
    if kind is np.bool_:
        return np.bool_(seed % 2)
    if issubclass(kind, np.integer):
        info = np.iinfo(kind)
        return kind(info.min + seed % (int(info.max) - int(info.min) + 1))
    special = (np.nan, -0.0, np.inf, -np.inf)
    return kind(special[seed % 4] if seed % 3 == 0 else (seed % 1000) / 7 - 50)


def _tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int, param: bool) -> torch.Tensor:
    t = (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 9).to(dtype)
    return nn.Parameter(t, requires_grad=False) if param else t


_floats = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from((-0.0, float("nan"), 5e-324))
_ints = st.integers(-(2**70), 2**70) | st.sampled_from((2**63 - 1, -(2**63), 2**64 - 1, 2**64, -(2**63) - 1,
                                                        10**300))
leaves = st.one_of(
    st.none(), st.booleans(), _ints, _floats, st.text(max_size=8), st.binary(max_size=8),
    st.binary(max_size=8).map(bytearray),
    st.builds(_numpy_scalar, st.sampled_from(_NUMPY_SCALARS), st.integers(0, 2**64)),
    st.text(max_size=5).map(np.str_), st.sampled_from(list(Mode) + list(Named)),
    st.lists(st.integers(0, 9), max_size=3).map(torch.Size),
    st.builds(_tensor, st.sampled_from(_DTYPES), st.lists(st.integers(0, 3), max_size=2).map(tuple),
              st.integers(0, 2**31), st.booleans()),
    st.builds(lambda dt, n: np.arange(n).astype(dt), st.sampled_from(("<i4", ">f8", "u1", "<c8", "?", "<U3")),
              st.integers(0, 4)),
    st.sampled_from((torch.float16, torch.bfloat16, torch.int32)),
)
_keys = st.one_of(st.text(max_size=4), st.integers(-3, 2**65), st.tuples(st.integers(0, 3)))


def _containers(inner: st.SearchStrategy) -> st.SearchStrategy:
    pairs = st.lists(st.tuples(_keys, inner), max_size=4)
    return st.one_of(
        st.lists(inner, max_size=4), st.lists(inner, max_size=4).map(tuple),
        st.dictionaries(_keys, inner, max_size=4),
        pairs.map(collections.OrderedDict),
        pairs.map(lambda p: collections.defaultdict(list, p)),
        st.builds(Pair, inner, inner),
    )


values = st.recursive(leaves, _containers, max_leaves=14)


def sibling(v: Any) -> Any:
    """A value of ``v``'s structure and types with other contents (a fresh target)."""
    if isinstance(v, torch.Tensor):
        z = torch.zeros_like(v.detach())
        return nn.Parameter(z, requires_grad=False) if isinstance(v, nn.Parameter) else z
    if isinstance(v, np.ndarray):
        return np.zeros_like(v)
    if isinstance(v, enum.Enum):
        return next(iter(type(v)))
    if isinstance(v, np.generic):
        return type(v)()
    if type(v) is torch.Size:
        return torch.Size([0] * len(v))
    if isinstance(v, tuple):
        items = [sibling(x) for x in v]
        return type(v)._make(items) if hasattr(type(v), "_fields") else tuple(items)
    if isinstance(v, list):
        return [sibling(x) for x in v]
    if isinstance(v, collections.defaultdict):
        return collections.defaultdict(v.default_factory, {k: sibling(x) for k, x in v.items()})
    if isinstance(v, dict):
        return type(v)((k, sibling(x)) for k, x in v.items())
    if v is None or isinstance(v, torch.dtype):
        return v
    return type(v)()


def _raw(t: torch.Tensor) -> bytes:
    return t.detach().resolve_conj().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def same(a: Any, b: Any) -> bool:
    """Equal value and type at every level, bit for bit."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and _raw(a) == _raw(b)
    if isinstance(a, np.ndarray | np.generic):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, collections.defaultdict) and a.default_factory is not b.default_factory:
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, float):
        return struct.pack("<d", a) == struct.pack("<d", b)
    return a == b


def as_stored(v: Any) -> Any:
    """The plain value the codec keeps for ``v`` (the types a load without a target gives)."""
    if isinstance(v, torch.Tensor):
        return v.detach() if isinstance(v, nn.Parameter) else v
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, enum.Enum):
        return int(v)
    if isinstance(v, bytearray):
        return bytes(v)
    if isinstance(v, tuple):
        return tuple(as_stored(x) for x in v)
    if isinstance(v, list):
        return [as_stored(x) for x in v]
    if isinstance(v, dict):
        return {k: as_stored(x) for k, x in v.items()}
    return v


_MISSING = object()


def types_from(result: Any, stored: Any, target: Any) -> str | None:
    """Where ``result`` (a load of ``stored`` into ``target``) has a type that is neither the
    stored one nor the target's at that place: a description, else None."""
    if type(result) is not type(stored) and (target is _MISSING or type(result) is not type(target)):
        return f"{type(result).__name__} for stored {type(stored).__name__} into {type(target).__name__}"
    if isinstance(stored, dict) and isinstance(result, dict):
        sub = target if isinstance(target, dict) else {}
        for k in stored:
            why = types_from(result[k], stored[k], sub.get(k, _MISSING))
            if why:
                return f"[{k!r}] {why}"
    elif isinstance(stored, list | tuple) and isinstance(result, list | tuple):
        sub = target if isinstance(target, list | tuple) and len(target) == len(stored) else ()
        for i, x in enumerate(stored):
            why = types_from(result[i], x, sub[i] if sub else _MISSING)
            if why:
                return f"[{i}] {why}"
    return None


# -- values the codec must refuse by name (UnsupportedStateError) at save ----------------------------

class _Obj:
    pass


class _Str(str):
    pass


def _deep_tuple(n: int) -> Any:
    v: Any = 0
    for _ in range(n):
        v = (v,)
    return v


def _cycle() -> list:
    c: list = []
    c.append(c)
    return c


def _refused_leaf(i: int) -> Any:
    makers = (
        lambda: {1, 2}, lambda: frozenset(), lambda: 1 + 2j, lambda: _Obj(), lambda: print,
        lambda: np.complex128(1j), lambda: np.longdouble(1) / 3, lambda: np.datetime64("2020-01-01"),
        lambda: np.timedelta64(3, "s"), lambda: np.void(b"ab"), lambda: np.array([object()]),
        lambda: np.zeros(2, dtype=[("a", "<i4")]), lambda: torch.zeros(2, 2).to_sparse(),
        lambda: "\ud800", lambda: _Str("x"), lambda: _deep_tuple(40), lambda: _cycle(),
        lambda: 10**5000, lambda: torch.device("cpu"), lambda: range(3),
    )
    return makers[i % len(makers)]()


refused_leaves = st.integers(0, 10**6).map(_refused_leaf)
