"""Writing the bulk of a large buffer with ``O_DIRECT``: the disk reads it from the caller's memory.

A buffered write copies every byte into the page cache, and that copy (with the allocation of
each cache page) is most of a save's CPU time: 4 processes writing 0.9 GB each of tensor memory,
hashed and fsynced, spent 2.5 system CPU-seconds through the page cache and 0.2 direct. On a
2-core host shared with training, each of those seconds is taken from training.

``O_DIRECT`` needs the memory address, the file offset and the length aligned. The kernel says
what this file needs (``statx`` with ``STATX_DIOALIGN``, Linux 6.1+): a memory alignment (512
bytes on most disks) and an offset alignment. A buffer whose address is congruent to its file
offset modulo the memory alignment has an aligned middle that starts and ends on page
boundaries of the file; that middle is written direct, its head and tail (less than a page
each) through the page cache. Storage files place their large pieces so (``engine.files``).

Where the kernel reports nothing (other systems, tmpfs, older kernels) nothing is written
direct. A direct write the file refuses (``EINVAL``) is written again through the page cache
and ends direct writes for that file: nothing depends on them but speed.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import struct
from dataclasses import dataclass

import numpy as np

from . import libc

_AT_EMPTY_PATH = 0x1000
_STATX_DIOALIGN = 0x2000
_STATX_SIZE = 256  # struct statx, with room to spare
_DIOALIGN_AT = 152  # offset of stx_dio_mem_align, then stx_dio_offset_align (u32 each)

# The largest memory alignment a file may ask for: storage files pad a large piece by less than
# this to put it where its bytes lie in memory (format version 4 allows such padding).
MAX_ALIGN = 4096
# The page size the direct middle of a buffer starts and ends on, so that no page of the file is
# both in the page cache (a head or a tail) and written direct.
PAGE = 4096
# A direct write waits for the disk; below this the copy through the page cache costs less.
MIN_DIRECT_BYTES = 1 << 20


@dataclass(frozen=True)
class Alignment:
    """What ``O_DIRECT`` on one file needs: ``memory`` for buffer addresses, ``offset`` for file
    offsets and lengths."""

    memory: int
    offset: int

    @property
    def step(self) -> int:
        """The boundary a direct range of the file starts and ends on."""
        return max(self.offset, PAGE)


@functools.lru_cache(maxsize=1)
def _statx() -> object | None:
    # statx(dirfd, path, flags, mask, struct statx *)
    args = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_uint, ctypes.c_char_p]
    return libc.function("statx", args, ctypes.c_int)


def alignment(fd: int) -> Alignment | None:
    """What direct writes to the open file ``fd`` need, or None where the kernel does not say
    (or asks for more than ``MAX_ALIGN``)."""
    fn = _statx()
    if fn is None:
        return None
    buf = ctypes.create_string_buffer(_STATX_SIZE)
    if fn(fd, b"", _AT_EMPTY_PATH, _STATX_DIOALIGN, buf) != 0:  # type: ignore[operator]
        return None
    (mask,) = struct.unpack_from("<I", buf, 0)
    memory, offset = struct.unpack_from("<II", buf, _DIOALIGN_AT)
    if not mask & _STATX_DIOALIGN or not memory or not offset:
        return None  # the file cannot do direct I/O (tmpfs, for one)
    if memory > MAX_ALIGN or offset > MAX_ALIGN or memory & (memory - 1) or offset & (offset - 1):
        return None
    return Alignment(memory, offset)


def open_direct(fd: int) -> int | None:
    """A second descriptor of the file open as ``fd`` (reopened through ``/proc``, so never a
    file renamed over the path since), writing with ``O_DIRECT``; None where that fails."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    try:
        direct = os.open(f"/proc/self/fd/{fd}", os.O_WRONLY | flag)
    except OSError:
        return None
    a, b = os.fstat(fd), os.fstat(direct)
    if (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino):
        os.close(direct)
        return None
    return direct


def address(view: memoryview) -> int:
    """Where the first byte of ``view`` lies in memory (a C-contiguous byte view)."""
    return int(np.frombuffer(view, dtype=np.uint8).__array_interface__["data"][0])


def direct_span(view: memoryview, offset: int, align: Alignment) -> tuple[int, int] | None:
    """The part ``[lo, hi)`` of ``view`` (to be written at file ``offset``) that can be written
    direct: from the first page boundary of the file to the last, when the view's address is
    congruent to ``offset`` modulo the memory alignment and the part is worth it."""
    n = len(view)
    if n < MIN_DIRECT_BYTES or (address(view) - offset) % align.memory:
        return None
    lo = -offset % align.step
    hi = lo + (n - lo) // align.step * align.step
    return (lo, hi) if hi - lo >= MIN_DIRECT_BYTES else None


def refused(exc: OSError) -> bool:
    """Whether a direct write failed because the file refuses it (nothing was written), not
    because the disk failed."""
    return exc.errno in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP)
