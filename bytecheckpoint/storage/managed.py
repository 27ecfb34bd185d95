"""What ``open_storage`` hands out: every backend operation retried and reported.

Each primitive runs under the retry policy and becomes one telemetry event
``storage.<op>`` with ``op``, ``backend``, ``path``, ``bytes``, ``attempt`` (attempts used),
latency and outcome. A writer's calls are events too: ``storage.open``, ``storage.write``
per buffer, ``storage.commit``, ``storage.abort``. Retried failures also emit
``storage.retry`` events, so flaky storage shows up even when every operation succeeds.
"Not found" is an answer, not a failure: its event has outcome ok and ``found=False``; so are
the other answers of ``_ANSWERS`` (outcome ok, ``answer`` names the exception).

Every retry is also logged (logger ``bytecheckpoint.storage``, warning: what failed, which
attempt, the wait), so a slow failure is never a silent one. An operating-system error that
is not an answer (a full disk, a read-only file system, no permission) comes out as a
:class:`~bytecheckpoint.errors.StorageIOError` that names the operation and the path and
keeps ``errno``. URLs in messages and logs have their credentials masked.
"""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Callable
from typing import TypeVar

from telemetry import span

from ..errors import StorageError, StorageIOError, StorageTimeoutError, TransientStorageError
from . import retry
from .base import Storage, WrappedWriter, Writer
from .config import RetrySettings
from .redact import redact
from .wrapper import StorageWrapper

T = TypeVar("T")

_EVENT_NAMES = {"read_into": "storage.read", "list_dir": "storage.list", "open_writer": "storage.open"}
log = logging.getLogger("bytecheckpoint.storage")

# Answers the callers act on (a missing file, a name taken): passed through as they are.
_ANSWERS = (FileNotFoundError, FileExistsError, IsADirectoryError, NotADirectoryError)
_ADVICE = {
    errno.ENOSPC: "the device is full: free space or save elsewhere",
    errno.EDQUOT: "the disk quota is exceeded: free space or raise the quota",
    errno.EROFS: "the file system is read-only: remount it read-write or save elsewhere",
    errno.EACCES: "permission denied: grant this user access or use another path",
    errno.EPERM: "operation not permitted: check the owner and permissions",
    errno.EIO: "an I/O error from the device: check the disk (dmesg) before retrying",
    errno.EFBIG: "the file is too large for this file system or the process limit (ulimit -f)",
    errno.ENAMETOOLONG: "the path is too long: use a shorter one",
}


def _gave_up(op: str, url: str, exc: BaseException, attempts: int, started: float) -> TransientStorageError:
    # A timeout stays one by its class too, so a caller can tell a hung server from the rest.
    cls = StorageTimeoutError if isinstance(exc, StorageTimeoutError) else TransientStorageError
    return cls(redact(
        f"{op} {url} failed after {attempts} attempts over {time.monotonic() - started:.1f}s: {exc}. "
        "The storage is unreachable or overloaded: check the endpoint and network, or allow more "
        "retries with BCP_STORAGE_RETRY_ATTEMPTS / BCP_STORAGE_RETRY_DEADLINE_S"
    ))


def os_failure(op: str, url: str, exc: OSError) -> StorageIOError:
    """A plain OSError (no path, often) as a named error saying what was done, where, and why."""
    code = exc.errno
    name = errno.errorcode.get(code, str(code)) if code is not None else "error"
    reason = exc.strerror or str(exc) or type(exc).__name__
    advice = _ADVICE.get(code, "") if code is not None else ""
    message = redact(f"{op} {url} failed: {reason} ({name})" + (f"; {advice}" if advice else ""))
    return StorageIOError(message, op=op, path=redact(url), errno=code)


