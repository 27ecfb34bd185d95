"""Host-wide write slots: at most N large local files are written to one file system at once.

The ranks of a host each write their own files, two or three each, so a save of 4 ranks ran
8-12 sequential write streams into one disk. A disk that serves a few streams faster than
many (this VM's wrote 2.95 GB/s with 2 streams and 1.89 with 8, ``bench/save_vs_write_limit.py``)
then takes longer for the same bytes. In a save that training waits for
(``Storage.for_waited_writes``; ``BCP_STORAGE_HOST_WRITERS``, default 4), a writer takes a slot
before its first large write and keeps it until its file is durable (after fsync), so the
host writes with N streams while the others wait their turn. Async saves take none: there a
rank whose turn had not come would hold up its own training.

Slots are ``flock`` locks on N files per file system (``st_dev``) in a directory every
process of the host sees (``BCP_STORAGE_SLOTS_DIR``, default the temporary directory). A
lock belongs to an open file description, so two threads of one process exclude each other
too, and the kernel releases it when the process dies: a crashed rank never keeps a slot.
Slot files are per user (mode 0600; no other user can hold them), and nothing planted at
their paths is followed or waited on. Slots only ever delay a write; whatever goes wrong with
them (a directory that cannot be written, a holder that never lets go), the write goes ahead
without one, at the latest after ``max_wait_s``.
"""

from __future__ import annotations

import fcntl
import os
import stat
import tempfile
import threading
import time

SLOTS_DIR_ENV = "BCP_STORAGE_SLOTS_DIR"
MAX_WAIT_S = 120.0
_held = threading.local()  # slots this thread holds: it never waits for another one


class _Count:
    n = 0


def _this_thread() -> _Count:
    count = getattr(_held, "count", None)
    if count is None:
        count = _held.count = _Count()
    return count


def slots_dir() -> str:
    return os.environ.get(SLOTS_DIR_ENV, "").strip() or tempfile.gettempdir()


class Slot:
    """A held slot (or none: ``fd`` is None); ``waited_s`` is how long taking it took."""

    def __init__(self, fd: int | None, waited_s: float) -> None:
        self.fd = fd
        self.waited_s = waited_s
        self._taker = _this_thread()  # a writer may be committed on another thread
        if fd is not None:
            self._taker.n += 1

    def release(self) -> None:
        if self.fd is not None:
            fd, self.fd = self.fd, None
            self._taker.n -= 1
            os.close(fd)  # closing the description releases its lock


def _open_slot(directory: str, device: int, index: int) -> int | None:
    """The descriptor of one slot file, or None where there is none to use. The files are a
    user's own (a shared temporary directory must not let another user hold this user's
    slots); a symlink or a FIFO planted at the path is neither followed nor waited on."""
    path = os.path.join(directory, f"bcp-write-slot-{os.getuid()}-{device:x}-{index}")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK,
                     0o600)
    except OSError:
        return None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    return fd


def take(target: str, count: int, max_wait_s: float = MAX_WAIT_S) -> Slot:
    """One of ``count`` slots of the file system that holds ``target`` (a file being written),
    waiting for one to be free; a slot of none when slots are off (``count`` < 1), when this
    thread already holds one (a writer that opens another before closing the first must not
    wait for itself), or after ``max_wait_s``."""
    if count < 1 or _this_thread().n:
        return Slot(None, 0.0)
    try:
        device = os.stat(os.path.dirname(os.path.abspath(target))).st_dev
    except OSError:
        return Slot(None, 0.0)
    start = time.monotonic()
    # Opened once for the whole wait, starting at a slot of this process's own, so that the
    # host's writers spread over the slots instead of all trying the first.
    first = os.getpid() % count
    fds: list[int] = []
    try:
        for i in range(count):
            fd = _open_slot(slots_dir(), device, (first + i) % count)
            if fd is None:
                return Slot(None, time.monotonic() - start)
            fds.append(fd)
        pause = 0.001
        while True:
            for fd in fds:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    continue
                fds.remove(fd)  # kept: the caller's slot
                return Slot(fd, time.monotonic() - start)
            if time.monotonic() - start >= max_wait_s:
                return Slot(None, time.monotonic() - start)
            time.sleep(pause)
            pause = min(pause * 2, 0.01)
    finally:
        for fd in fds:
            os.close(fd)
