"""``CheckpointManager``: when to save, what to keep, where to resume, for a training loop.

    mgr = bcp.CheckpointManager("ckpt", save_every_steps=100, last_step=steps,
                                retention=bcp.KeepLast(3) | bcp.KeepEvery(1000), preemption=True)
    start = mgr.restore(state) or 0          # None on a fresh start
    for step in range(start + 1, steps + 1):
        train_step()
        mgr.save(step, state)                # saves when the schedule says so (async)
        if mgr.stop_requested:               # SIGTERM / SIGUSR1 reached some rank: saved, stop
            break
    mgr.close()

Every rank makes the same calls. Rank 0 of the group decides what all ranks need to agree on
(the checkpoint to restore, a new checkpoint's name and timeline) and broadcasts it; it alone
applies retention, after a save commits. See docs/guide/manager.md for the rules.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import posixpath
import signal
import sys
import threading
import time
import uuid
import weakref
from collections.abc import Iterable
from typing import Any

import torch

from ..api import check_step, load
from ..api import save as _save
from ..commit.protocol import Latest, read_latest, repair
from ..commit.save_lock import pointer_locked
from ..commit.timeline import MANAGER_KEY, Timeline
from ..errors import (
    CheckpointError,
    ColdTierUnavailableError,
    ConcurrentSaveError,
    CorruptCheckpointError,
    InvalidArgumentError,
    NotACheckpointError,
    RankFailedError,
    StorageIOError,
)
from ..format.metadata import METADATA_FILE
from ..manage.catalog import RootListing, overtaking
from ..manage.deletion import delete_on_storage
from ..manage.records import CheckpointInfo
from ..manage.retention import Context, Policy, plan_deletions
from ..runtime.comm import Communicator, Outcome
from ..runtime.identity import stamp_rank
from ..storage import open_storage
from .agreement import SAVE, STOP, Agreed, Agreement
from .schedule import Schedule

log = logging.getLogger(__name__)

DEFAULT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
# How long close() waits for every rank's last vote on a late signal or save request: a rank
# that crashed or never closes must not hang the others' exit.
CLOSE_VOTE_TIMEOUT_S = 60.0
# The same for a rank that closes with an error: its vote can only say "no save", so it waits
# only for the ranks already voting, and its error is not held up a minute.
CLOSE_VOTE_FAILING_TIMEOUT_S = 5.0
_ACTIVE: dict[str, int] = {}  # root URL -> id of the open manager on it, in this process
_ACTIVE_LOCK = threading.Lock()
# Open managers whose signal handlers are installed, in installation order (under _ACTIVE_LOCK):
# closing one that a later one was installed on top of hands its saved handlers down to it.
_HANDLING: list[CheckpointManager] = []
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
_RANK_0_FAILED = "rank 0 failed"  # error_type of a decision that failed on rank 0 with no CheckpointError
_ASKED = {STOP: "a preemption signal", SAVE: "a save request (request_save(), or save_every_seconds due)"}
_ERRORS = {c.__name__: c for c in (NotACheckpointError, InvalidArgumentError, ConcurrentSaveError,
                                   CorruptCheckpointError, ColdTierUnavailableError)}


def _loadable(c: CheckpointInfo | None) -> bool:
    return c is not None and c.committed and c.problem is None


def _why(c: CheckpointInfo) -> str:
    return c.problem or "its metadata cannot be read"


def _release_root(key: str, owner: int) -> None:
    with _ACTIVE_LOCK:
        if _ACTIVE.get(key) == owner:
            del _ACTIVE[key]


class CheckpointManager:
    """Saves on a schedule, keeps what a retention policy says, restores and rolls back.

    Args:
        root: the directory (any storage URL) holding this run's checkpoints, one per save,
            named ``step_<N>``, and the ``latest`` pointer.
        save_every_steps: save when ``step % N == 0``.
        save_every_seconds: save when this much wall time passed since the last save (agreed
            between ranks at the next check, so within ``2 * check_every`` steps).
        last_step: the loop's final step, always saved.
        retention: a policy (:class:`KeepLast`, :class:`KeepEvery`, :class:`KeepBest`,
            :class:`KeepNewerThan`, combined with ``|`` and ``&``); None keeps everything.
        async_save: save in the background (one save in flight; the next waits for it).
        preemption: ``True`` (SIGTERM and SIGUSR1) or the signals to handle: a signal on any rank
            makes every rank save at the same step, then :attr:`stop_requested` turns True (at
            :meth:`close` for a signal too late for the loop). The handler replaced still runs
            after the manager's when it is a Python function (not SIG_DFL nor SIG_IGN).
        check_every: steps between the ranks' agreements on signals, requests and time.
        process_group: the ranks taking part (default: all).
        record_step_time: emit a ``train.step`` telemetry span per step (time between calls to
            :meth:`save`), which the dashboard's goodput page reads.
        save_kwargs: passed to :func:`bytecheckpoint.save` (``framework``, ``files_per``, ...).
    """

    def __init__(self, root: str, *, save_every_steps: int | None = None,
                 save_every_seconds: float | None = None, last_step: int | None = None,
                 retention: Policy | None = None, async_save: bool = True,
                 preemption: bool | Iterable[int] = False, check_every: int = 8,
                 process_group: Any = None, record_step_time: bool = False,
                 save_kwargs: dict[str, Any] | None = None) -> None:
        if retention is not None and not isinstance(retention, Policy):
            raise InvalidArgumentError(f"retention={retention!r} is not a retention policy (KeepLast, "
                                       "KeepEvery, KeepBest, KeepNewerThan, combined with | and &)")
        if isinstance(check_every, bool) or not isinstance(check_every, int) or check_every < 1:
            raise InvalidArgumentError(f"check_every={check_every!r}: give a whole number of steps >= 1")
        self.schedule = Schedule(save_every_steps, save_every_seconds, last_step)
        self.retention = retention
        self.async_save = async_save
        self.process_group = process_group
        self.record_step_time = record_step_time
        self.save_kwargs = dict(save_kwargs or {})
        for reserved in ("step", "async_save", "process_group", "user_metadata", "overwrite"):
            if reserved in self.save_kwargs:
                raise InvalidArgumentError(f"save_kwargs may not set {reserved!r}: the manager sets it")
        stamp_rank()  # its storage and train.step events name their rank
        self.storage, self.root = open_storage(root)
        self.root = self.root.rstrip("/") or self.root
        self.url = self.storage.url(self.root)
        self._check_root()
        self._key = self.url
        with _ACTIVE_LOCK:
            if self._key in _ACTIVE:
                raise ConcurrentSaveError(
                    f"another CheckpointManager of this process is open on {self.url}: two managers on "
                    "one root would delete each other's checkpoints and fight over 'latest'. Use one "
                    "manager per root (close() the other first), or give each run its own root")
            _ACTIVE[self._key] = id(self)
        self._finalizer = weakref.finalize(self, _release_root, self._key, id(self))
        try:
            self.comm = Communicator(process_group)
            self.agreement = Agreement(process_group, check_every)
        except BaseException:
            self._finalizer()
            raise
        self.listing = RootListing(self.storage, self.root)
        self._timeline: Timeline | None = None  # set by restore() or the first save
        self._last_step: int | None = None  # the newest step saved or restored on this timeline
        self._handle: Any = None
        self.last_result: Any = None  # the SaveResult of the last save waited for
        self.last_load: Any = None  # the LoadResult of the last restore
        self._pending_step: int | None = None
        self._before_pending: int | None = None  # _last_step before the save in flight
        self._pending_name: str | None = None  # the name of the save in flight (retention keeps it)
        self._decided: tuple[int, Agreed | None] | None = None
        self._stop = False
        self._closed = False
        self._step_t0: tuple[float, float] | None = None
        self._old_handlers: dict[int, Any] = {}
        self._pid = os.getpid()  # a forked child's signals are not this manager's
        # What save() was last given, and the optimizer steps counted by then: close() makes a
        # late save of it only if no optimizer of it has stepped since.
        self._seen: tuple[int, dict[str, Any], int] | None = None
        self._optimizer_steps = 0
        self._step_hooks: dict[int, Any] = {}  # id(optimizer) -> its pre-hook's handle
        if preemption:
            try:
                self._install(DEFAULT_SIGNALS if preemption is True else preemption)
            except BaseException:
                self._finalizer()  # free the root: this manager never opened
                raise

    # -- checks ------------------------------------------------------------------------------
    def _check_root(self) -> None:
        try:
            self.storage.size(self.root)
            is_file = True
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            is_file = False
        if is_file:
            raise NotACheckpointError(
                f"{self.url} is a file, not a directory of checkpoints; give the directory the "
                "manager should keep this run's checkpoints in")
        if self.storage.exists(posixpath.join(self.root, METADATA_FILE)):
            parent = posixpath.dirname(self.root)
            raise NotACheckpointError(
                f"{self.url} is one checkpoint, not a root of checkpoints; give the directory that "
                f"holds the run's checkpoints (its parent, {self.storage.url(parent)}?)")

    def _agreed(self, outcome: Outcome | None) -> Any:
        """Rank 0's decision on every rank; its error raised on every rank, by name."""
        got = self.comm.broadcast(outcome)
        if got.error is not None:
            if got.error_type == _RANK_0_FAILED:
                raise RankFailedError(got.error, {0: got.error})
            raise _ERRORS.get(got.error_type or "", CheckpointError)(got.error)
        return got.value

    def _decide(self, fn: Any, *args: Any) -> Any:
        outcome = None
        failure: BaseException | None = None
        if self.comm.is_coordinator:
            try:
                outcome = Outcome(value=fn(*args))
            except CheckpointError as exc:
                outcome = Outcome(error=str(exc), error_type=type(exc).__name__)
            except BaseException as exc:  # noqa: BLE001 - the other ranks wait in the broadcast
                failure = exc
                detail = Outcome.failure(exc).error
                outcome = Outcome(error=f"{self.url}: rank 0 failed deciding for every rank: {detail}",
                                  error_type=_RANK_0_FAILED)
        try:
            return self._agreed(outcome)
        except RankFailedError:
            if failure is not None:
                raise failure from None  # rank 0 raises its own error, as it would alone
            raise

    # -- preemption --------------------------------------------------------------------------
    def _install(self, signals: Any) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise InvalidArgumentError("preemption handlers can only be installed from the main thread "
                                       "(Python delivers signals there); create the manager there")
        sig = signals
        try:
            for sig in signals:
                self._old_handlers[sig] = signal.signal(sig, self._on_signal)
        except (OSError, ValueError, TypeError) as exc:  # SIGKILL, a bad number, not a signal
            self._uninstall()  # no handler of a manager that never opened may stay
            raise InvalidArgumentError(
                f"preemption={signals!r}: {sig!r} cannot be handled ({exc}); give True or a list "
                "of catchable signals, such as [signal.SIGTERM, signal.SIGUSR1]") from None
        with _ACTIVE_LOCK:
            _HANDLING.append(self)

    def _uninstall(self) -> None:
        """Put back the handlers this manager replaced, where its own is still installed. A
        handler installed on top of it since is left in place: a later manager's takes over
        what to put back at its close; a user's own stays theirs."""
        with _ACTIVE_LOCK:
            if self in _HANDLING:
                _HANDLING.remove(self)
            later = list(_HANDLING)
        mine = self._on_signal
        for sig, old in self._old_handlers.items():
            with contextlib.suppress(ValueError, TypeError):  # close() outside the main thread
                if signal.getsignal(sig) == mine:
                    signal.signal(sig, old)
                    continue
            for other in later:
                if other._old_handlers.get(sig) == mine:
                    other._old_handlers[sig] = old

    def _on_signal(self, signum: int, frame: Any) -> None:
        previous = self._old_handlers.get(signum)
        if os.getpid() != self._pid:
            # A forked child (a DataLoader worker) inherited this handler: nothing in it acts on
            # the flag, so it would never stop. It gets what the handler replaced instead.
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
            signal.raise_signal(signum)
            return
        self.agreement.flags[STOP] = 1  # an assignment: safe in a handler; acted on at a check
        # The handler this one replaced runs too (a launcher's log flush, a scheduler notice).
        # Not SIG_DFL/SIG_IGN (not callables) nor Python's SIGINT default: those would end the
        # job before its preemption save, which ends it cleanly instead.
        if callable(previous) and previous is not signal.default_int_handler:
            previous(signum, frame)

    def request_save(self) -> None:
        """Ask for a save soon (within ``2 * check_every`` steps; one the loop ends before is made
        by :meth:`close`); may be called on one rank only."""
        self.agreement.flags[SAVE] = 1

    @property
    def stop_requested(self) -> bool:
        """True once a preemption signal reached the ranks' agreement and its save was made:
        leave the training loop."""
        return self._stop

    # -- the schedule ------------------------------------------------------------------------
    def should_save(self, step: int) -> bool:
        """Whether :meth:`save` at ``step`` saves: by the step, or by what the ranks agreed
        (a signal, a request, the clock). Every rank must call it (or ``save``) every step."""
        step = check_step(step)
        assert step is not None
        if self._decided is None or self._decided[0] != step:
            self._check_in_flight()
            if self.schedule.time_due():
                self.agreement.flags[SAVE] = 1
            self._decided = (step, self.agreement.poll(step))
            self._step_time()
        agreed = self._decided[1]
        return self.schedule.step_due(step) or (agreed is not None and (agreed.stop or agreed.save))

    def _check_in_flight(self) -> None:
        """An async save in flight that has failed was no save: the clock runs from the one
        before it, so a time-based save is voted for now (the save then raises that error from
        its wait(), within ``2 * check_every`` steps) rather than an interval later."""
        done = getattr(self._handle, "done", None)
        if self.schedule.every_seconds is not None and done is not None and done():
            if self._handle.exception(timeout=0) is not None:
                self.schedule.save_failed()

    def _step_time(self) -> None:
        if not self.record_step_time:
            return
        now, wall = time.perf_counter(), time.time()
        if self._step_t0 is not None:
            with contextlib.suppress(Exception):  # telemetry never raises into training
                import telemetry

                with telemetry.span("train.step") as span:
                    # The step began at the previous call, not now: the span covers it.
                    span.ts, span._t0 = self._step_t0
        self._step_t0 = (wall, now)

    # -- saving --------------------------------------------------------------------------------
    def save(self, step: int, state: dict[str, Any], *, metrics: dict[str, float] | None = None,
             force: bool = False) -> bool:
        """Save ``state`` as step ``step`` if the schedule says so (or ``force``); return whether
        a save was started. Asynchronous unless ``async_save=False`` or preempted: the previous
        save is finished first, then retention runs on what has committed."""
        self._check_open()
        step = check_step(step)
        assert step is not None
        self._count_steps_of(state)
        self._seen = (step, state, self._optimizer_steps)
        due = self.should_save(step)
        agreed = self._decided[1] if self._decided else None
        stopping = agreed is not None and agreed.stop
        if not (due or force):
            return False
        metrics = self._check_metrics(metrics)
        self.wait()
        if self._last_step is not None and step <= self._last_step:
            raise InvalidArgumentError(
                f"step {step} is not after step {self._last_step}, the last one saved or restored on this "
                "timeline; nothing was saved (to redo from an earlier step, restore(state, step=...) first)")
        name, timeline = self._decide(self._name_for, step)
        self._timeline = timeline
        record = timeline.record() | ({"metrics": metrics} if metrics else {})
        try:
            result = _save(self.storage.url(posixpath.join(self.root, name)), state, step=step,
                           user_metadata={MANAGER_KEY: record}, process_group=self.process_group,
                           async_save=self.async_save and not stopping, **self.save_kwargs)
        except OSError as exc:
            raise self._not_saved(exc, step) from exc
        self._before_pending = self._last_step
        self._last_step = step
        self.schedule.saved()
        self.agreement.saved()  # the requests and due times voted on so far are met
        self._handle, self._pending_step, self._pending_name = result, step, name
        if not (self.async_save and not stopping):
            self.wait()
        if stopping:
            self._stop = True
        return True

    @staticmethod
    def _check_metrics(metrics: Any) -> dict[str, float] | None:
        if metrics is None:
            return None
        if not isinstance(metrics, dict):
            raise InvalidArgumentError(f"metrics={metrics!r}: give a dict of name -> number")
        out = {}
        for k, v in metrics.items():
            try:
                out[str(k)] = float(v)
            except (TypeError, ValueError):
                raise InvalidArgumentError(
                    f"metrics[{k!r}]={v!r} is not a number; nothing was saved") from None
        return out

    def _name_for(self, step: int) -> tuple[str, Timeline]:
        """Rank 0: the new checkpoint's name (``step_<N>``; with the timeline's id where an
        abandoned checkpoint holds that name) and its timeline. Refuses (nothing written) a save
        that would not become ``latest``: one continuing the live timeline at a step not after
        the step ``latest`` names (see :meth:`_check_not_behind`)."""
        found = self.listing.list(details=False)
        pointer, head = self._head(found)
        live = [c for c in found if not c.abandoned and c.problem is None]
        usable = head if _loadable(head) else None
        timeline = self._timeline
        if timeline is None:  # saving without restore(): continue the live timeline, if any
            base = usable or (live[-1] if live else None)
            timeline = base.timeline if base is not None else Timeline(uuid.uuid4().hex[:16])
        self._check_not_behind(step, timeline, pointer, head, live)
        name = f"step_{step}"
        if self.storage.exists(posixpath.join(self.root, name)):
            name = f"step_{step}-{timeline.id[:8] or 'x'}"
        return name, timeline

    def _check_not_behind(self, step: int, timeline: Timeline, pointer: Latest | None,
                          head: CheckpointInfo | None, live: list[CheckpointInfo]) -> None:
        """Rank 0: refuse a save ``latest`` would not move to. A save continuing the live
        timeline (this manager did not restore, or restored the checkpoint ``latest`` names and
        the run has moved on since) at a step not after the step ``latest`` names would stay
        behind it: ``restore()`` would resume the other run, and retention would delete the new
        checkpoints first. A rollback (``restore(state, step=...)``) starts a new timeline,
        which moves ``latest`` whatever the step: allowed."""
        if pointer is not None:
            ref_name = pointer.name
            ref_step = head.step if _loadable(head) and head is not None else pointer.step
            # An unloadable checkpoint has no timeline to compare: only a manager that never
            # restored is taken to continue it.
            continuing = self._timeline is None or (
                _loadable(head) and head is not None and timeline.holds(head.timeline, head.step))
        elif live:  # no pointer: the live timeline ends at its newest checkpoint
            ref_name, ref_step = live[-1].name, live[-1].step
            continuing = self._timeline is None or timeline.holds(live[-1].timeline, live[-1].step)
        else:
            return
        if continuing and ref_step is not None and step <= ref_step:
            how = ("this manager did not restore(), so it would continue that run"
                   if self._timeline is None else
                   "this manager's timeline reaches it (another run has saved to this root since)")
            raise InvalidArgumentError(
                f"{self.url}: step {step} is not after step {ref_step}, the step 'latest' names "
                f"({ref_name}); {how}, and a save there would not become 'latest': restore() would "
                "resume the other checkpoints and retention would delete the new ones first. "
                "Nothing was saved. Call restore(state) first to resume that run (then save steps "
                f"after {ref_step}), restore(state, step=N) to roll back to step N on a new "
                "timeline, or give this run a new root")
        if (pointer is not None and head is not None and not _loadable(head)
                and pointer.step is not None and step < pointer.step):
            raise CorruptCheckpointError(
                f"{self.url}: 'latest' names {pointer.name} (step {pointer.step}), which cannot be "
                f"loaded ({_why(head)}); a save of step {step} would not move 'latest' past it. "
                f"Nothing was saved. Repair or remove {pointer.name} (its bytes are kept: nothing "
                f"deletes it for you), or save a step after {pointer.step}")

    def wait(self) -> Any:
        """Wait for the save in flight (raising its error), then apply retention. Returns that
        save's ``SaveResult`` (also kept in :attr:`last_result`), or None when none was in flight."""
        handle, self._handle = self._handle, None
        if handle is None:
            return None
        just_saved, self._pending_name = self._pending_name, None
        try:
            self.last_result = handle.wait() if hasattr(handle, "wait") else handle
        except BaseException as exc:
            # Not saved: the same step may be saved again (it is not "the last one saved"), and
            # the clock runs from the save before it.
            self._last_step = self._before_pending
            self.schedule.save_failed()
            if isinstance(exc, OSError):
                raise self._not_saved(exc, self._pending_step) from exc
            raise
        if self.retention is not None and self.comm.is_coordinator:
            self._retain(just_saved)
        return self.last_result

    def _not_saved(self, exc: OSError, step: int | None) -> OSError:
        """A save that failed for want of space, named with what to do: retention keeps what it
        keeps beside the new checkpoint, so the root needs room for one checkpoint more. Rank 0
        applies retention first (a policy lowered since the last save frees space now)."""
        if exc.errno not in _NO_SPACE:
            return exc
        if self.retention is None:
            advice = ("this manager keeps every checkpoint (retention=None): give it a retention "
                      "policy, free space, or save elsewhere")
        else:
            kept = ""
            if self.comm.is_coordinator:
                deleted = self._retain()
                with contextlib.suppress(CheckpointError, OSError):
                    live = [c for c in self.listing.list(details=False) if not c.abandoned]
                    kept = f" {len(live)} checkpoint(s) ({sum(c.size or 0 for c in live) / 2**20:.1f} MiB)"
                kept += f" after deleting {deleted} now" if deleted else ""
            advice = (f"retention {self.retention!r} keeps{kept or ' what it keeps'} here, and a save "
                      "needs room for one checkpoint more than retention keeps: free space, keep fewer "
                      "checkpoints, or save elsewhere")
        msg = (f"{self.url}: step {step} was not saved: {exc}. The checkpoints committed before are "
               f"intact; {advice}")
        return StorageIOError(msg, op=getattr(exc, "op", "save"), path=getattr(exc, "path", self.url),
                              errno=exc.errno)

    # -- retention -----------------------------------------------------------------------------
    def _retain(self, just_saved: str | None = None) -> int:
        """Rank 0, after a commit: delete what the policy does not keep (never a protected one,
        nor ``just_saved``, the checkpoint this save committed). A failure is logged: the
        checkpoint just saved is committed whatever happens here."""
        deleted = 0
        try:
            decisions = plan_deletions(self.listing.list(), self.retention, context=Context(now=time.time()))
        except InvalidArgumentError as exc:
            log.warning("%s: retention skipped: %s", self.url, exc)
            return deleted
        for d in decisions:
            if d.delete and d.checkpoint.name == just_saved:
                # Not the newest of the live timeline: something else moved 'latest' on (another
                # run on this root). Deleting what was just saved would lose it without a word.
                log.warning("%s: retention would delete %s, which this save just committed; kept "
                            "('latest' names another checkpoint: is another run saving to this root?)",
                            self.url, d.checkpoint.name)
            elif d.delete:
                try:
                    self._delete(d.checkpoint)
                    deleted += 1
                except Exception as exc:  # noqa: BLE001 - retention never fails a training step
                    log.warning("%s: could not delete %s: %s", self.url, d.checkpoint.name, exc)
        return deleted

    def _delete(self, c: CheckpointInfo) -> None:
        delete_on_storage(self.storage, c)  # the core's deletion: locked, re-checked, metadata first

    # -- reading ------------------------------------------------------------------------------
    def steps(self) -> list[CheckpointInfo]:
        """The root's committed checkpoints, oldest step first: step, time, size, tier,
        whether abandoned by a rollback, whether ``latest`` names it, metrics."""
        return self.listing.list()

    def latest_step(self) -> int | None:
        """The step ``latest`` names (the newest save of the live timeline), or None when
        nothing is saved. Where ``latest`` names a checkpoint that is missing or cannot be
        loaded, still its step (as the pointer records it), never an older one; an unreadable
        pointer raises :class:`CorruptCheckpointError`.

        Not collective: any rank may call it alone (to log it, say), and reads the root itself."""
        pointer = read_latest(self.storage, self.root)
        if pointer is not None:
            if not pointer_locked(self.storage, self.root):  # it may lag a racing save
                pointer, head = self._head(self.listing.list(details=False))
                if pointer is None:
                    return None
            else:
                head = self.listing.catalog.one(self.root, pointer.name, details=False)
            return head.step if _loadable(head) and head is not None else pointer.step
        live = [c for c in self.listing.list(details=False) if not c.abandoned]
        return live[-1].step if live else None

    def _head(self, found: list[CheckpointInfo]) -> tuple[Latest | None, CheckpointInfo | None]:
        """Rank 0: the ``latest`` pointer (None when there is none, or it cannot be read: the
        listing then gives every checkpoint that problem) and the checkpoint it names: its entry
        in ``found``, else what is there (uncommitted or unreadable, or None when nothing is)."""
        try:
            pointer = read_latest(self.storage, self.root)
        except (CheckpointError, OSError, ValueError, TypeError):
            return None, None
        if pointer is None:
            return None, None
        head = next((c for c in found if c.name == pointer.name), None)
        if head is None:
            head = self.listing.catalog.one(self.root, pointer.name, details=False)
        locked = pointer_locked(self.storage, self.root)
        newer = None if locked else overtaking(found, pointer.name, pointer.step)
        if newer is not None:  # two saves committed at once; the older one moved 'latest' last
            log.warning("%s: 'latest' names %s (step %s), but %s (step %s) of its timeline is committed "
                        "too; taking %s as the latest", self.url, pointer.name, pointer.step, newer.name,
                        newer.step, newer.name)
            return Latest(newer.name, newer.step), newer
        return pointer, head

    def _repair_head(self, name: str) -> bool:
        """Rank 0: what ``bcp.load`` does for the checkpoint ``latest`` names when it is not
        there: put back the one an overwrite that crashed between its two renames moved aside
        (``.<name>.replaced-<id>``). Whether it is back in place."""
        target = posixpath.join(self.root, name)
        try:
            return repair(self.storage, target) == target
        except (CheckpointError, OSError) as exc:
            log.warning("%s: could not repair %s: %s", self.url, name, exc)
            return False

    def _unloadable_head(self, pointer: Latest, head: CheckpointInfo | None,
                         found: list[CheckpointInfo]) -> CheckpointError:
        """The error naming the checkpoint ``latest`` names, why it cannot be loaded, what to do."""
        steps = [c.step for c in found if c.problem is None and c.step is not None]
        older = [s for s in steps if pointer.step is None or s < pointer.step]
        named = f"{pointer.name}" + (f" (step {pointer.step})" if pointer.step is not None else "")
        then = (f"; to resume from an older checkpoint instead, restore(state, step=N) with one of "
                f"the steps here ({', '.join(map(str, older))}): the next save then starts a new "
                "timeline from it" if older else "")
        if head is None or (not head.committed and head.problem is None):
            return NotACheckpointError(
                f"{self.url}: 'latest' names {named}, which holds no committed checkpoint (it was "
                f"deleted or moved, or its save never committed); nothing was restored{then}")
        if head.unreachable is not None:  # committed and intact: its cold tier is not mounted
            return ColdTierUnavailableError(
                f"{self.url}: 'latest' names {named}, which cannot be loaded now: {head.problem}; nothing "
                f"was restored{then}", missing=head.unreachable)
        return CorruptCheckpointError(
            f"{self.url}: 'latest' names {named}, which cannot be loaded: {_why(head)}; nothing "
            f"was restored (bcp verify {head.url} says more){then}")

    def _choose(self, step: int | None) -> tuple[str | None, int | None, Timeline]:
        """Rank 0: the checkpoint to restore and the timeline the run continues on."""
        found = self.listing.list(details=False)
        pointer, head = self._head(found)
        live = [c for c in found if not c.abandoned and c.problem is None]
        if step is None and pointer is not None:
            # Exactly the checkpoint 'latest' names, never an older one in its place.
            if not _loadable(head) and self._repair_head(pointer.name):
                found = self.listing.list(details=False)
                pointer, head = self._head(found)
                live = [c for c in found if not c.abandoned and c.problem is None]
            if pointer is not None:
                if not _loadable(head):
                    raise self._unloadable_head(pointer, head, found)
                assert head is not None
                return head.name, head.step, head.timeline  # resuming where the live timeline ends
        if step is None:
            if not live:
                if found:
                    raise NotACheckpointError(f"{self.url}: no checkpoint here can be restored ("
                                              f"{found[-1].name}: {found[-1].problem})")
                return None, None, Timeline(uuid.uuid4().hex[:16])
            pick = live[-1]  # no 'latest' pointer: the newest checkpoint
        else:
            same = [c for c in found if c.step == step and c.problem is None]
            if not same:
                have = ", ".join(str(c.step) for c in found if c.step is not None) or "none"
                raise NotACheckpointError(
                    f"{self.url} holds no committed checkpoint of step {step}; the steps it holds: {have}")
            pick = next((c for c in same if not c.abandoned), same[-1])
        # Where the live timeline ends: what 'latest' names (even a checkpoint that cannot be
        # loaded: restoring another one branches from it), else the newest live checkpoint.
        end = pointer.name if pointer is not None else (live[-1].name if live else None)
        if end is not None and pick.name == end:
            return pick.name, pick.step, pick.timeline  # resuming where the live timeline ends
        return pick.name, pick.step, pick.timeline.branch(pick.step or 0, uuid.uuid4().hex[:16])

    def restore(self, state: dict[str, Any], step: int | None = None, **load_kwargs: Any) -> int | None:
        """Load the checkpoint ``latest`` names (or the one of ``step``) into ``state``; return its
        step, or None on a fresh start (nothing saved yet: ``state`` is left as it is). Restoring
        any checkpoint but the latest starts a new timeline from it: the next save becomes
        ``latest`` even at a lower step, and the checkpoints after it are abandoned (kept).

        Where ``latest`` names a checkpoint that is missing or cannot be loaded, what
        ``bcp.load`` repairs is repaired first (an overwrite that crashed part-way); otherwise
        :class:`NotACheckpointError` or :class:`CorruptCheckpointError` names it, and nothing is
        loaded: an older checkpoint is restored only when asked for by ``step``."""
        self._check_open()
        step = check_step(step)
        self.wait()
        name, found_step, timeline = self._decide(self._choose, step)
        self._timeline = timeline
        if name is None:
            return None
        self.last_load = load(self.storage.url(posixpath.join(self.root, name)), state,
                              process_group=self.process_group, **load_kwargs)
        self._last_step = found_step
        return found_step

    # -- lifetime ------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise InvalidArgumentError(f"this CheckpointManager on {self.url} is closed")

    def close(self) -> None:
        """Finish the save in flight and retention, make the save a signal, a request or the
        clock asked for too late for the loop to act on, restore the signal handlers, free the
        root."""
        if self._closed:
            return
        # Called while an exception propagates (a with block, a finally): the state may be
        # half-updated, so this rank votes against a last save.
        failing = sys.exc_info()[0] is not None
        try:
            try:
                self.wait()
            except BaseException:
                self._save_at_close(failing=True)  # the other ranks are waiting for this vote
                raise
            self._save_at_close(failing=failing)
            self.agreement.close()
        finally:
            self._closed = True
            self._seen = None
            for handle in self._step_hooks.values():
                handle.remove()
            self._step_hooks.clear()
            self._uninstall()
            self._finalizer()

    def _save_at_close(self, failing: bool) -> None:
        """A signal, a save request or a due time came after the ranks' last agreement and the
        loop ended before the next one: every rank votes (a request may have reached one rank
        only, so every manager holds the vote), and where all can, they save the state last
        given to save() at its step (synchronously), as the agreement would have."""
        if self._stop:
            return  # a preemption save was made: nothing was asked since that the loop could act on
        seen = self._seen
        # An optimizer that stepped after the last save() call changed the state since: saved now
        # as that call's step, a resume would train a step twice. This rank votes against.
        able = not failing and seen is not None and seen[2] == self._optimizer_steps
        timeout = CLOSE_VOTE_FAILING_TIMEOUT_S if failing else CLOSE_VOTE_TIMEOUT_S
        final = self.agreement.final(able, seen[0] if seen is not None else -1, timeout)
        if final is None:
            if self.agreement.flags[STOP] or self.agreement.flags[SAVE]:
                self._no_save_at_close(STOP if self.agreement.flags[STOP] else SAVE,
                                       f"not every rank took part in close()'s vote within {timeout:.0f} s")
            return
        if not (final.stop or final.save):
            return
        asked = STOP if final.stop else SAVE
        if not final.able or seen is None:
            self._no_save_at_close(asked, "some rank ended with an error, never called save(), was at "
                                          "another step, or stepped an optimizer after its last save() call")
            return
        step, state, _ = seen
        if self._last_step is None or step > self._last_step:  # else saved (or restored) already
            self._decided = (step, Agreed(stop=final.stop, save=True))
            self.save(step, state)
            self.wait()  # a stop saves synchronously; a request's save is finished here too
            log.warning("%s: %s came after the ranks' last agreement; saved step %d at close()",
                        self.url, _ASKED[asked], step)
        self._stop = final.stop

    def _count_steps_of(self, state: dict[str, Any]) -> None:
        """Count the steps of every optimizer in ``state`` (top level, or one dict down) from
        now on, for close()'s check that the state is still the one last given to save()."""
        values = list(state.values())
        values += [v for d in values if isinstance(d, dict) for v in d.values()]
        for value in values:
            if isinstance(value, torch.optim.Optimizer) and id(value) not in self._step_hooks:
                self._step_hooks[id(value)] = value.register_step_pre_hook(self._optimizer_stepped)

    def _optimizer_stepped(self, *_: Any) -> None:
        self._optimizer_steps += 1

    def _no_save_at_close(self, asked: int, why: str) -> None:
        # The job should not count on a checkpoint that does not exist.
        log.warning("%s: %s reached the ranks after their last agreement (every %d steps), and no "
                    "%scheckpoint was saved at close(): %s. The newest checkpoint is the last one saved "
                    "before", self.url, _ASKED[asked], self.agreement.check_every,
                    "preemption " if asked == STOP else "", why)

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"CheckpointManager({self.url!r})"

