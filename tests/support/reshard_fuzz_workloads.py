"""Rank functions and case builders for tests/distributed/test_fuzz_resharding.py.

A case is plain data drawn in the parent (so a failure prints as a replayable case): tensors
with a shape, a dtype and a layout for the save and for each load. Layouts:

- ``("dtensor", mesh_shape, placements)``: a DTensor on a mesh of the first ranks of the group,
  placements ``("S", dim)`` or ``("R",)`` (uneven shards when a dim does not divide);
- ``("replicated",)``: the full tensor as a plain tensor on every rank (``("strided",)``: laid
  out with its dims reversed, a load target that is not contiguous);
- ``("boxes", per_rank)``: hand-described :class:`TensorShard` boxes, ``per_rank[r]`` a list of
  ``(offset, lengths, replica_id)`` (several on one rank make a ``ShardSet``; none: no key);
- ``("flat", per_rank)``: FSDP-style flat irregular shards, ``per_rank[r]`` a list of
  ``(box_offset, box_lengths, start, stop)`` flat ranges of a box (a distributed optimizer's
  slice of a TP shard when the box is not the whole tensor).

Every rank builds the reference full tensors from the case's seed (NaNs with payloads, inf,
-0.0, subnormals: random bytes), saves in the save layout on a group of the first
``save_world`` ranks, then loads every load layout on a group of its first ``world`` ranks into
targets filled with the complement of the reference bytes, and returns every local piece that
differs bit for bit from the reference slice (a load's targets are a module's buffers with
``modules``, else a dict). Optimizer-like nested dicts (``exp_avg`` with
its parameter's layout, a 0-d ``step``, param groups) go along when ``optim`` is set.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

import bytecheckpoint as bcp
from bytecheckpoint.errors import CheckpointError
from bytecheckpoint.state.tensor_shard import TensorShard
from tests.support.helpers import same_bits

DTYPES = {
    "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
    "float64": torch.float64, "int64": torch.int64, "int8": torch.int8, "bool": torch.bool,
    "uint8": torch.uint8, "complex64": torch.complex64,
}

_GROUPS: dict[int, Any] = {}
_MESHES: dict[tuple[int, ...], DeviceMesh] = {}


# -- reference values ----------------------------------------------------------------------------

def reference(seed: int, shape: tuple[int, ...], dtype: str) -> torch.Tensor:
    """Random bytes viewed as ``dtype`` (every bit pattern: NaN payloads, inf, -0.0,
    subnormals), with -0.0, inf and NaN placed at the start of float tensors."""
    dt = DTYPES[dtype]
    g = torch.Generator().manual_seed(seed)
    n = math.prod(shape)
    if dt is torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    raw = torch.randint(0, 256, (n * dt.itemsize,), dtype=torch.uint8, generator=g)
    out = raw.view(dt).reshape(shape).clone()
    if dt.is_floating_point and n:
        flat = out.view(-1)
        for i, v in enumerate((-0.0, float("inf"), float("nan"), float("-inf"))[:n]):
            flat[i] = v
    return out


def complement(t: torch.Tensor) -> torch.Tensor:
    """A tensor every byte of which differs from ``t``'s: an unwritten element shows."""
    if t.dtype is torch.bool:
        return t.logical_not()
    return (~t.reshape(-1).view(torch.uint8)).view(t.dtype).reshape(t.shape).clone()


# -- groups and meshes (created in the same order on every rank) ---------------------------------

def group(n: int) -> Any:
    """The group of ranks ``0..n-1`` (every rank of the pool takes part in creating it)."""
    if n not in _GROUPS:
        _GROUPS[n] = dist.new_group(list(range(n)))
    return _GROUPS[n]


def mesh(shape: tuple[int, ...]) -> DeviceMesh:
    if shape not in _MESHES:
        _MESHES[shape] = DeviceMesh("cpu", torch.arange(math.prod(shape)).reshape(shape))
    return _MESHES[shape]


def prepare(case: dict[str, Any]) -> None:
    """Create every group and mesh the case uses, on every rank, in one order."""
    worlds = sorted({case["save_world"], *(load["world"] for load in case["loads"])})
    for n in worlds:
        group(n)
    shapes = []
    for spec in case["tensors"]:
        for layout in (spec["save"], *spec["loads"]):
            if layout[0] == "dtensor" and tuple(layout[1]) not in shapes:
                shapes.append(tuple(layout[1]))
    for shape in sorted(shapes):
        mesh(shape)


# -- building values in a layout -----------------------------------------------------------------

def _placements(raw: Any) -> list[Any]:
    return [Shard(p[1]) if p[0] == "S" else Replicate() for p in raw]


