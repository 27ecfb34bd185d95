"""When training may change the tensors of an async save: the snapshot modes and their guards.

``snapshot="blocking"`` (the default): ``save(..., async_save=True)`` returns once this rank's
tensors are copied into the host arena; training may change them at once.

``snapshot="overlapped"``: ``save`` returns as soon as the save is planned; the copy runs in
the background while training goes on. The saved bytes are still those of the moment of the
call, because everything that changes saved tensors on a schedule waits for the copy first:

- ``optimizer.step()`` of every ``torch.optim.Optimizer`` in the process (one global step
  pre-hook, installed once, that returns at once while no snapshot is in flight);
- the forward of every module in the saved state that has buffers (BatchNorm statistics and
  DDP's buffer broadcast change buffers in forward): a forward pre-hook for this save.

Anything else that changes a saved tensor in place (an EMA update, a manual ``no_grad``
write, ``load_state_dict``, a write from another thread) must first call
``handle.wait_snapshot()``. Such a write that races the copy is caught by the tensors'
version counters and fails the save with ``SnapshotChangedError``, except writes through
``.data`` or raw storage, which no counter sees.

On CUDA the copy runs on a side stream into pinned memory; the hooks make the caller's stream
wait for it (no host synchronisation) once the copies are queued.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Iterable
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..errors import InvalidArgumentError


class SnapshotMode(str, enum.Enum):
    BLOCKING = "blocking"
    OVERLAPPED = "overlapped"


def snapshot_mode(value: Any, async_save: bool) -> SnapshotMode:
    """``value`` (a SnapshotMode or its name) checked against ``async_save``."""
    try:
        mode = SnapshotMode(value)
    except ValueError:
        raise InvalidArgumentError(
            f"snapshot={value!r} is not a snapshot mode: use 'blocking' or 'overlapped'; nothing was saved"
        ) from None
    if mode is SnapshotMode.OVERLAPPED and not async_save:
        raise InvalidArgumentError("snapshot='overlapped' applies to async saves only: pass "
                                   "async_save=True as well, or leave snapshot out; nothing was saved")
    return mode


class Snapshot:
    """The copy of one async save's tensors: ``done`` once every copy has landed (or the copy
    failed: the save then fails, and training need not wait any longer)."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.queued = threading.Event()  # CUDA: every copy is on the side streams
        self.events: dict[torch.device, Any] = {}  # CUDA: per device, the last copy's event
        self.creator = threading.get_ident()
        self._module_hooks: list[Any] = []

    def finished(self) -> None:
        global _ACTIVE
        self.queued.set()
        self.done.set()
        with _LOCK:
            if _ACTIVE is self:
                _ACTIVE = None

    def wait(self, timeout: float | None = None) -> bool:
        return self.done.wait(timeout)

    def before_write(self) -> None:
        """Called where training is about to change saved tensors: return once it may. On
        CUDA the caller's streams wait for the copies (the host does not)."""
        if self.done.is_set():
            return
        self.queued.wait()
        if self.done.is_set() or not self.events:
            self.done.wait()
            return
        for device, event in self.events.items():
            torch.cuda.current_stream(device).wait_event(event)

    def guard_modules(self, modules: Iterable[torch.nn.Module]) -> None:
        for module in modules:
            if next(module.buffers(), None) is not None:
                self._module_hooks.append(module.register_forward_pre_hook(
                    lambda _m, _args: self.before_write()))

    def remove_module_hooks(self) -> None:
        """On the thread that saved only: a hook list must not change under a running forward."""
        if threading.get_ident() != self.creator:
            return
        hooks, self._module_hooks = self._module_hooks, []
        for h in hooks:
            h.remove()


_ACTIVE: Snapshot | None = None
_LOCK = threading.Lock()
_STEP_HOOK: Any = None


def _before_optimizer_step(_optimizer: Any, _args: Any, _kwargs: Any) -> None:
    snap = _ACTIVE
    if snap is not None:
        snap.before_write()


def begin(state: dict[str, Any]) -> Snapshot:
    """A snapshot of ``state`` starts: training's writers wait for it from now on."""
    global _ACTIVE, _STEP_HOOK
    snap = Snapshot()
    with _LOCK:
        if _STEP_HOOK is None:  # once per process: the hook does nothing while none is active
            _STEP_HOOK = register_optimizer_step_pre_hook(_before_optimizer_step)
        _ACTIVE = snap
    snap.guard_modules(v for v in state.values() if isinstance(v, torch.nn.Module))
    return snap
