"""The handle of an async save, the one save that may be in flight, and shutdown.

At most one save runs in the background per process: a new save (or a load) first waits
for it, so the staging arena and the save process group are never shared. At interpreter
exit a pending save is finished, and a failure nobody looked at is printed.
"""

from __future__ import annotations

import atexit
import contextlib
import contextvars
import os
import queue
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import torch

from ..errors import InvalidArgumentError
from ..runtime.devices import on_device
from .snapshot import Snapshot


class SaveHandle:
    """A save running in the background. With ``snapshot="blocking"`` training may change the
    saved tensors as soon as ``save(..., async_save=True)`` has returned this; with
    ``"overlapped"``, see :mod:`.snapshot` (``wait_snapshot()`` before other in-place writes)."""

    def __init__(self, path: str, step: int | None, snapshot: Snapshot | None = None) -> None:
        self.path = path
        self.step = step
        self.blocking_s = 0.0  # how long save() held the caller
        self._future: Future = Future()
        self._observed = False
        self._run: Callable[[], None] | None = None  # not yet handed to the worker
        self._snapshot = snapshot  # None: the copy was done before save() returned
        self._pid = os.getpid()  # only this process runs the save (see _check_process)

    def _start(self, work: Callable[[], Any], device: torch.device | None = None,
               deferred: bool = False) -> None:
        """Run ``work`` on the save worker thread, on the caller's CUDA ``device`` (a new
        thread starts on cuda:0, where its CUDA calls would otherwise go). ``deferred``: it
        is handed over at ``launch_pending()``, which ``save()`` calls last, whatever
        happened (see there)."""

        def run() -> None:
            with on_device(device):
                try:
                    self._future.set_result(work())
                except BaseException as exc:  # reported through the handle
                    self._future.set_exception(exc)
                finally:
                    # However the save ended, nobody may wait for its copy any longer (a copy
                    # thread that never started would otherwise leave training waiting).
                    if self._snapshot is not None and not self._snapshot.done.is_set():
                        self._snapshot.finished()

        self._run = run
        if not deferred:
            self._launch()

    def _launch(self) -> None:
        run, self._run = self._run, None
        if run is None:
            return
        try:
            _WORKER.submit(run)
        except RuntimeError:  # no new thread (interpreter shutdown): finish it here instead
            run()  # of leaving the handle, and the collector's pause, waiting for ever

    def _check_process(self) -> None:
        """A forked child inherits the handle but not the thread running the save: waiting
        for it there would never end, so it is refused by name."""
        if os.getpid() != self._pid and not self._future.done():
            raise InvalidArgumentError(
                f"the async save to {self.path} (step {self.step}) runs in process {self._pid}, "
                f"not in this forked process {os.getpid()}: wait for it in the process that "
                "called save()")

    def _confirm(self, timeout: float | None = None) -> bool:
        """Every call on the handle confirms an overlapped snapshot once its copy is done
        (see :mod:`.snapshot`): the caller has finished the writes it issued before."""
        snap = self._snapshot
        return snap is None or snap.wait(timeout)

    def _confirm_then_left(self, timeout: float | None) -> float | None:
        """Confirm within ``timeout``; what is left of it for waiting on the save."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self._confirm(timeout)
        return None if deadline is None else max(0.0, deadline - time.monotonic())

    def done(self) -> bool:
        """True when the save has committed or failed."""
        self._check_process()
        self._confirm(timeout=0)
        return self._future.done()

    def wait_snapshot(self, timeout: float | None = None) -> bool:
        """Block until the saved tensors are copied, or written when an overlapped save
        writes straight from them (or until that failed), so they may be changed in any way;
        True unless ``timeout`` seconds passed first. Returns at once for a blocking
        snapshot. The save's own error, if any, comes from ``wait()``."""
        self._check_process()
        snap = self._snapshot
        if snap is None:
            return True
        done = snap.wait(timeout)
        if done:
            snap.remove_module_hooks()
        return done

    def wait(self, timeout: float | None = None) -> Any:
        """Block until the save is committed and return its ``SaveResult``; raise its error.

        Raises ``TimeoutError`` if it is still running after ``timeout`` seconds."""
        self._check_process()
        self._observed = True
        left = self._confirm_then_left(timeout)
        try:
            return self._future.result(left)
        finally:
            if self._future.done() and self._snapshot is not None:
                self._snapshot.remove_module_hooks()

    result = wait

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The save's error, or None once it has committed (waits like ``wait``)."""
        self._check_process()
        self._observed = True
        return self._future.exception(self._confirm_then_left(timeout))

    def __repr__(self) -> str:
        future = self._future
        state = "running" if not future.done() else ("failed" if future.exception() else "committed")
        return f"SaveHandle({self.path!r}, step={self.step}, {state})"


