"""Cooling policies: the tiering service's notion of age, on top of the core's retention policies
(:mod:`bytecheckpoint.manage.retention`) and protection rule (:mod:`bytecheckpoint.manage.protection`)."""

from .rules import ModifiedWithin, OlderThan

__all__ = ["ModifiedWithin", "OlderThan"]
