"""One checkpoint of a root, as every tool sees it: ``bcp ls`` lists it, ``bcp gc`` and the
manager's retention decide on it, :meth:`CheckpointManager.steps` reports it, and the tiering
service cools it. Built by :mod:`.catalog`; the rules that protect it are in :mod:`.protection`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from ..commit.timeline import UNNAMED, Timeline

# The tier of a cooled checkpoint whose cold copies are not there (the cold disk unmounted): it
# is committed, but nothing can read, move or delete it until the cold tier is back.
COLD_UNREACHABLE = "cold-unreachable"


@dataclass(frozen=True)
class CheckpointInfo:
    """One checkpoint of a root (committed, or a directory a save is writing or left)."""

    step: int | None  # None when the metadata holds no usable step (see ``problem``)
    name: str
    url: str
    time: float  # when it was saved (the metadata's creation time, seconds since the epoch)
    size: int  # bytes of its storage files and metadata
    # "hot", "cold", "partial" or COLD_UNREACHABLE on local disk (cooled files are links); else the scheme
    tier: str
    abandoned: bool = False  # left behind by a rollback: not on the live timeline
    latest: bool = False  # named by its run's ``latest`` pointer
    metrics: dict[str, float] = field(default_factory=dict)
    timeline: Timeline = UNNAMED
    pinned: bool = False
    being_read: bool = False
    staging: bool = False  # a save to this path is under way (or crashed)
    committed: bool = True
    # committed by a newer release, whose format this one cannot read (``committed`` is False:
    # nothing here may act on it; ``problem`` says to upgrade)
    newer_format: bool = False
    problem: str | None = None  # why it cannot be classified safely: never moved or deleted
    run: str = "."  # the run directory, relative to the scanned root
    path: str = ""  # the path in its storage (on local disk: the absolute path)
    modified: float = 0.0  # last modification or commit, whichever is later (the age tiering uses)
    files: tuple[str, ...] = ()  # storage files, then the metadata file
    cold_files: int = 0  # files already in the cold tier (links into it, or an HDFS cold policy)
    # xxh3-128 of the metadata as scanned (b"": uncommitted): a deletion goes ahead only if the
    # checkpoint at the path is still this one, not one a new save put there since.
    identity: bytes = b""
    foreign: tuple[str, ...] = ()  # local disk: entries of its directory that are not its files
    # local disk: a cold path one of its links points to that is not there (COLD_UNREACHABLE);
    # ``problem`` says so too, which keeps gc and tiering off it
    unreachable: str | None = None

    @property
    def key(self) -> str:
        return os.path.normpath(os.path.join(self.run, self.name))

    @property
    def state(self) -> str:
        """``uncommitted``, ``newer-format``, ``cold-unreachable``, ``hot``, ``cold`` (every file)
        or ``partial``."""
        if self.newer_format:
            return "newer-format"
        if self.unreachable is not None:
            return COLD_UNREACHABLE
        if not self.committed:
            return "uncommitted"
        if self.cold_files == 0:
            return "hot"
        return "cold" if self.cold_files == len(self.files) else "partial"
