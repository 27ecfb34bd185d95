"""Hands events to the configured sink without ever blocking or raising into the caller.

An ``inline`` sink (the spool, Kafka's write-ahead spool) gets each event from the emitting
thread itself: one ``write()``, after which the event survives the process. Other sinks get
a bounded in-memory queue drained by one background thread: callers only ever
``put_nowait``, and a full queue drops the event and counts it. The same background thread
polls inline sinks (fsync in groups, ship, prune).

No sink exists until the first event: it is built then by a factory (``telemetry.config``),
so settings made after import (e.g. ``BCP_TELEMETRY_DIR`` set by the program) are honoured.

Counting: ``dropped`` counts every event that will not reach the sink: a full queue, an append
the sink refused, a span whose event could not be built, and (moved there from ``emitted`` and
``written``) events a spool had accepted into a segment file that was then deleted under it.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from telemetry.sinks.base import Sink

log = logging.getLogger("telemetry")

DEFAULT_QUEUE_SIZE = 65536
# Large enough to amortise per-write syscalls, small enough to keep write latency low.
BATCH_MAX = 1024
# After waking, the writer waits this long for a batch to build up. Without it every
# put_nowait() would hand the GIL to the writer for a one-event batch, which multiplies
# the per-span cost seen by callers. flush() and shutdown() cut the wait short.
LINGER_S = 0.05
# With nothing queued for this long the writer calls sink.poll(), so a sink can re-send
# what it spooled while its destination was down even when no new events arrive.
IDLE_POLL_S = 1.0
# Queued after inline appends so the writer thread polls the sink (ships) soon after a burst.
_POKE = object()
# At interpreter exit, how long to wait on a sink that delivers over the network (it has a
# ``delivering`` attribute: Kafka) while it is not connected. Its events are already safe in
# its write-ahead spool, and the next process on that spool sends them.
EXIT_NETWORK_WAIT_S = 0.5


class Emitter:
    def __init__(self, maxsize: int = DEFAULT_QUEUE_SIZE) -> None:
        self._maxsize = maxsize
        self._sink: Sink | None = None
        # Builds the sink on first use; returns None when telemetry turned out to be disabled.
        self._sink_factory: Callable[[], Sink | None] | None = None
        self._init_runtime()

    def _init_runtime(self) -> None:
        # Everything here is per-process: re-created from scratch in a forked child.
        self._queue: queue.Queue[Any] = queue.Queue(self._maxsize)
        self._thread: threading.Thread | None = None
        self._stop_token: object | None = None
        self._start_lock = threading.Lock()
        self._factory_lock = threading.Lock()
        self._wake = threading.Event()
        self._sink_lock = threading.Lock()
        # A plain Lock (not a Condition) keeps the producer's bookkeeping cheap.
        self._counts = threading.Lock()
        self._emitted = 0
        self._written = 0
        self._dropped = 0
        self._sink_errors = 0
        self._poked = False
        self._warned_unbuilt = False

    # -- producer side -------------------------------------------------------------

    def emit(self, event: dict[str, Any]) -> None:
        sink = self._sink
        if sink is None and self._sink_factory is not None:
            sink = self._default_sink()
            if sink is None:
                return  # telemetry is off after all
        if sink is not None and sink.inline:
            self._append(sink, event)
            return
        if self._thread is None and not self._ensure_started():
            with self._counts:
                self._dropped += 1
            return
        try:
            self._queue.put_nowait(event)
        except queue.Full:
            with self._counts:
                self._dropped += 1
            return
        with self._counts:
            self._emitted += 1

    def _append(self, sink: Sink, event: dict[str, Any]) -> None:
        try:
            sink.append(event)
        except Exception:  # noqa: BLE001 - disk full, an oversized event: counted, never raised
            with self._counts:
                self._dropped += 1
                self._sink_errors += 1
            return
        with self._counts:
            self._emitted += 1
            self._written += 1
        if not self._poked:
            # One wake-up per burst, so the writer ships soon without a per-event cost.
            self._poked = True
            if self._thread is None and not self._ensure_started():
                return
            with contextlib.suppress(queue.Full):
                self._queue.put_nowait(_POKE)

    def count_unbuilt(self, name: Any, exc: BaseException) -> None:
        """A span whose event could not be built (e.g. a field that fails to convert): dropped."""
        with self._counts:
            self._dropped += 1
            warn, self._warned_unbuilt = not self._warned_unbuilt, True
        if warn:
            with contextlib.suppress(Exception):
                log.warning(
                    "telemetry: could not build the event of span %r (%s); it is counted in "
                    "telemetry.stats()['dropped']",
                    name,
                    type(exc).__name__,
                )

    def _count_lost(self, n: int) -> None:
        # Events an inline sink had accepted (counted emitted and written) and then lost: the
        # segment file they were in was deleted before they were checked (see SegmentLog.sync).
        with self._counts:
            self._emitted -= n
            self._written -= n
            self._dropped += n

    def _adopt(self, sink: Sink | None) -> Sink | None:
        # The spool sinks keep their segment log in ``_log``; have it report losses to us.
        segment_log = getattr(sink, "_log", None)
        if segment_log is not None and hasattr(segment_log, "on_lost"):
            segment_log.on_lost = self._count_lost
        return sink

    def _default_sink(self) -> Sink | None:
        with self._factory_lock:
            if self._sink is None and self._sink_factory is not None:
                try:
                    self._sink = self._adopt(self._sink_factory())
                except Exception:  # noqa: BLE001 - a bad setting must not reach training
                    with self._counts:
                        self._sink_errors += 1
                    return None
            return self._sink

    def set_sink_factory(self, factory: Callable[[], Sink | None] | None) -> None:
        self._sink_factory = factory

    def _ensure_started(self) -> bool:
        with self._start_lock:
            if self._thread is not None:
                return True
            token = object()
            thread = threading.Thread(
                target=self._run, args=(token,), name="bcp-telemetry-writer", daemon=True
            )
            try:
                thread.start()
            except RuntimeError:
                # e.g. "can't create new thread at interpreter shutdown".
                return False
            self._thread = thread
            self._stop_token = token
            return True

    # -- writer thread -------------------------------------------------------------

    def _run(self, token: object) -> None:
        q = self._queue
        try:
            while True:
                try:
                    item = q.get(timeout=IDLE_POLL_S)
                except queue.Empty:
                    self._poll_sink()
                    continue
                if q.qsize() < BATCH_MAX and not self._wake.is_set():
                    self._wake.wait(LINGER_S)
                self._wake.clear()
                if not self._drain(q, item, token):
                    return
                if self._poked:
                    self._poked = False
                    self._poll_sink()
        finally:
            with self._start_lock:
                if self._thread is threading.current_thread():
                    self._thread = None
                    self._stop_token = None
            # Events that raced with the stop token must not be stranded.
            if not q.empty() and q is self._queue:
                self._ensure_started()

    def _drain(self, q: queue.Queue[Any], item: Any, token: object) -> bool:
        """Write everything queued right now; False once this thread's stop token shows up."""
        batch: list[dict[str, Any]] = []
        while True:
            if isinstance(item, dict):
                batch.append(item)
                if len(batch) >= BATCH_MAX:
                    self._write(batch)
                    batch = []
            elif isinstance(item, threading.Event):
                # A flush() marker: everything queued before it must be written first.
                if batch:
                    self._write(batch)
                    batch = []
                item.set()
            elif item is token:
                if batch:
                    self._write(batch)
                return False
            # Anything else is a stale stop token left behind by an earlier writer.
            try:
                item = q.get_nowait()
            except queue.Empty:
                break
        if batch:
            self._write(batch)
        return True

    def _write(self, batch: list[dict[str, Any]]) -> None:
        ok = True
        try:
            with self._sink_lock:
                sink = self._sink
                if sink is None:
                    raise RuntimeError("no telemetry sink configured")
                sink.emit(batch)
        except Exception:  # noqa: BLE001 - sinks are third-party code
            # A broken sink loses this batch but must never reach instrumented code.
            ok = False
        with self._counts:
            if ok:
                self._written += len(batch)
            else:  # every event of the batch is lost: each counts as dropped
                self._sink_errors += 1
                self._dropped += len(batch)

    def _poll_sink(self) -> None:
        try:
            with self._sink_lock:
                sink = self._sink
                if sink is not None:
                    sink.poll()
        except Exception:  # noqa: BLE001 - sinks are third-party code
            with self._counts:
                self._sink_errors += 1

    # -- control -------------------------------------------------------------------

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every event queued before the call reached the sink; False on timeout.

        Events the sink rejected count as handled (see ``sink_errors`` in stats()).
        """
        deadline = time.monotonic() + timeout
        if self._thread is not None or not self._queue.empty():
            if not self._ensure_started():
                return False
            # FIFO order: once the writer reaches the marker, everything before it is done.
            marker = threading.Event()
            try:
                self._queue.put(marker, timeout=timeout)
            except queue.Full:
                return False
            self._wake.set()
            if not marker.wait(max(0.0, deadline - time.monotonic())):
                return False
        return self._flush_sink(deadline)

    def _flush_sink(self, deadline: float) -> bool:
        return self._call_sink("flush", deadline)

    def _call_sink(self, method: str, deadline: float) -> bool:
        """Call ``sink.flush``/``sink.close`` under the sink lock; count, never raise, failures."""
        if not self._sink_lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            return False
        try:
            if self._sink is not None:
                getattr(self._sink, method)()
        except Exception:  # noqa: BLE001 - sink failures are counted, never raised
            with self._counts:
                self._sink_errors += 1
            return False
        finally:
            self._sink_lock.release()
        return True

    def shutdown(self, timeout: float = 5.0) -> bool:
        """Flush, stop the writer thread and close the sink. Later events restart it."""
        deadline = time.monotonic() + timeout
        ok = self.flush(timeout)
        with self._start_lock:
            thread, token = self._thread, self._stop_token
        if thread is not None and thread.is_alive():
            try:
                self._queue.put(token, timeout=max(0.0, deadline - time.monotonic()))
            except queue.Full:
                ok = False
            self._wake.set()
            thread.join(max(0.0, deadline - time.monotonic()))
            ok = ok and not thread.is_alive()
        return self._call_sink("close", deadline) and ok

    def set_sink(self, sink: Sink | None, timeout: float = 5.0) -> None:
        """Drain queued events into the current sink, then switch and close the old one.

        None leaves the next event to build a sink with the factory."""
        deadline = time.monotonic() + timeout
        self._adopt(sink)
        self.flush(timeout)
        if not self._sink_lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            # The old sink is stuck inside emit(): switch anyway, but closing it under
            # the writer's feet is unsafe, so leave it to the garbage collector.
            self._sink = sink
            return
        try:
            old, self._sink = self._sink, sink
        finally:
            self._sink_lock.release()
        if old is not None and old is not sink:
            try:
                old.flush()
                old.close()
            except Exception:  # noqa: BLE001 - sink failures are counted, never raised
                with self._counts:
                    self._sink_errors += 1

    def get_sink(self) -> Sink | None:
        return self._sink

    def set_queue_size(self, maxsize: int) -> None:
        if maxsize <= 0:
            raise ValueError("queue size must be positive")
        self._maxsize = maxsize
        q = self._queue
        # Resizing in place avoids swapping queues under concurrent producers.
        with q.mutex:
            q.maxsize = maxsize
            q.not_full.notify_all()

    def stats(self) -> dict[str, int]:
        with self._counts:
            out = {
                "emitted": self._emitted,
                "written": self._written,
                "dropped": self._dropped,
                "sink_errors": self._sink_errors,
                "queue_size": self._queue.qsize(),
            }
        sink = self._sink
        if sink is not None:
            try:
                # Sink counters (e.g. spooled, resent, sink_dropped) read without the sink lock:
                # they are plain ints, and stats() must not wait behind a slow send.
                out.update({f"sink_{key}": int(value) for key, value in sink.stats().items()})
            except Exception:  # noqa: BLE001 - sinks are third-party code
                pass
        return out

    def _after_fork_in_child(self) -> None:
        # The parent's writer thread does not exist here and its locks may be held;
        # queued parent events would be written twice. Start over, lazily.
        self._init_runtime()


EMITTER = Emitter()


def emit(event: dict[str, Any]) -> None:
    """Queue one event without blocking; dropped (and counted) when the queue is full."""
    EMITTER.emit(event)


def flush(timeout: float = 5.0) -> bool:
    """Wait until everything queued so far is written (or ``timeout``); True on success."""
    return EMITTER.flush(timeout)


def shutdown(timeout: float = 5.0) -> bool:
    """Flush, stop the background writer and close the sink."""
    return EMITTER.shutdown(timeout)


def stats() -> dict[str, int]:
    """Counters for this process: emitted, written, dropped, sink_errors, queue_size, and the
    sink's own counters prefixed ``sink_`` (the Kafka sink: sink_sent, sink_spooled, sink_resent,
    sink_dropped, sink_pending_bytes)."""
    return EMITTER.stats()


def _quiet_shutdown(timeout: float) -> None:
    with contextlib.suppress(Exception):
        EMITTER.shutdown(timeout)


def _shutdown_at_exit(timeout: float = 5.0) -> None:
    """Flush and close at interpreter exit, waiting on the network only while it answers.

    A sink that delivers over the network through a write-ahead spool (inline, with a
    ``delivering`` attribute: Kafka) has every accepted event on disk already. Its shutdown
    runs in a helper thread: exit waits for it up to EXIT_NETWORK_WAIT_S, and up to
    ``timeout`` only while the sink is connected and sending. A broker that is down or never
    answers therefore delays exit by at most EXIT_NETWORK_WAIT_S; the next process on the spool
    directory sends what is left. Other sinks get the full ``timeout`` as before.
    """
    # Nothing useful can be done about a failure this late; never spoil interpreter exit.
    with contextlib.suppress(Exception):
        sink = EMITTER.get_sink()
        if sink is None or not sink.inline or not hasattr(sink, "delivering"):
            EMITTER.shutdown(timeout)
            return
        deadline = time.monotonic() + timeout
        helper = threading.Thread(
            target=_quiet_shutdown, args=(timeout,), name="bcp-telemetry-exit", daemon=True
        )
        try:
            helper.start()
        except RuntimeError:
            # No threads this late: bound what can be bounded (the sink's close may still connect).
            EMITTER.shutdown(EXIT_NETWORK_WAIT_S)
            return
        helper.join(EXIT_NETWORK_WAIT_S)
        while helper.is_alive() and sink.delivering:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            helper.join(min(0.05, left))
        if helper.is_alive():
            log.warning(
                "telemetry: not waiting for %s to deliver at exit; the events stay in its spool %s, "
                "and the next process using that spool directory sends them",
                type(sink).__name__,
                getattr(sink, "pending_dir", ""),
            )


atexit.register(_shutdown_at_exit)

if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=EMITTER._after_fork_in_child)
