"""The policy protocol: a list of checkpoints in, one boolean per checkpoint out.

Shaped like Orbax's preservation policies: each policy is a small frozen dataclass with one
method, output aligned with input, and the clock comes in through the context so tests
never sleep.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from bytecheckpoint.manage.catalog import CheckpointInfo


@dataclass(frozen=True, kw_only=True)
class Context:
    now: float


class Policy(Protocol):
    def select(self, checkpoints: Sequence[CheckpointInfo], *, context: Context) -> list[bool]: ...


@dataclass(frozen=True)
class AnyOf:
    policies: tuple[Policy, ...]

    def select(self, checkpoints: Sequence[CheckpointInfo], *, context: Context) -> list[bool]:
        masks = [p.select(checkpoints, context=context) for p in self.policies]
        return [any(m[i] for m in masks) for i in range(len(checkpoints))]


@dataclass(frozen=True)
class AllOf:
    policies: tuple[Policy, ...]

    def select(self, checkpoints: Sequence[CheckpointInfo], *, context: Context) -> list[bool]:
        masks = [p.select(checkpoints, context=context) for p in self.policies]
        return [all(m[i] for m in masks) for i in range(len(checkpoints))]


@dataclass(frozen=True)
class Not:
    policy: Policy

    def select(self, checkpoints: Sequence[CheckpointInfo], *, context: Context) -> list[bool]:
        return [not x for x in self.policy.select(checkpoints, context=context)]
