"""Timelines: which checkpoints of a root a rollback abandoned.

Every checkpoint a :class:`~bytecheckpoint.manager.CheckpointManager` saves records, in its user
metadata under ``"bcp.manager"``, the timeline it belongs to: an id, and the branches that led
to it (``[[parent timeline id, step it branched at], ...]``, nearest first). The rule:

* a fresh run starts a new timeline with no branches;
* restoring the checkpoint that ``latest`` names continues its timeline;
* restoring any other checkpoint (step ``s`` of timeline ``P``) starts a new timeline that
  branches from ``P`` at ``s``: it inherits ``P``'s checkpoints up to step ``s`` (and what ``P``
  itself inherited), and nothing of ``P`` after ``s``;
* the *live* timeline is the timeline of the checkpoint ``latest`` names; a checkpoint is
  *abandoned* when it is not on the live timeline. ``latest`` names the newest save of the
  live timeline, so a save on a new branch moves it even to a lower step.

Checkpoints without a record (saved by ``bcp.save`` directly, or by earlier releases) all
belong to the unnamed timeline ``""``, on which ``latest`` only moves forward, as before.
Pure functions of metadata values: no I/O, no torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

MANAGER_KEY = "bcp.manager"  # the user-metadata entry the manager owns
_MAX_BRANCHES = 100_000


@dataclass(frozen=True)
class Timeline:
    id: str
    branches: tuple[tuple[str, int], ...] = ()  # (ancestor id, step it branched at), nearest first

    def record(self) -> dict[str, Any]:
        return {"timeline": self.id, "branches": [[t, s] for t, s in self.branches]}

    def branch(self, step: int, new_id: str) -> Timeline:
        """The timeline a restore of step ``step`` of this one starts."""
        return Timeline(new_id, ((self.id, step),) + self.branches)

    def holds(self, other: Timeline, step: int | None) -> bool:
        """Whether a checkpoint of timeline ``other`` at ``step`` is on this timeline."""
        if other.id == self.id:
            return True
        for tid, base in self.branches:
            if tid == other.id:
                return step is not None and step <= base
        return False


UNNAMED = Timeline("")


def timeline_of(user_metadata: Mapping[str, Any] | None) -> Timeline:
    """The timeline a checkpoint's user metadata records; the unnamed one where there is none
    or it is malformed (metadata may come from anywhere: nothing here trusts its shape)."""
    doc = user_metadata.get(MANAGER_KEY) if isinstance(user_metadata, Mapping) else None
    if not isinstance(doc, Mapping) or not isinstance(doc.get("timeline"), str):
        return UNNAMED
    branches = []
    raw = doc.get("branches")
    for entry in raw[:_MAX_BRANCHES] if isinstance(raw, list) else []:
        if (isinstance(entry, (list, tuple)) and len(entry) == 2 and isinstance(entry[0], str)
                and isinstance(entry[1], int) and not isinstance(entry[1], bool)):
            branches.append((entry[0], entry[1]))
    return Timeline(doc["timeline"], tuple(branches))


def metrics_of(user_metadata: Mapping[str, Any] | None) -> dict[str, float]:
    """The metrics recorded with a checkpoint (numbers only)."""
    doc = user_metadata.get(MANAGER_KEY) if isinstance(user_metadata, Mapping) else None
    raw = doc.get("metrics") if isinstance(doc, Mapping) else None
    if not isinstance(raw, Mapping):
        return {}
    return {str(k): float(v) for k, v in raw.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)}


def abandons(new: Mapping[str, Any] | None, old: Mapping[str, Any] | None, old_step: int | None) -> bool:
    """Whether a checkpoint saved with user metadata ``new`` abandons one saved with ``old`` at
    ``old_step`` (``latest`` then moves to the new one whatever the steps)."""
    return not timeline_of(new).holds(timeline_of(old), old_step)


def abandoned_flags(items: list[tuple[str, Mapping[str, Any] | None, int | None, bool, float]]) -> list[bool]:
    """For checkpoints given as ``(run, user_metadata, step, named_by_latest, time)``: whether
    each is abandoned, i.e. not on the live timeline of its run (the timeline of the checkpoint
    ``latest`` names, else of the newest save). Unreadable metadata is passed as None: such a
    checkpoint is never called abandoned."""
    live: dict[str, tuple[bool, float, Timeline]] = {}
    for run, meta, _step, is_latest, t in items:
        if meta is None:
            continue
        rank = (is_latest, t)
        if run not in live or rank > live[run][:2]:
            live[run] = (is_latest, t, timeline_of(meta))
    return [meta is not None and run in live and not live[run][2].holds(timeline_of(meta), step)
            for run, meta, step, _latest, _t in items]
