"""Moving one checkpoint to the cold tier, and resolving moves a crash interrupted.

Before anything is written, the checkpoint is described again through the directory the move
opened: one that has become untouchable since the scan (pinned, being read, named by
``latest``, a save to its path under way) or was replaced by a new save is refused. So is a
move that would land on a cold file that already exists (an orphan: the cold copy of an
earlier checkpoint at this path, which a link outside the hot root may still use).

Per checkpoint, each phase over all of its files before the next one starts:

1. copy     hot file -> ``<cold>/<rel>/.<file>.tiering-<id>`` through the storage layer (retries,
            I/O events, injectable faults), checking the checkpoint's checksums on the way;
            fsync; journal its inode; hard-link it to ``<cold>/<rel>/<file>`` (which fails,
            rather than replaces, if that name exists), then drop the temporary name.
2. verify   read the cold copy back (its cached pages dropped first): size, whole-file hash
            equal to the hot original's, every checksum of the metadata. Any mismatch aborts
            the move: the cold copies it created deleted, hot files untouched.
3. remap    hard-link the hot file into ``<run>/.<name>.tiering-<id>/`` (the hot copy, kept
            until step 4), then ``rename(2)`` a symlink to the cold copy over the hot path:
            one atomic, metadata-only step. A reader that opened the file before keeps its
            descriptor on the hot copy; any open after it follows the link.
4. free     delete ``.<name>.tiering-<id>/``; the hot blocks go once the last reader closes.

Every phase is journaled first. Whatever moment a crash hits, each hot path is either the
original file or a link to a complete, verified copy, so the checkpoint always loads;
:func:`recover` then rolls unremapped files back (deleting the cold copies this move created,
known by the inode it journaled, never another file) and remapped ones forward (freeing the
hot copies). It acts on the paths the record names, not on ones computed from the roots it
is given now, and only after checking them: a record that names anything outside the tiers,
or that is not in the mover's own form, is skipped and logged. The metadata file moves last.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import xxhash

from bytecheckpoint.errors import CheckpointError
from bytecheckpoint.format.metadata import METADATA_FILE, CheckpointMetadata, check_file_name
from bytecheckpoint.format.metadata_file import metadata_max_bytes
from bytecheckpoint.manage.catalog import (
    CheckpointInfo,
    cold_references,
    describe,
    inside,
    is_cold_link,
)
from bytecheckpoint.manage.deletion import recover_deletion
from bytecheckpoint.manage.journal import Journal
from bytecheckpoint.manage.protection import untouchable_reason
from bytecheckpoint.storage import Storage, open_storage
from bytecheckpoint.storage.base import abort_quietly
from bytecheckpoint.storage.local import fsync_dir
from telemetry import span
from telemetry.spans import Span

from .verify import chunk_checks, digest

Hook = Callable[[str], None]
log = logging.getLogger("storage_tiering")
_MOVE_ID = re.compile(r"[0-9a-f]{12}")  # uuid4().hex[:12], as Mover.cool makes them


class MoveError(RuntimeError):
    """A move was refused or aborted; the hot copy is intact."""


@dataclass(frozen=True)
class _Copied:
    name: str
    hot_file: str
    cold_file: str
    xxh3: int  # whole-file hash of the hot original
    size: int
    inode: int  # of the hot file copied, checked again at the remap


@dataclass(frozen=True)
class _Placed:
    """A cold file this move created: only such a file is ever deleted by it or its recovery."""

    cold_file: str
    dev: int
    ino: int

    def still_there(self) -> bool:
        try:
            st = os.lstat(self.cold_file)
        except FileNotFoundError:
            return False
        return (st.st_dev, st.st_ino) == (self.dev, self.ino)


@dataclass(frozen=True)
class MoveResult:
    checkpoint: str
    files: int
    bytes: int
    seconds: float


def _drop_cache(path: str) -> None:
    """Make the read-back come from the cold device, not from the pages just written."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _is_storage_file(meta: CheckpointMetadata, name: str) -> bool:
    return any(f.name == name for f in meta.files)


def scratch_dir(ckpt_path: str, move_id: str) -> str:
    parent, name = os.path.split(ckpt_path)
    return os.path.join(parent, f".{name}.tiering-{move_id}")


def cold_tmp(cold_file: str, move_id: str) -> str:
    d, n = os.path.split(cold_file)
    return os.path.join(d, f".{n}.tiering-{move_id}")


