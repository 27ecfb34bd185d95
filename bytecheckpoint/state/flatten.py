"""Turning a user's ``state`` dict into keyed tensors and packed objects, and back.

Keys are ``<top-level key>/<path>``: ``model/layers.0.attn.qkv.weight`` or
``optimizer/state/layers.0.attn.qkv.weight/exp_avg``. Optimizer state is keyed by parameter
FQN, never by position, so it survives any change of layout. Tensors are the live tensors of
the module/optimizer (loads copy into them in place); non-tensor values are packed objects:
those of modules and optimizers are the same on every rank and saved once, anything else
(extra state, schedulers, user objects) is saved per rank.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..errors import StateMismatchError, UnsupportedStateError
from ..format import codec
from ..format.dtypes import check_storable
from .plain_types import like
from .tensor_shard import (
    ShardSet,
    TensorShard,
    add_shard,
    is_megatron_sharded_tensor,
    is_megatron_unsupported,
    shard_of,
)

# Names that wrappers (torch.compile, activation checkpointing, FSDP v1) insert into FQNs;
# they are reserved by PyTorch, so dropping them anywhere cannot collide with a user name.
_WRAPPER_SEGMENTS = frozenset({"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"})

KIND_MODEL = "model"
KIND_OPTIM = "optim"
KIND_EXTRA = "extra"


def _identity(name: str) -> str:
    return name


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


FqnMap = Callable[[str], str]
# Loads: the tensors saved directly under a key prefix, by name: {name: (shape, dtype)}.
SavedTensors = Callable[[str], Mapping[str, tuple[tuple[int, ...], torch.dtype]]]
# What an optimizer state tensor of a parameter becomes under one FQN (a view or a shard).
StateView = Callable[[torch.Tensor], "torch.Tensor | TensorShard"]


@dataclass
class FlatState:
    """A state dict flattened into keyed tensors and objects, plus how to put it back."""

    tensors: dict[str, torch.Tensor | TensorShard | ShardSet] = field(default_factory=dict)
    kinds: dict[str, str] = field(default_factory=dict)  # top-level key -> storage kind
    # Saved once, by one rank that holds them (every holder must agree on the value).
    shared_objects: dict[str, Any] = field(default_factory=dict)
    rank_objects: dict[str, Any] = field(default_factory=dict)  # saved by every rank
    # Shared-object keys under these prefixes are taken on load even though the target
    # cannot list them in advance (non-tensor optimizer state, e.g. a float step).
    accept_prefixes: list[str] = field(default_factory=list)
    # Called after a load has filled ``tensors`` in place, with the loaded objects.
    appliers: list[Callable[[dict[str, Any], dict[str, Any]], None]] = field(default_factory=list)
    # Per-rank objects that came from stateful objects (state_dict/load_state_dict).
    per_rank_stateful: set[str] = field(default_factory=set)
    # Of those, data loaders whose sampler gives each rank its own part of the data.
    rank_sharded: set[str] = field(default_factory=set)
    # Names of the module adapters used (e.g. "fsdp"), for framework detection.
    adapters: set[str] = field(default_factory=set)
    # Loads: keys of objects that restore themselves (a data loader, RNGState) of which the
    # checkpoint holds nothing: missing keys, like any other (strict=False skips them).
    absent: set[str] = field(default_factory=set)

    def kind_of(self, key: str) -> str:
        return self.kinds[key.split("/", 1)[0]]


class ModuleAdapter:
    """How a module's tensors and its parameters' optimizer state map to global FQNs.

    The default reads ``state_dict()`` (DDP, FSDP2/DTensor, plain modules). Frameworks whose
    ``state_dict()`` would communicate or whose parameters are flat (FSDP v1) register their
    own adapter with :func:`register_module_adapter`.
    """

    name = "default"

    def matches(self, module: nn.Module) -> bool:
        return True

    def entries(self, module: nn.Module, fqn_map: FqnMap, *, keep_vars: bool = False
                ) -> dict[str, tuple[str, Any]]:
        """``{fqn: (name in module.state_dict(), value)}``; values are tensors, shards or objects.
        ``keep_vars``: the parameters themselves rather than detached aliases (a save only
        reads them; detaching each DTensor costs ~10 us through its dispatcher, every save)."""
        out: dict[str, tuple[str, Any]] = {}
        for name, value in unwrap(module).state_dict(keep_vars=keep_vars).items():
            fqn = fqn_map(clean_fqn(name))
            if fqn in out:  # one entry would be dropped from the save, or never loaded
                raise UnsupportedStateError(
                    f"{out[fqn][0]!r} and {name!r} of the module both map to {fqn!r} (fqn_map, or "
                    "a wrapper's prefix removed); give each its own name")
            out[fqn] = (name, value)
        return out

    def param_views(self, module: nn.Module, fqn_map: FqnMap) -> dict[int, list[tuple[str, StateView]]]:
        """For each parameter (by id): the FQNs it stands for and how its state maps to them."""
        named = unwrap(module).named_parameters(remove_duplicate=False)
        return {id(p): [(fqn_map(clean_fqn(name)), _same)] for name, p in named}


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


_ADAPTERS: list[ModuleAdapter] = []


def register_module_adapter(adapter: ModuleAdapter) -> None:
    """Adapters registered later are tried first; the default adapter is the fallback."""
    _ADAPTERS.insert(0, adapter)


def module_adapter(module: nn.Module) -> ModuleAdapter:
    for adapter in _ADAPTERS:
        if adapter.matches(module):
            return adapter
    return _DEFAULT_ADAPTER


_DEFAULT_ADAPTER = ModuleAdapter()


def _module_for(optimizer: torch.optim.Optimizer, modules: dict[str, nn.Module], key: str) -> nn.Module:
    wanted = {id(p) for g in optimizer.param_groups for p in g["params"]}
    for module in modules.values():
        if wanted <= {id(p) for p in module.parameters()}:
            return module
    raise UnsupportedStateError(
        f"state[{key!r}] is an optimizer whose parameters are not all in one module of the "
        "state; put the model it optimizes in the same state dict (e.g. state['model'])"
    )


def init_optimizer_state(optimizer: torch.optim.Optimizer, params: list[torch.Tensor] | None = None) -> None:
    """Create an optimizer's state tensors (so a load can fill them in place): of ``params``,
    or, when not given, of every parameter that requires grad if the optimizer has no state.

    One step with zero gradients and a zero learning rate allocates the state tensors
    without changing a parameter; the loaded values then overwrite all of it. The other
    parameters get no gradient for that step, which optimizers skip: their state is kept.
    """
    if params is None:
        if optimizer.state:
            return
        params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    if not params:
        return
    wanted = {id(p) for p in params}
    everyone = [p for g in optimizer.param_groups for p in g["params"]]
    saved_grads = [p.grad for p in everyone]
    lrs = []
    for g in optimizer.param_groups:
        lrs.append(g.get("lr"))
        if "lr" in g:
            g["lr"] = torch.tensor(0.0) if isinstance(g["lr"], torch.Tensor) else 0.0
    try:
        for p in everyone:
            p.grad = torch.zeros_like(p) if id(p) in wanted else None
        optimizer.step(*_step_args(optimizer))
    finally:
        for g, lr in zip(optimizer.param_groups, lrs):
            if lr is not None:
                g["lr"] = lr
        for p, grad in zip(everyone, saved_grads):
            p.grad = grad


def _zero_loss() -> float:
    return 0.0


def _step_args(optimizer: torch.optim.Optimizer) -> tuple[Callable[[], float], ...]:
    """A closure for optimizers whose step requires one (LBFGS: a zero loss with zero
    gradients ends its step at once); none for the others."""
    try:
        closure = inspect.signature(optimizer.step).parameters.get("closure")
    except (TypeError, ValueError):  # no signature to read: called as optimizers usually are
        return ()
    return (_zero_loss,) if closure is not None and closure.default is inspect.Parameter.empty else ()


def _flatten_module(key: str, module: nn.Module, flat: FlatState, fqn_map: FqnMap, for_load: bool) -> None:
    flat.kinds[key] = KIND_MODEL
    adapter = module_adapter(module)
    flat.adapters.add(adapter.name)
    raw_names: dict[str, str] = {}
    live = _live_storages(module) if for_load else set()
    copies: dict[str, torch.Tensor] = {}  # tensors of state_dict() that are not the module's own
    objects: dict[str, Any] = {}  # its non-tensor values (``_extra_state``)
    # A load copies into the values in place, which a parameter that requires grad refuses.
    for fqn, (name, value) in adapter.entries(module, fqn_map, keep_vars=not for_load).items():
        raw_names[fqn] = name
        if isinstance(value, torch.Tensor | TensorShard | ShardSet):
            flat.tensors[f"{key}/{fqn}"] = value
            if for_load and isinstance(value, torch.Tensor) and _storage_of(value) not in live:
                copies[name] = value
        else:
            flat.shared_objects[f"{key}/{fqn}"] = objects[fqn] = value

    def apply(shared: dict[str, Any], _rank: dict[str, Any]) -> None:
        # non-tensor values with the types the module's own state_dict() has (``like``)
        extra = {raw_names[k[len(key) + 1 :]]: like(objects.get(k[len(key) + 1 :]), v)
                 for k, v in shared.items() if k.startswith(f"{key}/") and k[len(key) + 1 :] in raw_names}
        # Non-tensor entries (e.g. _extra_state), and tensors that state_dict() returned as
        # copies rather than the module's own (a tensor get_extra_state, as TransformerEngine's
        # fp8 scales; a state_dict hook that renames, splits or casts), go back through the
        # module's load_state_dict, its hooks and set_extra_state: filling a copy in place
        # left the module as it was, silently.
        extra.update(copies)
        if extra:
            unwrap(module).load_state_dict(extra, strict=False)

    flat.appliers.append(apply)


def _storage_of(t: torch.Tensor) -> int:
    """The address of the storage ``t`` (a DTensor: its local shard) is a view of."""
    local = getattr(t, "_local_tensor", t)
    try:
        return local.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # a tensor without storage (meta, fake)
        return 0


def _live_storages(module: nn.Module) -> set[int]:
    """Storages of the module's parameters and buffers: what a load may fill in place."""
    out = {_storage_of(t) for t in unwrap(module).parameters()}
    out.update(_storage_of(t) for t in unwrap(module).buffers())
    out.add(0)  # no storage to tell: treated as the module's own, as before
    return out


