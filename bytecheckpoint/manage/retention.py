"""Retention: which committed checkpoints to keep, as small composable policies.

Shaped like Orbax's preservation policies and the tiering service's: each policy is a frozen
dataclass with one method, ``select(checkpoints, *, context) -> list[bool]`` (True = keep),
output aligned with input; the clock comes in through the context. ``a | b`` keeps what
either keeps, ``a & b`` what both keep.

A policy only proposes. :func:`plan_deletions` applies one to the checkpoints of each run's
live timeline and never deletes a *protected* checkpoint (:mod:`.protection`), whatever the
policy says: one named by ``latest``, pinned, being read (a lease), being saved, abandoned by a
rollback (kept until a person deletes it), or one that cannot be classified. Abandoned
checkpoints take no place in the policy's counts (``KeepLast(2)`` keeps the two newest of the
live timeline). The manager, ``bcp gc`` and the tiering service all decide through it.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ..errors import InvalidArgumentError
from .protection import counted, protected_reason


@dataclass(frozen=True, kw_only=True)
class Context:
    now: float  # seconds since the epoch, as the checkpoints' ``time``


class Checkpoint(Protocol):
    """What a policy reads of a checkpoint."""

    step: int | None
    time: float
    metrics: dict[str, float]


class Policy:
    """Base of the policies: ``|`` and ``&`` combine them."""

    def select(self, checkpoints: Sequence[Any], *, context: Context) -> list[bool]:
        raise NotImplementedError

    def __or__(self, other: Policy) -> AnyOf:
        return AnyOf((self, _policy(other)))

    def __and__(self, other: Policy) -> AllOf:
        return AllOf((self, _policy(other)))


def _policy(p: Any) -> Policy:
    if not isinstance(p, Policy):
        raise InvalidArgumentError(f"{p!r} is not a retention policy (KeepLast, KeepEvery, KeepBest, "
                                   "KeepNewerThan, or a combination of them with | and &)")
    return p


def _count(name: str, k: Any) -> None:
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise InvalidArgumentError(
            f"{name}({k!r}) would keep no checkpoint, so retention would delete every one: give a "
            "whole number >= 1 (or no retention policy to keep everything)")


def _order(c: Any) -> tuple[int, float]:
    return (c.step if isinstance(c.step, int) else -1, c.time)


def _newest_first(checkpoints: Sequence[Any]) -> list[int]:
    """Indices, newest first: by step, then time; by time alone when some checkpoint has no
    step (``save()`` without one), which would otherwise always count as the oldest."""
    if all(isinstance(c.step, int) for c in checkpoints):
        return sorted(range(len(checkpoints)), key=lambda i: _order(checkpoints[i]), reverse=True)
    return sorted(range(len(checkpoints)), key=lambda i: checkpoints[i].time, reverse=True)


@dataclass(frozen=True)
class KeepLast(Policy):
    """The ``k`` newest checkpoints (by step, then time; by time alone in a run where some
    checkpoint was saved without a step)."""

    k: int

    def __post_init__(self) -> None:
        _count("KeepLast", self.k)

    def select(self, checkpoints: Sequence[Any], *, context: Context) -> list[bool]:
        keep = set(_newest_first(checkpoints)[: self.k])
        return [i in keep for i in range(len(checkpoints))]


@dataclass(frozen=True)
class KeepEvery(Policy):
    """Checkpoints whose step is a multiple of ``k``, and those saved without a step (which
    cannot be judged by it)."""

    k: int

    def __post_init__(self) -> None:
        _count("KeepEvery", self.k)

    def select(self, checkpoints: Sequence[Any], *, context: Context) -> list[bool]:
        return [not isinstance(c.step, int) or c.step % self.k == 0 for c in checkpoints]


@dataclass(frozen=True)
class KeepBest(Policy):
    """The ``k`` checkpoints with the best value of ``metric`` (recorded by ``save(...,
    metrics={...})``); ``mode`` is ``"min"`` (a loss) or ``"max"`` (an accuracy). Checkpoints
    without the metric (or with NaN) are not among the best."""

    k: int
    metric: str
    mode: str = "min"

    def __post_init__(self) -> None:
        _count("KeepBest", self.k)
        if self.mode not in ("min", "max"):
            raise InvalidArgumentError(f"KeepBest(mode={self.mode!r}): give 'min' or 'max'")
        if not isinstance(self.metric, str) or not self.metric:
            raise InvalidArgumentError(f"KeepBest(metric={self.metric!r}): give the metric's name")

    def select(self, checkpoints: Sequence[Any], *, context: Context) -> list[bool]:
        scored = [(c.metrics.get(self.metric), i) for i, c in enumerate(checkpoints)]
        scored = [(v, i) for v, i in scored if v is not None and not math.isnan(v)]
        scored.sort(key=lambda x: (x[0] if self.mode == "min" else -x[0], -_order(checkpoints[x[1]])[0]))
        keep = {i for _, i in scored[: self.k]}
        return [i in keep for i in range(len(checkpoints))]


@dataclass(frozen=True)
class KeepNewerThan(Policy):
    """Checkpoints saved less than ``seconds`` ago."""

    seconds: float

    def __post_init__(self) -> None:
        s = self.seconds
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not s > 0:
            raise InvalidArgumentError(
                f"KeepNewerThan({self.seconds!r}) would keep no checkpoint: give a duration in seconds > 0")

    def select(self, checkpoints: Sequence[Any], *, context: Context) -> list[bool]:
        return [context.now - c.time < self.seconds for c in checkpoints]


@dataclass(frozen=True)
class _Combined(Policy):
    """Policies joined element-wise: ``_join`` (any / all) over each checkpoint's selections."""

    policies: tuple[Policy, ...]
    _join = staticmethod(any)

    def __post_init__(self) -> None:
        for p in self.policies:
            _policy(p)

    def select(self, checkpoints: Sequence[Any], *, context: Context) -> list[bool]:
        masks = [p.select(checkpoints, context=context) for p in self.policies]
        return [self._join(m[i] for m in masks) for i in range(len(checkpoints))]


