"""One save at a time per checkpoint path: who holds a path, and whether that holder still lives.

A save's coordinator holds the lock on its target path from ``begin_save`` to the end of the
commit (or of the clean-up of a failed save). While it is held, no other save can start on
that path, move its committed checkpoint aside or delete its staging directory, so a live save
is never destroyed by another one; the loser of a race gets :class:`ConcurrentSaveError`.

- Local disk (``file://``, ``shm://``): ``flock`` on ``<parent>/.<name>.lock``. The kernel drops
  the lock when its process dies, so liveness needs no clock and no heartbeat. The file says
  who took it (host, pid, save id, start time), for the message another saver gets.
- In one process (every backend, and all ``mem://`` has): a registry of the paths held.
- Other storage (object stores, HDFS): a lease record per save, ``.<name>.staging-<id>.owner``
  (JSON: host, pid, the pid's start time, heartbeat), renewed by a heartbeat thread. A record is
  live while its process runs (same host: pid and start time checked) or, seen from another
  host, while its heartbeat is younger than ``BCP_SAVE_LEASE_S`` (default 300 s). A saver
  writes its record, then lists the others: if any other is live it withdraws (so of two
  savers that start together at least one withdraws, never neither).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import math
import os
import posixpath
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

from ..errors import ConcurrentSaveError, InvalidSettingError, NotACheckpointError, StorageIOError
from ..storage import CommitMode, Storage
from ..storage.local import LocalStorage
from ..storage.managed import os_failure
from ..storage.wrapper import StorageWrapper

STAGING_TAG = ".staging-"
OWNER_SUFFIX = ".owner"
LOCK_SUFFIX = ".lock"
LEASE_ENV = "BCP_SAVE_LEASE_S"
HEARTBEAT_ENV = "BCP_SAVE_HEARTBEAT_S"
DEFAULT_LEASE_S = 300.0
DEFAULT_HEARTBEAT_S = 30.0
_MAX_RECORD = 64 << 10
# The save ids of holders that keep a path's lock for milliseconds (a reader repairing a crashed
# commit, a save or gc reclaiming a dead save's staging): a save that meets one waits it out.
BRIEF_PREFIX = "brief-"
BRIEF_WAIT_S = 2.0

log = logging.getLogger(__name__)

_HELD: dict[str, SaveLock] = {}
_HELD_LOCK = threading.Lock()


def _env_seconds(name: str, default: float) -> float:
    """Never raises (the heartbeat thread reads it): a bad value was refused as the save
    started (``check_settings``); one set since then gets the default."""
    try:
        value = float(os.environ.get(name, default))
    except ValueError:
        return default
    return value if value > 0 and math.isfinite(value) else default


def setting_seconds(name: str, default: float, *, zero_ok: bool = False) -> float:
    """The seconds the environment variable ``name`` gives (``default`` when unset), or an
    InvalidSettingError naming it: abc, a negative, NaN or infinite value is no duration."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero_ok):
        bound = ">= 0" if zero_ok else "> 0"
        raise InvalidSettingError(f"{name} = {raw!r} is not a finite number of seconds {bound}: "
                                  f"unset it (default {default:g}) or give one")
    return value


def check_settings() -> None:
    """Called as a save starts: a bad lease or heartbeat setting is named there, never
    replaced in silence (a heartbeat as long as the lease lets a live save's lease lapse)."""
    lease = setting_seconds(LEASE_ENV, DEFAULT_LEASE_S)
    beat = setting_seconds(HEARTBEAT_ENV, DEFAULT_HEARTBEAT_S)
    if beat >= lease:
        raise InvalidSettingError(
            f"{HEARTBEAT_ENV} = {beat:g} s is not shorter than {LEASE_ENV} = {lease:g} s: a save's "
            "owner record would count as dead between its heartbeats; make the heartbeat a "
            "fraction of the lease (defaults 30 and 300)")


def lease_seconds() -> float:
    """How long a writer on another host may go unheard before what it left counts as stale."""
    return _env_seconds(LEASE_ENV, DEFAULT_LEASE_S)


def local_os_path(storage: Storage, path: str) -> str | None:
    """The operating-system path of ``path`` when ``storage`` is a local disk, else None."""
    inner = storage
    while isinstance(inner, StorageWrapper):
        inner = inner.inner
    if isinstance(inner, LocalStorage):
        return inner._os_path(path)
    return None


def _split(path: str) -> tuple[str, str]:
    return posixpath.split(path.rstrip("/"))


def owner_record_path(path: str, save_id: str) -> str:
    parent, name = _split(path)
    return posixpath.join(parent, f".{name}{STAGING_TAG}{save_id}{OWNER_SUFFIX}")