def build(ref: torch.Tensor, layout: Any, rank: int, fill: bool) -> Any:
    """This rank's value of ``ref`` in ``layout`` (its values, or their complement when not
    ``fill``), or None when the rank holds none of it."""
    source = ref if fill else complement(ref)
    kind = layout[0]
    if kind == "replicated":
        return source.clone()
    if kind == "strided":  # the full tensor, its dims laid out in reverse (not contiguous)
        dims = tuple(reversed(range(source.ndim)))
        return source.permute(dims).contiguous().permute(dims)
    if kind == "dtensor":
        m = mesh(tuple(layout[1]))
        if m.get_coordinate() is None:
            return None
        placements = _placements(layout[2])
        lengths, offset = compute_local_shape_and_global_offset(tuple(ref.shape), m, placements)
        local = source[tuple(slice(o, o + n) for o, n in zip(offset, lengths))].clone()
        return DTensor.from_local(local, m, placements, run_check=False, shape=ref.shape,
                                  stride=ref.stride())
    mine = layout[1][rank] if rank < len(layout[1]) else []
    shards = [_shard(source, kind, piece) for piece in mine]
    if not shards:
        return None
    return shards[0] if len(shards) == 1 else shards


def _shard(source: torch.Tensor, kind: str, piece: Any) -> TensorShard:
    shape = tuple(source.shape)
    if kind == "boxes":
        offset, lengths, replica = piece
        data = source[tuple(slice(o, o + n) for o, n in zip(offset, lengths))].clone()
        return TensorShard(data, shape, tuple(offset), tuple(lengths), None, replica)
    offset, lengths, start, stop = piece
    box = source[tuple(slice(o, o + n) for o, n in zip(offset, lengths))]
    data = box.contiguous().reshape(-1)[start:stop].clone()
    return TensorShard(data, shape, tuple(offset), tuple(lengths), (start, stop))


