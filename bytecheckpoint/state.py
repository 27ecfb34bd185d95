"""Turning a user's ``state`` dict into keyed tensors and packed objects, and back.

Keys are ``<top-level key>/<path>``: ``model/layers.0.attn.qkv.weight`` or
``optimizer/state/layers.0.attn.qkv.weight/exp_avg``. Optimizer state is keyed by parameter
FQN, never by position, so it survives any change of layout. Tensors are the live tensors of
the module/optimizer (loads copy into them in place); non-tensor values are packed objects:
those of modules and optimizers are the same on every rank and saved once, anything else
(extra state, schedulers, user objects) is saved per rank.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .errors import StateMismatchError, UnsupportedStateError

# Names that wrappers (torch.compile, activation checkpointing, FSDP v1) insert into FQNs;
# they are reserved by PyTorch, so dropping them anywhere cannot collide with a user name.
_WRAPPER_SEGMENTS = frozenset({"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"})

KIND_MODEL = "model"
KIND_OPTIM = "optim"
KIND_EXTRA = "extra"


def clean_fqn(name: str) -> str:
    """Drop wrapper segments (``torch.compile``'s ``_orig_mod``, checkpoint wrappers)."""
    return ".".join(p for p in name.split(".") if p not in _WRAPPER_SEGMENTS)


def unwrap(module: nn.Module) -> nn.Module:
    """The user's model inside DDP / ``torch.compile`` wrappers, so FQNs match any layout."""
    while True:
        if isinstance(module, DistributedDataParallel):
            module = module.module
        elif hasattr(module, "_orig_mod") and isinstance(module._orig_mod, nn.Module):
            module = module._orig_mod
        else:
            return module


@dataclass
class FlatState:
    """A state dict flattened into keyed tensors and objects, plus how to put it back."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    kinds: dict[str, str] = field(default_factory=dict)  # top-level key -> storage kind
    shared_objects: dict[str, Any] = field(default_factory=dict)  # saved once (rank 0)
    rank_objects: dict[str, Any] = field(default_factory=dict)  # saved by every rank
    # Shared-object keys under these prefixes are taken on load even though the target
    # cannot list them in advance (non-tensor optimizer state, e.g. a float step).
    accept_prefixes: list[str] = field(default_factory=list)
    # Called after a load has filled ``tensors`` in place, with the loaded objects.
    appliers: list[Callable[[dict[str, Any], dict[str, Any]], None]] = field(default_factory=list)

    def kind_of(self, key: str) -> str:
        return self.kinds[key.split("/", 1)[0]]


def _module_for(optimizer: torch.optim.Optimizer, modules: dict[str, nn.Module], key: str) -> nn.Module:
    wanted = {id(p) for g in optimizer.param_groups for p in g["params"]}
    for module in modules.values():
        if wanted <= {id(p) for p in module.parameters()}:
            return module
    raise UnsupportedStateError(
        f"state[{key!r}] is an optimizer whose parameters are not all in one module of the "
        "state; put the model it optimizes in the same state dict (e.g. state['model'])"
    )


def param_fqns(module: nn.Module) -> dict[int, str]:
    named = unwrap(module).named_parameters(remove_duplicate=False)
    return {id(p): clean_fqn(name) for name, p in named}


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create an optimizer's state tensors (so a load can fill them in place).

    One step with zero gradients and a zero learning rate allocates every state tensor
    without changing a parameter; the loaded values then overwrite all of it.
    """
    if optimizer.state:
        return
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    saved_grads = [p.grad for p in params]
    lrs = []
    for g in optimizer.param_groups:
        lrs.append(g.get("lr"))
        if "lr" in g:
            g["lr"] = torch.tensor(0.0) if isinstance(g["lr"], torch.Tensor) else 0.0
    try:
        for p in params:
            p.grad = torch.zeros_like(p)
        optimizer.step()
    finally:
        for g, lr in zip(optimizer.param_groups, lrs):
            if lr is not None:
                g["lr"] = lr
        for p, grad in zip(params, saved_grads):
            p.grad = grad


def _flatten_module(key: str, module: nn.Module, flat: FlatState) -> None:
    flat.kinds[key] = KIND_MODEL
    module = unwrap(module)
    raw_names: dict[str, str] = {}
    for name, value in module.state_dict().items():
        fqn = clean_fqn(name)
        raw_names[fqn] = name
        if isinstance(value, torch.Tensor):
            flat.tensors[f"{key}/{fqn}"] = value
        else:
            flat.shared_objects[f"{key}/{fqn}"] = value

    def apply(shared: dict[str, Any], _rank: dict[str, Any]) -> None:
        extra = {raw_names[k[len(key) + 1 :]]: v for k, v in shared.items()
                 if k.startswith(f"{key}/") and k[len(key) + 1 :] in raw_names}
        if extra:  # non-tensor entries (e.g. _extra_state) go back through the module
            module.load_state_dict(extra, strict=False)

    flat.appliers.append(apply)


def _flatten_optimizer(
    key: str, optimizer: torch.optim.Optimizer, module: nn.Module, flat: FlatState, for_load: bool,
    has_saved_state: Callable[[str], bool],
) -> None:
    flat.kinds[key] = KIND_OPTIM
    fqn_of = param_fqns(module)
    order: list[tuple[int, torch.Tensor, str]] = []
    for g in optimizer.param_groups:
        for p in g["params"]:
            order.append((len(order), p, fqn_of[id(p)]))
    if for_load and has_saved_state(f"{key}/state/"):
        init_optimizer_state(optimizer)
    for _, p, fqn in order:
        for name, value in optimizer.state.get(p, {}).items():
            entry = f"{key}/state/{fqn}/{name}"
            if isinstance(value, torch.Tensor):
                flat.tensors[entry] = value
            elif not for_load:
                flat.shared_objects[entry] = value
    flat.accept_prefixes.append(f"{key}/state/")
    flat.shared_objects[f"{key}/param_groups"] = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": [fqn_of[id(p)] for p in g["params"]]}
        for g in optimizer.param_groups
    ]

    def apply(shared: dict[str, Any], _rank: dict[str, Any]) -> None:
        groups = shared.get(f"{key}/param_groups")
        if groups is None:
            return
        index_of = {fqn: i for i, _, fqn in order}
        if len(groups) != len(optimizer.param_groups):
            raise StateMismatchError(
                f"{key}: checkpoint has {len(groups)} parameter groups, optimizer has "
                f"{len(optimizer.param_groups)}"
            )
        new_groups = []
        for saved, live in zip(groups, optimizer.param_groups):
            live_fqns = {fqn_of[id(p)] for p in live["params"]}
            if set(saved["params"]) != live_fqns:
                diff = sorted(set(saved["params"]) ^ live_fqns)[:5]
                raise StateMismatchError(
                    f"{key}: a parameter group holds different parameters than the "
                    f"checkpoint's (e.g. {diff})"
                )
            new_groups.append({**saved, "params": [index_of[f] for f in saved["params"]]})
        state: dict[int, dict[str, Any]] = {}
        for i, p, fqn in order:
            entries = {name: v for name, v in optimizer.state.get(p, {}).items()}
            prefix = f"{key}/state/{fqn}/"
            for k, v in shared.items():
                if k.startswith(prefix):
                    entries[k[len(prefix) :]] = v
            if entries:
                state[i] = entries
        optimizer.load_state_dict({"state": state, "param_groups": new_groups})

    flat.appliers.append(apply)