def _same_encoding(a: Any, b: Any) -> bool:
    return codec.encode(a) == codec.encode(b)


def _flatten_optimizer(
    key: str, optimizer: torch.optim.Optimizer, module: nn.Module, flat: FlatState, for_load: bool,
    has_saved_state: Callable[[str], bool], fqn_map: FqnMap, saved_tensors: SavedTensors,
) -> None:
    """Optimizer state keyed by parameter FQN: ``<key>/state/<fqn>/<name>`` for state and
    ``<key>/param_groups/<fqn>`` for the hyperparameters of the parameter's group. Both are
    independent of how parameters are grouped, ordered, flattened or split across stages."""
    flat.kinds[key] = KIND_OPTIM
    views = module_adapter(module).param_views(module, fqn_map)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    unsaved: set[int] = set()  # parameters given state only by init_optimizer_state, none saved
    if for_load and has_saved_state(f"{key}/state/"):
        had = {id(k) for k in optimizer.state}
        saved = {id(p) for p in params if id(p) not in had and any(
            has_saved_state(f"{key}/state/{fqn}/") for fqn, _ in views[id(p)])}
        # Every parameter with saved state needs state to fill, not only those of an optimizer
        # with none yet: one that has not stepped since (a frozen parameter, one without a
        # gradient yet in this process) had its saved state left out of the load, silently.
        try:
            init_optimizer_state(optimizer, [p for p in params if id(p) in saved])
        except Exception:  # a step it cannot take (SparseAdam wants sparse gradients): the saved
            pass  # state of plain parameters loads into new tensors (_saved_only_state)
        # A parameter that had no gradient yet when the checkpoint was saved (an unused branch,
        # an expert that got no tokens, a layer unfrozen later) has no state in it. The zero
        # step's state (step 1, zero moments) was then reported missing, or kept under
        # strict=False, and training went on with a bias correction the run never had.
        unsaved = {id(p) for p in params if id(p) not in had and id(p) not in saved}
    # By id, not by the parameter: hashing a DTensor goes through its __torch_function__
    # (about 25 us each, every save); the state's keys are the parameters themselves.
    state_of = {id(k): v for k, v in optimizer.state.items() if id(k) not in unsaved}
    for p in params:
        for name, value in state_of.get(id(p), {}).items():
            for fqn, view in views[id(p)]:
                entry = f"{key}/state/{fqn}/{name}"
                if isinstance(value, torch.Tensor):
                    flat.tensors[entry] = view(value)
                elif not for_load:
                    flat.shared_objects[entry] = value
    added = _saved_only_state(key, params, views, flat, saved_tensors) if for_load else {}
    flat.accept_prefixes.append(f"{key}/state/")
    for g in optimizer.param_groups:
        hparams = {k: v for k, v in g.items() if k != "params"}
        for p in g["params"]:
            for fqn, _ in views[id(p)]:
                flat.shared_objects[f"{key}/param_groups/{fqn}"] = hparams

    def apply(shared: dict[str, Any], _rank: dict[str, Any]) -> None:
        new_groups = []
        index = {id(p): i for i, p in enumerate(params)}
        for live in optimizer.param_groups:
            fqns = [fqn for p in live["params"] for fqn, _ in views[id(p)]]
            saved = _saved_group(key, fqns, shared)
            current = {k: v for k, v in live.items() if k != "params"}
            hparams = like(current, dict(saved)) if saved is not None else current
            new_groups.append({**hparams, "params": [index[id(p)] for p in live["params"]]})
        # Index the loaded state by parameter once: scanning every key per parameter is
        # quadratic, seconds at a few thousand parameters.
        prefix = f"{key}/state/"
        by_fqn: dict[str, dict[str, Any]] = {}
        for k, v in shared.items():
            if k.startswith(prefix):
                fqn, _, name = k[len(prefix) :].rpartition("/")
                by_fqn.setdefault(fqn, {})[name] = v
        state: dict[int, dict[str, Any]] = {}
        for i, p in enumerate(params):
            entries = {} if id(p) in unsaved else dict(optimizer.state.get(p, {}))
            entries.update(added.get(id(p), {}))
            for fqn, _ in views[id(p)]:
                entries.update(by_fqn.get(fqn, {}))
            if entries:
                state[i] = entries
        optimizer.load_state_dict({"state": state, "param_groups": new_groups})

    flat.appliers.append(apply)


