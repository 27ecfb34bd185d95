"""What is on the tiers: every checkpoint directory under the hot root, and its state.

A run is a directory holding checkpoints (the parent of ``step_N/``); runs may sit at any
depth below the hot root. Hidden entries (staging directories, leases, pins, tiering
scratch) are never checkpoints, and a directory that is a symlink is never followed. A
checkpoint file is *cold* when its hot path is a symlink whose resolved target (real paths,
not the link's text) lies inside the cold root; a checkpoint is cold when all its files are.

What cannot be classified safely is said so in ``problem`` (a step that is not a
non-negative integer, unreadable metadata, a ``latest`` pointer that cannot be read), and the
policies never move or delete such a checkpoint.
"""

from __future__ import annotations

import math
import os
import stat
from collections import defaultdict
from dataclasses import dataclass

from bytecheckpoint.commit.integrity import LATEST_FILE, STAGING_TAG, read_latest
from bytecheckpoint.commit.leases import is_being_read, is_pinned
from bytecheckpoint.errors import CheckpointError
from bytecheckpoint.format.metadata import METADATA_FILE, CheckpointMetadata
from bytecheckpoint.storage.local import LocalStorage

_STORAGE = LocalStorage(fsync=False)  # only for listing leases and pins


@dataclass(frozen=True)
class CheckpointInfo:
    run: str  # the run directory, relative to the hot root ("." for the root itself)
    name: str
    path: str  # absolute hot path
    committed: bool
    step: int | None
    modified: float  # last modification or commit, whichever is later
    files: tuple[str, ...]  # storage files, then the metadata file
    size: int
    cold_files: int  # files whose hot path already links into the cold root
    pinned: bool
    being_read: bool
    latest: bool  # named by the run's ``latest`` pointer
    staging: bool = False  # a save into this path is under way or crashed
    problem: str | None = None  # why it cannot be classified safely: never moved or deleted

    @property
    def key(self) -> str:
        return os.path.normpath(os.path.join(self.run, self.name))

    @property
    def state(self) -> str:
        if not self.committed:
            return "uncommitted"
        if self.cold_files == 0:
            return "hot"
        return "cold" if self.cold_files == len(self.files) else "partial"


def read_meta(path: str) -> CheckpointMetadata:
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


def latest_of(run_dir: str) -> tuple[str | None, str | None]:
    """The checkpoint name the run's ``latest`` pointer names, or the reason it cannot be read
    (then no checkpoint of the run may be deleted: the one it protects is unknown)."""
    if not os.path.lexists(os.path.join(run_dir, LATEST_FILE)):
        return None, None
    try:
        found = read_latest(_STORAGE, run_dir)
    except (CheckpointError, OSError, ValueError, TypeError) as exc:
        pointer = os.path.join(run_dir, LATEST_FILE)
        return None, (f"the run's {LATEST_FILE} pointer is unreadable ({str(exc)[:200]}): which "
                      f"checkpoint it protects is unknown; fix or remove {pointer}")
    return (found.name if found is not None else None), None


def _info(hot_root: str, cold_root: str | None, run_dir: str, name: str, latest: str | None,
          staging: set[str], latest_problem: str | None = None) -> CheckpointInfo:
    path = os.path.join(run_dir, name)
    run = os.path.relpath(run_dir, hot_root)
    common = dict(run=run, name=name, path=path, pinned=is_pinned(_STORAGE, path),
                  being_read=is_being_read(_STORAGE, path), latest=name == latest,
                  staging=name in staging)
    problem = latest_problem
    try:
        meta = read_meta(path) if os.path.exists(os.path.join(path, METADATA_FILE)) else None
    except (OSError, CheckpointError, ValueError, TypeError) as exc:
        meta = None  # unreadable metadata: treated as uncommitted, never moved
        problem = problem or f"unreadable metadata ({str(exc)[:200]})"
    if meta is None:
        try:
            mtimes = [os.lstat(os.path.join(path, n)).st_mtime for n in os.listdir(path)] or [0.0]
        except OSError:
            mtimes = [0.0]
        return CheckpointInfo(committed=False, step=None, modified=max(mtimes), files=(), size=0,
                              cold_files=0, problem=problem, **common)
    step, step_problem = check_step(meta.step)
    problem = problem or step_problem
    files = tuple(f.name for f in meta.files) + (METADATA_FILE,)
    # The metadata file is written last, so its mtime is the commit time.
    modified = 0.0
    cold = 0
    for n in files:
        full = os.path.join(path, n)
        try:
            modified = max(modified, os.stat(full).st_mtime)  # a cold copy keeps the hot mtime
        except FileNotFoundError:
            pass  # a missing file: the mover's verification refuses it
        cold += is_cold_link(full, cold_root)
    size = sum(f.size for f in meta.files) + os.stat(os.path.join(path, METADATA_FILE)).st_size
    return CheckpointInfo(committed=True, step=step, modified=modified, files=files, size=size,
                          cold_files=cold, problem=problem, **common)


def scan(hot_root: str, cold_root: str | None) -> list[CheckpointInfo]:
    """Every checkpoint directory under ``hot_root``: committed ones, and directories that
    look like checkpoints but hold no metadata (a save in progress or abandoned). Symlinked
    directories are neither listed nor entered: what they point to is not this tier's."""
    out: list[CheckpointInfo] = []
    for run_dir, dirs, _ in os.walk(hot_root):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".")
                         and not os.path.islink(os.path.join(run_dir, d)))
        staging = {d[1:].split(STAGING_TAG)[0] for d in os.listdir(run_dir)
                   if d.startswith(".") and STAGING_TAG in d}
        latest, latest_problem = latest_of(run_dir)
        here = [d for d in dirs if os.path.exists(os.path.join(run_dir, d, METADATA_FILE))
                or d in staging or _looks_like_checkpoint(os.path.join(run_dir, d))]
        for d in here:
            out.append(_info(hot_root, cold_root, run_dir, d, latest, staging, latest_problem))
        dirs[:] = [d for d in dirs if d not in here]  # never descend into a checkpoint
    return out


def describe(path: str, hot_root: str, cold_root: str | None) -> CheckpointInfo | None:
    """The catalog entry of the one checkpoint directory ``path``, read afresh (None when it
    is no directory, or a symlink to one)."""
    if os.path.islink(path) or not os.path.isdir(path):
        return None
    run_dir, name = os.path.split(path)
    staging = {d[1:].split(STAGING_TAG)[0] for d in os.listdir(run_dir)
               if d.startswith(".") and STAGING_TAG in d}
    latest, latest_problem = latest_of(run_dir)
    return _info(hot_root, cold_root, run_dir, name, latest, staging, latest_problem)


def untouchable_reason(c: CheckpointInfo) -> str | None:
    """Why ``c`` may be neither moved nor deleted, whatever a policy says; None if it may."""
    if c.problem is not None:
        return f"cannot be classified: {c.problem}"
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


def _looks_like_checkpoint(path: str) -> bool:
    try:
        return any(n.endswith(".safetensors") for n in os.listdir(path))
    except OSError:
        return False


def hot_bytes(hot_root: str) -> int:
    """Bytes the hot tier holds (links count as their own few bytes, not their target's)."""
    total = 0
    for run_dir, _, names in os.walk(hot_root):
        for n in names:
            st = os.lstat(os.path.join(run_dir, n))
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
