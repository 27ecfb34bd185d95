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
  (Modules without buffers get hooks that never wait: the start and the end of their
  forward only confirm the snapshot, below.)

Anything else that changes a saved tensor in place (an EMA update, a manual ``no_grad``
write, ``load_state_dict``, a write from another thread) must first call
``handle.wait_snapshot()``. Such a write before the copy is released is caught by the tensors'
version counters and fails the save with ``SnapshotChangedError``, except writes through
``.data`` or raw storage, which no counter sees.

Catching it needs more than a check around each copy: an in-place op bumps its tensor's
counter only after it has written the data, so a write still running when the copy ends is
invisible there. The save therefore does not commit until the snapshot is *confirmed*: the
first time a thread of training reaches bytecheckpoint after the copy is released (an
optimizer step, the start or end of a forward of a saved module, any call on the handle, the
next ``save`` or ``load``, interpreter exit), every write that thread issued before has
finished, and the counters are compared with those of ``save()`` there. Only then may the
tensors change. If no thread comes within ``BCP_SNAPSHOT_CONFIRM_S`` seconds of the write's
end, the save's own thread compares them; only a write that started before the copy ended
and is still running then could go unseen.

On CUDA the copy runs on a side stream into pinned memory; the hooks make the caller's stream
wait for it (no host synchronisation) once the copies are queued. Host tensors saved to a
page-cached storage are not copied at all: the writer writes from them, and "the copy is done"
means every piece has gone through ``write()`` (``write_through``).
"""

from __future__ import annotations

import enum
import os
import threading
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..errors import InvalidArgumentError, InvalidSettingError, SnapshotChangedError
from .write_through import enabled as write_through_enabled

CONFIRM_SETTING = "BCP_SNAPSHOT_CONFIRM_S"


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
    if mode is SnapshotMode.OVERLAPPED:
        confirm_timeout()  # bad settings fail here, not in the background
        write_through_enabled()
    return mode


class Snapshot:
    """The copy of one async save's tensors: ``done`` once every copy has landed (or the copy
    failed: the save then fails, and training need not wait any longer); ``confirmed`` once
    the counters were compared after the copy was released (see the module's docstring)."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.queued = threading.Event()  # CUDA: every copy is on the side streams
        self.events: dict[torch.device, Any] = {}  # CUDA: per device, the last copy's event
        self.creator = threading.get_ident()
        self.changed: Callable[[], str | None] = lambda: None  # the stager's: a changed tensor
        self.confirmed = threading.Event()
        self.changed_name: str | None = None
        self._confirm_lock = threading.Lock()
        self._module_hooks: list[Any] = []

    def release_in_child(self) -> None:
        """In a forked child: no thread copies or confirms there, so nothing may wait for
        this snapshot (fresh events: a parent's thread may have held their locks)."""
        for name in ("done", "queued", "confirmed"):
            event = threading.Event()
            event.set()
            setattr(self, name, event)
        self._confirm_lock = threading.Lock()

    def finished(self) -> None:
        self.queued.set()
        self.done.set()
        self._retire()

    def _retire(self) -> None:
        """The step hook may forget this snapshot once its copy is done (on CUDA every step
        until then makes its stream wait for the copy) and it is confirmed."""
        global _ACTIVE
        if self.done.is_set() and self.confirmed.is_set():
            with _LOCK:
                if _ACTIVE is self:
                    _ACTIVE = None

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the copy; once it is done, confirm from this thread (True)."""
        if not self.done.wait(timeout):
            return False
        self.confirm()
        return True

    def released(self) -> bool:
        """Training may write now: the copy is done, or (CUDA) queued before its writes."""
        return self.done.is_set() or (self.queued.is_set() and bool(self.events))

    def confirm(self) -> None:
        """Called on a thread that has reached bytecheckpoint after the copy was released:
        every in-place write this thread issued before has bumped its counter by now, so the
        first call compares the counters with those of save(); from then on writes are the
        next state's."""
        if self.confirmed.is_set():
            return
        with self._confirm_lock:
            if not self.confirmed.is_set():
                self.changed_name = self.changed()
                self.confirmed.set()
        self._retire()

    def settle(self, timeout: float | None = None) -> None:
        """On the save's thread, before this rank reports its files written: wait for a
        confirmation (from here after ``timeout``, default ``BCP_SNAPSHOT_CONFIRM_S``); raise
        ``SnapshotChangedError`` if a saved tensor changed before it."""
        if threading.get_ident() == self.creator:  # the save runs inline, in training's thread
            self.confirm()
        if not self.confirmed.wait(confirm_timeout() if timeout is None else timeout):
            self.confirm()
        if self.changed_name is not None:
            raise SnapshotChangedError(
                f"{self.changed_name} was changed in place after this async save (snapshot="
                "'overlapped') was called and before it was released, so the save could mix two "
                "training states; it is not committed. Call handle.wait_snapshot() before changing "
                "saved tensors outside optimizer.step() and module forward, or save with "
                "snapshot='blocking'")

    def before_write(self) -> None:
        """Called where training is about to change saved tensors: return once it may. On
        CUDA the caller's streams wait for the copies (the host does not)."""
        if not self.done.is_set():
            self.queued.wait()
            if self.done.is_set() or not self.events:
                self.done.wait()
            else:
                for device, event in self.events.items():
                    torch.cuda.current_stream(device).wait_event(event)
        self.confirm()

    def pass_by(self) -> None:
        """A forward that changes no saved tensor: confirm if the copy is released, never wait."""
        if not self.confirmed.is_set() and self.released():
            self.confirm()

    def guard_modules(self, modules: Iterable[torch.nn.Module]) -> None:
        for module in modules:
            if waits_in_forward(module):
                self._module_hooks.append(module.register_forward_pre_hook(
                    lambda _m, _args: self.before_write()))
            else:
                self._module_hooks.append(module.register_forward_pre_hook(
                    lambda _m, _args: self.pass_by()))
            # The end of forward confirms a snapshot taken during it (a write-through one often
            # is): otherwise the commit would wait for the optimizer step, most of a step later.
            self._module_hooks.append(module.register_forward_hook(
                lambda _m, _args, _out: self.pass_by()))

    def remove_module_hooks(self) -> None:
        """On the thread that saved only: a hook list must not change under a running forward."""
        if threading.get_ident() != self.creator:
            return
        hooks, self._module_hooks = self._module_hooks, []
        for h in hooks:
            h.remove()


def saved_modules(state: dict[str, Any]) -> list[torch.nn.Module]:
    """The modules of a saved state whose forward the snapshot guards."""
    return [v for v in state.values() if isinstance(v, torch.nn.Module)]


def waits_in_forward(module: torch.nn.Module) -> bool:
    """A module with buffers changes them in forward (BatchNorm statistics, DDP's buffer
    broadcast): its forward waits for the snapshot."""
    return next(module.buffers(), None) is not None


def confirm_timeout() -> float:
    """``BCP_SNAPSHOT_CONFIRM_S``: how long a written save waits for training to confirm."""
    raw = os.environ.get(CONFIRM_SETTING, "").strip()
    try:
        value = float(raw) if raw else 30.0
    except ValueError:
        raise InvalidSettingError(f"{CONFIRM_SETTING}={raw!r} is not a number of seconds; "
                                   "unset it or give e.g. 30") from None
    if not value >= 0 or value == float("inf"):
        raise InvalidSettingError(f"{CONFIRM_SETTING}={raw!r} must be a finite number of "
                                   "seconds >= 0; unset it or give e.g. 30")
    return value


_ACTIVE: Snapshot | None = None
_LOCK = threading.Lock()
_STEP_HOOK: Any = None


def _before_optimizer_step(_optimizer: Any, _args: Any, _kwargs: Any) -> None:
    snap = _ACTIVE
    if snap is not None:
        snap.before_write()


def _release_in_child() -> None:
    """A forked child's optimizer steps and forwards never wait for the parent's snapshot."""
    global _ACTIVE, _LOCK
    _LOCK = threading.Lock()
    snap, _ACTIVE = _ACTIVE, None
    if snap is not None:
        snap.release_in_child()


os.register_at_fork(after_in_child=_release_in_child)


def warn_if_graph_capturable(state: dict[str, Any]) -> None:
    """An optimizer step replayed from a CUDA graph runs no Python hook and bumps no version
    counter, so neither the wait nor the check of an overlapped snapshot sees it. A saved
    optimizer built with ``capturable=True`` may be stepped that way: say what to do."""
    for key, value in state.items():
        if isinstance(value, torch.optim.Optimizer) and any(
                g.get("capturable") for g in value.param_groups):
            warnings.warn(
                f"state[{key!r}] is an optimizer with capturable=True: a step replayed from a CUDA "
                "graph is not seen by snapshot='overlapped' (no hook runs, no version counter "
                "moves). Call handle.wait_snapshot() before replaying such a graph, or save with "
                "snapshot='blocking'", RuntimeWarning, stacklevel=5)


def begin(state: dict[str, Any], changed: Callable[[], str | None]) -> Snapshot:
    """A snapshot of ``state`` starts: training's writers wait for it from now on.
    ``changed()`` names a saved tensor whose counter moved since save(), or None."""
    global _ACTIVE, _STEP_HOOK
    warn_if_graph_capturable(state)
    snap = Snapshot()
    snap.changed = changed
    with _LOCK:
        if _STEP_HOOK is None:  # once per process: the hook does nothing while none is active
            _STEP_HOOK = register_optimizer_step_pre_hook(_before_optimizer_step)
        _ACTIVE = snap
    snap.guard_modules(saved_modules(state))
    return snap
