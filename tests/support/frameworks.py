"""Rank functions for FSDP v1, tensor parallel, pipeline parallel and Megatron-style layouts.

Each layout's reference is gathered by that framework's own means (FSDP's FULL_STATE_DICT,
``DTensor.full_tensor()``, an all-gather of pipeline stages), never through bytecheckpoint,
and returned as ``canonical`` dicts: checkpoint key -> full tensor, plus ``hparams/<fqn>``
-> the hyperparameters of the parameter's optimizer group.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    StateDictType,
    fully_shard,
)
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import bytecheckpoint as bcp
from bytecheckpoint.state.flatten import clean_fqn
from demo.model import GPT, Block
from tests.support.helpers import same_bits
from tests.support.workloads import CFG, make_fsdp2, make_plain, train_step

Canonical = dict[str, Any]


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu().clone()


def _hparams(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


def canonical(model: nn.Module, optim: torch.optim.Optimizer,
              fqn_map: Callable[[str], str] = lambda n: n) -> Canonical:
    """Full state of a plain, DDP, FSDP2 or TP model (DTensors gathered by DTensor)."""
    out: Canonical = {}
    for name, t in model.state_dict().items():
        out[f"model/{fqn_map(clean_fqn(name))}"] = _full(t)
    names = {id(p): fqn_map(clean_fqn(n)) for n, p in model.named_parameters()}
    for group in optim.param_groups:
        for p in group["params"]:
            out[f"hparams/{names[id(p)]}"] = _hparams(group)
            for k, v in optim.state.get(p, {}).items():
                out[f"optimizer/state/{names[id(p)]}/{k}"] = _full(v)
    return out


def _fsdp1_full_optim(model: FSDP, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """FSDP's own FULL optimizer state dict.

    With ``use_orig_params=True`` on CPU, torch 2.13 returns ``exp_avg`` aliased to
    ``exp_avg_sq`` when both are gathered in one call, so each state name is gathered in a
    call of its own (the optimizer's state is restored afterwards)."""
    def gather() -> dict[str, Any]:
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                                  FullStateDictConfig(rank0_only=False),
                                  FullOptimStateDictConfig(rank0_only=False)):
            return FSDP.optim_state_dict(model, optim)

    if not any(m._use_orig_params for m in FSDP.fsdp_modules(model)):
        return gather()
    saved = {p: dict(st) for p, st in optim.state.items()}
    names = {k for st in saved.values() for k, v in st.items() if k != "step"}
    merged: dict[str, Any] = {}
    try:
        for name in sorted(names):
            for p, st in saved.items():
                optim.state[p] = {k: v for k, v in st.items() if k in ("step", name)}
            part = gather()
            for fqn, entries in part["state"].items():
                merged.setdefault(fqn, {}).update({k: _full(v) for k, v in entries.items()})
            merged_groups = part["param_groups"]
    finally:
        for p, st in saved.items():
            optim.state[p] = st
    return {"state": merged, "param_groups": merged_groups}


def canonical_fsdp1(model: FSDP, optim: torch.optim.Optimizer) -> Canonical:
    """Full state of an FSDP v1 model, all-gathered by FSDP itself."""
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                              FullStateDictConfig(rank0_only=False)):
        msd = model.state_dict()
    osd = _fsdp1_full_optim(model, optim)
    out: Canonical = {f"model/{clean_fqn(k)}": _full(v) for k, v in msd.items()}
    for fqn, entries in osd["state"].items():
        for k, v in entries.items():
            out[f"optimizer/state/{clean_fqn(fqn)}/{k}"] = _full(v)
    for group in osd["param_groups"]:
        for fqn in group["params"]:
            out[f"hparams/{clean_fqn(fqn)}"] = _hparams(group)
    return out


# -- FSDP v1 ---------------------------------------------------------------------------------

def make_fsdp1(seed: int, use_orig_params: bool, lr: float = 1e-2) -> tuple[FSDP, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = FSDP(GPT(CFG), auto_wrap_policy=ModuleWrapPolicy({Block}),
                 use_orig_params=use_orig_params, device_id=torch.device("cpu"))
    return model, torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)