def _saved_only_state(key: str, params: list[torch.Tensor], views: dict[int, list[tuple[str, StateView]]],
                      flat: FlatState, saved_tensors: SavedTensors) -> dict[int, dict[str, torch.Tensor]]:
    """Load targets for saved state tensors that this optimizer's zero step does not create
    (LBFGS's search direction, ``max_exp_avg_sq`` saved with amsgrad=True), as torch's
    ``load_state_dict`` takes them; they were left out, silently. Plain parameters only: the
    state of a sharded one must be sharded like it (reported as unexpected keys instead)."""
    added: dict[int, dict[str, torch.Tensor]] = {}
    for p in params:
        if len(views[id(p)]) != 1 or type(p) not in (torch.Tensor, nn.Parameter):
            continue
        fqn, view = views[id(p)][0]
        if view is not _same:
            continue
        for name, (shape, dtype) in saved_tensors(f"{key}/state/{fqn}").items():
            entry = f"{key}/state/{fqn}/{name}"
            if entry not in flat.tensors:  # on the CPU: load_state_dict moves it as it does others
                flat.tensors[entry] = added.setdefault(id(p), {})[name] = torch.empty(shape, dtype=dtype)
    return added


def _saved_group(key: str, fqns: list[str], shared: dict[str, Any]) -> dict[str, Any] | None:
    """The saved hyperparameters of a live group of the parameters ``fqns`` (None when none of
    them has any). Parameters grouped together here must have had equal ones."""
    saved = [(f, shared[f"{key}/param_groups/{f}"]) for f in fqns if f"{key}/param_groups/{f}" in shared]
    if not saved:
        return None
    first_fqn, first = saved[0]
    for fqn, other in saved[1:]:
        if not _same_encoding(first, other):
            raise StateMismatchError(
                f"{key}: {first_fqn} and {fqn} share a parameter group here but had different "
                "hyperparameters in the checkpoint; group them as they were saved, or load the "
                "model alone and rebuild the optimizer")
    return first


