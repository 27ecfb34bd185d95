"""Host-wide write slots: at most N large local files are written to one file system at once.

The ranks of a host each write their own files, two or three each, so a save of 4 ranks ran
8-12 sequential write streams into one disk. A disk that serves a few streams faster than
many (this VM's wrote 2.95 GB/s with 2 streams and 1.89 with 8, ``bench/save_vs_write_limit.py``)
then takes longer for the same bytes. In a save that training waits for
(``Storage.for_waited_writes``; ``BCP_STORAGE_HOST_WRITERS``, default 4), a writer takes a slot
before its first large write and keeps it until its file is durable (after fsync), so the
host writes with N streams while the others wait their turn. Async saves take none: there a
rank whose turn had not come would hold up its own training.

A process takes at most ``per_process`` of them at once: its part of the host's bytes times
N, at least 1. First come, first served, one rank took two slots for its two files while
another rank's files both waited, and the save then lasted as long as that rank's late
writes, the disk left with fewer streams at the end. With slots in proportion to bytes each
rank's bytes go out at about the same pace, so the ranks finish together; an equal share
(one slot per rank of four) held back a rank that wrote four times as much as each of the
others, and its files then went out one at a time once the others were done.

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

from ..errors import InvalidSettingError

SLOTS_DIR_ENV = "BCP_STORAGE_SLOTS_DIR"
MAX_WAIT_S = 120.0
_held = threading.local()  # slots this thread holds: it never waits for another one


class _Count:
    n = 0


class _ProcessShare:
    """The slots this process holds (or is taking) per file system, against its share."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._held: dict[int, int] = {}

    def claim(self, device: int, share: int, deadline: float) -> bool:
        """Count one more slot on ``device``, waiting while the process holds ``share``; False
        at ``deadline`` (the write then goes ahead without a slot)."""
        with self._cond:
            while self._held.get(device, 0) >= share:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            self._held[device] = self._held.get(device, 0) + 1
            return True

    def give_back(self, device: int) -> None:
        with self._cond:
            self._held[device] -= 1
            self._cond.notify_all()


_share = _ProcessShare()


def _new_share_in_child() -> None:
    global _share, _held
    _share = _ProcessShare()  # a forked child holds none of its parent's slots
    _held = threading.local()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_share_in_child)


def _this_thread() -> _Count:
    count = getattr(_held, "count", None)
    if count is None:
        count = _held.count = _Count()
    return count


def slots_dir() -> str:
    return os.environ.get(SLOTS_DIR_ENV, "").strip() or tempfile.gettempdir()


def check_setting() -> None:
    """Called as a save starts: a ``BCP_STORAGE_SLOTS_DIR`` that is no directory is a typo
    that would turn the host's write limit off without a word; it is named instead."""
    raw = os.environ.get(SLOTS_DIR_ENV, "").strip()
    if raw and not os.path.isdir(raw):
        what = "does not exist" if not os.path.lexists(raw) else "is not a directory"
        raise InvalidSettingError(f"{SLOTS_DIR_ENV} = {raw!r} {what}: give a directory every "
                                  "process of the host can write, or unset it (the temporary "
                                  "directory)")


class Slot:
    """A held slot (or none: ``fd`` is None); ``waited_s`` is how long taking it took."""

    def __init__(self, fd: int | None, waited_s: float) -> None:
        self.fd = fd
        self.waited_s = waited_s
        self._taker = _this_thread()  # a writer may be committed on another thread
        # set by ``take`` where the slot counts in this process's share (``per_process``)
        self._device: int | None = None
        self._share = _share
        if fd is not None:
            self._taker.n += 1

    def release(self) -> None:
        if self.fd is not None:
            fd, self.fd = self.fd, None
            self._taker.n -= 1
            os.close(fd)  # closing the description releases its lock
            if self._device is not None:
                self._share.give_back(self._device)


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


def take(target: str, count: int, max_wait_s: float = MAX_WAIT_S, *, per_process: int = 0) -> Slot:
    """One of ``count`` slots of the file system that holds ``target`` (a file being written),
    waiting for one to be free, and, with ``per_process`` >= 1, for this process to hold fewer
    than that many; a slot of none when slots are off (``count`` < 1), when this thread
    already holds one (a writer that opens another before closing the first must not wait
    for itself), or after ``max_wait_s``."""
    if count < 1 or _this_thread().n:
        return Slot(None, 0.0)
    try:
        device = os.stat(os.path.dirname(os.path.abspath(target))).st_dev
    except OSError:
        return Slot(None, 0.0)
    start = time.monotonic()
    share = _share
    if per_process >= 1 and not share.claim(device, per_process, start + max_wait_s):
        return Slot(None, time.monotonic() - start)
    counted = device if per_process >= 1 else None
    slot = Slot(None, 0.0)
    try:
        slot = _take_lock(device, count, start, max_wait_s)
    finally:
        if slot.fd is None and counted is not None:
            share.give_back(counted)  # no lock (or an error): nothing of the share is held
    if slot.fd is not None:
        slot._device, slot._share = counted, share
    return slot


def _take_lock(device: int, count: int, start: float, max_wait_s: float) -> Slot:
    """The flock of a free slot file of ``device`` (polled until ``max_wait_s``)."""
    # Opened once for the whole wait, starting at a slot of this process's own, so that the
    # host's writers spread over the slots instead of all trying the first.
    first = os.getpid() % count
    try:
        directory = slots_dir()
    except OSError:  # no usable temporary directory (full, or no descriptors): write unslotted
        return Slot(None, time.monotonic() - start)
    fds: list[int] = []
    try:
        for i in range(count):
            fd = _open_slot(directory, device, (first + i) % count)
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
