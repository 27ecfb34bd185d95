"""What is on the tiers: every checkpoint directory under the hot root, and its state.

A run is a directory holding checkpoints (the parent of ``step_N/``); runs may sit at any
depth below the hot root. Hidden entries (staging directories, leases, pins, tiering
scratch) are never checkpoints. A checkpoint file is *cold* when its hot path is a link
into the cold root; a checkpoint is cold when all its files are.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass

from bytecheckpoint.errors import CheckpointError
from bytecheckpoint.integrity import LATEST_FILE, STAGING_TAG
from bytecheckpoint.leases import is_being_read, is_pinned
from bytecheckpoint.metadata import METADATA_FILE, CheckpointMetadata
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


def is_cold_link(hot_file: str, cold_root: str) -> bool:
    return os.path.islink(hot_file) and os.readlink(hot_file).startswith(cold_root + os.sep)


def _latest_name(run_dir: str) -> str | None:
    try:
        with open(os.path.join(run_dir, LATEST_FILE)) as f:
            return str(json.load(f)["checkpoint"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _info(hot_root: str, cold_root: str, run_dir: str, name: str, latest: str | None,
          staging: set[str]) -> CheckpointInfo:
    path = os.path.join(run_dir, name)
    run = os.path.relpath(run_dir, hot_root)
    common = dict(run=run, name=name, path=path, pinned=is_pinned(_STORAGE, path),
                  being_read=is_being_read(_STORAGE, path), latest=name == latest,
                  staging=name in staging)
    try:
        meta = read_meta(path) if os.path.exists(os.path.join(path, METADATA_FILE)) else None
    except (OSError, CheckpointError):
        meta = None  # unreadable metadata: treated as uncommitted, never moved
    if meta is None:
        mtimes = [os.lstat(os.path.join(path, n)).st_mtime for n in os.listdir(path)] or [0.0]
        return CheckpointInfo(committed=False, step=None, modified=max(mtimes), files=(), size=0,
                              cold_files=0, **common)
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
    return CheckpointInfo(committed=True, step=meta.step, modified=modified, files=files, size=size,
                          cold_files=cold, **common)


def scan(hot_root: str, cold_root: str) -> list[CheckpointInfo]:
    """Every checkpoint directory under ``hot_root``: committed ones, and directories that
    look like checkpoints but hold no metadata (a save in progress or abandoned)."""
    out: list[CheckpointInfo] = []
    for run_dir, dirs, names in os.walk(hot_root):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        staging = {d[1:].split(STAGING_TAG)[0] for d in os.listdir(run_dir)
                   if d.startswith(".") and STAGING_TAG in d}
        latest = _latest_name(run_dir) if LATEST_FILE in names else None
        here = [d for d in dirs if os.path.exists(os.path.join(run_dir, d, METADATA_FILE))
                or d in staging or _looks_like_checkpoint(os.path.join(run_dir, d))]
        for d in here:
            out.append(_info(hot_root, cold_root, run_dir, d, latest, staging))
        dirs[:] = [d for d in dirs if d not in here]  # never descend into a checkpoint
    return out


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
    targets = set()
    for run_dir, _, names in os.walk(hot_root):
        for n in names:
            full = os.path.join(run_dir, n)
            if is_cold_link(full, cold_root):
                targets.add(os.readlink(full))
    out = []
    for d, _, names in os.walk(cold_root):
        for n in names:
            full = os.path.join(d, n)
            if full not in targets and not (d == cold_root and n in ignore):
                out.append(full)
    return sorted(out)