def link_tmp(hot_file: str, move_id: str) -> str:
    d, n = os.path.split(hot_file)
    return os.path.join(d, f".{n}.tiering-link-{move_id}")


def _read_meta_at(dir_fd: int, source: str) -> bytes:
    """The metadata bytes of the checkpoint directory open as ``dir_fd`` (not of whatever the
    path names by now)."""
    try:
        fd = os.open(METADATA_FILE, os.O_RDONLY, dir_fd=dir_fd)
    except FileNotFoundError:
        raise MoveError(f"{source}: no metadata any more (no longer a committed checkpoint); "
                        "not moved") from None
    try:
        size = os.fstat(fd).st_size
        if size > metadata_max_bytes():
            raise MoveError(f"{source}: the metadata file is {size} bytes, over the limit; not moved")
        chunks = []
        while True:
            b = os.read(fd, 1 << 20)
            if not b:
                break
            chunks.append(b)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _place(tmp: str, cold_file: str) -> None:
    """Give ``tmp`` the name ``cold_file``, never replacing a file already there."""
    try:
        os.link(tmp, cold_file, follow_symlinks=False)
    except FileExistsError:
        raise MoveError(f"{cold_file} appeared in the cold tier during the move; not overwritten, move "
                        "aborted, hot copy kept") from None
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOSYS, errno.EMLINK):
            raise
        # A file system without hard links: check and rename (the tier's lock keeps other
        # passes out; only a person writing into the cold tier at this instant could race).
        if os.path.lexists(cold_file):
            raise MoveError(f"{cold_file} appeared in the cold tier during the move; not overwritten, "
                            "move aborted, hot copy kept") from None
        os.rename(tmp, cold_file)
    else:
        os.unlink(tmp)
    fsync_dir(os.path.dirname(cold_file))


def _refuse_foreign_links(ckpt_path: str, todo: list[str], cold_root: str) -> None:
    """A file that is a link, but not into this cold tier, was cooled by a pass given another
    one (two services on one hot tier): copying it again would only orphan that copy, and its
    remap is refused anyway, after the whole copy."""
    for n in todo:
        link = os.path.join(ckpt_path, n)
        if os.path.islink(link):
            raise MoveError(f"{link} links to {os.path.realpath(link)}, outside the cold root {cold_root} "
                            "(cooled by a tiering pass given another cold tier?); not moved. Run one "
                            "service per hot tier, with one cold tier")


def _unlink_logged(path: str) -> bool:
    try:
        os.unlink(path)
    except OSError as exc:
        log.error("tiering: could not remove %s (the next pass's recovery will): %s", path, exc)
        return False
    return True


def _refuse_read_only_hot(ckpt_path: str) -> None:
    """The remap writes in the checkpoint directory and its run directory: on a read-only hot
    tier (or without write permission) refuse before copying a byte, not after the whole copy."""
    for d in (ckpt_path, os.path.dirname(ckpt_path)):
        if not os.access(d, os.W_OK):
            raise MoveError(f"{d} is not writable (a read-only mount, or no write permission): {ckpt_path} "
                            "cannot be remapped to its cold copy; not moved, nothing copied")