def fsdp1_train_save(path: str, steps: int, use_orig_params: bool) -> Canonical:
    model, optim = make_fsdp1(0, use_orig_params)
    for step in range(steps):
        train_step(model, optim, step, dist.get_rank())
    bcp.save(path, {"model": model, "optimizer": optim}, step=steps)  # framework detected
    return canonical_fsdp1(model, optim)


def fsdp1_load(path: str, use_orig_params: bool) -> Canonical:
    model, optim = make_fsdp1(123, use_orig_params, lr=5e-4)
    result = bcp.load(path, {"model": model, "optimizer": optim}, framework="fsdp")
    assert result.framework in {"fsdp", "fsdp2", "single", "dtensor", "manual"}
    return canonical_fsdp1(model, optim)


def fsdp1_save_collectives(path: str, use_orig_params: bool) -> dict[str, int]:
    """Count every torch.distributed collective during an FSDP v1 save, split into those made
    by the planning/commit protocol (bytecheckpoint's Communicator) and any others."""
    from bytecheckpoint.planning import plan_cache
    from bytecheckpoint.runtime import comm as bcomm
    plan_cache.clear()  # a first save of this structure: the full protocol
    model, optim = make_fsdp1(0, use_orig_params)
    train_step(model, optim, 0, dist.get_rank())
    counts = {"protocol_calls": 0, "other_collectives": 0, "protocol_collectives": 0}
    inside = [0]
    names = ["all_gather", "all_gather_into_tensor", "all_gather_object", "all_reduce", "broadcast",
             "broadcast_object_list", "gather", "gather_object", "scatter", "scatter_object_list",
             "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single",
             "send", "recv", "isend", "irecv", "barrier"]
    saved_fns = {n: getattr(dist, n) for n in names}
    saved_methods = {n: getattr(bcomm.Communicator, n) for n in ("gather", "scatter", "broadcast",
                                                                  "all_gather")}

    def counting(fn: Callable) -> Callable:
        def wrapper(*a: Any, **k: Any) -> Any:
            counts["protocol_collectives" if inside[0] else "other_collectives"] += 1
            return fn(*a, **k)
        return wrapper

    def protocol(fn: Callable) -> Callable:
        def wrapper(*a: Any, **k: Any) -> Any:
            counts["protocol_calls"] += 1
            inside[0] += 1
            try:
                return fn(*a, **k)
            finally:
                inside[0] -= 1
        return wrapper

    try:
        for n, fn in saved_fns.items():
            setattr(dist, n, counting(fn))
        for n, fn in saved_methods.items():
            setattr(bcomm.Communicator, n, protocol(fn))
        bcp.save(path, {"model": model, "optimizer": optim}, framework="fsdp")
        during_save = dict(counts)
        # The counter sees FSDP's own all-gathers when they happen (a FULL_STATE_DICT).
        counts.update(other_collectives=0)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
            model.state_dict()
        during_save["full_state_dict_collectives"] = counts["other_collectives"]
    finally:
        for n, fn in saved_fns.items():
            setattr(dist, n, fn)
        for n, fn in saved_methods.items():
            setattr(bcomm.Communicator, n, fn)
    return during_save


# -- FSDP2 and plain targets ------------------------------------------------------------------

def fsdp2_load_canonical(path: str) -> Canonical:
    model, optim = make_fsdp2(seed=123, lr=5e-4)
    bcp.load(path, {"model": model, "optimizer": optim})
    return canonical(model, optim)


def fsdp2_train_save_canonical(path: str, steps: int) -> Canonical:
    model, optim = make_fsdp2(seed=0)
    for step in range(steps):
        train_step(model, optim, step, dist.get_rank())
    bcp.save(path, {"model": model, "optimizer": optim}, step=steps)
    return canonical(model, optim)


def plain_load_canonical(path: str) -> Canonical:
    """In the test process: no process group at all."""
    model, optim = make_plain(seed=123, lr=5e-4)
    bcp.load(path, {"model": model, "optimizer": optim})
    return canonical(model, optim)


