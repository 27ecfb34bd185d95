"""The checkpoint manager: schedule, retention, restore and rollback, preemption.

``timeline``, ``retention`` and ``records`` import no torch (``bcp ls`` and ``bcp gc`` use
them); ``CheckpointManager`` loads on first use.
"""

from typing import TYPE_CHECKING

from ..commit.timeline import Timeline
from ..manage.records import CheckpointInfo
from ..manage.retention import AllOf, AnyOf, Context, KeepBest, KeepEvery, KeepLast, KeepNewerThan, Policy

if TYPE_CHECKING:
    from .manager import CheckpointManager


def __getattr__(name: str) -> object:
    if name == "CheckpointManager":
        from .manager import CheckpointManager

        return CheckpointManager
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["AllOf", "AnyOf", "CheckpointInfo", "CheckpointManager", "Context", "KeepBest", "KeepEvery",
           "KeepLast", "KeepNewerThan", "Policy", "Timeline"]
