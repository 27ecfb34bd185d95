"""The tiering journal: an append-only JSON-lines file in the cold tier, fsynced per record.

Each record is ``{"id", "op", "state", ...}``; a move writes ``begin`` (with its file list),
``copied``, ``verified``, ``remapped``, ``freeing`` and ``done``, or ``aborted``. A move
whose last record is neither ``done``, ``aborted`` nor ``recovered`` was interrupted, and the
next run resolves it (moves: ``storage_tiering.mover.recover``; deletions:
:func:`bytecheckpoint.manage.deletion.recover_deletion`). A torn last line, from a crash during an
append, is ignored. It lives in the core because ``bcp gc`` journals its deletions here too.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from collections.abc import Iterator
from typing import Any

from ..errors import CheckpointError, StorageIOError
from ..storage.managed import os_failure

FINAL_STATES = frozenset({"done", "aborted", "recovered"})
JOURNAL_FILE = ".tiering-journal.jsonl"
LOCK_FILE = ".tiering.lock"


class TierBusyError(CheckpointError):
    """Another tiering pass or ``bcp gc`` holds the lock on this cold tier."""


@contextlib.contextmanager
def exclusive(cold_root: str) -> Iterator[None]:
    """Hold the cold tier's lock: one tiering pass or ``bcp gc`` at a time moves or deletes in
    it (a cooling racing a deletion of the same checkpoint would leave cold copies no link uses)."""
    lock = os.path.join(cold_root, LOCK_FILE)
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    except (FileNotFoundError, NotADirectoryError):
        raise
    except OSError as exc:  # read-only (EROFS), no permission, full: nothing can be moved or deleted
        raise _unwritable("lock", lock, exc) from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise TierBusyError(f"another tiering pass or bcp gc holds {cold_root}/{LOCK_FILE}; not "
                                "starting: try again when it has finished") from None
        yield
    finally:
        os.close(fd)


def _unwritable(op: str, path: str, exc: OSError) -> StorageIOError:
    """A failure to write the cold tier's lock or journal, named: nothing was moved or deleted
    by this step, and every checkpoint stays where it was (and loadable)."""
    err = os_failure(op, path, exc)
    err.message += ("; the cold tier must be writable (mounted read-write, with write permission for "
                    "this user) for tiering and gc --cold: nothing was moved or deleted by this step")
    return err


def _write_all(fd: int, data: bytes) -> None:
    """Write all of ``data``: a short write (a nearly full disk) continues, or raises ENOSPC."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


class Journal:
    def __init__(self, cold_root: str) -> None:
        self.path = os.path.join(cold_root, JOURNAL_FILE)

    def append(self, move_id: str, op: str, state: str, **fields: Any) -> None:
        record = {"id": move_id, "op": op, "state": state, "time": time.time(), **fields}
        line = (json.dumps(record, separators=(",", ":")) + "\n").encode()
        try:
            self._append(line)
        except OSError as exc:
            raise _unwritable("append to the journal", self.path, exc) from None

    def _append(self, line: bytes) -> None:
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            end = os.fstat(fd).st_size
            try:
                _write_all(fd, line)
                os.fsync(fd)
            except OSError:
                # A full disk writes part of a line and then fails: cut it off, or the next
                # record, appended to that fragment, would be unreadable as well.
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, end)
                raise
        finally:
            os.close(fd)

    def records(self) -> Iterator[dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                for raw in f:
                    try:
                        record = json.loads(raw)
                    except ValueError:
                        continue  # torn tail of a crashed append
                    # The journal is a file like any other: a line that is not one of our
                    # records is skipped, never a KeyError in the next pass.
                    if isinstance(record, dict) and isinstance(record.get("id"), str):
                        yield record
        except FileNotFoundError:
            return

    def unfinished(self) -> list[dict[str, Any]]:
        """The ``begin`` record of every operation that never reached a final state."""
        begun: dict[str, dict[str, Any]] = {}
        for r in self.records():
            if r.get("state") == "begin":
                begun[r["id"]] = r
            elif r.get("state") in FINAL_STATES:
                begun.pop(r["id"], None)
        return list(begun.values())
