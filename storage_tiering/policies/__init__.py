"""Cooling and retention policies: one small dataclass each, composed with AnyOf/AllOf/Not."""

from .base import AllOf, AnyOf, Context, Not, Policy
from .rules import EveryKSteps, FullyCold, NewestPerRun, OlderThan, Untouchable

__all__ = ["AllOf", "AnyOf", "Context", "EveryKSteps", "FullyCold", "NewestPerRun", "Not", "OlderThan",
           "Policy", "Untouchable"]
