"""A nested checkpoint dict (Lightning's, say) saved as a bytecheckpoint state, and read back
without a template.

Trainers hand their checkpoint IO a dict of dicts and lists with tensors at the leaves and
expect the same dict back from a path alone. Saving the whole dict as one packed object would
hide the tensors from ranged reads, per-chunk checksums and ``bcp export``; so each tensor is
saved as a real tensor (a ``TensorShard`` of itself, entry ``tensors/<path>``) and the rest,
with a small placeholder (name, dtype, shape) where each tensor was, as the packed object
``tree``. Loading reads ``tree`` first, allocates the tensors it names and reads them in.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

import bytecheckpoint as bcp
from bytecheckpoint.errors import CorruptCheckpointError, NotACheckpointError

TREE_KEY = "tree"
TENSORS_KEY = "tensors"
_TAG = "__bcp_tensor__"  # first item of a placeholder tuple in the tree
_MAX_NDIM = 64


def _is_saved_as_tensor(value: Any) -> bool:
    # Plain tensors only: a tensor subclass (DTensor) is left to the codec, which names it.
    return type(value) in (torch.Tensor, torch.nn.Parameter) and value.dim() > 0 and value.numel() > 0


def to_state(tree: Mapping[str, Any]) -> dict[str, Any]:
    """The bytecheckpoint state that saves ``tree``: ``{"tree": skeleton, "tensors": {...}}``."""
    tensors: dict[str, Any] = {}

    def walk(value: Any, path: tuple[str, ...]) -> Any:
        if _is_saved_as_tensor(value):
            name = ".".join(path) or "tensor"
            if name in tensors:  # "a.b" as one key and as a path: keep both
                name = f"{name}#{len(tensors)}"
            tensors[name] = bcp.TensorShard(value.detach(), tuple(value.shape))
            return (_TAG, name, value.dtype, list(value.shape))
        if isinstance(value, Mapping):
            return {k: walk(v, (*path, str(k))) for k, v in value.items()}
        if isinstance(value, list | tuple):
            items = [walk(v, (*path, str(i))) for i, v in enumerate(value)]
            return items if isinstance(value, list) else tuple(items)
        return value

    skeleton = walk(tree, ())
    return {TREE_KEY: skeleton, TENSORS_KEY: tensors} if tensors else {TREE_KEY: skeleton}


def _placeholders(value: Any) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    found: list[tuple[str, torch.dtype, tuple[int, ...]]] = []

    def walk(v: Any) -> None:
        if isinstance(v, tuple) and len(v) == 4 and v[0] == _TAG:
            _, name, dtype, shape = v
            ok_shape = isinstance(shape, list) and len(shape) <= _MAX_NDIM and all(
                isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape)
            if not (isinstance(name, str) and isinstance(dtype, torch.dtype) and ok_shape):
                raise CorruptCheckpointError(
                    f"a tensor placeholder in the saved tree is malformed: {v!r:.200}")
            found.append((name, dtype, tuple(shape)))
        elif isinstance(v, Mapping):
            for x in v.values():
                walk(x)
        elif isinstance(v, list | tuple):
            for x in v:
                walk(x)

    walk(value)
    return found


def _fill(value: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    if isinstance(value, tuple) and len(value) == 4 and value[0] == _TAG:
        return tensors[value[1]]
    if isinstance(value, Mapping):
        return {k: _fill(v, tensors) for k, v in value.items()}
    if isinstance(value, list | tuple):
        items = [_fill(v, tensors) for v in value]
        return items if isinstance(value, list) else tuple(items)
    return value


def load_tree(path: str, *, process_group: Any = None, verify: bool = True) -> dict[str, Any]:
    """Read back a dict saved with :func:`to_state` from the checkpoint at ``path``."""
    probe: dict[str, Any] = {TREE_KEY: None}
    bcp.load(path, probe, strict=False, process_group=process_group, verify=verify)
    skeleton = probe[TREE_KEY]
    if not isinstance(skeleton, Mapping):
        raise NotACheckpointError(
            f"{path} is a bytecheckpoint checkpoint but holds no trainer checkpoint dict (no '{TREE_KEY}' "
            "entry): it was saved by bcp.save or the CheckpointManager, not by a trainer integration; "
            "load it with bcp.load(path, {'model': model, ...})")
    wanted = _placeholders(skeleton)
    tensors: dict[str, torch.Tensor] = {}
    for name, dtype, shape in wanted:
        try:
            tensors[name] = torch.empty(shape, dtype=dtype)
        except (RuntimeError, MemoryError) as exc:
            raise CorruptCheckpointError(
                f"{path}: cannot allocate tensor {name!r} of shape {shape} and {dtype}: {exc}") from None
    state: dict[str, Any] = {TREE_KEY: None}
    if tensors:
        state[TENSORS_KEY] = {n: bcp.TensorShard(t, tuple(t.shape)) for n, t in tensors.items()}
    bcp.load(path, state, process_group=process_group, verify=verify)
    return _fill(state[TREE_KEY], tensors)
