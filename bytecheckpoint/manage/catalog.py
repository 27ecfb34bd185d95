"""The catalog of a root: every checkpoint under it and its state, on any storage.

A run is a directory holding checkpoints (the parent of ``step_N/``); runs may sit at any
depth below the root (``nested``; the manager's root is one run). Hidden entries (staging
directories, leases, pins, tiering scratch) are never checkpoints, and on local disk a
directory that is a symlink is never followed. A checkpoint is a directory holding the
metadata file (committed), or one a save is writing or left (its staging directory exists,
or it holds storage files but no metadata).

Tiers, on local disk: a checkpoint file is *cold* when its path is a symlink. Given the cold
root, only a link whose resolved target (real paths, not the link's text) lies inside it
counts; without one, a link to a regular file outside the checkpoint directory counts (the
checkpoint was cooled: its bytes live elsewhere, whatever ``--cold`` says). A checkpoint is
cold when all its files are. On other storage its tier is the scheme (HDFS cooling sets it).

What cannot be classified safely is said so in ``problem`` (a step that is not a
non-negative integer, unreadable metadata, a ``latest`` pointer that cannot be read), and
nothing moves or deletes such a checkpoint (:mod:`.protection`).
"""

from __future__ import annotations

import logging
import math
import os
import posixpath
import stat
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import xxhash

from ..commit.integrity import dangling_target
from ..commit.leases import LEASED_SCHEMES, is_being_read, is_pinned
from ..commit.protocol import LATEST_FILE, read_latest
from ..commit.save_lock import STAGING_TAG, local_os_path, pointer_locked
from ..commit.timeline import abandoned_flags, metrics_of, timeline_of
from ..errors import CheckpointError, NewerFormatError
from ..format.metadata import METADATA_FILE, CheckpointMetadata
from ..format.metadata_file import read_metadata_bytes
from ..storage import Storage, open_storage, split_url
from ..storage.local import LocalStorage
from .protection import untouchable_reason
from .records import COLD_UNREACHABLE, CheckpointInfo

log = logging.getLogger(__name__)

LOCAL_DISK = LocalStorage(fsync=False)  # listing a local root: no retries or I/O events per stat

__all__ = ["CheckpointInfo", "Catalog", "cold_references", "cold_root_of", "cold_target", "describe",
           "hot_bytes", "inside", "is_cold_link", "open_root", "orphans", "read_meta",
           "RootListing", "scan", "untouchable_reason"]


def open_root(url: str) -> tuple[Storage, str]:
    """The storage and path of a root: a plain path or ``file://`` is listed directly (absolute
    path), anything else through the storage layer (retries, any backend)."""
    scheme, rest = split_url(url)
    if scheme == "file":
        return LOCAL_DISK, os.path.abspath(rest)
    return open_storage(url)


def latest_of(storage: Storage, run_dir: str, entries: list[str]) -> tuple[str | None, str | None]:
    """The checkpoint name the run's ``latest`` pointer names, or the reason it cannot be read
    (then no checkpoint of the run may be deleted: the one it protects is unknown)."""
    if LATEST_FILE not in entries:
        return None, None
    try:
        found = read_latest(storage, run_dir)
    except (CheckpointError, OSError, ValueError, TypeError) as exc:
        pointer = storage.url(posixpath.join(run_dir, LATEST_FILE))
        return None, (f"the run's {LATEST_FILE} pointer is unreadable ({str(exc)[:200]}): which "
                      f"checkpoint it protects is unknown; fix or remove {pointer}")
    return (found.name if found is not None else None), None


@dataclass(frozen=True)
class _Read:
    meta: CheckpointMetadata | None
    meta_size: int
    problem: str | None
    identity: bytes = b""  # xxh3-128 of the metadata bytes (``integrity.metadata_identity``)
    newer: bool = False  # committed, in a format newer than this release reads
    missing: str | None = None  # the metadata links to this cold path, which is not there


