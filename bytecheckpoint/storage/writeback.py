"""Start the kernel's writeback of a file's dirty pages early (Linux ``sync_file_range``).

A save writes gigabytes and then fsyncs. Left alone, the kernel holds those pages in the
page cache until the dirty thresholds or the fsync, so the disk idles while the writer fills
memory and the writer idles while the disk drains it. Asking for writeback of each finished
window overlaps the two. Where the call does not exist (not Linux), this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys

SYNC_FILE_RANGE_WRITE = 2  # start writeback of dirty pages in the range; do not wait


@functools.lru_cache(maxsize=1)
def _sync_file_range() -> object | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def available() -> bool:
    return _sync_file_range() is not None


class WriteBehind:
    """Tracks how much of a file has been handed to writeback; ``advance(size)`` after each
    write starts writeback of every whole window written since the last call."""

    def __init__(self, fd: int, window: int) -> None:
        self._fd = fd
        self._window = window
        self._fn = _sync_file_range() if window > 0 else None
        self.started = 0  # bytes handed to writeback so far

    def advance(self, size: int) -> None:
        if self._fn is None or size - self.started < self._window:
            return
        # A failure here only loses the overlap: the fsync at commit still makes it durable.
        self._fn(self._fd, self.started, size - self.started, SYNC_FILE_RANGE_WRITE)  # type: ignore[operator]
        self.started = size
