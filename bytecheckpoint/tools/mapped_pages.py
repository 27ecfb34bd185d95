"""Letting go of the pages of a memory-mapped file once they are copied.

``torch.load(mmap=True)`` maps the whole file; every page a conversion copies stays resident
(and counts in the process's RSS) until the mapping closes, so converting a 64 MiB file held
69 MiB under a 16 MiB cap. The pages are clean (nothing writes them), so ``madvise
(MADV_DONTNEED)`` drops them and a later access reads the file again: data never changes.
Only ranges inside a mapping of the named file are ever dropped (on anonymous memory the same
call would zero live data), as ``/proc/self/maps`` lists them; elsewhere this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import sys

_MADV_DONTNEED = 4  # Linux


class MappedFile:
    """The address ranges where this process maps ``path``, read once after it was mapped."""

    def __init__(self, path: str) -> None:
        self.ranges: list[tuple[int, int]] = []
        self._madvise = None
        if not sys.platform.startswith("linux"):
            return
        real = os.path.realpath(path)
        try:
            with open("/proc/self/maps") as f:
                for line in f:
                    fields = line.split(None, 5)
                    if len(fields) == 6 and fields[5].strip() == real:
                        lo, hi = (int(x, 16) for x in fields[0].split("-"))
                        self.ranges.append((lo, hi))
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            self._madvise = libc.madvise
            self._madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        except (OSError, AttributeError):
            self.ranges = []

    def drop(self, addr: int, length: int) -> None:
        """Drop the pages ``[addr, addr + length)`` touches inside the mapping (a page shared
        with bytes still to be read is harmless to drop: it is read again from the file)."""
        if length <= 0 or self._madvise is None:
            return
        page = mmap.PAGESIZE
        lo, hi = addr // page * page, -(-(addr + length) // page) * page
        for start, end in self.ranges:
            a, b = max(lo, start), min(hi, end)
            if a < b:
                self._madvise(a, b - a, _MADV_DONTNEED)