# Deeper nesting ran into Python's recursion limit here (a raw RecursionError), or at the load.
_MAX_LEAF_DEPTH = 600


def _leaves(value: Any, path: tuple[Any, ...] = (), whole: Callable[[tuple[Any, ...]], bool] | None = None
            ) -> Iterator[tuple[tuple[Any, ...], Any]]:
    """``(path, leaf)`` of a nested state; a path holds the containers' own keys and indexes
    (an int key stays an int, so a load puts the value back under it). ``whole(path)``: the
    value there is one leaf, whatever it holds."""
    if len(path) > _MAX_LEAF_DEPTH:  # a cycle, or nesting no codec stores: Python's RecursionError
        raise UnsupportedStateError(
            f"a value in the state nests more than {_MAX_LEAF_DEPTH} levels of dicts and lists "
            f"(at {_show(path[:4])}...), or holds itself (a list or dict that contains itself); "
            "store a flat form")
    if whole is not None and path and whole(path):
        yield path, value
    elif isinstance(value, Mapping):
        for k, v in value.items():
            yield from _leaves(v, (*path, k), whole)
    elif isinstance(value, list | tuple) and value and all(_is_shard(v) for v in value):
        for v in value:  # several pieces of one tensor under one key
            yield path, v
    elif isinstance(value, list | tuple) and any(isinstance(v, Mapping | list | tuple) or _is_shard(v)
                                                for v in value):
        for i, v in enumerate(value):
            yield from _leaves(v, (*path, i), whole)
    else:
        yield path, value


def _is_extra_state(path: tuple[Any, ...]) -> bool:
    """A module's ``get_extra_state()`` entry of a model state dict: one value, as the module
    itself saves it (``model/_extra_state``), whatever it holds (TransformerEngine: a dict)."""
    last = path[-1]
    return len(path) == 1 and isinstance(last, str) and (
        last == "_extra_state" or last.endswith("._extra_state"))


