"""Deleting a checkpoint of a local hot tier, with the cold copies only it uses.

``bcp gc`` and the tiering service's retention delete through :func:`delete_checkpoint`:

1. check again that the checkpoint may go (a pin, a lease, a save to its path may have come
   since the decision), and that it is a directory inside the hot root, not a link;
2. journal the deletion (when a journal is given), then rename the directory aside to
   ``.<name>.deleting-<id>``: it stops being a checkpoint at once (a crash leaves a hidden
   directory, never half a checkpoint);
3. delete its cold copies that no other link under the hot root resolves to (a ``cp -a`` copy
   shares its original's cold files), then the renamed directory, then empty cold directories.

The deletion holds the path's save lock throughout. A crash between 2 and 3 is finished by
:func:`recover_deletion` from the journal record; without a journal (``bcp gc`` without
``--cold``) the deletion writes its own record beside the checkpoint first,
``.<name>.deleting-<id>.record``, and :func:`recover_unjournaled` finishes it. Only
files proved to be the checkpoint's are deleted: a cold file is one whose link resolves (real
paths) inside the cold root; a link elsewhere is removed, its target never.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import posixpath
import re
import shutil
import stat
import uuid
from dataclasses import dataclass, field

from telemetry import span

from ..commit import save_lock
from ..commit.integrity import metadata_identity
from ..commit.leases import is_being_read, is_pinned
from ..commit.protocol import LATEST_FILE
from ..errors import CheckpointError, ConcurrentSaveError
from ..format.metadata import METADATA_FILE
from ..storage import Storage
from ..storage.local import fsync_dir
from .catalog import LOCAL_DISK, CheckpointInfo, cold_references, cold_target, describe, inside, latest_of
from .journal import Journal
from .protection import untouchable_reason

DELETING_TAG = ".deleting-"
RECORD_SUFFIX = ".record"
# Exactly what a deletion of ours names: ``.<name>.deleting-<12 hex>`` (+ ``.record``).
_RECORD_RE = re.compile(r"\.(?P<name>.+)\.deleting-(?P<id>[0-9a-f]{12})\.record")
_MAX_RECORD = 1 << 20


class DeletionRefusedError(CheckpointError):
    """A checkpoint was kept: it became protected, was replaced, or is not this tier's."""


@dataclass(frozen=True)
class Deleted:
    path: str
    cold_files: list[str] = field(default_factory=list)  # cold copies deleted with it
    bytes_freed: int = 0  # hot files (not links) and cold copies removed


def remove_empty_dirs(start: str, root: str) -> None:
    """Remove ``start`` and its parents while they are empty, stopping at ``root`` (never
    removed) and never outside it."""
    real_root = os.path.realpath(root)
    d = os.path.realpath(start)
    while inside(d, real_root):
        try:
            os.rmdir(d)
        except OSError:
            return  # not empty (something else lives there) or gone
        d = os.path.dirname(d)


def _own_cold_files(hot_dir: str, cold_root: str | None, shared: dict[str, list[str]]) -> list[str]:
    """The cold copies ``hot_dir``'s links resolve to that no other link uses."""
    out = []
    for n in sorted(os.listdir(hot_dir)):
        target = cold_target(os.path.join(hot_dir, n), cold_root)
        if target is not None and target not in shared and os.path.isfile(target) \
                and not os.path.islink(target):
            out.append(target)
    return out


def _regular_bytes(hot_dir: str) -> int:
    total = 0
    for d, _, names in os.walk(hot_dir):
        for n in names:
            st = os.lstat(os.path.join(d, n))
            total += st.st_size if stat.S_ISREG(st.st_mode) else 0
    return total


def reclaimable_bytes(path: str, hot_root: str, cold_root: str | None) -> int:
    """What deleting the checkpoint at ``path`` would free: its hot files (links count
    nothing) and the cold copies only it uses (``bcp gc``'s dry run reports this)."""
    shared = cold_references(hot_root, cold_root, exclude=path)
    return _regular_bytes(path) + sum(os.path.getsize(f) for f in _own_cold_files(path, cold_root, shared))


