"""Shared memory (``shm://name/...``): the in-memory flavour that every process on a host sees.

``mem://`` lives inside one process. A multi-process job that checkpoints to memory needs a
namespace its ranks share, so ``shm://`` maps paths onto a directory in the host's
shared-memory file system (tmpfs, ``/dev/shm``; override with ``BCP_SHM_DIR``). The data
lives in RAM and survives the death of a rank, but not a reboot; there is nothing to fsync.

Nothing is ever read, written or deleted outside that directory: ``..`` segments and symbolic
links inside it that resolve outside it are refused by name. The check holds against a link
swapped in after it: each read, write, rename and delete acts through a descriptor of the
directory it touches, opened first and checked for where it really is (``/proc/self/fd``), and
a file is never written through a link. The directory itself must belong to this user and be
closed to others' writes (it is created 0700): anyone else could read or replace what is in it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
from collections.abc import Iterator

from ..errors import InvalidStorageURLError
from . import libc
from .base import CommitMode, Writer
from .local import WRITE_FLAGS, LocalStorage, _LocalWriter, _open_regular

DEFAULT_DIR = "/dev/shm/bytecheckpoint"
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def _fd_path(fd: int) -> str | None:
    """Where the file or directory open on ``fd`` really is; None without ``/proc``."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None


class _ShmWriter(_LocalWriter):
    """Creates its file in a directory already open and checked, never through a link."""

    def __init__(self, dir_fd: int, name: str, url: str, path: str, *args: object) -> None:
        self._dir_fd, self._name, self._url = dir_fd, name, url
        super().__init__(path, *args)  # type: ignore[arg-type]

    def _open(self, path: str) -> int:
        try:
            return os.open(self._name, WRITE_FLAGS | os.O_NOFOLLOW, 0o644, dir_fd=self._dir_fd)
        except OSError as exc:
            if exc.errno != errno.ELOOP:
                raise
            raise InvalidStorageURLError(
                f"{self._url} is a symbolic link; shm:// never writes through one (remove it: what "
                "it points to was not touched)") from None