_PENDING: SaveHandle | None = None
_LOCK = threading.Lock()
# Held by the save() in its foreground, whichever thread called it. Reentrant: a save from a
# signal handler on the saving thread goes ahead as it always did, rather than hang.
_TURN = threading.RLock()


@contextlib.contextmanager
def save_turn() -> Iterator[None]:
    """Saves called from several threads take turns: they share one staging arena, one plan
    cache and one pending save, so two at once would copy into the same memory."""
    with _TURN:
        yield


class _Worker:
    """The thread background saves run on, started once and kept: starting a thread per save
    made ``save()`` wait until the new thread was scheduled and running (several ms with
    the training processes on every core). At most one save runs at a time (``wait_pending``),
    so one thread is enough. A process forked from this one starts its own."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()

    def submit(self, job: Callable[[], None]) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():  # first use, or after fork
                self._jobs = queue.SimpleQueue()
                self._thread = threading.Thread(target=self._loop, args=(self._jobs,),
                                                name="bcp-save", daemon=True)
                self._thread.start()
            self._jobs.put(job)

    @staticmethod
    def _loop(jobs: queue.SimpleQueue[Callable[[], None]]) -> None:
        while True:
            job = jobs.get()
            try:  # in a fresh context, as on a thread of its own (telemetry's current span)
                contextvars.Context().run(job)
            except BaseException:  # noqa: BLE001 - a job reports through its handle; keep serving
                pass


_WORKER = _Worker()


def set_pending(handle: SaveHandle) -> None:
    global _PENDING
    with _LOCK:
        _PENDING = handle


def launch_pending() -> None:
    """Start the pending save's thread if its start was deferred. An overlapped save's copy
    starts once ``save()`` has nothing left to do: started earlier, it competed for the GIL
    and the cores with the rest of ``save()`` (the telemetry span, re-enabling the collector),
    which the caller waited for."""
    with _LOCK:
        handle = _PENDING
    if handle is not None:
        handle._launch()


def wait_pending() -> None:
    """Wait for the save in flight, if any. A failure nobody has looked at becomes a warning
    here (the handle still holds it); it does not stop the next save."""
    global _PENDING
    with _LOCK:
        handle = _PENDING
    if handle is None:
        return
    handle._confirm()  # this save() or load() comes after the caller's writes
    exc = handle._future.exception()
    # Forgotten only once it is over: a wait cut short (Ctrl-C) leaves it pending, so the next
    # save still waits before reusing the arena it may be writing from, and exit finishes it.
    with _LOCK:
        if _PENDING is handle:
            _PENDING = None
    if handle._snapshot is not None:
        handle._snapshot.remove_module_hooks()
    if exc is not None and not handle._observed:
        handle._observed = True
        warnings.warn(f"the async save to {handle.path} (step {handle.step}) failed: {exc}",
                      RuntimeWarning, stacklevel=3)


def _at_exit() -> None:
    with _LOCK:
        handle = _PENDING
    if handle is None:
        return
    handle._confirm()  # training has stopped writing
    if not handle.done():
        print(f"bytecheckpoint: waiting for the async save to {handle.path} to finish",
              file=sys.stderr)
    exc = handle._future.exception()
    if exc is not None and not handle._observed:
        print(f"bytecheckpoint: the async save to {handle.path} (step {handle.step}) failed: {exc}",
              file=sys.stderr)


def _forget_in_child() -> None:
    """A forked child (a fork-started DataLoader worker or ``multiprocessing.Process``) inherits
    the parent's pending save but not the thread that runs it: waiting for it there, at the
    child's exit or its first save, would never end. The save is the parent's to finish."""
    global _PENDING, _LOCK, _TURN
    _LOCK, _TURN = threading.Lock(), threading.RLock()  # a parent's thread may have held them
    _PENDING = None


os.register_at_fork(after_in_child=_forget_in_child)


def _register_at_exit() -> None:
    """Finish a pending save at interpreter exit while thread pools still take work: as a
    threading exit hook registered after ``concurrent.futures``' own, it runs before that one
    stops every executor (hooks run newest first); ``atexit`` runs after it, too late for a
    save that has not started writing yet."""
    import concurrent.futures.thread  # noqa: F401 - its exit hook must be registered first

    hook = getattr(threading, "_register_atexit", None)
    if hook is None:
        atexit.register(_at_exit)
    else:
        hook(_at_exit)


_register_at_exit()