def _cooled_link(full: str, ckpt_dir: str, cold_root: str | None) -> bool:
    if cold_root is not None:
        return is_cold_link(full, cold_root)
    # No cold root given: a link to a file outside the checkpoint holds its bytes elsewhere.
    if not os.path.islink(full):
        return False
    target = os.path.realpath(full)
    return os.path.isfile(target) and not inside(target, os.path.realpath(ckpt_dir))


class Catalog:
    """Lists the checkpoints of a root; keeps what it read of each metadata file (a committed
    checkpoint never changes under its name except by an ``overwrite=True`` save, which the
    cache key notices by the metadata's size)."""

    def __init__(self, storage: Storage, root: str, cold_root: str | None = None) -> None:
        self.storage, self.root = storage, root
        self.cold_root = os.path.abspath(cold_root) if cold_root else None
        self._cache: dict[tuple[str, int], _Read] = {}

    def _local(self, path: str) -> str | None:
        return local_os_path(self.storage, path)

    def _read(self, path: str) -> _Read | None:
        """The metadata of the checkpoint at ``path``; None when it holds none."""
        meta_path = posixpath.join(path, METADATA_FILE)
        try:
            size = self.storage.size(meta_path)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            missing = dangling_target(self._local(meta_path))
            if missing is not None:  # cooled, and its cold tier is not mounted: still committed
                return _Read(None, 0, unreachable_problem(missing), missing=missing)
            return None
        except OSError as exc:  # e.g. a metadata path that is a directory on some backends
            return _Read(None, 0, f"unreadable metadata ({str(exc)[:200]})")
        # An overwrite often writes metadata of the same size: on local disk the file's inode
        # and mtime tell the new one from the old.
        key: tuple = (path, size, *_file_stamp(self._local(meta_path)))
        if key not in self._cache:
            try:
                raw = read_metadata_bytes(self.storage, meta_path, size)  # no second size request
                meta = CheckpointMetadata.from_bytes(raw, source=self.storage.url(meta_path))
                self._cache[key] = _Read(meta, size, None, xxhash.xxh3_128_digest(raw))
            except FileNotFoundError:
                return None
            except NewerFormatError as exc:  # committed (its metadata is there), not damaged
                self._cache[key] = _Read(None, size, f"newer format ({str(exc)[:200]})", newer=True)
            except (CheckpointError, OSError, ValueError, TypeError) as exc:
                self._cache[key] = _Read(None, size, f"unreadable metadata ({str(exc)[:200]})")
        return self._cache[key]

    def _is_checkpoint_dir(self, path: str, staging: set[str]) -> tuple[bool, list[str] | None]:
        """Whether ``path`` (holding no metadata) is a checkpoint a save is writing or left, and
        its entries when it is a directory to descend into."""
        if posixpath.basename(path) in staging:
            return True, None
        try:
            entries = self.storage.list_dir(path)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError, OSError):
            return False, None
        return any(n.endswith(".safetensors") for n in entries), entries

    def scan(self, *, nested: bool = True, details: bool = True) -> list[CheckpointInfo]:
        """Every checkpoint under the root, by run then name. ``nested`` descends into
        directories that are no checkpoint (runs at any depth); ``details`` adds pins, leases
        and tiers (a few more storage calls per checkpoint)."""
        out: list[CheckpointInfo] = []
        pending = [self.root]
        while pending:
            run_dir = pending.pop(0)
            try:
                entries = sorted(self.storage.list_dir(run_dir))
            except (FileNotFoundError, NotADirectoryError):
                continue
            found = self._scan_run(run_dir, entries, details)
            out += found
            if nested:
                names = {c.name for c in found}
                pending += [posixpath.join(run_dir, e) for e in entries
                            if e not in names and self._descend(posixpath.join(run_dir, e), e)]
        return out

    def one(self, run_dir: str, name: str, *, details: bool = True) -> CheckpointInfo | None:
        """The entry of checkpoint ``name`` in ``run_dir`` alone: one listing and its own
        metadata, not every checkpoint's (None when it is none). ``abandoned`` is not computed
        (that needs the whole run)."""
        try:
            entries = self.storage.list_dir(run_dir)
        except (FileNotFoundError, NotADirectoryError):
            return None
        staging = _staging_names(entries)
        is_checkpoint, read = self._candidate(run_dir, name, staging) if name in entries else (False, None)
        if not is_checkpoint:
            return None
        latest, latest_problem = latest_of(self.storage, run_dir, entries)
        run = posixpath.relpath(run_dir, self.root) if run_dir != self.root else "."
        return self._info(run, run_dir, name, read, latest, latest_problem, staging, details).info

    def _descend(self, path: str, name: str) -> bool:
        if name.startswith(".") or name == LATEST_FILE:
            return False
        local = self._local(path)
        if local is not None:
            return os.path.isdir(local) and not os.path.islink(local)
        return True  # listing a file on an object store yields nothing

    def _candidate(self, run_dir: str, name: str, staging: set[str]) -> tuple[bool, _Read | None]:
        """Whether entry ``name`` of ``run_dir`` is a checkpoint (committed or not), and its
        metadata read."""
        if name.startswith(".") or name == LATEST_FILE:
            return False, None
        path = posixpath.join(run_dir, name)
        local = self._local(path)
        if local is not None and (os.path.islink(local) or not os.path.isdir(local)):
            return False, None  # a symlinked directory is not this tier's; a file is no checkpoint
        read = self._read(path)
        return read is not None or self._is_checkpoint_dir(path, staging)[0], read

    def _scan_run(self, run_dir: str, entries: list[str], details: bool) -> list[CheckpointInfo]:
        staging = _staging_names(entries)
        latest, latest_problem = latest_of(self.storage, run_dir, entries)
        found: list[tuple[str, _Read | None]] = []
        for name in entries:
            is_checkpoint, read = self._candidate(run_dir, name, staging)
            if is_checkpoint:
                found.append((name, read))
        run = posixpath.relpath(run_dir, self.root) if run_dir != self.root else "."
        infos = [self._info(run, run_dir, name, read, latest, latest_problem, staging, details)
                 for name, read in found]
        flags = abandoned_flags([(run, c.meta_doc, c.info.step, c.info.latest, c.info.time) for c in infos])
        return [_replace_abandoned(c.info, a) for c, a in zip(infos, flags)]

    def _info(self, run: str, run_dir: str, name: str, read: _Read | None, latest: str | None,
              latest_problem: str | None, staging: set[str], details: bool) -> _Built:
        path = posixpath.join(run_dir, name)
        local = self._local(path)
        leased = details and self.storage.scheme in LEASED_SCHEMES
        common: dict[str, Any] = dict(
            run=run, name=name, path=path, url=self.storage.url(path),
            latest=name == latest, staging=name in staging,
            pinned=details and is_pinned(self.storage, path),
            being_read=leased and is_being_read(self.storage, path))
        problem = latest_problem or (read.problem if read is not None else None)
        if read is not None and read.missing is not None:
            return _Built(CheckpointInfo(step=None, time=0.0, size=0, tier=COLD_UNREACHABLE, problem=problem,
                                         modified=_mtime_of_entries(local), unreachable=read.missing,
                                         **common), None)
        if read is None or read.meta is None:
            # A newer format's checkpoint counts as uncommitted here (nothing this release can
            # classify) but says what it is; its ``problem`` keeps gc and tiering off it.
            newer = read is not None and read.newer
            return _Built(CheckpointInfo(step=None, time=0.0, size=read.meta_size if read else 0,
                                         tier="newer-format" if newer else "uncommitted",
                                         committed=False, newer_format=newer, problem=problem,
                                         modified=_mtime_of_entries(local), **common), None)
        meta = read.meta
        step, step_problem = check_step(meta.step)
        when, time_problem = check_time(meta.created_at)
        files = tuple(f.name for f in meta.files) + (METADATA_FILE,)
        modified, cold, missing = when, 0, None
        if local is not None:
            modified = 0.0  # the metadata file is written last, so its mtime is the commit time
            for n in files:
                full = os.path.join(local, n)
                try:
                    modified = max(modified, os.stat(full).st_mtime)  # a cold copy keeps the hot mtime
                except FileNotFoundError:
                    # A missing file: verification refuses it. A link to nothing: the cold tier
                    # of a partly cooled checkpoint is not mounted.
                    missing = missing or dangling_target(full)
                cold += _cooled_link(full, local, self.cold_root)
        tier = "hot" if cold == 0 else ("cold" if cold == len(files) else "partial")
        if missing is not None:
            tier, problem = COLD_UNREACHABLE, problem or unreachable_problem(missing)
        foreign = _foreign_entries(local, files) if local is not None else ()
        user = dict(meta.user_metadata) if isinstance(meta.user_metadata, Mapping) else {}
        info = CheckpointInfo(
            step=step, time=when, size=sum(f.size for f in meta.files) + read.meta_size,
            tier=tier if local is not None else self.storage.scheme, metrics=metrics_of(user),
            timeline=timeline_of(user), committed=True, problem=problem or step_problem or time_problem,
            modified=modified, files=files, cold_files=cold, identity=read.identity, foreign=foreign,
            unreachable=missing, **common)
        return _Built(info, user if info.problem is None else None)


