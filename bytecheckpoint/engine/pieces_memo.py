"""The pieces a rank listed for its last save, reused while the state holds the same tensors.

Listing a rank's pieces asks the planner about every tensor (its box, its local view, its
global shape): about a third of the time ``save()`` holds the caller on a plan-cache hit
(1,076 tensors per rank on the 3.56 GB benchmark model). A save whose state holds the same
tensor objects as the last one, each with the same shape and dtype (and, for a DTensor, the
same sharding spec and local tensor), gets the same pieces from the planners named in
``PURE_PLANNERS``, whose pieces depend on nothing else. The memo holds weak references: it
never keeps a replaced tensor alive, and never mistakes a new tensor at a reused address for
the old one, and it keeps no tensor data: a piece it reuses is rebuilt from its box and the
live tensor (these planners' pieces are each a whole local tensor). Hand-described shards
(``TensorShard``, ``ShardSet``) are listed every save.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ..format.boxes import Box
from ..planners import LocalShard

# Planners whose pieces of a tensor are a function of that tensor alone (its shape, dtype and,
# for a DTensor, its spec and local tensor) and of this process's place in the mesh.
PURE_PLANNERS = frozenset({"fsdp2", "dtensor", "ddp", "single"})


class _Seen:
    """One tensor as the last save saw it."""

    __slots__ = ("ref", "spec", "local", "shape", "dtype")

    def __init__(self, value: torch.Tensor) -> None:
        self.ref = weakref.ref(value)
        local = value._local_tensor if isinstance(value, DTensor) else value
        self.spec = value._spec if isinstance(value, DTensor) else None
        self.local = weakref.ref(local) if local is not value else None
        self.shape, self.dtype = local.shape, local.dtype

    def same(self, value: Any) -> bool:
        if self.ref() is not value:
            return False
        if self.spec is not None:
            local = value._local_tensor
            if value._spec is not self.spec or self.local is None or self.local() is not local:
                return False
        else:
            local = value
        return local.shape == self.shape and local.dtype == self.dtype


@dataclass
class Pieces:
    boxes: dict[str, list[Box]]  # key -> the boxes of its pieces, each its whole local tensor
    rows: list[tuple[str, str, tuple[int, ...], Any]]  # the local plan's items, as tuples
    digest: bytes  # plan_cache.rows_digest(rows)

    def shards(self, tensors: dict[str, Any]) -> dict[str, list[LocalShard]]:
        """The pieces of the live ``tensors`` (checked by ``lookup`` to be the listed ones)."""
        out = {}
        for key, value in tensors.items():
            out[key] = [LocalShard(box, _local(value)) for box in self.boxes[key]]
        return out


@dataclass
class _Entry:
    planner: str
    global_ranks: tuple[int, ...]
    keys: list[str]
    seen: list[_Seen]
    pieces: Pieces


_LAST: _Entry | None = None


def _local(value: torch.Tensor) -> torch.Tensor | None:
    """A DTensor's local tensor (None if it has none we can see), a plain tensor itself."""
    if isinstance(value, DTensor):
        local = getattr(value, "_local_tensor", None)
        return local if isinstance(local, torch.Tensor) else None
    return value


def _memoizable(planner: str, tensors: dict[str, Any]) -> bool:
    return planner in PURE_PLANNERS and all(
        isinstance(v, torch.Tensor) and _local(v) is not None for v in tensors.values())


def lookup(planner: str, global_ranks: list[int], tensors: dict[str, Any]) -> Pieces | None:
    """The last save's pieces if ``tensors`` (the flattened state) are the ones it listed."""
    last = _LAST
    if last is None or last.planner != planner or last.global_ranks != tuple(global_ranks):
        return None
    if len(tensors) != len(last.keys) or not _memoizable(planner, tensors):
        return None
    for (key, value), want, seen in zip(tensors.items(), last.keys, last.seen):
        if key != want or not seen.same(value):
            return None
    return last.pieces


def remember(planner: str, global_ranks: list[int], tensors: dict[str, Any],
             shards: dict[str, list[LocalShard]], rows: list[Any], digest: bytes) -> None:
    """Keep what this save listed for the next save of the same state (or forget the last
    save's, where the pieces are not each a whole local tensor)."""
    global _LAST
    _LAST = None
    if not _memoizable(planner, tensors):
        return
    boxes = {}
    for key, value in tensors.items():
        local = _local(value)
        if any(s.data is not local for s in shards[key]):
            return
        boxes[key] = [s.box for s in shards[key]]
    try:
        seen = [_Seen(v) for v in tensors.values()]
    except TypeError:  # a tensor subclass without weak references: listed every save
        return
    _LAST = _Entry(planner, tuple(global_ranks), list(tensors), seen, Pieces(boxes, rows, digest))


def clear() -> None:
    global _LAST
    _LAST = None