def delete_tree(hot_dir: str, cold_root: str | None, hot_root: str) -> Deleted:
    """Delete a hot checkpoint directory (already renamed aside) and the cold copies only it
    links to: a cold file is deleted when the link resolves inside the cold root (real paths)
    and no other link under ``hot_root`` resolves to it."""
    if os.path.islink(hot_dir) or not os.path.isdir(hot_dir):
        raise DeletionRefusedError(f"{hot_dir} is not a directory of this tier; not deleted")
    shared = cold_references(hot_root, cold_root, exclude=hot_dir)
    freed = _regular_bytes(hot_dir)
    deleted = []
    for target in _own_cold_files(hot_dir, cold_root, shared):
        size = os.path.getsize(target)
        os.unlink(target)
        deleted.append(target)
        freed += size
    shutil.rmtree(hot_dir)
    for d in {os.path.dirname(t) for t in deleted}:
        remove_empty_dirs(d, cold_root or d)
    return Deleted(hot_dir, deleted, freed)


def _refuse_if_changed(url: str, ckpt: CheckpointInfo, now: bytes | None) -> None:
    """Retention decided on the checkpoint it scanned; a new save may have put another one
    at the path since (``overwrite=True``), which the decision says nothing about."""
    if ckpt.identity and now != ckpt.identity:
        raise DeletionRefusedError(
            f"{url} was replaced by a new save since the decision to delete it; kept "
            "(the next pass decides on the new one)")


def _refuse_if_foreign(url: str, foreign: list[str] | tuple[str, ...]) -> None:
    if foreign:
        shown = ", ".join(repr(n) for n in list(foreign)[:5]) + (" ..." if len(foreign) > 5 else "")
        raise DeletionRefusedError(
            f"{url} also holds {shown}, which are not part of the checkpoint; kept. Move those "
            "out (the next pass deletes the checkpoint), or delete the directory yourself")


def delete_checkpoint(ckpt: CheckpointInfo, hot_root: str, cold_root: str | None,
                      journal: Journal | None) -> Deleted:
    """Retention: rename the checkpoint aside (it stops being one at once), then delete its
    hot files and the cold copies no other checkpoint links to. A crash in between is
    finished by :func:`recover_deletion` (when journaled). Checked again first: a checkpoint
    that has become untouchable since the decision (pinned, read, named by ``latest``, a save
    to its path under way) is kept, and so is one a new save put at the path meanwhile.
    Raises DeletionRefusedError when it kept the checkpoint."""
    path = ckpt.path
    if not inside(os.path.realpath(path), os.path.realpath(hot_root)) or os.path.islink(path):
        raise DeletionRefusedError(f"{path} is not a directory inside the hot root {hot_root}; not deleted")
    identity = os.lstat(path).st_ino
    fresh = describe(path, hot_root, cold_root)
    why = untouchable_reason(fresh) if fresh is not None else "no longer a checkpoint"
    if why is not None:
        raise DeletionRefusedError(f"{path}: {why} since the decision; kept")
    assert fresh is not None
    _refuse_if_changed(path, ckpt, fresh.identity)
    _refuse_if_foreign(path, fresh.foreign)
    op_id = uuid.uuid4().hex[:12]
    # The path's save lock, held to the end: a recovery pass (or a save) never works on a
    # deletion still running, and a crashed one's lock goes with its process.
    try:
        lock = save_lock.acquire(LOCAL_DISK, path, f"delete-{op_id}")
    except ConcurrentSaveError:
        raise DeletionRefusedError(f"{path}: a save, deletion or repair holds its path; kept") from None
    # (a lock that cannot be taken at all, a read-only root, raises its own StorageIOError)
    try:
        return _delete_locked(path, ckpt, fresh, identity, hot_root, cold_root, journal, op_id)
    finally:
        lock.release()