@dataclass(frozen=True)
class _Built:
    info: CheckpointInfo
    meta_doc: dict | None  # user metadata, for the timeline; None when it cannot be trusted


def unreachable_problem(missing: str) -> str:
    """Why a cooled checkpoint whose cold copy ``missing`` is not there cannot be classified (it
    is committed, its bytes are in a cold tier that is not mounted now)."""
    return (f"cold tier unreachable: {missing} is not there (is the cold disk mounted?). The checkpoint "
            "is committed; mount the cold tier again where its links point")


def _replace_abandoned(c: CheckpointInfo, abandoned: bool) -> CheckpointInfo:
    return replace(c, abandoned=abandoned) if abandoned else c


def _staging_names(entries: list[str]) -> set[str]:
    """The checkpoints of a run directory a save is writing (their staging directories)."""
    return {e[1:].split(STAGING_TAG)[0] for e in entries if e.startswith(".") and STAGING_TAG in e}


def _file_stamp(local: str | None) -> tuple[int, int]:
    if local is None:
        return (0, 0)
    try:
        st = os.stat(local)
    except OSError:
        return (0, 0)
    return (st.st_ino, st.st_mtime_ns)


def _foreign_entries(local: str, files: tuple[str, ...]) -> tuple[str, ...]:
    """Entries of a checkpoint directory that are not the checkpoint's files (a user's notes,
    an evaluation's output): nothing of ours deletes them."""
    try:
        return tuple(sorted(set(os.listdir(local)) - set(files)))
    except OSError:
        return ()