def _flatten_object(key: str, value: Any, state: MutableMapping[str, Any], flat: FlatState) -> None:
    flat.kinds[key] = KIND_EXTRA
    if hasattr(value, "state_dict") and hasattr(value, "load_state_dict"):
        flat.rank_objects[key] = value.state_dict()

        def apply(_shared: dict[str, Any], rank: dict[str, Any]) -> None:
            if key in rank:
                value.load_state_dict(rank[key])
    else:
        flat.rank_objects[key] = value

        def apply(_shared: dict[str, Any], rank: dict[str, Any]) -> None:
            if key not in rank:
                return
            loaded = rank[key]
            if isinstance(value, MutableMapping) and isinstance(loaded, Mapping):
                value.clear()  # keep the caller's dict object, as torch's load does
                value.update(loaded)
            else:
                state[key] = loaded

    flat.appliers.append(apply)


def flatten_state(
    state: MutableMapping[str, Any],
    *,
    for_load: bool = False,
    has_saved_state: Callable[[str], bool] = lambda prefix: True,
) -> FlatState:
    """Flatten ``state`` (modules, optimizers, stateful objects, plain values)."""
    if not isinstance(state, MutableMapping):
        raise UnsupportedStateError(
            f"state must be a dict such as {{'model': model, 'optimizer': optim}}, got "
            f"{type(state).__name__}"
        )
    flat = FlatState()
    modules = {k: v for k, v in state.items() if isinstance(v, nn.Module)}
    for key, value in state.items():
        if not isinstance(key, str) or not key or "/" in key:
            raise UnsupportedStateError(f"state key {key!r} must be a non-empty string without '/'")
        if isinstance(value, nn.Module):
            _flatten_module(key, value, flat)
        elif isinstance(value, torch.optim.Optimizer):
            module = _module_for(value, modules, key)
            _flatten_optimizer(key, value, module, flat, for_load, has_saved_state)
        else:
            _flatten_object(key, value, state, flat)
    return flat