def _dotted(path: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in path)


class _Names:
    """Checkpoint keys given to the leaves of one state entry: two different paths that would
    get the same key (``"a.b"`` beside ``{"a": {"b": ...}}``, ``1`` beside ``"1"``) are refused,
    where one of them was dropped from the save, or left unloaded, silently."""

    def __init__(self, key: str) -> None:
        self.key = key
        self._paths: dict[str, tuple[Any, ...]] = {}

    def claim(self, entry: str, path: tuple[Any, ...]) -> str:
        other = self._paths.setdefault(entry, path)
        if other != path:
            raise UnsupportedStateError(
                f"state[{self.key!r}]: {_show(other)} and {_show(path)} would both be stored as "
                f"{entry!r}; rename one of them (keys are joined with '.', and compared as text)")
        return entry


def _show(path: tuple[Any, ...]) -> str:
    return "".join(f"[{p!r}]" for p in path)


def _is_shard(value: Any) -> bool:
    return isinstance(value, TensorShard) or is_megatron_sharded_tensor(value)


def is_sharded_dict(value: Any) -> bool:
    """A (nested) mapping with hand-described shards among its leaves."""
    return isinstance(value, Mapping) and any(_is_shard(v) for _, v in _leaves(value))


def _flatten_sharded_dict(key: str, value: MutableMapping[str, Any], flat: FlatState) -> None:
    """A Megatron-style sharded state dict: shards keyed by their own key (Megatron) or
    their path (a list of shards at one path: pieces of one tensor); plain tensors are
    replicated tensors; other leaves are saved once."""
    flat.kinds[key] = KIND_OPTIM if "optim" in key else KIND_MODEL
    flat.adapters.add("manual")
    plain: dict[str, tuple[Any, ...]] = {}
    names = _Names(key)
    for path, leaf in _leaves(value):
        if is_megatron_unsupported(leaf):
            raise UnsupportedStateError(
                f"state[{key!r}] holds a megatron {type(leaf).__name__} ({leaf.key!r}); only "
                "ShardedTensor leaves are supported: apply factories before saving, and keep "
                "per-rank objects in a separate state entry"
            )
        shard = shard_of(leaf)
        name = _dotted(path)
        if shard is not None:
            # a megatron shard names its own key (pieces of one tensor share it); a path does not
            entry = (f"{key}/{leaf.key}" if is_megatron_sharded_tensor(leaf)
                     else names.claim(f"{key}/{name}", path))
            held = flat.tensors.get(entry)
            if held is not None and not isinstance(held, TensorShard | ShardSet):
                raise UnsupportedStateError(f"{entry} is both a plain tensor and a shard")
            flat.tensors[entry] = add_shard(held, shard)
        elif isinstance(leaf, torch.Tensor):
            flat.tensors[names.claim(f"{key}/{name}", path)] = leaf
        else:
            flat.shared_objects[names.claim(f"{key}/{name}", path)] = leaf
            plain[f"{key}/{name}"] = path
    flat.appliers.append(_put_back(value, plain))


def _put_back(value: Any, plain: dict[str, tuple[Any, ...]]
              ) -> Callable[[dict[str, Any], dict[str, Any]], None]:
    """The applier that stores each loaded shared object at its path in ``value``."""

    def apply(shared: dict[str, Any], _rank: dict[str, Any]) -> None:
        for entry, path in plain.items():
            if entry in shared:
                node: Any = value
                for part in path[:-1]:
                    node = node[part]
                last = path[-1]
                # Landed in what the caller holds, as a plain object's value is (``into``): a
                # tensor in a list was replaced, and the caller's own tensor kept its values.
                landed = into(node[last], shared[entry])
                if isinstance(node, list | MutableMapping):
                    node[last] = landed
                elif landed is not node[last]:  # a tuple: only what it holds can change
                    raise UnsupportedStateError(
                        f"{entry}: the loaded value cannot be put back into the tuple at "
                        f"{_show(path[:-1])}; hold that part of the state in a list")

    return apply