def _mtime_of_entries(local: str | None) -> float:
    if local is None:
        return 0.0
    try:
        return max([os.lstat(os.path.join(local, n)).st_mtime for n in os.listdir(local)] or [0.0])
    except OSError:
        return 0.0


def scan(hot_root: str, cold_root: str | None = None, *, nested: bool = True) -> list[CheckpointInfo]:
    """Every checkpoint under the root ``hot_root`` (a local path or any storage URL)."""
    storage, root = open_root(hot_root)
    return Catalog(storage, root, cold_root).scan(nested=nested)


def describe(path: str, hot_root: str, cold_root: str | None) -> CheckpointInfo | None:
    """The catalog entry of the one local checkpoint directory ``path``, read afresh (None when
    it is no directory, a symlink to one, or no checkpoint). Its ``abandoned`` flag is not
    computed (that needs the whole run; nothing moves or deletes by it alone)."""
    if os.path.islink(path) or not os.path.isdir(path):
        return None
    run_dir, name = os.path.split(os.path.abspath(path))
    hot_root = os.path.abspath(hot_root)
    catalog = Catalog(LOCAL_DISK, hot_root, cold_root)
    entries = os.listdir(run_dir)
    staging = _staging_names(entries)
    read = catalog._read(path)
    if read is None and not catalog._is_checkpoint_dir(path, staging)[0]:
        return None
    latest, latest_problem = latest_of(LOCAL_DISK, run_dir, entries)
    run = os.path.relpath(run_dir, hot_root) if run_dir != hot_root else "."
    return catalog._info(run, run_dir, name, read, latest, latest_problem, staging, True).info


