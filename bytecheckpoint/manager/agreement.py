"""How every rank learns what one rank saw (a preemption signal, a save request, its clock),
without a collective on every training step.

Each rank keeps its flags locally (setting one is an assignment: a signal handler may do it).
Every ``check_every`` steps each rank starts a non-blocking MAX all-reduce of its flags on a
gloo group of its own, and takes the result of the one it started ``check_every`` steps
before; that result is the decision, identical on every rank, at the same step. A step with
no check costs one modulo; a check costs starting a tiny all-reduce and collecting one that
finished long ago. A flag set at step ``s`` is acted on within ``2 * check_every`` steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..runtime.comm import gloo_group_of

STOP, SAVE = 0, 1  # flag positions


@dataclass(frozen=True)
class Agreed:
    stop: bool = False
    save: bool = False


@dataclass(frozen=True)
class Final:
    stop: bool  # some rank saw a preemption signal
    able: bool  # every rank can save, at one step
    step: int
    save: bool = False  # some rank asked for a save (a request, its clock) not made since


class Agreement:
    def __init__(self, process_group: Any = None, check_every: int = 4) -> None:
        self.check_every = check_every
        self.flags = [0, 0]  # this rank's: written by signal handlers and the schedule
        self._distributed = dist.is_available() and dist.is_initialized()
        self._group = None
        if self._distributed:
            group = process_group if process_group is not None else dist.group.WORLD
            ranks = dist.get_process_group_ranks(group)
            # Its own group: the all-reduce in flight never interleaves with training's or saves'.
            # Made with ``group`` as parent: members of a subgroup agree on its name first.
            self._group = gloo_group_of(ranks, group)
        self._pending: tuple[Any, torch.Tensor] | None = None
        # A save was made on every rank since the all-reduce in flight was started: the save
        # requests it carries (sent before that save) are met, and must not make a second one.
        self._met = False

    def poll(self, step: int) -> Agreed | None:
        """The agreed flags at this step (None when this step has no check)."""
        if step % self.check_every:
            return None
        if not self._distributed:
            agreed = Agreed(bool(self.flags[STOP]), bool(self.flags[SAVE]))
            self.flags[SAVE] = 0
            return agreed
        agreed = self._collect()
        tensor = torch.tensor(self.flags, dtype=torch.int32)
        self.flags[SAVE] = 0  # sent: a save request is acted on once
        work = dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
        self._pending = (work, tensor)
        return agreed

    def _collect(self) -> Agreed:
        """The result of the all-reduce in flight (every rank started it, so every rank must
        collect it), less the save requests a save since has met; nothing when none is."""
        pending, self._pending = self._pending, None
        met, self._met = self._met, False
        if pending is None:
            return Agreed()
        work, tensor = pending
        work.wait()
        return Agreed(bool(tensor[STOP]), bool(tensor[SAVE]) and not met)

    def saved(self) -> None:
        """Every rank started a save at this step: it meets the save requests made so far, the
        ones this rank has not sent yet and the ones of the all-reduce in flight (the clock's,
        set every step while a save was due, would otherwise make a second save one check
        later)."""
        self.flags[SAVE] = 0
        self._met = self._pending is not None

    def now(self) -> Agreed:
        """Agree at once (a blocking all-reduce): for the loop's end, where no later check comes."""
        if not self._distributed:
            return Agreed(bool(self.flags[STOP]), bool(self.flags[SAVE]))
        tensor = torch.tensor(self.flags, dtype=torch.int32)
        self.close()
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self._group)
        return Agreed(bool(tensor[STOP]), bool(tensor[SAVE]))

    def final(self, able: bool, step: int, timeout_s: float) -> Final | None:
        """The last agreement, at close: the flags, whether every rank can save (``able``) and
        gave the same ``step``. None when some rank did not take part within ``timeout_s``
        (it crashed or never closes): waiting longer would only hang the job's exit."""
        if not self._distributed:
            return Final(bool(self.flags[STOP]), able, step, bool(self.flags[SAVE]))
        try:
            # The same on every rank: what the ranks agreed last and no save has met since.
            sent = self._collect()
            stop, save = int(self.flags[STOP] or sent.stop), int(self.flags[SAVE] or sent.save)
            # MAX of [stop, save, unable, step, -step]: any rank's stop, request or inability,
            # and the step range.
            tensor = torch.tensor([stop, save, int(not able), step, -step], dtype=torch.int64)
            work = dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
            work.wait(timeout=timedelta(seconds=timeout_s))
        except (RuntimeError, ValueError):  # gloo's timeout, a peer gone, the group destroyed;
            return None  # the group is not used again
        stop, save, unable, high, low = (int(v) for v in tensor)
        return Final(bool(stop), not unable and high == -low, high, bool(save))

    def close(self) -> None:
        """Collect the all-reduce in flight (every rank started it, so every rank must)."""
        self._collect()