def _process_start(pid: int) -> str | None:
    """The start time of ``pid`` (clock ticks since boot), which tells a reused pid apart."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[19].decode()
    except (OSError, IndexError):
        return None


def owner_doc(save_id: str) -> dict[str, Any]:
    now = time.time()
    return {"save_id": save_id, "host": socket.gethostname(), "pid": os.getpid(),
            "pid_start": _process_start(os.getpid()), "started": now, "heartbeat": now}


def describe(doc: dict[str, Any] | None) -> str:
    """``save 1a2b by pid 42 on host-a, started 12 s ago`` (what is known of it)."""
    if not doc:
        return "owner unknown"
    parts = []
    if doc.get("save_id"):
        parts.append(f"save {doc['save_id']}")
    if doc.get("pid") is not None:
        parts.append(f"by pid {doc['pid']} on {doc.get('host', '?')}")
    started = doc.get("started")
    if isinstance(started, (int, float)):
        parts.append(f"started {max(0.0, time.time() - started):.0f} s ago")
    return ", ".join(parts) or "owner unknown"


def record_alive(doc: dict[str, Any] | None, now: float | None = None) -> bool:
    """Whether the save that wrote the owner record ``doc`` may still be running."""
    if not isinstance(doc, dict):
        return True  # unreadable: the message names the file, so a person can remove it
    now = time.time() if now is None else now
    pid = doc.get("pid")
    if doc.get("host") == socket.gethostname() and isinstance(pid, int) and not isinstance(pid, bool):
        if pid == os.getpid():
            # This process's own record: alive only while this process holds that save's lock
            # (a record it failed to delete would otherwise block every later save of its own).
            with _HELD_LOCK:
                return any(lock.save_id == doc.get("save_id") for lock in _HELD.values())
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass  # alive, another user's
        start = doc.get("pid_start")
        return start is None or _process_start(pid) in (None, start)
    beat = doc.get("heartbeat", doc.get("started"))
    if not isinstance(beat, (int, float)) or isinstance(beat, bool):
        return True
    return now - float(beat) < _env_seconds(LEASE_ENV, DEFAULT_LEASE_S)


def read_record(storage: Storage, full: str) -> dict[str, Any] | None:
    """An owner record, or None when it cannot be read as one (raises FileNotFoundError)."""
    try:
        raw = storage.read_small(full, _MAX_RECORD)  # its heartbeat may rewrite it meanwhile
        if raw is None:
            return None
        doc = json.loads(raw.decode())
    except (ValueError, UnicodeDecodeError, IsADirectoryError):
        return None
    return doc if isinstance(doc, dict) else None


class SaveLock:
    """The right to change a checkpoint path; ``release()`` gives it up (idempotent)."""

    def __init__(self, storage: Storage, path: str, save_id: str, key: str) -> None:
        self.storage, self.path, self.save_id, self._key = storage, path, save_id, key
        self.owner = owner_doc(save_id)
        self._fd: int | None = None
        self._dir_fd: int | None = None  # the lock file's directory (local disk)
        self._lock_file: str | None = None
        self._record: str | None = None
        # Local disk: what the lock file said when we took it. Its holder unlinks it when done,
        # so a record left in it is that of a save whose process died holding the lock.
        self.previous: dict[str, Any] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.released = False

    # -- local: flock -------------------------------------------------------------------------
    def _take_flock(self, dir_fd: int, lock_file: str) -> None:
        """Lock ``lock_file``, acting on it only by its name in the directory open on ``dir_fd``
        (which this lock keeps, and closes on release): a directory on the way to it that is
        swapped for a link meanwhile is never followed."""
        import fcntl

        name = os.path.basename(lock_file)
        deadline = time.monotonic() + BRIEF_WAIT_S
        while True:
            fd = _open_lock_file(lock_file, dir_fd)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                held = exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)
                doc = _read_fd(fd) if held else None
                os.close(fd)
                if not held:
                    raise
                if _brief_holder(doc) and time.monotonic() < deadline:
                    time.sleep(0.01)
                    continue
                raise _busy(self.storage, self.path, doc, None) from None
            # Its last holder may have unlinked the file between our open and our lock.
            try:
                same = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        self.previous = _read_fd(fd)
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(self.owner).encode(), 0)
        except OSError as exc:
            # The flock is the lock; the record only names its holder in a loser's message (and
            # lets the next holder spot a crash sooner). A full disk must not refuse the lock:
            # that would keep `bcp gc` from freeing space and fail a save with no named error.
            log.warning("save lock %s taken without its owner record (%s)", lock_file, exc)
        self._fd, self._dir_fd, self._lock_file = fd, dir_fd, lock_file

    # -- elsewhere: a lease record with a heartbeat ----------------------------------------------
    def _take_lease(self) -> None:
        storage, record = self.storage, owner_record_path(self.path, self.save_id)
        storage.write_bytes(record, json.dumps(self.owner).encode())
        self._record = record
        try:
            others = other_records(storage, self.path, exclude=self.save_id)
        except BaseException:  # never leave a record that says a save runs when none does
            self._drop_record()
            raise
        for other, doc in others:
            if record_alive(doc):
                self._drop_record()
                raise _busy(storage, self.path, doc, other)
        interval = _env_seconds(HEARTBEAT_ENV, DEFAULT_HEARTBEAT_S)
        self._thread = threading.Thread(target=self._beat, args=(interval,), daemon=True,
                                         name=f"bcp-save-lease-{self.save_id}")
        self._thread.start()

    def _beat(self, interval: float) -> None:
        while not self._stop.wait(interval):
            self.owner["heartbeat"] = time.time()
            try:
                self.storage.write_bytes(self._record, json.dumps(self.owner).encode())
            except Exception as exc:  # the lease is generous; the next beat tries again
                log.warning("could not renew save lease %s: %s", self._record, exc)

    def ensure_record(self) -> None:
        """Write this save's owner record where the lock itself keeps none (local disk): on an
        object store it is what says "a save is under way, nothing here is committed yet"."""
        if self._record is None:
            record = owner_record_path(self.path, self.save_id)
            self.storage.write_bytes(record, json.dumps(self.owner).encode())
            self._record = record

    def _drop_record(self) -> None:
        if self._record is None:
            return
        for attempt in range(2):  # a record left behind holds other hosts off for a lease's time
            try:
                self.storage.delete(self._record)
                break
            except FileNotFoundError:
                break
            except Exception as exc:  # noqa: BLE001 - releasing never fails the save
                if attempt:
                    log.warning("could not delete the save's owner record %s (other hosts wait "
                                "for its lease to lapse, %.0f s; delete it to save sooner): %s",
                                self.storage.url(self._record), _env_seconds(LEASE_ENV, DEFAULT_LEASE_S),
                                exc)
        self._record = None

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._drop_record()
        if self._fd is not None:
            with contextlib.suppress(OSError):  # unlinked while still locked: see _take_flock
                os.unlink(os.path.basename(self._lock_file), dir_fd=self._dir_fd)
            os.close(self._fd)
            self._fd = None
        if self._dir_fd is not None:
            os.close(self._dir_fd)
            self._dir_fd = None
        with _HELD_LOCK:
            if _HELD.get(self._key) is self:
                del _HELD[self._key]


def open_dir(storage: Storage, path: str) -> int:
    """A descriptor of the directory ``path`` of local ``storage`` (made if missing), for acting
    in it by name: on shm:// checked to lie inside its root (``SharedMemoryStorage.open_dir``)."""
    inner = storage
    while isinstance(inner, StorageWrapper):
        inner = inner.inner
    opener = getattr(inner, "open_dir", None)
    if opener is not None:
        return opener(path)
    local = local_os_path(storage, path) or "."
    os.makedirs(local, exist_ok=True)
    return os.open(local, os.O_RDONLY | os.O_DIRECTORY)