def overtaking(found: list[CheckpointInfo], name: str, pointer_step: int | None) -> CheckpointInfo | None:
    """The committed checkpoint of ``found`` (one run) a resume takes instead of ``name``, the
    one ``latest`` names, or None to take that one. Where saves of a root are not serialised
    (``save_lock.pointer_locked``), two saves committing at once can leave ``latest`` on the
    lower step. Nothing moves it back on purpose on one timeline (a rollback starts a new one),
    so a checkpoint of a higher step that the named one's timeline holds is the newer one."""
    head = next((c for c in found if c.name == name), None)
    if (head is None or not head.committed or head.problem is not None or head.step is None
            or pointer_step is None):
        return None  # a pointer without a step moves on every save: no step says "newer"
    newer = [c for c in found if c.committed and c.problem is None and c.step is not None
             and c.step > head.step and head.timeline.holds(c.timeline, c.step)]
    return max(newer, key=lambda c: (c.step, c.time)) if newer else None


def newer_than_latest(url: str) -> str | None:
    """The checkpoint a load of the root ``url`` takes instead of the one its ``latest`` names,
    when two saves racing on a root without a pointer lock left ``latest`` on the lower step
    (:func:`overtaking`): a resume never goes back a step. None to load ``url`` as it is (a
    checkpoint, a root on local disk, a pointer with no step, nothing newer)."""
    try:
        storage, root = open_storage(url)
        if pointer_locked(storage, root) or storage.exists(posixpath.join(root, METADATA_FILE)):
            return None
        latest = read_latest(storage, root)
        if latest is None or latest.step is None:
            return None
        newer = overtaking(RootListing(storage, root).list(details=False), latest.name, latest.step)
    except (CheckpointError, OSError):  # the load itself meets it and reports it, by name
        return None
    if newer is None:
        return None
    log.warning("%s names %s (step %s), but %s (step %s) of its timeline is committed too: two saves "
                "committed at once and the older one moved 'latest' last; loading %s (the next save "
                "moves 'latest' on)", storage.url(posixpath.join(root, LATEST_FILE)), latest.name,
                latest.step, newer.name, newer.step, newer.name)
    return storage.url(newer.path)


class RootListing:
    """The committed checkpoints of one root (one run), as the manager reports and retains
    them: oldest step first."""

    def __init__(self, storage: Storage, root: str) -> None:
        self.catalog = Catalog(storage, root)

    def list(self, *, details: bool = True) -> list[CheckpointInfo]:
        found = [c for c in self.catalog.scan(nested=False, details=details) if c.committed]
        found.sort(key=lambda c: (c.step if c.step is not None else -1, c.time))
        return found

    def find(self, name: str, *, details: bool = True) -> CheckpointInfo | None:
        """The committed checkpoint ``name`` of this root, reading its metadata alone."""
        found = self.catalog.one(self.catalog.root, name, details=details)
        return found if found is not None and found.committed else None


def read_meta(path: str) -> CheckpointMetadata:
    """The metadata of the local checkpoint at ``path``."""
    with open(os.path.join(path, METADATA_FILE), "rb") as f:
        return CheckpointMetadata.from_bytes(f.read(), source=os.path.join(path, METADATA_FILE))


def inside(path: str, root: str) -> bool:
    """``path`` lies strictly inside ``root`` (both absolute, already resolved)."""
    return path != root and os.path.commonpath([path, root]) == root


