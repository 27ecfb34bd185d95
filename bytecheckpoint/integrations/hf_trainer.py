"""Hugging Face ``Trainer``: ``BytecheckpointCallback``.

    args = TrainingArguments(..., save_steps=500, save_only_model=True)
    trainer = Trainer(model, args, ..., callbacks=[BytecheckpointCallback()])
    trainer.train(resume_from_checkpoint=True)   # on a relaunch

At each of the Trainer's saves the callback saves the model, optimizer, LR scheduler, GradScaler
(fp16) and every process's RNG through bytecheckpoint, as step ``<global_step>`` of a root (default
``<output_dir>/bytecheckpoint``) run by a :class:`bytecheckpoint.CheckpointManager` (its
``retention`` applies); with ``save_only_model=True`` the Trainer itself writes only the model
and ``trainer_state.json``. On resume it loads them back at the Trainer's step, and puts the RNG
back where the Trainer's own resume would.

Why a callback and not a full replacement: the Trainer's saving and resuming are private
(``_save_checkpoint``, ``_load_from_checkpoint``, ``_load_optimizer_and_scheduler``,
``_load_rng_state``). Its resume reads ``trainer_state.json`` (step, epoch, how many batches
to skip) and refuses a ``resume_from_checkpoint`` folder without its own model weights, before
any callback runs. Replacing those means overriding private methods, which change between
releases; so the Trainer keeps writing the model and ``trainer_state.json`` (small next to the
optimizer state, which is twice the model for Adam) and the callback does the rest.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import bytecheckpoint as bcp
from bytecheckpoint.errors import CheckpointError, MissingKeysError, NotACheckpointError
from bytecheckpoint.storage import open_storage

from .rng import KeptRNG

try:
    from transformers import TrainerCallback
    from transformers.trainer_utils import rotate_checkpoints
except ImportError as exc:  # the extra is not installed
    raise ImportError("bytecheckpoint.integrations.hf_trainer needs transformers: "
                      "pip install 'bytecheckpoint[transformers]' (transformers 5)") from exc


# Callbacks of this process whose manager is open (under _OPEN_LOCK): a new train() on the same
# root ends the one whose train() stopped on an error outside the callback's hooks.
_OPEN: weakref.WeakSet[BytecheckpointCallback] = weakref.WeakSet()
_OPEN_LOCK = threading.Lock()


def _root_url(root: str) -> str:
    """The root's URL as its CheckpointManager names it."""
    storage, path = open_storage(root)
    return storage.url(path.rstrip("/") or path)