class Mover:
    """Moves checkpoints from ``hot_root`` to ``cold_root`` (local directories or mounts)."""

    def __init__(self, hot_root: str, cold_root: str, journal: Journal, on_step: Hook | None = None) -> None:
        self.hot_root, self.cold_root = hot_root, cold_root
        self.journal = journal
        self.on_step = on_step or (lambda step: None)
        self.hot: Storage = open_storage(hot_root)[0]
        self.cold: Storage = open_storage(cold_root)[0]

    def cold_path(self, hot_file: str) -> str:
        return os.path.join(self.cold_root, os.path.relpath(hot_file, self.hot_root))

    def cool(self, ckpt: CheckpointInfo) -> MoveResult:
        """Move every file of ``ckpt`` not yet cold; raises MoveError with the hot copy intact."""
        move_id = uuid.uuid4().hex[:12]
        t0 = time.perf_counter()
        # A refusal ends the span in error too (the failed_ops alert): each one asks for a look.
        with span("tiering.move", checkpoint=ckpt.path, path=ckpt.path, move_id=move_id) as ev:
            real_hot = os.path.realpath(self.hot_root)
            if os.path.islink(ckpt.path) or not inside(os.path.realpath(ckpt.path), real_hot):
                raise MoveError(f"{ckpt.path} is not a directory inside the hot root {self.hot_root}; "
                                "not moved")
            # The remap works inside this very directory: were the path saved over meanwhile
            # (overwrite=True renames the old one aside), the new checkpoint is never touched.
            try:
                dir_fd = os.open(ckpt.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
            except (FileNotFoundError, NotADirectoryError):
                raise MoveError(f"{ckpt.path}: gone since the scan; nothing moved") from None
            try:
                meta, files = self._recheck(ckpt, dir_fd, "the scan", "not moved")
                return self._cool(ckpt, meta, files, move_id, dir_fd, t0, ev)
            finally:
                os.close(dir_fd)

    def _recheck(self, ckpt: CheckpointInfo, dir_fd: int, since: str,
                 outcome: str) -> tuple[CheckpointMetadata, tuple[str, ...]]:
        """The decision was made on the scan: check that the checkpoint open as ``dir_fd`` is
        still the one scanned, and still one that may be moved (not pinned, read, named by
        ``latest``, being saved over). Returns its metadata and files, read through ``dir_fd``."""
        path = ckpt.path
        fresh = self._still_movable(path, since, outcome)
        here, now = os.fstat(dir_fd), os.lstat(path)
        raw = _read_meta_at(dir_fd, path)
        identity = xxhash.xxh3_128_digest(raw)
        if (here.st_dev, here.st_ino) != (now.st_dev, now.st_ino) or fresh.identity != identity \
                or (ckpt.identity and identity != ckpt.identity):
            raise MoveError(f"{path} was replaced by a new save since {since}; {outcome} (the next pass "
                            "decides on the new one)")
        try:
            meta = CheckpointMetadata.from_bytes(raw, source=os.path.join(path, METADATA_FILE))
        except (CheckpointError, ValueError, TypeError) as exc:
            raise MoveError(f"{path}: unreadable metadata ({str(exc)[:200]}); {outcome}") from None
        return meta, fresh.files

    def _still_movable(self, path: str, since: str, outcome: str) -> CheckpointInfo:
        """The checkpoint at ``path``, described afresh; MoveError if it is untouchable now."""
        fresh = describe(path, self.hot_root, self.cold_root)
        why = untouchable_reason(fresh) if fresh is not None else "no longer a checkpoint"
        if why is not None:
            raise MoveError(f"{path}: {why} since {since}; {outcome}")
        assert fresh is not None
        return fresh

    def _refuse_existing_cold(self, ckpt_path: str, todo: list[str]) -> None:
        """Never replace a cold file: one already at a cold path this move would use is the
        cold copy of an earlier checkpoint at this path (removed by ``rm -r``, or saved over),
        which a link inside or outside the hot root may still use."""
        real_cold = os.path.realpath(self.cold_root)
        taken = []
        for n in todo:
            cold_file = self.cold_path(os.path.join(ckpt_path, n))
            if not inside(os.path.realpath(cold_file), real_cold):
                raise MoveError(f"{cold_file} resolves outside the cold root {self.cold_root} (a link in "
                                f"the cold tree?); {ckpt_path} not moved")
            if os.path.lexists(cold_file):
                taken.append(cold_file)
        if not taken:
            return
        users = cold_references(self.hot_root, self.cold_root)
        user = next((users[os.path.realpath(t)][0] for t in taken if users.get(os.path.realpath(t))), None)
        shown = ", ".join(taken[:3]) + (f" and {len(taken) - 3} more" if len(taken) > 3 else "")
        if user is not None:
            why = f"{user} links to it"
        else:
            why = ("left by an earlier checkpoint at this path and reported as an orphan: a copy kept "
                   "outside the hot root (cp -a, a link) may still use it")
        raise MoveError(f"{shown} already in the cold tier ({why}); not overwritten, {ckpt_path} stays "
                        "hot. Delete those cold files once nothing uses them (a copy that links to them "
                        "needs them: make it a real copy first, e.g. cp -rL), then the next pass cools "
                        "this checkpoint")

    def _cool(self, ckpt: CheckpointInfo, meta: CheckpointMetadata, files: tuple[str, ...], move_id: str,
              dir_fd: int, t0: float, ev: Span) -> MoveResult:
        todo = [n for n in files if not is_cold_link(os.path.join(ckpt.path, n), self.cold_root)]
        ev.set(files=len(todo))
        _refuse_read_only_hot(ckpt.path)
        _refuse_foreign_links(ckpt.path, todo, self.cold_root)
        self._refuse_existing_cold(ckpt.path, todo)
        cold_files = [self.cold_path(os.path.join(ckpt.path, n)) for n in todo]
        self.journal.append(move_id, "move", "begin", checkpoint=ckpt.path, files=todo,
                            cold_files=cold_files)
        copied: list[_Copied] = []
        placed: list[_Placed] = []
        try:
            for n in todo:
                copied.append(self._copy(ckpt.path, n, meta, move_id, dir_fd, placed))
                self.on_step("copy")
            self.journal.append(move_id, "move", "copied")
            self.on_step("copied")
            for c in copied:
                self._verify(c, meta)
            self.journal.append(move_id, "move", "verified")
            self.on_step("verified")
            # A reader, a pin or latest may have come while we copied: leave it the hot
            # copy. (A save over the path meanwhile is caught by the remap, file by file.)
            self._still_movable(ckpt.path, "the scan", "not remapped")
            scratch = scratch_dir(ckpt.path, move_id)
            os.makedirs(scratch)  # a hot tier that refuses it aborts here, every hot file untouched
        except BaseException as exc:
            self._abort(move_id, todo, ckpt.path, exc, placed)
            raise
        for c in copied:
            self._remap(c, scratch, move_id, dir_fd)
            self.on_step("remap")
        os.fsync(dir_fd)
        self.journal.append(move_id, "move", "remapped")
        self.on_step("remapped")
        self.journal.append(move_id, "move", "freeing")
        self.on_step("free")
        shutil.rmtree(scratch)
        self.journal.append(move_id, "move", "done")
        moved = sum(c.size for c in copied)
        ev.set(bytes=moved)
        return MoveResult(ckpt.path, len(copied), moved, time.perf_counter() - t0)

    def _copy(self, ckpt_path: str, name: str, meta: CheckpointMetadata, move_id: str,
              dir_fd: int, placed: list[_Placed]) -> _Copied:
        hot_file = os.path.join(ckpt_path, name)
        cold_file = self.cold_path(hot_file)
        tmp = cold_tmp(cold_file, move_id)
        self.cold.makedirs(os.path.dirname(cold_file))
        st = os.stat(name, dir_fd=dir_fd)
        checks = chunk_checks(meta, name) if _is_storage_file(meta, name) else []
        with span("tiering.copy", path=hot_file, bytes=st.st_size):
            writer = self.cold.open_writer(tmp)
            try:
                got = digest(lambda off, n: self.hot.read(hot_file, off, n), st.st_size, checks, writer.write)
            except BaseException:
                abort_quietly(writer)  # a failing abort must not hide why the copy failed
                raise
            writer.commit()
        if got.bad:
            raise MoveError(f"{hot_file}: the hot copy fails the checkpoint's checksums "
                            f"({', '.join(got.bad[:3])}); it was not moved. Run bcp verify on it")
        os.utime(tmp, ns=(st.st_atime_ns, st.st_mtime_ns))  # age policies see the original mtime
        made = os.lstat(tmp)
        # Journaled before it gets its name: recovery deletes a cold file only if it is this inode.
        self.journal.append(move_id, "move", "placing", file=name, cold_file=cold_file,
                            dev=made.st_dev, ino=made.st_ino, size=made.st_size)
        mine = _Placed(cold_file, made.st_dev, made.st_ino)
        try:
            _place(tmp, cold_file)
        finally:
            if mine.still_there():  # named, even if a later step of the placing failed
                placed.append(mine)
        return _Copied(name, hot_file, cold_file, got.xxh3, got.size, st.st_ino)

    def _verify(self, c: _Copied, meta: CheckpointMetadata) -> None:
        size = self.cold.size(c.cold_file)
        stored = _is_storage_file(meta, c.name)
        checks = chunk_checks(meta, c.name) if stored else []
        expected = meta.file(c.name).size if stored else c.size
        with span("tiering.verify", path=c.cold_file, bytes=size):
            if size != expected or size != c.size:
                raise MoveError(f"{c.cold_file}: cold copy is {size} bytes, the hot file {c.size} and the "
                                f"metadata {expected}; move aborted, hot copy kept")
            _drop_cache(c.cold_file)
            got = digest(lambda off, n: self.cold.read(c.cold_file, off, n), size, checks)
        if got.bad or got.xxh3 != c.xxh3 or got.size != size:
            what = f"checksum mismatch ({', '.join(got.bad[:3])})" if got.bad else "differs from the hot file"
            raise MoveError(f"{c.cold_file}: cold copy {what}; move aborted, hot copy kept")

    def _remap(self, c: _Copied, scratch: str, move_id: str, dir_fd: int) -> None:
        kept = os.path.join(scratch, c.name)
        os.link(c.name, kept, src_dir_fd=dir_fd, follow_symlinks=False)
        if os.lstat(kept).st_ino != c.inode:
            raise MoveError(f"{c.hot_file} was replaced during the move; left as it is")
        tmp = os.path.basename(link_tmp(c.hot_file, move_id))
        os.symlink(c.cold_file, tmp, dir_fd=dir_fd)
        os.replace(tmp, c.name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)

    def _abort(self, move_id: str, todo: list[str], ckpt: str, exc: BaseException,
               placed: list[_Placed]) -> None:
        """Remove what this move wrote: its temporary files, and the cold copies it put in
        place (never a cold file that was there before it)."""
        # What cannot be removed now (a cold tier gone read-only) is left to the next pass's
        # recovery, which knows these files by the journal: the move's own error is reported.
        left = 0
        for n in todo:
            tmp = cold_tmp(self.cold_path(os.path.join(ckpt, n)), move_id)
            if os.path.lexists(tmp):
                left += not _unlink_logged(tmp)
        for p in placed:
            if p.still_there():
                left += not _unlink_logged(p.cold_file)
        if left:
            return  # its record stays unfinished: the next pass's recovery removes them
        try:
            self.journal.append(move_id, "move", "aborted", error=f"{type(exc).__name__}: {exc}"[:500])
        except OSError as journal_exc:
            # A full or read-only cold tier: the move's own error is the one to report. Its record
            # stays unfinished, and the next pass's recovery finds nothing left to undo.
            log.error("tiering: move %s aborted (%s); its journal record could not be closed: %s",
                      move_id, exc, journal_exc)


def recover(hot_root: str, cold_root: str, journal: Journal) -> int:
    """Resolve every move and deletion a crash interrupted; return how many. A move record
    that fails the checks of :func:`_move_plan` is skipped, logged, and left unfinished (a later
    pass given the right roots resolves it)."""
    count = 0
    placing: dict[str, dict[str, dict]] = {}
    for r in journal.records():
        if isinstance(r, dict) and r.get("op") == "move" and r.get("state") == "placing" \
                and isinstance(r.get("id"), str) and isinstance(r.get("file"), str):
            placing.setdefault(r["id"], {})[r["file"]] = r
    for rec in journal.unfinished():
        op, rec_id = rec.get("op"), rec.get("id")
        plan: _MovePlan | str | None = None
        if op == "move":
            own = placing.get(rec_id, {}) if isinstance(rec_id, str) else {}
            plan = _move_plan(hot_root, cold_root, rec, own)
            if isinstance(plan, str):
                log.warning("tiering: journal record %r of %s skipped, nothing done: %s", rec_id,
                            str(rec.get("checkpoint"))[:300], plan)
                continue
        try:
            with span("tiering.recover", checkpoint=rec.get("checkpoint"), op=op, move_id=rec_id):
                if isinstance(plan, _MovePlan):
                    _recover_move(hot_root, cold_root, plan)
                elif op == "delete":
                    recover_deletion(hot_root, cold_root, rec)
        except OSError as exc:  # a tier read-only or full for now: left unfinished, tried next pass
            log.error("tiering: %s %r of %s not resolved now, the next pass tries again: %s", op, rec_id,
                      str(rec.get("checkpoint"))[:300], exc)
            continue
        journal.append(rec_id, op, "recovered")
        count += 1
    return count


@dataclass(frozen=True)
class _FilePlan:
    name: str
    hot_file: str  # in the checkpoint directory, as the record names it (checked inside the hot root)
    link_text: str  # what the remap's symlink holds: the cold path as the move wrote it
    cold_file: str  # that path with its directory resolved (checked inside the cold root)
    placed: _Placed | None  # the cold file the move created, when it journaled one


@dataclass(frozen=True)
class _MovePlan:
    ckpt: str
    move_id: str
    scratch: str
    files: list[_FilePlan]


def _move_plan(hot_root: str, cold_root: str, rec: dict, placing: dict[str, dict]) -> _MovePlan | str:
    """What recovering the move ``rec`` may touch, or why it may touch nothing. The journal is a
    file like any other: act only on what a move of ours can have left. The checkpoint must lie
    inside the hot root (real paths) and not be a link, the id must be the mover's, each file a
    plain checkpoint file name, each cold path resolve inside the cold root. Cold paths are the
    ones the move recorded, not recomputed from the roots given now (which may differ)."""
    ckpt, move_id, names = rec.get("checkpoint"), rec.get("id"), rec.get("files")
    real_hot, real_cold = os.path.realpath(hot_root), os.path.realpath(cold_root)
    if not isinstance(move_id, str) or not _MOVE_ID.fullmatch(move_id):
        return f"id {str(move_id)[:40]!r} is not a move id of the mover's"
    if not isinstance(ckpt, str) or not os.path.isabs(ckpt) or ".." in ckpt.split(os.sep) \
            or os.path.basename(ckpt) in ("", ".") or os.path.basename(ckpt).startswith("."):
        return "the checkpoint is not an absolute path to a checkpoint directory"
    if not inside(os.path.realpath(ckpt), real_hot):
        return f"the checkpoint is not inside the hot root {hot_root}"
    if os.path.islink(ckpt):
        return "the checkpoint path is a symlink now"
    scratch = scratch_dir(ckpt, move_id)
    if not inside(os.path.realpath(scratch), real_hot):
        return f"its scratch directory is not inside the hot root {hot_root}"
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        return "its file list is not a list of names"
    recorded = rec.get("cold_files")
    if recorded is not None and (not isinstance(recorded, list) or len(recorded) != len(names)):
        return "its cold paths do not match its file list"
    files = []
    for i, n in enumerate(names):
        try:
            check_file_name(n, "the journal record")
        except CheckpointError:
            return f"file {n[:60]!r} is not a plain checkpoint file name"
        hot_file = os.path.join(ckpt, n)
        # Records written before cold paths were journaled: the path the move computed then.
        link_text = recorded[i] if recorded is not None else \
            os.path.join(cold_root, os.path.relpath(hot_file, hot_root))
        if not isinstance(link_text, str) or not os.path.isabs(link_text) or os.path.basename(link_text) != n:
            return f"the cold path of {n!r} is not an absolute path to a file of that name"
        cold_file = os.path.join(os.path.realpath(os.path.dirname(link_text)), n)
        if not inside(cold_file, real_cold):
            return f"the cold path of {n!r} resolves outside the cold root {cold_root}"
        p = placing.get(n)
        placed = None
        if p is not None and p.get("cold_file") == link_text and type(p.get("dev")) is int \
                and type(p.get("ino")) is int:
            placed = _Placed(cold_file, p["dev"], p["ino"])
        files.append(_FilePlan(n, hot_file, link_text, cold_file, placed))
    return _MovePlan(ckpt, move_id, scratch, files)


def _drop_temporaries(plan: _MovePlan) -> None:
    """Remove the move's temporary names: a remap's link not yet renamed over the hot file, a
    copy not yet named."""
    for f in plan.files:
        tmp_link = link_tmp(f.hot_file, plan.move_id)
        if os.path.islink(tmp_link):
            os.unlink(tmp_link)
        tmp_cold = cold_tmp(f.cold_file, plan.move_id)
        if os.path.lexists(tmp_cold) and not os.path.isdir(tmp_cold):
            os.unlink(tmp_cold)


def _recover_move(hot_root: str, cold_root: str, plan: _MovePlan) -> None:
    _drop_temporaries(plan)
    # Only then: the remap's own temporary link would count as a user of its cold copy, which
    # the roll back would keep as an orphan that blocks the checkpoint's next move.
    users = cold_references(hot_root, cold_root)
    scratch_ok = os.path.isdir(plan.scratch) and not os.path.islink(plan.scratch)
    for f in plan.files:
        hot_copy = os.path.join(plan.scratch, f.name)
        if scratch_ok and os.path.islink(f.hot_file) and not os.path.exists(f.hot_file) \
                and os.path.isfile(hot_copy) and not os.path.islink(hot_copy):
            os.replace(hot_copy, f.hot_file)  # never leave a link pointing nowhere
            continue
        if os.path.islink(f.hot_file) and os.readlink(f.hot_file) == f.link_text:
            continue  # remapped: roll forward (the hot copy is freed below)
        # Copied but never remapped: roll back, deleting the cold copy only if this move created
        # it (the inode it journaled) and no link uses it. A cold file that was there before
        # the move, or that it cannot prove its own, is left (reported as an orphan if unused).
        if f.placed is not None and f.placed.still_there() and os.path.realpath(f.cold_file) not in users:
            os.unlink(f.cold_file)
    if scratch_ok:
        shutil.rmtree(plan.scratch, ignore_errors=True)
    if os.path.isdir(plan.ckpt):
        fsync_dir(plan.ckpt)