def expected_of(ref: torch.Tensor, value: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(loaded, expected) pairs for every local piece of ``value``."""
    if isinstance(value, DTensor):
        m = value.device_mesh
        lengths, offset = compute_local_shape_and_global_offset(tuple(ref.shape), m, value.placements)
        return [(value.to_local(), ref[tuple(slice(o, o + n) for o, n in zip(offset, lengths))])]
    if isinstance(value, torch.Tensor):
        return [(value, ref)]
    out = []
    for shard in value if isinstance(value, list) else [value]:
        box = ref[tuple(slice(o, o + n) for o, n in zip(shard.global_offset, shard.local_shape))]
        if shard.flat_range is None:
            out.append((shard.data, box))
        else:
            start, stop = shard.flat_range
            out.append((shard.data, box.contiguous().reshape(-1)[start:stop]))
    return out


# -- one case on every rank ----------------------------------------------------------------------

def _model(values: dict[str, Any], as_module: bool) -> Any:
    """A module of the DTensors and plain tensors (buffers), or, on a rank that holds
    hand-described shards (or for a load into a dict), a (sharded) dict."""
    if not as_module or any(not isinstance(v, torch.Tensor) for v in values.values()):
        return values
    module = nn.Module()
    for name, value in values.items():
        module.register_buffer(name, value)
    return module


def _anchor_layout(world: int) -> tuple:
    return ("boxes", [[((r * 4 // world, 0), ((r + 1) * 4 // world - r * 4 // world, 2), 0)]
                      for r in range(world)])


def _state(case: dict[str, Any], which: int | None, rank: int, fill: bool) -> dict[str, Any]:
    """The state in the save layout (``which`` None) or load ``which``'s layout."""
    model: dict[str, Any] = {}
    optim_state: dict[str, Any] = {}
    for i, spec in enumerate(case["tensors"]):
        layout = spec["save"] if which is None else spec["loads"][which]
        shape, dtype = tuple(spec["shape"]), spec["dtype"]
        value = build(reference(case["seed"] + 2 * i, shape, dtype), layout, rank, fill)
        if value is not None:
            model[spec["name"]] = value
        if case["optim"]:
            entry: dict[str, Any] = {"step": torch.tensor(float(i + 1) if fill else -1.0)}
            moment = build(reference(case["seed"] + 2 * i + 1, shape, dtype), layout, rank, fill)
            if moment is not None:
                entry["exp_avg"] = moment
            optim_state[spec["name"]] = entry
    state: dict[str, Any] = {"model": _model(model, which is None or case.get("modules", False))}
    if case["optim"]:
        names = [s["name"] for s in case["tensors"]]
        # A Megatron-style sharded optimizer dict: one row of ``anchor`` per rank keeps it one.
        world = case["save_world"] if which is None else case["loads"][which]["world"]
        anchor = build(reference(case["seed"] - 1, (4, 2), "float32"), _anchor_layout(world), rank, fill)
        state["optim"] = {"state": optim_state, "anchor": anchor,
                          "param_groups": [{"lr": 0.5 if fill else 0.0, "params": names}]}
    return state


def compare(case: dict[str, Any], state: dict[str, Any]) -> list[str]:
    """Every local piece of ``state`` that differs from the reference, by name."""
    bad = []
    for i, spec in enumerate(case["tensors"]):
        shape, dtype, name = tuple(spec["shape"]), spec["dtype"], spec["name"]
        model = state["model"]
        held = dict(model.named_buffers()) if isinstance(model, nn.Module) else model
        checks = [("model", held.get(name), case["seed"] + 2 * i)]
        if case["optim"]:
            entry = state["optim"]["state"][name]
            checks.append(("exp_avg", entry.get("exp_avg"), case["seed"] + 2 * i + 1))
            if not same_bits(entry["step"], torch.tensor(float(i + 1))):
                bad.append(f"{name}.step={entry['step']}")
        for what, value, seed in checks:
            if value is None:
                continue
            ref = reference(seed, shape, dtype)
            for k, (got, want) in enumerate(expected_of(ref, value)):
                if not same_bits(got, want):
                    bad.append(f"{what} {name} piece {k}: got {got.reshape(-1)[:6].tolist()} "
                               f"want {want.reshape(-1)[:6].tolist()}")
    if case["optim"]:
        if state["optim"]["param_groups"][0]["lr"] != 0.5:
            bad.append(f"param_groups lr={state['optim']['param_groups'][0]['lr']}")
        anchor = reference(case["seed"] - 1, (4, 2), "float32")
        if not all(same_bits(g, e) for g, e in expected_of(anchor, state["optim"]["anchor"])):
            bad.append("optim anchor")
    return bad


def run_case(path: str, case: dict[str, Any]) -> dict[str, Any]:
    """Save ``case`` at ``path`` on its save group, load each load layout on its group; per
    load, this rank's mismatches, or the error's type and message (a raw error is re-raised)."""
    rank = dist.get_rank()
    prepare(case)
    out: dict[str, Any] = {"save": None, "loads": []}
    if rank < case["save_world"]:
        try:
            bcp.save(path, _state(case, None, rank, fill=True), process_group=group(case["save_world"]))
        except CheckpointError as exc:
            out["save"] = f"{type(exc).__name__}: {exc}"
    saved = [None] * dist.get_world_size()
    dist.all_gather_object(saved, out["save"])
    for i, load in enumerate(case["loads"]):
        if rank >= load["world"] or any(saved):
            out["loads"].append(None)
            continue
        target = _state(case, i, rank, fill=False)
        try:
            bcp.load(path, target, process_group=group(load["world"]), verify=load.get("verify", True))
        except CheckpointError as exc:
            out["loads"].append(f"{type(exc).__name__}: {exc}")
            continue
        out["loads"].append(compare(case, target))
    dist.barrier()
    return out


def load_in_process(path: str, case: dict[str, Any]) -> list[str]:
    """Load ``case``'s checkpoint into plain full tensors with no process group."""
    plain = dict(case, tensors=[dict(s, loads=[("replicated",)]) for s in case["tensors"]])
    target = _state(plain, 0, 0, fill=False)
    bcp.load(path, target)
    return compare(plain, target)


# -- regressions ---------------------------------------------------------------------------------

def _group_of(ranks: tuple[int, ...]) -> Any:
    if ranks not in _GROUPS:
        _GROUPS[ranks] = dist.new_group(list(ranks))
    return _GROUPS[ranks]


def overlapping_subgroup_saves(root: str) -> list[str]:
    """Ranks 1 and 2 save on their group, then ranks 1, 2 and 3 on theirs, and load it: the
    second save's members have made different numbers of groups (the first save's own group).
    Returns this rank's mismatches."""
    rank = dist.get_rank()
    groups = {ranks: _group_of(ranks) for ranks in ((1, 2), (1, 2, 3))}
    bad: list[str] = []
    for ranks, g in groups.items():
        if rank not in ranks:
            continue
        n = len(ranks)
        case = {"seed": n, "save_world": n, "loads": [{"world": n}], "optim": False,
                "tensors": [{"name": "w", "shape": (len(ranks), 3), "dtype": "float32",
                             "save": ("boxes", [[((r, 0), (1, 3), 0)] for r in range(len(ranks))]),
                             "loads": [("replicated",)]}]}
        path = f"{root}/{len(ranks)}"
        bcp.save(path, _state(case, None, ranks.index(rank), fill=True), process_group=g)
        target = _state(case, 0, ranks.index(rank), fill=False)
        bcp.load(path, target, process_group=g)
        bad += compare(case, target)
    dist.barrier()
    return bad