def plain_train_save_canonical(path: str, steps: int) -> Canonical:
    model, optim = make_plain(seed=0)
    for step in range(steps):
        train_step(model, optim, step, 0)
    bcp.save(path, {"model": model, "optimizer": optim}, step=steps)
    return canonical(model, optim)


# -- tensor parallel (+ FSDP2 on a 2-D mesh) ------------------------------------------------

def tp_plan(prefix: str = "", layers: int = CFG.layers, embed: bool = True,
            head: bool = True) -> dict[str, Any]:
    """Megatron-style: vocab-sharded embedding and head (uneven: 251 rows), column-parallel
    MLP up-projection, row-parallel down-projection."""
    plan: dict[str, Any] = {}
    if embed:
        plan[f"{prefix}embed"] = RowwiseParallel(input_layouts=Replicate())
    if head:
        plan[f"{prefix}head"] = ColwiseParallel(output_layouts=Replicate())
    for i in range(layers):
        plan[f"{prefix}blocks.{i}.fc"] = ColwiseParallel()
        plan[f"{prefix}blocks.{i}.out"] = RowwiseParallel()
    return plan


def make_tp_dp(seed: int, dp: int, tp: int, lr: float = 1e-2) -> tuple[nn.Module, torch.optim.Optimizer]:
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(seed)
    model = GPT(CFG)
    parallelize_module(model, mesh["tp"], tp_plan())
    if dp > 1:
        for block in model.blocks:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    return model, torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)


def tp_dp_train_save(path: str, steps: int, dp: int, tp: int) -> Canonical:
    model, optim = make_tp_dp(0, dp, tp)
    dp_rank = dist.get_rank() // tp
    for step in range(steps):
        train_step(model, optim, step, dp_rank)
    bcp.save(path, {"model": model, "optimizer": optim}, step=steps)
    return canonical(model, optim)


def tp_dp_load(path: str, dp: int, tp: int) -> Canonical:
    model, optim = make_tp_dp(123, dp, tp, lr=5e-4)
    bcp.load(path, {"model": model, "optimizer": optim})
    return canonical(model, optim)


# -- pipeline parallel (stage-local layer numbers, as Megatron) ------------------------------

class Stage(nn.Module):
    """One pipeline stage of the GPT: its layers are numbered from 0 locally."""

    def __init__(self, stage: int, stages: int) -> None:
        super().__init__()
        full = GPT(CFG)
        per = CFG.layers // stages
        if stage == 0:
            self.embed, self.pos = full.embed, full.pos
        self.blocks = nn.ModuleList(full.blocks[stage * per : (stage + 1) * per])
        if stage == stages - 1:
            self.ln_f, self.head = full.ln_f, full.head


