"""Local disk: positional reads and writes, fsync on commit, atomic renames.

Large reads are split into parts read concurrently with ``os.preadv``; a large buffer handed
to a writer is split into parts written concurrently with ``os.pwritev`` at their offsets
(part size and thread count from :mod:`.config`). Large transfers run through a small,
recycled part of the page cache (``writeback``; ``BCP_STORAGE_DROP_BEHIND``), and the aligned
middle of a large write skips it (``direct_io``; ``BCP_STORAGE_DIRECT_WRITES``).
"""

from __future__ import annotations

import copy
import dataclasses
import errno
import math
import os
import shutil
import stat
from collections.abc import Iterator
from fractions import Fraction

from ..errors import NotARegularFileError
from . import direct_io, libc, parallel, write_slots
from .base import CommitMode, Storage, Writer
from .config import TransferSettings, settings
from .writeback import WriteBehind, drop_pages


def fsync_dir(path: str) -> None:
    """Make a directory's entries (a create, rename or unlink in it) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        n = os.pwritev(fd, [data], offset)
        data, offset = data[n:], offset + n


_READ_CALL = 4 << 20

# Bytes read through one descriptor before the next is opened. Along one descriptor's long
# sequential read the kernel's readahead keeps growing, and past about 64 MiB the copy out of
# the page cache got three times dearer here: 4 ranks loading 3.56 GB through 128 or 256 MiB
# per descriptor ran at 1.3-1.4 GB/s with 2.4-2.8 system CPU-s, through 64 MiB at 1.8-2.0
# GB/s with 0.9 (docs/performance/loads.md, "Reads through a fresh descriptor every 64 MiB").
_DESCRIPTOR_BYTES = 64 << 20


def _segments(views: list[memoryview], limit: int) -> Iterator[list[memoryview]]:
    """``views`` in order, cut into consecutive groups of at most ``limit`` bytes (a view
    that crosses a boundary is split there); empty views are left out."""
    group: list[memoryview] = []
    size = 0
    for view in views:
        while len(view):
            take = min(len(view), limit - size)
            group.append(view[:take])
            size += take
            view = view[take:]
            if size == limit:
                yield group
                group, size = [], 0
    if group:
        yield group


_IOV_MAX = 1024  # buffers per preadv call (Linux's UIO_MAXIOV)


def _preadv_all(fd: int, offset: int, views: list[memoryview], drop: bool = False) -> int:
    """Fill ``views`` in order from ``offset``, a few MiB per call; short only at EOF."""
    total, i, skip = 0, 0, 0  # views[i][skip:] is the next byte to fill
    while i < len(views):
        batch, size = [], 0
        j = i
        while j < len(views) and len(batch) < _IOV_MAX and size < _READ_CALL:
            part = views[j][skip:] if j == i else views[j]
            part = part[: _READ_CALL - size]
            batch.append(part)
            size += len(part)
            if len(part) < len(views[j]) - (skip if j == i else 0):
                break  # this view continues in the next call
            j += 1
        n = os.preadv(fd, batch, offset + total)
        if n == 0:
            break
        if drop:
            drop_pages(fd, offset + total, n)
        total += n
        while i < len(views) and n > 0:  # advance past what this call filled
            left = len(views[i]) - skip
            if n >= left:
                n, i, skip = n - left, i + 1, 0
            else:
                skip, n = skip + n, 0
        while i < len(views) and len(views[i]) == 0:
            i += 1
    return total


def _read_sequential(path: str, offset: int, views: list[memoryview], drop: bool) -> int:
    """Fill ``views`` in order from ``offset`` of ``path``: one sequential stream, a fresh
    descriptor every ``_DESCRIPTOR_BYTES``, all of the one file the first opened (a file
    renamed over ``path`` meanwhile is not read); short only at end of file."""
    total = 0
    first = _open_regular(path)
    try:
        for i, group in enumerate(_segments(views, _DESCRIPTOR_BYTES)):
            size = sum(len(v) for v in group)
            fd = first if i == 0 else _reopen(first)
            try:
                os.posix_fadvise(fd, offset + total, size, os.POSIX_FADV_SEQUENTIAL)
                got = _preadv_all(fd, offset + total, group, drop)
            finally:
                if fd != first:
                    os.close(fd)
            total += got
            if got < size:
                break
    finally:
        os.close(first)
    return total


def _reopen(fd: int) -> int:
    """A new descriptor, with readahead state of its own, of the file ``fd`` is open on,
    whatever its path names now; ``fd`` itself where there is no ``/proc`` to reopen it by."""
    try:
        return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return fd


def _refuse_special(path: str, mode: int) -> None:
    """A storage file must be a regular file: a directory is the usual answer, anything else
    (a FIFO would block the open until a writer came) is refused by name."""
    if stat.S_ISDIR(mode):
        raise IsADirectoryError(errno.EISDIR, "is a directory, not a file", path)
    if not stat.S_ISREG(mode):
        kind = ("a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode)
                else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a regular file")
        raise NotARegularFileError(f"{path} is {kind}, not a regular file; refusing to read it "
                                   "(replace it with the file that belongs there)",
                                   op="open", path=path, errno=errno.EINVAL)


def _open_regular(path: str) -> int:
    """Open ``path`` for reading, never blocking on a FIFO, and only if it is a regular file."""
    _refuse_special(path, os.stat(path).st_mode)  # checked before the open: no FIFO is opened
    # O_NONBLOCK as well, should a FIFO be swapped in after the check; no effect on a file.
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        _refuse_special(path, os.fstat(fd).st_mode)
    except BaseException:
        os.close(fd)
        raise
    return fd


WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NONBLOCK
SLOT_MIN_BYTES = 8 << 20  # a file that grows past this waits for a host write slot


class _LocalWriter(Writer):
    def __init__(self, path: str, fsync: bool, transfer: TransferSettings,
                 page_cache_is_copy: bool = True, host_writers: int = 0,
                 slots_per_process: int = 0) -> None:
        self._path = path
        self._fsync = fsync
        self._transfer = transfer
        self._fd = self._open(path)
        st = os.fstat(self._fd)
        if not stat.S_ISREG(st.st_mode):  # a device or FIFO at the path: never write into it
            os.close(self._fd)
            _refuse_special(path, st.st_mode)
        self._identity = (st.st_dev, st.st_ino)
        self._size = 0
        # Without fsync nothing waits for the disk, so there is nothing to overlap.
        self._behind = WriteBehind(self._fd, transfer.write_behind_bytes if fsync else 0,
                                   drop=transfer.drop_behind)
        # Direct writes: what the file needs (None: none), and their descriptor, opened at the
        # first write that can use it.
        self.direct_alignment = (direct_io.alignment(self._fd)
                                 if transfer.direct_writes and page_cache_is_copy else None)
        self._direct_fd: int | None = None
        self.direct_bytes = 0  # written direct so far
        # A host-wide write slot (``write_slots``), taken at the first large write: a small
        # file (metadata, markers) never waits for one.
        self._slots = host_writers
        self._slots_per_process = slots_per_process
        self._slot: write_slots.Slot | None = None
        self.slot_wait_s = 0.0

    def _open(self, path: str) -> int:
        # O_NONBLOCK: a FIFO planted at the path fails the open (ENXIO) instead of blocking it.
        return os.open(path, WRITE_FLAGS, 0o644)

    def write(self, data: memoryview | bytes) -> None:
        mv = memoryview(data).cast("B")
        base = self._size
        if self._slot is None and self._slots and base + len(mv) > SLOT_MIN_BYTES:
            self._slot = write_slots.take(self._path, self._slots, per_process=self._slots_per_process)
            self.slot_wait_s = self._slot.waited_s
        span = self._direct_span(mv, base)
        if span is None:
            self._write_buffered(mv, base)
        else:
            lo, hi = span
            self._write_buffered(mv[:lo], base)
            self._write_direct(mv[lo:hi], base + lo)
            self._write_buffered(mv[hi:], base + hi)
        self._size += len(mv)
        self._behind.advance(self._size)

    def _direct_span(self, mv: memoryview, base: int) -> tuple[int, int] | None:
        if self.direct_alignment is None:
            return None
        span = direct_io.direct_span(mv, base, self.direct_alignment)
        if span is not None and self._direct_fd is None:
            self._direct_fd = direct_io.open_direct(self._fd)
            if self._direct_fd is None:
                self.direct_alignment = None
                return None
        return span

    def _write_parts(self, fd: int, mv: memoryview, base: int) -> None:
        # Positional writes at fixed offsets: a failed call can be repeated as a whole.
        parts = parallel.split(base, len(mv), self._transfer.part_bytes)
        parallel.run_parts(
            [lambda o=o, n=n: _pwrite_all(fd, mv[o - base : o - base + n], o) for o, n in parts],
            self._transfer,
        )

    def _write_buffered(self, mv: memoryview, base: int) -> None:
        if len(mv):
            self._write_parts(self._fd, mv, base)

    def _write_direct(self, mv: memoryview, base: int) -> None:
        """Write ``mv`` (page-aligned in the file, its address aligned) at ``base`` direct; a
        file that refuses gets it through the page cache, and no more direct writes."""
        assert self._direct_fd is not None
        try:
            self._write_parts(self._direct_fd, mv, base)
        except OSError as exc:
            if not direct_io.refused(exc):
                raise
            self.direct_alignment = None  # a refused call wrote nothing: write it all again
            self._write_buffered(mv, base)
            return
        self.direct_bytes += len(mv)

    def commit(self) -> int:
        try:
            self._behind.check()
            if self._fsync:
                # Also what makes the direct writes durable: it flushes the disk's own cache
                # and the file's new size and extents.
                os.fsync(self._fd)
                self._behind.finish()
        finally:
            self._close()
        return self._size

    def _close(self) -> None:
        try:
            if self._direct_fd is not None:
                os.close(self._direct_fd)
                self._direct_fd = None
        finally:
            try:
                os.close(self._fd)
            finally:
                if self._slot is not None:
                    self._slot.release()  # after the fsync: the disk's work is done

    def abort(self) -> None:
        try:
            self._close()
        finally:
            try:
                st = os.lstat(self._path)
                # Only the file this writer wrote: never one that replaced it at the path since.
                if (st.st_dev, st.st_ino) == self._identity:
                    os.unlink(self._path)
            except FileNotFoundError:
                pass


class LocalStorage(Storage):
    scheme = "file"
    commit_mode = CommitMode.RENAME
    buffered_writes = True  # pwrite copies into the page cache
    # A disk file's cached pages are a copy, safe to drop once read; a subclass whose page
    # cache is the data itself (tmpfs) says so.
    page_cache_is_copy = True

    def __init__(self, fsync: bool = True, transfer: TransferSettings | None = None) -> None:
        # fsync is what makes a commit survive a power loss; tests may turn it off.
        self.fsync = fsync
        self.transfer = transfer or settings().transfer
        # Host-wide write slots (``write_slots``): only for writes a caller waits for, where
        # the disk's throughput is all that counts (``for_waited_writes``); 0: none.
        self.host_writers = 0
        self.slots_per_process = 0  # of those, the most one process holds at once; 0: any

    def for_waited_writes(self, share_of_host: Fraction | None = None) -> Storage:
        t = self.transfer
        dup = copy.copy(self)
        dup.transfer = dataclasses.replace(t, direct_writes=t.direct_writes and t.direct_sync_writes)
        dup.host_writers = t.host_writers if self.page_cache_is_copy else 0  # tmpfs has no disk
        # Each writing process holds slots in proportion to its bytes, so the ranks finish
        # together (``write_slots``); an unknown share: no limit.
        dup.slots_per_process = (max(1, math.floor(dup.host_writers * share_of_host))
                                 if dup.host_writers and share_of_host else 0)
        return dup

    def _os_path(self, path: str) -> str:
        """The operating-system path of ``path`` (subclasses map a namespace onto a root)."""
        return path

    def open_writer(self, path: str) -> Writer:
        return _LocalWriter(self._os_path(path), self.fsync, self.transfer, self.page_cache_is_copy,
                            self.host_writers, self.slots_per_process)

    def read_into(self, path: str, offset: int, buffer: memoryview) -> int:
        return self._read_into_os(self._os_path(path), offset, buffer)

    def _read_into_os(self, path: str, offset: int, buffer: memoryview) -> int:
        os.close(_open_regular(path))  # missing or not a file: raises here, before any part runs
        drop = self._drops_reads(len(buffer))

        def read_part(off: int, view: memoryview) -> int:
            # Descriptors of its own per part: the kernel keeps readahead state per open
            # file, and parts sharing one descriptor would reset each other's.
            return _read_sequential(path, off, [view], drop)

        n = parallel.read_parts(read_part, offset, buffer, self.transfer)
        if drop and self.transfer.parallel:
            # A part's readahead may have cached the start of a part already read and dropped.
            fd = _open_regular(path)
            try:
                drop_pages(fd, offset, n)
            finally:
                os.close(fd)
        return n

    def read_into_many(self, path: str, offset: int, buffers: list[memoryview]) -> int:
        # One sequential pass: the kernel's readahead sees one stream, where a read per buffer
        # would open the file again and restart it each time.
        return self._read_many_os(self._os_path(path), offset, buffers)

    def _read_many_os(self, path: str, offset: int, buffers: list[memoryview]) -> int:
        views = [memoryview(b).cast("B") for b in buffers]
        size = sum(len(v) for v in views)
        return _read_sequential(path, offset, views, self._drops_reads(size))

    def _drops_reads(self, size: int) -> bool:
        # Small reads (metadata, headers) may well be read again; tensor bytes are not.
        return self.page_cache_is_copy and self.transfer.drop_behind and size >= _READ_CALL

    def size(self, path: str) -> int:
        path = self._os_path(path)
        st = os.stat(path)
        _refuse_special(path, st.st_mode)
        return st.st_size

    def exists(self, path: str) -> bool:
        # Anything at the path exists, a FIFO included (size() refuses those by name).
        return os.path.exists(self._os_path(path))

    def list_dir(self, path: str) -> list[str]:
        try:
            return sorted(os.listdir(self._os_path(path)))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def is_dir(self, path: str) -> bool:
        return os.path.isdir(self._os_path(path))

    def makedirs(self, path: str) -> None:
        os.makedirs(self._os_path(path), exist_ok=True)

    def rename(self, src: str, dst: str, *, overwrite: bool = False) -> None:
        src, dst = self._os_path(src), self._os_path(dst)
        if overwrite and not os.path.isdir(dst):
            os.replace(src, dst)
        else:
            if os.path.lexists(dst):
                raise FileExistsError(dst)
            os.rename(src, dst)
        if self.fsync:
            fsync_dir(os.path.dirname(os.path.abspath(dst)) or ".")

    def exchange(self, a: str, b: str) -> bool:
        b = self._os_path(b)
        if not libc.exchange(self._os_path(a), b):
            return False
        if self.fsync:
            fsync_dir(os.path.dirname(os.path.abspath(b)) or ".")
        return True

    def delete(self, path: str) -> None:
        path = self._os_path(path)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    def url(self, path: str) -> str:
        return path
