"""Hugging Face Accelerate: ``save_state`` / ``load_state`` through bytecheckpoint.

    from bytecheckpoint.integrations.accelerate import load_state, save_state
    model, optim, sched, loader = accelerator.prepare(model, optim, sched, loader)
    start = load_state(accelerator, "ckpt") or 0             # None on a fresh start
    batches = skip_first_batches(accelerator, loader, start % len(loader))  # mid-epoch
    ...
    save_state(accelerator, f"ckpt/step_{step}", step=step)  # on every process

They save what ``accelerator.save_state`` saves (every prepared model, optimizer, scheduler and
data loader, the ``GradScaler``, objects given to ``register_for_checkpointing``, every
process's RNG and ``accelerator.step``), plus each data loader's epoch (``iteration``, which
seeds its shuffling), as one bytecheckpoint checkpoint: models and optimizers tensor by tensor
(deduplicated, resharded on load), the rest packed, nothing pickled.

Why helpers and not Accelerate's hooks: ``register_save_state_pre_hook`` only lets a hook take
the model weights out of ``save_state``; optimizers, schedulers, samplers and RNG states are
still written by ``torch.save`` and read back by ``torch.load`` (pickle). A helper that takes
the accelerator saves all of it through one path, on every process at once.
"""

from __future__ import annotations

import os
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import bytecheckpoint as bcp
from bytecheckpoint.commit.integrity import read_metadata, resolve
from bytecheckpoint.commit.save_lock import LOCK_SUFFIX, STAGING_TAG
from bytecheckpoint.engine.async_save import wait_pending
from bytecheckpoint.errors import CorruptCheckpointError, InvalidArgumentError, MissingKeysError

from .rng import KeptRNG

try:
    import accelerate
except ImportError as exc:  # the extra is not installed
    raise ImportError("bytecheckpoint.integrations.accelerate needs Hugging Face Accelerate: "
                      "pip install 'bytecheckpoint[accelerate]' (accelerate 1.15)") from exc