def _stage_map(stage: int, stages: int) -> Callable[[str], str]:
    return bcp.pipeline_fqn_map(stage * (CFG.layers // stages), prefix="blocks.")


def _synthetic_grads(model: nn.Module, fqn_map: Callable[[str], str], step: int) -> None:
    """Gradients that depend only on (global FQN, step), so any layout trains identically."""
    for name, p in model.named_parameters():
        fqn = fqn_map(clean_fqn(name))
        g = torch.Generator().manual_seed(step * 7919 + sum(map(ord, fqn)))
        full = torch.randn(p.shape, generator=g, dtype=p.dtype)
        p.grad = distribute_tensor(full, p.device_mesh, p.placements) if isinstance(p, DTensor) else full


def pp_tp_train_save(path: str, steps: int, pp: int, tp: int) -> Canonical:
    """PP x TP on pp*tp ranks (stage = rank // tp), synthetic gradients; returns every
    stage's canonical state merged (all-gathered by the test, not by the library)."""
    mesh = init_device_mesh("cpu", (pp, tp), mesh_dim_names=("pp", "tp"))
    stage = dist.get_rank() // tp
    torch.manual_seed(0)
    model = Stage(stage, pp)
    per = CFG.layers // pp
    if tp > 1:
        parallelize_module(model, mesh["tp"], tp_plan(layers=per, embed=stage == 0,
                                                      head=stage == pp - 1))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    fqn_map = _stage_map(stage, pp)
    for step in range(steps):
        _synthetic_grads(model, fqn_map, step)
        optim.step()
    bcp.save(path, {"model": model, "optimizer": optim}, step=steps, fqn_map=fqn_map)
    return _merged(canonical(model, optim, fqn_map))


def pp_dp_load(path: str, pp: int, dp: int) -> Canonical:
    """Load into PP x DP (FSDP2 over each stage's DP group), stage = rank // dp."""
    mesh = init_device_mesh("cpu", (pp, dp), mesh_dim_names=("pp", "dp"))
    stage = dist.get_rank() // dp
    torch.manual_seed(123)
    model = Stage(stage, pp)
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    optim = torch.optim.AdamW(model.parameters(), lr=5e-4, weight_decay=0.1)
    fqn_map = _stage_map(stage, pp)
    bcp.load(path, {"model": model, "optimizer": optim}, fqn_map=fqn_map)
    return _merged(canonical(model, optim, fqn_map))


def _merged(mine: Canonical) -> Canonical:
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    merged: Canonical = {}
    for part in everyone:
        for k, v in part.items():
            if k in merged and isinstance(v, torch.Tensor):
                assert same_bits(merged[k], v), f"{k} differs between ranks"
            merged[k] = v
    return merged


# -- Megatron-style manual spec: TP-sharded model, flattened DP-sharded distributed optimizer --

MEG_LAYERS, MEG_H = 2, 6
# key -> (per-layer shape, TP-split axis or None for replicated)
MEG_PARAMS = {
    "decoder.layers.mlp.linear_fc1.weight": ((4 * MEG_H, MEG_H), 0),
    "decoder.layers.mlp.linear_fc1.bias": ((4 * MEG_H,), 0),
    "decoder.layers.mlp.linear_fc2.weight": ((MEG_H, 4 * MEG_H), 1),
    "decoder.layers.mlp.linear_fc2.bias": ((MEG_H,), None),
    "decoder.layers.input_layernorm.weight": ((MEG_H,), None),
}
MEG_STATES = ("param", "exp_avg", "exp_avg_sq")


def megatron_reference() -> dict[str, torch.Tensor]:
    """Global tensors (layers stacked on a prepended axis): weights and optimizer states."""
    out = {}
    for key, (shape, _) in MEG_PARAMS.items():
        for name in ("weight", *MEG_STATES):
            g = torch.Generator().manual_seed(sum(map(ord, key + name)))
            out[f"{key}/{name}"] = torch.randn((MEG_LAYERS, *shape), generator=g)
    return out


def _meg_local(shape: tuple[int, ...], axis: int | None, tp_rank: int, tp: int) -> tuple[slice, ...]:
    if axis is None:
        return tuple(slice(None) for _ in shape)
    n = shape[axis] // tp
    return tuple(slice(tp_rank * n, (tp_rank + 1) * n) if d == axis else slice(None)
                 for d in range(len(shape)))


def megatron_state(tp: int, dp: int, fill: torch.Tensor | None = None) -> tuple[dict[str, Any], list]:
    """This rank's Megatron-style sharded state dict (rank = dp_rank * tp + tp_rank).

    Model weights are megatron-core ``ShardedTensor`` objects (one per layer, prepended layer
    axis, replica id = DP rank). The distributed optimizer concatenates this TP rank's local
    parameters into one flat buffer, pads it to a multiple of ``dp`` and gives each DP rank
    an even slice; each parameter's part of that slice is a ``TensorShard`` with a flattened
    range. ``fill`` replaces every value (a load target). Returns the state and a record of
    (key, global offset, local shape, flat range, data) for reassembling by hand.
    """
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    rank = dist.get_rank() if dist.is_initialized() else 0
    tp_rank, dp_rank = rank % tp, rank // tp
    ref = megatron_reference()
    record: list = []
    model: dict[str, Any] = {}
    for key, (shape, axis) in MEG_PARAMS.items():
        sl = _meg_local(shape, axis, tp_rank, tp)
        for layer in range(MEG_LAYERS):
            local = ref[f"{key}/weight"][layer][sl].clone()
            if fill is not None:
                local.fill_(float(fill))
            offsets = [(0, layer, MEG_LAYERS)] + ([(1 + axis, tp_rank, tp)] if axis is not None else [])
            model[f"{key}.{layer}"] = ShardedTensor.from_rank_offsets(
                f"{key}/weight", local.unsqueeze(0), *offsets, replica_id=(0, 0, dp_rank))
            record.append((f"{key}/weight", layer, sl, None, local))
    # The distributed optimizer's flat buffer over this TP rank's local parameters.
    layout = []  # (key, layer, local slices, local shape, start in buffer)
    cursor = 0
    for key, (shape, axis) in MEG_PARAMS.items():
        sl = _meg_local(shape, axis, tp_rank, tp)
        local_shape = tuple(ref[f"{key}/weight"][0][sl].shape)
        for layer in range(MEG_LAYERS):
            layout.append((key, layer, sl, local_shape, cursor))
            cursor += int(torch.Size(local_shape).numel())
    per_dp = -(-cursor // dp)
    lo, hi = dp_rank * per_dp, min(cursor, (dp_rank + 1) * per_dp)
    optim: dict[str, Any] = {"state": {}, "step": 7, "param_groups": [{"lr": 3e-4, "betas": [0.9, 0.95]}]}
    for name in MEG_STATES:
        buffer = torch.empty(per_dp)  # this DP rank's slice of the flat buffer
        for key, layer, sl, local_shape, start in layout:
            n = int(torch.Size(local_shape).numel())
            a, b = max(lo, start), min(hi, start + n)
            if a >= b:
                continue
            values = ref[f"{key}/{name}"][layer][sl].reshape(-1)[a - start : b - start]
            view = buffer[a - lo : b - lo]
            view.copy_(values if fill is None else torch.full_like(values, float(fill)))
            offset = [layer] + [s.start or 0 for s in sl]
            optim["state"].setdefault(key, {}).setdefault(name, []).append(bcp.TensorShard(
                view, (MEG_LAYERS, *MEG_PARAMS[key][0]), tuple(offset), (1, *local_shape),
                (a - start, b - start), replica_id=0))
            record.append((f"{key}/{name}", layer, sl, (a - start, b - start), view))
    return {"model": model, "optimizer": optim}, record


def megatron_save(path: str, tp: int, dp: int) -> None:
    state, _ = megatron_state(tp, dp)
    bcp.save(path, state, framework="megatron")


def megatron_load(path: str, tp: int, dp: int) -> dict[str, Any]:
    """Load into another TP x DP layout; return every global tensor reassembled by hand
    from all ranks' local buffers (NaN wherever nothing was loaded)."""
    state, record = megatron_state(tp, dp, fill=torch.tensor(float("nan")))
    state["optimizer"]["step"] = -1
    bcp.load(path, state)
    mine = [(k, layer, sl, rng, t.clone()) for k, layer, sl, rng, t in record]
    everyone: list[Any] = [None] * (dist.get_world_size() if dist.is_initialized() else 1)
    if dist.is_initialized():
        dist.all_gather_object(everyone, mine)
    else:
        everyone = [mine]
    full: dict[str, torch.Tensor] = {}
    for part in everyone:
        for key, layer, sl, rng, data in part:
            shape = MEG_PARAMS[key.split("/")[0]][0]
            g = full.setdefault(key, torch.full((MEG_LAYERS, *shape), float("nan")))
            target = g[layer][sl]
            if rng is None:
                target.copy_(data)
            else:
                flat = target.reshape(-1).clone()
                flat[rng[0] : rng[1]] = data
                target.copy_(flat.view(target.shape))
    return {"tensors": full, "step": state["optimizer"]["step"],
            "param_groups": state["optimizer"]["param_groups"]}
