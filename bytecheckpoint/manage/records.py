"""The committed checkpoints of one root, as the manager reports and retains them.

Read straight from storage on any backend: every entry of the root holding a metadata file is a
committed checkpoint; its step, time, size, metrics and timeline come from the metadata (read
once per checkpoint and cached, a committed checkpoint never changes under its name except by
an ``overwrite=True`` save, which the cache key notices by the metadata's size).
"""

from __future__ import annotations

import os
import posixpath
from dataclasses import dataclass, field

from ..commit.leases import LEASED_SCHEMES, is_being_read, is_pinned
from ..commit.protocol import LATEST_FILE, read_latest
from ..commit.save_lock import STAGING_TAG, local_os_path
from ..commit.timeline import UNNAMED, Timeline, metrics_of, timeline_of
from ..errors import CheckpointError
from ..format.metadata import METADATA_FILE, CheckpointMetadata
from ..storage import Storage


@dataclass(frozen=True)
class CheckpointInfo:
    """One committed checkpoint of a root, as :meth:`CheckpointManager.steps` reports it."""

    step: int | None
    name: str
    url: str
    time: float  # when it was saved (seconds since the epoch)
    size: int  # bytes of its storage files and metadata
    tier: str  # "hot", "cold" or "partial" on local disk (cooled files are links); else the scheme
    abandoned: bool  # left behind by a rollback: not on the live timeline
    latest: bool  # named by the root's ``latest`` pointer
    metrics: dict[str, float] = field(default_factory=dict)
    timeline: Timeline = UNNAMED
    pinned: bool = False
    being_read: bool = False
    staging: bool = False  # a save to this path is under way
    committed: bool = True
    problem: str | None = None


@dataclass(frozen=True)
class _Read:
    step: int | None
    time: float
    size: int
    user_metadata: dict
    problem: str | None


class RootListing:
    """Lists a root's checkpoints; keeps what it read of each metadata file."""

    def __init__(self, storage: Storage, root: str) -> None:
        self.storage, self.root = storage, root
        self._cache: dict[tuple[str, int], _Read] = {}

    def _read(self, name: str) -> _Read | None:
        meta_path = posixpath.join(self.root, name, METADATA_FILE)
        try:
            size = self.storage.size(meta_path)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return None
        key = (name, size)
        if key not in self._cache:
            try:
                meta = CheckpointMetadata.from_bytes(bytes(self.storage.read(meta_path)),
                                                     source=self.storage.url(meta_path))
                step = meta.step if isinstance(meta.step, int) else None
                self._cache[key] = _Read(step, meta.created_at, meta.total_bytes + size,
                                         dict(meta.user_metadata), None)
            except FileNotFoundError:
                return None
            except (CheckpointError, OSError, ValueError) as exc:
                self._cache[key] = _Read(None, 0.0, size, {}, f"unreadable metadata ({str(exc)[:200]})")
        return self._cache[key]

    def _tier(self, name: str) -> str:
        local = local_os_path(self.storage, posixpath.join(self.root, name))
        if local is None:
            return self.storage.scheme
        try:
            files = [e for e in os.scandir(local)]
        except OSError:
            return "hot"
        links = sum(e.is_symlink() for e in files)
        return "hot" if links == 0 else ("cold" if links == len(files) else "partial")

    def list(self, *, details: bool = True) -> list[CheckpointInfo]:
        """Every committed checkpoint of the root, oldest step first; ``details`` adds the pin,
        lease and tier of each (a few more storage calls per checkpoint)."""
        try:
            entries = self.storage.list_dir(self.root)
        except (FileNotFoundError, NotADirectoryError):
            return []
        staging = {e[1:].split(STAGING_TAG)[0] for e in entries if e.startswith(".") and STAGING_TAG in e}
        try:
            pointer = read_latest(self.storage, self.root) if LATEST_FILE in entries else None
        except CheckpointError:
            pointer = None
        found = []
        for name in sorted(entries):
            if name.startswith(".") or name == LATEST_FILE:
                continue
            read = self._read(name)
            if read is not None:
                found.append((name, read))
        latest_name = pointer.name if pointer is not None else None
        live = self._live_timeline(found, latest_name)
        leased = details and self.storage.scheme in LEASED_SCHEMES
        out = []
        for name, r in found:
            tl = timeline_of(r.user_metadata)
            path = posixpath.join(self.root, name)
            out.append(CheckpointInfo(
                step=r.step, name=name, url=self.storage.url(path), time=r.time, size=r.size,
                tier=self._tier(name) if details else "", abandoned=not live.holds(tl, r.step),
                latest=name == latest_name, metrics=metrics_of(r.user_metadata), timeline=tl,
                pinned=details and is_pinned(self.storage, path),
                being_read=leased and is_being_read(self.storage, path),
                staging=name in staging, problem=r.problem))
        out.sort(key=lambda c: (c.step if c.step is not None else -1, c.time))
        return out

    @staticmethod
    def _live_timeline(found: list[tuple[str, _Read]], latest_name: str | None) -> Timeline:
        """The timeline of the checkpoint ``latest`` names; without a usable pointer, that of
        the newest save."""
        by_name = dict(found)
        if latest_name in by_name:
            return timeline_of(by_name[latest_name].user_metadata)
        if not found:
            return UNNAMED
        newest = max(found, key=lambda f: f[1].time)
        return timeline_of(newest[1].user_metadata)
