"""FSDP v1 (``FullyShardedDataParallel``), with ``use_orig_params`` True or False.

FSDP v1 concatenates a wrapped module's parameters into one flat parameter and gives each
rank an even 1-D slice of it, so a rank's slice starts and ends in the middle of original
tensors (paper §3.2, Fig. 7). Instead of all-gathering (what ``FULL_STATE_DICT`` does) each
original parameter's part of the local slice becomes a :class:`TensorShard` with a flat
range, which is decomposed into at most ``2 * ndim - 1`` regular boxes. Saving therefore
communicates nothing beyond planning; loading writes straight into the flat shard through
views. Optimizer state follows the same slices: per flat parameter (``use_orig_params=False``)
or per original parameter (``use_orig_params=True``, each a 1-D slice of its own).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from ..errors import UnsupportedStateError
from ..state.flatten import FqnMap, ModuleAdapter, StateView, clean_fqn, register_module_adapter
from ..state.tensor_shard import TensorShard, flat_shard
from .ddp import DDPPlanner


@dataclass(frozen=True)
class _OrigParam:
    fqn: str
    shape: tuple[int, ...]
    offset_in_shard: int  # where its elements start in the rank's flat shard
    start: int  # its first element held here, in its own flattened order
    stop: int  # one past its last element held here


def _fsdp_units(root: nn.Module) -> Iterator[tuple[str, Any]]:
    """(cleaned module prefix, flat-parameter handle) of every FSDP unit that owns params."""
    for name, module in root.named_modules():
        if isinstance(module, FSDP) and module._handle is not None:
            yield clean_fqn(name), module._handle


def _local_shard(handle: Any) -> torch.Tensor:
    flat = handle.flat_param
    local = getattr(flat, "_local_shard", None)
    if local is None:
        return flat.data
    if flat.data.data_ptr() != local.data_ptr():
        raise UnsupportedStateError(
            "an FSDP flat parameter is unsharded right now (inside forward/backward or "
            "summon_full_params); call save()/load() between training steps"
        )
    return local


def _orig_params(prefix: str, handle: Any, fqn_map: FqnMap) -> list[_OrigParam]:
    flat = handle.flat_param
    out = []
    for fqn, shape, info in zip(flat._fqns, flat._shapes, flat._shard_param_infos):
        full = clean_fqn(f"{prefix}.{fqn}" if prefix else fqn)
        if info.in_shard:
            start, stop = info.intra_param_start_idx, info.intra_param_end_idx + 1
            offset = info.offset_in_shard
        else:
            start = stop = offset = 0
        out.append(_OrigParam(fqn_map(full), tuple(shape), offset, start, stop))
    return out


def _aliases(prefix: str, handle: Any, fqn_map: FqnMap) -> list[tuple[str, str]]:
    """(alias fqn, primary fqn) for parameters shared between modules (tied weights)."""
    out = []
    for info in handle.flat_param._shared_param_infos or ():
        alias = f"{info.module_name}.{info.param_name}" if info.module_name else info.param_name
        primary = (f"{info.prim_module_name}.{info.prim_param_name}" if info.prim_module_name
                   else info.prim_param_name)
        join = (lambda n: f"{prefix}.{n}") if prefix else (lambda n: n)
        out.append((fqn_map(clean_fqn(join(alias))), fqn_map(clean_fqn(join(primary)))))
    return out


def _param_shard(local: torch.Tensor, p: _OrigParam) -> TensorShard:
    data = local[p.offset_in_shard : p.offset_in_shard + (p.stop - p.start)]
    return flat_shard(data, p.shape, p.start, p.stop)


def _persistent_buffers(root: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    for name, module in root.named_modules():
        skip = getattr(module, "_non_persistent_buffers_set", set())
        for bname, buf in module._buffers.items():
            if buf is not None and bname not in skip:
                yield clean_fqn(f"{name}.{bname}" if name else bname), buf


class FSDPAdapter(ModuleAdapter):
    name = "fsdp"

    def matches(self, module: nn.Module) -> bool:
        return any(isinstance(m, FSDP) for m in module.modules())

    def entries(self, module: nn.Module, fqn_map: FqnMap, *, keep_vars: bool = False
                ) -> dict[str, tuple[str, Any]]:
        out: dict[str, tuple[str, Any]] = {}  # shards of the flat parameters: keep_vars is moot
        for prefix, handle in _fsdp_units(module):
            local = _local_shard(handle)
            shards = {p.fqn: _param_shard(local, p) for p in _orig_params(prefix, handle, fqn_map)}
            for p_fqn, shard in shards.items():
                out[p_fqn] = (p_fqn, shard)
            for alias, primary in _aliases(prefix, handle, fqn_map):
                out[alias] = (alias, shards[primary])
        for fqn, buf in _persistent_buffers(module):  # FSDP leaves buffers whole on every rank
            out[fqn_map(fqn)] = (fqn, buf)
        return out

    def param_views(self, module: nn.Module, fqn_map: FqnMap) -> dict[int, list[tuple[str, StateView]]]:
        views: dict[int, list[tuple[str, StateView]]] = {}
        for prefix, handle in _fsdp_units(module):
            flat = handle.flat_param
            originals = _orig_params(prefix, handle, fqn_map)
            if handle._use_orig_params:
                for param, p in zip(flat._params, originals):
                    views[id(param)] = [(p.fqn, _orig_view(param, p))]
            else:
                n_local = _local_shard(handle).numel()
                views[id(flat)] = [(p.fqn, _flat_view(n_local, p)) for p in originals]
        return views


def _flat_view(n_local: int, p: _OrigParam) -> StateView:
    """State of a whole flat parameter (e.g. ``exp_avg``) -> this original parameter's part;
    anything not shaped like the flat shard (``step``) is per-parameter as it is."""

    def view(t: torch.Tensor) -> torch.Tensor | TensorShard:
        if t.dim() == 1 and t.numel() == n_local:
            return _param_shard(t, p)
        return t

    return view


def _orig_view(param: torch.Tensor, p: _OrigParam) -> StateView:
    """State of an original parameter, which FSDP holds as its 1-D local slice."""

    def view(t: torch.Tensor) -> torch.Tensor | TensorShard:
        if t.dim() == 1 and t.numel() == p.stop - p.start and tuple(t.shape) == tuple(param.shape):
            return flat_shard(t, p.shape, p.start, p.stop)
        return t

    return view


class FSDPPlanner(DDPPlanner):
    """Flat-parameter slices arrive as TensorShards (see the adapter); buffers and scalar
    optimizer state are whole on every rank and deduplicated like DDP's."""

    name = "fsdp"


register_module_adapter(FSDPAdapter())