class BytecheckpointCallback(TrainerCallback):
    """Saves the Trainer's model, optimizer, LR scheduler and RNG through bytecheckpoint at each
    of its saves, and restores them when the Trainer resumes.

    Args:
        root: where the checkpoints go (any storage URL); default ``<output_dir>/bytecheckpoint``.
        retention: a retention policy (``bcp.KeepLast(3)``...), applied after each save commits.
        async_save: return once the state is copied to host memory (the next save, the end of
            training or a resume waits for it).
    """

    def __init__(self, root: str | None = None, *, retention: Any = None, async_save: bool = False) -> None:
        self.root = root
        self.retention = retention
        self.async_save = async_save
        self.manager: Any = None
        self._rng: KeptRNG | None = None  # to put back at the first step of a mid-epoch resume
        self._total_limit: int | None = None  # the Trainer's save_total_limit, applied here
        self._args: Any = None  # those of the train() running (its save_total_limit is ours)
        self._thread: threading.Thread | None = None  # the thread running this callback's train()

    def _root(self, args: Any) -> str:
        return self.root or os.path.join(args.output_dir, "bytecheckpoint")

    def _manager(self, args: Any) -> Any:
        if self.manager is None:
            self.manager = bcp.CheckpointManager(self._root(args), retention=self.retention,
                                                 async_save=self.async_save)
            with _OPEN_LOCK:
                _OPEN.add(self)
        return self.manager

    def _end_stale(self, args: Any) -> None:
        """End the manager another callback of this process left open on our root because its
        train() stopped on an error outside the callback's hooks (on_train_end never came), so
        that this train() may save there. Only where that train() cannot still run: it was on
        this thread (which is in this train() now) or on one that has ended. One on another
        live thread may be saving: the manager's two-writers refusal stands."""
        url = _root_url(self._root(args))
        me = threading.current_thread()
        with _OPEN_LOCK:
            others = [c for c in _OPEN if c is not self]
        for other in others:
            manager, thread = other.manager, other._thread
            if manager is not None and manager.url == url and (
                    thread is None or thread is me or not thread.is_alive()):
                other._end(other._args)

    @staticmethod
    def _state(model: Any, optimizer: Any, lr_scheduler: Any, rng: bcp.RNGState) -> dict[str, Any]:
        state: dict[str, Any] = {"model": model, "rng": rng}
        if optimizer is not None:
            state["optimizer"] = getattr(optimizer, "optimizer", optimizer)  # inside Accelerate's wrapper
        if lr_scheduler is not None:
            state["scheduler"] = lr_scheduler
        # fp16 training: the GradScaler, which Accelerate's optimizer wrapper holds. The
        # Trainer's own checkpoint saves it (scaler.pt) but not with save_only_model=True;
        # without it a resumed run starts from the initial scale again.
        scaler = getattr(optimizer, "scaler", None)
        if scaler is not None:
            state["scaler"] = scaler
        return state

    def on_save(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                lr_scheduler: Any = None, **kwargs: Any) -> None:
        saved = self._state(model, optimizer, lr_scheduler, bcp.RNGState())
        with self._ending_on_error(args):
            self._manager(args).save(state.global_step, saved, force=True)
        self._rotate(args, state, in_flight=self.async_save)

    def _take_over_rotation(self, args: Any) -> None:
        """The Trainer deletes its older ``checkpoint-<N>`` folders (``save_total_limit``) while
        saving, before ``on_save``: had our save of that step failed or been killed, the newest
        folder would lack our state and the older ones, which have it, would be gone (nothing to
        resume). So the callback rotates them itself, once its save has committed."""
        limit = args.save_total_limit
        if limit is not None and limit > 0:
            self._total_limit, args.save_total_limit = limit, None

    def _rotate(self, args: Any, state: Any, *, in_flight: bool) -> None:
        if self._total_limit is None or not args.should_save:
            return
        # A save still in flight has not committed: keep one folder more, the one before it.
        rotate_checkpoints(output_dir=args.output_dir, save_total_limit=self._total_limit + int(in_flight),
                           best_model_checkpoint=state.best_model_checkpoint, use_mtime=True)

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                       lr_scheduler: Any = None, **kwargs: Any) -> None:
        if self.manager is not None:
            self._end(self._args or args)  # an earlier train() of this callback stopped on an error
        self._end_stale(args)
        self._args, self._thread = args, threading.current_thread()
        self._take_over_rotation(args)
        if state.global_step == 0:
            return  # a fresh run (the Trainer resumed nothing)
        rng = KeptRNG()
        with self._ending_on_error(args):
            manager = self._manager(args)
            try:
                _restore(manager, self._state(model, optimizer, lr_scheduler, rng), state.global_step)
            except NotACheckpointError as exc:
                raise NotACheckpointError(
                    f"the Trainer resumed at step {state.global_step} but {manager.url} has no "
                    f"bytecheckpoint checkpoint of that step ({exc}); resume from a checkpoint saved with "
                    "this callback"
                    f"{_resumable(manager, args.output_dir, state.global_step)}, or drop the callback to "
                    "resume from the Trainer's own files") from None
        # The Trainer skips the batches of the epoch already seen, which draws from the RNG,
        # then sets the RNG (its own resume does the same); at an epoch boundary it skips nothing.
        mid_epoch = state.epoch is not None and not math.isclose(state.epoch, round(state.epoch))
        self._rng = rng if mid_epoch else None

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        rng, self._rng = self._rng, None
        if rng is not None:
            rng.restore_again()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        try:
            if self.manager is not None:
                self.manager.close()  # the save in flight, retention
            self._rotate(args, state, in_flight=False)
        finally:
            self._end(args)

    def _end(self, args: Any) -> None:
        """This train() is over: free the root (another Trainer of this process may use it) and
        give the Trainer its ``save_total_limit`` back."""
        manager, self.manager = self.manager, None
        self._thread = None
        with _OPEN_LOCK:
            _OPEN.discard(self)
        if manager is not None:
            try:
                manager.close()  # a save still in flight commits, or its error is named here
            except Exception as exc:  # noqa: BLE001 - the error that ended train() is raised already
                warnings.warn(f"{manager.url}: {exc}", RuntimeWarning, stacklevel=2)
        if self._total_limit is not None:
            args.save_total_limit, self._total_limit = self._total_limit, None

    @contextlib.contextmanager
    def _ending_on_error(self, args: Any) -> Iterator[None]:
        try:
            yield
        except BaseException:
            self._end(args)  # train() stops with this error: on_train_end never comes
            raise


def _resumable(manager: Any, output_dir: str, step: int) -> str:
    """The Trainer folder of the newest step before ``step`` that the callback committed (a save
    that failed or was killed leaves the Trainer's folder of its step without our state)."""
    try:
        committed = manager.steps()
    except (CheckpointError, OSError):
        return ""  # the error being raised names the step; this is only a hint
    for c in reversed(committed):
        folder = os.path.join(output_dir, f"checkpoint-{c.step}")
        if c.step is not None and c.step < step and os.path.isdir(folder):
            return f" (the newest: resume_from_checkpoint={folder!r})"
    return ""


def _restore(manager: Any, saved: dict[str, Any], step: int) -> None:
    """Restore ``saved`` from ``step``; a checkpoint written before the callback saved the
    GradScaler resumes without it (a warning says the scale starts over)."""
    try:
        manager.restore(saved, step=step)
    except MissingKeysError as exc:
        if "scaler" not in saved or exc.missing_keys != ["scaler"] or exc.unexpected_keys:
            raise
        warnings.warn(f"{manager.url}: the checkpoint of step {step} holds no GradScaler state (saved by an "
                      "older version of the callback); the loss scale starts from its initial value",
                      RuntimeWarning, stacklevel=3)
        manager.restore({k: v for k, v in saved.items() if k != "scaler"}, step=step)