def cold_target(hot_file: str, cold_root: str | None) -> str | None:
    """The real path of the cold copy ``hot_file`` links to, when it is a symlink whose target,
    fully resolved, lies inside the cold root; None otherwise (a link elsewhere is no cold
    copy, whatever its text says: ``COLD/../victim`` resolves outside)."""
    if cold_root is None or not os.path.islink(hot_file):
        return None
    target = os.path.realpath(hot_file)
    return target if inside(target, os.path.realpath(cold_root)) else None


def is_cold_link(hot_file: str, cold_root: str | None) -> bool:
    return cold_target(hot_file, cold_root) is not None


def cold_references(hot_root: str, cold_root: str | None, *,
                    exclude: str | None = None) -> dict[str, list[str]]:
    """Every cold file some symlink under ``hot_root`` resolves to (real path -> the links),
    hidden directories included, ``exclude`` (a directory) left out. A file with a reference
    here is still in use: a checkpoint copied with ``cp -a`` shares its original's cold files."""
    refs: dict[str, list[str]] = defaultdict(list)
    if cold_root is None:
        return refs
    skip = os.path.realpath(exclude) if exclude else None
    for d, dirs, names in os.walk(hot_root):
        if skip is not None:
            dirs[:] = [x for x in dirs if os.path.realpath(os.path.join(d, x)) != skip]
        for n in names + [x for x in dirs if os.path.islink(os.path.join(d, x))]:
            full = os.path.join(d, n)
            target = cold_target(full, cold_root)
            if target is not None:
                refs[target].append(full)
    return refs


def check_step(step: object) -> tuple[int | None, str | None]:
    """A step usable for ordering, or None with the reason it is not (older saves accepted
    ``step="init"``; a hostile metadata may hold anything)."""
    if step is None:
        return None, None
    if isinstance(step, int) and not isinstance(step, bool) and step >= 0:
        return step, None
    return None, f"step {str(step)[:40]!r} is not a non-negative integer: it cannot be ordered"


def check_time(value: object) -> tuple[float, str | None]:
    """A finite timestamp, or 0 with the reason."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value), None
    return 0.0, f"time {str(value)[:40]!r} is not a finite number: its age is unknown"


def cold_root_of(path: str) -> str | None:
    """Where the cold tier of the cooled checkpoint at ``path`` seems to be, read from its links
    alone (the cold tier mirrors the hot one, so a cold copy's path ends as its link's does:
    their common tail, at least checkpoint and file name, is cut off the target). For messages
    only: nothing is deleted on this guess."""
    try:
        names = sorted(os.listdir(path))
    except OSError:
        return None
    for n in names:
        link = os.path.join(path, n)
        if not os.path.islink(link):
            continue
        a, b = os.path.abspath(link).split(os.sep), os.path.realpath(link).split(os.sep)
        k = 0
        while k < min(len(a), len(b)) - 1 and a[-1 - k] == b[-1 - k]:
            k += 1
        if k >= 2:
            return os.sep.join(b[:-k]) or os.sep
    return None


def hot_bytes(hot_root: str) -> int:
    """Bytes the hot tier holds (links count as their own few bytes, not their target's)."""
    total = 0
    for run_dir, _, names in os.walk(hot_root):
        for n in names:
            try:
                st = os.lstat(os.path.join(run_dir, n))
            except FileNotFoundError:
                continue  # a save renamed its staging directory meanwhile
            if not stat.S_ISLNK(st.st_mode):
                total += st.st_size
    return total


def orphans(hot_root: str, cold_root: str, ignore: frozenset[str]) -> list[str]:
    """Cold files that no hot path links to: left when a cooled checkpoint was removed by other
    means (``rm -r``, a save with ``overwrite=True`` over it). Reported, never deleted: a link
    outside the hot root may still point at them."""
    targets = cold_references(hot_root, cold_root)
    out = []
    for d, _, names in os.walk(cold_root):
        for n in names:
            full = os.path.join(d, n)
            if os.path.realpath(full) not in targets and not (d == cold_root and n in ignore):
                out.append(full)
    return sorted(out)