def _delete_locked(path: str, ckpt: CheckpointInfo, fresh: CheckpointInfo, identity: int, hot_root: str,
                   cold_root: str | None, journal: Journal | None, op_id: str) -> Deleted:
    parent, name = os.path.split(path)
    trash = os.path.join(parent, f".{name}{DELETING_TAG}{op_id}")
    record = trash + RECORD_SUFFIX
    cold_dir = os.path.join(cold_root, os.path.relpath(path, hot_root)) if cold_root else None
    with span("tiering.delete", checkpoint=path, path=path, bytes=ckpt.size, step=ckpt.step):
        if journal is not None:
            journal.append(op_id, "delete", "begin", checkpoint=path, trash=trash, cold_dir=cold_dir)
        else:
            try:
                _write_record(record, path, trash, fresh, op_id)
            except OSError as exc:
                if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
                return _delete_in_place(path, ckpt, fresh, hot_root, cold_root)
        os.rename(path, trash)
        moved = describe(trash, hot_root, cold_root)
        if os.lstat(trash).st_ino != identity or moved is None or moved.identity != fresh.identity \
                or moved.foreign:
            # A save committed a new checkpoint at the path after the check, or a file of
            # someone else's appeared in it: put it back.
            os.rename(trash, path)
            if journal is not None:
                journal.append(op_id, "delete", "aborted", error="changed while being deleted")
            _drop_record(record, journal)
            raise DeletionRefusedError(f"{path} was replaced or written to while being deleted; kept")
        fsync_dir(parent)
        done = delete_tree(trash, cold_root, hot_root)
        if cold_dir is not None and cold_root is not None:
            remove_empty_dirs(cold_dir, cold_root)  # files in it that others use stay, and so does it
        if journal is not None:
            journal.append(op_id, "delete", "done")
        _drop_record(record, journal)
    return Deleted(path, done.cold_files, done.bytes_freed)


def _delete_in_place(path: str, ckpt: CheckpointInfo, fresh: CheckpointInfo, hot_root: str,
                     cold_root: str | None) -> Deleted:
    """No room for the deletion record: a full disk, when freeing space matters most, and
    deleting needs none. Deleted where it is (under the path's save lock), the metadata first
    and made durable, so it stops being a checkpoint at once, as the storage-layer deletion
    does: a crash part-way leaves an uncommitted directory (``bcp ls`` shows it; delete it by
    hand), never a committed checkpoint with files missing."""
    _refuse_if_foreign(path, sorted(set(os.listdir(path)) - set(fresh.files)))
    _refuse_if_changed(path, ckpt, metadata_identity(LOCAL_DISK, path))
    meta = os.path.join(path, METADATA_FILE)
    freed = os.lstat(meta).st_size if os.path.isfile(meta) else 0
    with contextlib.suppress(FileNotFoundError):
        os.unlink(meta)
    fsync_dir(path)
    done = delete_tree(path, cold_root, hot_root)
    fsync_dir(os.path.dirname(path))
    return Deleted(path, done.cold_files, done.bytes_freed + freed)


