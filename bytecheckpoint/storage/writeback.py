"""Keep a large file transfer moving through a small, reused part of the page cache (Linux).

A save writes gigabytes and then fsyncs. Left alone, the kernel holds those pages in the
page cache until the dirty thresholds or the fsync, so the disk idles while the writer fills
memory and the writer idles while the disk drains it. Asking for writeback of each finished
window (``sync_file_range``) overlaps the two.

Dropping the pages once they are on disk (``POSIX_FADV_DONTNEED``) matters as much: a
checkpoint's bytes are not read back by the process that wrote them, and every new
page-cache page must first be allocated. Where memory is handed out lazily (VMs that give
free pages back to their host, memory cgroups near their limit) that allocation, not the
disk, sets the speed: on such a VM one process's 3.56 GB write-and-fsync ran at 0.49 GB/s
plain and at 2.01 GB/s through a recycled window (bench/engine_vs_dcp.py). Large reads
drop what they have consumed for the same reason. Where the calls do not exist (not Linux), this does nothing.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os

from . import libc

SYNC_FILE_RANGE_WAIT_BEFORE = 1
SYNC_FILE_RANGE_WRITE = 2  # start writeback of dirty pages in the range; do not wait
SYNC_FILE_RANGE_WAIT_AFTER = 4
_WRITE_AND_WAIT = SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE | SYNC_FILE_RANGE_WAIT_AFTER
# Errors that mean "this file cannot do it", not "the data did not reach the disk".
_UNSUPPORTED = {errno.ENOSYS, errno.EINVAL, errno.ESPIPE, errno.EOPNOTSUPP}


@functools.lru_cache(maxsize=1)
def _sync_file_range() -> object | None:
    return libc.function("sync_file_range", [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint],
                         ctypes.c_int)


def available() -> bool:
    return _sync_file_range() is not None


def drop_pages(fd: int, offset: int, length: int) -> None:
    """Tell the kernel the clean cached pages of ``[offset, offset + length)`` (0: to the end)
    will not be read again. Advice only: dirty pages stay, and a failure changes nothing."""
    if hasattr(os, "posix_fadvise"):
        try:
            os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass


class WriteBehind:
    """Tracks how much of a file has been handed to writeback; ``advance(size)`` after each
    write starts writeback of every whole window written since the last call.

    With ``drop``, the window before the newest one is waited for and its pages dropped, so
    at most about two windows of the file are in the page cache at any time; ``finish()``
    after the fsync drops the rest."""

    def __init__(self, fd: int, window: int, drop: bool = False) -> None:
        self._fd = fd
        self._window = window
        self._fn = _sync_file_range() if window > 0 else None
        self._drop = drop and self._fn is not None
        self.started = 0  # bytes handed to writeback so far
        self.dropped = 0  # bytes known to be on disk whose pages were dropped
        # A failed wait for writeback; this file can no longer be made whole.
        self.error: OSError | None = None

    def check(self) -> None:
        """Raise the writeback failure seen earlier, if any: a rewrite of the last block would
        not bring back the window that failed, and the fsync would not report it again."""
        if self.error is not None:
            raise self.error

    def advance(self, size: int) -> None:
        self.check()
        if self._fn is None or size - self.started < self._window:
            return
        # A failure here only loses the overlap: the fsync at commit still makes it durable.
        self._fn(self._fd, self.started, size - self.started, SYNC_FILE_RANGE_WRITE)  # type: ignore[operator]
        self.started = size
        if self._drop and self.started - self.dropped >= 2 * self._window:
            self._drop_until(self.started - self._window)  # the newest window stays in flight

    def _drop_until(self, end: int) -> None:
        length = end - self.dropped
        if self._fn(self._fd, self.dropped, length, _WRITE_AND_WAIT) != 0:  # type: ignore[operator]
            code = ctypes.get_errno()
            if code in _UNSUPPORTED:
                self._drop = False
                return
            # Waiting consumed the file's writeback error, so a later fsync would not see it.
            self.error = OSError(code, f"writing back bytes {self.dropped}..{end}: {os.strerror(code)}")
            raise self.error
        drop_pages(self._fd, self.dropped, length)
        self.dropped = end

    def finish(self) -> None:
        """After the fsync: every byte is on disk; drop what is still cached."""
        if self._drop:
            drop_pages(self._fd, 0, 0)