class ManagedStorage(StorageWrapper):
    def __init__(self, inner: Storage, policy: RetrySettings) -> None:
        super().__init__(inner)
        self.policy = policy

    def _retry(self, op: str, path: str, fn: Callable[[], T], event) -> tuple[T, int]:
        started = time.monotonic()

        def on_retry(attempt: int, exc: BaseException, delay: float) -> None:
            log.warning("%s", redact(f"storage: {op} {self.url(path)} failed (attempt {attempt} of "
                                     f"{self.policy.attempts}: {type(exc).__name__}: {exc}); "
                                     f"retrying in {delay:.2f}s"))
            with span("storage.retry", op=op, backend=self.scheme, path=redact(self.url(path)),
                      attempt=attempt, delay_s=round(delay, 4),
                      error=redact(f"{type(exc).__name__}: {exc}")[:300]):
                pass

        try:
            return retry.call(fn, self.policy, on_retry=on_retry)
        except Exception as exc:
            attempts = getattr(exc, "attempts", 1)
            event.set(attempt=attempts)
            if retry.is_transient(exc):
                raise _gave_up(op, self.url(path), exc, attempts, started) from exc
            if isinstance(exc, OSError) and not isinstance(exc, (StorageError, *_ANSWERS)):
                raise os_failure(op, self.url(path), exc) from exc
            raise

    def _call(self, op: str, path: str, fn: Callable[[], T], nbytes: int | None = None,
              extra: dict[str, object] | None = None) -> T:
        fields: dict[str, object] = {"op": op, "backend": self.scheme, "path": redact(self.url(path))}
        fields.update(extra or {})
        if nbytes is not None:
            # A read's bytes are those it got (set below), not the buffer's size: a missing
            # file or a short read at the end of one moved fewer.
            fields["requested_bytes" if op == "read_into" else "bytes"] = nbytes
        answer: OSError | None = None
        with span(_EVENT_NAMES.get(op, f"storage.{op}"), **fields) as event:
            try:
                value, attempts = self._retry(op, path, fn, event)
            except _ANSWERS as exc:
                # An answer, not a failure (an overwrite's probe of a directory with size()
                # got IsADirectoryError): an error event raised a failed_ops alert for every
                # successful save over a checkpoint. A caller that fails on it fails its phase.
                event.set(attempt=getattr(exc, "attempts", 1), bytes=0)
                event.set(**({"found": False} if isinstance(exc, FileNotFoundError)
                             else {"answer": type(exc).__name__}))
                answer = exc
            else:
                event.set(attempt=attempts)
                if op == "read_into":
                    event.set(bytes=value)
        if answer is not None:
            raise answer
        return value

    def rename(self, src: str, dst: str, *, overwrite: bool = False) -> None:
        state = {"tries": 0}

        def attempt() -> None:
            state["tries"] += 1
            try:
                self.inner.rename(src, dst, overwrite=overwrite)
            except FileNotFoundError:
                # An earlier attempt that reported failure may have moved it after all.
                if state["tries"] > 1 and self.inner.exists(dst) and not self.inner.exists(src):
                    return
                raise

        return self._call("rename", src, attempt)

    def open_writer(self, path: str) -> Writer:
        return _ManagedWriter(self, path)


class _ManagedWriter(WrappedWriter):
    """Retries each call (writers fail atomically per call); each call is one event.

    ``storage.write`` events carry the bytes of that call, so their sum over a file is its
    size; the ``storage.commit`` event also carries the whole file's bytes and seconds.
    """

    def __init__(self, storage: ManagedStorage, path: str) -> None:
        self._storage, self._path = storage, path
        self._started = time.perf_counter()
        self._bytes = 0
        self._inner = storage._call("open_writer", path, lambda: storage.inner.open_writer(path))

    def write(self, data: memoryview | bytes) -> None:
        n = memoryview(data).nbytes
        self._storage._call("write", self._path, lambda: self._inner.write(data), nbytes=n)
        self._bytes += n

    def commit(self) -> int:
        extra = {"file_bytes": self._bytes, "file_s": round(time.perf_counter() - self._started, 6),
                 "direct_bytes": self._inner.direct_bytes,
                 "slot_wait_s": round(self._inner.slot_wait_s, 6)}
        return self._storage._call("commit", self._path, self._inner.commit, extra=extra)

    def abort(self) -> None:
        self._storage._call("abort", self._path, self._inner.abort)