def _open_lock_file(lock_file: str, dir_fd: int) -> int:
    """Open (create) a lock file by its name in ``dir_fd``, never through a symbolic link
    planted there: the holder truncates and rewrites it, which would clobber whatever file the
    link names."""
    try:
        return os.open(os.path.basename(lock_file), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644,
                       dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        raise StorageIOError(f"{lock_file} is a symbolic link, not a save lock; remove it (what it "
                             "points to was not touched)", op="lock", path=lock_file,
                             errno=exc.errno) from None


def _brief_holder(doc: dict[str, Any] | None) -> bool:
    """Whether the lock's holder, by the record in its file, lets go within milliseconds: one
    of ``BRIEF_PREFIX``, or one that has not written its own record yet (the file is empty, or
    still names a save whose process is dead)."""
    if doc is None:
        return True
    return str(doc.get("save_id", "")).startswith(BRIEF_PREFIX) or not record_alive(doc)


def _read_fd(fd: int) -> dict[str, Any] | None:
    try:
        doc = json.loads(os.pread(fd, _MAX_RECORD, 0).decode() or "null")
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    return doc if isinstance(doc, dict) else None


def _busy(storage: Storage, path: str, doc: dict[str, Any] | None, record: str | None
          ) -> ConcurrentSaveError:
    hint = ""
    if record is not None:
        hint = (f" If you are sure no such save runs, delete {storage.url(record)}; a dead one's "
                f"lease also lapses {_env_seconds(LEASE_ENV, DEFAULT_LEASE_S):.0f} s after its "
                "last heartbeat (BCP_SAVE_LEASE_S).")
    return ConcurrentSaveError(
        f"another save to {storage.url(path)} is in progress ({describe(doc)}); wait for it to "
        "finish, or save to another path. Nothing of that save was touched." + hint
    )


def other_records(storage: Storage, path: str, exclude: str = "") -> list[tuple[str, dict | None]]:
    """The owner records of other saves to ``path`` (lease-based storage), with their contents."""
    parent, name = _split(path)
    prefix = f".{name}{STAGING_TAG}"
    out = []
    for entry in storage.list_dir(parent):
        if not (entry.startswith(prefix) and entry.endswith(OWNER_SUFFIX)):
            continue
        if entry[len(prefix):-len(OWNER_SUFFIX)] == exclude:
            continue
        full = posixpath.join(parent, entry)
        try:
            out.append((full, read_record(storage, full)))
        except FileNotFoundError:
            continue  # released while we listed
    return out


def uses_leases(storage: Storage) -> bool:
    return local_os_path(storage, "") is None and storage.scheme != "mem"


def _key(storage: Storage, path: str) -> str:
    local = local_os_path(storage, path)
    return os.path.realpath(local) if local is not None else storage.url(path.rstrip("/"))


def acquire(storage: Storage, path: str, save_id: str) -> SaveLock:
    """Take the save lock on ``path`` or raise :class:`ConcurrentSaveError` naming its holder."""
    if storage.commit_mode is CommitMode.MARKER and not _split(path)[0]:
        # Its owner record and 'latest' go beside it, in the parent: a bucket has none.
        raise NotACheckpointError(f"{storage.url(path)} is a whole bucket, which cannot be a checkpoint; "
                                  f"give a name inside it, as in {storage.url(path.rstrip('/'))}/step_100")
    key = _key(storage, path)
    lock = SaveLock(storage, path, save_id, key)
    with _HELD_LOCK:
        holder = _HELD.get(key)
        if holder is not None:
            raise _busy(storage, path, holder.owner, None)
        _HELD[key] = lock  # reserved: a second thread of this process fails fast
    try:
        local = local_os_path(storage, path)
        if local is not None:
            parent, name = os.path.split(local.rstrip(os.sep))
            lock_file = os.path.join(parent, f".{name}{LOCK_SUFFIX}")
            dir_fd = None
            try:
                dir_fd = open_dir(storage, _split(path)[0])
                lock._take_flock(dir_fd, lock_file)
            except BaseException as exc:
                if dir_fd is not None and lock._dir_fd is None:
                    os.close(dir_fd)
                if not isinstance(exc, OSError) or isinstance(exc, StorageIOError):
                    raise
                raise os_failure("lock", lock_file, exc) from exc  # a full disk, no descriptors
        elif uses_leases(storage):
            lock._take_lease()
    except BaseException:
        with _HELD_LOCK:
            _HELD.pop(key, None)
        raise
    return lock


def try_acquire(storage: Storage, path: str, save_id: str) -> SaveLock | None:
    """The lock if it is free now, else None (for a reader that repairs a crashed commit)."""
    try:
        return acquire(storage, path, save_id)
    except (ConcurrentSaveError, OSError):
        return None


def held_by_this_process(storage: Storage, path: str) -> SaveLock | None:
    with _HELD_LOCK:
        return _HELD.get(_key(storage, path))


def pointer_locked(storage: Storage, root: str) -> bool:
    """Whether :func:`pointer_lock` serialises the savers of ``root`` (local disk). Elsewhere
    (object stores, HDFS, mem://) two saves committing at once can leave ``latest`` on the
    lower step, so readers check it against the root's listing (``catalog.overtaking``)."""
    return local_os_path(storage, root) is not None and storage.commit_mode is not CommitMode.MARKER


@contextlib.contextmanager
def pointer_lock(storage: Storage, root: str, timeout_s: float = 30.0) -> Iterator[None]:
    """Serialise read-compare-replace of ``<root>/latest`` between savers on local disk (saves
    to different paths of one root), so an older step never replaces a newer one. Elsewhere
    the pointer is replaced by one atomic write without this lock."""
    if not pointer_locked(storage, root):
        yield
        return
    import fcntl

    # The root directory itself is the lock (flock works on a directory): no file is left.
    fd = open_dir(storage, root)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise ConcurrentSaveError(
                        f"{storage.url(root)}/latest stayed locked by another save for {timeout_s:.0f} s;"
                        " the checkpoint is committed, but latest was not moved: load it by its path"
                    ) from None
                time.sleep(0.01)
        yield
    finally:
        os.close(fd)  # closing drops the lock
