"""The write-ahead spool: append-only JSON-lines segment files that events reach before anything else.

Layout of one spool directory::

    events-{host}-{pid}-{seq:05d}.jsonl    a segment: one JSON event per line, written by one process
    events-...jsonl.acked                  (Kafka) byte offset the broker acknowledged, as text

A process appends to its own open segment with one ``write()`` per event, so an event is
accepted once it is in the OS page cache: a SIGKILL right after loses nothing, and an fsync
policy (``BCP_TELEMETRY_FSYNC``) sets what a power loss may lose. A segment is rotated by
size and then *sealed*: closed and made read-only, the sign for readers (the ingester, the
Kafka shipper) that nothing more will be appended, so once they have durably passed it on
they may delete it. A segment of a dead process on this host counts as sealed too.

What the counters promise: ``SegmentLog.appended`` counts lines that reached a linked file
whole. A write cut short (disk full, RLIMIT_FSIZE) is cut back off the file, so the next line
never lands on a fragment. If the spool directory or the open segment is deleted under the
process, ``sync()`` notices (by ``fstat``: no links left, or the path now names another file
or nothing), starts a new segment (recreating the directory) and moves the lines appended
since the previous check from ``appended`` to ``lost`` (reported through ``on_lost``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import socket
import stat
import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger("telemetry.spool")

FSYNC_POLICIES = ("interval", "always", "never")
DEFAULT_FSYNC = "interval"
# A line is one event; far larger than any span makes, small enough to ship as one message.
MAX_LINE_BYTES = 256 * 1024
SEGMENT_GLOB = "*.jsonl"
# Every this many appends the appending thread checks (one fstat) that the open segment still
# has a link, so a deleted spool directory costs at most this many events before sync() runs.
CHECK_EVERY = 64
ACKED_SUFFIX = ".acked"
_SEGMENT = re.compile(r"^(?:claimed-(?P<chost>.+?)-(?P<cpid>\d+)-)?"
                      r"(?P<original>events-(?P<host>.+)-(?P<pid>\d+)-(?P<seq>\d+)\.jsonl)$")
_UNSAFE_CHARS = re.compile(r"[^A-Za-z0-9._-]")
# Built once: json.dumps() with keyword options constructs a new encoder per call.
# default=str is a last resort for events that did not come through span().
_ENCODER = json.JSONEncoder(separators=(",", ":"), default=str)


class LineTooLongError(ValueError):
    """An event whose JSON line is over MAX_LINE_BYTES: it is refused (and counted as dropped)."""


def safe_component(text: str) -> str:
    return _UNSAFE_CHARS.sub("_", text) or "unknown"


def encode_line(event: dict[str, Any]) -> bytes:
    line = (_ENCODER.encode(event) + "\n").encode("utf-8", "backslashreplace")
    if len(line) > MAX_LINE_BYTES:
        raise LineTooLongError(f"telemetry event {event.get('name')!r} is {len(line)} bytes as JSON, over "
                               f"the {MAX_LINE_BYTES}-byte line limit; keep span fields small")
    return line


def parse_name(name: str) -> dict[str, Any] | None:
    """host, pid, seq, original name and (for a claimed file) the claiming pid; None if foreign."""
    match = _SEGMENT.match(name)
    if match is None:
        return None
    owner = int(match["cpid"]) if match["cpid"] else int(match["pid"])
    return {"host": match["chost"] or match["host"], "pid": owner, "seq": int(match["seq"]),
            "original": match["original"], "writer_pid": int(match["pid"])}


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def this_host() -> str:
    return safe_component(socket.gethostname())


def is_sealed(path: Path, st: os.stat_result | None = None) -> bool:
    """Nothing more will be appended to ``path``: it was sealed, or its writer (here) is dead."""
    try:
        st = st or path.stat()
    except OSError:
        return True
    if not st.st_mode & stat.S_IWUSR:
        return True
    info = parse_name(path.name)
    return info is not None and info["host"] == this_host() and info["writer_pid"] != os.getpid() \
        and not pid_alive(info["writer_pid"])


def segments(directory: Path) -> list[Path]:
    """Segment files, oldest first (by writer, then sequence; foreign names last by name)."""
    if not directory.is_dir():
        return []

    def key(path: Path) -> tuple[Any, ...]:
        info = parse_name(path.name)
        if info is None:
            return (1, path.name, 0, 0)
        original = parse_name(info["original"]) or info
        return (0, original["host"], original["writer_pid"], original["seq"])

    return sorted(directory.glob(SEGMENT_GLOB), key=key)


def count_lines(path: Path, start: int = 0) -> int:
    """Complete lines in ``path`` from byte ``start`` on (what dropping the file would lose)."""
    count = 0
    with contextlib.suppress(OSError), open(path, "rb") as handle:
        handle.seek(start)
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            count += chunk.count(b"\n")
    return count


def read_acked(segment: Path) -> int:
    """The acknowledged offset of ``segment`` (by its original name); 0 when unknown or garbled."""
    info = parse_name(segment.name)
    path = segment.with_name((info["original"] if info else segment.name) + ACKED_SUFFIX)
    try:
        value = int(path.read_text().strip() or 0)
    except (OSError, ValueError):
        return 0
    return max(0, value)


def write_acked(segment: Path, offset: int) -> None:
    """Record ``offset`` atomically (a torn cursor would only resend, but must never skip)."""
    info = parse_name(segment.name)
    path = segment.with_name((info["original"] if info else segment.name) + ACKED_SUFFIX)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(str(offset))
    os.replace(tmp, path)


def remove_segment(segment: Path) -> bool:
    """Delete a segment and its cursor: the cursor first, so a crash in between only resends."""
    info = parse_name(segment.name)
    cursor = segment.with_name((info["original"] if info else segment.name) + ACKED_SUFFIX)
    with contextlib.suppress(OSError):
        cursor.unlink()
    try:
        segment.unlink()
    except FileNotFoundError:
        return False
    return True


def seal_file(path: Path) -> None:
    with contextlib.suppress(OSError):
        os.chmod(path, stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH)


_LOGS: weakref.WeakSet[SegmentLog] = weakref.WeakSet()


class SegmentLog:
    """This process's append side of a spool directory.

    ``append`` may be called from any thread and costs one ``write()``; ``sync`` (fsync in
    groups, close rotated files) is for one background thread. Rotated files are handed to
    ``sync`` rather than fsync'd in the caller, so no emitting thread ever waits on the disk.
    """

    def __init__(self, directory: str | os.PathLike[str], segment_bytes: int, fsync: str = DEFAULT_FSYNC,
                 host: str | None = None) -> None:
        if segment_bytes <= 0:
            raise ValueError("segment_bytes must be positive")
        if fsync not in FSYNC_POLICIES:
            raise ValueError(f"unknown fsync policy {fsync!r}; use one of {', '.join(FSYNC_POLICIES)}")
        self.directory = Path(directory)
        self.segment_bytes = segment_bytes
        self.fsync = fsync
        self._host = safe_component(host) if host else this_host()
        # Told how many lines were lost after they had been counted appended (their file was
        # deleted before they were checked); the emitter moves them from written to dropped.
        self.on_lost: Callable[[int], None] | None = None
        self._warned_lost = False
        self._init_process()
        _LOGS.add(self)

    def _init_process(self) -> None:
        # Everything per process: a forked child starts its own series of files.
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._seq = 0
        self._fd = -1
        self._path: Path | None = None
        self._size = 0
        self._dirty = False
        # Lines appended to the open segment since a check last found it linked at its path.
        self._unchecked = 0
        # (fd, path, unchecked lines) waiting for a check, fsync, close and seal.
        self._rotated: list[tuple[int, Path, int]] = []
        self.appended = 0
        self.lost = 0  # lines counted appended, then found in a file deleted under us

    @property
    def current_path(self) -> Path | None:
        return self._path

    def _open_next(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        while True:
            name = f"events-{self._host}-{self._pid}-{self._seq:05d}.jsonl"
            self._seq += 1
            path = self.directory / name
            try:
                # Exclusive create: a reused pid must never append to an earlier process's file.
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC, 0o644)
            except FileExistsError:
                continue
            # A cursor left by a deleted namesake would make readers skip this file's start.
            with contextlib.suppress(OSError):
                path.with_name(name + ACKED_SUFFIX).unlink()
            self._fd, self._path, self._size = fd, path, 0
            return

    def append(self, line: bytes) -> None:
        """Write one encoded line (see ``encode_line``); raises OSError if the disk refuses it.

        A line is all or nothing: when the write is cut short (or the ``always`` fsync fails)
        what reached the file is cut off again before the error is raised."""
        with self._lock:
            if self._unchecked >= CHECK_EVERY:
                self._check_linked_locked()
            if self._fd < 0:
                self._open_next()
            start = self._size
            view = memoryview(line)
            try:
                while view:
                    written = os.write(self._fd, view)
                    if written <= 0:
                        raise OSError(f"short write to {self._path}")
                    view = view[written:]
                if self.fsync == "always":
                    os.fsync(self._fd)
            except BaseException:
                if len(view) < len(line):  # some of it reached the file
                    self._cut_back_locked(start)
                raise
            self._size += len(line)
            self._unchecked += 1
            self.appended += 1
            self._dirty = self.fsync != "always"
            if self._size >= self.segment_bytes:
                self._rotate_locked()

    def _cut_back_locked(self, start: int) -> None:
        """Remove a partly written line, so the next line does not continue the fragment."""
        try:
            os.ftruncate(self._fd, start)
        except OSError:
            # The fragment stays: make it the torn last line of a sealed file (readers skip
            # that) and start the next line in a new segment.
            log.warning("telemetry: could not cut a partly written event off %s; starting a new segment",
                        self._path)
            self._rotate_locked()

    def _rotate_locked(self) -> None:
        if self._fd >= 0:
            self._rotated.append((self._fd, self._path, self._unchecked))  # type: ignore[arg-type]
        self._fd, self._path, self._size, self._dirty, self._unchecked = -1, None, 0, False, 0

    def _check_linked_locked(self) -> None:
        try:
            linked = os.fstat(self._fd).st_nlink > 0
        except OSError:
            return
        if linked:
            self._unchecked = 0
        else:
            self._rotate_locked()  # sync() counts the unchecked lines lost

    def _check_open_locked(self) -> None:
        """Start a new segment if the open one was deleted or replaced under us (``rm -rf`` of
        the spool directory): appends would otherwise go on into a file nobody can read."""
        if self._fd < 0:
            return
        try:
            st = os.fstat(self._fd)
        except OSError:
            return
        if st.st_nlink:
            try:
                here = os.stat(self._path)  # type: ignore[arg-type]
            except (FileNotFoundError, NotADirectoryError):
                here = None  # moved away with its directory, say: it still exists, elsewhere
            except OSError:
                return  # e.g. no permission to look: the descriptor still works
            if here is not None and (here.st_dev, here.st_ino) == (st.st_dev, st.st_ino):
                self._unchecked = 0  # every line so far is in a file readers can find
                return
        # Rotated with its unchecked count: _close_files counts them lost if no link is left.
        self._rotate_locked()

    def rotate(self) -> None:
        """Seal the open segment now (the next append opens a new one)."""
        with self._lock:
            self._rotate_locked()

    def sync(self) -> None:
        """fsync what was appended since the last call (policy permitting); seal rotated files;
        start a new segment if the open one was deleted (see ``_check_open_locked``)."""
        with self._lock:
            self._check_open_locked()
            fd = self._fd if self._dirty and self.fsync != "never" else -1
            self._dirty = False
            rotated, self._rotated = self._rotated, []
        if fd >= 0:
            # Outside the lock: appends go on while the disk catches up. Only sync() and
            # close() close descriptors, and they never run at the same time.
            with contextlib.suppress(OSError):
                os.fsync(fd)
        self._close_files(rotated)

    def _close_files(self, files: list[tuple[int, Path, int]]) -> None:
        lost = 0
        gone: Path | None = None
        for fd, path, unchecked in files:
            try:
                deleted = os.fstat(fd).st_nlink == 0
            except OSError:
                deleted = False
            try:
                if self.fsync != "never" and not deleted:
                    os.fsync(fd)
            except OSError:
                pass
            finally:
                if not deleted:
                    # By descriptor: the path may name another file by now, or nothing.
                    with contextlib.suppress(OSError):
                        os.fchmod(fd, stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH)
                os.close(fd)
            if deleted and unchecked:
                lost += unchecked
                gone = path
        if lost:
            self._count_lost(lost, gone)  # type: ignore[arg-type]

    def _count_lost(self, lost: int, path: Path) -> None:
        with self._lock:
            self.appended -= lost
            self.lost += lost
        if not self._warned_lost:
            self._warned_lost = True
            log.warning("telemetry: the spool segment %s was deleted while this process was writing it "
                        "(was %s removed?); %d events written to it since the last check are counted "
                        "as dropped, and new events go to a new segment", path, self.directory, lost)
        callback = self.on_lost
        if callback is not None:
            with contextlib.suppress(Exception):
                callback(lost)

    def close(self) -> None:
        """Seal the open segment; a later append opens a new one."""
        with self._lock:
            self._rotate_locked()
            rotated, self._rotated = self._rotated, []
        self._close_files(rotated)

    def _after_fork_in_child(self) -> None:
        # The parent's descriptors and lock are not this process's; its files are not ours to seal.
        fds = [self._fd, *(fd for fd, _, _ in self._rotated)]
        for fd in fds:
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._init_process()


def _after_fork() -> None:
    for segment_log in list(_LOGS):
        segment_log._after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)


class SpoolPruner:
    """Keeps the unsent bytes of a spool directory under ``limit_bytes`` by dropping the oldest
    sealed segments, counting the events they held (``dropped``) and warning once per process."""

    def __init__(self, directory: Path, limit_bytes: int, what: str) -> None:
        self.directory = directory
        self.limit_bytes = limit_bytes
        self.what = what
        self.dropped = 0
        self._warned = False

    def enforce(self, pending: list[tuple[Path, int, int, bool]]) -> int:
        """``pending``: (segment, size, already passed on, sealed), oldest first. Returns the
        pending bytes left."""
        total = sum(size - done for _, size, done, _ in pending)
        for path, size, done, sealed in pending:
            if total <= self.limit_bytes:
                break
            if not sealed:
                continue
            lost = count_lines(path, done)
            if remove_segment(path):
                self.dropped += lost
                total -= size - done
                if not self._warned:
                    self._warned = True
                    log.warning("telemetry: the spool %s holds more than %d bytes %s; dropping the oldest "
                                "events (%d so far, counted in telemetry.stats()['sink_dropped']). Raise "
                                "BCP_TELEMETRY_SPOOL_LIMIT_BYTES or get the events moving.",
                                self.directory, self.limit_bytes, self.what, lost)
        return total