def _flatten_tensor_dict(key: str, value: MutableMapping[str, Any], flat: FlatState) -> None:
    """Loads only: a dict such as ``model.state_dict()`` or DCP's ``get_state_dict`` model
    dict, where the checkpoint holds tensors under ``key/`` (saved from a module, or by DCP).
    Its tensors are load targets, filled in place and resharded like a module's (plain
    tensors are whole tensors, DTensors their shards); its other leaves get the saved values."""
    flat.kinds[key] = KIND_OPTIM if "optim" in key else KIND_MODEL
    plain: dict[str, tuple[Any, ...]] = {}
    names = _Names(key)
    for path, leaf in _leaves(value, whole=_is_extra_state):
        name = names.claim(f"{key}/{clean_fqn(_dotted(path))}", path)
        if isinstance(leaf, torch.Tensor):
            flat.tensors[name] = leaf
        else:
            flat.shared_objects[name] = leaf
            plain[name] = path
    flat.appliers.append(_put_back(value, plain))


def is_optimizer_dict(value: Any) -> bool:
    """An optimizer state dict keyed by parameter FQN, as DCP's ``get_state_dict`` returns it:
    ``{"state": {fqn: {name: value}}, "param_groups": [{..., "params": [fqn, ...]}]}``."""
    return (isinstance(value, MutableMapping) and isinstance(value.get("state"), MutableMapping)
            and isinstance(value.get("param_groups"), list)
            and all(isinstance(g, MutableMapping) and isinstance(g.get("params"), list)
                    and all(isinstance(p, str) for p in g["params"]) for g in value["param_groups"])
            and all(isinstance(k, str) and isinstance(v, MutableMapping) for k, v in value["state"].items()))


def _is_indexed_optimizer_dict(value: Any) -> bool:
    """``optimizer.state_dict()``: state and groups' params keyed by parameter index."""
    return (isinstance(value, Mapping) and isinstance(value.get("state"), Mapping)
            and isinstance(value.get("param_groups"), list)
            and any(isinstance(g, Mapping) and any(isinstance(p, int) for p in g.get("params", ()))
                    for g in value["param_groups"]))


def _flatten_optimizer_dict(key: str, value: MutableMapping[str, Any], flat: FlatState) -> None:
    """Loads only: an FQN-keyed optimizer state dict (``is_optimizer_dict``) where the
    checkpoint holds an optimizer under ``key``, saved from an optimizer object or by DCP.
    Its state tensors are load targets under the names an optimizer's are saved with
    (``<key>/state/<fqn>/<name>``), filled in place and resharded; its other state values and
    each group's hyperparameters (``<key>/param_groups/<fqn>``) get the saved values."""
    flat.kinds[key] = KIND_OPTIM
    plain: dict[str, tuple[str, ...]] = {}
    for fqn, entries in value["state"].items():
        for name, leaf in entries.items():
            entry = f"{key}/state/{fqn}/{name}"
            if isinstance(leaf, torch.Tensor):
                flat.tensors[entry] = leaf
            else:
                flat.shared_objects[entry] = leaf
                plain[entry] = ("state", fqn, str(name))
    groups = value["param_groups"]
    for g in groups:
        hparams = {k: v for k, v in g.items() if k != "params"}
        for fqn in g["params"]:
            flat.shared_objects[f"{key}/param_groups/{fqn}"] = hparams
    put_back = _put_back(value, plain)

    def apply(shared: dict[str, Any], rank: dict[str, Any]) -> None:
        put_back(shared, rank)
        for g in groups:
            saved = _saved_group(key, g["params"], shared)
            if saved is not None:
                g.update({k: v for k, v in saved.items() if k != "params"})

    flat.appliers.append(apply)


def is_reshardable(value: Any) -> bool:
    """Objects that split their own state into entries and can rebuild it from the saved
    entries under another layout (``bytecheckpoint.data.TokenLoader``, ``RNGState``)."""
    return all(callable(getattr(value, m, None))
               for m in ("checkpoint_shards", "load_prefixes", "restore_shards"))


def _flatten_reshardable(key: str, value: Any, flat: FlatState, for_load: bool,
                         has_saved_state: Callable[[str], bool]) -> None:
    """Each entry is saved once by any rank holding it (identical copies, e.g. a DP shard
    held by its TP peers, are written once); a load reads the entries the object asks for."""
    flat.kinds[key] = KIND_EXTRA
    if for_load and not has_saved_state(key):
        flat.absent.add(key)  # nothing to restore: left as it is, reported missing
        return
    if for_load:
        prefixes = value.load_prefixes(lambda rel: has_saved_state(f"{key}/{rel}"))
        flat.accept_prefixes.extend(f"{key}/{p}" for p in prefixes)
    else:
        for name, entry in value.checkpoint_shards().items():
            flat.shared_objects[f"{key}/{name}"] = entry

    def apply(shared: dict[str, Any], _rank: dict[str, Any]) -> None:
        entries = {k[len(key) + 1 :]: v for k, v in shared.items() if k.startswith(f"{key}/")}
        value.restore_shards(entries)

    flat.appliers.append(apply)


