"""The commit protocol: where a save writes, what it may replace, how it becomes visible.

A checkpoint directory is committed when its metadata file exists under the final path.
On storage with atomic rename (``CommitMode.RENAME``), ranks write into a hidden staging
directory next to the final one (``.<name>.staging-<id>``); the coordinator writes the metadata
last and renames the directory into place. With ``overwrite=True`` the two directories are
exchanged in one step where the file system can (``renameat2(RENAME_EXCHANGE)``: local disks,
tmpfs), so the path always names the old checkpoint or the new one; elsewhere the old one is
first renamed aside (``.<name>.replaced-<id>``) and deleted only once the new one is in place,
and if the process dies between the two renames, the next save to the path or the next load
puts the old one back. So a crash at any moment leaves the old checkpoint or the new one.

On object stores (``CommitMode.MARKER``: no rename, but a PUT of one object is atomic) ranks
write straight into the final prefix and the metadata object, written last, is the commit. The
save's owner record ``.<name>.staging-<id>.owner`` next to it says a save is under way, so a
crashed save is reported as "never committed" and its files are cleaned up by the next save to
the same path. An ``overwrite=True`` save there names its data files with its save id
(``model-00003.<id>.safetensors``, see :func:`data_file_tag`), so they never collide with the
files of the checkpoint it replaces: the old metadata object stays the commit until the new one
is PUT over it (one atomic PUT), and only then are the files the new metadata does not name
deleted. A crash before the PUT leaves the old checkpoint loadable and the new files as garbage,
which the next overwrite of the path deletes (files of our naming that the committed metadata
does not name and no live save owns). Other saves keep the plain names.

Every save holds the path's save lock (:mod:`.save_lock`) from :func:`begin_save` to the end of
its commit or clean-up, so it never deletes or replaces another live save's files, and
``overwrite=True`` replaces only a committed checkpoint of this format with nothing else in it:
never a file, a root of checkpoints, or a directory holding anything else.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import posixpath
import re
import stat
import time
import uuid
from dataclasses import dataclass

import msgpack
import xxhash

from ..errors import (
    CheckpointError,
    CheckpointExistsError,
    ColdTierUnavailableError,
    CorruptCheckpointError,
    NotACheckpointError,
    UnsafeCheckpointError,
)
from ..format.metadata import (
    FORMAT_NAME,
    FORMAT_VERSION,
    MAGIC,
    METADATA_FILE,
    CheckpointMetadata,
    check_file_name,
)
from ..storage import CommitMode, Storage
from . import save_lock
from .leases import LEASED_SCHEMES, is_being_read
from .save_lock import STAGING_TAG, SaveLock, local_os_path

LATEST_FILE = "latest"
REPLACED_TAG = ".replaced-"
MAX_LATEST_BYTES = 64 << 10  # a pointer is a few dozen bytes; anything large is not ours
MAX_METADATA_CHECK_BYTES = 2 << 30
GRACE_ENV = "BCP_SAVE_STAGING_GRACE_S"
DEFAULT_GRACE_S = 60.0
WAIT_READERS_ENV = "BCP_OVERWRITE_WAIT_S"
DEFAULT_WAIT_READERS_S = 5.0
# The names of the data files a save writes (the leftovers of a crashed save on an object store),
# with the save's tag where it has one.
_DATA_FILE = re.compile(r"^[a-z]+-h?\d{5}(?:\.(?P<tag>[0-9A-Za-z]{1,32}))?\.safetensors$")
_TAG = re.compile(r"^[0-9A-Za-z]{1,32}$")

log = logging.getLogger(__name__)


def _seconds(name: str, default: float) -> float:
    try:
        value = float(os.environ.get(name, default))
    except ValueError:
        return default
    return value if value >= 0 and math.isfinite(value) else default


def check_save_settings() -> None:
    """The commit settings a save reads, checked as it starts (``save_lock.setting_seconds``):
    a bad value is named, not replaced by the default where it is read."""
    save_lock.check_settings()
    save_lock.setting_seconds(GRACE_ENV, DEFAULT_GRACE_S, zero_ok=True)
    save_lock.setting_seconds(WAIT_READERS_ENV, DEFAULT_WAIT_READERS_S, zero_ok=True)


def _tag_of(save_id: str) -> str:
    return save_id if _TAG.match(save_id) else xxhash.xxh3_64_hexdigest(save_id.encode())


def data_file_tag(storage: Storage, overwrite: bool, save_id: str) -> str:
    """The tag a save puts in its data files' names: its save id for an overwrite on an object
    store (its files must not replace the old checkpoint's before its metadata does), else ""
    (the names earlier releases wrote). Every rank works it out alike from its assignment."""
    if not overwrite or storage.commit_mode is not CommitMode.MARKER:
        return ""
    return _tag_of(save_id)


def data_file_name(kind: str, writer: str, tag: str = "") -> str:
    """``<kind>-<writer>[.<tag>].safetensors``: ``writer`` is ``00003`` (rank 3) or ``h00003``
    (host 3); a plain file name inside the checkpoint, as the metadata requires."""
    return f"{kind}-{writer}.{tag}.safetensors" if tag else f"{kind}-{writer}.safetensors"


def split_checkpoint_path(path: str, *, saving: bool = False) -> tuple[str, str]:
    path = path.rstrip("/")
    parent, name = posixpath.split(path)
    if not name or name.startswith("."):
        raise NotACheckpointError(
            f"{path!r} cannot be a checkpoint path: give a directory name such as "
            "'checkpoints/step_100' (names starting with '.' are reserved)"
        )
    tag = next((t for t in (STAGING_TAG, REPLACED_TAG) if t in name), None)
    if saving and tag is not None:
        # ".a.staging-b.lock" would read as a staging entry of "a": a save to "a" would delete
        # this save's lock, staging or the checkpoint it moved aside.
        raise NotACheckpointError(
            f"{path!r} cannot be saved to: {tag!r} in a name marks what saves leave beside a "
            f"checkpoint, and a save to {name.split(tag)[0]!r} would take it for its own; choose "
            "a name without it")
    return parent, name


def staging_path(path: str, save_id: str) -> str:
    parent, name = split_checkpoint_path(path)
    return posixpath.join(parent, f".{name}{STAGING_TAG}{save_id}")


def stale_staging_dirs(storage: Storage, path: str) -> list[str]:
    """Every staging entry of saves to ``path`` (directories, markers, owner records), live or not."""
    parent, name = split_checkpoint_path(path)
    prefix = f".{name}{STAGING_TAG}"
    return [posixpath.join(parent, n) for n in storage.list_dir(parent) if n.startswith(prefix)]


def _replaced_dirs(storage: Storage, path: str) -> list[str]:
    parent, name = split_checkpoint_path(path)
    prefix = f".{name}{REPLACED_TAG}"
    return [posixpath.join(parent, n) for n in storage.list_dir(parent) if n.startswith(prefix)]


# -- what is at the target ---------------------------------------------------------------------


def exists(storage: Storage, path: str) -> bool:
    """``storage.exists``, where a file standing in for a parent directory means "no"."""
    try:
        return storage.exists(path)
    except NotADirectoryError:
        return False


def _is_link(storage: Storage, path: str) -> bool:
    local = local_os_path(storage, path)
    return local is not None and os.path.islink(local.rstrip(os.sep))


def checkpoint_files(storage: Storage, path: str) -> set[str] | None:
    """The entries a committed checkpoint of this format at ``path`` consists of (its storage
    files and its metadata), or None where ``path`` has no metadata file."""
    meta_path = posixpath.join(path, METADATA_FILE)
    url = storage.url(path)
    try:
        size = storage.size(meta_path)
        if size > MAX_METADATA_CHECK_BYTES:
            raise NotACheckpointError(f"{url}: {METADATA_FILE} is {size} bytes, too large to be ours")
        raw = bytes(storage.read(meta_path))
    except (FileNotFoundError, NotADirectoryError):
        return None
    except IsADirectoryError:
        raise NotACheckpointError(f"{url}: {METADATA_FILE} is a directory, not a checkpoint") from None
    try:
        names = {f.name for f in CheckpointMetadata.from_bytes(raw, source=url).files}
    except CorruptCheckpointError:
        names = _loose_file_names(raw, url)  # damaged, but ours: it may still be replaced
        if names is None:
            raise NotACheckpointError(
                f"{url}: {METADATA_FILE} is not bytecheckpoint metadata, so this is not a "
                "checkpoint of ours; it is left as it is. Remove it yourself or choose another path"
            ) from None
    return names | {METADATA_FILE}


def _newer(url: str, what: str) -> NotACheckpointError:
    return NotACheckpointError(
        f"{url} holds a checkpoint of {what}, newer than this library reads (format version "
        f"{FORMAT_VERSION}); it is left as it is. Upgrade bytecheckpoint to replace it, or remove "
        "it yourself")


def _loose_file_names(raw: bytes, url: str) -> set[str] | None:
    # Formats 2 on put the document behind MAGIC and a digest: a damaged one is read past them
    # (reading from byte 0 decoded the magic's first byte as a number: "not ours").
    if raw[: len(MAGIC) - 1] == MAGIC[:-1] and not raw.startswith(MAGIC):
        raise _newer(url, "a later metadata header")
    body = raw[len(MAGIC) + 16:] if raw.startswith(MAGIC) else raw
    try:  # the first object only: whatever follows it (a trailer, damage) does not matter here
        unpacker = msgpack.Unpacker(raw=False, strict_map_key=True, max_buffer_size=len(body) + 1)
        unpacker.feed(body)
        doc = next(unpacker)
    except Exception:  # any decoding failure: not ours
        return None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
        return None
    version = doc.get("version")
    if type(version) is int and version > FORMAT_VERSION:  # which files it holds is not ours to guess
        raise _newer(url, f"format version {version}")
    names = set()
    for entry in doc.get("files") or []:
        with contextlib.suppress(TypeError, IndexError, UnsafeCheckpointError):
            names.add(check_file_name(entry[0], "metadata"))
    return names


def check_target(storage: Storage, path: str, overwrite: bool) -> bool:
    """Whether a committed checkpoint is at ``path`` (to be replaced: ``overwrite`` is set).

    Raises :class:`CheckpointExistsError` for a checkpoint without ``overwrite``,
    :class:`ColdTierUnavailableError` for a cooled checkpoint whose cold tier is not mounted
    (with or without ``overwrite``: what it holds cannot be checked) and
    :class:`NotACheckpointError` for anything else there: a file, a broken link, a root of
    checkpoints, a directory holding anything but one checkpoint. Nothing is changed."""
    url = storage.url(path)
    local = local_os_path(storage, path)
    if local is not None and os.path.islink(local.rstrip(os.sep)) and not os.path.exists(local):
        raise NotACheckpointError(f"{url} is a broken symbolic link; remove it or choose another path")
    _check_cold_tier(storage, path)
    names = checkpoint_files(storage, path)
    if names is not None:
        if not overwrite:
            raise CheckpointExistsError(
                f"{url} already holds a checkpoint; choose a new path or pass overwrite=True")
        extra = sorted(set(storage.list_dir(path)) - names)
        if extra:
            raise NotACheckpointError(
                f"{url} holds a checkpoint and also {_listing(extra)}, which are not part of it; "
                "overwrite=True replaces only a checkpoint with nothing else in it. Move those "
                "out, or choose another path"
            )
        return True
    try:
        storage.size(path)
        is_file = True
    except (FileNotFoundError, IsADirectoryError):
        is_file = False
    if is_file:
        raise NotACheckpointError(
            f"{url} is a file, not a checkpoint; it is left as it is. Choose another path")
    entries = storage.list_dir(path)
    if not entries and (storage.commit_mode is CommitMode.MARKER or not storage.is_dir(path)):
        return False  # nothing there (an object store has no empty directories)
    what = _what_is(storage, path, entries)
    if not entries and overwrite:
        return False  # an empty directory: nothing to lose (renamed aside like a checkpoint)
    raise (NotACheckpointError if overwrite else CheckpointExistsError)(
        f"{url} exists and is {what}, not a checkpoint; " + (
            "overwrite=True replaces only a committed checkpoint, so it is left as it is. "
            if overwrite else "") + "Choose another path"
    )


def _check_cold_tier(storage: Storage, path: str) -> None:
    """Refuse a checkpoint whose metadata links into a cold tier that is not there: committed,
    but unreadable now, so neither "not a checkpoint" (it is one) nor safe to replace (what it
    holds cannot be checked, and its cold copies would be orphaned)."""
    from .integrity import dangling_metadata_link  # integrity imports this module

    missing = dangling_metadata_link(storage, path)
    if missing is not None:
        raise ColdTierUnavailableError(
            f"{storage.url(path)} is a committed checkpoint cooled to a cold tier that is not mounted "
            f"now (or was moved): its {METADATA_FILE} links to {missing}, which is not there. Nothing "
            "was saved and it is left as it is: mount the cold tier again where the links point "
            "(overwrite=True then replaces it), or choose another path", missing=missing)


def _listing(names: list[str], limit: int = 5) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _what_is(storage: Storage, path: str, entries: list[str]) -> str:
    if not entries:
        return "an empty directory"
    if LATEST_FILE in entries or any(
        exists(storage, posixpath.join(path, e, METADATA_FILE)) for e in entries[:50] if not e.startswith(".")
    ):
        return "a root of checkpoints (it holds checkpoints or a 'latest' pointer)"
    return f"a directory holding {_listing(entries)}"


# -- clearing what crashed saves left ----------------------------------------------------------


def _recently_active(storage: Storage, entry: str, grace: float) -> bool:
    """A staging directory written to within ``grace`` seconds (local disk only): a rank of a
    save whose coordinator has not taken the lock yet may be filling it."""
    local = local_os_path(storage, entry)
    if local is None:
        return storage.commit_mode is CommitMode.RENAME and storage.scheme != "mem"
    newest = 0.0
    with contextlib.suppress(OSError):
        newest = os.lstat(local).st_mtime
        with os.scandir(local) as it:
            for e in it:
                with contextlib.suppress(OSError):
                    newest = max(newest, e.stat(follow_symlinks=False).st_mtime)
    return time.time() - newest < grace


def _dead_entries(storage: Storage, path: str, lock: SaveLock) -> list[str]:
    """Staging entries of saves to ``path`` that are over (their owner died or finished)."""
    grace = _seconds(GRACE_ENV, DEFAULT_GRACE_S)
    mine = staging_path(path, lock.save_id)
    crashed = lock.previous.get("save_id") if lock.previous else None
    crashed_path = staging_path(path, str(crashed)) if crashed else None
    records: dict[str, bool] = {}
    for full in stale_staging_dirs(storage, path):
        if full.endswith(save_lock.OWNER_SUFFIX):
            try:
                records[full[: -len(save_lock.OWNER_SUFFIX)]] = save_lock.record_alive(
                    save_lock.read_record(storage, full))
            except FileNotFoundError:
                records[full[: -len(save_lock.OWNER_SUFFIX)]] = False
    dead = []
    for full in stale_staging_dirs(storage, path):
        base = full[: -len(save_lock.OWNER_SUFFIX)] if full.endswith(save_lock.OWNER_SUFFIX) else full
        if base == mine:
            continue
        if base in records:
            if not records[base]:
                dead.append(full)
        elif storage.commit_mode is CommitMode.MARKER or not storage.is_dir(full):
            dead.append(full)  # a marker of an earlier release: the save lock now excludes its writer
        elif base == crashed_path or not _recently_active(storage, full, grace):
            dead.append(full)
    return dead


def reclaim_dead_saves(storage: Storage, parent: str, skip: str = "", only: str | None = None
                       ) -> list[str]:
    """Delete the staging entries in ``parent`` of saves to any path there (``only`` that name)
    whose writer is dead (killed: a shm:// one holds RAM until reclaimed), except those of
    ``skip``; return them.

    A path's save lock says whether its writer lives (the kernel drops a dead one's ``flock``;
    elsewhere its lease lapses): each path with staging is locked for as long as deciding takes,
    so a live save is never touched, and what it decided is deleted after the lock is given back
    (a dead save stays dead; a save starting meanwhile writes under another id). Never raises:
    what it cannot remove is logged and stays for the next save, load or gc."""
    if storage.commit_mode is not CommitMode.RENAME or storage.scheme == "mem":
        return []  # object stores: the next save to the path (owner records); mem: one process
    try:
        entries = storage.list_dir(parent)
    except (FileNotFoundError, NotADirectoryError):
        return []
    except OSError as exc:
        log.warning("could not look for crashed saves' staging in %s: %s", storage.url(parent), exc)
        return []
    names = sorted({e[1:].split(STAGING_TAG)[0] for e in entries
                    if e.startswith(".") and STAGING_TAG in e} - {skip})
    if only is not None:
        names = [n for n in names if n == only]
    reclaimed: list[str] = []
    for name in names:
        try:
            dead = _dead_of(storage, posixpath.join(parent, name))
        except (CheckpointError, OSError) as exc:  # a look-alike name, or storage trouble
            log.warning("could not check the staging of saves to %s: %s",
                        storage.url(posixpath.join(parent, name)), exc)
            continue
        for leftover in dead:
            try:
                storage.delete(leftover)
                reclaimed.append(leftover)
            except Exception as exc:  # noqa: BLE001 - the next save, load or gc tries again
                log.warning("could not reclaim %s, left by a save that is over: %s",
                            storage.url(leftover), exc)
    return reclaimed


def _dead_of(storage: Storage, path: str) -> list[str]:
    """The staging entries of saves to ``path`` that are over; none while a save holds it."""
    split_checkpoint_path(path)
    lock = save_lock.try_acquire(storage, path, f"{save_lock.BRIEF_PREFIX}{uuid.uuid4().hex[:8]}")
    if lock is None:
        return []  # a live save holds the path: all of it may be that save's
    try:
        return _dead_entries(storage, path, lock)
    finally:
        lock.release()


def _restore_replaced(storage: Storage, path: str) -> str | None:
    """Under the save lock: finish what a commit that died part-way left. Returns the path of
    the checkpoint put back, if one was."""
    restored = None
    for replaced in sorted(_replaced_dirs(storage, path)):
        if not storage.exists(path) and not _is_link(storage, path):
            if storage.exists(posixpath.join(replaced, METADATA_FILE)):
                storage.rename(replaced, path)  # the new one never made it in: the old is back
                restored = path
                log.warning("%s: put the checkpoint back that a crashed overwrite had moved aside",
                            storage.url(path))
            continue
        storage.delete(replaced)  # the new one is in place: this is the old, meant to go
    return restored


def repair(storage: Storage, path: str, wait_s: float = 2.0) -> str | None:
    """For a reader: where the checkpoint at ``path`` is when a commit died between moving the
    old one aside and renaming the new one in (it puts the old one back when no save holds the
    path, else reads it where it lies). None when there is nothing to repair."""
    if storage.commit_mode is CommitMode.MARKER:
        return None
    try:
        split_checkpoint_path(path)
        replaced = _replaced_dirs(storage, path)
    except NotACheckpointError:
        return None
    if not replaced:
        return None
    meta = posixpath.join(path, METADATA_FILE)
    deadline = time.monotonic() + wait_s
    while True:
        if storage.exists(meta):
            return path  # a live commit just finished its second rename
        lock = save_lock.try_acquire(storage, path, f"{save_lock.BRIEF_PREFIX}{uuid.uuid4().hex[:8]}")
        if lock is not None:
            try:
                dead = _dead_entries(storage, path, lock)
                _restore_replaced(storage, path)
                for leftover in dead:  # the crashed save's staging, which only this lock knew
                    storage.delete(leftover)
            finally:
                lock.release()
            return path if storage.exists(meta) else None
        if time.monotonic() > deadline:
            break
        time.sleep(0.02)
    # Cannot take the lock (read-only storage, or a save holds it): read the old one in place.
    for candidate in sorted(replaced):
        if storage.exists(posixpath.join(candidate, METADATA_FILE)):
            return candidate
    return None


# -- the protocol --------------------------------------------------------------------------


def _live_tags(storage: Storage, path: str, lock: SaveLock) -> set[str]:
    """The data-file tags of saves to ``path`` that are running (this one included)."""
    live = {_tag_of(lock.save_id)}
    for _record, doc in save_lock.other_records(storage, path, exclude=lock.save_id):
        if save_lock.record_alive(doc) and doc is not None:
            live.add(_tag_of(str(doc.get("save_id", ""))))
    return live


def _sweep(storage: Storage, path: str, keep: set[str], live: set[str]) -> None:
    """Object stores: delete the data files in ``path`` that the committed metadata does not name
    (``keep``) and no running save owns (``live`` tags): those of a replaced checkpoint, or of an
    overwrite that crashed before its commit. Anything not named like our data files stays."""
    for entry in storage.list_dir(path):
        found = _DATA_FILE.match(entry)
        if found is None or entry in keep or (found["tag"] is not None and found["tag"] in live):
            continue
        storage.delete(posixpath.join(path, entry))


def _clear_uncommitted(storage: Storage, path: str, had_saves: bool) -> None:
    """Object stores: the data files a crashed save left in the final prefix (it has no metadata)."""
    entries = storage.list_dir(path)
    if not had_saves or any(not _DATA_FILE.match(e) for e in entries):
        return  # not (only) a crashed save's files: check_target refuses it, naming what it is
    for e in entries:
        storage.delete(posixpath.join(path, e))


def begin_save(storage: Storage, path: str, overwrite: bool, save_id: str,
               lock: SaveLock | None = None) -> str:
    """Check the target, clear what crashed saves to it left, and return where ranks write.

    ``lock`` is the caller's save lock on ``path``; without one, one is taken here and held
    until the process ends or ``save_lock.held_by_this_process(...).release()``."""
    split_checkpoint_path(path, saving=True)
    own = lock is None
    if lock is None:
        lock = save_lock.acquire(storage, path, save_id)
    try:
        return _begin(storage, path, overwrite, save_id, lock)
    except BaseException:
        if own:
            lock.release()
        raise


def prepare_target(storage: Storage, path: str, overwrite: bool, lock: SaveLock) -> bool:
    """Under the save lock: finish or undo what saves that are over left, then check the target
    (see :func:`check_target`); return whether a committed checkpoint is there to replace."""
    marker = storage.commit_mode is CommitMode.MARKER
    dead = _dead_entries(storage, path, lock)
    if not marker:
        _restore_replaced(storage, path)
    else:
        names = checkpoint_files(storage, path)
        if names is None:
            _clear_uncommitted(storage, path, had_saves=bool(dead))
        elif overwrite:  # what replaced checkpoints and crashed overwrites left beside this one
            _sweep(storage, path, names, _live_tags(storage, path, lock))
    committed = check_target(storage, path, overwrite)
    for leftover in dead:
        storage.delete(leftover)  # left by a save that is over (crashed, or a dead lease)
    if not marker:  # and beside it: a killed save's staging to another path of the root
        parent, name = split_checkpoint_path(path)
        reclaim_dead_saves(storage, parent, skip=name)
    return committed


def _begin(storage: Storage, path: str, overwrite: bool, save_id: str, lock: SaveLock) -> str:
    prepare_target(storage, path, overwrite, lock)
    if storage.commit_mode is not CommitMode.MARKER:
        staging = staging_path(path, save_id)
        storage.makedirs(staging)
        return staging
    # Says "a save is under way" until it commits or is cleaned up. A checkpoint being replaced
    # stays committed meanwhile: this save's files are tagged (data_file_tag), so they are not
    # its files, and its metadata is replaced by one PUT at the commit.
    lock.ensure_record()
    storage.makedirs(path)
    return path


def abandon(storage: Storage, staging: str, path: str, save_id: str) -> None:
    """Remove what a failed, uncommitted save wrote; a committed checkpoint is left alone.

    Called after a failure, so it never raises: what it cannot remove is logged, and the next
    save to the path removes it (the save's error is the one to report)."""
    try:
        if storage.commit_mode is not CommitMode.MARKER:
            storage.delete(staging)
            return
        names = checkpoint_files(storage, staging)
        if names is None:
            storage.delete(staging)  # nothing committed here: all of it is this save's
            return
        # A checkpoint is committed here (the one this save was to replace, or this save's own
        # if its commit failed after the PUT): only this save's files it does not name go.
        tag = _tag_of(save_id)
        for entry in storage.list_dir(staging):
            found = _DATA_FILE.match(entry)
            if found is not None and found["tag"] == tag and entry not in names:
                storage.delete(posixpath.join(staging, entry))
    except Exception as exc:  # noqa: BLE001 - the save's own error is the one to report
        log.warning("could not remove what a failed save to %s wrote (the next save to it will): %s",
                    storage.url(path), exc)


def _wait_for_readers(storage: Storage, path: str) -> None:
    """Give loads of the checkpoint about to be replaced a moment to finish (a load that is
    still running then fails with CheckpointReplacedError, never with mixed data)."""
    if storage.scheme not in LEASED_SCHEMES:
        return
    deadline = time.monotonic() + _seconds(WAIT_READERS_ENV, DEFAULT_WAIT_READERS_S)
    while is_being_read(storage, path) and time.monotonic() < deadline:
        time.sleep(0.05)


def _drop_replaced(storage: Storage, final: str, save_id: str) -> None:
    """Object stores, after the metadata PUT: delete the data files the new metadata does not
    name (the replaced checkpoint's). The save lock is held, so no other save writes here. The
    save is committed whatever happens now: a failure is logged and the next overwrite retries."""
    try:
        names = checkpoint_files(storage, final)
        if names is not None:
            _sweep(storage, final, names, {_tag_of(save_id)})
    except Exception as exc:  # noqa: BLE001 - committed: never undone by a failed clean-up
        log.warning("%s is committed, but files of the checkpoint it replaced could not be deleted "
                    "(the next overwrite of it deletes them): %s", storage.url(final), exc)


def commit(storage: Storage, staging: str, final: str, overwrite: bool, save_id: str) -> None:
    """Make ``staging`` visible as ``final``: an atomic rename, or, over a committed checkpoint,
    one exchange of the two where the file system can (``renameat2``), else the old copy moved
    aside first and put back if the rename fails. On object stores the metadata the caller
    wrote into ``final`` already committed it; what remains is deleting the files of the
    checkpoint it replaced."""
    if storage.commit_mode is CommitMode.MARKER:
        _drop_replaced(storage, final, save_id)
        return
    parent, name = split_checkpoint_path(final)
    replaced = None
    if storage.exists(final) or _is_link(storage, final):
        check_target(storage, final, overwrite)  # still nothing but a checkpoint of ours
        _wait_for_readers(storage, final)
        replaced = posixpath.join(parent, f".{name}{REPLACED_TAG}{save_id}")
        if storage.exchange(staging, final):
            # One step: the path names the old checkpoint, then the new one, never nothing (a
            # crash between two renames left it empty, and a tool that lists the directory, such
            # as Lightning resolving "last", found no checkpoint there).
            _set_aside(storage, staging, replaced)
            _delete_replaced(storage, final, replaced)
            return
        storage.rename(final, replaced)
    try:
        storage.rename(staging, final)
    except BaseException:
        if replaced is not None:
            try:
                storage.rename(replaced, final)
            except Exception as exc:  # the next save or load puts it back (_restore_replaced)
                log.warning("could not put %s back after a failed commit: %s", storage.url(final), exc)
        raise
    if replaced is not None:
        _delete_replaced(storage, final, replaced)


def _set_aside(storage: Storage, old: str, replaced: str) -> None:
    """Give the checkpoint an exchange moved to the staging name (``old``) the name of a replaced
    one, which every later save or load of the path deletes; where that fails, it stays at the
    staging name, which the next save deletes as the leftover of a save that is over."""
    try:
        storage.rename(old, replaced)
    except Exception as exc:  # noqa: BLE001 - committed: never reported as a failed save
        log.warning("%s is committed; the checkpoint it replaced stays at %s until the next save "
                    "to it: %s", storage.url(posixpath.dirname(old)), storage.url(old), exc)


def _delete_replaced(storage: Storage, final: str, replaced: str) -> None:
    try:
        storage.delete(replaced)
    except Exception as exc:  # noqa: BLE001 - committed: never reported as a failed save
        log.warning("%s is committed, but the checkpoint it replaced (%s) could not be deleted "
                    "(the next save or load of it removes it): %s", storage.url(final),
                    storage.url(replaced), exc)


# -- the latest pointer ---------------------------------------------------------------------


@dataclass(frozen=True)
class Latest:
    name: str
    step: int | None


def read_latest(storage: Storage, root: str) -> Latest | None:
    """The ``latest`` pointer of ``root``, checked: it names a plain entry of ``root`` (never a
    path out of it) and an integer step; anything else is a CorruptCheckpointError.

    An object store answers a read in two requests (its size, then its bytes), so a save
    replacing the pointer between them tears the read; a damaged pointer reads the same bytes
    twice in a row, so it is refused only then (or after five reads that all fail)."""
    pointer = posixpath.join(root, LATEST_FILE)
    where = storage.url(pointer)
    last = None
    for attempt in range(5):
        raw = _read_pointer(storage, pointer, where)
        if raw is None:
            return None
        try:
            return _parse_latest(raw, where)
        except CorruptCheckpointError:
            if raw == last or attempt == 4:
                raise
            last = raw
            time.sleep(0.01 * (attempt + 1))  # let the save's PUT finish
    return None  # not reached: the last attempt returns or raises


def _read_pointer(storage: Storage, pointer: str, where: str) -> bytes | None:
    """The bytes of the pointer file; None where there is none."""
    try:
        raw = storage.read_small(pointer, MAX_LATEST_BYTES)  # a save renames over it any time
        if raw is None:
            raise CorruptCheckpointError(
                f"{where} is over {MAX_LATEST_BYTES} bytes, not a latest pointer (a few dozen bytes "
                "of JSON); remove it, or load a checkpoint by its path")
    except (FileNotFoundError, NotADirectoryError):
        return None  # NotADirectoryError: ``root`` is a file, which holds no pointer
    except IsADirectoryError as exc:
        raise CorruptCheckpointError(f"{where} is not a file ({exc}); remove it, or load a checkpoint "
                                     "by its path") from exc
    except OSError as exc:
        if type(exc).__name__ != "NotARegularFileError":
            raise
        raise CorruptCheckpointError(f"{where}: {exc}") from exc
    return raw


def _parse_latest(raw: bytes, where: str) -> Latest:
    try:
        doc = json.loads(raw.decode())
        if not isinstance(doc, dict):
            raise ValueError("not a JSON object")
        name = check_file_name(doc.get("checkpoint"), where)
        step = doc.get("step")
        if step is not None and (not isinstance(step, int) or isinstance(step, bool) or step < 0):
            raise ValueError(f"its step {step!r} is not a whole number >= 0")
    except (ValueError, UnicodeDecodeError, UnsafeCheckpointError) as exc:
        raise CorruptCheckpointError(
            f"{where}: unreadable latest pointer ({exc}); the next save replaces it, or load a "
            "checkpoint by its path") from exc
    return Latest(name, step)


def _user_metadata(storage: Storage, path: str) -> dict | None:
    """The user metadata of the checkpoint at ``path``; None where it cannot be read."""
    try:
        meta_path = posixpath.join(path, METADATA_FILE)
        if storage.size(meta_path) > MAX_METADATA_CHECK_BYTES:
            return None
        raw = bytes(storage.read(meta_path))
        return CheckpointMetadata.from_bytes(raw, source=storage.url(path)).user_metadata
    except (OSError, CorruptCheckpointError):
        return None


def _keeps_pointer(storage: Storage, parent: str, current: Latest, final: str) -> bool:
    """``latest`` names a later step than the new checkpoint: it stays unless the new one is on
    a timeline that abandoned it (a rollback, see :mod:`.manager.timeline`)."""
    from .timeline import abandons

    old = _user_metadata(storage, posixpath.join(parent, current.name))
    new = _user_metadata(storage, final)
    return old is None or new is None or not abandons(new, old, current.step)


POINTER_TEMP_PREFIX = f".{LATEST_FILE}.tmp-"
_POINTER_TEMP_RE = re.compile(re.escape(POINTER_TEMP_PREFIX) + r"[0-9A-Za-z_-]{1,64}")


def _clear_stale_pointer_temps(storage: Storage, parent: str) -> None:
    """Remove ``.latest.tmp-*`` files a crash left between the write and the rename (local disk,
    under the pointer lock, so no writer of this host is between the two). A writer on another
    host may not share the lock, so only a plain file untouched for a whole save lease
    (``BCP_SAVE_LEASE_S``) goes: its writer renames it milliseconds after writing it."""
    if save_lock.local_os_path(storage, parent) is None:
        return
    try:
        # By name in a directory open and checked (shm://): one swapped for a link meanwhile
        # is never where anything is removed.
        fd = save_lock.open_dir(storage, parent)
    except OSError:
        return
    try:
        names = os.listdir(fd)
        cutoff = time.time() - save_lock.lease_seconds()
        for name in names:
            if not _POINTER_TEMP_RE.fullmatch(name):
                continue
            try:
                st = os.lstat(name, dir_fd=fd)
                if stat.S_ISREG(st.st_mode) and st.st_mtime < cutoff:
                    os.unlink(name, dir_fd=fd)
            except OSError:
                continue  # gone meanwhile, or not ours to remove
    except OSError:
        return
    finally:
        os.close(fd)


def update_latest(storage: Storage, final: str, step: int | None, save_id: str) -> bool:
    """Point ``<parent>/latest`` at ``final`` unless it already names a later step (of a
    checkpoint that exists) on the new checkpoint's timeline: a checkpoint saved after a
    rollback moves it back. An unreadable pointer is replaced."""
    parent, name = split_checkpoint_path(final)
    with save_lock.pointer_lock(storage, parent):
        try:
            current = read_latest(storage, parent)
        except CorruptCheckpointError as exc:
            log.warning("replacing an unreadable latest pointer: %s", exc)
            current = None
        if (current is not None and step is not None and current.step is not None and current.step > step
                and storage.exists(posixpath.join(parent, current.name, METADATA_FILE))
                and _keeps_pointer(storage, parent, current, final)):
            return False
        doc = json.dumps({"checkpoint": name, "step": step, "time": time.time()}).encode()
        if storage.commit_mode is CommitMode.MARKER:
            storage.write_bytes(posixpath.join(parent, LATEST_FILE), doc)  # one PUT: atomic
            return True
        _clear_stale_pointer_temps(storage, parent)
        tmp = posixpath.join(parent, f"{POINTER_TEMP_PREFIX}{save_id}")
        try:
            storage.write_bytes(tmp, doc)
            storage.rename(tmp, posixpath.join(parent, LATEST_FILE), overwrite=True)
        except BaseException:
            # Its fsync or rename failed (a full disk): the temp would stay a whole lease.
            with contextlib.suppress(Exception):
                storage.delete(tmp)
            raise
        return True
