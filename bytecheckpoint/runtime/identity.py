"""Telemetry events name the rank that emitted them, and its place in the parallel layout.

The telemetry context takes ``rank`` and ``world_size`` from ``RANK`` / ``WORLD_SIZE``, which
torchrun sets. A job started otherwise (``mp.spawn``, ``init_process_group(rank=...)``) has
neither, and its events carried no rank: the per-rank heatmap left them out and the
slow-rank rule could not name the slow rank. Saves, loads and the manager stamp the process
group's global rank instead, which is also the rank a checkpoint's files are named by.

The heatmap lays ranks out by their ``dp`` / ``tp`` / ``pp`` coordinates. A program may set
them (``telemetry.set_context``); where it has not, a save or load whose state holds DTensors
reads them from the device mesh, when its dimensions carry the usual names (``AXIS_NAMES``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from telemetry import get_context, set_context

# Mesh dimension names (compared in lower case) read as each telemetry axis. Several
# data-parallel dimensions (HSDP's replicate and shard groups) make one dp index, row-major
# in the mesh's order; a dimension of any other name (cp, ep) is left out.
AXIS_NAMES: dict[str, frozenset[str]] = {
    "dp": frozenset({"dp", "data", "ddp", "fsdp", "hsdp", "dp_replicate", "dp_shard",
                     "replicate", "shard"}),
    "tp": frozenset({"tp", "tensor", "model"}),
    "pp": frozenset({"pp", "pipeline", "pipe", "stage"}),
}
# The axes stamp_topology set, and to what: it replaces only its own values, never the
# program's.
_stamped: dict[str, int] = {}


def stamp_rank() -> None:
    """Put this process's global rank and world size on its telemetry events, from the
    default process group when there is one (a launcher's ``RANK`` that disagrees with it
    is overridden: the group is what the checkpoint's ranks are)."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    rank, world = dist.get_rank(), dist.get_world_size()
    context = get_context()
    if context.get("rank") != rank or context.get("world_size") != world:
        set_context(rank=rank, world_size=world)


def axes_of(names: Sequence[str], coordinate: Sequence[int], sizes: Sequence[int]) -> dict[str, int]:
    """This rank's dp / tp / pp index from its coordinate in a mesh with dimension ``names``
    and ``sizes``; an axis no dimension is named for is left out."""
    axes: dict[str, int] = {}
    for axis, aliases in AXIS_NAMES.items():
        dims = [i for i, name in enumerate(names) if str(name).lower() in aliases]
        if not dims:
            continue
        index = 0
        for i in dims:
            index = index * sizes[i] + coordinate[i]
        axes[axis] = index
    return axes


def stamp_topology(tensors: Iterable[Any]) -> None:
    """Put this rank's dp / tp / pp on its telemetry events from the device mesh of the first
    DTensor among ``tensors`` (the whole mesh it was cut from, so that a stage's sub-mesh
    still gives its pp), where the program has not set them itself."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed support
        return
    mesh = next((t.device_mesh for t in tensors if isinstance(t, DTensor)), None)
    if mesh is None:
        return
    try:
        axes = _mesh_axes(_root_of(mesh)) or _mesh_axes(mesh)
    except Exception:  # telemetry never fails a save or a load
        return
    context = get_context()
    updates: dict[str, int | None] = {
        axis: index for axis, index in axes.items()
        if context.get(axis) != index and context.get(axis) in (None, _stamped.get(axis))}
    # an axis this mesh does not name, stamped from an earlier one: unset
    updates.update({axis: None for axis, index in _stamped.items()
                    if axis not in axes and context.get(axis) == index})
    if updates:
        for axis, index in updates.items():
            if index is None:
                _stamped.pop(axis, None)
            else:
                _stamped[axis] = index
        set_context(**updates)


def state_tensors(state: Any, _seen: set[int] | None = None, _depth: int = 0) -> Iterator[Any]:
    """The tensors a save or load is handed, found without flattening it: in mappings, lists
    and tuples, a module's parameters and buffers and an optimizer's parameters (a lazy walk,
    so ``stamp_topology`` stops at the first DTensor). The state's first events (a load's
    metadata read, a save's first storage calls) come before the flattening, and carried no
    dp / tp / pp, or an earlier mesh's, without it. Values nested deeper than
    ``_MAX_WALK_DEPTH`` are not walked: a very deep plain value raised a raw RecursionError
    here, before the codec could refuse it by name."""
    seen = set() if _seen is None else _seen
    if id(state) in seen or _depth > _MAX_WALK_DEPTH:
        return
    seen.add(id(state))
    if isinstance(state, torch.Tensor):
        yield state
    elif isinstance(state, torch.nn.Module):
        yield from state.parameters()
        yield from state.buffers()
    elif isinstance(state, torch.optim.Optimizer):
        for group in state.param_groups:
            yield from group.get("params", ())
    elif isinstance(state, Mapping):
        for value in state.values():
            yield from state_tensors(value, seen, _depth + 1)
    elif isinstance(state, (list, tuple)):
        for value in state:
            yield from state_tensors(value, seen, _depth + 1)


_MAX_WALK_DEPTH = 64  # real states nest a handful of levels


def _root_of(mesh: Any) -> Any:
    get_root = getattr(mesh, "_get_root_mesh", None)  # private in torch 2.13; the mesh if absent
    root = get_root() if callable(get_root) else None
    return root if root is not None else mesh


def _mesh_axes(mesh: Any) -> dict[str, int]:
    names, coordinate = mesh.mesh_dim_names, mesh.get_coordinate()
    if not names or coordinate is None:  # unnamed, or this rank is not in it
        return {}
    return axes_of(names, coordinate, tuple(mesh.shape))