def into(old: Any, new: Any) -> Any:
    """``new`` (a loaded packed object) landed in ``old`` (what the caller passed) where they
    match: a tensor of the same shape and dtype is copied into in place, so a dict such as
    ``model.state_dict()`` updates the tensors it aliases (the model's parameters, as DCP's
    in-place load does); dicts and lists keep their identity. Anything else is replaced, with
    ``old``'s types where they hold it exactly (``like``: a namedtuple, a numpy scalar)."""
    if isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor):
        if (type(old) in (torch.Tensor, nn.Parameter) and old.shape == new.shape and old.dtype == new.dtype
                and not old.is_inference()):
            try:
                with torch.no_grad():
                    old.copy_(new)
                return old
            except RuntimeError:  # not writable in place (an expanded view): replaced instead
                return like(old, new)
        return like(old, new)
    if isinstance(old, MutableMapping) and isinstance(new, Mapping):
        merged = {k: into(old[k], v) if k in old else v for k, v in new.items()}
        old.clear()
        old.update(merged)
        return old
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        old[:] = [into(o, n) for o, n in zip(old, new)]
        return old
    return like(old, new)


def _is_stateful(value: Any) -> bool:
    return hasattr(value, "state_dict") and hasattr(value, "load_state_dict")


def _flatten_stateful_tensors(key: str, value: Any, flat: FlatState) -> None:
    """Loads only: a ``Stateful`` (state_dict / load_state_dict) whose checkpoint entry is a
    group of tensors (DCP saves a Stateful's state dict as it is, tensors as tensors). Its
    current ``state_dict()`` is the template the saved tensors and values load into; then it
    gets ``load_state_dict`` with the filled template."""
    template = value.state_dict()
    if not isinstance(template, MutableMapping):
        raise UnsupportedStateError(
            f"state[{key!r}].state_dict() returned a {type(template).__name__}, not a dict; the "
            "checkpoint holds tensors under this key, which load into a dict only")
    _flatten_tensor_dict(key, template, flat)
    flat.kinds[key] = KIND_EXTRA

    def apply(_shared: dict[str, Any], _rank: dict[str, Any]) -> None:
        value.load_state_dict(template)  # after _flatten_tensor_dict's applier filled it

    flat.appliers.append(apply)


def _sharded_by_rank(value: Any) -> bool:
    """A data loader (torchdata's ``StatefulDataLoader``) over a ``DistributedSampler``: its
    position counts batches of this rank's part of the data, which another number of ranks
    splits differently, so even a position every rank shares does not carry over."""
    from torch.utils.data import DataLoader, DistributedSampler

    if not isinstance(value, DataLoader):
        return False
    batches = getattr(value, "batch_sampler", None)
    samplers = (getattr(value, "sampler", None), getattr(batches, "sampler", None))
    return any(isinstance(s, DistributedSampler) for s in samplers)


def _not_too_deep(key: str, merge: Callable[[Any, Any], Any], target: Any, loaded: Any) -> Any:
    """``merge(target, loaded)`` (``into`` or ``like``, which recurse level by level): a value
    nested deeper than Python's recursion limit allows is a named error, not RecursionError
    (the save walks plain lists and dicts up to ``_MAX_LEAF_DEPTH`` levels deep)."""
    try:
        return merge(target, loaded)
    except RecursionError:
        raise UnsupportedStateError(
            f"state[{key!r}] nests too deeply (hundreds of levels of lists or dicts) to be loaded "
            f"into the value passed: pass None as state[{key!r}] to get the saved value as it is, "
            "or store a flatter form") from None


def _flatten_object(key: str, value: Any, state: MutableMapping[str, Any], flat: FlatState) -> None:
    flat.kinds[key] = KIND_EXTRA
    if _is_stateful(value):
        template = flat.rank_objects[key] = value.state_dict()
        flat.per_rank_stateful.add(key)
        if _sharded_by_rank(value):
            flat.rank_sharded.add(key)

        def apply(_shared: dict[str, Any], rank: dict[str, Any]) -> None:
            if key in rank:  # with the types its own state_dict() has (an OrderedDict, ...)
                value.load_state_dict(_not_too_deep(key, like, template, rank[key]))
    else:
        flat.rank_objects[key] = value

        def apply(_shared: dict[str, Any], rank: dict[str, Any]) -> None:
            if key in rank:  # the caller's containers and tensors are kept, as torch's load does
                state[key] = _not_too_deep(key, into, value, rank[key])

    flat.appliers.append(apply)


