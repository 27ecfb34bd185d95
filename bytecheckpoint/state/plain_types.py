"""Giving a loaded plain value back the types the load's target holds at the same places.

The codec stores plain values as msgpack: an ``OrderedDict`` or ``defaultdict`` comes back as
a dict, a namedtuple or ``torch.Size`` as a tuple, a numpy scalar as the Python number it
equals, an ``IntEnum`` as an int, a ``bytearray`` as bytes, an ``nn.Parameter`` as a tensor.
Nothing in the checkpoint says which class a value had (storing class names and importing
them on load would run code a checkpoint names). The caller's target does say it: where it
holds a value of one of these types, the loaded value is rebuilt with the target's own class,
and only when that is exact (a float that a ``numpy.float32`` cannot hold stays a float).
"""

from __future__ import annotations

import enum
from collections import OrderedDict, defaultdict
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn


def like(template: Any, loaded: Any) -> Any:
    """``loaded`` with the types that ``template`` (the caller's value there) has, where they
    can hold it exactly; otherwise ``loaded`` as it is. ``template`` is never changed."""
    if type(template) in _AS_STORED:  # most leaves: nothing to rebuild
        return loaded
    if isinstance(template, np.generic):
        return _numpy_scalar(template, loaded)
    if isinstance(template, tuple) and type(loaded) is tuple:
        return _tuple(template, loaded)
    if isinstance(template, Mapping) and type(loaded) is dict:
        return _mapping(template, loaded)
    if isinstance(template, list) and type(loaded) is list and len(template) == len(loaded):
        return [like(t, v) for t, v in zip(template, loaded)]
    if isinstance(template, enum.Enum) and isinstance(template, int) and type(loaded) is int:
        return _member(type(template), loaded)
    if type(template) is bytearray and type(loaded) is bytes:
        return bytearray(loaded)
    if isinstance(template, nn.Parameter) and type(loaded) is torch.Tensor:
        grad = template.requires_grad and (loaded.is_floating_point() or loaded.is_complex())
        return nn.Parameter(loaded, requires_grad=grad)
    return loaded


_AS_STORED = frozenset({type(None), bool, int, float, str, bytes, torch.Tensor})


def _numpy_scalar(template: np.generic, loaded: Any) -> Any:
    """The target's numpy type of ``loaded`` when it holds exactly the same value."""
    if type(loaded) not in (bool, int, float, str, bytes):
        return loaded
    try:
        value = type(template)(loaded)
        back = value.item()
    except (OverflowError, ValueError, TypeError):
        return loaded
    exact = type(back) is type(loaded) and (back == loaded or back != back and loaded != loaded)
    return value if exact else loaded


def _tuple(template: tuple[Any, ...], loaded: tuple[Any, ...]) -> tuple[Any, ...]:
    if type(template) is torch.Size:
        return torch.Size(loaded) if all(type(d) is int for d in loaded) else loaded
    if len(template) != len(loaded):
        return loaded
    items = [like(t, v) for t, v in zip(template, loaded)]
    if hasattr(type(template), "_make") and hasattr(type(template), "_fields"):  # a namedtuple
        return type(template)._make(items)
    return tuple(items)


def _mapping(template: Mapping[Any, Any], loaded: dict[Any, Any]) -> dict[Any, Any]:
    items = {k: like(template[k], v) if k in template else v for k, v in loaded.items()}
    if type(template) is OrderedDict:
        return OrderedDict(items)
    if type(template) is defaultdict:
        return defaultdict(template.default_factory, items)
    return items


def _member(cls: type[enum.Enum], value: int) -> Any:
    try:
        return cls(value)
    except (ValueError, TypeError):  # no longer a member: the saved int as it is
        return value