def _write_record(record: str, path: str, trash: str, fresh: CheckpointInfo, op_id: str) -> None:
    """What :func:`recover_unjournaled` needs to prove a ``.deleting-`` directory is this
    deletion's: the directory's inode, the checkpoint's files and metadata identity, and who
    deleted (a live deleter's work is never taken over)."""
    st = os.lstat(path)
    doc = {**save_lock.owner_doc(f"delete-{op_id}"), "op": "delete", "id": op_id, "checkpoint": path,
           "trash": trash, "dev": st.st_dev, "ino": st.st_ino, "files": list(fresh.files),
           "identity": fresh.identity.hex()}
    fd = os.open(record, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    try:
        _write_all(fd, json.dumps(doc).encode())
        os.fsync(fd)
    except BaseException:
        # A full disk: an empty or torn record proves nothing, so no pass would ever remove it.
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(record)
        raise
    os.close(fd)
    fsync_dir(os.path.dirname(record))


def _write_all(fd: int, data: bytes) -> None:
    """Write all of ``data``: a short write (a nearly full disk) continues, or raises ENOSPC."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _drop_record(record: str, journal: Journal | None) -> None:
    if journal is None:
        try:
            os.unlink(record)
        except FileNotFoundError:
            pass


def delete_on_storage(storage: Storage, ckpt: CheckpointInfo, *, cold_in_place: bool = False,
                      requested: bool = False) -> None:
    """Delete a checkpoint through the storage layer, on any backend (the manager's retention,
    ``bcp gc`` on an object store, HDFS tiering): under its path's save lock, checked again
    under it (pins, leases, ``latest``, a new save at the path since the decision, entries
    that are not the checkpoint's), the metadata first (it stops being committed at once),
    then the rest. A cooled checkpoint (files that are links into a cold tier) is refused:
    only :func:`delete_checkpoint`, given the cold root, removes its cold copies with it;
    ``cold_in_place``: its cold files are its own, at its path (an HDFS storage policy).
    ``requested``: this very checkpoint was asked for by name (Lightning's ``save_top_k``), not
    chosen by a retention policy, so being named by ``latest`` does not keep it.
    Raises DeletionRefusedError when kept."""
    if ckpt.cold_files and not cold_in_place:
        raise DeletionRefusedError(
            f"{ckpt.url} is cooled to another tier (its files are links): deleting here would orphan "
            "its cold copies; delete it with `bcp gc --cold COLD_ROOT`")
    path = ckpt.path
    lock = save_lock.try_acquire(storage, path, f"retention-{uuid.uuid4().hex[:8]}")
    if lock is None:
        raise DeletionRefusedError(f"{ckpt.url}: a save or repair holds its path; kept")
    try:
        if is_pinned(storage, path) or is_being_read(storage, path):
            raise DeletionRefusedError(f"{ckpt.url}: pinned or being read since the decision; kept")
        _refuse_if_changed(ckpt.url, ckpt, metadata_identity(storage, path))
        if not requested:
            # An unreadable pointer protects every checkpoint of its run, as at the scan.
            parent, name = posixpath.split(path.rstrip("/"))
            latest, problem = latest_of(storage, parent, [LATEST_FILE])
            if problem is not None or latest == name:
                raise DeletionRefusedError(f"{ckpt.url}: named by latest since the decision; kept")
        if ckpt.files:
            _refuse_if_foreign(ckpt.url, sorted(set(storage.list_dir(path)) - set(ckpt.files)))
        with span("tiering.delete", checkpoint=ckpt.url, path=ckpt.url, bytes=ckpt.size, step=ckpt.step):
            storage.delete(posixpath.join(path, METADATA_FILE))  # uncommitted first
            storage.delete(path)
    finally:
        lock.release()


def recover_deletion(hot_root: str, cold_root: str | None, rec: dict) -> None:
    """Finish a deletion a crash interrupted, from its journal ``begin`` record."""
    trash = rec.get("trash")
    # The journal is a file like any other: act only on what a deletion of ours can have left.
    if not (isinstance(trash, str) and ".deleting-" in os.path.basename(trash)
            and inside(os.path.realpath(trash), os.path.realpath(hot_root))):
        return
    if os.path.isdir(trash) and not os.path.islink(trash):
        moved = describe(trash, hot_root, cold_root)
        home = rec.get("checkpoint")
        if moved is not None and moved.foreign:
            # A crash came between the rename and its check: entries that are not the
            # checkpoint's are never deleted; it goes back where it was if that is free.
            if isinstance(home, str) and os.path.dirname(home) == os.path.dirname(trash) \
                    and not os.path.lexists(home):
                os.rename(trash, home)
            return
        delete_tree(trash, cold_root, hot_root)  # renamed away, so no longer a checkpoint: finish
    cold_dir = rec.get("cold_dir")
    if isinstance(cold_dir, str) and cold_root is not None and not os.path.isdir(rec.get("checkpoint") or ""):
        remove_empty_dirs(cold_dir, cold_root)


def recover_deletions(hot_root: str, cold_root: str | None, journal: Journal) -> int:
    """Finish every deletion under ``hot_root`` the journal shows interrupted (``bcp gc`` may
    be given one run of the tier: others' records are left for the tiering pass, and so are
    moves); returns how many."""
    count = 0
    for rec in journal.unfinished():
        trash = rec.get("trash")
        if rec.get("op") != "delete" or not isinstance(trash, str) \
                or not inside(os.path.realpath(trash), os.path.realpath(hot_root)):
            continue
        with span("tiering.recover", checkpoint=rec.get("checkpoint"), op="delete", move_id=rec.get("id")):
            recover_deletion(hot_root, cold_root, rec)
        journal.append(rec["id"], "delete", "recovered")
        count += 1
    return count


def _read_record(record: str) -> dict | None:
    """A deletion record (never through a link, never a FIFO), or None if it is not one."""
    try:
        fd = os.open(record, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        doc = json.loads(os.read(fd, _MAX_RECORD).decode())
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    finally:
        os.close(fd)
    return doc if isinstance(doc, dict) else None


def _only_its_files(trash: str, doc: dict, cold_root: str | None) -> bool:
    """Whether ``trash`` holds nothing but what the record says the checkpoint had (some may be
    gone: a crash in the middle of removing them), the same metadata, and no cold link a
    deletion without the cold root would orphan the target of."""
    files = doc.get("files")
    if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
        return False
    for entry in os.listdir(trash):
        st = os.lstat(os.path.join(trash, entry))
        if entry not in files or not (stat.S_ISREG(st.st_mode)
                                      or (stat.S_ISLNK(st.st_mode) and cold_root is not None)):
            return False
    if os.path.lexists(os.path.join(trash, METADATA_FILE)):
        now = metadata_identity(LOCAL_DISK, trash)
        return now is not None and now.hex() == doc.get("identity")
    return True


def _finish_from_record(parent: str, name: str, op_id: str, hot_root: str, cold_root: str | None) -> bool:
    """Finish (or undo) one deletion cut short, proved ours by its record; False when left."""
    home = os.path.join(parent, name)
    trash = os.path.join(parent, f".{name}{DELETING_TAG}{op_id}")
    record = trash + RECORD_SUFFIX
    doc = _read_record(record)
    if doc is None or doc.get("id") != op_id or not isinstance(doc.get("trash"), str) \
            or os.path.basename(doc["trash"]) != os.path.basename(trash) or save_lock.record_alive(doc):
        return False  # not one of our records, or its deleter may still run
    if not os.path.lexists(trash):
        os.unlink(record)  # it finished, or never renamed the checkpoint: nothing to do
        return True
    st = os.lstat(trash)
    if not stat.S_ISDIR(st.st_mode) or (st.st_dev, st.st_ino) != (doc.get("dev"), doc.get("ino")):
        return False  # not the directory that deletion renamed aside
    if _only_its_files(trash, doc, cold_root):
        delete_tree(trash, cold_root, hot_root)  # renamed away, so no longer a checkpoint: finish
    elif not os.path.lexists(home):
        os.rename(trash, home)  # someone else's files (or changed): never deleted; put back
    else:
        return False
    fsync_dir(parent)
    os.unlink(record)
    return True


def recover_unjournaled(hot_root: str, cold_root: str | None) -> int:
    """Finish the deletions without a journal (``bcp gc`` without ``--cold``) that a crash cut
    short under ``hot_root``: a ``.<name>.deleting-<id>`` directory whose record beside it
    proves it is that deletion's renamed checkpoint, once its deleter is gone (the path's save
    lock is free and its process dead), is deleted; one holding anything else is put back.
    Links are never followed. Returns how many were resolved."""
    count = 0
    for parent, dirs, names in os.walk(hot_root):
        dirs[:] = [d for d in dirs if not d.startswith(".")]  # never into staging or trash
        for entry in names:
            m = _RECORD_RE.fullmatch(entry)
            if m is None:
                continue
            home = os.path.join(parent, m["name"])
            lock = save_lock.try_acquire(LOCAL_DISK, home, f"recover-{m['id']}")
            if lock is None:
                continue  # a deletion or save works on that path now: the next pass
            try:
                with span("tiering.recover", checkpoint=home, op="delete", move_id=m["id"]):
                    count += _finish_from_record(parent, m["name"], m["id"], hot_root, cold_root)
            except OSError:
                continue  # changed under us: the next pass looks again
            finally:
                lock.release()
    return count