def _scheduler_checks(key: str, scheduler: Any) -> list[Callable[[dict[str, Any], dict[str, Any]], None]]:
    """Appliers refusing a scheduler whose per-group state (``base_lrs``, by group position)
    no longer lines up with its optimizer's groups, which load by parameter name: built in
    another order or number, each group was scheduled from another group's learning rate,
    silently. Schedulers (and those a ``SequentialLR`` chains) whose ``base_lrs`` are their
    groups' ``initial_lr`` when built, as every torch scheduler's are, and are loaded."""
    checks = []
    for part in [scheduler, *getattr(scheduler, "_schedulers", [])]:
        if not _base_lrs_match(part):
            continue  # its own base learning rates (CyclicLR's after another scheduler's)

        def check(_shared: dict[str, Any], rank: dict[str, Any], part: Any = part) -> None:
            if key in rank and not _base_lrs_match(part):
                raise StateMismatchError(
                    f"state[{key!r}] was saved for {len(part.base_lrs)} parameter groups whose initial "
                    "learning rates, in group order, are not those of its optimizer's groups as loaded: "
                    "the optimizer's groups were built in another order or number. Build them as when "
                    f"saved, or leave {key!r} out of the state and rebuild the scheduler")

        checks.append(check)
    return checks


def _base_lrs_match(scheduler: Any) -> bool:
    base = getattr(scheduler, "base_lrs", None)
    groups = scheduler.optimizer.param_groups
    if not isinstance(base, list):
        return True
    try:
        return len(base) == len(groups) and all(float(b) == float(g["initial_lr"])
                                                for b, g in zip(base, groups))
    except (KeyError, TypeError, ValueError, RuntimeError):  # no initial_lr, or not a number
        return False


def flatten_state(
    state: MutableMapping[str, Any],
    *,
    for_load: bool = False,
    has_saved_state: Callable[[str], bool] = lambda prefix: True,
    fqn_map: FqnMap | None = None,
    saved_as_tensors: Callable[[str], bool] = lambda key: False,
    saved_tensors: SavedTensors = lambda prefix: {},
) -> FlatState:
    """Flatten ``state`` (modules, optimizers, sharded dicts, stateful objects, plain values).

    ``fqn_map`` renames this rank's parameter FQNs to global ones (pipeline stages that
    number their layers from zero, as Megatron does). ``saved_as_tensors(key)`` (loads): the
    checkpoint holds ``state[key]`` as tensors, not as a packed value, so a dict there is a
    dict of load targets (``_flatten_tensor_dict``). ``saved_tensors(prefix)`` (loads): the
    checkpoint's tensors directly under ``prefix``, by name, with their shapes and dtypes.
    """
    fqn_map = fqn_map or _identity
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
            _flatten_module(key, value, flat, fqn_map, for_load)
        elif isinstance(value, torch.optim.Optimizer):
            module = _module_for(value, modules, key)
            _flatten_optimizer(key, value, module, flat, for_load, has_saved_state, fqn_map, saved_tensors)
        elif is_sharded_dict(value):
            _flatten_sharded_dict(key, value, flat)
        elif is_reshardable(value):
            _flatten_reshardable(key, value, flat, for_load, has_saved_state)
        elif for_load and is_optimizer_dict(value) and has_saved_state(f"{key}/param_groups/"):
            _flatten_optimizer_dict(key, value, flat)
        elif for_load and _is_indexed_optimizer_dict(value) and has_saved_state(f"{key}/param_groups/"):
            raise UnsupportedStateError(
                f"state[{key!r}] is an optimizer state dict keyed by parameter index "
                "(optimizer.state_dict()); the checkpoint keys optimizer state by parameter name. "
                f"Pass the optimizer itself ({{{key!r}: optim}}, with its model in the state), or "
                "the FQN-keyed dict of torch.distributed.checkpoint.state_dict.get_state_dict")
        elif for_load and isinstance(value, MutableMapping) and saved_as_tensors(key):
            _flatten_tensor_dict(key, value, flat)
        elif for_load and _is_stateful(value) and saved_as_tensors(key):
            _flatten_stateful_tensors(key, value, flat)
        else:
            _flatten_object(key, value, state, flat)
    optimizers = [v for v in state.values() if isinstance(v, torch.optim.Optimizer)] if for_load else []
    for key, value in state.items():  # after every other applier: the optimizer's groups loaded
        if (isinstance(value, torch.optim.lr_scheduler.LRScheduler) and key in flat.per_rank_stateful
                and any(getattr(value, "optimizer", None) is o for o in optimizers)):
            flat.appliers.extend(_scheduler_checks(key, value))
    for name, tensor in flat.tensors.items():
        if isinstance(tensor, torch.Tensor):
            try:
                check_storable(tensor)
            except UnsupportedStateError as exc:
                raise UnsupportedStateError(f"{name}: {exc}") from None
    return flat