class AnyOf(_Combined):
    """Keeps what any of its policies keeps (``a | b``)."""


class AllOf(_Combined):
    """Keeps what every one of its policies keeps (``a & b``)."""

    _join = staticmethod(all)


@dataclass(frozen=True)
class Decision:
    checkpoint: Any
    delete: bool
    reason: str


class KeepNone(Policy):
    """Keeps nothing: what a tiering pass with no age and no count to keep hot proposes."""

    def select(self, checkpoints: Sequence[Any], *, context: Context) -> list[bool]:
        return [False] * len(checkpoints)

    def __repr__(self) -> str:
        return "KeepNone()"


def any_of(policies: Sequence[Policy]) -> Policy:
    """The policies joined with ``|``; :class:`KeepNone` when there are none."""
    return AnyOf(tuple(policies)) if len(policies) > 1 else (policies[0] if policies else KeepNone())


def kept_by(checkpoints: Sequence[Any], policy: Policy, *, context: Context,
            refuse_empty: bool = False) -> list[bool]:
    """What ``policy`` keeps, run by run (``run``), among the checkpoints it may count
    (:func:`~.protection.counted`); False for the others. With ``refuse_empty``, a policy that
    keeps none of a run's checkpoints is refused (InvalidArgumentError)."""
    runs: dict[str, list[int]] = defaultdict(list)
    for i, c in enumerate(checkpoints):
        if counted(c):
            runs[c.run].append(i)
    kept = [False] * len(checkpoints)
    for idx in runs.values():
        mask = policy.select([checkpoints[i] for i in idx], context=context)
        if refuse_empty and not any(mask):
            raise InvalidArgumentError(
                f"the retention policy {policy!r} keeps none of the {len(idx)} checkpoints, so it "
                "would delete every one; nothing was deleted. Add KeepLast(1) to it with |")
        for i, k in zip(idx, mask):
            kept[i] = bool(k)
    return kept


def plan_deletions(checkpoints: Sequence[Any], policy: Policy, *, context: Context,
                   refuse_empty: bool = True) -> list[Decision]:
    """One decision per checkpoint, aligned with the input. In each run (``run``), the policy
    sees only the checkpoints it may count (committed, classifiable, not abandoned); protected
    ones are kept whatever it says. With ``refuse_empty``, a policy that keeps none of a run's
    checkpoints is refused (InvalidArgumentError; nothing is deleted)."""
    kept = kept_by(checkpoints, policy, context=context, refuse_empty=refuse_empty)
    out = []
    for i, c in enumerate(checkpoints):
        why = protected_reason(c)
        if why is not None:
            out.append(Decision(c, False, why))
        elif kept[i]:
            out.append(Decision(c, False, "kept by the retention policy"))
        else:
            out.append(Decision(c, True, "not kept by the retention policy"))
    return out