class SharedMemoryStorage(LocalStorage):
    scheme = "shm"
    commit_mode = CommitMode.RENAME
    page_cache_is_copy = False  # tmpfs: the cached pages are the only copy

    def __init__(self, root: str | None = None) -> None:
        super().__init__(fsync=False)
        self.configured = root or os.environ.get("BCP_SHM_DIR") or DEFAULT_DIR
        self.root = os.path.abspath(self.configured)

    def check_path(self, path: str) -> None:
        # Every process of the host must map shm:// onto the same directory: a relative one
        # would depend on each process's working directory.
        if not os.path.isabs(self.configured):
            raise InvalidStorageURLError(
                f"BCP_SHM_DIR={self.configured!r} is a relative path; give an absolute directory "
                f"such as {DEFAULT_DIR}")
        self._ensure_root()
        self._os_path(path)

    def _ensure_root(self) -> None:
        """Make the root (0700) if missing; refuse one that another user could write to or owns."""
        try:
            os.makedirs(self.root, mode=0o700, exist_ok=True)
            st, link = os.stat(self.root), os.lstat(self.root)
        except OSError as exc:
            raise InvalidStorageURLError(
                f"the shared-memory root {self.root} (BCP_SHM_DIR) is not a directory and cannot "
                f"be made one ({exc.strerror or exc}); set BCP_SHM_DIR to a writable directory "
                f"on tmpfs, such as {DEFAULT_DIR}") from None
        me = os.geteuid()
        owner = st.st_uid
        if owner == me and stat.S_ISLNK(link.st_mode) and link.st_uid not in (me, 0):
            owner = link.st_uid  # whoever owns a link there chooses the directory it names
        if owner != me:
            raise InvalidStorageURLError(
                f"the shared-memory root {self.root} (BCP_SHM_DIR) belongs to uid {owner}, not to "
                f"this user (uid {me}): "
                "its owner could read or replace the checkpoints in it; remove it if it is stale, "
                "or set BCP_SHM_DIR to a directory of your own (it is created 0700)")
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            raise InvalidStorageURLError(
                f"the shared-memory root {self.root} (BCP_SHM_DIR) is writable by group or others "
                f"(mode {stat.S_IMODE(st.st_mode):o}) without the sticky bit: they could replace the "
                f"checkpoints in it; run chmod go-w {self.root}, or set BCP_SHM_DIR to a directory "
                "of your own (it is created 0700)")

    def _os_path(self, path: str, *, follow_last: bool = True) -> str:
        full = os.path.normpath(os.path.join(self.root, path.lstrip("/")))
        if not _inside(full, self.root):
            raise InvalidStorageURLError(f"shm://{path} points outside the shared-memory root {self.root}")
        # A symbolic link inside the root may lead anywhere: where it resolves must be inside
        # the root too, so nothing outside it is written through it or deleted through it.
        # (``follow_last=False``: the entry itself is acted on, never what a link there names.)
        resolved = full if follow_last or full == self.root else os.path.dirname(full)
        if not _inside(os.path.realpath(resolved), os.path.realpath(self.root)):
            raise InvalidStorageURLError(
                f"shm://{path} leads outside the shared-memory root {self.root} through a symbolic "
                "link; remove the link (nothing was read or written through it)")
        return full

    def _check_fd(self, fd: int, path: str) -> None:
        """Refuse ``fd`` unless what it is open on lies inside the root (a link swapped in after
        ``_os_path`` checked the path leads elsewhere)."""
        where = _fd_path(fd)
        if where is not None and not _inside(where, os.path.realpath(self.root)):
            raise InvalidStorageURLError(
                f"shm://{path} leads outside the shared-memory root {self.root} through a symbolic "
                "link; remove the link (nothing was read or written through it)")

    @contextlib.contextmanager
    def _parent(self, path: str) -> Iterator[tuple[int, str, str]]:
        """The directory ``path`` is in, open and checked, and the entry's name in it."""
        full = self._os_path(path, follow_last=False)
        fd = os.open(os.path.dirname(full), _DIR_FLAGS)
        try:
            self._check_fd(fd, path)
            yield fd, os.path.basename(full), full
        finally:
            os.close(fd)

    def _is_root(self, path: str) -> bool:
        return self._os_path(path, follow_last=False) == self.root

    def open_writer(self, path: str) -> Writer:
        if self._is_root(path):
            return super().open_writer(path)  # a directory: refused as one
        with self._parent(path) as (fd, name, full):
            return _ShmWriter(fd, name, self.url(path), full, self.fsync, self.transfer,
                              self.page_cache_is_copy, self.host_writers, self.slots_per_process)

    @contextlib.contextmanager
    def _opened(self, path: str) -> Iterator[str]:
        """A path to the file ``path`` names now, checked to lie inside the root, which stays
        the same file however the names change while it is read."""
        fd = _open_regular(self._os_path(path))
        try:
            self._check_fd(fd, path)
            yield f"/proc/self/fd/{fd}" if _fd_path(fd) is not None else self._os_path(path)
        finally:
            os.close(fd)

    def read_into(self, path: str, offset: int, buffer: memoryview) -> int:
        with self._opened(path) as where:
            return self._read_into_os(where, offset, buffer)

    def read_into_many(self, path: str, offset: int, buffers: list[memoryview]) -> int:
        with self._opened(path) as where:
            return self._read_many_os(where, offset, buffers)

    def makedirs(self, path: str) -> None:
        os.close(self.open_dir(path))

    def open_dir(self, path: str) -> int:
        """A descriptor of the directory ``path`` (made if missing), checked to lie inside the
        root: for those who act in it by name later (the save lock, the ``latest`` pointer's
        temporaries), so a directory swapped for a link meanwhile changes nothing. The caller
        closes it."""
        self._ensure_root()
        rel = os.path.relpath(self._os_path(path, follow_last=False), self.root)
        fd = os.open(self.root, _DIR_FLAGS)
        try:
            self._check_fd(fd, path)
            for part in [] if rel == os.curdir else rel.split(os.sep):  # one level at a time
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, dir_fd=fd)
                try:
                    inner = os.open(part, _DIR_FLAGS, dir_fd=fd)
                except NotADirectoryError:
                    raise FileExistsError(errno.EEXIST, "exists and is not a directory",
                                          self._os_path(path)) from None
                os.close(fd)
                fd = inner
                self._check_fd(fd, path)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def rename(self, src: str, dst: str, *, overwrite: bool = False) -> None:
        if self._is_root(src) or self._is_root(dst):
            return super().rename(src, dst, overwrite=overwrite)
        with self._parent(src) as (sfd, sname, _), self._parent(dst) as (dfd, dname, dfull):
            try:
                is_dir = stat.S_ISDIR(os.stat(dname, dir_fd=dfd).st_mode)
            except FileNotFoundError:
                is_dir = None  # nothing there
            if overwrite and not is_dir:
                os.replace(sname, dname, src_dir_fd=sfd, dst_dir_fd=dfd)
                return
            if is_dir is not None or _lexists(dname, dfd):  # a dangling link is there too
                raise FileExistsError(dfull)
            os.rename(sname, dname, src_dir_fd=sfd, dst_dir_fd=dfd)

    def exchange(self, a: str, b: str) -> bool:
        if self._is_root(a) or self._is_root(b):
            return False
        with self._parent(a) as (afd, aname, _), self._parent(b) as (bfd, bname, _):
            return libc.exchange(aname, bname, a_dir=afd, b_dir=bfd)

    def delete(self, path: str) -> None:
        if self._is_root(path):
            return super().delete(path)
        try:
            with self._parent(path) as (fd, name, _):
                mode = os.lstat(name, dir_fd=fd).st_mode
                if stat.S_ISDIR(mode):
                    shutil.rmtree(name, ignore_errors=True, dir_fd=fd)  # never follows a link
                else:
                    os.unlink(name, dir_fd=fd)  # a link itself, never what it points to
        except FileNotFoundError:
            pass

    def url(self, path: str) -> str:
        return f"shm://{path.lstrip('/')}"


def _lexists(name: str, dir_fd: int) -> bool:
    try:
        os.lstat(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return False
    return True
