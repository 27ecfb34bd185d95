"""Moving one checkpoint to the cold tier, and resolving moves a crash interrupted.

Per checkpoint, each phase over all of its files before the next one starts:

1. copy     hot file -> ``<cold>/<rel>/.<file>.tiering-<id>`` through the storage layer (retries,
            I/O events, injectable faults), checking the checkpoint's checksums on the way;
            fsync; rename to ``<cold>/<rel>/<file>``.
2. verify   read the cold copy back (its cached pages dropped first): size, whole-file hash
            equal to the hot original's, every checksum of the metadata. Any mismatch aborts
            the move: cold copies deleted, hot files untouched.
3. remap    hard-link the hot file into ``<run>/.<name>.tiering-<id>/`` (the hot copy, kept
            until step 4), then ``rename(2)`` a symlink to the cold copy over the hot path:
            one atomic, metadata-only step. A reader that opened the file before keeps its
            descriptor on the hot copy; any open after it follows the link.
4. free     delete ``.<name>.tiering-<id>/``; the hot blocks go once the last reader closes.

Every phase is journaled first. Whatever moment a crash hits, each hot path is either the
original file or a link to a complete, verified copy, so the checkpoint always loads;
:func:`recover` then rolls unremapped files back (deleting their cold copies) and remapped
ones forward (freeing the hot copies). The metadata file moves last.
"""

from __future__ import annotations

import os
import posixpath
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from bytecheckpoint.commit.leases import is_being_read, is_pinned
from bytecheckpoint.format.metadata import CheckpointMetadata
from bytecheckpoint.manage.catalog import CheckpointInfo, cold_references, is_cold_link, read_meta
from bytecheckpoint.manage.deletion import recover_deletion
from bytecheckpoint.manage.journal import Journal
from bytecheckpoint.storage import Storage, open_storage
from bytecheckpoint.storage.base import abort_quietly
from bytecheckpoint.storage.local import LocalStorage, fsync_dir
from telemetry import span

from .verify import chunk_checks, digest

Hook = Callable[[str], None]
_LEASES = LocalStorage(fsync=False)


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
        # The remap works inside this very directory: were the path saved over meanwhile
        # (overwrite=True renames the old one aside), the new checkpoint is never touched.
        dir_fd = os.open(ckpt.path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            return self._cool(ckpt, move_id, dir_fd, t0)
        finally:
            os.close(dir_fd)

    def _cool(self, ckpt: CheckpointInfo, move_id: str, dir_fd: int, t0: float) -> MoveResult:
        meta = read_meta(ckpt.path)
        todo = [n for n in ckpt.files if not is_cold_link(os.path.join(ckpt.path, n), self.cold_root)]
        with span("tiering.move", checkpoint=ckpt.path, path=ckpt.path, files=len(todo),
                  move_id=move_id) as ev:
            self.journal.append(move_id, "move", "begin", checkpoint=ckpt.path, files=todo)
            copied: list[_Copied] = []
            try:
                for n in todo:
                    copied.append(self._copy(ckpt.path, n, meta, move_id, dir_fd))
                    self.on_step("copy")
                self.journal.append(move_id, "move", "copied")
                self.on_step("copied")
                for c in copied:
                    self._verify(c, meta)
                self.journal.append(move_id, "move", "verified")
                self.on_step("verified")
                # A reader may have arrived while we copied: leave it the hot copy.
                if is_pinned(_LEASES, ckpt.path) or is_being_read(_LEASES, ckpt.path):
                    raise MoveError(f"{ckpt.path}: pinned or being read since the scan; not remapped")
            except BaseException as exc:
                self._abort(move_id, todo, ckpt.path, exc, [c.cold_file for c in copied])
                raise
            scratch = scratch_dir(ckpt.path, move_id)
            os.makedirs(scratch)
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
              dir_fd: int) -> _Copied:
        hot_file = os.path.join(ckpt_path, name)
        cold_file = self.cold_path(hot_file)
        tmp = cold_tmp(cold_file, move_id)
        if os.path.lexists(cold_file):
            # Left by an earlier checkpoint at this path: replaced only when no hot link uses it
            # (a copy made with cp -a links to its original's cold files).
            users = cold_references(self.hot_root, self.cold_root).get(os.path.realpath(cold_file))
            if users:
                raise MoveError(f"{cold_file} already exists and {users[0]} links to it; not "
                                "overwritten. Move that copy's data or remove it, then cool again")
        self.cold.makedirs(posixpath.dirname(cold_file))
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
        self.cold.rename(tmp, cold_file, overwrite=True)
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

    def _abort(self, move_id: str, todo: list[str], ckpt: str, exc: BaseException, placed: list[str]) -> None:
        """Remove what this move wrote: its temporary files, and the cold copies it put in
        place (never a cold file that was there before it)."""
        for n in todo:
            tmp = cold_tmp(self.cold_path(os.path.join(ckpt, n)), move_id)
            if os.path.lexists(tmp):
                os.unlink(tmp)
        for cold_file in placed:
            if os.path.lexists(cold_file):
                os.unlink(cold_file)
        self.journal.append(move_id, "move", "aborted", error=f"{type(exc).__name__}: {exc}"[:500])


def recover(hot_root: str, cold_root: str, journal: Journal) -> int:
    """Resolve every move and deletion a crash interrupted; return how many."""
    count = 0
    for rec in journal.unfinished():
        with span("tiering.recover", checkpoint=rec.get("checkpoint"), op=rec["op"], move_id=rec["id"]):
            if rec["op"] == "move":
                _recover_move(hot_root, cold_root, rec)
            elif rec["op"] == "delete":
                recover_deletion(hot_root, cold_root, rec)
        journal.append(rec["id"], rec["op"], "recovered")
        count += 1
    return count


def _recover_move(hot_root: str, cold_root: str, rec: dict) -> None:
    ckpt, move_id = rec["checkpoint"], rec["id"]
    scratch = scratch_dir(ckpt, move_id)
    for n in rec["files"]:
        hot_file = os.path.join(ckpt, n)
        cold_file = os.path.join(cold_root, os.path.relpath(hot_file, hot_root))
        hot_copy = os.path.join(scratch, n)
        if os.path.lexists(link_tmp(hot_file, move_id)):
            os.unlink(link_tmp(hot_file, move_id))
        if os.path.lexists(cold_tmp(cold_file, move_id)):
            os.unlink(cold_tmp(cold_file, move_id))
        if os.path.islink(hot_file) and os.readlink(hot_file) == cold_file:
            if not os.path.exists(cold_file) and os.path.exists(hot_copy):
                os.replace(hot_copy, hot_file)  # never leave a link pointing nowhere
            continue  # remapped: roll forward (the hot copy is freed below)
        if (os.path.lexists(cold_file) and not os.path.islink(hot_file)
                and os.path.realpath(cold_file) not in cold_references(hot_root, cold_root)):
            os.unlink(cold_file)  # copied but never remapped, and no link uses it: roll back
    shutil.rmtree(scratch, ignore_errors=True)
    if os.path.isdir(ckpt):
        fsync_dir(ckpt)