class _Counter:
    """``accelerator.step`` (the gradient-accumulation counter) as a stateful object."""

    def __init__(self, accelerator: Any) -> None:
        self.accelerator = accelerator

    def state_dict(self) -> dict[str, int]:
        return {"step": int(self.accelerator.step)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.accelerator.step = int(state["step"])


class _LoaderPosition:
    """Where a prepared data loader is: its epoch (``iteration``) and its seedable sampler's
    seed, which fix the epoch's order (the seed defaults to torch's initial seed when
    ``prepare`` ran, so a resumed process would shuffle differently); and, for a stateful
    loader (``use_stateful_dataloader=True``), its position within the epoch."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def _sampler(self) -> Any:
        get = getattr(self.loader, "get_sampler", None)
        sampler = get() if callable(get) else None
        return sampler if hasattr(sampler, "initial_seed") else None

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"iteration": _epoch_to_resume(self.loader)}
        sampler = self._sampler()
        if sampler is not None:
            state["sampler_seed"] = int(sampler.initial_seed)
        batches = _batches(self.loader)
        if batches is not None:
            state["batches"] = batches
        if getattr(self.loader, "use_stateful_dataloader", False):
            state["loader"] = self.loader.state_dict()
            if sampler is None and _reshuffles_from_global_rng(self.loader):
                _warn_unseeded(self.loader)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if hasattr(self.loader, "iteration"):
            self.loader.iteration = int(state["iteration"])
        sampler = self._sampler()
        if sampler is not None and "sampler_seed" in state:
            sampler.initial_seed = int(state["sampler_seed"])
        if "loader" in state and getattr(self.loader, "use_stateful_dataloader", False):
            self.loader.load_state_dict(state["loader"])
        saved, now = state.get("batches"), _batches(self.loader)
        if saved is not None and now is not None and saved != now:
            warnings.warn(
                f"the checkpoint's data loader had {saved} batches an epoch, this one has {now} (another "
                "batch size, data set or number of processes): the epoch and the steps restored count "
                "the saving run's batches, so skipping into the epoch by this loader's batches does "
                "not continue at the sample the checkpoint reached", RuntimeWarning, stacklevel=2)


def _batches(loader: Any) -> int | None:
    """Batches an epoch of ``loader`` (None where it has no length: an iterable data set)."""
    try:
        return int(len(loader))
    except (TypeError, NotImplementedError):
        return None


def _epoch_to_resume(loader: Any) -> int:
    """The epoch (``iteration``) a resume starts in. A loader counts an epoch only when asked
    for the batch after its last one, so a save during the last batch (a save every N steps
    landing on an epoch's end) would resume into the epoch just read, in its order again: that
    epoch is counted here. The epoch of a resumed run is read through the loader
    :func:`skip_first_batches` made, which counts it instead."""
    running = _SKIPPING.get(loader)
    source = running if running is not None and _iterating(running) else loader
    epoch = int(getattr(source, "iteration", 0))
    if _iterating(source) and getattr(source, "end_of_dataloader", False):
        epoch += 1
    return epoch


def _iterating(loader: Any) -> bool:
    """Whether an iterator of Accelerate's ``loader`` is under way (not ended)."""
    refs = getattr(getattr(loader, "gradient_state", None), "dataloader_references", None) or ()
    return any(r is loader for r in refs)


_SKIPPING: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def _reshuffles_from_global_rng(loader: Any) -> bool:
    """A shuffling sampler without a generator of its own draws each epoch's order from torch's
    global RNG when the epoch starts: a resumed process cannot draw that order again."""
    import torch.utils.data as tud

    get = getattr(loader, "get_sampler", None)
    sampler = get() if callable(get) else None
    return isinstance(sampler, tud.RandomSampler) and sampler.generator is None


def _order_not_saved(loader: Any) -> bool:
    """A shuffling sampler that is not Accelerate's seedable one: its epoch order comes from a
    generator (the global one, or its own) whose state at the epoch's start no checkpoint keeps."""
    import torch.utils.data as tud

    get = getattr(loader, "get_sampler", None)
    sampler = get() if callable(get) else None
    return isinstance(sampler, tud.RandomSampler) and not hasattr(sampler, "initial_seed")


_WARNED: weakref.WeakSet[Any] = weakref.WeakSet()


def _warn_unseeded(loader: Any) -> None:
    if loader not in _WARNED:
        _WARNED.add(loader)
        warnings.warn(
            "a stateful data loader with a plain shuffling sampler is saved mid-epoch, but its "
            "epoch order came from torch's global RNG when the epoch began, so a resumed run "
            "skips the batches already seen of a *different* order. For an exact resume pass "
            "DataLoaderConfiguration(use_stateful_dataloader=True, use_seedable_sampler=True) "
            "to the Accelerator", RuntimeWarning, stacklevel=3)


_RESUMED: weakref.WeakKeyDictionary[Any, KeptRNG] = weakref.WeakKeyDictionary()


def _numbered(name: str, i: int) -> str:
    return name if i == 0 else f"{name}_{i}"


def accelerator_state(accelerator: Any) -> dict[str, Any]:
    """The bytecheckpoint state of everything ``accelerator`` prepared (the same on save and load)."""
    if not isinstance(accelerator, accelerate.Accelerator):
        raise InvalidArgumentError(f"give the Accelerator itself, not a {type(accelerator).__name__}")
    kind = str(accelerator.distributed_type)
    if any(k in kind for k in ("DEEPSPEED", "MEGATRON", "XLA")):
        raise InvalidArgumentError(
            f"accelerator.distributed_type is {kind}: that engine saves its own state; use "
            "accelerator.save_state there")
    state: dict[str, Any] = {}
    for i, model in enumerate(accelerator._models):
        state[_numbered("model", i)] = model
    for i, opt in enumerate(accelerator._optimizers):
        state[_numbered("optimizer", i)] = getattr(opt, "optimizer", opt)  # inside AcceleratedOptimizer
    for i, sched in enumerate(accelerator._schedulers):
        state[_numbered("scheduler", i)] = sched
    for i, loader in enumerate(accelerator._dataloaders):
        state[_numbered("dataloader", i)] = _LoaderPosition(loader)
    for i, obj in enumerate(accelerator._custom_objects):
        state[_numbered("custom", i)] = obj
    if accelerator.scaler is not None:
        state["scaler"] = accelerator.scaler
    state["accelerator"] = _Counter(accelerator)
    state["rng"] = KeptRNG()
    return state


def save_state(accelerator: Any, path: str, *, step: int | None = None, async_save: bool = False,
               **save_kwargs: Any) -> Any:
    """Save everything ``accelerator`` prepared to the checkpoint ``path``; call it on every
    process. ``step`` is recorded (and ``<parent>/latest`` names the newest step). Returns the
    ``SaveResult`` (a ``SaveHandle`` with ``async_save=True``)."""
    state = accelerator_state(accelerator)
    accelerator.wait_for_everyone()  # no process still in its step while others copy state
    return bcp.save(str(path), state, step=step, async_save=async_save, **save_kwargs)


def load_state(accelerator: Any, path: str, **load_kwargs: Any) -> int | None:
    """Load the checkpoint ``path`` (or the one a root's ``latest`` names) into everything
    ``accelerator`` prepared, on every process; return its step, or None when ``path`` holds
    no checkpoint yet (a fresh start: nothing is changed). Models and optimizers reshard to
    this number of processes; per-process state (schedulers, data loaders, RNG) needs the
    same number unless every process saved the same value.

    To continue mid-epoch, skip the batches already seen with :func:`skip_first_batches`
    (``skip_first_batches(accelerator, loader, step % len(loader))``): the epoch's order is
    restored, and so is the RNG once the loader starts."""
    wait_pending()  # an async save of this process commits first: it may be the newest
    target = str(path)
    if "://" not in target and _holds_nothing(target):
        return None  # fresh start: one code path serves fresh and resumed runs
    state = accelerator_state(accelerator)
    if load_kwargs.get("strict", True):
        target = _check_nothing_left_out(target, state)
    step = bcp.load(target, state, **load_kwargs).step
    _RESUMED[accelerator] = state["rng"]
    return step


def _holds_nothing(target: str) -> bool:
    """A local path with no checkpoint yet: missing, empty, or holding only what a first save
    killed before its commit left (its staging directory, owner record and lock), which the next
    save clears. Anything else (a checkpoint moved aside by an overwrite...) goes to ``bcp.load``."""
    if not os.path.isdir(target):
        return not os.path.exists(target)
    return all(STAGING_TAG in n or n.endswith(LOCK_SUFFIX) for n in os.listdir(target))


def _check_nothing_left_out(target: str, state: dict[str, Any]) -> str:
    """The checkpoint ``target`` names (a root: the one its ``latest`` names), refused before
    anything loads when it holds objects this accelerator has not prepared or registered (a
    scheduler, a data loader, a registered object): ``bcp.load`` leaves a top-level entry
    the state does not name alone, and the run would go on without it (a constant LR...)."""
    storage, path = resolve(target)
    try:
        meta = read_metadata(storage, path)
    except (OSError, CorruptCheckpointError):
        return target  # replaced meanwhile, or damaged: bcp.load looks again, or names it
    saved = {t.key.split("/", 1)[0] for t in meta.tensors} | {o.key.split("/", 1)[0] for o in meta.objects}
    extra = sorted(saved - set(state))
    url = storage.url(path)
    if extra:
        raise MissingKeysError(
            f"{url} holds {', '.join(extra)}, which this accelerator has not prepared or registered "
            "(the saving run had more objects); prepare and register the same objects as the run "
            "that saved, or load the parts you want with bcp.load", [], extra)
    return url


def skip_first_batches(accelerator: Any, loader: Any, num_batches: int) -> Iterator[Any]:
    """``accelerator.skip_first_batches(loader, num_batches)`` for the first epoch after
    :func:`load_state`, exactly as the uninterrupted run would have gone on.

    A new loader iterator draws its base seed from torch's global generator when it starts;
    the uninterrupted run drew that at the start of the epoch, before the checkpoint, so after
    the resumed iterator starts, every process's RNG is put back to the checkpoint's (as the
    Hugging Face Trainer does). Without a preceding ``load_state`` it only skips."""
    skipped = accelerator.skip_first_batches(loader, num_batches)
    if skipped is not loader:
        _SKIPPING[loader] = skipped
    kept = _RESUMED.pop(accelerator, None)
    if kept is not None and num_batches > 0 and _order_not_saved(loader):
        warnings.warn(
            f"skipping {num_batches} batches of a resumed epoch whose shuffling order was not saved (a "
            "plain RandomSampler draws it when the epoch begins, from an RNG that has moved on since): "
            "the batches skipped and those that follow are not the ones the interrupted run had. For an "
            "exact resume pass DataLoaderConfiguration(use_seedable_sampler=True) to the Accelerator",
            RuntimeWarning, stacklevel=2)

    def batches() -> Iterator[Any]:
        it = iter(skipped)
        first = next(it, _END)  # the iterator starts (and draws) here
        if kept is not None:
            kept.restore_again()
        if first is not _END:
            yield first
            yield from it
        _epoch_done(loader, skipped)

    return batches()


def _epoch_done(loader: Any, skipped: Any) -> None:
    """The epoch read through ``skipped`` (a new loader Accelerate made) ended: count it on
    ``loader`` too. Its ``iteration`` seeds the next epoch's shuffling; left behind, the next
    epoch would repeat the resumed epoch's order."""
    if skipped is not loader and hasattr(loader, "iteration") and hasattr(skipped, "iteration"):
        loader.iteration = max(int(loader.iteration), int(skipped.iteration))


_END = object()
