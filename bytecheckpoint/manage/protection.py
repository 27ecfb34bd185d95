"""Which checkpoints are protected: the one rule ``bcp gc``, ``bcp ls``, the manager's retention
and the tiering service share.

Two levels, each a reason (a sentence ``bcp ls``/``gc`` and the tiering report print) or None:

* *untouchable* (:func:`untouchable_reason`): neither moved nor deleted, whatever a policy
  says: one that cannot be classified (an odd step, unreadable metadata or ``latest``), one not
  committed (a save being written, or abandoned half-way), one a save to its path is replacing,
  a pinned one, one being read (a lease), the one ``latest`` names;
* *protected* (:func:`protected_reason`): never deleted by retention: untouchable, or abandoned
  by a rollback (kept until a person deletes it; cooling it is fine).

Retention counts (``KeepLast(2)``: the two newest) only the checkpoints :func:`counted` says:
committed, classifiable and on the live timeline. The checkpoints are read by attribute
(:class:`~bytecheckpoint.manage.records.CheckpointInfo`).
"""

from __future__ import annotations

from .records import CheckpointInfo


def untouchable_reason(c: CheckpointInfo) -> str | None:
    """Why ``c`` may be neither moved nor deleted; None if it may."""
    if c.problem is not None:  # a missing cold tier says so itself: the checkpoint is committed
        return c.problem if c.unreachable is not None else f"cannot be classified: {c.problem}"
    if not c.committed:
        return "a save is being written" if c.staging else "uncommitted"
    if c.staging:
        return "a save to this path is under way"
    if c.pinned:
        return "pinned"
    if c.being_read:
        return "being read (lease)"
    if c.latest:
        return "named by latest"
    return None


def protected_reason(c: CheckpointInfo) -> str | None:
    """Why retention may never delete ``c``; None if it may."""
    why = untouchable_reason(c)
    if why is None and c.abandoned:
        return "abandoned by a rollback (kept until deleted by hand)"
    return why


def counted(c: CheckpointInfo) -> bool:
    """Whether ``c`` takes a place in a retention policy's counts."""
    return c.committed and c.problem is None and not c.abandoned
